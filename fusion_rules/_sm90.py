"""Shared pieces of the sm90 (CuTe DSL, Hopper) implementations of the built-in rules."""

import torch

from te_fused_ops.grouped_mm import grouped_row_sum
from te_fused_ops.kernels.block_quantize import block_quantize_sm90
from te_fused_ops.kernels.grouped_gemm import (
    grouped_gemm_fp8_sm90,
    grouped_gemm_sm90,
    sm90_grouped_gemm_fp8_unsupported_reason,
    sm90_grouped_gemm_unsupported_reason,
)
from te_fused_ops.kernels.grouped_wgrad import grouped_wgrad_sm90, sm90_wgrad_unsupported_reason
from te_fused_ops.ops import Activation, GroupedLinear
from te_fused_ops.ops.base import is_quantized
from te_fused_ops.quantization import Float8BlockScaling, quantize_weight, reuse_or_make


def _reason(reason):
    return reason.removeprefix("sm90 backend: ") if reason else None


def kernel_unsupported_reason(linear: GroupedLinear, info, activation=None):
    """Why the sm90 grouped GEMM cannot run ``linear`` (the first matched op) + ``activation``.
    An fp8_blockwise input runs the block-scaled FP8 kernel; other recipes stay emulated."""
    recipe = info.input_recipe[0]
    if recipe is not None:
        if not isinstance(recipe, Float8BlockScaling):
            return emulated_recipe_reason(recipe)
        return _reason(
            sm90_grouped_gemm_fp8_unsupported_reason(info.dtype, linear.out_features, linear.in_features, activation)
        )
    return _reason(
        sm90_grouped_gemm_unsupported_reason(
            info.dtype, linear.out_features, linear.in_features, activation, linear.bias is not None
        )
    )


def emulated_recipe_reason(recipe) -> str:
    """Why a quantized input of ``recipe`` (not fp8_blockwise) runs emulated on sm90."""
    if recipe.name == "mxfp8":
        return "mxfp8 input: emulated on Hopper, which has no MX block-scaling hardware (quantize, dequantize, bf16 GEMM)"
    return f"{recipe.name} input: emulated (the sm90 FP8 kernels take fp8_blockwise)"


def backward_unsupported_reason(linear: GroupedLinear, info, index: int, fp8: bool = False):
    """Why the sm90 kernels cannot run the backward of ``linear`` (op ``index`` of info's window).
    ``fp8``: the caller runs `linear_backward`, which takes fp8_blockwise inputs."""
    recipe = info.input_recipe[index]
    if recipe is not None:
        if not isinstance(recipe, Float8BlockScaling):
            return emulated_recipe_reason(recipe)
        if not fp8 or recipe.power_2_scales:
            return "fp8_blockwise input: this backward runs in torch (sm90: grouped_linear_backward, no power_2_scales)"
        if info.input_requires_grad[index]:  # dx = dy (1x128 E4M3) @ W[g] (128x128 E4M3)
            reason = sm90_grouped_gemm_fp8_unsupported_reason(info.dtype, linear.in_features, linear.out_features, None)
            if reason:
                return _reason(reason)
        if info.params_require_grad[index]:
            return _reason(sm90_wgrad_unsupported_reason(info.dtype, linear.out_features, linear.in_features))
        return None
    if info.input_requires_grad[index]:  # dx (M, in) = dy (M, out) @ W[g]
        reason = sm90_grouped_gemm_unsupported_reason(info.dtype, linear.in_features, linear.out_features, None, False)
        if reason:
            return _reason(reason)
    if info.params_require_grad[index]:
        return _reason(sm90_wgrad_unsupported_reason(info.dtype, linear.out_features, linear.in_features))
    return None


def epilogue_args(act: Activation, ctx) -> dict:
    """Keyword arguments of the activation's kernel epilogue (constants, router probs)."""
    args = {}
    if act.kernel_name == "clamped_swiglu":
        args.update(limit=act.limit, alpha=act.alpha)
    if act.kernel_name == "scaled_swiglu":
        args["probs"] = ctx.side["probs"].detach().float()
    return args


