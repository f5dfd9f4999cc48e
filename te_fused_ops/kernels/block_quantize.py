"""Torch-facing wrapper of the E4M3 block-quantization kernel (`block_quantize_sm90`).

``block_quantize_sm90(x, block_rows)``: x (M, K) with 1 x 128 blocks (block_rows=1, activations)
or (G, N, K) with 128 x 128 blocks (block_rows=128, weights) -> (data like x in E4M3, scale_inv
float32 (M, ceil(K/128)) or (G, ceil(N/128), ceil(K/128))), bit for bit the "fp8_blockwise"
recipe's torch quantizer (power_2_scales=False). One launch, no host sync. Compiled once per
(input dtype, block_rows), all extents symbolic.
"""

from __future__ import annotations

import functools

import torch

from .launch import DTYPES, num_sms, tvm_ffi_available

_NAME = "block_quantize_sm90"
CTAS_PER_SM = 8


@functools.cache
def compile_block_quantize(dtype, block_rows, tvm_ffi=None):
    """Compile (once per configuration) and return fn(x (G, R, C), data, scale_inv, max_ctas)."""
    import cutlass
    import cutlass.cute as cute

    from .block_quantize_sm90 import BlockQuantizeSm90

    if tvm_ffi is None:
        tvm_ffi = tvm_ffi_available()
    element = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]
    g, r, c, rb, cb = (cute.sym_int() for _ in range(5))

    def fake(dt, shape, align):
        return cute.runtime.make_fake_compact_tensor(dt, shape, stride_order=(2, 1, 0), assumed_align=align)

    args = (
        fake(element, (g, r, c), element.width // 8),
        fake(cutlass.Float8E4M3FN, (g, r, c), 1),
        fake(cutlass.Float32, (g, rb, cb), 4),
        cutlass.Int32(1),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi),
    )
    return cute.compile(BlockQuantizeSm90(block_rows), *args, options="--enable-tvm-ffi" if tvm_ffi else "")


def block_quantize_sm90(x: torch.Tensor, block_rows: int):
    """(data, scale_inv) of ``x`` in E4M3 blocks of ``block_rows`` x 128 (see the module)."""
    if block_rows not in (1, 128):
        raise ValueError(f"{_NAME}: block_rows must be 1 or 128, got {block_rows}")
    ndim = 2 if block_rows == 1 else 3
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_NAME}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{_NAME}: x has dtype {x.dtype}, supported: bfloat16, float16")
    if x.get_device() < 0:
        raise ValueError(f"{_NAME}: x must be on a CUDA device, got {x.device}")
    if x.dim() != ndim:
        raise ValueError(f"{_NAME}: x must be {ndim}-D for block_rows={block_rows}, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{_NAME}: x must be contiguous")
    x3 = x if ndim == 3 else x.unsqueeze(0)
    g, r, c = x3.shape
    data = torch.empty(x3.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale_inv = torch.empty(g, -(-r // block_rows), -(-c // 128), dtype=torch.float32, device=x.device)
    if x3.numel():
        fn = compile_block_quantize(x.dtype, block_rows)
        blocks = scale_inv.numel()
        ctas = min(-(-blocks // 4), num_sms(x.get_device()) * CTAS_PER_SM)
        fn(x3, data, scale_inv, ctas) if tvm_ffi_available() else _call_classic(fn, x3, data, scale_inv, ctas)
    if ndim == 2:
        return data[0], scale_inv[0]
    return data, scale_inv


def _call_classic(fn, x3, data, scale_inv, ctas):
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    def cv(t, align):
        return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=2)

    stream = cuda.CUstream(torch.cuda.current_stream(x3.device).cuda_stream)
    fn(cv(x3, 2), cv(data, 1), cv(scale_inv, 4), cutlass.Int32(ctas), stream)
