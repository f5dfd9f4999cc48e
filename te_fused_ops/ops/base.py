"""The basic op interface (`BasicOp`); the per-op context lives in `te_fused_ops.context`."""

import torch
from torch import nn

from ..call import run_ops
from ..context import OpContext, PlanOwner, Recompute
from ..quantization import is_quantized

__all__ = ["BasicOp", "OpContext", "Recompute", "is_quantized"]


class BasicOp(PlanOwner, nn.Module):
    """A fusible op. Subclasses implement `op_forward` / `op_backward` and may declare side inputs.

    ``side_inputs``: names of keyword inputs the op consumes (``split_sizes``, ``probs``);
    ``optional_side_inputs``: those of them a call may leave out.
    ``side_outputs``: names of side values the op produces for the ops after it (in
    ``ctx.produced``, set by `bind_side_inputs`' caller from `bound_side_outputs` or by the
    forward); ``grad_side_outputs``: those of them that take a gradient (the backward finds it
    in ``ctx.produced_grads``); ``side_outputs_end``: side output -> another of them whose first
    consumer ends it (the rows it describes are gone after that op).
    ``param_names``: attributes holding the op's parameters and the buffers it computes with (a
    router's ``expert_bias``; None entries are skipped); each call reads them once and the op's
    forward and backward use only what it read (``ctx.params``).
    """

    side_inputs: tuple = ()
    format_role = None  # "quantize" / "transpose": the planner may fold the op into a step as a format
    optional_side_inputs: tuple = ()
    side_outputs: tuple = ()
    grad_side_outputs: tuple = ()
    side_outputs_end: dict = {}
    param_names: tuple = ()
    expert_params: tuple = ()  # parameters whose first dimension indexes the op's experts (groups)
    float32_params: tuple = ()  # parameters or buffers kept in float32 by module casts, loads and autocast
    param_shapes: dict = {}  # name -> the shape it must have, checked at every call (set by __init__; read only)
    chunks = 1  # > 1: the op opens a chunked segment (te_fused_ops.overlap) ...
    closes_chunks = False  # ... which the next op with closes_chunks ends

    def __init__(self):
        super().__init__()
        self._init_plan_owner()

    def _apply(self, fn, recurse=True):
        """`nn.Module._apply` (``to()``, ``half()``, ...), except that ``float32_params`` stay
        float32: moved with the module, never rounded to its dtype (and made float32 again where a
        load left another dtype)."""
        kept = {name: getattr(self, name).data for name in self.float32_params if getattr(self, name) is not None}
        module = super()._apply(fn, recurse)
        for name, values in kept.items():
            tensor = getattr(self, name)
            if tensor.dtype != torch.float32:
                tensor.data = values.to(tensor.device, torch.float32)
        return module

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """`nn.Module._load_from_state_dict`; ``float32_params`` stay float32 (``assign=True`` would
        take a checkpoint's 16-bit tensor as it is)."""
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        for name in self.float32_params:
            tensor = getattr(self, name)
            if tensor is not None and tensor.is_floating_point() and tensor.dtype != torch.float32:
                tensor.data = tensor.data.float()

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

    def grad_kept_elsewhere(self, name: str) -> bool:
        """Whether the backward leaves parameter ``name``'s gradient out on purpose (added to a
        buffer of the caller's instead), so no gradient for it is no rule's mistake."""
        return False

    def compile_unsupported_reason(self):
        """What in this op's configuration torch.compile cannot trace (a phrase), or None."""
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
        """Check this op's side inputs against ``x``, a tensor shaped as the op's input (rows,
        features; it may hold no data); return what ctx.side holds. ``side``: every side value
        visible here by name; ``memo``: binding state shared by the ops of one call."""
        return {name: side[name] for name in self.side_inputs if name in side}

    def side_value_experts(self, name: str):
        """How many experts side value ``name``, produced or consumed by this op, spans where the
        op's configuration fixes it (a permute's ``split_sizes``: its local experts; a router's
        ``indices``: ids below its num_experts), else None. A plan is made only where each
        producer and its consumers agree."""
        return None

    def bound_side_outputs(self, ctx: OpContext) -> dict:
        """The side values this op produces once bound (before its forward runs), by name."""
        return {}

    def output_like(self, ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
        """A tensor shaped as this op's output rows (for binding the ops after it in the same step),
        given one shaped as its input: ``x`` unless the op changes the number of rows."""
        return x

    def op_forward(self, ctx: OpContext, x):
        raise NotImplementedError

    def op_backward(self, ctx: OpContext, dy) -> tuple:
        """Return ``(dx or None, grads)``; grads maps parameter / side-input names to gradients."""
        raise NotImplementedError

    def forward(self, x, **side):
        return run_ops(self, [self], x, side, self._plans, fuse=True)

    def extra_repr(self) -> str:
        return ""

