"""Errors an op raises for bad input (shape, dtype, device, split values).

A fused step raises them unchanged (type and message), as the op on its own would; only an
error inside a rule's own code is wrapped in `te_fused_ops.FusionRuleError`. Each is also the
builtin error it names, so ``except ValueError`` / ``except TypeError`` catch them.
"""


class OpInputError(Exception):
    """Base of the bad-input errors of the ops."""


class OpValueError(OpInputError, ValueError):
    pass


class OpTypeError(OpInputError, TypeError):
    pass
