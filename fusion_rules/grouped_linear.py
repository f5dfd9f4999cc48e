"""GroupedLinear alone, forward and backward.

The forward takes a Quantize[, Transpose] before the op (its input format: x cast on the way
in, with the column-wise copy the weight gradient reads) and one after it (its output format:
the GEMM's output cast, e.g. in the GEMM's epilogue).
"""

from te_fused_ops.fusion import FusionRule, register_rule
from te_fused_ops.ops import GroupedLinear


def _forward_reference(ops, ctxs, x):
    linear, ctx = ops[0], ctxs[0]
    if ctx.input_format is not None:
        x = ctx.input_format.apply(x)
    y = linear.op_forward(ctx, x)
    return y if ctx.output_format is None else ctx.output_format.apply(y)


def _backward_reference(ops, ctxs, dy):
    dx, grads = ops[0].op_backward(ctxs[0], dy)
    return dx, [grads]


grouped_linear = register_rule(FusionRule(
    "grouped_linear", pattern=(GroupedLinear,), passes="forward", reference=_forward_reference, formats=(0, 1)))
grouped_linear_backward = register_rule(FusionRule(
    "grouped_linear_backward", pattern=(GroupedLinear,), passes="backward", reference=_backward_reference))
