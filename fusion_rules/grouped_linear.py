"""GroupedLinear alone (forward): the sm90 grouped GEMM kernel, or the torch op."""

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.ops import GroupedLinear

from ._sm90 import kernel_unsupported_reason, run_grouped_gemm

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


register_rule(grouped_linear)
