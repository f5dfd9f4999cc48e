"""GroupedLinear: rows of group g get ``y = x @ W[g].T (+ b[g])``."""

import math

import torch
from torch import nn

from ..errors import OpTypeError, OpValueError, bool_argument, floating_dtype_argument, int_argument
from ..grouped_mm import grouped_mm_nn, grouped_mm_nt, grouped_row_sum, grouped_wgrad
from ..quantization import high_precision_wgrad, quantize, quantized_weight_values, wgrad_source
from ..splits import bind_offsets, row_group_ids
from .base import BasicOp, OpContext, Recompute, is_quantized


def _main_grad(weight: torch.Tensor) -> torch.Tensor:
    main_grad = getattr(weight, "main_grad", None)
    if not isinstance(main_grad, torch.Tensor) or main_grad.dtype != torch.float32 or main_grad.shape != weight.shape:
        raise OpValueError(
            "GroupedLinear: accumulate_main_grad=True needs weight.main_grad, a float32 tensor of shape "
            f"{tuple(weight.shape)} on {weight.device}; got {main_grad!r:.80}"
        )
    if main_grad.device != weight.device or not main_grad.is_contiguous():
        raise OpValueError("GroupedLinear: argument 'weight.main_grad' must be contiguous and on the weight's device")
    return main_grad


