"""Shared pieces of the sm90 (CuTe DSL, Hopper) implementations of the built-in rules."""

import torch

from te_fused_ops.ops import GroupedLinear


def kernel_unsupported_reason(linear: GroupedLinear, info, activation=None):
    """Why the sm90 grouped GEMM cannot run ``linear`` (the first matched op) + ``activation``."""
    if info.input_quantized[0]:
        return "quantized input (the sm90 kernel takes bf16/fp16)"
    from te_fused_ops.kernels.grouped_gemm import sm90_grouped_gemm_unsupported_reason

    reason = sm90_grouped_gemm_unsupported_reason(
        info.dtype, linear.out_features, linear.in_features, activation, linear.bias is not None
    )
    return reason.removeprefix("sm90 backend: ") if reason else None


def run_grouped_gemm(linear: GroupedLinear, ctx, x: torch.Tensor, activation=None, **epilogue):
    """The sm90 kernel on the weight (natural layout, GLU too) this call read; fills ctx like the op.

    Returns (pre, act) as `grouped_gemm_sm90`.
    """
    from te_fused_ops.kernels.grouped_gemm import grouped_gemm_sm90

    weight, bias = ctx.params["weight"], ctx.params.get("bias")
    linear.check_input(x, weight)
    pre, act = grouped_gemm_sm90(
        x, weight.detach(), ctx.side["offsets"], bias=None if bias is None else bias.detach(), activation=activation, **epilogue
    )
    linear.keep_for_backward(ctx, x, None)
    return pre, act
