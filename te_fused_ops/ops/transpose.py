"""Transpose: value identity that adds the per-group transposed (column-wise) copy."""

import torch

from ..errors import OpTypeError, OpValueError
from ..quantization import QuantizedTensor, add_columnwise, high_precision_wgrad
from ..splits import bind_offsets
from .base import BasicOp, OpContext


def with_columnwise(x: torch.Tensor, offsets: torch.Tensor):
    """``x`` (M, K) with its per-group column-wise copy: column-wise quantized for a quantized
    input (none where its recipe runs the weight gradient in 16 bits: that reads ``x.source``);
    for a plain tensor ``x.T`` contiguous (K, M) as attribute ``te_columnwise`` (group g owns
    columns offsets[g]:offsets[g+1])."""
    if isinstance(x, QuantizedTensor):
        return x if high_precision_wgrad(x.recipe) else add_columnwise(x, offsets)
    y = x.view_as(x)
    y.te_columnwise = x.t().contiguous()
    return y


class Transpose(BasicOp):
    """Makes the column-wise layout the next GroupedLinear's weight-gradient GEMM needs.

    Side input ``split_sizes`` (G,) int: column-wise scale blocks never straddle a group.
    """

    side_inputs = ("split_sizes",)
    format_role = "transpose"

    def bind_side_inputs(self, side: dict, x: torch.Tensor, memo: dict) -> dict:
        return {"offsets": bind_offsets("Transpose", side, x, memo)}

    def output_recipe(self, input_recipe):
        return input_recipe

    def op_forward(self, ctx: OpContext, x):
        if not isinstance(x, torch.Tensor):
            raise OpTypeError(f"Transpose: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2:
            raise OpValueError(f"Transpose: argument 'x' must be 2-D (tokens, features), got shape {tuple(x.shape)}")
        return with_columnwise(x, ctx.side["offsets"])

    def op_backward(self, ctx: OpContext, dy):
        return dy, {}
