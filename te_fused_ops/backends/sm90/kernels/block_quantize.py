"""Torch-facing wrappers of the E4M3 block-quantization kernels (`block_quantize_sm90`).

``block_quantize_sm90(x, block_rows, power_2_scales=False)``: x (M, K) with 1 x 128 blocks
(block_rows=1, activations) or (G, N, K) with 128 x 128 blocks (block_rows=128, weights) ->
(data like x in E4M3, scale_inv float32 (M, ceil(K/128)) or (G, ceil(N/128), ceil(K/128))), bit for
bit the torch quantizer of ``Float8BlockScaling(power_2_scales)``; weights with ``transposed=True``
also (data_t (G, K, N), scale_inv_t (G, ceil(K/128), ceil(N/128))), each group transposed (the
FP8 data gradient's K-major operand), from the same read.

``tensor_quantize_sm90(x, block_rows, offsets=None, amax_parts=None)``: the same shapes with one
scale for the whole tensor (``Float8CurrentScaling``; with ``offsets`` the amax covers x (M, K)'s
grouped rows only), its multipliers broadcast to the grid the FP8 GEMM reads: an amax launch, then
the cast; or only the cast, from the amax parts the producing GEMM's epilogue wrote.

``block_dequantize_sm90(data, scale_inv, dtype)``: the inverse for 1 x 128 blocks, data (M, K)
E4M3 and multipliers (M, ceil(K/128)) -> (M, K) ``dtype``, bit for bit
`QuantizedTensor.dequantize` (any recipe whose multipliers are given per 1 x 128 block).

``block_columns_sm90(x, offsets, ...)``: the per-group column-wise 1 x 128 E4M3 copy of x (M, K)
(bf16/fp16, or E4M3 with its row-wise multipliers) in the block-padded layout the FP8 weight
gradient reads (`BlockColumns`), optionally with x's row-wise copy from the same read.

K is a multiple of 8. One launch each, no host sync. Compiled once per configuration, all
extents symbolic.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .launch import DTYPES, cached_kernel, compile_launcher, fake_tensor, num_sms, tvm_ffi_available

_NAME = "block_quantize_sm90"
_DEQUANT_NAME = "block_dequantize_sm90"
CTAS_PER_SM = 8
AMAX_CTAS_PER_SM = 2  # the tensor amax's grid: each cast CTA reduces one part per amax CTA
WARPS_PER_CTA = 8
VEC = 8  # columns per lane: the kernels' 16-byte accesses need K % 8 == 0


def _fake_x(dtype, g, r, c):
    """A fake bf16/fp16 (G, R, C) tensor for `cute.compile`."""
    import cutlass

    return fake_tensor({torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype], (g, r, c))


def _compile(kernel, dtype, data_first: bool, tvm_ffi, extra=(), transposed=None):
    """cute.compile ``kernel`` on symbolic (G, R, C) operands: (x, data, scale_inv, *extra) or,
    with ``data_first``, (data, scale_inv, out); ``transposed`` (True, False: R and C multiples of
    16 and a (G, C, R) copy with its scales after ``extra``, or None for neither)."""
    import cutlass
    import cutlass.cute as cute

    g, rb, cb = (cute.sym_int() for _ in range(3))
    r = cute.sym_int(divisibility=16) if transposed else cute.sym_int()
    c = cute.sym_int(divisibility=16 if transposed else VEC)
    x, data = _fake_x(dtype, g, r, c), fake_tensor(cutlass.Float8E4M3FN, (g, r, c))
    scale_inv = fake_tensor(cutlass.Float32, (g, rb, cb), 4)
    tensors = (data, scale_inv, x) if data_first else (x, data, scale_inv)
    if transposed is not None:
        copy = (fake_tensor(cutlass.Float8E4M3FN, (g, c, r)), fake_tensor(cutlass.Float32, (g, cb, rb), 4))
        extra = (*extra, *(copy if transposed else (None, None)))
    return compile_launcher(kernel, (*tensors, *extra, cutlass.Int32(1)), tvm_ffi)


@cached_kernel
def compile_block_quantize(dtype, block_rows, tvm_ffi=None, power_2_scales=False, tensor_scale=False,
                           transposed=False):
    """Compile (once per configuration) and return fn(x (G, R, C), data, scale_inv, amax_parts,
    data_t, scale_inv_t, max_ctas); amax_parts (P,) float32 with ``tensor_scale``, else None;
    data_t (G, C, R) and scale_inv_t with ``transposed``, else None."""
    import cutlass
    import cutlass.cute as cute

    from .block_quantize_sm90 import BlockQuantizeSm90

    parts = fake_tensor(cutlass.Float32, (cute.sym_int(),), 4) if tensor_scale else None
    kernel = BlockQuantizeSm90(block_rows, power_2_scales, tensor_scale, transposed)
    return _compile(kernel, dtype, False, tvm_ffi, (parts,), transposed)


@cached_kernel
def compile_tensor_amax(dtype, with_offsets, tvm_ffi=None):
    """Compile (once per configuration) and return fn(x (G, R, C), offsets (G+1,) int32 or None,
    parts (P,) float32); the grid is P CTAs."""
    import cutlass
    import cutlass.cute as cute

    from .block_quantize_sm90 import TensorAmaxSm90

    x = _fake_x(dtype, cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=VEC))
    offsets = fake_tensor(cutlass.Int32, (cute.sym_int(),), 4) if with_offsets else None
    parts = fake_tensor(cutlass.Float32, (cute.sym_int(),), 4)
    return compile_launcher(TensorAmaxSm90(), (x, offsets, parts), tvm_ffi)


@cached_kernel
def compile_block_dequantize(dtype, tvm_ffi=None):
    """Compile (once per output dtype) and return fn(data (G, R, C), scale_inv, out, max_ctas)."""
    from .block_quantize_sm90 import BlockDequantizeSm90

    return _compile(BlockDequantizeSm90(torch.finfo(dtype).max), dtype, True, tvm_ffi)


@cached_kernel
def compile_block_columns(dtype, from_rows, rows, power_2_scales, tvm_ffi=None):
    """Compile (once per configuration) and return fn(x (M, C), x multipliers or None, offsets
    (G+1,), data (C, 128 blocks), scale_inv (blocks, C), row data or None, row scale_inv or None,
    max_ctas), x E4M3 with ``from_rows``, else ``dtype``; the row-wise copy (M, C) and its
    multipliers (M, ceil(C / 128)) with ``rows`` (16-bit x)."""
    import cutlass
    import cutlass.cute as cute

    from .block_quantize_sm90 import BlockColumnQuantizeSm90

    m, c, cb, blocks = cute.sym_int(), cute.sym_int(divisibility=VEC), cute.sym_int(), cute.sym_int()
    padded = cute.sym_int(divisibility=128)
    f8 = cutlass.Float8E4M3FN
    source = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]
    x = fake_tensor(f8 if from_rows else source, (m, c))
    x_scale = fake_tensor(cutlass.Float32, (m, cb), 4) if from_rows else None
    columns = (fake_tensor(cutlass.Int32, (cute.sym_int(),), 4), fake_tensor(f8, (c, padded)),
               fake_tensor(cutlass.Float32, (blocks, c)))
    row_outputs = (fake_tensor(f8, (m, c)), fake_tensor(cutlass.Float32, (m, cb), 4)) if rows else (None, None)
    args = (x, x_scale, *columns, *row_outputs, cutlass.Int32(1))
    return compile_launcher(BlockColumnQuantizeSm90(from_rows, power_2_scales, rows), args, tvm_ffi)


def _ctas(work_items: int, device_index: int) -> int:
    return max(1, min(-(-work_items // WARPS_PER_CTA), num_sms(device_index) * CTAS_PER_SM))


def _launch(fn, tensors, ctas=None):
    """fn(*tensors[, ctas]) through TVM-FFI or the classic launcher (``ctas``: the grid, when the
    kernel takes it)."""
    args = tensors if ctas is None else (*tensors, ctas)
    fn(*args) if tvm_ffi_available() else _call_classic(fn, tensors, ctas)


def _cast_input(name: str, x, block_rows: int):
    """x (M, K) for block_rows 1, (G, N, K) for 128, checked, as (G, R, C)."""
    if block_rows not in (1, 128):
        raise ValueError(f"{name}: block_rows must be 1 or 128, got {block_rows}")
    ndim = 2 if block_rows == 1 else 3
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in DTYPES:
        raise TypeError(f"{name}: x has dtype {x.dtype}, supported: bfloat16, float16")
    if x.get_device() < 0:
        raise ValueError(f"{name}: x must be on a CUDA device, got {x.device}")
    if x.dim() != ndim:
        raise ValueError(f"{name}: x must be {ndim}-D for block_rows={block_rows}, got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: x must be contiguous")
    if x.shape[-1] % VEC or (x.numel() and x.data_ptr() % 16):
        raise ValueError(f"{name}: x needs a last dim that is a multiple of 8 and a 16-byte aligned start, got "
                         f"shape {tuple(x.shape)}")
    return x if ndim == 3 else x.unsqueeze(0)


def _check_vector(name: str, arg: str, t, dtype, kind: str, device):
    """TypeError / ValueError naming ``arg`` unless ``t`` is a contiguous 1-D ``dtype`` tensor
    (``kind``: "a float32", "an int32") on ``device``."""
    if not isinstance(t, torch.Tensor) or t.dtype != dtype:
        raise TypeError(f"{name}: {arg} must be {kind} tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if t.dim() != 1 or not t.is_contiguous() or t.device != device:
        raise ValueError(f"{name}: {arg} must be a contiguous 1-D tensor on x's device, got shape {tuple(t.shape)} "
                         f"on {t.device}")


def _cast_outputs(x3, block_rows):
    g, r, c = x3.shape
    data = torch.empty(x3.shape, dtype=torch.float8_e4m3fn, device=x3.device)
    scale_inv = torch.empty(g, -(-r // block_rows), -(-c // 128), dtype=torch.float32, device=x3.device)
    return data, scale_inv


def _row_item_ctas(x3):
    """CTAs of a launch whose warps take items of 8 rows x 128 columns."""
    g, r, c = x3.shape
    return _ctas(g * -(-r // 8) * -(-c // 128), x3.get_device())


def _as_given(x, data, scale_inv, copy=(None, None)):
    """The cast's outputs shaped as x was given, followed by the transposed copy when made."""
    if copy[0] is not None:
        return data, scale_inv, *copy
    return (data[0], scale_inv[0]) if x.dim() == 2 else (data, scale_inv)


