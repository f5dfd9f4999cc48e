"""Forward GroupGemm + Quantize (+ Transpose): the GEMM output cast in its epilogue."""

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.ops import GroupedLinear, Quantize, Transpose


def _forward_torch(ops, ctxs, x):
    for op, ctx in zip(ops, ctxs):
        x = op.op_forward(ctx, x)
    return x


grouped_linear_quantize = FusionRule("grouped_linear+quantize", pattern=(GroupedLinear, Quantize), passes="forward")
grouped_linear_quantize.implementation("torch")(_forward_torch)

grouped_linear_quantize_transpose = FusionRule(
    "grouped_linear+quantize+transpose", pattern=(GroupedLinear, Quantize, Transpose), passes="forward"
)
grouped_linear_quantize_transpose.implementation("torch")(_forward_torch)

register_rule(grouped_linear_quantize)
register_rule(grouped_linear_quantize_transpose)
