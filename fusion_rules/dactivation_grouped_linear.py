"""Backward GroupGemm + dActivation (+ Quantize (+ Transpose)).

In forward order the ops are ``Activation, [Quantize, [Transpose,]] GroupedLinear``. A fused
kernel runs the GroupedLinear's data-gradient GEMM with the activation's backward in its
epilogue, ``d_pre = act'(pre) * (dy @ W[g])``, and emits the activation output the weight
gradient needs from the saved ``pre`` (the fused forward keeps no activation output). The torch
backend is the reference for it: the same steps in sequence, one rule, one plan step.
"""

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.kernels.grouped_gemm import grouped_dgrad_dact_sm90, sm90_grouped_dgrad_dact_unsupported_reason
from te_fused_ops.ops import Activation, GroupedLinear, Quantize, Transpose
from te_fused_ops.ops.base import is_quantized

from ._sm90 import backward_unsupported_reason, epilogue_args, linear_param_grads


def _backward_torch(ops, ctxs, dy):
    grads = [None] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        dy, grads[i] = ops[i].op_backward(ctxs[i], dy)
    return dy, grads


def _rule(name: str, pattern) -> FusionRule:
    rule = FusionRule(name, pattern=pattern, passes="backward")
    rule.implementation("torch")(_backward_torch)
    return register_rule(rule)


def _supports_sm90(ops, info, backend):
    if backend != "sm90":
        return None
    act, linear = ops
    if act.kernel_name is None:
        return f"no kernel epilogue for {act.op_name}"
    if not info.input_requires_grad[0]:
        return "the activation's input needs no gradient"
    reason = sm90_grouped_dgrad_dact_unsupported_reason(info.dtype, linear.out_features, linear.in_features, act.kernel_name)
    if reason:
        return reason.removeprefix("sm90 backend: ")
    return backward_unsupported_reason(linear, info, 1)


def _backward_sm90(ops, ctxs, dy):
    """One kernel: d_pre = act'(pre) * (dy @ W[g]) and act(pre) (FC2's weight-gradient operand);
    then the varlen-K weight gradient. FP8 (saved recipe, quantized dy) takes the torch path."""
    act, linear = ops
    act_ctx, linear_ctx = ctxs
    if linear_ctx.saved["recipe"] is not None or is_quantized(dy):
        return _backward_torch(ops, ctxs, dy)
    dy = dy.contiguous()
    d_pre, out, d_probs = grouped_dgrad_dact_sm90(
        dy,
        linear_ctx.saved["weight"].detach(),
        linear_ctx.side["offsets"],
        act_ctx.load_input(),
        activation=act.kernel_name,
        **epilogue_args(act, act_ctx),
    )
    act_grads = {"probs": d_probs.to(act_ctx.side["probs"].dtype)} if act_ctx.needs_grad("probs") else {}
    return d_pre, [act_grads, linear_param_grads(linear_ctx, dy, x=out)]


dactivation_grouped_linear = FusionRule(
    "dactivation+grouped_linear", pattern=(Activation, GroupedLinear), passes="backward", supports=_supports_sm90
)
dactivation_grouped_linear.implementation("torch")(_backward_torch)
dactivation_grouped_linear.implementation("sm90")(_backward_sm90)
register_rule(dactivation_grouped_linear)
dactivation_quantize_grouped_linear = _rule(
    "dactivation+quantize+grouped_linear", (Activation, Quantize, GroupedLinear)
)
dactivation_quantize_transpose_grouped_linear = _rule(
    "dactivation+quantize+transpose+grouped_linear", (Activation, Quantize, Transpose, GroupedLinear)
)
