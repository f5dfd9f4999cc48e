"""Torch-facing wrappers of the sm90 grouped weight-gradient kernel: checks, config, compile cache.

    dW[g] = dy[s:e].T @ x[s:e]      s, e = offsets[g], offsets[g+1], clamped to [0, M] on the device

`grouped_wgrad_sm90` reads bf16/fp16 dy and x in place; `grouped_wgrad_gathered_sm90` reads x's
rows by index (x[index] never written); `grouped_wgrad_fp8_sm90` reads their per-group
column-wise E4M3 copies (block-scaled FP8, 1 x 128 token blocks).

Importable without cutlass. Kernels are compiled once per (dtype, tile_n, main_grad, cluster_m, FP8,
TVM-FFI) with M, N, K and G symbolic; the persistent grid size (SM count minus the SM margin) is a
launch argument, so margins share one compiled kernel. The launch depends on tensor shapes only.
"""

from __future__ import annotations

import functools

import torch

from . import sm90_unavailable_reason, tuning
from .launch import (
    DTYPES,
    LaunchMemo,
    check_input,
    check_tensor,
    cached_kernel,
    compile_launcher,
    fake_tensor,
    num_sms,
    resolve_sm_margin,
    call_signature,
    tvm_ffi_available,
)

_NAME = "grouped_wgrad_sm90"
_FP8_NAME = "grouped_wgrad_fp8_sm90"
_GATHERED_NAME = "grouped_wgrad_gathered_sm90"
_MAX_ROWS = 2**30  # the ragged token view's mode extent
FP8_MAX_GROUPS = 512  # FP8 wgrad and the cast epilogues scan the groups into shared memory: group_tile_scheduler.SORT_MAX_G


def sm90_wgrad_unsupported_reason(dtype, n, k) -> str | None:
    """None if the sm90 wgrad kernel can run (dtype, N, K), else the first failing condition."""
    reason = sm90_unavailable_reason()
    if reason is not None:
        return reason
    if dtype not in DTYPES:
        return f"sm90 backend: dtype {str(dtype).replace('torch.', '')} not supported (bf16, fp16)"
    if n % 8 != 0:
        return f"sm90 backend: N={n} not a multiple of 8"
    if k % 8 != 0:
        return f"sm90 backend: K={k} not a multiple of 8"
    return None


def choose_config(n: int, k: int, max_ctas: int) -> tuple[int, int]:
    """(tile_n, cluster_m) from shapes only: wide tiles along K of dW (256, or 192 where that pads
    K less, `tuning.wide_tile`: 6.7% faster at K = 2880) unless K fits in 128 columns; CTA pairs
    sharing the x tile when N spans more than one 128-row tile."""
    return (128 if k <= 128 else tuning.wide_tile(k)), (2 if n > 128 and max_ctas >= 2 else 1)


def narrow_twin(bound) -> dict | None:
    """A 16-bit weight gradient's stand-in while it compiles: the cooperative 128-wide tile. Each
    dW element is the same sum over the tokens in the same order at every tile width and schedule
    (`test_tile_widths_are_bit_equal`, `test_pingpong` on the GPU); on the CPU machine tile 256
    compiles in 4.8-8.1 s, 192 in 2.7-4.6 s, 128 in 1.4-2.5 s. FP8 (cooperative only): none."""
    if bound.arguments.get("fp8"):
        return None
    overrides = {"pingpong": False} if bound.arguments.get("pingpong") else {}
    if bound.arguments["tile_n"] != 128:
        overrides["tile_n"] = 128
    return overrides or None


