"""Torch-facing wrappers of the sm90 grouped GEMM kernels: checks, config, compile cache.

``grouped_gemm_sm90``: y = x_g @ W[g].T ("nk", W (G, N, K)) or x_g @ W[g] ("kn", W (G, K, N),
e.g. the data gradient dx = dy @ W[g] of a GroupedLinear, W read in place), + bias / activation.
``grouped_dgrad_dact_sm90``: the backward of FC2 fused with the activation's backward.
``grouped_gemm_gathered_sm90``: the forward reading x's rows by index (a permute inside FC1's loads).
``grouped_gemm_fp8_sm90``: the forward on block-scaled FP8 operands (x 1x128, W 128x128 blocks).
``grouped_gemm_act_quant_sm90``: the forward + GLU activation with the activation (or, without an
activation, the output) cast to E4M3 in 1x128 blocks in the epilogue (no bf16 round trip).

Tensors cross into the kernels through TVM-FFI (``apache-tvm-ffi``) when it is installed, which keeps
the per-call host overhead to a few microseconds; without it the classic CuTe DSL call path is used.
Kernels are compiled once per configuration (dtype, tile_n, cluster_m, epilogue, weight layout,
TVM-FFI) with M, N, K and G symbolic, and kept in-process. The persistent grid size, which the SM
margin sets, is a runtime argument. GLU weights and biases are read in their natural [gate; up]
layout; nothing is repacked.
"""

from __future__ import annotations


import torch

from . import sm90_unavailable_reason, tuning
from ....activations import ACTIVATIONS, GLU_N_MULTIPLE, activation_constants, activation_spec
from .block_quantize import BlockColumns
from .grouped_wgrad import FP8_MAX_GROUPS  # the FP8 kernels' group scan in shared memory
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

_FWD = "grouped_gemm_sm90"
_DACT = "grouped_dgrad_dact_sm90"
DACT_GLU_I_MULTIPLE = 32  # dgrad + dActivation, GLU: I a multiple of the 32-column chunk
FP8_GLU_N_MULTIPLE = 128  # FP8 GLU: each half's 64-row boxes inside one 128-row scale block
_FP8 = "grouped_gemm_fp8_sm90"
_DACT_FP8 = "grouped_dgrad_dact_fp8_sm90"
_ACT_QUANT = "grouped_gemm_act_quant_sm90"
_GATHERED = "grouped_gemm_gathered_sm90"
GATHER_K_MULTIPLE = 64  # gathered A rows: whole 64-column k-tiles of 16-byte loads
_ACT_QUANT_FP8 = "grouped_gemm_act_quant_fp8_sm90"
# the columns an epilogue casts with a column-wise copy (the act's) come in multiples of this, so a
# tile's are one 1x128 block
CAST_COLUMNS_MULTIPLE = 128


def _common_unsupported_reason(dtype, activation):
    reason = sm90_unavailable_reason()
    if reason is not None:
        return reason
    if dtype not in DTYPES:
        return f"sm90 backend: dtype {str(dtype).replace('torch.', '')} not supported (bf16, fp16)"
    if activation is not None and activation not in ACTIVATIONS:
        return f"sm90 backend: activation {activation!r} not supported ({tuple(ACTIVATIONS)})"
    return None


def sm90_grouped_gemm_unsupported_reason(dtype, n, k, activation, has_bias) -> str | None:
    """None if ``grouped_gemm_sm90`` can run this configuration, else the first failing condition."""
    reason = _common_unsupported_reason(dtype, activation)
    if reason is not None:
        return reason
    if k % 8 != 0:
        return f"sm90 backend: K={k} not a multiple of 8"
    if n % 8 != 0:
        return f"sm90 backend: N={n} not a multiple of 8"
    if activation is not None and ACTIVATIONS[activation].glu and n % GLU_N_MULTIPLE != 0:
        return f"sm90 backend: N={n} not a multiple of {GLU_N_MULTIPLE} for a GLU activation"
    return None


def sm90_grouped_gemm_fp8_unsupported_reason(out_dtype, n, k, activation) -> str | None:
    """None if ``grouped_gemm_fp8_sm90`` can run (M, k) @ (G, n, k) FP8 operands + ``activation``
    into ``out_dtype``, else the first failing condition."""
    reason = _common_unsupported_reason(out_dtype, activation)
    if reason is not None:
        return reason
    if k % 16 != 0:
        return f"sm90 backend: K={k} not a multiple of 16 (FP8)"
    multiple = FP8_GLU_N_MULTIPLE if activation is not None and ACTIVATIONS[activation].glu else 8
    if n % multiple != 0:
        return f"sm90 backend: N={n} not a multiple of {multiple} (FP8, activation {activation!r})"
    return None


def sm90_grouped_dgrad_dact_unsupported_reason(dtype, h, i, activation) -> str | None:
    """None if ``grouped_dgrad_dact_sm90`` can run dy (M, h) @ W (G, h, i) + d``activation``."""
    if activation is None:
        return "sm90 backend: the dgrad + dActivation kernel needs an activation"
    reason = _common_unsupported_reason(dtype, activation)
    if reason is not None:
        return reason
    if h % 8 != 0:
        return f"sm90 backend: H={h} not a multiple of 8"
    multiple = DACT_GLU_I_MULTIPLE if ACTIVATIONS[activation].glu else 8
    if i % multiple != 0:
        return f"sm90 backend: I={i} not a multiple of {multiple} for activation {activation!r}"
    return None


def sm90_grouped_dgrad_dact_fp8_unsupported_reason(dtype, h, i, activation) -> str | None:
    """None if ``grouped_dgrad_dact_fp8_sm90`` can run dy (M, h) @ W (G, h, i) in FP8 + d``activation``."""
    reason = sm90_grouped_dgrad_dact_unsupported_reason(dtype, h, i, activation)
    if reason is None and h % 16 != 0:
        return f"sm90 backend: H={h} not a multiple of 16 (FP8)"
    return reason


