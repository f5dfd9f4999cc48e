"""Basic op interface and the per-op context shared by unfused ops and fused rules."""

import torch
from torch import nn


class _Recompute:
    """Stands in for a saved tensor that its producer can recompute in the backward."""

    def __init__(self, fn):
        self.fn = fn


class OpContext:
    """What one op's forward leaves for its backward, whichever step (op or rule) ran it.

    side:                 bound side inputs (e.g. ``offsets`` for grouped ops, ``probs``)
    saved:                tensors for the backward, by name
    recompute_output:     set by a fused forward that did not keep this op's output alive; a
                          callable giving the output again (the consumer saves it lazily)
    """

    def __init__(self, op, index: int, input_requires_grad: bool, params_require_grad: bool):
        self.op = op
        self.index = index
        self.input_requires_grad = input_requires_grad
        self.params_require_grad = params_require_grad
        self.side: dict = {}
        self.saved: dict = {}
        self.recompute_output = None
        self.input_recompute = None

    def save_input(self, x) -> None:
        """Keep the op's input for the backward, lazily when its producer can recompute it."""
        self.saved["input"] = _Recompute(self.input_recompute) if self.input_recompute is not None else x

    def load_input(self):
        value = self.saved["input"]
        return value.fn() if isinstance(value, _Recompute) else value


class BasicOp(nn.Module):
    """A fusible op. Subclasses implement `op_forward` / `op_backward` and may declare side inputs.

    ``side_inputs``: names of keyword inputs the op consumes (``split_sizes``, ``probs``).
    """

    side_inputs: tuple = ()

    def __init__(self):
        super().__init__()
        self._plans: dict = {}

    @property
    def op_name(self) -> str:
        return type(self).__name__

    def plan_signature(self) -> tuple:
        """Configuration that changes which rules apply (part of the plan cache key)."""
        return (type(self),)

    def output_quantized(self, input_quantized: bool) -> bool:
        """Whether the output is a QuantizedTensor given whether the input is (plan time)."""
        return False

    def bind_side_inputs(self, side: dict, x: torch.Tensor, memo: dict) -> dict:
        """Check this op's side inputs against the sequence input ``x``; return what ctx.side holds."""
        return {name: side[name] for name in self.side_inputs}

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
    from ..quantization import QuantizedTensor

    return isinstance(x, QuantizedTensor)