def run_grouped_gemm(linear: GroupedLinear, ctx, x: torch.Tensor, activation=None, **epilogue):
    """The sm90 kernel on the weight (natural layout, GLU too) this call read; fills ctx like the op.

    A quantized (fp8_blockwise) ``x`` runs the block-scaled FP8 kernel on the weight quantized
    in 128 x 128 blocks on this call. Returns (pre, act) as `grouped_gemm_sm90`.
    """
    weight, bias = ctx.params["weight"], ctx.params.get("bias")
    linear.check_input(x, weight)
    bias = None if bias is None else bias.detach()
    if is_quantized(x):
        w_data, w_scale_inv = quantize_weight_blocks(weight.detach(), x.recipe)
        pre, act = grouped_gemm_fp8_sm90(
            x.rowwise_data, x.rowwise_scale_inv, w_data, w_scale_inv, ctx.side["offsets"],
            bias=bias, activation=activation, out_dtype=x.dtype, **epilogue,
        )
        linear.keep_for_backward(ctx, x, x.recipe)
        return pre, act
    pre, act = grouped_gemm_sm90(x, weight.detach(), ctx.side["offsets"], bias=bias, activation=activation, **epilogue)
    linear.keep_for_backward(ctx, x, None)
    return pre, act


def quantize_weight_blocks(weight: torch.Tensor, recipe: Float8BlockScaling, transposed: bool = False):
    """(data (G, N, K) E4M3, scale_inv (G, N/128, K/128)) of ``weight`` in 128 x 128 blocks, or
    with ``transposed`` both per-group transposed ((G, K, N), (G, K/128, N/128): the data
    gradient's K-major operand). Made on every call (one kernel launch, or torch for power-of-two
    scales), unless inside `reuse_quantized_weights`."""

    def make():
        if transposed:
            data, scale_inv = quantize_weight_blocks(weight, recipe)
            return data.transpose(1, 2).contiguous(), scale_inv.transpose(1, 2).contiguous()
        if recipe.power_2_scales:
            qw = quantize_weight(weight, recipe)
            return qw.rowwise_data, qw.rowwise_scale_inv
        return block_quantize_sm90(weight.contiguous(), 128)

    return reuse_or_make(weight, recipe, "blocks transposed" if transposed else "blocks", make)


def linear_param_grads(ctx, dy: torch.Tensor, x: torch.Tensor = None) -> dict:
    """GroupedLinear's weight gradient (varlen-K kernel, dy and x read in place; accumulated into
    ``weight.main_grad`` when the op asks for it) and bias gradient.

    ``x``: the op's input (default: what its forward saved)."""
    offsets, grads = ctx.side["offsets"], {}
    if ctx.needs_grad("weight"):
        main_grad = ctx.main_grads.get("weight")  # accumulated in place by the kernel's epilogue
        dw = grouped_wgrad_sm90(dy, ctx.load_input() if x is None else x, offsets, main_grad=main_grad)
        if main_grad is None:
            grads["weight"] = dw
    if ctx.needs_grad("bias"):
        grads["bias"] = grouped_row_sum(dy, offsets)
    return grads


def linear_backward(linear: GroupedLinear, ctx, dy):
    """GroupedLinear's backward on sm90: dx = dy @ W[g] (W read in place) and the parameter grads.

    After an fp8_blockwise forward the data gradient is an FP8 GEMM: dy cast in 1 x 128 blocks,
    W in 128 x 128 blocks, transposed (the kernel reads K-major operands; cast again on this call,
    or once per `reuse_quantized_weights` scope); the weight gradient stays bf16 (dy as it came, x dequantized). A quantized dy
    takes the torch path."""
    recipe = ctx.saved["recipe"]
    if is_quantized(dy):
        return linear.op_backward(ctx, dy)
    dy = dy.contiguous()
    offsets = ctx.side["offsets"]
    dx = None
    if recipe is None:
        if ctx.input_requires_grad:
            dx = grouped_gemm_sm90(dy, ctx.saved["weight"].detach(), offsets, weight_layout="kn")[0]
        return dx, linear_param_grads(ctx, dy)
    if ctx.input_requires_grad:
        dy_data, dy_scale_inv = block_quantize_sm90(dy, 1)
        w_data, w_scale_inv = quantize_weight_blocks(ctx.saved["weight"].detach(), recipe, transposed=True)
        dx = grouped_gemm_fp8_sm90(dy_data, dy_scale_inv, w_data, w_scale_inv, offsets, out_dtype=dy.dtype)[0]
    x = ctx.load_input().dequantize() if ctx.needs_grad("weight") else None
    return dx, linear_param_grads(ctx, dy, x)
