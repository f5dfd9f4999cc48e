"""Quantize alone: the row-wise cast on the sm90 cast kernels ("fp8_blockwise" 1 x 128 blocks in
one launch, "fp8_current" an amax launch and the cast), or the torch op."""

import torch

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.ops import Quantize

from ._sm90 import casts_on_kernel, quantize_rows

quantize_rule = FusionRule("quantize", pattern=(Quantize,), passes="forward")


@quantize_rule.supports
def _supports(ops, info, backend):
    if backend != "sm90":
        return None
    recipe = ops[0].recipe
    if not casts_on_kernel(recipe):
        return f"{recipe.name} cast runs in torch (the sm90 cast kernels make fp8_blockwise and fp8_current scales)"
    if info.input_recipe[0] is not None:
        return "quantized input (dequantized and requantized in torch)"
    if info.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(info.dtype).removeprefix('torch.')} not supported (bf16, fp16)"
    return None


@quantize_rule.implementation("sm90")
def _forward_sm90(ops, ctxs, x):
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[-1] % 8 or rows.data_ptr() % 16:  # the kernel's 16-byte accesses; torch casts the same bytes
        return ops[0].op_forward(ctxs[0], x)
    return quantize_rows(rows.view(x.shape), ops[0].recipe, ctxs[0].side["offsets"])


@quantize_rule.implementation("torch")
def _forward_torch(ops, ctxs, x):
    return ops[0].op_forward(ctxs[0], x)


register_rule(quantize_rule)
