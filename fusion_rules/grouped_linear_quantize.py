"""Forward GroupGemm + Quantize (+ Transpose): the GEMM output cast in its epilogue.

On sm90, "fp8_blockwise" after a bf16/fp16 input casts the output to E4M3 in the GEMM's epilogue,
which never writes it in bf16, and with a Transpose after it also writes the per-group column-wise
copy (N % 128 == 0, G <= 512); other recipes (and an FP8 input) run the GEMM and then the cast
(rules 'grouped_linear' and 'quantize').
"""

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.ops import GroupedLinear, Quantize, Transpose
from te_fused_ops.quantization import Float8BlockScaling

from ._sm90 import columns_unsupported_reason, kernel_unsupported_reason, rows_quantized, run_grouped_gemm


def _forward_torch(ops, ctxs, x):
    for op, ctx in zip(ops, ctxs):
        x = op.op_forward(ctx, x)
    return x


def _supports_sm90(ops, info, backend):
    if backend != "sm90":
        return None
    recipe = ops[1].recipe
    if not isinstance(recipe, Float8BlockScaling):
        return f"{recipe.name}: no cast epilogue for this recipe (the output is cast after the kernel, rule 'quantize')"
    if info.input_recipe[0] is not None:
        return "quantized input: the FP8 kernel has no cast epilogue (the output is cast after it, rule 'quantize')"
    return kernel_unsupported_reason(ops[0], info)


def _forward_sm90(ops, ctxs, x):
    recipe, columns = ops[1].recipe, len(ops) == 3
    _, data, scale_inv, *made = run_grouped_gemm(ops[0], ctxs[0], x, act_cast=recipe, columns=columns)
    return rows_quantized(data, scale_inv, data.shape, x.dtype, recipe, ctxs[1].side["offsets"], *made)


def _supports_sm90_columns(ops, info, backend):
    reason = _supports_sm90(ops, info, backend)
    if backend != "sm90" or reason:
        return reason
    return columns_unsupported_reason(ops[1].recipe, ops[0].out_features, ops[0].num_groups)


grouped_linear_quantize = FusionRule(
    "grouped_linear+quantize", pattern=(GroupedLinear, Quantize), passes="forward", supports=_supports_sm90
)
grouped_linear_quantize.implementation("sm90")(_forward_sm90)
grouped_linear_quantize.implementation("torch")(_forward_torch)

grouped_linear_quantize_transpose = FusionRule(
    "grouped_linear+quantize+transpose", pattern=(GroupedLinear, Quantize, Transpose), passes="forward",
    supports=_supports_sm90_columns,
)
grouped_linear_quantize_transpose.implementation("sm90")(_forward_sm90)
grouped_linear_quantize_transpose.implementation("torch")(_forward_torch)

register_rule(grouped_linear_quantize)
register_rule(grouped_linear_quantize_transpose)
