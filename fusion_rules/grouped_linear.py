"""GroupedLinear alone: forward and backward on the sm90 kernels, or the torch op; and
Transpose + GroupedLinear, whose column-wise copy the sm90 weight gradient does not read."""

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.ops import GroupedLinear, Transpose

from ._sm90 import backward_unsupported_reason, kernel_unsupported_reason, linear_backward, run_grouped_gemm

grouped_linear = FusionRule("grouped_linear", pattern=(GroupedLinear,), passes="forward")


@grouped_linear.supports
def _supports(ops, info, backend):
    return kernel_unsupported_reason(ops[0], info) if backend == "sm90" else None


@grouped_linear.implementation("sm90")
def _forward_sm90(ops, ctxs, x):
    return run_grouped_gemm(ops[0], ctxs[0], x)[0]


@grouped_linear.implementation("torch")
def _forward_torch(ops, ctxs, x):
    return ops[0].op_forward(ctxs[0], x)


grouped_linear_backward = FusionRule("grouped_linear_backward", pattern=(GroupedLinear,), passes="backward")


@grouped_linear_backward.supports
def _supports_backward(ops, info, backend):
    return backward_unsupported_reason(ops[0], info, 0) if backend == "sm90" else None


@grouped_linear_backward.implementation("sm90")
def _backward_sm90(ops, ctxs, dy):
    dx, grads = linear_backward(ops[0], ctxs[0], dy)
    return dx, [grads]


@grouped_linear_backward.implementation("torch")
def _backward_torch(ops, ctxs, dy):
    dx, grads = ops[0].op_backward(ctxs[0], dy)
    return dx, [grads]


transpose_grouped_linear = FusionRule(
    "transpose+grouped_linear", pattern=(Transpose, GroupedLinear), passes="forward"
)


@transpose_grouped_linear.supports
def _supports_transpose(ops, info, backend):
    """sm90: only when the linear's forward and backward both run on the kernels (the varlen-K
    weight gradient reads the row-wise input in place; a torch backward falls back to it too)."""
    if backend != "sm90":
        return None
    linear_info = info.window(1, 2)
    return kernel_unsupported_reason(ops[1], linear_info) or backward_unsupported_reason(ops[1], linear_info, 0)


@transpose_grouped_linear.implementation("sm90")
def _forward_transpose_sm90(ops, ctxs, x):
    return run_grouped_gemm(ops[1], ctxs[1], x)[0]


@transpose_grouped_linear.implementation("torch")
def _forward_transpose_torch(ops, ctxs, x):
    return ops[1].op_forward(ctxs[1], ops[0].op_forward(ctxs[0], x))


register_rule(grouped_linear)
register_rule(grouped_linear_backward)
register_rule(transpose_grouped_linear)