def max_clusters(num_sms: int, sm_margin: int, cluster_m: int) -> int:
    """Persistent grid size in clusters: num_sms - sm_margin SMs, at least one cluster."""
    return max(1, (num_sms - sm_margin) // cluster_m)


def choose_config(m: int, n: int, g: int, num_sms: int, tile_ns=(128, 256), halves=1) -> tuple[int, int]:
    """(tile_n, cluster_m) from shapes only. Wide tiles (256, or 192 where ``tile_ns`` has it and
    it pads N less: `tuning.wide_tile`; ``halves`` 2 for a GLU's [gate, up]) unless they would
    leave part of the persistent grid idle; CTA pairs sharing W (cluster_m=2) unless N is a single
    tile and groups are small: a pair splits a group's odd last m-tile along N (`cluster_tile`),
    which needs two n-tiles, else the pair's second CTA idles there."""
    wide = tuning.wide_tile(n, halves, tile_ns)
    tile_n = wide if -(-m // 128) * -(-n // wide) >= num_sms else 128
    return tile_n, 2 if n > tile_n or m >= 1024 * g else 1


PINGPONG_SHORT_K = 1536  # plain outputs: K up to which the hidden epilogue outweighs a little padding
SHORT_K_PAD_MARGIN = 0.035  # ... that much more of N padded by 192-wide tiles than by 256-wide ones
ACT_PAD_MARGIN = 0.01  # activation epilogues: 192-wide tiles may pad N this much more at any K


def pingpong_pays(m: int, n: int, k: int, num_sms: int, halves: int = 1, act_epilogue: bool = False) -> bool:
    """Whether the ping-pong schedule on 192-wide tiles with CTA pairs is the choice for a 16-bit
    forward, "kn" data gradient or dgrad + dActivation (``act_epilogue``: the kernel's epilogue
    applies an activation or its gradient, reading or writing more than one output; ``halves`` 2
    for a GLU's [gate, up]). 192-wide tiles must fill the persistent grid; then, by the share of N
    they pad against 256-wide tiles (`tuning.padded_share`):
    - an activation epilogue, hidden under the other warpgroup's mainloop, pays at any K where
      192 pads at most `ACT_PAD_MARGIN` more;
    - a plain output pays where 192 pads at least `tuning.WASTE_MARGIN` less (N = 2880), or
      where K is at most `PINGPONG_SHORT_K` and 192 pads at most `SHORT_K_PAD_MARGIN` more. At
      longer K a plain output's epilogue is a small share of a tile, and the cooperative 256-wide
      tile reads fewer operand bytes per FLOP.
    Measured (H200, `sweep_configs.py --configs 256x2,192x2,192x2p`, 12 classes): 1.02-1.08x the
    best cooperative configuration where this picks ping-pong on a class that cooperative kernels
    ran before (mixtral's FC1 + SwiGLU and dgrad + dSwiGLU at K 4096, qwen3's FC2 forward at
    K 768 padding 3.1% more, gpt-oss's FC1 data gradient at K 5760); plain outputs at K 8192-28672
    without the padding gain 1.03-1.20x slower in ping-pong (mixtral, H 6144 with I 8192 or
    10752), and 192-wide tiles padding 12% more (I 512) 1.35x (H100)."""
    if -(-m // 128) * -(-n // 192) < num_sms:
        return False
    extra = tuning.padded_share(n, 192, halves) - tuning.padded_share(n, 256, halves)
    if act_epilogue:
        return extra <= ACT_PAD_MARGIN
    return extra <= -tuning.WASTE_MARGIN or (k <= PINGPONG_SHORT_K and extra <= SHORT_K_PAD_MARGIN)


def forward_tiles(fn_name, weight_layout, activation) -> dict:
    """`choose_config`'s tile options of a forward: 192-wide tiles for the bf16 forward on "nk"
    weights (measured: FC1 + SwiGLU and FC2 8.6% / 5.1% faster at N = 2880; FC1's "kn" data
    gradient is not), whole 1 x 128 blocks for the cast epilogue."""
    spec = activation_spec(activation, fn_name)
    if fn_name not in (_FWD, _GATHERED) or weight_layout != "nk":
        return {}
    return {"tile_ns": tuning.TILE_NS, "halves": 2 if spec is not None and spec.glu else 1}


def _cutlass_dtype(dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]


def _forward_fakes(dt, weight_layout, n_divisibility):
    """((M, G, N) symbols, fake (x (M, K), weight, offsets (G+1,), pre (M, N))) of a forward."""
    import cutlass
    import cutlass.cute as cute

    m, g, g1 = cute.sym_int(), cute.sym_int(), cute.sym_int()
    k, n = cute.sym_int(divisibility=8), cute.sym_int(divisibility=n_divisibility)
    weight = fake_tensor(dt, (g, n, k) if weight_layout == "nk" else (g, k, n))
    return (m, g, n), (fake_tensor(dt, (m, k)), weight, fake_tensor(cutlass.Int32, (g1,), 4), fake_tensor(dt, (m, n)))


def _fp8_operand_fakes(m, k, g, n):
    """Fake block-scaled FP8 operands of an (M, K) x (G, N, K) grouped GEMM: (A E4M3, its 1x128
    multipliers (M, K/128), B E4M3, its 128x128 multipliers (G, N/128, K/128), offsets (G+1,))."""
    import cutlass
    import cutlass.cute as cute

    k_blocks, n_blocks, g1 = (cute.sym_int() for _ in range(3))
    f8, f32 = cutlass.Float8E4M3FN, cutlass.Float32
    return (
        fake_tensor(f8, (m, k)),
        fake_tensor(f32, (m, k_blocks), 4),
        fake_tensor(f8, (g, n, k)),
        fake_tensor(f32, (g, n_blocks, k_blocks), 4),
        fake_tensor(cutlass.Int32, (g1,), 4),
    )


def _amax_parts_fake():
    import cutlass
    import cutlass.cute as cute

    return fake_tensor(cutlass.Float32, (cute.sym_int(),), 4)


def _compile(kernel, args, tvm_ffi):
    """The launcher of ``kernel`` on tensors ``args`` then (constants, max_clusters), constants an
    `ActivationConstants`."""
    import cutlass

    from .activation_math_sm90 import default_constants

    return compile_launcher(kernel, (*args, default_constants(), cutlass.Int32(1)), tvm_ffi)


@cached_kernel
def compile_grouped_gemm(
    dtype, tile_n, activation, has_bias, tvm_ffi=None, cluster_m=2, weight_layout="nk", act_amax=False,
    pingpong=False, **kernel_opts
):
    """Compile (once per configuration) and return the launcher of ``grouped_gemm_sm90``:
    fn(x, weight, offsets, pre, act, bias, probs, act_amax, constants, max_clusters[, stream])."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_act_sm90 import GroupedGemmActSm90

    dt = _cutlass_dtype(dtype)
    spec = activation_spec(activation, "compile_grouped_gemm")
    glu = spec is not None and spec.glu
    (m, g, n), operands = _forward_fakes(dt, weight_layout, GLU_N_MULTIPLE if glu else 8)
    n_act = cute.sym_int(divisibility=8)
    args = (
        *operands,
        fake_tensor(dt, (m, n_act if glu else n)) if spec is not None else None,
        fake_tensor(dt, (g, n)) if has_bias else None,
        fake_tensor(cutlass.Float32, (m,), 4) if spec is not None and spec.takes_probs else None,
        _amax_parts_fake() if act_amax else None,
    )
    b_major = {"nk": "k", "kn": "mn"}[weight_layout]
    kernel = GroupedGemmActSm90(dt, tile_n, activation, has_bias, b_major, cluster_m, act_amax=act_amax,
                                pingpong=pingpong, **kernel_opts)
    return _compile(kernel, args, tvm_ffi)


@cached_kernel
def compile_grouped_gemm_gathered(dtype, tile_n, activation, has_bias, tvm_ffi=None, cluster_m=2, pingpong=False,
                                  **kernel_opts):
    """Compile (once per configuration) and return the launcher of ``grouped_gemm_gathered_sm90``:
    fn(x, x_index, weight, offsets, pre, act, bias, probs, constants, max_clusters[, stream])."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_act_sm90 import GroupedGemmGatheredSm90

    dt = _cutlass_dtype(dtype)
    spec = activation_spec(activation, "compile_grouped_gemm_gathered")
    glu = spec is not None and spec.glu
    t, m, g, g1 = (cute.sym_int() for _ in range(4))
    k = cute.sym_int(divisibility=GATHER_K_MULTIPLE)
    n, n_act = cute.sym_int(divisibility=GLU_N_MULTIPLE if glu else 8), cute.sym_int(divisibility=8)
    args = (
        fake_tensor(dt, (t, k)),
        fake_tensor(cutlass.Int32, (m,), 4),
        fake_tensor(dt, (g, n, k)),
        fake_tensor(cutlass.Int32, (g1,), 4),
        fake_tensor(dt, (m, n)),
        fake_tensor(dt, (m, n_act if glu else n)) if spec is not None else None,
        fake_tensor(dt, (g, n)) if has_bias else None,
        fake_tensor(cutlass.Float32, (m,), 4) if spec is not None and spec.takes_probs else None,
    )
    kernel = GroupedGemmGatheredSm90(dt, tile_n, activation, has_bias, cluster_m, pingpong=pingpong, **kernel_opts)
    return _compile(kernel, args, tvm_ffi)


@cached_kernel
def compile_grouped_gemm_act_quant(dtype, activation, has_bias, tvm_ffi=None, cluster_m=2, weight_layout="nk",
                                   tile_n=256, columns=False, **kernel_opts):
    """Compile (once per configuration) and return the launcher of ``grouped_gemm_act_quant_sm90``:
    fn(x, weight, offsets, pre, data, scale_inv, col_data, col_scale, bias, probs, constants,
    max_clusters), pre None without an activation, col_data / col_scale None without ``columns``.
    ``kernel_opts``: `GroupedGemmActQuantSm90` options (power_2_scales, ...)."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_act_sm90 import GroupedGemmActQuantSm90

    dt = _cutlass_dtype(dtype)
    spec = activation_spec(activation, "compile_grouped_gemm_act_quant")
    cols_multiple = CAST_COLUMNS_MULTIPLE if columns else 8  # of C, the cast output's columns
    n_multiple = max(2 * cols_multiple, GLU_N_MULTIPLE) if spec else cols_multiple
    (m, g, n), (x, weight, offsets, pre) = _forward_fakes(dt, weight_layout, n_multiple)
    cols = cute.sym_int(divisibility=cols_multiple) if spec else n
    col_blocks, blocks = cute.sym_int(), cute.sym_int()
    args = (
        x, weight, offsets, pre if spec else None,
        fake_tensor(cutlass.Float8E4M3FN, (m, cols), 16),
        fake_tensor(cutlass.Float32, (m, col_blocks), 4),
        fake_tensor(cutlass.Float8E4M3FN, (cols, cute.sym_int(divisibility=128)), 16) if columns else None,
        fake_tensor(cutlass.Float32, (blocks, cols), 4) if columns else None,
        fake_tensor(dt, (g, n)) if has_bias else None,
        fake_tensor(cutlass.Float32, (m,), 4) if spec and spec.takes_probs else None,
    )
    b_major = {"nk": "k", "kn": "mn"}[weight_layout]
    kernel = GroupedGemmActQuantSm90(dt, activation, has_bias, b_major, cluster_m, tile_n=tile_n, columns=columns,
                                     **kernel_opts)
    return _compile(kernel, args, tvm_ffi)


@cached_kernel
def compile_grouped_dgrad_dact(dtype, tile_n, activation, tvm_ffi=None, cluster_m=2, epilogue_warps=False,
                               pingpong=False, gathered=False, deep_operands=False, emit_act=True, **kernel_opts):
    """Compile (once per configuration) and return the launcher of ``grouped_dgrad_dact_sm90``:
    fn(dy, [dy_index,] weight, offsets, pre, d_pre, act, probs, d_probs_part, constants,
    max_clusters[, stream]); ``gathered``: dy (T, H) read by dy_index (M,); ``deep_operands``:
    one C stage and one store slot, the rest of shared memory as operand stages; without
    ``emit_act`` act is None (not written)."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_dact_sm90 import DEEP_OPERAND_SPLIT, GroupedGemmDActGatheredSm90, GroupedGemmDActSm90

    dt = _cutlass_dtype(dtype)
    spec = activation_spec(activation, "compile_grouped_dgrad_dact")
    m, g, g1, n_tiles = cute.sym_int(), cute.sym_int(), cute.sym_int(), cute.sym_int()
    h = cute.sym_int(divisibility=GATHER_K_MULTIPLE if gathered else 8)
    i = cute.sym_int(divisibility=DACT_GLU_I_MULTIPLE if spec.glu else 8)
    i_pre = cute.sym_int(divisibility=2 * DACT_GLU_I_MULTIPLE) if spec.glu else i
    dy = (fake_tensor(dt, (cute.sym_int(), h)), fake_tensor(cutlass.Int32, (m,), 4)) if gathered else (
        fake_tensor(dt, (m, h)),)
    args = (
        *dy,
        fake_tensor(dt, (g, h, i)),
        fake_tensor(cutlass.Int32, (g1,), 4),
        fake_tensor(dt, (m, i_pre)),
        fake_tensor(dt, (m, i_pre)),
        fake_tensor(dt, (m, i)) if emit_act else None,
        fake_tensor(cutlass.Float32, (m,), 4) if spec.takes_probs else None,
        fake_tensor(cutlass.Float32, (n_tiles, m), 4) if spec.takes_probs else None,
    )
    if deep_operands:
        kernel_opts = {**kernel_opts, **DEEP_OPERAND_SPLIT}
    if gathered:
        kernel = GroupedGemmDActGatheredSm90(dt, tile_n, activation, cluster_m, pingpong=pingpong, emit_act=emit_act,
                                             **kernel_opts)
    else:
        kernel = GroupedGemmDActSm90(dt, tile_n, activation, cluster_m, epilogue_warps=epilogue_warps,
                                     pingpong=pingpong, emit_act=emit_act, **kernel_opts)
    return _compile(kernel, args, tvm_ffi)


@cached_kernel
def compile_grouped_dgrad_dact_fp8(dtype, activation, tvm_ffi=None, cluster_m=2, d_pre_amax=False, tile_n=128,
                                   emit_act=False, **kernel_opts):
    """Compile (once per configuration) and return the launcher of ``grouped_dgrad_dact_fp8_sm90``:
    fn(dy, dy_scale, weight_t, weight_t_scale, offsets, pre, d_pre, act, probs, d_probs_part, d_pre_amax,
    constants, max_clusters), act None without ``emit_act``."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_dact_sm90 import GroupedGemmDActFp8Sm90

    dt = _cutlass_dtype(dtype)
    spec = activation_spec(activation, "compile_grouped_dgrad_dact_fp8")
    m, g, n_tiles = (cute.sym_int() for _ in range(3))
    h = cute.sym_int(divisibility=16)
    i = cute.sym_int(divisibility=DACT_GLU_I_MULTIPLE if spec.glu else 8)
    i_pre = cute.sym_int(divisibility=2 * DACT_GLU_I_MULTIPLE) if spec.glu else i
    args = (
        *_fp8_operand_fakes(m, h, g, i),
        fake_tensor(dt, (m, i_pre)),
        fake_tensor(dt, (m, i_pre)),
        fake_tensor(dt, (m, i)) if emit_act else None,
        fake_tensor(cutlass.Float32, (m,), 4) if spec.takes_probs else None,
        fake_tensor(cutlass.Float32, (n_tiles, m), 4) if spec.takes_probs else None,
        _amax_parts_fake() if d_pre_amax else None,
    )
    kernel = GroupedGemmDActFp8Sm90(dt, activation, cluster_m, tile_n, d_pre_amax=d_pre_amax, emit_act=emit_act,
                                    **kernel_opts)
    return _compile(kernel, args, tvm_ffi)


@cached_kernel
def compile_grouped_gemm_fp8(dtype, activation, has_bias, tvm_ffi=None, cluster_m=2, tile_n=128, act_amax=False,
                             overlap_promotion=False, up_box_split=False, **kernel_opts):
    """Compile (once per configuration) and return the launcher of ``grouped_gemm_fp8_sm90``:
    fn(x, x_scale, weight, weight_scale, offsets, pre, act, bias, probs, act_amax, constants, max_clusters).
    ``up_box_split``: GLU at tile_n 256 for N/2 an odd multiple of 64 (`GroupedGemmSm90`)."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_act_sm90 import GroupedGemmActFp8Sm90

    dt = _cutlass_dtype(dtype)
    spec = activation_spec(activation, "compile_grouped_gemm_fp8")
    glu = spec is not None and spec.glu
    m, g = cute.sym_int(), cute.sym_int()
    k, n = cute.sym_int(divisibility=16), cute.sym_int(divisibility=FP8_GLU_N_MULTIPLE if glu else 8)
    n_act = cute.sym_int(divisibility=8)
    args = (
        *_fp8_operand_fakes(m, k, g, n),
        fake_tensor(dt, (m, n)),
        fake_tensor(dt, (m, n_act if glu else n)) if spec is not None else None,
        fake_tensor(dt, (g, n)) if has_bias else None,
        fake_tensor(cutlass.Float32, (m,), 4) if spec is not None and spec.takes_probs else None,
        _amax_parts_fake() if act_amax else None,
    )
    kernel = GroupedGemmActFp8Sm90(dt, activation, has_bias, cluster_m, tile_n, act_amax=act_amax,
                                   overlap_promotion=overlap_promotion, up_box_split=up_box_split, **kernel_opts)
    return _compile(kernel, args, tvm_ffi)


@cached_kernel
def compile_grouped_gemm_act_quant_fp8(dtype, activation, has_bias, tvm_ffi=None, cluster_m=2, columns=False,
                                       **kernel_opts):
    """Compile (once per configuration) and return the launcher of
    ``grouped_gemm_act_quant_fp8_sm90``: fn(x, x_scale, weight, weight_scale, offsets, pre, data,
    scale_inv, col_data, col_scale, bias, probs, constants, max_clusters), col_data / col_scale
    None without ``columns``. ``kernel_opts``: `GroupedGemmActQuantFp8Sm90` options
    (power_2_scales, ...)."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_act_sm90 import GroupedGemmActQuantFp8Sm90

    dt = _cutlass_dtype(dtype)
    spec = activation_spec(activation, "compile_grouped_gemm_act_quant_fp8")
    m, g = cute.sym_int(), cute.sym_int()
    k, n = cute.sym_int(divisibility=16), cute.sym_int(divisibility=2 * CAST_COLUMNS_MULTIPLE)
    cols, col_blocks, blocks = cute.sym_int(divisibility=CAST_COLUMNS_MULTIPLE), cute.sym_int(), cute.sym_int()
    args = (
        *_fp8_operand_fakes(m, k, g, n),
        fake_tensor(dt, (m, n)),
        fake_tensor(cutlass.Float8E4M3FN, (m, cols), 16),
        fake_tensor(cutlass.Float32, (m, col_blocks), 4),
        fake_tensor(cutlass.Float8E4M3FN, (cols, cute.sym_int(divisibility=128)), 16) if columns else None,
        fake_tensor(cutlass.Float32, (blocks, cols), 4) if columns else None,
        fake_tensor(dt, (g, n)) if has_bias else None,
        fake_tensor(cutlass.Float32, (m,), 4) if spec.takes_probs else None,
    )
    kernel = GroupedGemmActQuantFp8Sm90(dt, activation, has_bias, cluster_m, columns=columns, **kernel_opts)
    return _compile(kernel, args, tvm_ffi)


def _check_shape(fn_name, t, arg, shape):
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{fn_name}: {arg} must have shape {tuple(shape)}, got {tuple(t.shape)}")


def _check_probs(fn_name, spec, probs, m, dev):
    if spec is not None and spec.takes_probs:
        if probs is None:
            raise ValueError(f"{fn_name}: probs is required for activation {spec.name!r}")
        check_tensor(fn_name, probs, "probs", torch.float32, 1, dev)
        _check_shape(fn_name, probs, "probs", (m,))
    elif probs is not None:
        users = tuple(name for name, s in ACTIVATIONS.items() if s.takes_probs)
        raise ValueError(f"{fn_name}: probs is only used by activations {users}")


def _check_epilogue_tensors(fn_name, spec, dtype, bias, probs, out, act_out, m, n, g, dev):
    """Checks of a forward's epilogue tensors (bias (G, N), probs, out (M, N), act_out in
    ``dtype``); returns the act shape, or None without an activation."""
    if bias is not None:
        check_tensor(fn_name, bias, "bias", dtype, 2, dev)
        _check_shape(fn_name, bias, "bias", (g, n))
    _check_probs(fn_name, spec, probs, m, dev)
    if out is not None:
        check_tensor(fn_name, out, "out", dtype, 2, dev)
        _check_shape(fn_name, out, "out", (m, n))
    act_shape = None if spec is None else (m, n // 2 if spec.glu else n)
    if act_out is not None:
        if act_shape is None:
            raise ValueError(f"{fn_name}: act_out given but there is no activation")
        check_tensor(fn_name, act_out, "act_out", dtype, 2, dev)
        _check_shape(fn_name, act_out, "act_out", act_shape)
    return act_shape


def heuristic_config(m, n, k, g, sms, tiles=None, conflict=None, act_epilogue=False) -> tuning.LaunchConfig:
    """The configuration chosen from shapes alone (an (M, K) x (G, K, N) problem; ``act_epilogue``:
    an activation or its gradient in the epilogue): ping-pong on 192-wide tiles in CTA pairs where
    it pays (`pingpong_pays`) and no option in ``conflict`` rules it out, else `choose_config`'s."""
    tiles = tiles or {}
    if conflict is None and pingpong_pays(m, n, k, sms, tiles.get("halves", 1), act_epilogue):
        return tuning.LaunchConfig(192, 2, True)
    return tuning.LaunchConfig(*choose_config(m, n, g, sms, **tiles))


def _forward_conflict(activation, weight_layout, act_amax) -> str | None:
    """The option of a 16-bit forward that rules ping-pong out, or None: ``act_amax``, or a GLU
    activation on "kn" weights (neither checked on a GPU with ping-pong)."""
    if act_amax:
        return "act_amax"
    spec = activation_spec(activation, _FWD)
    if weight_layout == "kn" and spec is not None and spec.glu:
        return "a GLU activation on weight_layout 'kn'"
    return None


def _candidates(conflict) -> tuple:
    """The autotuner's candidates: the cooperative configurations, and the ping-pong ones unless
    the option ``conflict`` names is on."""
    return tuning.CANDIDATES + (() if conflict else tuning.PINGPONG_CANDIDATES)


def _launch_config(fn_name, m, n, g, dev, tile_n, cluster_m, sm_margin, tiles=None, pingpong=False,
                   conflict=None, k=None, act_epilogue=False):
    """(tile_n, cluster_m, max_clusters, pingpong) from shapes, overrides (``tiles``:
    `forward_tiles`) and the SM margin. ``pingpong``: True / False, or None for the heuristic
    (`heuristic_config`, which needs the reduction length ``k`` and ``act_epilogue``) when tile_n
    and cluster_m are not given either; ``conflict`` names an option that is on and rules ping-pong
    out (None: none)."""
    margin = resolve_sm_margin(sm_margin, fn_name)
    sms = num_sms(dev)
    tuning.check_pingpong(fn_name, pingpong)
    cooperative = choose_config(m, n, g, sms, **(tiles or {}))
    if pingpong is None:
        auto = heuristic_config(m, n, k, g, sms, tiles, conflict, act_epilogue)
        pingpong = tile_n is None and cluster_m is None and auto.pingpong
        if pingpong:
            tile_n, cluster_m = auto.tile_n, auto.cluster_m
    if pingpong and tile_n is None:
        tile_n = tuning.pingpong_tile_n(cooperative[0])
    tile_n = cooperative[0] if tile_n is None else tile_n
    cluster_m = cooperative[1] if cluster_m is None else cluster_m
    if tile_n not in tuning.TILE_NS or cluster_m not in (1, 2):
        raise ValueError(f"{fn_name}: tile_n must be one of {tuning.TILE_NS} and cluster_m 1 or 2")
    if pingpong and tile_n not in tuning.PINGPONG_TILE_NS:
        raise ValueError(f"{fn_name}: pingpong needs tile_n in {tuning.PINGPONG_TILE_NS}, got {tile_n}")
    if pingpong and conflict:
        raise ValueError(f"{fn_name}: pingpong does not run with {conflict}")
    return tile_n, cluster_m, max_clusters(sms, margin, cluster_m), pingpong


_LAUNCHERS = {}
_MEMO = LaunchMemo()  # argument signature -> validated launch (both wrappers; keys differ)


def grouped_gemm_sm90(
    x, weight, offsets, *, bias=None, activation=None, probs=None, out=None, act_out=None,
    weight_layout="nk", tile_n=None, cluster_m=None, sm_margin=None, act_amax=False, pingpong=None, **constants,
):
    """pre = x_g @ W[g].T ("nk") or x_g @ W[g] ("kn") (+ b[g]) per row group, act = activation(pre).

    x (M, K) bf16/fp16; weight (G, N, K) for weight_layout "nk", (G, K, N) for "kn" (GLU: natural
    [gate; up] halves of N); offsets (G+1,) int32 cumulative row starts on x's device; bias (G, N)
    or None; probs (M,) float32 for activations that take probs (scaled_swiglu); ``constants``:
    the activations' float constants by keyword (``activations.CONSTANT_DEFAULTS``, e.g. limit /
    alpha of clamped_swiglu; registry defaults; another name raises TypeError); out / act_out:
    optional preallocated buffers for pre / act.
    Returns (pre (M, N) = [gate, up] for GLU, act (M, N/2) GLU / (M, N) srelu / None).
    Rows >= offsets[G] are zero. No host sync; the launch depends on shapes only.
    tile_n (128, 192 or 256) and cluster_m (1: no W multicast, 2) override the heuristic;
    ``pingpong`` (None: the heuristic's) runs each MMA warpgroup on tiles of its own, one's
    epilogue under the other's mainloop (tile_n 128 or 192, no ``act_amax``);
    sm_margin: SMs to leave free (None: 0).
    ``act_amax``: also return (P,) float32 partial maxima of |act| over the grouped rows (finite
    values, as stored) whose max is the act's amax (`tensor_quantize_sm90`'s ``amax_parts``).
    Checks run once per argument signature (`launch.call_signature`); repeats only launch.
    """
    tvm_ffi = tvm_ffi_available()
    key = (
        call_signature(tvm_ffi, x, weight, offsets, bias, probs, out, act_out),
        _FWD, activation, weight_layout, tile_n, cluster_m, sm_margin, act_amax, pingpong,
    )
    args = (x, weight, offsets, bias, activation, probs, out, act_out, weight_layout, tile_n, cluster_m, sm_margin,
            act_amax, pingpong)
    launch = _MEMO.get(key)
    if launch is None:
        launch = _forward_launch(*args)
        if tile_n is None and cluster_m is None and pingpong is None and launch[0] is not None:
            n = weight.shape[1] if weight_layout == "nk" else weight.shape[2]
            conflict = _forward_conflict(activation, weight_layout, act_amax)
            config = tuning.tuned_config(
                _FWD, (x.dtype, weight.shape[0], n, x.shape[1], tuning.rows_bucket(x.shape[0]), activation,
                       weight_layout, bias is not None, bool(act_amax)),
                lambda cfg: grouped_gemm_sm90(x, weight, offsets, bias=bias, activation=activation, probs=probs,
                                              weight_layout=weight_layout, tile_n=cfg.tile_n, cluster_m=cfg.cluster_m,
                                              sm_margin=sm_margin, act_amax=act_amax, pingpong=cfg.pingpong,
                                              **constants),
                heuristic_config(x.shape[0], n, x.shape[1], weight.shape[0], num_sms(x.get_device()),
                                 forward_tiles(_FWD, weight_layout, activation), conflict, activation is not None),
                _candidates(conflict))
            if config is not None:
                args = (*args[:9], config.tile_n, config.cluster_m, *args[11:13], config.pingpong)
                launch = _forward_launch(*args)
        _MEMO.put(key, launch)
    fn, pre_shape, act_shape, clusters, num_parts = launch
    pre = out if out is not None else x.new_empty(pre_shape)
    act = act_out if act_out is not None or act_shape is None else x.new_empty(act_shape)
    parts = _amax_parts(fn, num_parts, x.device)
    _run(fn, tvm_ffi, _forward_launch, args, (x, weight, offsets, pre, act, bias, probs, parts),
         activation_constants(_FWD, constants), clusters)
    return (pre, act) if parts is None else (pre, act, parts)


def grouped_gemm_gathered_sm90(
    x, x_index, weight, offsets, *, bias=None, activation=None, probs=None, tile_n=None, cluster_m=None,
    sm_margin=None, pingpong=False, **constants,
):
    """`grouped_gemm_sm90` ("nk" weights) on the rows x[x_index]: pre[r] = x[x_index[r]] @ W[g].T
    (+ b[g]) for offsets[g] <= r < offsets[g+1], act = activation(pre), without writing the gathered
    rows (the producer warps load them by index with cp.async; sm90 has no TMA gather).

    x (T, K) bf16/fp16, K a multiple of 64; x_index (M,) int32, the token of each grouped row
    (ids outside [0, T) are clamped: no out-of-bounds read); weight (G, N, K); offsets, bias,
    probs (M,), constants as for `grouped_gemm_sm90`. Returns (pre (M, N), act or None); rows >=
    offsets[G] are zero. tile_n (128, 192, 256) and cluster_m (1, 2) override `choose_config`;
    ``pingpong=True`` (tile_n 128 or 192) runs each MMA warpgroup on tiles of its own, as
    `grouped_gemm_sm90`'s does (None: `grouped_gemm_sm90`'s heuristic). No host sync; checks run
    once per argument signature.
    """
    tvm_ffi = tvm_ffi_available()
    key = (call_signature(tvm_ffi, x, x_index, weight, offsets, bias, probs), _GATHERED, activation, tile_n,
           cluster_m, sm_margin, pingpong)
    args = (x, x_index, weight, offsets, bias, activation, probs, tile_n, cluster_m, sm_margin, pingpong)
    launch = _MEMO.get(key) or _MEMO.put(key, _gathered_launch(*args))
    fn, pre_shape, act_shape, clusters = launch
    pre = x.new_empty(pre_shape)
    act = None if act_shape is None else x.new_empty(act_shape)
    _run(fn, tvm_ffi, _gathered_launch, args, (x, x_index, weight, offsets, pre, act, bias, probs),
         activation_constants(_GATHERED, constants), clusters)
    return pre, act


def _gathered_launch(x, x_index, weight, offsets, bias, activation, probs, tile_n, cluster_m, sm_margin,
                     pingpong=False):
    """Every check of `grouped_gemm_gathered_sm90`; (launcher or None when M == 0, pre shape, act
    shape or None, persistent grid in clusters)."""
    name = _GATHERED
    check_tensor(name, x_index, "x_index", torch.int32, 1, check_input(name, x, "x"))
    (t, k), m = x.shape, x_index.shape[0]
    if t == 0 and m:
        raise ValueError(f"{name}: x has no rows to gather, x_index has {m}")
    if k % GATHER_K_MULTIPLE:
        raise ValueError(f"{name}: K={k} (x.shape[1]) must be a multiple of {GATHER_K_MULTIPLE}")
    m, n, act_shape, tile_n, cluster_m, clusters, pingpong = _forward_checks(
        name, x, weight, offsets, bias, activation, probs, None, None, "nk", tile_n, cluster_m, sm_margin, pingpong,
        rows=m)
    if m == 0:
        return None, (m, n), act_shape, clusters
    key = (_GATHERED, x.dtype, tile_n, activation, bias is not None, tvm_ffi_available(), cluster_m, pingpong)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_gemm_gathered(*key[1:])
    return fn, (m, n), act_shape, clusters


def _amax_parts(fn, num_parts, device):
    """The act-amax output of a launch: None when not asked for (``num_parts`` 0), zeros when
    nothing is launched (M == 0)."""
    if not num_parts:
        return None
    if fn is None:
        return torch.zeros(1, dtype=torch.float32, device=device)
    return torch.empty(num_parts, dtype=torch.float32, device=device)


def _forward_launch(
    x, weight, offsets, bias, activation, probs, out, act_out, weight_layout, tile_n, cluster_m, sm_margin,
    act_amax=False, pingpong=None,
):
    """Every check of `grouped_gemm_sm90`; (launcher or None when M == 0, pre shape, act shape or
    None, persistent grid in clusters, act-amax parts or 0)."""
    m, n, act_shape, tile_n, cluster_m, clusters, pingpong = _forward_checks(
        _FWD, x, weight, offsets, bias, activation, probs, out, act_out, weight_layout, tile_n, cluster_m, sm_margin,
        pingpong, _forward_conflict(activation, weight_layout, act_amax),
    )
    num_parts = _check_amax_request(_FWD, "act_amax", act_amax, act_shape is not None, clusters, cluster_m)
    if m == 0:
        return None, (m, n), act_shape, clusters, num_parts
    key = (_FWD, x.dtype, tile_n, activation, bias is not None, tvm_ffi_available(), cluster_m, weight_layout,
           bool(act_amax), pingpong)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_gemm(*key[1:])
    return fn, (m, n), act_shape, clusters, num_parts


def _check_amax_request(fn_name, arg, asked, has_output, clusters, cluster_m) -> int:
    """Entries of an amax-parts output (8 per CTA of the largest grid: one per consumer warp),
    0 when not ``asked``; ``has_output``: whether the kernel writes the tensor it measures."""
    if not isinstance(asked, bool):
        raise TypeError(f"{fn_name}: {arg} must be a bool, got {type(asked).__name__}")
    if asked and not has_output:
        raise ValueError(f"{fn_name}: {arg} needs an activation")
    return clusters * cluster_m * 8 if asked else 0


def _forward_checks(
    fn_name, x, weight, offsets, bias, activation, probs, out, act_out, weight_layout, tile_n, cluster_m, sm_margin,
    pingpong=False, conflict=None, rows=None,
):
    """The checks of a bf16/fp16 forward; (M, N, act shape or None, tile_n, cluster_m, grid,
    pingpong) (``pingpong``, ``conflict``: as for `_launch_config`; ``rows``: M where the grouped
    rows are gathered from x, else x's rows)."""
    dev = check_input(fn_name, x, "x")
    check_tensor(fn_name, weight, "weight", x.dtype, 3, dev)
    check_tensor(fn_name, offsets, "offsets", torch.int32, 1, dev)
    spec = activation_spec(activation, fn_name)
    if weight_layout not in ("nk", "kn"):
        raise ValueError(f"{fn_name}: weight_layout must be 'nk' or 'kn', got {weight_layout!r}")
    m, k = x.shape
    m = m if rows is None else rows
    if weight_layout == "nk":
        g, n, kw = weight.shape
    else:
        g, kw, n = weight.shape
    if kw != k:
        raise ValueError(f"{fn_name}: weight has K={kw} (weight_layout {weight_layout!r}), x has K={k}")
    if g < 1:
        raise ValueError(f"{fn_name}: weight must hold at least one group")
    _check_shape(fn_name, offsets, "offsets", (g + 1,))
    glu = spec is not None and spec.glu
    if k % 8:
        raise ValueError(f"{fn_name}: K={k} (x.shape[1]) must be a multiple of 8")
    if n % (GLU_N_MULTIPLE if glu else 8):
        raise ValueError(
            f"{fn_name}: N={n} (weight's N dim) must be a multiple of {GLU_N_MULTIPLE if glu else 8}"
            + (f" for activation {activation!r}" if glu else "")
        )
    act_shape = _check_epilogue_tensors(fn_name, spec, x.dtype, bias, probs, out, act_out, m, n, g, dev)
    tile_n, cluster_m, clusters, pingpong = _launch_config(
        fn_name, m, n, g, dev, tile_n, cluster_m, sm_margin, forward_tiles(fn_name, weight_layout, activation),
        pingpong, conflict, k, spec is not None,
    )
    return m, n, act_shape, tile_n, cluster_m, clusters, pingpong


def grouped_gemm_act_quant_sm90(
    x, weight, offsets, *, activation, bias=None, probs=None, out=None, weight_layout="nk",
    power_2_scales=False, columns=False, tile_n=None, cluster_m=None, sm_margin=None, **constants,
):
    """`grouped_gemm_sm90` whose cast output, the GLU ``activation``'s or (``activation=None``) the
    GEMM output itself, is cast to E4M3 in 1 x 128 blocks in the epilogue ("fp8_blockwise"): bit
    for bit `quantization.quantize` of the bf16/fp16 tensor `grouped_gemm_sm90` returns for it,
    without writing that (``Float8BlockScaling(power_2_scales)``).

    Returns (pre (M, N) for GLU, None without an activation; data (M, C) float8_e4m3fn;
    scale_inv (M, ceil(C/128)) float32), C = N/2 for GLU, N without an activation. Rows >=
    offsets[G]: pre and data zero, scale_inv 1. GLU: tile_n 256. ``columns`` (a `Transpose`
    after the cast): a fourth output, the per-group column-wise copy of the same values as
    `block_columns_sm90` makes it (`BlockColumns`); needs C % 128 == 0 and G <= 512. No host sync.
    """
    tvm_ffi = tvm_ffi_available()
    key = (
        call_signature(tvm_ffi, x, weight, offsets, bias, probs, out),
        _ACT_QUANT, activation, weight_layout, power_2_scales, columns, tile_n, cluster_m, sm_margin,
    )
    args = (x, weight, offsets, bias, activation, probs, out, weight_layout, power_2_scales, columns, tile_n,
            cluster_m, sm_margin)
    launch = _MEMO.get(key) or _MEMO.put(key, _act_quant_launch(*args))
    fn, pre_shape, data_shape, clusters = launch
    pre = None
    if pre_shape is not None:
        pre = out if out is not None else x.new_empty(pre_shape)
    cast = _cast_outputs(data_shape, offsets.shape[0] - 1, columns, x.device)
    _run(fn, tvm_ffi, _act_quant_launch, args, (x, weight, offsets, pre, *cast, bias, probs),
         activation_constants(_ACT_QUANT, constants), clusters)
    return _cast_result(pre, cast, data_shape[0], columns)


def _cast_outputs(data_shape, groups, columns, dev):
    """(data (M, C) E4M3, scale_inv (M, ceil(C/128)) float32, with ``columns`` the column-wise
    copy's data (C, 128 * blocks) E4M3 and scale_inv (blocks, C) float32, else None, None): the
    buffers a cast epilogue writes."""
    m, c = data_shape
    data = torch.empty(data_shape, dtype=torch.float8_e4m3fn, device=dev)
    scale_inv = torch.empty(m, -(-c // 128), dtype=torch.float32, device=dev)
    if not columns:
        return data, scale_inv, None, None
    blocks = -(-m // 128) + groups
    return (data, scale_inv, torch.empty(c, 128 * blocks, dtype=torch.float8_e4m3fn, device=dev),
            torch.empty(blocks, c, dtype=torch.float32, device=dev))


def _cast_result(pre, cast, m, columns):
    """A cast epilogue's outputs: (pre, data, scale_inv[, `BlockColumns` with ``columns``])."""
    data, scale_inv, col_data, col_scale = cast
    return (pre, data, scale_inv, BlockColumns(col_data, col_scale, m)) if columns else (pre, data, scale_inv)


def sm90_act_quant_columns_unsupported_reason(c, g) -> str | None:
    """None if `grouped_gemm_act_quant_sm90` can also write the column-wise copy of a cast output
    with ``c`` columns over ``g`` groups (``columns=True``)."""
    if c % CAST_COLUMNS_MULTIPLE:
        return f"sm90 backend: {c} cast columns, not a multiple of {CAST_COLUMNS_MULTIPLE} (column-wise copy)"
    if g > FP8_MAX_GROUPS:
        return f"sm90 backend: {g} groups, more than {FP8_MAX_GROUPS} (column-wise copy)"
    return None


def _act_quant_launch(x, weight, offsets, bias, activation, probs, out, weight_layout, power_2_scales, columns,
                      tile_n, cluster_m, sm_margin):
    """Every check of `grouped_gemm_act_quant_sm90`; (launcher or None when M == 0, pre shape or
    None, cast output shape, persistent grid in clusters)."""
    spec = activation_spec(activation, _ACT_QUANT)
    if spec is not None and not spec.glu:
        glus = tuple(name for name, s in ACTIVATIONS.items() if s.glu)
        raise ValueError(f"{_ACT_QUANT}: activation must be None or a GLU activation {glus}, got {activation!r}")
    if spec is not None and tile_n not in (None, 256):
        raise ValueError(f"{_ACT_QUANT}: tile_n must be 256 with activation {activation!r}, got {tile_n}")
    if tile_n not in (None, 128, 256):  # a tile holds whole 1 x 128 cast blocks
        raise ValueError(f"{_ACT_QUANT}: tile_n must be 128 or 256, got {tile_n}")
    if spec is None and out is not None:
        raise ValueError(f"{_ACT_QUANT}: out (the pre-activation buffer) needs an activation")
    if not isinstance(columns, bool):
        raise TypeError(f"{_ACT_QUANT}: columns must be a bool, got {type(columns).__name__}")
    m, n, act_shape, tile_n, cluster_m, clusters, _ = _forward_checks(
        _ACT_QUANT, x, weight, offsets, bias, activation, probs, out, None, weight_layout,
        256 if spec else tile_n, cluster_m, sm_margin,
    )
    pre_shape, data_shape = ((m, n), act_shape) if spec else (None, (m, n))
    if columns:
        reason = sm90_act_quant_columns_unsupported_reason(data_shape[1], offsets.shape[0] - 1)
        if reason:
            raise ValueError(f"{_ACT_QUANT}: {reason.removeprefix('sm90 backend: ')}")
    if m == 0:
        return None, pre_shape, data_shape, clusters
    key = (_ACT_QUANT, x.dtype, activation, bias is not None, tvm_ffi_available(), cluster_m, weight_layout, tile_n,
           columns, bool(power_2_scales))
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_gemm_act_quant(*key[1:-1], power_2_scales=key[-1])
    return fn, pre_shape, data_shape, clusters


def grouped_gemm_fp8_sm90(
    x, x_scale_inv, weight, weight_scale_inv, offsets, *, bias=None, activation=None, probs=None,
    out_dtype=torch.bfloat16, out=None, act_out=None, tile_n=None, cluster_m=None, sm_margin=None,
    act_amax=False, overlap_promotion=None, **constants,
):
    """`grouped_gemm_sm90` ("nk" layout) on block-scaled FP8 operands, outputs in ``out_dtype``.

    x (M, K) float8_e4m3fn with x_scale_inv (M, ceil(K/128)) float32, the multiplier of each 1x128
    block (x ~= x.float() * scale); weight (G, N, K) float8_e4m3fn with weight_scale_inv
    (G, ceil(N/128), ceil(K/128)) float32 per 128x128 block (`quantization.quantize` /
    `quantize_weight` with "fp8_blockwise" make both). K a multiple of 16; N of 8 (128 for GLU).
    bias (G, N), out (M, N), act_out in ``out_dtype`` (bf16/fp16); probs, constants as for
    `grouped_gemm_sm90`. Returns (pre, act). Each 128-deep block's product is accumulated in fp32
    and scaled on the CUDA cores. tile_n: 128, 192 or 256 (256: the block's product taken in two
    128-column halves; GLU with N/2 an odd multiple of 64: the up half's two 64-column parts
    scaled by their own W blocks) (None: `tuning.fp8_tile_n`); cluster_m (1, 2)
    overrides the heuristic. ``act_amax``: also return the act's amax parts, as `grouped_gemm_sm90`.
    ``overlap_promotion`` (tile_n 128): two block products in flight, one promoted while the next
    one's WGMMAs run (the same sums, bit for bit; FC1 + SwiGLU 1.8% / 2.6% faster on dsv3 / mixtral,
    H100); None: on wherever the n-tile is 128. No host sync; checks run once per argument signature.
    """
    tvm_ffi = tvm_ffi_available()
    key = (
        call_signature(tvm_ffi, x, x_scale_inv, weight, weight_scale_inv, offsets, bias, probs, out, act_out),
        _FP8, activation, out_dtype, tile_n, cluster_m, sm_margin, act_amax, overlap_promotion,
    )
    args = (x, x_scale_inv, weight, weight_scale_inv, offsets, bias, activation, probs, out_dtype, out,
            act_out, tile_n, cluster_m, sm_margin, act_amax, overlap_promotion)
    launch = _MEMO.get(key)
    if launch is None:
        launch = _fp8_launch(*args)
        if tile_n is None and cluster_m is None and overlap_promotion is None and launch[0] is not None:
            (m, k), (g, n, _) = x.shape, weight.shape
            spec = activation_spec(activation, _FP8)
            glu = spec is not None and spec.glu
            config = tuning.tuned_config(
                _FP8, (out_dtype, g, n, k, tuning.rows_bucket(m), activation, bias is not None, bool(act_amax)),
                lambda cfg: _amax_folded(grouped_gemm_fp8_sm90(
                    x, x_scale_inv, weight, weight_scale_inv, offsets, bias=bias, activation=activation, probs=probs,
                    out_dtype=out_dtype, tile_n=cfg.tile_n, cluster_m=cfg.cluster_m, sm_margin=sm_margin,
                    act_amax=act_amax, **constants),
                    act_amax),
                (tuning.fp8_tile_n(n, glu), _fp8_cluster_m(m, n, g, x.get_device(), sm_margin)),
                tuning.fp8_candidates())
            if config is not None:
                args = (*args[:11], config.tile_n, config.cluster_m, *args[13:])
                launch = _fp8_launch(*args)
        _MEMO.put(key, launch)
    fn, pre_shape, act_shape, clusters, num_parts = launch
    pre = out if out is not None else torch.empty(pre_shape, dtype=out_dtype, device=x.device)
    act = act_out
    if act is None and act_shape is not None:
        act = torch.empty(act_shape, dtype=out_dtype, device=x.device)
    parts = _amax_parts(fn, num_parts, x.device)
    _run(fn, tvm_ffi, _fp8_launch, args,
         (x, x_scale_inv, weight, weight_scale_inv, offsets, pre, act, bias, probs, parts),
         activation_constants(_FP8, constants), clusters)
    return (pre, act) if parts is None else (pre, act, parts)


def _amax_folded(result: tuple, amax: bool) -> tuple:
    """An FP8 wrapper's result with its amax parts (last, when ``amax``) reduced to their max: the
    parts' count and order follow the launch configuration, their max does not."""
    return (*result[:-1], result[-1].amax()) if amax else result


def _fp8_cluster_m(m, n, g, dev, sm_margin) -> int:
    """The FP8 kernels' heuristic cluster_m (as `_launch_config` chooses it for them)."""
    return _launch_config(_FP8, m, n, g, dev, 128, None, sm_margin)[1]


def _fp8_launch(x, x_scale, weight, weight_scale, offsets, bias, activation, probs, out_dtype, out, act_out,
                tile_n, cluster_m, sm_margin, act_amax=False, overlap_promotion=None):
    """Every check of `grouped_gemm_fp8_sm90`; (launcher or None when M == 0, pre shape, act shape
    or None, persistent grid in clusters, act-amax parts or 0)."""
    if out_dtype not in DTYPES:
        raise TypeError(f"{_FP8}: out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    dev, (m, k), (g, n, _) = _check_fp8_operands(_FP8, ("x", x, x_scale), ("weight", weight, weight_scale), offsets)
    spec = activation_spec(activation, _FP8)
    glu = spec is not None and spec.glu
    multiple = FP8_GLU_N_MULTIPLE if glu else 8
    if n % multiple:
        raise ValueError(f"{_FP8}: N={n} (weight.shape[1]) must be a multiple of {multiple}"
                         + (f" for activation {activation!r}" if glu else ""))
    act_shape = _check_epilogue_tensors(_FP8, spec, out_dtype, bias, probs, out, act_out, m, n, g, dev)
    if tile_n not in (None, 128, 192, 256):
        raise ValueError(f"{_FP8}: tile_n must be 128, 192 or 256, got {tile_n!r}")
    if overlap_promotion is not None and not isinstance(overlap_promotion, bool):
        raise TypeError(f"{_FP8}: overlap_promotion must be a bool or None, got {type(overlap_promotion).__name__}")
    if overlap_promotion and tile_n not in (None, 128):
        raise ValueError(f"{_FP8}: overlap_promotion needs tile_n 128, got {tile_n}")
    _, cluster_m, clusters, _ = _launch_config(_FP8, m, n, g, dev, 128, cluster_m, sm_margin)
    num_parts = _check_amax_request(_FP8, "act_amax", act_amax, act_shape is not None, clusters, cluster_m)
    if m == 0:
        return None, (m, n), act_shape, clusters, num_parts
    tile_n = 128 if overlap_promotion else tile_n or tuning.fp8_tile_n(n, glu)
    overlap_promotion = tile_n == 128 if overlap_promotion is None else overlap_promotion
    key = (_FP8, out_dtype, activation, bias is not None, tvm_ffi_available(), cluster_m, tile_n, bool(act_amax),
           overlap_promotion, glu and tile_n == 256 and (n // 2) % 128 != 0)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_gemm_fp8(*key[1:])
    return fn, (m, n), act_shape, clusters, num_parts


def grouped_gemm_act_quant_fp8_sm90(
    x, x_scale_inv, weight, weight_scale_inv, offsets, *, activation, bias=None, probs=None,
    out_dtype=torch.bfloat16, out=None, power_2_scales=False, columns=False, cluster_m=None, sm_margin=None,
    **constants,
):
    """`grouped_gemm_fp8_sm90` with a GLU ``activation`` whose act is cast to E4M3 in 1 x 128 blocks
    in the epilogue ("fp8_blockwise"), as `grouped_gemm_act_quant_sm90` casts it: bit for bit
    `quantization.quantize` of the act `grouped_gemm_fp8_sm90` returns in ``out_dtype``, without
    writing that act.

    Operands, bias, probs, out (the pre-activation buffer) and constants as for
    `grouped_gemm_fp8_sm90`; N/2 a multiple of 128 (tile_n 256: each block's product in two
    halves, a tile's 128 act columns one cast block). Returns (pre (M, N) in ``out_dtype``, data
    (M, N/2) float8_e4m3fn, scale_inv (M, N/256) float32[, `BlockColumns` with ``columns``: the
    per-group column-wise copy as `block_columns_sm90` makes it, G <= 512]). Rows >= offsets[G]:
    pre and data zero, scale_inv 1. No host sync.
    """
    tvm_ffi = tvm_ffi_available()
    key = (
        call_signature(tvm_ffi, x, x_scale_inv, weight, weight_scale_inv, offsets, bias, probs, out),
        _ACT_QUANT_FP8, activation, out_dtype, power_2_scales, columns, cluster_m, sm_margin,
    )
    args = (x, x_scale_inv, weight, weight_scale_inv, offsets, bias, activation, probs, out_dtype, out, power_2_scales,
            columns, cluster_m, sm_margin)
    launch = _MEMO.get(key) or _MEMO.put(key, _act_quant_fp8_launch(*args))
    fn, pre_shape, data_shape, clusters = launch
    pre = out if out is not None else torch.empty(pre_shape, dtype=out_dtype, device=x.device)
    cast = _cast_outputs(data_shape, offsets.shape[0] - 1, columns, x.device)
    _run(fn, tvm_ffi, _act_quant_fp8_launch, args,
         (x, x_scale_inv, weight, weight_scale_inv, offsets, pre, *cast, bias, probs),
         activation_constants(_ACT_QUANT_FP8, constants), clusters)
    return _cast_result(pre, cast, data_shape[0], columns)


def _act_quant_fp8_launch(x, x_scale, weight, weight_scale, offsets, bias, activation, probs, out_dtype, out,
                          power_2_scales, columns, cluster_m, sm_margin):
    """Every check of `grouped_gemm_act_quant_fp8_sm90`; (launcher or None when M == 0, pre shape,
    cast output shape, persistent grid in clusters)."""
    name = _ACT_QUANT_FP8
    if out_dtype not in DTYPES:
        raise TypeError(f"{name}: out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    dev, (m, k), (g, n, _) = _check_fp8_operands(name, ("x", x, x_scale), ("weight", weight, weight_scale), offsets)
    spec = activation_spec(activation, name)
    if spec is None or not spec.glu:
        glus = tuple(key for key, s in ACTIVATIONS.items() if s.glu)
        raise ValueError(f"{name}: activation must be a GLU activation {glus}, got {activation!r}")
    if n % (2 * CAST_COLUMNS_MULTIPLE):
        raise ValueError(f"{name}: N={n} (weight.shape[1]) must be a multiple of {2 * CAST_COLUMNS_MULTIPLE} (each "
                         "half of a 256-wide tile one W block and one cast block)")
    if not isinstance(power_2_scales, bool):
        raise TypeError(f"{name}: power_2_scales must be a bool, got {type(power_2_scales).__name__}")
    if not isinstance(columns, bool):
        raise TypeError(f"{name}: columns must be a bool, got {type(columns).__name__}")
    act_shape = _check_epilogue_tensors(name, spec, out_dtype, bias, probs, out, None, m, n, g, dev)
    if columns:
        reason = sm90_act_quant_columns_unsupported_reason(act_shape[1], g)
        if reason:
            raise ValueError(f"{name}: {reason.removeprefix('sm90 backend: ')}")
    _, cluster_m, clusters, _ = _launch_config(name, m, n, g, dev, 256, cluster_m, sm_margin)
    if m == 0:
        return None, (m, n), act_shape, clusters
    key = (_ACT_QUANT_FP8, out_dtype, activation, bias is not None, tvm_ffi_available(), cluster_m, columns,
           power_2_scales)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_gemm_act_quant_fp8(*key[1:-1], power_2_scales=key[-1])
    return fn, (m, n), act_shape, clusters


def _check_fp8_operands(fn_name, a, b, offsets):
    """Checks of block-scaled FP8 operands a = (name, (M, K) E4M3, (M, ceil(K/128)) float32) and
    b = (name, (G, N, K) E4M3, (G, ceil(N/128), ceil(K/128)) float32), K a multiple of 16, and of
    offsets (G + 1,) int32; returns (device index, a's shape, b's shape)."""
    (a_name, a_data, a_scale), (b_name, b_data, b_scale) = a, b
    if not isinstance(a_data, torch.Tensor):
        raise TypeError(f"{fn_name}: {a_name} must be a torch.Tensor, got {type(a_data).__name__}")
    dev = a_data.get_device()
    if dev < 0:
        raise ValueError(f"{fn_name}: {a_name} must be on a CUDA device, got {a_data.device}")
    check_tensor(fn_name, a_data, a_name, torch.float8_e4m3fn, 2, dev)
    check_tensor(fn_name, b_data, b_name, torch.float8_e4m3fn, 3, dev)
    check_tensor(fn_name, a_scale, f"{a_name}_scale_inv", torch.float32, 2, dev)
    check_tensor(fn_name, b_scale, f"{b_name}_scale_inv", torch.float32, 3, dev)
    check_tensor(fn_name, offsets, "offsets", torch.int32, 1, dev)
    m, k = a_data.shape
    g, n, kb = b_data.shape
    if kb != k:
        raise ValueError(f"{fn_name}: {b_name} has K={kb} (its last dim), {a_name} has K={k}")
    if g < 1:
        raise ValueError(f"{fn_name}: {b_name} must hold at least one group")
    if k % 16:
        raise ValueError(f"{fn_name}: K={k} ({a_name}.shape[1]) must be a multiple of 16")
    _check_shape(fn_name, a_scale, f"{a_name}_scale_inv", (m, -(-k // 128)))
    _check_shape(fn_name, b_scale, f"{b_name}_scale_inv", (g, -(-n // 128), -(-k // 128)))
    _check_shape(fn_name, offsets, "offsets", (g + 1,))
    return dev, (m, k), (g, n, k)


def grouped_dgrad_dact_sm90(
    dy, weight, offsets, pre, *, activation, probs=None, out=None, act_out=None, dy_index=None,
    sm_margin=None, tile_n=None, cluster_m=None, epilogue_warps=None, pingpong=None, deep_operands=False,
    d_probs_parts=False, emit_act=True, **constants,
):
    """Backward of FC2 fused with the activation's backward: h = dy_g @ W[g], then dActivation.

    dy (M, H) bf16/fp16; weight (G, H, I) the FC2 weight in its natural layout (read in place);
    offsets (G+1,) int32; pre (M, 2I) [gate, up] for GLU, (M, I) for srelu, the saved
    pre-activation; probs (M,) float32 for scaled_swiglu; constants as for `grouped_gemm_sm90`;
    out / act_out: optional preallocated buffers for d_pre / act.
    ``dy_index`` (M,) int32: dy is (T, H) instead and row r of h is dy[dy_index[r]] @ W[g] (ids
    outside [0, T) clamped), read by index inside the GEMM (a combine's backward whose expert rows
    are copies of their token's gradient, never written); H a multiple of 64, not with
    epilogue_warps.
    Returns (d_pre like pre, act (M, I) = activation(pre) (times probs for scaled_swiglu: the input
    of FC2's weight gradient), d_probs (M,) float32 for scaled_swiglu else None). With
    ``d_probs_parts`` d_probs is the kernel's (P, M) float32 partial sums over its column tiles
    instead (their sum over dim 0), for a caller whose next pass sums them. Without ``emit_act``
    act is not written and None is returned in its place (a caller that kept it).
    Rows >= offsets[G] are zero. No host sync. H a multiple of 8; I a multiple of 32 (GLU) or 8.
    ``epilogue_warps`` (None: False): True runs the dActivation on three warps of its own, on h
    rounded to dy's dtype (as the unfused path stores it), while the MMA warpgroups run the next
    tile; False: the MMA warpgroups run it from their fp32 accumulator between tiles.
    ``pingpong`` as for `grouped_gemm_sm90` (not with epilogue_warps). ``deep_operands``: one C
    stage and one store slot, the rest of shared memory as operand stages (ping-pong only; False:
    the kernel's own split, which at ping-pong 192 with ``dy_index`` is that one already).
    Checks run once per argument signature, as for `grouped_gemm_sm90`.
    """
    tvm_ffi = tvm_ffi_available()
    if not isinstance(emit_act, bool):
        raise TypeError(f"{_DACT}: emit_act must be a bool, got {type(emit_act).__name__}")
    if act_out is not None and not emit_act:
        raise ValueError(f"{_DACT}: act_out given with emit_act=False")
    key = (
        call_signature(tvm_ffi, dy, weight, offsets, pre, probs, out, act_out, dy_index),
        _DACT, activation, tile_n, cluster_m, sm_margin, epilogue_warps, pingpong, deep_operands, emit_act,
    )
    args = (dy, weight, offsets, pre, activation, probs, out, act_out, tile_n, cluster_m, sm_margin, epilogue_warps,
            pingpong, dy_index, deep_operands, emit_act)
    launch = _MEMO.get(key)
    if launch is None:
        launch = _dact_launch(*args)
        if tile_n is None and cluster_m is None and pingpong is None and not deep_operands and launch[0] is not None:
            i, m = weight.shape[2], pre.shape[0]
            conflict = _dact_conflict(epilogue_warps)
            config = tuning.tuned_config(
                _DACT, (dy.dtype, weight.shape[0], i, dy.shape[1], tuning.rows_bucket(m), activation,
                        epilogue_warps, dy_index is not None) + (() if emit_act else ("no act",)),
                lambda cfg: grouped_dgrad_dact_sm90(dy, weight, offsets, pre, activation=activation, probs=probs,
                                                    dy_index=dy_index, sm_margin=sm_margin, tile_n=cfg.tile_n,
                                                    cluster_m=cfg.cluster_m, epilogue_warps=epilogue_warps,
                                                    pingpong=cfg.pingpong, deep_operands=cfg.deep_operands,
                                                    emit_act=emit_act, **constants),
                heuristic_config(m, i, dy.shape[1], weight.shape[0], num_sms(dy.get_device()),
                                 conflict=conflict, act_epilogue=True),
                _candidates(conflict) + (() if conflict else tuning.DEEP_OPERAND_CANDIDATES))
            if config is not None:
                args = (*args[:8], config.tile_n, config.cluster_m, *args[10:12], config.pingpong, dy_index,
                        config.deep_operands, emit_act)
                launch = _dact_launch(*args)
        _MEMO.put(key, launch)
    fn, act_shape, partial_shape, clusters = launch
    d_pre = out if out is not None else torch.empty_like(pre)
    act = None if not emit_act else act_out if act_out is not None else dy.new_empty(act_shape)
    d_probs_part = None if partial_shape is None else dy.new_empty(partial_shape, dtype=torch.float32)
    operands = (dy,) if dy_index is None else (dy, dy_index)
    _run(fn, tvm_ffi, _dact_launch, args, (*operands, weight, offsets, pre, d_pre, act, probs, d_probs_part),
         activation_constants(_DACT, constants), clusters)
    return d_pre, act, _d_probs(d_probs_part, d_probs_parts)


def _d_probs(d_probs_part, keep_parts: bool):
    """d_probs from the kernel's (P, M) partials: their sum over dim 0, or themselves."""
    if d_probs_part is None or keep_parts:
        return d_probs_part
    return d_probs_part.sum(0)


def _dact_conflict(epilogue_warps) -> str | None:
    """The option of `grouped_dgrad_dact_sm90` that rules ping-pong out, or None."""
    return "epilogue_warps" if epilogue_warps else None


def _dact_launch(dy, weight, offsets, pre, activation, probs, out, act_out, tile_n, cluster_m, sm_margin,
                 epilogue_warps, pingpong=None, dy_index=None, deep_operands=False, emit_act=True):
    """Every check of `grouped_dgrad_dact_sm90`; (launcher or None when M == 0, act shape,
    d_probs partials shape or None, persistent grid in clusters)."""
    dev = check_input(_DACT, dy, "dy")
    check_tensor(_DACT, weight, "weight", dy.dtype, 3, dev)
    check_tensor(_DACT, offsets, "offsets", torch.int32, 1, dev)
    spec = activation_spec(activation, _DACT)
    if spec is None:
        raise ValueError(f"{_DACT}: activation is required, one of {tuple(ACTIVATIONS)}")
    m, h = dy.shape
    if dy_index is not None:
        check_tensor(_DACT, dy_index, "dy_index", torch.int32, 1, dev)
        m = dy_index.shape[0]
        if dy.shape[0] == 0 and m:
            raise ValueError(f"{_DACT}: dy has no rows to gather, dy_index has {m}")
        if h % GATHER_K_MULTIPLE:
            raise ValueError(f"{_DACT}: H={h} (dy.shape[1]) must be a multiple of {GATHER_K_MULTIPLE} with dy_index")
        if epilogue_warps:
            raise ValueError(f"{_DACT}: dy_index runs on the MMA warpgroups' epilogue (not epilogue_warps)")
    g, hw, i = weight.shape
    if hw != h:
        raise ValueError(f"{_DACT}: weight has H={hw} (weight.shape[1]), dy has H={h}")
    if g < 1:
        raise ValueError(f"{_DACT}: weight must hold at least one group")
    _check_shape(_DACT, offsets, "offsets", (g + 1,))
    if h % 8:
        raise ValueError(f"{_DACT}: H={h} (dy.shape[1]) must be a multiple of 8")
    multiple = DACT_GLU_I_MULTIPLE if spec.glu else 8
    if i % multiple:
        raise ValueError(
            f"{_DACT}: I={i} (weight.shape[2]) must be a multiple of {multiple} for activation "
            f"{activation!r}"
        )
    check_tensor(_DACT, pre, "pre", dy.dtype, 2, dev)
    _check_shape(_DACT, pre, "pre", (m, 2 * i if spec.glu else i))
    _check_probs(_DACT, spec, probs, m, dev)
    for buf, arg, shape in ((out, "out", pre.shape), (act_out, "act_out", (m, i))):
        if buf is not None:
            check_tensor(_DACT, buf, arg, dy.dtype, 2, dev)
            _check_shape(_DACT, buf, arg, tuple(shape))
    if epilogue_warps is None:
        # faster alone (H100: 1.02-1.07x), not in the training step (docs/notes/backward-kernels.md)
        epilogue_warps = False
    elif not isinstance(epilogue_warps, bool):
        raise TypeError(f"{_DACT}: epilogue_warps must be a bool or None, got {type(epilogue_warps).__name__}")
    tile_n, cluster_m, clusters, pingpong = _launch_config(_DACT, m, i, g, dev, tile_n, cluster_m, sm_margin,
                                                           pingpong=pingpong,
                                                           conflict=_dact_conflict(epilogue_warps),
                                                           k=h, act_epilogue=True)
    if not isinstance(deep_operands, bool):
        raise TypeError(f"{_DACT}: deep_operands must be a bool, got {type(deep_operands).__name__}")
    if deep_operands and not pingpong:
        raise ValueError(f"{_DACT}: deep_operands needs the ping-pong schedule")
    partial_shape = (-(-i // tile_n), m) if spec.takes_probs else None
    if m == 0:
        return None, (m, i), partial_shape, clusters
    key = (_DACT, dy.dtype, tile_n, activation, tvm_ffi_available(), cluster_m, epilogue_warps, pingpong,
           dy_index is not None, deep_operands, emit_act)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_dgrad_dact(*key[1:])
    return fn, (m, i), partial_shape, clusters


def grouped_dgrad_dact_fp8_sm90(
    dy, dy_scale_inv, weight_t, weight_t_scale_inv, offsets, pre, *, activation, probs=None, out=None,
    tile_n=None, cluster_m=None, sm_margin=None, d_pre_amax=False, emit_act=False, d_probs_parts=False,
    **constants,
):
    """`grouped_dgrad_dact_sm90` on block-scaled FP8 operands: h = dy_g @ W[g] in FP8, then dActivation.

    dy (M, H) float8_e4m3fn with dy_scale_inv (M, ceil(H/128)) float32 per 1x128 block; weight_t
    (G, I, H) float8_e4m3fn, FC2's weight (G, H, I) cast in 128x128 blocks and transposed per
    group (`block_quantize_sm90(..., transposed=True)`), with weight_t_scale_inv
    (G, ceil(I/128), ceil(H/128)); pre, probs, constants as for `grouped_dgrad_dact_sm90`, pre's
    dtype (bf16/fp16) the output's; ``out``: d_pre's buffer (pre itself allowed: each tile reads
    its pre before it stores its d_pre there). Returns (d_pre like pre, d_probs (M,) float32 for
    scaled_swiglu else None); with ``emit_act`` (d_pre, act (M, I) in pre's dtype, d_probs), act as
    `grouped_dgrad_dact_sm90` returns it (FC2's 16-bit weight gradient reads it where the forward
    kept the act only in E4M3). Rows >= offsets[G] are zero. H a multiple of 16; I of 32 (GLU) or
    8. tile_n (over I): 128 or 256 (each block's product in two 128-column halves); None:
    `tuning.fp8_dact_tile_n`. ``d_pre_amax``: also return d_pre's amax parts, as ``act_amax`` of
    `grouped_gemm_sm90` (the fp8_current cast of FC1's data gradient). ``d_probs_parts`` as for
    `grouped_dgrad_dact_sm90`. No host sync; checks run once per argument signature.
    """
    tvm_ffi = tvm_ffi_available()
    key = (
        call_signature(tvm_ffi, dy, dy_scale_inv, weight_t, weight_t_scale_inv, offsets, pre, probs, out),
        _DACT_FP8, pre.dtype, activation, tile_n, cluster_m, sm_margin, d_pre_amax, emit_act,
    )
    args = (dy, dy_scale_inv, weight_t, weight_t_scale_inv, offsets, pre, activation, probs, cluster_m, sm_margin,
            d_pre_amax, tile_n, emit_act)
    launch = _MEMO.get(key)
    if launch is None:
        launch = _dact_fp8_launch(*args)
        _check_d_pre_out(_DACT_FP8, out, pre)
        if tile_n is None and cluster_m is None and launch[0] is not None:
            m, (g, i, h) = dy.shape[0], weight_t.shape
            config = tuning.tuned_config(
                _DACT_FP8, (pre.dtype, g, i, h, tuning.rows_bucket(m), activation, bool(d_pre_amax), emit_act),
                lambda cfg: _amax_folded(grouped_dgrad_dact_fp8_sm90(
                    dy, dy_scale_inv, weight_t, weight_t_scale_inv, offsets, pre, activation=activation, probs=probs,
                    tile_n=cfg.tile_n, cluster_m=cfg.cluster_m, sm_margin=sm_margin, d_pre_amax=d_pre_amax,
                    emit_act=emit_act, **constants), d_pre_amax),
                (tuning.fp8_dact_tile_n(i), _fp8_cluster_m(m, i, g, dy.get_device(), sm_margin)),
                tuning.fp8_candidates(tile_ns=(128, 256)))
            if config is not None:
                args = (*args[:8], config.cluster_m, *args[9:11], config.tile_n, emit_act)
                launch = _dact_fp8_launch(*args)
        _MEMO.put(key, launch)
    fn, partial_shape, clusters, num_parts = launch
    d_pre = torch.empty_like(pre) if out is None else out
    act = pre.new_empty((pre.shape[0], weight_t.shape[1])) if emit_act else None
    d_probs_part = None if partial_shape is None else pre.new_empty(partial_shape, dtype=torch.float32)
    parts = _amax_parts(fn, num_parts, pre.device)
    _run(fn, tvm_ffi, _dact_fp8_launch, args,
         (dy, dy_scale_inv, weight_t, weight_t_scale_inv, offsets, pre, d_pre, act, probs, d_probs_part, parts),
         activation_constants(_DACT_FP8, constants), clusters)
    d_probs = _d_probs(d_probs_part, d_probs_parts)
    outputs = (d_pre, act, d_probs) if emit_act else (d_pre, d_probs)
    return outputs if parts is None else (*outputs, parts)


def _check_d_pre_out(name, out, pre):
    """``out`` (None, or d_pre's buffer: pre's dtype, shape and device, contiguous rows)."""
    if out is not None:
        check_tensor(name, out, "out", pre.dtype, 2, pre.get_device())
        _check_shape(name, out, "out", tuple(pre.shape))


def _dact_fp8_launch(dy, dy_scale, weight_t, weight_t_scale, offsets, pre, activation, probs, cluster_m, sm_margin,
                     d_pre_amax=False, tile_n=None, emit_act=False):
    """Every check of `grouped_dgrad_dact_fp8_sm90`; (launcher or None when M == 0, d_probs
    partials shape or None, persistent grid in clusters, d_pre amax parts or 0)."""
    name = _DACT_FP8
    if not isinstance(emit_act, bool):
        raise TypeError(f"{name}: emit_act must be a bool, got {type(emit_act).__name__}")
    dev, (m, h), (g, i, _) = _check_fp8_operands(
        name, ("dy", dy, dy_scale), ("weight_t", weight_t, weight_t_scale), offsets
    )
    spec = activation_spec(activation, name)
    if spec is None:
        raise ValueError(f"{name}: activation is required, one of {tuple(ACTIVATIONS)}")
    multiple = DACT_GLU_I_MULTIPLE if spec.glu else 8
    if i % multiple:
        raise ValueError(f"{name}: I={i} (weight_t.shape[1]) must be a multiple of {multiple} for activation "
                         f"{activation!r}")
    if not isinstance(pre, torch.Tensor) or pre.dtype not in DTYPES:
        raise TypeError(f"{name}: pre must be a bfloat16 or float16 tensor, got {getattr(pre, 'dtype', type(pre))}")
    check_tensor(name, pre, "pre", pre.dtype, 2, dev)
    _check_shape(name, pre, "pre", (m, 2 * i if spec.glu else i))
    _check_probs(name, spec, probs, m, dev)
    if tile_n not in (None, 128, 256):
        raise ValueError(f"{name}: tile_n must be 128 or 256, got {tile_n!r}")
    tile_n = tile_n or tuning.fp8_dact_tile_n(i)
    _, cluster_m, clusters, _ = _launch_config(name, m, i, g, dev, tile_n, cluster_m, sm_margin)
    partial_shape = (-(-i // tile_n), m) if spec.takes_probs else None
    num_parts = _check_amax_request(name, "d_pre_amax", d_pre_amax, True, clusters, cluster_m)
    if m == 0:
        return None, partial_shape, clusters, num_parts
    key = (_DACT_FP8, pre.dtype, activation, tvm_ffi_available(), cluster_m, bool(d_pre_amax), tile_n, emit_act)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_dgrad_dact_fp8(*key[1:])
    return fn, partial_shape, clusters, num_parts


def _run(fn, tvm_ffi, checks, check_args, tensors, constants, clusters):
    """Launch ``fn`` (None: M == 0, nothing to launch) on ``tensors`` (a tuple, None for absent
    ones), the activation ``constants`` (floats, `activations.activation_constants`) and the Int32
    grid size. When the compiled
    entry rejects an argument, rerun the wrapper's ``checks(*check_args)``: they raise the error
    naming it (else the entry's own error propagates)."""
    if fn is None:
        return
    try:
        if tvm_ffi:
            fn(*tensors, constants, clusters)
        else:
            _launch_classic(fn, tensors, constants, clusters)
    except Exception:
        checks(*check_args)
        raise


def _launch_classic(fn, tensors, constants, clusters):
    """The CuTe DSL call path without TVM-FFI (tensors through DLPack, explicit stream)."""
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    def cv(t):
        if t is None:
            return None
        align = 4 if t.dtype in (torch.int32, torch.float32) else 16
        return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    device = next(t for t in tensors if t is not None).device
    stream = cuda.CUstream(torch.cuda.current_stream(device).cuda_stream)
    fn(*(cv(t) for t in tensors), tuple(cutlass.Float32(c) for c in constants), cutlass.Int32(clusters), stream)
