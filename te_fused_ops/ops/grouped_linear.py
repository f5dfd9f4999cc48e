"""GroupedLinear: rows of group g get ``y = x @ W[g].T (+ b[g])``."""

import math

import torch
from torch import nn

from ..grouped_mm import grouped_mm_nn, grouped_mm_nt, grouped_row_sum, grouped_wgrad
from ..splits import bind_offsets, row_group_ids
from .base import BasicOp, OpContext, is_quantized


def columnwise_view(x) -> torch.Tensor:
    """(M, K) values of ``x`` for a weight-gradient GEMM, from its column-wise copy when it has one."""
    if is_quantized(x):
        return x.dequantize_columnwise().t() if x.has_columnwise else x.dequantize()
    columnwise = getattr(x, "te_columnwise", None)
    return columnwise.t() if columnwise is not None else x


class GroupedLinear(BasicOp):
    """Grouped linear layer over contiguous row groups.

    weight: (G, out_features, in_features), natural layout (also in state_dict); bias: (G, out_features).
    Input x: (M, in_features), rows grouped by the side input ``split_sizes`` (G,) int tensor on
    x's device; rows past ``sum(split_sizes)`` give zero output and zero gradient.
    A quantized input (`te_fused_ops.quantization.QuantizedTensor`) computes in its format: the
    weight is quantized with the same recipe (cached per weight version).
    """

    side_inputs = ("split_sizes",)

    def __init__(self, num_groups: int, in_features: int, out_features: int, bias: bool = False, dtype=None, device=None):
        super().__init__()
        for arg, value in (("num_groups", num_groups), ("in_features", in_features), ("out_features", out_features)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"GroupedLinear: argument '{arg}' must be a positive int, got {value!r}")
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        factory = {"dtype": dtype, "device": device}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory)) if bias else None
        self._param_cache: dict = {}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Per group, as ``nn.Linear``: kaiming-uniform weight, bias uniform in ±1/sqrt(in_features)."""
        with torch.no_grad():
            for g in range(self.num_groups):
                nn.init.kaiming_uniform_(self.weight[g], a=math.sqrt(5))
            if self.bias is not None:
                bound = 1.0 / math.sqrt(self.in_features)
                nn.init.uniform_(self.bias, -bound, bound)

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
        )

    def plan_signature(self) -> tuple:
        return (GroupedLinear, self.num_groups, self.in_features, self.out_features, self.bias is not None)

    def bind_side_inputs(self, side: dict, x: torch.Tensor, memo: dict) -> dict:
        return {"offsets": bind_offsets("GroupedLinear", side, x, memo, self.num_groups)}

    def cached_param(self, kind, make, name: str = "weight"):
        """``make(param)`` computed once per version of parameter ``name`` (repacks, quantized copies)."""
        param = getattr(self, name)
        key = (param.data_ptr(), param._version, param.dtype, param.device)
        hit = self._param_cache.get(kind)
        if hit is None or hit[0] != key:
            with torch.no_grad():
                hit = self._param_cache[kind] = (key, make(param.detach()))
        return hit[1]

    def check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"GroupedLinear: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"GroupedLinear: argument 'x' must have shape (tokens, {self.in_features}) (in_features), "
                f"got {tuple(x.shape)}"
            )
        if x.dtype != self.weight.dtype:
            raise TypeError(f"GroupedLinear: argument 'x' has dtype {x.dtype} but the weight has {self.weight.dtype}")

    def compute_weight(self, recipe=None) -> torch.Tensor:
        """The weight as the GEMM sees it: quantized with ``recipe`` and dequantized (cached), if given."""
        if recipe is None:
            return self.weight
        from ..quantization import quantize_weight

        return self.cached_param(("dequantized", recipe), lambda w: quantize_weight(w, recipe).dequantize())

    def add_bias(self, y: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """y (M, N) += bias of each row's group; padding rows stay zero."""
        if self.bias is None:
            return y
        bias_rows = torch.cat([self.bias, self.bias.new_zeros(1, self.out_features)])
        return y + bias_rows[row_group_ids(offsets, y.shape[0])]

    def op_forward(self, ctx: OpContext, x) -> torch.Tensor:
        self.check_input(x)
        offsets = ctx.side["offsets"]
        x_values = x.dequantize() if is_quantized(x) else x
        recipe = x.recipe if is_quantized(x) else None
        y = self.add_bias(grouped_mm_nt(x_values, self.compute_weight(recipe), offsets), offsets)
        if self.weight.requires_grad:
            ctx.save_input(x)
        ctx.saved["recipe"] = recipe
        return y

    def grad_operands(self, ctx: OpContext, dy):
        """(dy for the data gradient, dy for the weight gradient), both (M, N) plain tensors.

        With a quantized input the gradient is quantized with the same recipe, row-wise for the
        data gradient and per-group column-wise for the weight gradient (unless ``dy`` already is).
        """
        if is_quantized(dy):
            return dy.dequantize(), columnwise_view(dy)
        if ctx.saved["recipe"] is None:
            return dy, dy
        from ..quantization import quantize

        dyq = quantize(dy, ctx.saved["recipe"], rowwise=True, columnwise=self.weight.requires_grad, offsets=ctx.side["offsets"])
        return dyq.dequantize(), columnwise_view(dyq)

    def op_backward(self, ctx: OpContext, dy):
        offsets = ctx.side["offsets"]
        dy_data, dy_wgrad = self.grad_operands(ctx, dy)
        grads = {}
        dx = None
        if ctx.input_requires_grad:
            dx = grouped_mm_nn(dy_data, self.compute_weight(ctx.saved["recipe"]).detach(), offsets)
        if self.weight.requires_grad:
            x = ctx.load_input()
            grads["weight"] = grouped_wgrad(dy_wgrad, columnwise_view(x), offsets)
        if self.bias is not None and self.bias.requires_grad:
            grads["bias"] = grouped_row_sum(dy_data, offsets)
        return dx, grads