def block_quantize_sm90(x: torch.Tensor, block_rows: int, power_2_scales: bool = False, transposed: bool = False,
                        out: tuple = None):
    """(data, scale_inv) of ``x`` in E4M3 blocks of ``block_rows`` x 128 (see the module); with
    ``transposed`` (weights (G, N, K), N and K multiples of 16) also (data_t (G, K, N), scale_inv_t
    (G, ceil(K/128), ceil(N/128))), each group of both transposed, from the same read. ``out``:
    tensors like those this call returns (an earlier call's), written instead and returned."""
    x3 = _cast_input(_NAME, x, block_rows)
    data, scale_inv, copy = _cast_targets(_NAME, x, x3, block_rows, transposed, out)
    if x3.numel():
        if block_rows == 1:  # a warp per 8 rows of a 128-column block
            ctas = _row_item_ctas(x3)
        else:  # a CTA per block
            ctas = _block_ctas(scale_inv)
        fn = compile_block_quantize(x.dtype, block_rows, None, bool(power_2_scales), False, bool(transposed))
        _launch(fn, (x3, data, scale_inv, None, *copy), ctas)
    return _as_given(x, data, scale_inv, copy)


def _cast_targets(name, x, x3, block_rows, transposed, out):
    """(data, scale_inv, transposed copy or (None, None)) that a block cast of ``x`` (as x3)
    writes: new tensors, or ``out`` (as `_as_given` shapes them) after its checks."""
    if out is None:
        data, scale_inv = _cast_outputs(x3, block_rows)
        copy = _transposed_outputs(name, x, x3, block_rows, data, scale_inv) if transposed else (None, None)
        return data, scale_inv, copy
    want = _as_given(x, *_cast_targets(name, x, x3.new_empty(x3.shape, device="meta"), block_rows, transposed, None))
    if not isinstance(out, (tuple, list)) or len(out) != len(want):
        raise TypeError(f"{name}: out must be a tuple of {len(want)} tensors (what this call returns), got "
                        f"{type(out).__name__}" + (f" of {len(out)}" if isinstance(out, (tuple, list)) else ""))
    for i, (o, w) in enumerate(zip(out, want)):
        if (not isinstance(o, torch.Tensor) or o.dtype != w.dtype or o.shape != w.shape or o.device != x.device
                or not o.is_contiguous() or (o.numel() and o.data_ptr() % 16)):
            got = f"{o.dtype} {tuple(o.shape)} on {o.device}" if isinstance(o, torch.Tensor) else type(o).__name__
            raise ValueError(f"{name}: out[{i}] must be a contiguous, 16-byte aligned {w.dtype} tensor of shape "
                             f"{tuple(w.shape)} on x's device, got {got}")
    if x.dim() == 2:
        return out[0].unsqueeze(0), out[1].unsqueeze(0), (None, None)
    return out[0], out[1], tuple(out[2:]) if transposed else (None, None)


