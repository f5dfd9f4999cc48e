"""Errors an op raises for bad input (shape, dtype, device, split values).

A fused step raises them unchanged (type and message), as the op on its own would; only an
error inside a rule's own code is wrapped in `te_fused_ops.FusionRuleError`. Each is also the
builtin error it names, so ``except ValueError`` / ``except TypeError`` catch them.
"""

import numbers


class OpInputError(Exception):
    """Base of the bad-input errors of the ops."""


class OpValueError(OpInputError, ValueError):
    pass


class OpTypeError(OpInputError, TypeError):
    pass


def real_argument(op_name: str, arg: str, value) -> float:
    """``value`` as a float; `OpTypeError` naming the op and argument for a bool or a non-number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise OpTypeError(f"{op_name}: argument '{arg}' must be a real number, got {value!r}")
    return float(value)


def int_argument(op_name: str, arg: str, value, low: int = 1) -> int:
    """``value`` as an int >= ``low`` (any integral number: a numpy int as well); `OpValueError`
    naming the op and argument for a bool, a non-integer or a smaller value."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        wanted = "a positive int" if low == 1 else f"an int >= {low}"
        raise OpValueError(f"{op_name}: argument '{arg}' must be {wanted}, got {value!r}")
    return int(value)


def bool_argument(op_name: str, arg: str, value) -> bool:
    """``value`` as a bool (a Python or numpy bool); `OpTypeError` naming the op and argument for
    anything else (a string "false" or a 0/1 would otherwise read as a choice)."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and str(getattr(value, "dtype", "")) == "bool" and value.shape == ():
        return bool(value)
    raise OpTypeError(f"{op_name}: argument '{arg}' must be a bool, got {value!r}")


def floating_dtype_argument(op_name: str, dtype):
    """``dtype`` (None: torch's default) if it makes floating parameters; `OpTypeError` otherwise."""
    import torch

    if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
        raise OpTypeError(f"{op_name}: argument 'dtype' must be a floating torch.dtype, got {dtype!r}")
    return dtype
