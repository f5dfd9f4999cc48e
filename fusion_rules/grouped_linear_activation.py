"""Forward GroupGemm + Activation (+ Quantize (+ Transpose)).

The fused forward keeps the pre-activation (which the activation's backward needs anyway) and
not the activation output: the next GroupedLinear's weight gradient recomputes it (memory
contract: less saved than the unfused chain, which keeps both). With
``GroupedLinear(recompute_output=True)`` it keeps neither: the backward reruns the GEMM for pre.

On sm90 a Quantize after the activation: "fp8_blockwise" (bf16/fp16 x, GLU activation) casts
the act to E4M3 in the GEMM's epilogue, which never writes it in bf16, and with a Transpose after
it also writes the per-group column-wise copy the next GroupedLinear's FP8 weight gradient reads
(I % 128 == 0, G <= 512); "fp8_current" takes its amax from the epilogue (partial maxima per
consumer warp), so the cast kernel runs without an amax pass.
"""

import torch

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.ops import Activation, GroupedLinear, Quantize, Transpose
from te_fused_ops.ops.base import Recompute
from te_fused_ops.activations import ACTIVATIONS
from te_fused_ops.quantization import Float8BlockScaling, Float8CurrentScaling

from ._sm90 import (
    columns_unsupported_reason,
    epilogue_args,
    kernel_unsupported_reason,
    quantize_rows,
    rows_quantized,
    run_grouped_gemm,
)


def finish_activation(act: Activation, ctx, pre: torch.Tensor, out: torch.Tensor, keep_output: bool,
                      pre_recompute=None) -> torch.Tensor:
    """Fill the activation's ctx as its own forward would; unless ``keep_output``, let consumers
    recompute ``out`` from the saved pre-activation instead of keeping it. ``pre_recompute``
    (the GroupedLinear's ``recompute_output``): keep that instead of ``pre``."""
    if ctx.input_requires_grad or ctx.params_require_grad:
        ctx.input_recompute = pre_recompute
        ctx.save_input(pre)
        if not keep_output:
            ctx.recompute_output = Recompute(act.compute, ctx.side, ctx.saved["input"])
    return out


def _forward_torch(ops, ctxs, x):
    linear, act = ops[0], ops[1]
    pre = linear.op_forward(ctxs[0], x)
    act.check_input(pre)
    y = finish_activation(act, ctxs[1], pre, act.compute(ctxs[1].side, pre), len(ops) > 2, ctxs[0].recompute_output)
    for op, ctx in zip(ops[2:], ctxs[2:]):
        y = op.op_forward(ctx, y)
    return y


def _forward_sm90(ops, ctxs, x):
    linear, act = ops
    pre, out = run_grouped_gemm(linear, ctxs[0], x, act.kernel_name, **epilogue_args(act, ctxs[1]))
    return finish_activation(act, ctxs[1], pre, out, False, ctxs[0].recompute_output)


def _forward_sm90_cast(ops, ctxs, x):
    linear, act, quantize = ops
    recipe, offsets, epilogue = quantize.recipe, ctxs[2].side["offsets"], epilogue_args(act, ctxs[1])
    if isinstance(recipe, Float8BlockScaling):
        pre, data, scale_inv = run_grouped_gemm(linear, ctxs[0], x, act.kernel_name, act_cast=recipe, **epilogue)
        finish_activation(act, ctxs[1], pre, None, False, ctxs[0].recompute_output)
        return rows_quantized(data, scale_inv, data.shape, pre.dtype, recipe, offsets)
    pre, out, amax_parts = run_grouped_gemm(linear, ctxs[0], x, act.kernel_name, act_amax=True, **epilogue)
    finish_activation(act, ctxs[1], pre, out, False, ctxs[0].recompute_output)
    return quantize_rows(out, recipe, offsets, amax_parts)


def _forward_sm90_cast_columns(ops, ctxs, x):
    linear, act, quantize = ops[:3]
    recipe = quantize.recipe
    pre, data, scale_inv, columns = run_grouped_gemm(linear, ctxs[0], x, act.kernel_name, act_cast=recipe,
                                                     columns=True, **epilogue_args(act, ctxs[1]))
    finish_activation(act, ctxs[1], pre, None, False, ctxs[0].recompute_output)
    return rows_quantized(data, scale_inv, data.shape, pre.dtype, recipe, ctxs[2].side["offsets"], columns)


def _supports_sm90(ops, info, backend):
    if backend != "sm90":
        return None
    act = ops[1]
    if act.kernel_name is None:
        return f"no kernel epilogue for {act.op_name}"
    return kernel_unsupported_reason(ops[0], info, act.kernel_name)


def _supports_sm90_cast(ops, info, backend):
    reason = _supports_sm90(ops, info, backend)
    if backend != "sm90" or reason:
        return reason
    recipe = ops[2].recipe
    if isinstance(recipe, Float8CurrentScaling):
        return None
    if not isinstance(recipe, Float8BlockScaling):
        return f"{recipe.name}: no act-cast epilogue for this recipe (the act is cast after the kernel)"
    if info.input_recipe[0] is not None:
        return "quantized input: the FP8 kernel has no act-cast epilogue (the act is cast after it, rule 'quantize')"
    if not ACTIVATIONS[ops[1].kernel_name].glu:
        return f"{ops[1].op_name}: the act-cast epilogue takes GLU activations (the act is cast after the kernel)"
    return None


def _supports_sm90_cast_columns(ops, info, backend):
    reason = _supports_sm90_cast(ops, info, backend)
    if backend != "sm90" or reason:
        return reason
    return columns_unsupported_reason(ops[2].recipe, ops[0].out_features // 2, ops[0].num_groups)


grouped_linear_activation = FusionRule(
    "grouped_linear+activation", pattern=(GroupedLinear, Activation), passes="forward", supports=_supports_sm90
)
grouped_linear_activation.implementation("sm90")(_forward_sm90)
grouped_linear_activation.implementation("torch")(_forward_torch)

grouped_linear_activation_quantize = FusionRule(
    "grouped_linear+activation+quantize", pattern=(GroupedLinear, Activation, Quantize), passes="forward",
    supports=_supports_sm90_cast,
)
grouped_linear_activation_quantize.implementation("sm90")(_forward_sm90_cast)
grouped_linear_activation_quantize.implementation("torch")(_forward_torch)

grouped_linear_activation_quantize_transpose = FusionRule(
    "grouped_linear+activation+quantize+transpose",
    pattern=(GroupedLinear, Activation, Quantize, Transpose),
    passes="forward",
    supports=_supports_sm90_cast_columns,
)
grouped_linear_activation_quantize_transpose.implementation("sm90")(_forward_sm90_cast_columns)
grouped_linear_activation_quantize_transpose.implementation("torch")(_forward_torch)

for _rule in (
    grouped_linear_activation,
    grouped_linear_activation_quantize,
    grouped_linear_activation_quantize_transpose,
):
    register_rule(_rule)