def _transposed_outputs(name, x, x3, block_rows, data, scale_inv):
    """Empty (data_t (G, C, R), scale_inv_t) for a cast of ``x`` (as x3) with ``transposed``, after its checks."""
    if block_rows != 128 or x3.shape[1] % 16 or x3.shape[2] % 16:
        raise ValueError(f"{name}: transposed=True needs a (G, N, K) weight (block_rows=128) with N and K multiples "
                         f"of 16, got block_rows={block_rows}, shape {tuple(x.shape)}")
    return (torch.empty(x3.shape[0], x3.shape[2], x3.shape[1], dtype=data.dtype, device=x3.device),
            scale_inv.new_empty(scale_inv.shape[0], scale_inv.shape[2], scale_inv.shape[1]))


def _block_ctas(scale_inv):
    """CTAs of a launch with a CTA per 128 x 128 block: one wave, each prefetching its next block."""
    from .block_quantize_sm90 import BLOCK_CTAS_PER_SM

    return min(scale_inv.numel(), num_sms(scale_inv.get_device()) * BLOCK_CTAS_PER_SM)


def tensor_quantize_sm90(x: torch.Tensor, block_rows: int, offsets: torch.Tensor = None,
                         amax_parts: torch.Tensor = None, transposed: bool = False, out: tuple = None):
    """(data, multipliers) of ``x`` cast with one scale (fp8_current): ``scale_inv = amax / 448``
    (1 where 0), amax over x's finite values, or with ``offsets`` (G+1,) int32 (x (M, K) only)
    over its rows below ``clamp(max(offsets), 0, M)``; multipliers that scale in every block of
    the 1 x 128 / 128 x 128 grid of `block_quantize_sm90`. Two launches, no host sync.
    ``transposed``: as `block_quantize_sm90`'s, (data, multipliers, data_t, multipliers_t).

    ``amax_parts``: (P,) float32 whose max is that amax (the ``act_amax`` output of the GEMM that
    wrote x); then only the cast runs and ``offsets`` is not used. ``out``: as
    `block_quantize_sm90`'s."""
    name = "tensor_quantize_sm90"
    x3 = _cast_input(name, x, block_rows)
    if amax_parts is not None:
        _check_vector(name, "amax_parts", amax_parts, torch.float32, "a float32", x.device)
    elif offsets is not None:
        _check_vector(name, "offsets", offsets, torch.int32, "an int32", x.device)
        if block_rows != 1:
            raise ValueError(f"{name}: offsets group the rows of a 2-D x (block_rows=1)")
    data, scale_inv, copy = _cast_targets(name, x, x3, block_rows, transposed, out)
    if not x3.numel():
        for scales in (scale_inv, copy[1]) if transposed else (scale_inv,):
            scales.fill_(1.0)
        return _as_given(x, data, scale_inv, copy)
    ctas = _row_item_ctas(x3)
    parts = amax_parts
    if parts is None:
        parts = torch.empty(min(ctas, num_sms(x.get_device()) * AMAX_CTAS_PER_SM), dtype=torch.float32, device=x.device)
        _launch(compile_tensor_amax(x.dtype, offsets is not None), (x3, offsets, parts))
    fn = compile_block_quantize(x.dtype, block_rows, None, False, True, bool(transposed))
    _launch(fn, (x3, data, scale_inv, parts, *copy), _block_ctas(scale_inv) if transposed else ctas)
    return _as_given(x, data, scale_inv, copy)