@functools.partial(cached_kernel, stand_in_of=narrow_twin)
def compile_grouped_wgrad(dtype, tile_n, main_grad, cluster_m=1, tvm_ffi=None, fp8=False, pingpong=False,
                          **kernel_opts):
    """Compile (once per configuration) and return the launcher fn(dy, x, offsets, out, dy scales,
    x scales, tokens, max_ctas): 16-bit dy (M, N), x (M, K), no scales or tokens (None), or with
    ``fp8`` the block-padded E4M3 copies dy^T (N, 128 blocks), x^T (K, 128 blocks), their
    (blocks, N), (blocks, K) float32 multipliers and M (Int32); dW in ``dtype``. Shapes are
    symbolic."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_wgrad_sm90 import GroupedWgradSm90

    dt = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]
    g, g1, blocks = cute.sym_int(), cute.sym_int(), cute.sym_int()
    if fp8:
        padded = cute.sym_int(divisibility=128)
        n, k = cute.sym_int(divisibility=16), cute.sym_int(divisibility=16)
        f8 = cutlass.Float8E4M3FN
        operands = (fake_tensor(f8, (n, padded)), fake_tensor(f8, (k, padded)))
        scales = (fake_tensor(cutlass.Float32, (blocks, n)), fake_tensor(cutlass.Float32, (blocks, k)), cutlass.Int32(1))
    else:
        m = cute.sym_int()
        n, k = cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)
        operands = (fake_tensor(dt, (m, n)), fake_tensor(dt, (m, k)))
        scales = (None, None, None)
    out = fake_tensor(cutlass.Float32 if main_grad else dt, (g, n, k))
    args = (*operands, fake_tensor(cutlass.Int32, (g1,), 4), out, *scales, cutlass.Int32(1))
    kernel = GroupedWgradSm90(dt, tile_n, main_grad, cluster_m, ab_dtype=cutlass.Float8E4M3FN if fp8 else None,
                              pingpong=pingpong, **kernel_opts)
    return compile_launcher(kernel, args, tvm_ffi)


_LAUNCHERS = {}
_MEMO = LaunchMemo()  # argument signature -> validated launch


def grouped_wgrad_sm90(
    dy, x, offsets, *, out=None, main_grad=None, sm_margin=None, tile_n=None, cluster_m=None, pingpong=None
):
    """dW[g] = dy_g^T @ x_g over the token rows offsets[g]:offsets[g+1] of each group.

    dy (M, N), x (M, K) bf16/fp16 contiguous, read in place (groups may start at any row; rows
    >= offsets[G] are ignored); offsets (G+1,) int32 on the same device (clamped on the device).
    Returns dW (G, N, K) in dy's dtype (written into ``out`` if given; empty groups give 0), or,
    with ``main_grad`` (fp32 (G, N, K)), main_grad += dW in place and main_grad is returned.
    sm_margin (int >= 0; None: 0) SMs are left free.
    tile_n (128, 192 or 256, along K) and cluster_m (1, 2: CTA pairs multicast x) override the
    heuristic; ``pingpong`` (None: False) runs each MMA warpgroup on tiles of its own (tile_n 128 or
    192, not with main_grad). No host sync. Checks run once per argument signature (`launch.call_signature`).
    """
    tvm_ffi = tvm_ffi_available()
    key = (
        call_signature(tvm_ffi, dy, x, offsets, out, main_grad),
        tile_n, cluster_m, sm_margin, pingpong,
    )
    args = (dy, x, offsets, out, main_grad, sm_margin, tile_n, cluster_m, pingpong)
    launch = _MEMO.get(key)
    if launch is None:
        launch = _launch(*args)
        if tile_n is None and cluster_m is None and pingpong is None and launch[0] is not None:
            g, n, k = launch[1]
            config = tuning.tuned_config(
                _NAME, (dy.dtype, g, n, k, tuning.rows_bucket(dy.shape[0]), main_grad is not None),
                lambda cfg: grouped_wgrad_sm90(dy, x, offsets, sm_margin=sm_margin, tile_n=cfg.tile_n,
                                               cluster_m=cfg.cluster_m, pingpong=cfg.pingpong or None,
                                               main_grad=None if main_grad is None else main_grad.clone()),
                choose_config(n, k, max(1, num_sms(dy.get_device()) - (sm_margin or 0))),
                tuning.CANDIDATES + (() if main_grad is not None else tuning.PINGPONG_CANDIDATES))
            if config is not None:
                args = (*args[:6], config.tile_n, config.cluster_m, config.pingpong)
                launch = _launch(*args)
        _MEMO.put(key, launch)
    fn, shape, max_ctas = launch
    result = main_grad if main_grad is not None else out if out is not None else dy.new_empty(shape)
    if fn is None:  # no rows (every group is empty) or no output
        if main_grad is None and result.numel():
            result.zero_()
        return result
    try:
        if tvm_ffi:
            fn(dy, x, offsets, result, None, None, None, max_ctas)
        else:
            _call_classic(fn, (dy, x, offsets, result, None, None), None, max_ctas)
    except Exception:
        _launch(*args)  # raises the error naming the argument the kernel rejected
        raise
    return result


def grouped_column_sums_sm90(dy, offsets, *, sm_margin=None):
    """Per-group column sums of dy (M, N) -> (G, N) in dy's dtype (a bias gradient): the kernel
    above against an (M, 8) ones operand, so float32 sums in a fixed order, one read of dy, rows
    >= offsets[G] ignored and empty groups 0, as for dW."""
    ones = dy.new_ones(dy.shape[0], 8)
    return grouped_wgrad_sm90(dy, ones, offsets, sm_margin=sm_margin)[:, :, 0].contiguous()


def _check_destination(name, out, main_grad, dtype, shape, dev):
    """The checks of a wrapper's ``out`` (dW in ``dtype``) or ``main_grad`` (fp32), at most one given."""
    if out is not None and main_grad is not None:
        raise ValueError(f"{name}: pass at most one of out and main_grad")
    given, arg = (main_grad, "main_grad") if main_grad is not None else (out, "out")
    if given is not None:
        check_tensor(name, given, arg, torch.float32 if main_grad is not None else dtype, 3, dev)
        if tuple(given.shape) != shape:
            raise ValueError(f"{name}: {arg} must have shape {shape}, got {tuple(given.shape)}")


