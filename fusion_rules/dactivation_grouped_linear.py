"""Backward GroupGemm + dActivation (+ Quantize (+ Transpose)).

In forward order the ops are ``Activation, [Quantize, [Transpose,]] GroupedLinear``. A fused
kernel runs the GroupedLinear's data-gradient GEMM with the activation's backward in its
epilogue, ``d_pre = act'(pre) * (dy @ W[g])``. Without Quantize it also emits the activation
output the weight gradient needs from the saved ``pre`` (the fused forward keeps no activation
output); after a Quantize (fp8_blockwise / fp8_current) the GEMM runs on FP8 operands (dy cast
1x128, the forward's weight cast transposed) and the weight gradient reads the quantized input
dequantized, as the torch backend does. The torch backend is the reference: the same steps in
sequence, one rule, one plan step.
"""

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.kernels.grouped_gemm import (
    grouped_dgrad_dact_fp8_sm90,
    grouped_dgrad_dact_sm90,
    sm90_grouped_dgrad_dact_fp8_unsupported_reason,
    sm90_grouped_dgrad_dact_unsupported_reason,
)
from te_fused_ops.ops import Activation, GroupedLinear, Quantize, Transpose
from te_fused_ops.ops.base import is_quantized

from ._sm90 import (
    FP8_KERNEL_RECIPES,
    backward_unsupported_reason,
    emulated_recipe_reason,
    epilogue_args,
    fp8_dgrad_operands,
    linear_param_grads,
    quantized_input_param_grads,
)


def _backward_torch(ops, ctxs, dy):
    grads = [None] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        dy, grads[i] = ops[i].op_backward(ctxs[i], dy)
    return dy, grads


def _supports_sm90(ops, info, backend):
    """bf16 (Activation, GroupedLinear), or FP8 (Activation, Quantize, [Transpose,] GroupedLinear)."""
    if backend != "sm90":
        return None
    act, linear = ops[0], ops[-1]
    if act.kernel_name is None:
        return f"no kernel epilogue for {act.op_name}"
    if not info.input_requires_grad[0]:
        return "the activation's input needs no gradient"
    index = len(ops) - 1
    if len(ops) == 2:
        unsupported = sm90_grouped_dgrad_dact_unsupported_reason
    else:
        if ops[1].quantize_grad:
            return "Quantize(quantize_grad=True) casts the gradient between the GEMM and the dActivation"
        recipe = info.input_recipe[index]
        if not isinstance(recipe, FP8_KERNEL_RECIPES):
            return emulated_recipe_reason(recipe)
        unsupported = sm90_grouped_dgrad_dact_fp8_unsupported_reason
    reason = unsupported(info.dtype, linear.out_features, linear.in_features, act.kernel_name)
    if reason:
        return reason.removeprefix("sm90 backend: ")
    return backward_unsupported_reason(linear, info, index)


def _act_grads(act_ctx, d_probs) -> dict:
    return {"probs": d_probs.to(act_ctx.side["probs"].dtype)} if act_ctx.needs_grad("probs") else {}


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
    return d_pre, [_act_grads(act_ctx, d_probs), linear_param_grads(linear_ctx, dy, x=out)]


def _backward_fp8_sm90(ops, ctxs, dy):
    """One kernel: d_pre = act'(pre) * (dy @ W[g]) on FP8 operands (the forward's recipe); then
    the bf16 weight gradient on the dequantized input. Quantize and Transpose pass dy through.
    A quantized dy takes the torch path."""
    act = ops[0]
    act_ctx, linear_ctx = ctxs[0], ctxs[-1]
    if is_quantized(dy):
        return _backward_torch(ops, ctxs, dy)
    dy = dy.contiguous()
    d_pre, d_probs = grouped_dgrad_dact_fp8_sm90(
        *fp8_dgrad_operands(linear_ctx, dy, linear_ctx.saved["recipe"]),
        linear_ctx.side["offsets"],
        act_ctx.load_input(),
        activation=act.kernel_name,
        **epilogue_args(act, act_ctx),
    )
    passed_through = [{} for _ in ops[1:-1]]
    return d_pre, [_act_grads(act_ctx, d_probs), *passed_through, quantized_input_param_grads(linear_ctx, dy)]


def _rule(name: str, pattern, sm90) -> FusionRule:
    rule = FusionRule(name, pattern=pattern, passes="backward", supports=_supports_sm90)
    rule.implementation("torch")(_backward_torch)
    rule.implementation("sm90")(sm90)
    return register_rule(rule)


dactivation_grouped_linear = _rule("dactivation+grouped_linear", (Activation, GroupedLinear), _backward_sm90)
dactivation_quantize_grouped_linear = _rule(
    "dactivation+quantize+grouped_linear", (Activation, Quantize, GroupedLinear), _backward_fp8_sm90
)
dactivation_quantize_transpose_grouped_linear = _rule(
    "dactivation+quantize+transpose+grouped_linear", (Activation, Quantize, Transpose, GroupedLinear),
    _backward_fp8_sm90,
)
