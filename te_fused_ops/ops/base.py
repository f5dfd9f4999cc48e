"""Basic op interface and the per-op context shared by unfused ops and fused rules."""

import itertools
import weakref

import torch
from torch import nn

from ..quantization import QuantizedTensor, current_reuse_scope

_owners: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
_uids = itertools.count()


def register_owner(module: nn.Module) -> int:
    """A new id for ``module`` (a Sequential or a BasicOp); torch.compile finds it by that id."""
    uid = next(_uids)
    _owners[uid] = module
    return uid


def registered_owner(uid: int) -> nn.Module:
    """The module registered as ``uid``."""
    return _owners[uid]


class Recompute:
    """Stands in for a saved tensor that can be recomputed in the backward as ``fn(*args)``.

    ``args`` may hold tensors (saved through autograd like any other saved value) and other
    `Recompute`s (called first); ``fn`` must not capture tensors itself (a bound method of the
    op, a module-level function).
    """

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self):
        return self.fn(*(arg() if isinstance(arg, Recompute) else arg for arg in self.args))


class OpContext:
    """What one op's forward leaves for its backward, whichever step (op or rule) ran it.

    params:               the op's parameters as this call sees them (``getattr`` at call time,
                          so parametrizations, ``functional_call`` and FSDP2 unsharding apply);
                          forward only, never kept for the backward
    grad_names:           parameter and side-input names whose tensors require grad
    side:                 bound side inputs (e.g. ``offsets`` for grouped ops, ``probs``)
    saved:                values for the backward, by name (tensors, QuantizedTensors,
                          `Recompute`s, plain Python values); tensors reach the backward
                          through ``ctx.save_for_backward`` of the Sequential's autograd.Function
    recompute_output:     set by a fused forward that did not keep this op's output alive: a
                          `Recompute` giving the output again (the consumer saves it lazily)
    main_grads:           parameter name -> fp32 buffer the backward accumulates that gradient
                          into instead of returning it (an output, so not a saved tensor)
    forward_rule:         name of the fusion rule whose forward ran this op, or None (error hints)
    reuse_scope:          the `reuse_quantized_weights` scope open when the forward ran (or None):
                          both passes make or reuse weight copies in it
    """

    def __init__(self, op, index: int, input_requires_grad: bool, params_require_grad: bool):
        self.op = op
        self.index = index
        self.input_requires_grad = input_requires_grad
        self.params_require_grad = params_require_grad
        self.params: dict = {}
        self.grad_names: frozenset = frozenset()
        self.side: dict = {}
        self.saved: dict = {}
        self.recompute_output = None
        self.input_recompute = None
        self.main_grads: dict = {}
        self.forward_rule = None
        self.reuse_scope = current_reuse_scope()

    def save_input(self, x) -> None:
        """Keep the op's input for the backward, lazily when its producer can recompute it."""
        self.saved["input"] = self.input_recompute if self.input_recompute is not None else x

    def load_input(self):
        value = self.saved["input"]
        return value() if isinstance(value, Recompute) else value

    def needs_grad(self, name: str) -> bool:
        """Whether parameter or side input ``name`` required grad when the forward ran."""
        return name in self.grad_names


class BasicOp(nn.Module):
    """A fusible op. Subclasses implement `op_forward` / `op_backward` and may declare side inputs.

    ``side_inputs``: names of keyword inputs the op consumes (``split_sizes``, ``probs``);
    ``optional_side_inputs``: those of them a call may leave out.
    ``param_names``: attributes holding the op's parameters (None entries are skipped); each
    call reads them once and the op's forward and backward use only what it read (``ctx.params``).
    """

    side_inputs: tuple = ()
    optional_side_inputs: tuple = ()
    param_names: tuple = ()

    def __init__(self):
        super().__init__()
        self._plans: dict = {}
        self._owner_id = register_owner(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._owner_id = register_owner(self)  # a copy is another owner

    @property
    def op_name(self) -> str:
        """The op's class name; a class torch makes around it (``fully_shard`` turns
        ``GroupedLinear`` into ``FSDPGroupedLinear``) is skipped."""
        for cls in type(self).__mro__:
            if not cls.__module__.startswith("torch."):
                return cls.__name__
        return type(self).__name__

    def plan_signature(self) -> tuple:
        """Configuration that changes which rules apply (part of the plan cache key)."""
        return (type(self),)

    def output_recipe(self, input_recipe):
        """The Recipe of the output if it is a QuantizedTensor, else None, given the input's
        (plan time)."""
        return None

    def call_params(self) -> dict:
        """name -> parameter tensor as this call sees it (read once per call)."""
        params = {}
        for name in self.param_names:
            value = getattr(self, name)
            if value is not None:
                params[name] = value
        return params

    def bind_side_inputs(self, side: dict, x: torch.Tensor, memo: dict) -> dict:
        """Check this op's side inputs against the sequence input ``x``; return what ctx.side holds."""
        return {name: side[name] for name in self.side_inputs if name in side}

    def op_forward(self, ctx: OpContext, x):
        raise NotImplementedError

    def op_backward(self, ctx: OpContext, dy) -> tuple:
        """Return ``(dx or None, grads)``; grads maps parameter / side-input names to gradients."""
        raise NotImplementedError

    def forward(self, x, **side):
        from ..sequential import run_ops

        return run_ops(self, [self], x, side, self._plans, fuse=True)

    def extra_repr(self) -> str:
        return ""


def is_quantized(x) -> bool:
    return isinstance(x, QuantizedTensor)