def gemm_weight(weight: torch.Tensor, recipe, reuse_scope, dgrad: bool = False) -> torch.Tensor:
    """The weight as the GEMM sees it: itself, or quantized with ``recipe`` and dequantized
    (reused while the op context's ``reuse_scope`` is open); ``dgrad``: as the data gradient's
    GEMM reads it (`quantized_weight_values`)."""
    if recipe is None:
        return weight
    return quantized_weight_values(weight, recipe, reuse_scope, dgrad)


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
    ``accumulate_main_grad=True`` (Megatron's gradient-accumulation fusion): the weight gradient
    is added in float32 to ``weight.main_grad`` (a float32 tensor of the weight's shape that the
    caller owns and zeroes) and ``weight.grad`` stays None. As in Transformer Engine, it is added in
    every backward that reaches the op, ``torch.autograd.grad(loss, x)`` and
    ``backward(inputs=[x])`` too (a leaf's ``.grad`` would be left alone there).
    A quantized input (`te_fused_ops.quantization.QuantizedTensor`) computes in its format: the
    weight is quantized with the same recipe on every call (see `reuse_quantized_weights`).
    ``recompute_output=True`` (bf16/fp16 input): the op's output is not kept for the backward of
    the op that consumes it (an activation's pre-activation); that backward reruns this GEMM from
    the input and weight, which the gradients keep anyway. One (M, out_features) tensor less per
    layer for one extra GEMM, where checkpointing the whole MLP reruns its whole forward.
    """

    side_inputs = ("split_sizes",)
    param_names = ("weight", "bias")
    expert_params = ("weight", "bias")

    def __init__(
        self,
        num_groups: int,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype=None,
        device=None,
        accumulate_main_grad: bool = False,
        recompute_output: bool = False,
    ):
        super().__init__()
        num_groups, in_features, out_features = (int_argument("GroupedLinear", arg, value) for arg, value in (
            ("num_groups", num_groups), ("in_features", in_features), ("out_features", out_features)))
        self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
        self.param_shapes = {"weight": (num_groups, out_features, in_features), "bias": (num_groups, out_features)}
        factory = {"dtype": floating_dtype_argument("GroupedLinear", dtype), "device": device}
        self.weight = nn.Parameter(torch.empty(num_groups, out_features, in_features, **factory))
        has_bias = bool_argument("GroupedLinear", "bias", bias)
        self.bias = nn.Parameter(torch.empty(num_groups, out_features, **factory)) if has_bias else None
        self.accumulate_main_grad = bool_argument("GroupedLinear", "accumulate_main_grad", accumulate_main_grad)
        self.recompute_output = bool_argument("GroupedLinear", "recompute_output", recompute_output)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Per group, as ``nn.Linear``: kaiming-uniform weight, bias uniform in ±1/sqrt(in_features)."""
        with torch.no_grad():
            for g in range(self.num_groups):
                nn.init.kaiming_uniform_(self.weight[g], a=math.sqrt(5))
            if self.bias is not None:
                bound = 1.0 / math.sqrt(self.in_features)
                nn.init.uniform_(self.bias, -bound, bound)

    def grad_kept_elsewhere(self, name: str) -> bool:
        return self.accumulate_main_grad and name == "weight"  # added to weight.main_grad

    def extra_repr(self) -> str:
        return (
            f"num_groups={self.num_groups}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.bias is not None}"
            + (", recompute_output=True" if self.recompute_output else "")
            + (", accumulate_main_grad=True" if self.accumulate_main_grad else "")
        )

    def plan_signature(self) -> tuple:
        return (GroupedLinear, self.num_groups, self.in_features, self.out_features, self.bias is not None,
                self.recompute_output, self.accumulate_main_grad)

    def side_value_experts(self, name: str):
        return self.num_groups if name == "split_sizes" else None

    def bind_side_inputs(self, side: dict, x: torch.Tensor, memo: dict) -> dict:
        experts = memo.get("chunk experts")  # in a chunked segment: (first, stop) of the chunk's experts
        groups = self.num_groups if experts is None else experts[1] - experts[0]
        return {"offsets": bind_offsets("GroupedLinear", side, x, memo, groups)}

    def compile_unsupported_reason(self):
        return "accumulate_main_grad=True" if self.accumulate_main_grad else None

    def check_input(self, x, weight: torch.Tensor) -> None:
        if not isinstance(x, torch.Tensor):
            raise OpTypeError(f"GroupedLinear: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise OpValueError(
                f"GroupedLinear: argument 'x' must have shape (tokens, {self.in_features}) (in_features), "
                f"got {tuple(x.shape)}"
            )
        if x.dtype != weight.dtype:
            raise OpTypeError(f"GroupedLinear: argument 'x' has dtype {x.dtype} but the weight has {weight.dtype}")

    @staticmethod
    def add_bias(y: torch.Tensor, bias, offsets: torch.Tensor) -> torch.Tensor:
        """y (M, N) += bias (G, N) of each row's group; padding rows stay zero. bias None: y."""
        if bias is None:
            return y
        bias_rows = torch.cat([bias, bias.new_zeros(1, bias.shape[1])])
        return y + bias_rows[row_group_ids(offsets, y.shape[0])]

    @staticmethod
    def output_torch(x, weight, bias, offsets) -> torch.Tensor:
        """The op's output on the torch path (unquantized input), recomputed for ``recompute_output``."""
        return GroupedLinear.add_bias(grouped_mm_nt(x, weight.detach(), offsets), bias, offsets).detach()

    @staticmethod
    def keep_for_backward(ctx: OpContext, x, recipe, output_fn=None) -> None:
        """Save what op_backward needs: the input for the weight gradient, the weight (as this
        call read it) for the data gradient, the recipe. Every fused forward of a GroupedLinear
        calls this so the backward can be planned independently. With ``recompute_output`` the
        consumer of this call's output gets it again as ``output_fn(x, weight, bias, offsets)``
        (this backend's GEMM, default `output_torch`; the weight and bias as this call read
        them) instead of keeping it; a quantized x raises. With a recipe's 16-bit weight gradient
        (`high_precision_wgrad`) a quantized x is kept as its ``source`` (`wgrad_source`)."""
        if ctx.needs_grad("weight"):
            ctx.save_input(wgrad_source(x) if is_quantized(x) and high_precision_wgrad(recipe) else x)
            if ctx.op.accumulate_main_grad:
                ctx.main_grads["weight"] = _main_grad(ctx.params["weight"])
        if ctx.input_requires_grad:
            ctx.saved.weight = ctx.params["weight"]
        ctx.saved.recipe = recipe
        if ctx.op.recompute_output:
            if is_quantized(x):
                raise OpValueError("GroupedLinear: recompute_output=True takes a bf16/fp16 input, got a QuantizedTensor")
            params = (ctx.params["weight"], ctx.params.get("bias"))
            ctx.recompute_output = Recompute(output_fn or GroupedLinear.output_torch, x, *params, ctx.side["offsets"])

    def op_forward(self, ctx: OpContext, x) -> torch.Tensor:
        weight = ctx.params["weight"]
        self.check_input(x, weight)
        offsets = ctx.side["offsets"]
        x_values = x.dequantize() if is_quantized(x) else x
        recipe = x.recipe if is_quantized(x) else None
        y = grouped_mm_nt(x_values, gemm_weight(weight, recipe, ctx.reuse_scope), offsets)
        y = self.add_bias(y, ctx.params.get("bias"), offsets)
        self.keep_for_backward(ctx, x, recipe)
        return y

    def grad_operands(self, ctx: OpContext, dy):
        """(dy for the data gradient, dy for the weight gradient), both (M, N) plain tensors.

        With a quantized input the gradient is quantized with the same recipe, row-wise for the
        data gradient and per-group column-wise for the weight gradient (unless ``dy`` already is;
        the weight gradient takes dy unquantized with the recipe's `high_precision_wgrad`).
        """
        hp_wgrad = high_precision_wgrad(ctx.saved.recipe)
        if is_quantized(dy):
            return dy.dequantize(), (wgrad_source(dy) if hp_wgrad else columnwise_view(dy))
        if ctx.saved.recipe is None:
            return dy, dy
        columnwise = ctx.needs_grad("weight") and not hp_wgrad
        dyq = quantize(dy, ctx.saved.recipe, rowwise=True, columnwise=columnwise, offsets=ctx.side["offsets"])
        return dyq.dequantize(), (dy if hp_wgrad else columnwise_view(dyq))

    def op_backward(self, ctx: OpContext, dy):
        offsets = ctx.side["offsets"]
        dy_data, dy_wgrad = self.grad_operands(ctx, dy)
        grads = {}
        dx = None
        # the weight gradient first: an input the backward recomputes (a Permute's rows) is freed
        # before dx is allocated
        if ctx.needs_grad("weight"):
            main_grad = ctx.main_grads.get("weight")
            out_dtype = None if main_grad is None else torch.float32
            dw = grouped_wgrad(dy_wgrad, columnwise_view(ctx.load_input()), offsets, out_dtype=out_dtype)
            if main_grad is None:
                grads["weight"] = dw
            else:
                main_grad.add_(dw)
        if ctx.needs_grad("bias"):
            grads["bias"] = grouped_row_sum(dy_data, offsets)
        if ctx.input_requires_grad:
            weight = gemm_weight(ctx.saved.weight, ctx.saved.recipe, ctx.reuse_scope, dgrad=True)
            dx = grouped_mm_nn(dy_data, weight.detach(), offsets)
        return dx, grads
