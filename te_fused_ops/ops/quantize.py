"""Quantize: cast to a low-precision recipe; straight-through backward."""

import dataclasses

import torch

from ..errors import OpTypeError, bool_argument
from ..quantization import QuantizedTensor, fake_quantize, get_recipe, high_precision_wgrad, quantize
from ..splits import bind_offsets
from .base import BasicOp, OpContext


class Quantize(BasicOp):
    """Cast the input to ``recipe`` (a `te_fused_ops.quantization.Recipe` or its name).

    Output: a `QuantizedTensor` with row-wise data and scales (``dequantize()`` gives the values,
    without a gradient; torch ops on the output itself, e.g. ``y * 1``, and the ops after it in a
    `Sequential` keep the straight-through gradient).
    With ``recipe.high_precision_wgrad`` the output keeps the input as its ``source`` for the
    16-bit weight gradient of the GroupedLinear after it.
    Backward: straight-through; with ``quantize_grad=True`` the gradient is quantized with the
    same recipe and dequantized (what an FP8 backward GEMM would see).
    Optional side input ``split_sizes`` (G,): rows past their sum are padding and never affect
    the scales (per-tensor amax over grouped rows only); given automatically inside a Sequential
    whose GroupedLinear consumes it.
    """

    side_inputs = ("split_sizes",)
    format_role = "quantize"
    optional_side_inputs = ("split_sizes",)

    def __init__(self, recipe, quantize_grad: bool = False):
        super().__init__()
        self.recipe = get_recipe(recipe)
        self.quantize_grad = bool_argument("Quantize", "quantize_grad", quantize_grad)

    def extra_repr(self) -> str:
        changed = [f"{field.name}={getattr(self.recipe, field.name)!r}" for field in dataclasses.fields(self.recipe)
                   if getattr(self.recipe, field.name) != field.default] if dataclasses.is_dataclass(self.recipe) else []
        options = f"({', '.join(changed)})" if changed else ""
        return f"recipe={self.recipe.name}{options}, quantize_grad={self.quantize_grad}"

    def plan_signature(self) -> tuple:
        return (Quantize, self.recipe, self.quantize_grad)

    def output_recipe(self, input_recipe):
        return self.recipe

    def bind_side_inputs(self, side: dict, x: torch.Tensor, memo: dict) -> dict:
        if side.get("split_sizes") is None:
            return {"offsets": None}
        return {"offsets": bind_offsets("Quantize", side, x, memo)}

    def op_forward(self, ctx: OpContext, x):
        if isinstance(x, QuantizedTensor):
            x = x.dequantize()
        if not isinstance(x, torch.Tensor):
            raise OpTypeError(f"Quantize: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
        made = quantize(x, self.recipe, rowwise=True, offsets=ctx.side["offsets"])
        if high_precision_wgrad(self.recipe):
            made.source = x.detach()
        return made

    def grad(self, dy, offsets=None):
        """The straight-through gradient, quantized if ``quantize_grad`` (padding rows past
        ``offsets[-1]`` excluded from the scales)."""
        if not self.quantize_grad or isinstance(dy, QuantizedTensor):
            return dy
        return fake_quantize(dy, self.recipe, offsets=offsets)

    def op_backward(self, ctx: OpContext, dy):
        return self.grad(dy, ctx.side["offsets"]), {}