def _launch(dy, x, offsets, out, main_grad, sm_margin, tile_n, cluster_m, pingpong=None):
    """Every check of `grouped_wgrad_sm90`; (launcher or None when there is nothing to compute,
    dW shape, persistent grid in CTAs)."""
    dev = check_input(_NAME, dy, "dy")
    check_tensor(_NAME, x, "x", dy.dtype, 2, dev)
    check_tensor(_NAME, offsets, "offsets", torch.int32, 1, dev)
    (m, n), k = dy.shape, x.shape[1]
    if x.shape[0] != m:
        raise ValueError(f"{_NAME}: x has {x.shape[0]} rows, dy has {m}")
    g = _check_sizes(_NAME, m, n, k, offsets, out, main_grad, dy.dtype, dev)
    margin = resolve_sm_margin(sm_margin, _NAME)
    if tile_n not in (None, *tuning.TILE_NS):
        raise ValueError(f"{_NAME}: tile_n must be one of {tuning.TILE_NS}, got {tile_n!r}")
    if cluster_m not in (None, 1, 2):
        raise ValueError(f"{_NAME}: cluster_m must be 1 or 2, got {cluster_m!r}")
    tuning.check_pingpong(_NAME, pingpong)
    if pingpong and (tile_n not in (None, *tuning.PINGPONG_TILE_NS) or main_grad is not None):
        raise ValueError(f"{_NAME}: pingpong needs tile_n in {tuning.PINGPONG_TILE_NS} and no main_grad")
    if g * n * k == 0 or m == 0:
        return None, (g, n, k), 0

    max_ctas = max(1, num_sms(dev) - margin)
    auto_tile_n, auto_cluster_m = choose_config(n, k, max_ctas)
    if pingpong and tile_n is None:
        tile_n = tuning.pingpong_tile_n(auto_tile_n)
    tile_n = tile_n or auto_tile_n
    cluster_m = cluster_m or auto_cluster_m
    max_ctas = max(max_ctas, cluster_m)
    key = (dy.dtype, tile_n, main_grad is not None, cluster_m, tvm_ffi_available(), False, bool(pingpong))
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_wgrad(*key)
    return fn, (g, n, k), max_ctas


