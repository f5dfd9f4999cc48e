"""Backward GroupGemm + dActivation (+ Quantize (+ Transpose)).

In forward order the ops are ``Activation, [Quantize, [Transpose,]] GroupedLinear``. A fused
kernel runs the GroupedLinear's data-gradient GEMM with the activation's backward in its
epilogue, ``d_pre = act'(pre) * (dy @ W[g])``. Without Quantize it also emits the activation
output the weight gradient needs from the saved ``pre`` (the fused forward keeps no activation
output); after a Quantize (fp8_blockwise / fp8_current) the GEMM runs on FP8 operands (dy cast
1x128, the forward's weight cast transposed) and the weight gradient runs on per-group
column-wise FP8 copies of dy and of the quantized input (fp8_blockwise; fp8_current reads the
input dequantized), as the torch backend does. The torch backend is the reference: the same
steps in sequence, one rule, one plan step.

The rules that also take the preceding GroupedLinear (FC1) feed FC1's backward from the kernel's
epilogue: with "fp8_current" d_pre's amax, so FC1's cast of d_pre skips its amax pass; with
"fp8_blockwise" d_pre itself as the row-wise and per-group column-wise E4M3 copies FC1's FP8 data
and weight gradients read (`grouped_dgrad_dact_quant_fp8_sm90`: no bf16 d_pre, no cast kernel).
"""

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.backends.sm90.kernels.grouped_gemm import (
    grouped_dgrad_dact_fp8_sm90,
    grouped_dgrad_dact_quant_fp8_sm90,
    grouped_dgrad_dact_sm90,
    sm90_grouped_dgrad_dact_fp8_unsupported_reason,
    sm90_grouped_dgrad_dact_quant_fp8_unsupported_reason,
    sm90_grouped_dgrad_dact_unsupported_reason,
)
from te_fused_ops.ops import Activation, GroupedLinear, Quantize, Transpose
from te_fused_ops.ops.base import is_quantized
from te_fused_ops.quantization import Float8BlockScaling, Float8CurrentScaling

