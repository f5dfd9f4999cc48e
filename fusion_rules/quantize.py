"""Quantize alone: the row-wise cast on the sm90 cast kernels ("fp8_blockwise" 1 x 128 blocks in
one launch, "fp8_current" an amax launch and the cast), or the torch op.

Quantize before a GroupedLinear (+ Activation) whose weight gradient runs in FP8 ("fp8_blockwise"):
on sm90 the cast also writes x's block-padded column-wise copy from the same read, which the
GroupedLinear keeps for its weight gradient instead of the rows (no second cast, from the E4M3
rows, in the backward); the GroupedLinear (+ Activation) then runs as its own rule does.
"""

import torch

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.ops import Activation, GroupedLinear, Quantize
from te_fused_ops.quantization import Float8BlockScaling

from ._sm90 import casts_on_kernel, fp8_wgrad_shape_reason, quantize_rows, quantize_rows_and_columns
from .grouped_linear import grouped_linear
from .grouped_linear_activation import grouped_linear_activation

quantize_rule = FusionRule("quantize", pattern=(Quantize,), passes="forward")


@quantize_rule.supports
def _supports(ops, info, backend):
    if backend != "sm90":
        return None
    recipe = ops[0].recipe
    if not casts_on_kernel(recipe):
        return f"{recipe.name} cast runs in torch (the sm90 cast kernels make fp8_blockwise and fp8_current scales)"
    if info.input_recipe[0] is not None:
        return "quantized input (dequantized and requantized in torch)"
    if info.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(info.dtype).removeprefix('torch.')} not supported (bf16, fp16)"
    return None


@quantize_rule.implementation("sm90")
def _forward_sm90(ops, ctxs, x):
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[-1] % 8 or rows.data_ptr() % 16:  # the kernel's 16-byte accesses; torch casts the same bytes
        return ops[0].op_forward(ctxs[0], x)
    return quantize_rows(rows.view(x.shape), ops[0].recipe, ctxs[0].side["offsets"])


@quantize_rule.implementation("torch")
def _forward_torch(ops, ctxs, x):
    return ops[0].op_forward(ctxs[0], x)


def _then(ops):
    """The rule that runs what follows the Quantize."""
    return grouped_linear if len(ops) == 2 else grouped_linear_activation


def _supports_with_columns(ops, info, backend):
    if backend != "sm90":
        return None
    reason = _supports(ops[:1], info.window(0, 1), backend)
    if reason:
        return reason
    recipe = ops[0].recipe
    if not isinstance(recipe, Float8BlockScaling):
        return f"{recipe.name}: the weight gradient reads the input dequantized (no column-wise copy to make)"
    if not info.params_require_grad[1]:
        return "the GroupedLinear needs no weight gradient (no column-wise copy to make)"
    return fp8_wgrad_shape_reason(ops[1]) or _then(ops).first_failure(ops[1:], info.window(1, len(ops)), backend)


def _forward_with_columns_sm90(ops, ctxs, x):
    x = quantize_rows_and_columns(x, ops[0].recipe, ctxs[1].side["offsets"])
    return _then(ops).implementations["sm90"](ops[1:], ctxs[1:], x)


def _with_columns_rule(name, pattern) -> FusionRule:
    """sm90 only: elsewhere the ops run as rules 'quantize' and 'grouped_linear[+activation]' do."""
    rule = FusionRule(name, pattern=pattern, passes="forward", supports=_supports_with_columns)
    rule.implementation("sm90")(_forward_with_columns_sm90)
    return rule


quantize_grouped_linear = _with_columns_rule("quantize+grouped_linear", (Quantize, GroupedLinear))
quantize_grouped_linear_activation = _with_columns_rule(
    "quantize+grouped_linear+activation", (Quantize, GroupedLinear, Activation)
)
for _rule in (quantize_rule, quantize_grouped_linear, quantize_grouped_linear_activation):
    register_rule(_rule)