def _check_sizes(name, rows, n, k, offsets, out, main_grad, dtype, dev) -> int:
    """The size checks of both 16-bit weight gradients: ``rows`` (M, the rows the offsets index)
    fits the ragged token view, N (dy's columns) and K (x's) are multiples of 8, offsets has G + 1
    >= 1 entries, and the destination (dW in ``dtype``) fits (G, N, K); returns G."""
    if rows > _MAX_ROWS:
        raise ValueError(f"{name}: M={rows} rows exceed {_MAX_ROWS}")
    if n % 8:
        raise ValueError(f"{name}: N={n} (dy.shape[1]) must be a multiple of 8")
    if k % 8:
        raise ValueError(f"{name}: K={k} (x.shape[1]) must be a multiple of 8")
    if offsets.shape[0] < 1:
        raise ValueError(f"{name}: offsets must have G+1 >= 1 entries, got shape (0,)")
    g = offsets.shape[0] - 1
    _check_destination(name, out, main_grad, dtype, (g, n, k), dev)
    return g


@cached_kernel
def compile_grouped_wgrad_gathered(dtype, tile_n, tvm_ffi=None, gathered="x", **kernel_opts):
    """Compile (once per configuration) and return the launcher fn(dy, x, index (M,), offsets,
    dW (G, N, K), max_ctas) of `grouped_wgrad_gathered_sm90`: dy (M, N) and x (T, K) with
    ``gathered`` "x", dy (T, N) and x (M, K) with "dy"; shapes symbolic."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_wgrad_sm90 import GroupedWgradGatheredSm90

    dt = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]
    m, t, g, g1 = (cute.sym_int() for _ in range(4))
    n, k = cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)
    dy_rows, x_rows = (m, t) if gathered == "x" else (t, m)
    args = (fake_tensor(dt, (dy_rows, n)), fake_tensor(dt, (x_rows, k)), fake_tensor(cutlass.Int32, (m,), 4),
            fake_tensor(cutlass.Int32, (g1,), 4), fake_tensor(dt, (g, n, k)), cutlass.Int32(1))
    return compile_launcher(GroupedWgradGatheredSm90(dt, tile_n, gathered=gathered, **kernel_opts), args, tvm_ffi)


def grouped_wgrad_gathered_sm90(dy, x, index, offsets, *, gathered="x", out=None, sm_margin=None, tile_n=None,
                                cluster_m=None):
    """dW[g] = dy_g^T @ x_g over the rows offsets[g]:offsets[g+1], one operand's rows read by
    index inside the GEMM, never written in expert order.

    ``gathered`` "x" (FC1's weight gradient without the permuted copy of its input): x_g =
    x[index]_g, dy (M, N), x (T, K); computed as dW^T = x_g^T dy_g with x's gathered rows as A
    (128 columns of K a tile) and dy as B, each tile stored transposed; tile_n along N. "dy" (FC2's
    weight gradient without the expert-ordered copy of the combine's gradient): dy_g =
    dy[index]_g, dy (T, N), x (M, K); dy's gathered rows as A (128 columns of N a tile), x as B,
    tile_n along K. bf16/fp16, N and K multiples of 8; index (M,) int32, the token of each row
    (ids outside [0, T) clamped); offsets (G+1,) int32. Returns dW (G, N, K) in dy's dtype (into
    ``out`` if given; empty groups give 0), bit for bit `grouped_wgrad_sm90` on the copy made by
    index at its default configuration on the layer shapes measured. tile_n (128, 192 or 256;
    None: 256, 128 where the B operand's width fits) and cluster_m (1 or 2, None: 2: CTA pairs on
    adjacent blocks of the gathered operand's columns share B's tile). sm_margin as for
    `grouped_wgrad_sm90`. No host sync.
    """
    tvm_ffi = tvm_ffi_available()
    key = (call_signature(tvm_ffi, dy, x, index, offsets, out), _GATHERED_NAME, gathered, sm_margin, tile_n,
           cluster_m)
    args = (dy, x, index, offsets, gathered, out, sm_margin, tile_n, cluster_m)
    fn, shape, max_ctas = _MEMO.get(key) or _MEMO.put(key, _gathered_launch(*args))
    result = out if out is not None else dy.new_empty(shape)
    if fn is None:
        if result.numel():
            result.zero_()
        return result
    try:
        if tvm_ffi:
            fn(dy, x, index, offsets, result, max_ctas)
        else:
            _call_classic(fn, (dy, x, index, offsets, result), max_ctas)
    except Exception:
        _gathered_launch(*args)
        raise
    return result


def _gathered_launch(dy, x, index, offsets, gathered, out, sm_margin, tile_n, cluster_m):
    """Every check of `grouped_wgrad_gathered_sm90`; (launcher or None, dW shape, grid in CTAs)."""
    name = _GATHERED_NAME
    if gathered not in ("x", "dy"):
        raise ValueError(f"{name}: gathered must be 'x' or 'dy', got {gathered!r}")
    dev = check_input(name, dy, "dy")
    check_tensor(name, x, "x", dy.dtype, 2, dev)
    check_tensor(name, index, "index", torch.int32, 1, dev)
    check_tensor(name, offsets, "offsets", torch.int32, 1, dev)
    source, rows = (x, dy) if gathered == "x" else (dy, x)  # the gathered operand, the one in expert order
    m = index.shape[0]
    if rows.shape[0] != m:
        other = "dy" if gathered == "x" else "x"
        raise ValueError(f"{name}: {other} has {rows.shape[0]} rows, index has {m}")
    n, k = dy.shape[1], x.shape[1]
    g = _check_sizes(name, m, n, k, offsets, out, None, dy.dtype, dev)
    if source.shape[0] == 0 and m:
        raise ValueError(f"{name}: {gathered} has no rows to gather, index has {m}")
    if tile_n not in (None, 128, 192, 256):
        raise ValueError(f"{name}: tile_n must be 128, 192 or 256, got {tile_n!r}")
    if cluster_m not in (None, 1, 2):
        raise ValueError(f"{name}: cluster_m must be 1 or 2, got {cluster_m!r}")
    max_ctas = max(1, num_sms(dev) - resolve_sm_margin(sm_margin, name))
    if g * n * k == 0 or m == 0:
        return None, (g, n, k), 0
    b_width = n if gathered == "x" else k
    tile_n = tile_n or (128 if b_width <= 128 else 256)
    key = (_GATHERED_NAME, dy.dtype, tile_n, tvm_ffi_available(), gathered, cluster_m or 2)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_wgrad_gathered(dy.dtype, tile_n, key[3], gathered, cluster_m=key[5])
    return fn, (g, n, k), max_ctas


def grouped_wgrad_fp8_sm90(dy_columns, x_columns, offsets, *, out_dtype=torch.bfloat16, out=None, main_grad=None,
                           sm_margin=None, cluster_m=None, tile_n=None, overlap_promotion=False):
    """dW[g] = dy_g^T @ x_g from block-padded column-wise FP8 copies of dy (M, N) and x (M, K).

    dy_columns, x_columns: `block_quantize.BlockColumns` of dy and x with the same M and blocks
    (`block_columns_sm90`; data (C, 128 * blocks) E4M3, scale_inv (blocks, C) float32, blocks =
    ceil(M / 128) + G); offsets (G+1,) int32 on the same device, G <= 512, the offsets the copies
    were made with. N and K multiples of 16. Returns dW (G, N, K) in ``out_dtype`` (bf16/fp16;
    into ``out`` if given), or with ``main_grad`` (fp32) main_grad += dW. Each 128-token block's
    product is added in float32, scaled by its two multipliers. sm_margin and cluster_m as for
    `grouped_wgrad_sm90`; tile_n (along K) 128, 192, or 256 (each block's product taken in two
    128-column halves); None: `tuning.fp8_tile_n` of K. ``overlap_promotion`` (tile_n 128): two
    block products in flight, each block promoted under the next one's WGMMAs. All bit-equal to
    tile 128; past tile 128 or with the overlap, a tile's stores wait for its mainloop instead of
    running under the next tile's. No host sync.
    """
    tvm_ffi = tvm_ffi_available()
    try:
        dy_t, dy_scales, m = dy_columns
        x_t, x_scales, x_m = x_columns
    except (TypeError, ValueError):
        raise TypeError(f"{_FP8_NAME}: dy_columns and x_columns must be BlockColumns (data, scale_inv, num_tokens)")
    key = (
        call_signature(tvm_ffi, dy_t, x_t, offsets, out, main_grad, dy_scales, x_scales),
        m, x_m, out_dtype, cluster_m, sm_margin, tile_n, overlap_promotion,
    )
    args = (dy_t, dy_scales, x_t, x_scales, m, x_m, offsets, out_dtype, out, main_grad, sm_margin, cluster_m,
            tile_n, overlap_promotion)
    launch = _MEMO.get(key)
    if launch is None:
        launch = _fp8_launch(*args)
        if tile_n is None and cluster_m is None and not overlap_promotion and launch[0] is not None:
            g, n, k = launch[1]
            config = tuning.tuned_config(
                _FP8_NAME, (out_dtype, g, n, k, tuning.rows_bucket(m), main_grad is not None),
                lambda cfg: grouped_wgrad_fp8_sm90(
                    dy_columns, x_columns, offsets, out_dtype=out_dtype, sm_margin=sm_margin, cluster_m=cfg.cluster_m,
                    tile_n=cfg.tile_n, main_grad=None if main_grad is None else main_grad.clone()),
                (tuning.fp8_tile_n(k, glu=False), choose_config(n, k, launch[2])[1]),
                tuning.fp8_candidates())
            if config is not None:
                args = (*args[:11], config.cluster_m, config.tile_n, overlap_promotion)
                launch = _fp8_launch(*args)
        _MEMO.put(key, launch)
    fn, shape, max_ctas = launch
    result = main_grad if main_grad is not None else out if out is not None else dy_t.new_empty(shape, dtype=out_dtype)
    if fn is None:
        if main_grad is None and result.numel():
            result.zero_()
        return result
    try:
        if tvm_ffi:
            fn(dy_t, x_t, offsets, result, dy_scales, x_scales, m, max_ctas)
        else:
            _call_classic(fn, (dy_t, x_t, offsets, result, dy_scales, x_scales), m, max_ctas)
    except Exception:
        _fp8_launch(*args)
        raise
    return result


def _fp8_launch(dy_t, dy_scales, x_t, x_scales, m, x_m, offsets, out_dtype, out, main_grad, sm_margin, cluster_m,
                tile_n, overlap_promotion):
    """Every check of `grouped_wgrad_fp8_sm90`; (launcher or None, dW shape, grid in CTAs)."""
    name = _FP8_NAME
    if not isinstance(dy_t, torch.Tensor):
        raise TypeError(f"{name}: dy_columns.data must be a torch.Tensor, got {type(dy_t).__name__}")
    dev = dy_t.get_device()
    if dev < 0:
        raise ValueError(f"{name}: dy_columns.data must be on a CUDA device, got {dy_t.device}")
    if out_dtype not in DTYPES:
        raise TypeError(f"{name}: out_dtype must be bfloat16 or float16, got {out_dtype}")
    check_tensor(name, dy_t, "dy_columns.data", torch.float8_e4m3fn, 2, dev)
    check_tensor(name, x_t, "x_columns.data", torch.float8_e4m3fn, 2, dev)
    check_tensor(name, offsets, "offsets", torch.int32, 1, dev)
    if m != x_m:
        raise ValueError(f"{name}: dy_columns has {m} tokens, x_columns {x_m}")
    n, padded = dy_t.shape
    k = x_t.shape[0]
    g = offsets.shape[0] - 1
    if not 1 <= g <= FP8_MAX_GROUPS:
        raise ValueError(f"{name}: offsets must have G+1 entries with 1 <= G <= {FP8_MAX_GROUPS}, got shape "
                         f"{tuple(offsets.shape)}")
    if not isinstance(m, int) or not 0 <= m <= _MAX_ROWS:
        raise ValueError(f"{name}: num_tokens must be an int in [0, {_MAX_ROWS}], got {m!r}")
    blocks = -(-m // 128) + g
    for arg, data, scales, rows in (("dy_columns", dy_t, dy_scales, n), ("x_columns", x_t, x_scales, k)):
        if tuple(data.shape) != (rows, 128 * blocks):
            raise ValueError(f"{name}: {arg}.data must have shape {(rows, 128 * blocks)} (128 * (ceil(M/128) + G) "
                             f"columns), got {tuple(data.shape)}")
        check_tensor(name, scales, f"{arg}.scale_inv", torch.float32, 2, dev)
        if tuple(scales.shape) != (blocks, rows):
            raise ValueError(f"{name}: {arg}.scale_inv must have shape {(blocks, rows)}, got {tuple(scales.shape)}")
    for arg, value in (("N (dy_columns.data.shape[0])", n), ("K (x_columns.data.shape[0])", k)):
        if value % 16:
            raise ValueError(f"{name}: {arg}={value} must be a multiple of 16")
    _check_destination(name, out, main_grad, out_dtype, (g, n, k), dev)
    margin = resolve_sm_margin(sm_margin, name)
    if cluster_m not in (None, 1, 2):
        raise ValueError(f"{name}: cluster_m must be 1 or 2, got {cluster_m!r}")
    if tile_n not in (None, 128, 192, 256):
        raise ValueError(f"{name}: tile_n must be 128, 192 or 256, got {tile_n!r}")
    if not isinstance(overlap_promotion, bool):
        raise TypeError(f"{name}: overlap_promotion must be a bool, got {type(overlap_promotion).__name__}")
    if overlap_promotion and tile_n not in (None, 128):
        raise ValueError(f"{name}: overlap_promotion needs tile_n 128, got {tile_n}")
    if g * n * k == 0 or m == 0:
        return None, (g, n, k), 0
    max_ctas = max(1, num_sms(dev) - margin)
    cluster_m = cluster_m or choose_config(n, k, max_ctas)[1]
    max_ctas = max(max_ctas, cluster_m)
    tile_n = 128 if overlap_promotion else tile_n or tuning.fp8_tile_n(k, glu=False)
    key = (out_dtype, tile_n, main_grad is not None, cluster_m, tvm_ffi_available(), True, False,
           overlap_promotion)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_wgrad(*key[:7], overlap_promotion=overlap_promotion)
    return fn, (g, n, k), max_ctas


def _call_classic(fn, tensors, *scalars):
    """The classic call path: ``tensors`` as CuTe tensors, then ``scalars`` (ints as Int32, None
    kept) and the current stream."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    def cv(t):
        if t is None:
            return None
        align = 4 if t.dim() == 1 else 16  # offsets: 4 bytes, as compiled
        return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    stream = cuda.CUstream(torch.cuda.current_stream(tensors[0].device).cuda_stream)
    fn(*(cv(t) for t in tensors), *(None if v is None else cutlass.Int32(v) for v in scalars), stream)