from ._sm90 import (
    FP8_KERNEL_RECIPES,
    backward_unsupported_reason,
    emulated_recipe_reason,
    epilogue_args,
    fp8_data_grad,
    fp8_dgrad_operands,
    fp8_grad_casts,
    fp8_wgrad_applies,
    linear_backward,
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


def _dact_fp8(ops, ctxs, dy, d_pre_amax: bool, d_pre_recipe=None):
    """One kernel: d_pre = act'(pre) * (dy @ W[g]) on FP8 operands (the forward's recipe); then
    the weight gradient (`fp8_grad_casts`: FP8 for fp8_blockwise, else bf16 on the dequantized
    input). Quantize and Transpose pass dy through.
    A quantized dy takes the torch path. Returns (d_pre, grads, d_pre's amax parts with
    ``d_pre_amax`` after the kernel, else None); with ``d_pre_recipe`` (a Float8BlockScaling) d_pre
    is ((row data, row multipliers), `BlockColumns`), cast in the kernel's epilogue."""
    act = ops[0]
    act_ctx, linear_ctx = ctxs[0], ctxs[-1]
    if is_quantized(dy):
        return (*_backward_torch(ops, ctxs, dy), None)
    dy = dy.contiguous()
    recipe = linear_ctx.saved["recipe"]
    x = linear_ctx.load_input() if linear_ctx.needs_grad("weight") else None
    dy_rows, dy_columns = fp8_grad_casts(linear_ctx, dy, recipe, x, True)
    operands = (*fp8_dgrad_operands(linear_ctx, dy_rows, recipe), linear_ctx.side["offsets"], act_ctx.load_input())
    kwargs = dict(activation=act.kernel_name, **epilogue_args(act, act_ctx))
    if d_pre_recipe is None:
        outputs = grouped_dgrad_dact_fp8_sm90(*operands, d_pre_amax=d_pre_amax, **kwargs)
    else:
        rows, columns, d_probs = grouped_dgrad_dact_quant_fp8_sm90(
            *operands, power_2_scales=d_pre_recipe.power_2_scales, **kwargs)
        outputs = ((rows, columns), d_probs)
    passed_through = [{} for _ in ops[1:-1]]
    linear_grads = quantized_input_param_grads(linear_ctx, dy, x, dy_columns)
    grads = [_act_grads(act_ctx, outputs[1]), *passed_through, linear_grads]
    return outputs[0], grads, outputs[2] if d_pre_amax else None


def _backward_fp8_sm90(ops, ctxs, dy):
    return _dact_fp8(ops, ctxs, dy, False)[:2]


def _supports_with_fc1(ops, info, backend):
    """FC1's input fp8_current or fp8_blockwise (FC2's cast either), FC1's input needing its
    gradient (the cast of d_pre this rule feeds), both backwards on the kernels; fp8_blockwise:
    d_pre's cast in the kernel's epilogue (`grouped_dgrad_dact_quant_fp8_sm90`) and no FC1 bias
    (its gradient would sum d_pre in bf16)."""
    if backend != "sm90":
        return None
    recipe = info.input_recipe[0]
    if not isinstance(recipe, (Float8CurrentScaling, Float8BlockScaling)):
        return "FC1's input is neither fp8_current nor fp8_blockwise (no cast of d_pre to feed)"
    if not info.input_requires_grad[0]:
        return "FC1's input needs no gradient (no cast of d_pre)"
    reason = _supports_sm90(ops[1:], info.window(1, len(ops)), backend) or backward_unsupported_reason(ops[0], info, 0)
    if reason or isinstance(recipe, Float8CurrentScaling):
        return reason
    fc1, act, fc2 = ops[0], ops[1], ops[-1]
    if fc1.bias is not None:
        return "FC1 has a bias (its gradient sums d_pre in bf16)"
    reason = sm90_grouped_dgrad_dact_quant_fp8_unsupported_reason(
        info.dtype, fc2.out_features, fc2.in_features, fc2.num_groups, act.kernel_name)
    return reason.removeprefix("sm90 backend: ") if reason else None


def _backward_with_fc1_sm90(ops, ctxs, dy):
    """fp8_current: `_dact_fp8` with d_pre's amax from its epilogue, then FC1's backward
    (`linear_backward`), whose cast of d_pre takes that amax. fp8_blockwise: d_pre cast in the
    kernel's epilogue, FC1's FP8 data and weight gradients on those copies (the unfused order
    where FC1's weight gradient does not run in FP8, or dy arrives quantized)."""
    fc1, fc1_ctx = ops[0], ctxs[0]
    recipe = fc1_ctx.saved["recipe"]
    if isinstance(recipe, Float8CurrentScaling):
        d_pre, grads, amax_parts = _dact_fp8(ops[1:], ctxs[1:], dy, True)
        dx, fc1_grads = linear_backward(fc1, fc1_ctx, d_pre, amax_parts)
        return dx, [fc1_grads, *grads]
    x = None if is_quantized(dy) or not fc1_ctx.needs_grad("weight") else fc1_ctx.load_input()
    if not fp8_wgrad_applies(fc1_ctx, recipe, x):  # x loaded once, whichever order runs
        d_pre, grads, _ = _dact_fp8(ops[1:], ctxs[1:], dy, False)
        dx, fc1_grads = linear_backward(fc1, fc1_ctx, d_pre, x=x)
        return dx, [fc1_grads, *grads]
    (d_pre_rows, d_pre_columns), grads, _ = _dact_fp8(ops[1:], ctxs[1:], dy, False, recipe)
    dx = fp8_data_grad(fc1_ctx, d_pre_rows, recipe, dy.dtype)
    fc1_grads = quantized_input_param_grads(fc1_ctx, None, x, d_pre_columns, out_dtype=dy.dtype)
    return dx, [fc1_grads, *grads]


def _rule(name: str, pattern, sm90, supports=_supports_sm90) -> FusionRule:
    rule = FusionRule(name, pattern=pattern, passes="backward", supports=supports)
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
grouped_linear_dactivation_quantize_grouped_linear = _rule(
    "grouped_linear+dactivation+quantize+grouped_linear", (GroupedLinear, Activation, Quantize, GroupedLinear),
    _backward_with_fc1_sm90, _supports_with_fc1,
)
grouped_linear_dactivation_quantize_transpose_grouped_linear = _rule(
    "grouped_linear+dactivation+quantize+transpose+grouped_linear",
    (GroupedLinear, Activation, Quantize, Transpose, GroupedLinear), _backward_with_fc1_sm90, _supports_with_fc1,
)
