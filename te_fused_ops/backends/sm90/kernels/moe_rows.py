"""Torch-facing wrappers of the MoE row-movement kernels (`moe_rows_sm90`).

``scatter_rows(x, rows, num_kept, out=None, scale=None, y=None, dot_out=None)``: token order ->
expert order, x (T, H) -> out (M, H), M = T * k: the permute's forward, and (x = dy, ``scale`` =
the router probs, ``y`` = the experts' output, ``dot_out`` = d_probs) the combine's backward.

``scatter_cast_rows(x, rows, num_kept, power_2_scales=False, num_rows=None)``: the same rows cast
to E4M3 in 1x128 blocks on the way (each token cast once): (data (M, H), scale_inv (M,
ceil(H/128))), the FP8 dispatch (and the combine's backward feeding an FP8 GEMM).

``gather_sum(src, rows, num_kept, out=None, weights=None)``: expert order -> token order, src
(M, H) -> out (T, H), the weighted sum of each token's kept rows: the combine's forward, and
(no weights) the permute's backward.

rows (T, k) int32 with 1 <= k <= 16, num_kept (1,) int32 (a view such as ``offsets[-1:]`` will
do), scale / weights / dot_out (T, k) float32; H a multiple of 8. Slots whose row is outside
[0, min(num_kept, M)) are dropped (see `moe_rows_sm90`). One launch each, on the current stream,
no host sync, nothing allocated but ``out`` when it is None. Compiled once per configuration, T,
k, H and M symbolic; launched through TVM-FFI.
"""

from __future__ import annotations

import torch

from .launch import (
    LaunchMemo,
    call_signature,
    check_input,
    check_tensor,
    cached_kernel,
    compile_launcher,
    fake_tensor,
)

MAX_SLOTS = 16  # = moe_rows_sm90.MAX_SLOTS
VEC = 8  # = moe_rows_sm90.VEC: H % 8 == 0 for the 16-byte accesses

_MEMO = LaunchMemo()  # argument signature -> validated launcher (both wrappers; keys differ)


def _fake_operands(dtype):
    """Symbolic (x (T, H), rows (T, k), num_kept (1,), expert-ordered (M, H), slot floats (T, k))."""
    import cutlass
    from cutlass import cute

    element = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]
    t, k, m, h = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int(divisibility=VEC)
    return (fake_tensor(element, (t, h)), fake_tensor(cutlass.Int32, (t, k), 4),
            fake_tensor(cutlass.Int32, (1,), 4), fake_tensor(element, (m, h)),
            fake_tensor(cutlass.Float32, (t, k), 4))


@cached_kernel
def compile_scatter_rows(dtype, scaled: bool, dot: bool, tvm_ffi=True):
    """Compile (once per configuration) and return fn(x, rows, num_kept, out, scale, y, dot_out),
    scale None unless ``scaled``, y and dot_out None unless ``dot``."""
    from .moe_rows_sm90 import ScatterRowsSm90

    x, rows, num_kept, expert_rows, slot_floats = _fake_operands(dtype)
    args = (x, rows, num_kept, expert_rows, slot_floats if scaled else None,
            expert_rows if dot else None, slot_floats if dot else None)
    return compile_launcher(ScatterRowsSm90(scaled, dot), args, tvm_ffi)


@cached_kernel
def compile_scatter_cast_rows(dtype, power_2_scales: bool, tvm_ffi=True):
    """Compile (once per configuration) and return fn(x, rows, num_kept, data, scale_inv)."""
    import cutlass
    from cutlass import cute

    from .moe_rows_sm90 import ScatterCastRowsSm90

    x, rows, num_kept, _, _ = _fake_operands(dtype)
    m, h, blocks = cute.sym_int(), x.shape[1], cute.sym_int()
    data = fake_tensor(cutlass.Float8E4M3FN, (m, h), 8)
    scale_inv = fake_tensor(cutlass.Float32, (m, blocks), 4)
    return compile_launcher(ScatterCastRowsSm90(power_2_scales), (x, rows, num_kept, data, scale_inv), tvm_ffi)


@cached_kernel
def compile_gather_sum(dtype, weighted: bool, tvm_ffi=True):
    """Compile (once per configuration) and return fn(src, rows, num_kept, out, weights), weights
    None unless ``weighted``."""
    from .moe_rows_sm90 import GatherSumSm90

    out, rows, num_kept, src, slot_floats = _fake_operands(dtype)
    return compile_launcher(GatherSumSm90(weighted), (src, rows, num_kept, out, slot_floats if weighted else None),
                            tvm_ffi)