def block_dequantize_sm90(data: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(M, K) ``dtype`` values of E4M3 ``data`` (M, K) with float32 multipliers (M, ceil(K/128))."""
    if dtype not in DTYPES:
        raise TypeError(f"{_DEQUANT_NAME}: dtype must be bfloat16 or float16, got {dtype}")
    for arg, t, want in (("data", data, torch.float8_e4m3fn), ("scale_inv", scale_inv, torch.float32)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{_DEQUANT_NAME}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != want:
            raise TypeError(f"{_DEQUANT_NAME}: {arg} has dtype {t.dtype}, expected {want}")
        if t.get_device() < 0 or t.device != data.device:
            raise ValueError(f"{_DEQUANT_NAME}: {arg} must be on data's CUDA device, got {t.device}")
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"{_DEQUANT_NAME}: {arg} must be a contiguous 2-D tensor, got shape {tuple(t.shape)}")
    m, k = data.shape
    if scale_inv.shape != (m, -(-k // 128)):
        raise ValueError(f"{_DEQUANT_NAME}: scale_inv must have shape {(m, -(-k // 128))}, got {tuple(scale_inv.shape)}")
    if k % VEC or (data.numel() and data.data_ptr() % 16):
        raise ValueError(f"{_DEQUANT_NAME}: data needs a last dim that is a multiple of 8 and a 16-byte aligned start")
    out = torch.empty(m, k, dtype=dtype, device=data.device)
    if data.numel():
        tensors = (data.unsqueeze(0), scale_inv.unsqueeze(0), out.unsqueeze(0))
        _launch(compile_block_dequantize(dtype), tensors, _ctas(-(-m // 2) * scale_inv.shape[1], data.get_device()))
    return out


class BlockColumns(NamedTuple):
    """A per-group column-wise 1 x 128 E4M3 copy of x (M, C), block-padded (`block_columns_sm90`):
    data (C, 128 * blocks) with block b in columns [128 b, 128 b + 128), scale_inv (blocks, C)
    float32, blocks = ceil(M / 128) + G; num_tokens = M."""

    data: torch.Tensor
    scale_inv: torch.Tensor
    num_tokens: int


COLUMN_MAX_GROUPS = 512  # = block_quantize_sm90.COLUMN_SCAN_GROUPS
COLUMN_CTAS_PER_SM = 2  # BlockColumnQuantizeSm90: 512 threads, two 32 KB tiles


def block_columns_sm90(x, offsets, *, x_scale_inv=None, rows=False, power_2_scales=False):
    """x (M, C)'s per-group column-wise copy for the FP8 weight gradient (`BlockColumns`).

    x: bf16/fp16, or float8_e4m3fn row-wise data with ``x_scale_inv`` (M, ceil(C/128)) float32
    (the copy is then made from the dequantized values, as `add_columnwise` does); offsets (G+1,)
    int32, G <= 512 (group g's tokens form ceil(rows_g / 128) blocks from its first row; rows
    past offsets[G] are not read). C a multiple of 8. ``rows`` (16-bit x): also return x's
    row-wise copy (data (M, C) E4M3, scale_inv (M, ceil(C/128))) of the grouped rows from the
    same read: (columns, data, scale_inv). Bit for bit the torch quantizer of
    ``Float8BlockScaling(power_2_scales)``. One launch, no host sync.
    """
    name = "block_columns_sm90"
    from_rows = x_scale_inv is not None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in ((torch.float8_e4m3fn,) if from_rows else DTYPES):
        want = "float8_e4m3fn (x_scale_inv given)" if from_rows else "bfloat16 or float16"
        raise TypeError(f"{name}: x has dtype {x.dtype}, expected {want}")
    if x.get_device() < 0 or x.dim() != 2 or not x.is_contiguous():
        raise ValueError(f"{name}: x must be a contiguous 2-D CUDA tensor, got shape {tuple(x.shape)} on {x.device}")
    m, c = x.shape
    if c % VEC or (x.numel() and x.data_ptr() % 16):
        raise ValueError(f"{name}: x needs a last dim that is a multiple of 8 and a 16-byte aligned start")
    if rows and from_rows:
        raise ValueError(f"{name}: rows=True needs a bf16/fp16 x (the row-wise copy is x_scale_inv's)")
    if from_rows and (not isinstance(x_scale_inv, torch.Tensor) or x_scale_inv.dtype != torch.float32
                      or tuple(x_scale_inv.shape) != (m, -(-c // 128)) or not x_scale_inv.is_contiguous()
                      or x_scale_inv.device != x.device):
        raise ValueError(f"{name}: x_scale_inv must be a contiguous float32 ({m}, {-(-c // 128)}) tensor on x's device")
    _check_vector(name, "offsets", offsets, torch.int32, "an int32", x.device)
    g = offsets.shape[0] - 1
    if not 1 <= g <= COLUMN_MAX_GROUPS:
        raise ValueError(f"{name}: offsets must have G+1 entries with 1 <= G <= {COLUMN_MAX_GROUPS}, got "
                         f"{offsets.shape[0]}")
    blocks = -(-m // 128) + g
    data = torch.empty(c, 128 * blocks, dtype=torch.float8_e4m3fn, device=x.device)
    scale_inv = torch.empty(blocks, c, dtype=torch.float32, device=x.device)
    row_outputs = (None, None)
    if rows:
        row_outputs = (torch.empty(m, c, dtype=torch.float8_e4m3fn, device=x.device),
                       torch.empty(m, -(-c // 128), dtype=torch.float32, device=x.device))
    if x.numel():
        dtype = torch.bfloat16 if from_rows else x.dtype
        fn = compile_block_columns(dtype, from_rows, bool(rows), bool(power_2_scales))
        ctas = min(blocks * -(-c // 128), num_sms(x.get_device()) * COLUMN_CTAS_PER_SM)
        _launch(fn, (x, x_scale_inv, offsets, data, scale_inv, *row_outputs), ctas)
    columns = BlockColumns(data, scale_inv, m)
    return (columns, *row_outputs) if rows else columns


def _call_classic(fn, tensors, ctas):
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    stream = cuda.CUstream(torch.cuda.current_stream(tensors[0].device).cuda_stream)

    def convert(t):
        if t is None:
            return None
        # float32 scales and int32 offsets: 4-byte aligned; data (bf16 / fp16 / E4M3 / uint8): 16-byte
        aligned = from_dlpack(t, assumed_align=4 if t.dtype in (torch.float32, torch.int32) else 16)
        return aligned.mark_layout_dynamic(leading_dim=t.dim() - 1)

    grid = () if ctas is None else (cutlass.Int32(ctas),)
    fn(*(convert(t) for t in tensors), *grid, stream)