def _check_slot_tensor(fn_name: str, t, arg: str, dtype, shape, device_index: int) -> None:
    """TypeError/ValueError naming ``arg`` unless ``t`` is a contiguous ``dtype`` tensor of
    ``shape`` on cuda:``device_index`` (4-byte elements: any view is aligned enough)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn_name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{fn_name}: {arg} has dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn_name}: {arg} must have shape {shape}, got {tuple(t.shape)}")
    if t.get_device() != device_index:
        raise ValueError(f"{fn_name}: {arg} is on {t.device}, expected cuda:{device_index}")
    if not t.is_contiguous():
        raise ValueError(f"{fn_name}: {arg} must be contiguous")


def _check_routing(fn_name: str, rows, num_kept, device_index: int, num_tokens=None):
    """Checks rows (T, k) int32 (T = ``num_tokens`` when given), 1 <= k <= 16, and num_kept (1,)
    int32; returns (T, k)."""
    if isinstance(rows, torch.Tensor) and rows.dim() != 2:
        raise ValueError(f"{fn_name}: rows must be 2-D (T, k), got shape {tuple(rows.shape)}")
    tokens, k = rows.shape if isinstance(rows, torch.Tensor) else (0, 0)
    tokens = tokens if num_tokens is None else num_tokens
    _check_slot_tensor(fn_name, rows, "rows", torch.int32, (tokens, k), device_index)
    if not 1 <= k <= MAX_SLOTS:
        raise ValueError(f"{fn_name}: rows has k={k} slots per token, supported: 1..{MAX_SLOTS}")
    _check_slot_tensor(fn_name, num_kept, "num_kept", torch.int32, (1,), device_index)
    return tokens, k


def _check_rows_of(fn_name: str, t, arg: str, dtype, shape, device_index: int) -> None:
    """`launch.check_tensor` (2-D ``dtype``, contiguous, 16-byte aligned) and ``shape``."""
    check_tensor(fn_name, t, arg, dtype, 2, device_index)
    if tuple(t.shape) != shape:
        raise ValueError(f"{fn_name}: {arg} must have shape {shape}, got {tuple(t.shape)}")


def _check_hidden(fn_name: str, t, arg: str) -> None:
    if t.shape[1] == 0 or t.shape[1] % VEC:
        raise ValueError(f"{fn_name}: H={t.shape[1]} ({arg}.shape[1]) must be a positive multiple of {VEC}")


def _scatter_launch(x, rows, num_kept, out, scale, y, dot_out, num_rows=None):
    """Every check of `scatter_rows`; (launcher or None when T == 0, out's shape (M, H))."""
    name = "scatter_rows"
    dev = check_input(name, x, "x")
    _check_hidden(name, x, "x")
    tokens, hidden = x.shape
    _, k = _check_routing(name, rows, num_kept, dev, tokens)
    shape = (tokens * k if num_rows is None else num_rows, hidden)
    if out is not None:
        _check_rows_of(name, out, "out", x.dtype, shape, dev)
    if scale is not None:
        _check_slot_tensor(name, scale, "scale", torch.float32, (tokens, k), dev)
    if (y is None) != (dot_out is None):
        raise ValueError(f"{name}: y and dot_out go together (got only {'y' if dot_out is None else 'dot_out'})")
    if y is not None:
        _check_rows_of(name, y, "y", x.dtype, shape, dev)
        _check_slot_tensor(name, dot_out, "dot_out", torch.float32, (tokens, k), dev)
    fn = compile_scatter_rows(x.dtype, scale is not None, y is not None) if tokens else None
    return fn, shape


def _scatter_cast_launch(x, rows, num_kept, power_2_scales, num_rows=None):
    """Every check of `scatter_cast_rows`; (launcher or None when T == 0, data's shape (M, H),
    scale_inv's shape (M, ceil(H/128)))."""
    name = "scatter_cast_rows"
    dev = check_input(name, x, "x")
    _check_hidden(name, x, "x")
    tokens, hidden = x.shape
    _, k = _check_routing(name, rows, num_kept, dev, tokens)
    if not isinstance(power_2_scales, bool):
        raise TypeError(f"{name}: power_2_scales must be a bool, got {type(power_2_scales).__name__}")
    m = tokens * k if num_rows is None else num_rows
    fn = compile_scatter_cast_rows(x.dtype, power_2_scales) if tokens else None
    return fn, (m, hidden), (m, -(-hidden // 128))


def _gather_launch(src, rows, num_kept, out, weights):
    """Every check of `gather_sum`; (launcher or None when T == 0, out's shape (T, H))."""
    name = "gather_sum"
    dev = check_input(name, src, "src")
    _check_hidden(name, src, "src")
    tokens, k = _check_routing(name, rows, num_kept, dev)
    shape = (tokens, src.shape[1])
    if out is not None:
        _check_rows_of(name, out, "out", src.dtype, shape, dev)
    if weights is not None:
        _check_slot_tensor(name, weights, "weights", torch.float32, (tokens, k), dev)
    fn = compile_gather_sum(src.dtype, weights is not None) if tokens else None
    return fn, shape


def _run(fn, checks, check_args, tensors):
    """Launch ``fn`` (None: T == 0, nothing to launch) on ``tensors``; when the compiled entry
    rejects an argument, rerun ``checks(*check_args)``, which raise the error naming it."""
    if fn is None:
        return
    try:
        fn(*tensors)
    except Exception:
        checks(*check_args)
        raise


def scatter_rows(x, rows, num_kept, out=None, scale=None, y=None, dot_out=None, num_rows=None):
    """Token order -> expert order: for each slot (t, j) with row r = rows[t, j], out[r] = x[t]
    (times scale[t, j] in float32, rounded once) when kept (0 <= r < num_kept[0]), out[r] = 0
    when dropped and 0 <= r < M. With ``y`` (M, H) and ``dot_out`` (T, k) float32 also
    dot_out[t, j] = <x[t], y[r]> in float32 for kept slots, 0 for dropped ones. Rows no slot
    names are not written.

    x (T, H) bf16/fp16; rows (T, k) int32; num_kept (1,) int32; out (M, H) like x, M = ``num_rows``
    (default T * k), allocated when None; scale (T, k) float32 or None. Reads each x row once.
    Returns out. Checks run once per argument signature (`launch.call_signature`); repeats only launch.
    """
    key = (call_signature(True, x, rows, num_kept, out, scale, y, dot_out), "scatter_rows", num_rows)
    args = (x, rows, num_kept, out, scale, y, dot_out, num_rows)
    fn, shape = _MEMO.get(key) or _MEMO.put(key, _scatter_launch(*args))
    out = x.new_empty(shape) if out is None else out
    _run(fn, _scatter_launch, args, (x, rows, num_kept, out, scale, y, dot_out))
    return out


def scatter_cast_rows(x, rows, num_kept, power_2_scales=False, num_rows=None):
    """`scatter_rows` with the rows cast to E4M3 in 1x128 blocks on the way: each token's row of x
    cast once (bit for bit `block_quantize_sm90(x, 1, power_2_scales)`'s row) and its data and
    block multipliers written to the row of each kept slot; a dropped slot's row in [0, M) gets
    zero data and multipliers; rows no slot names are not written.

    x (T, H) bf16/fp16; rows (T, k) int32; num_kept (1,) int32; M = ``num_rows`` (default T * k).
    Returns (data (M, H) float8_e4m3fn, scale_inv (M, ceil(H/128)) float32), both allocated. Reads
    each x row once. Checks run once per argument signature; repeats only launch.
    """
    key = (call_signature(True, x, rows, num_kept), "scatter_cast_rows", power_2_scales, num_rows)
    args = (x, rows, num_kept, power_2_scales, num_rows)
    fn, data_shape, scale_shape = _MEMO.get(key) or _MEMO.put(key, _scatter_cast_launch(*args))
    data = torch.empty(data_shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale_inv = torch.empty(scale_shape, dtype=torch.float32, device=x.device)
    _run(fn, _scatter_cast_launch, args, (x, rows, num_kept, data, scale_inv))
    return data, scale_inv


def gather_sum(src, rows, num_kept, out=None, weights=None):
    """Expert order -> token order: out[t] = sum over kept slots j (0 <= rows[t, j] < num_kept[0])
    of weights[t, j] * src[rows[t, j]] (weights None: 1), in slot order, float32, rounded once; a
    token with no kept slot gets zeros. Deterministic (no atomics).

    src (M, H) bf16/fp16 (any M); rows (T, k) int32; num_kept (1,) int32; out (T, H) like
    src, allocated when None; weights (T, k) float32 or None. Returns out. Checks run once per
    argument signature (`launch.call_signature`); repeats only launch.
    """
    key = (call_signature(True, src, rows, num_kept, out, weights), "gather_sum")
    args = (src, rows, num_kept, out, weights)
    fn, shape = _MEMO.get(key) or _MEMO.put(key, _gather_launch(*args))
    out = src.new_empty(shape) if out is None else out
    _run(fn, _gather_launch, args, (src, rows, num_kept, out, weights))
    return out
