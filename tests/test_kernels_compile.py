"""The sm90 kernel configurations compile for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a).

A covering set rather than the cross product (a compile takes 3-10 s on CI's 2 cores): every
kernel class, every activation in the forward and the backward kernel, each tile_n, dtype, bias,
W multicast and weight layout at least once. `test_wgmma_batching` compiles eight more; the GPU
tests compile and run the full matrices.
"""

import importlib.util
import os

import pytest
import torch

from te_fused_ops.activations import ACTIVATIONS

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

@pytest.fixture(autouse=True)
def _sm90a(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


def test_package_imports_without_cutlass_use():
    import te_fused_ops.backends.sm90.kernels as k

    assert k.sm90_unavailable_reason() is None  # with CUTE_DSL_ARCH=sm_90a


@pytest.mark.parametrize("activation,tile_n,dtype,has_bias", [
    (None, 128, torch.bfloat16, True), ("swiglu", 128, torch.float16, False), ("geglu", 256, torch.bfloat16, True),
    ("srelu", 256, torch.float16, False), ("clamped_swiglu", 128, torch.bfloat16, True),
    ("scaled_swiglu", 192, torch.bfloat16, False),
])
def test_grouped_gemm_compiles(activation, tile_n, dtype, has_bias):
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm

    assert os.environ["CUTE_DSL_ARCH"] == "sm_90a"
    assert compile_grouped_gemm(dtype, tile_n, activation, has_bias, tvm_ffi=False) is not None


def test_grouped_gemm_with_act_amax_compiles():
    """The act's amax parts from the epilogue (fp8_current), bf16 and FP8 kernels."""
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm, compile_grouped_gemm_fp8

    assert compile_grouped_gemm(torch.bfloat16, 192, "swiglu", False, False, act_amax=True) is not None
    assert compile_grouped_gemm_fp8(torch.bfloat16, "srelu", False, False, act_amax=True) is not None


def test_grouped_gemm_compiles_without_cluster():
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm

    assert compile_grouped_gemm(torch.bfloat16, 128, "srelu", True, False, 1) is not None


@pytest.mark.parametrize(
    "dtype,tile_n,activation,has_bias,cluster_m",
    [(torch.bfloat16, 256, None, False, 2), (torch.float16, 128, "swiglu", True, 1)],
)
def test_grouped_gemm_kn_compiles(dtype, tile_n, activation, has_bias, cluster_m):
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm

    fn = compile_grouped_gemm(dtype, tile_n, activation, has_bias, False, cluster_m, "kn")
    assert fn is not None


@pytest.mark.parametrize("activation,tile_n,epilogue_warps", [
    ("swiglu", 128, False), ("geglu", 256, True), ("srelu", 128, True), ("clamped_swiglu", 256, False),
    ("scaled_swiglu", 256, True),
])
def test_grouped_dgrad_dact_compiles(activation, tile_n, epilogue_warps):
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_dgrad_dact

    assert compile_grouped_dgrad_dact(torch.bfloat16, tile_n, activation, False, 2, epilogue_warps) is not None


@pytest.mark.parametrize("tile_n,pingpong,gathered", [(192, True, True), (128, False, False), (256, False, True)])
def test_grouped_dgrad_dact_compiles_without_the_act(tile_n, pingpong, gathered):
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_dgrad_dact

    assert compile_grouped_dgrad_dact(torch.bfloat16, tile_n, "scaled_swiglu", False, 2, False, pingpong, gathered,
                                      emit_act=False) is not None


def test_grouped_dgrad_dact_compiles_fp16_and_without_cluster():
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_dgrad_dact

    assert compile_grouped_dgrad_dact(torch.float16, 128, "swiglu", False, 1, False) is not None


def test_device_math_covers_the_registry():
    from te_fused_ops.backends.sm90.kernels.activation_math_sm90 import ACTIVATION_MATH

    assert set(ACTIVATION_MATH) == set(ACTIVATIONS)


def test_unknown_epilogue_rejected():
    import cutlass

    from te_fused_ops.backends.sm90.kernels.grouped_dact_sm90 import GroupedGemmDActFp8Sm90, GroupedGemmDActSm90
    from te_fused_ops.backends.sm90.kernels.grouped_act_sm90 import GroupedGemmActQuantSm90, GroupedGemmActSm90

    with pytest.raises(ValueError, match="activation"):
        GroupedGemmActSm90(cutlass.BFloat16, 128, "relu", False)
    with pytest.raises(ValueError, match="needs an activation"):
        GroupedGemmDActSm90(cutlass.BFloat16, 128, None)
    with pytest.raises(ValueError, match="epilogue_warps"):  # its hooks need the whole accumulator
        GroupedGemmActQuantSm90(cutlass.BFloat16, "swiglu", False, epilogue_warps=True)
    with pytest.raises(ValueError, match="epilogue_warps"):  # FP8 operands
        GroupedGemmDActFp8Sm90(cutlass.BFloat16, "swiglu", epilogue_warps=True)


def test_unsupported_reasons():
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import sm90_grouped_dgrad_dact_unsupported_reason as why_dact
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import sm90_grouped_gemm_unsupported_reason as why

    assert why(torch.bfloat16, 4096, 2048, "swiglu", True) is None
    assert why(torch.float16, 8, 8, None, False) is None
    assert "dtype float32" in why(torch.float32, 64, 64, None, False)
    assert "K=100" in why(torch.bfloat16, 64, 100, None, False)
    assert "N=100" in why(torch.bfloat16, 100, 64, None, False)
    assert "N=96" in why(torch.bfloat16, 96, 64, "swiglu", False)
    assert why(torch.bfloat16, 96, 64, "srelu", False) is None
    assert "'relu'" in why(torch.bfloat16, 64, 64, "relu", False)

    assert why_dact(torch.bfloat16, 1024, 96, "swiglu") is None
    assert why_dact(torch.float16, 8, 8, "srelu") is None
    assert "I=80" in why_dact(torch.bfloat16, 64, 80, "clamped_swiglu")
    assert "H=12" in why_dact(torch.bfloat16, 12, 64, "swiglu")
    assert "needs an activation" in why_dact(torch.bfloat16, 64, 64, None)


def test_split_offsets_compiles():
    from te_fused_ops.backends.sm90.kernels.split_offsets import compile_split_offsets

    assert compile_split_offsets(torch.int32, tvm_ffi=False) is not None


@pytest.mark.parametrize(
    "activation,dtype,has_bias,cluster_m,tile_n,up_box_split",
    [("swiglu", torch.bfloat16, True, 1, 128, False), ("scaled_swiglu", torch.float16, False, 2, 128, False),
     (None, torch.bfloat16, False, 2, 192, False), ("swiglu", torch.bfloat16, False, 2, 256, True)],
)
def test_grouped_gemm_fp8_compiles(activation, dtype, has_bias, cluster_m, tile_n, up_box_split):
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm_fp8

    fn = compile_grouped_gemm_fp8(dtype, activation, has_bias, tvm_ffi=False, cluster_m=cluster_m, tile_n=tile_n,
                                  up_box_split=up_box_split)
    assert fn is not None


@pytest.mark.parametrize("dtype,block_rows,power_2_scales,tensor_scale,transposed",
                         [(torch.bfloat16, 1, False, True, False), (torch.float16, 128, True, False, False),
                          (torch.bfloat16, 128, False, True, True), (torch.bfloat16, 128, False, False, True)])
def test_block_quantize_compiles(dtype, block_rows, power_2_scales, tensor_scale, transposed):
    from te_fused_ops.backends.sm90.kernels.block_quantize import compile_block_quantize

    assert compile_block_quantize(dtype, block_rows, False, power_2_scales, tensor_scale, transposed) is not None


def test_tensor_amax_and_dequantize_compile():
    from te_fused_ops.backends.sm90.kernels.block_quantize import compile_block_dequantize, compile_tensor_amax

    assert compile_tensor_amax(torch.bfloat16, True, tvm_ffi=False) is not None
    assert compile_block_dequantize(torch.float16, tvm_ffi=False) is not None


def test_grouped_dgrad_dact_fp8_compiles():
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_dgrad_dact_fp8

    assert compile_grouped_dgrad_dact_fp8(torch.bfloat16, "swiglu", tvm_ffi=False, cluster_m=2) is not None
    # d_pre's amax parts from the epilogue (fp8_current)
    assert compile_grouped_dgrad_dact_fp8(torch.float16, "scaled_swiglu", False, 1, d_pre_amax=True) is not None
    # the act for FC2's 16-bit weight gradient where the forward kept it only in E4M3
    assert compile_grouped_dgrad_dact_fp8(torch.bfloat16, "scaled_swiglu", False, 2, tile_n=256, emit_act=True) is not None


@pytest.mark.parametrize(
    "activation,has_bias,weight_layout,tile_n,columns",
    [("scaled_swiglu", True, "nk", 256, False), ("geglu", False, "kn", 256, True), (None, True, "nk", 128, True)],
)
def test_grouped_gemm_act_quant_compiles(activation, has_bias, weight_layout, tile_n, columns):
    """columns: the per-group column-wise copy too (a Transpose after the cast)."""
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm_act_quant

    fn = compile_grouped_gemm_act_quant(torch.bfloat16, activation, has_bias, tvm_ffi=False, weight_layout=weight_layout,
                                        tile_n=tile_n, columns=columns)
    assert fn is not None


@pytest.mark.parametrize("m_tiles,n_tiles", [(1, 1), (3, 5), (8, 7), (9, 4), (22, 3), (112, 16)])
def test_banded_tile_order(m_tiles, n_tiles):
    from te_fused_ops.backends.sm90.kernels.group_tile_scheduler import RASTER_BAND, banded_tile

    order = [banded_tile(t, m_tiles, n_tiles, RASTER_BAND) for t in range(m_tiles * n_tiles)]
    assert sorted(order) == [(m, n) for m in range(m_tiles) for n in range(n_tiles)]  # each tile once
    if m_tiles <= RASTER_BAND:  # short segments keep the m-fastest order
        assert order == [(t % m_tiles, t // m_tiles) for t in range(m_tiles * n_tiles)]
    # a wave of 66 consecutive tiles of a tall segment spans a block, not one column
    wave = order[: min(66, len(order))]
    assert len({m for m, _ in wave}) <= RASTER_BAND or m_tiles * n_tiles <= 66


@pytest.mark.parametrize("clusters,tiles", [(1, 5), (2, 7), (5, 23), (66, 66), (66, 3072), (66, 3100)])
def test_reversed_waves_cover_every_tile_once(clusters, tiles):
    """The varlen-K schedule: each cluster's ids grow (the walk ends at the first id past the
    last tile), every tile is visited by exactly one cluster, and odd waves run in reverse."""
    from te_fused_ops.backends.sm90.kernels.group_tile_scheduler import reversed_wave_tile

    seen = []
    for cluster in range(clusters):
        ids = [reversed_wave_tile(wave, cluster, clusters) for wave in range(-(-tiles // clusters) + 1)]
        assert ids == sorted(ids) and ids[0] == cluster
        seen += [t for t in ids if t < tiles]
    assert sorted(seen) == list(range(tiles))
    if tiles >= 2 * clusters:
        assert [reversed_wave_tile(1, c, clusters) for c in range(clusters)] == list(range(2 * clusters - 1, clusters - 1, -1))


def test_segment_tiles_split_tail():
    from te_fused_ops.backends.sm90.kernels.group_tile_scheduler import segment_tiles

    for rows in (0, 1, 128, 129, 256, 300, 517, 2700):
        m_tiles = -(-rows // 128)
        for n_tiles in (1, 2, 3, 6):
            # a vertical pair per two m-tiles; an odd last m-tile as ceil(n/2) split pairs
            assert segment_tiles(rows, n_tiles, 128, 2, True) == m_tiles // 2 * n_tiles + m_tiles % 2 * -(-n_tiles // 2)
            assert segment_tiles(rows, n_tiles, 128, 2, False) == -(-m_tiles // 2) * n_tiles
            assert segment_tiles(rows, n_tiles, 128, 1, True) == m_tiles * n_tiles


def test_choose_config_pairs_when_n_has_two_tiles():
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import choose_config

    assert choose_config(65536, 1536, 128, 132) == (256, 2)  # qwen3 FC1: small groups, N of 6 tiles
    assert choose_config(2000, 256, 64, 132) == (128, 2)  # few tiles: 128 wide, two of them
    assert choose_config(100, 128, 8, 132) == (128, 1)  # one n-tile, small groups: no pairs
    assert choose_config(32768, 128, 8, 132) == (256, 2)  # one n-tile, large groups


def test_fp8_tile_is_256_on_glu_halves_padded_little_or_whole_blocks_else_192_where_it_pads_less():
    from te_fused_ops.backends.sm90.kernels.tuning import fp8_dact_tile_n, fp8_tile_n

    assert fp8_tile_n(1536, glu=True) == 256  # qwen3 FC1: 768-wide halves, six W blocks each
    assert fp8_tile_n(5760, glu=True) == 256  # gpt-oss FC1: 2880-wide halves, 2.2% padded at 256
    assert fp8_tile_n(2 * 192, glu=True) == 192  # halves of 1.5 W blocks: 33% padded at 256, none at 192
    assert fp8_tile_n(4096, glu=True) == 256  # dsv3 FC1: 2048-wide halves are 21.3 tiles of 96, 8 of 128
    assert fp8_tile_n(28672, glu=True) == 256  # mixtral FC1: 0.4% padding at 192
    assert fp8_tile_n(2880, glu=False) == 192 and fp8_tile_n(2048, glu=False) == 256
    assert fp8_tile_n(2 * 1408, glu=True) == 256 and fp8_tile_n(1408, glu=False) == 128  # a GLU tile holds 128 of each half
    assert fp8_tile_n(2 * 200, glu=True) == 128  # halves of 1.6 W blocks: a 256 tile would straddle two halves
    assert fp8_tile_n(1000, glu=False) == 128  # 256 pads more than 128
    assert fp8_tile_n(7168, glu=False) == fp8_tile_n(768, glu=False) == 256  # weight gradients' K
    assert fp8_dact_tile_n(2048) == fp8_dact_tile_n(768) == 256  # dsv3, qwen3: whole 256-wide tiles
    assert fp8_dact_tile_n(2880) == fp8_dact_tile_n(1408) == 128  # 256 pads more; I 2880 is not whole blocks


def test_forward_takes_192_wide_tiles_where_they_pad_n_less():
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import _ACT_QUANT, _FWD, choose_config, forward_tiles

    def forward(n, activation=None, layout="nk", fn=_FWD):
        return choose_config(32768, n, 32, 132, **forward_tiles(fn, layout, activation))[0]

    assert forward(2880) == 192  # 15 tiles of 192, 12 of 256 hold 6.7% padding
    assert forward(5760, "swiglu") == 192  # halves of 2880: 30 boxes of 96, 23 of 128
    assert forward(2816, "swiglu") == 256  # halves of 1408: 11 boxes of 128
    assert forward(2048) == forward(4096, "swiglu") == 256
    assert forward(2880, layout="kn") == 256  # FC1's data gradient: 192 not faster there
    assert forward(2880, fn=_ACT_QUANT) == 256  # the cast epilogue's tiles hold whole 1 x 128 blocks
    assert choose_config(32768, 2880, 32, 132) == (256, 2)  # dgrad + dActivation: 256


def test_pingpong_where_it_hides_an_activation_epilogue_or_192_wide_tiles_pad_less(monkeypatch):
    """The ping-pong heuristic (`pingpong_pays`) on the swept classes, and how `_launch_config`
    resolves it: only with no tile_n / cluster_m given, never beside a conflicting option."""
    from te_fused_ops.backends.sm90.kernels import grouped_gemm as gg

    def pays(m, n, k, halves=1, act=False):
        return gg.pingpong_pays(m, n, k, 132, halves, act)

    # activation epilogues (FC1 forward + SwiGLU on [gate, up] halves, dgrad + dSwiGLU over I)
    assert pays(65536, 1536, 2048, 2, True) and pays(65536, 768, 2048, act=True)  # qwen3
    assert pays(32768, 5760, 2880, 2, True) and pays(32768, 2880, 2880, act=True)  # gpt-oss
    assert pays(32768, 28672, 4096, 2, True) and pays(32768, 14336, 4096, act=True)  # mixtral: 0.45% more padding
    assert pays(32768, 21504, 6144, 2, True) and pays(32768, 10752, 6144, act=True)  # H 6144, I 10752: none
    assert not pays(32768, 4096, 7168, 2, True) and not pays(32768, 2048, 7168, act=True)  # dsv3: 3.1% more
    assert not pays(32768, 2816, 2048, 2, True) and pays(32768, 1408, 2048, act=True)  # I 1408
    assert not pays(32768, 1024, 2048, 2, True) and not pays(32768, 512, 2048, act=True)  # I 512: 12.5% more
    # plain outputs (FC2 forward over H, FC1's "kn" data gradient over H)
    assert pays(65536, 2048, 768) and pays(65536, 2048, 1536)  # qwen3: short K, 3.1% more padding
    assert not pays(32768, 2048, 2816)  # I 1408's FC1 data gradient: K past PINGPONG_SHORT_K
    assert pays(32768, 2880, 2880) and pays(32768, 2880, 5760)  # gpt-oss: 192 pads 6.7% less
    assert pays(16384, 2880, 8192) and pays(16384, 2880, 16384)  # ... at any K
    assert not pays(32768, 7168, 2048) and not pays(32768, 7168, 4096)  # dsv3
    assert not pays(32768, 4096, 14336) and not pays(32768, 4096, 28672)  # mixtral
    assert not pays(32768, 6144, 10752) and not pays(32768, 6144, 21504)  # long K, no padding either way
    assert not pays(256, 1536, 2048, 2, True)  # 2 x 8 tiles of 192 leave most of the grid idle
    monkeypatch.setattr(gg, "num_sms", lambda dev: 132)
    auto = gg._launch_config("f", 65536, 768, 128, 0, None, None, None, pingpong=None, k=6144, act_epilogue=True)
    assert auto[0:2] == (192, 2) and auto[3] is True
    assert gg._launch_config("f", 65536, 768, 128, 0, None, None, None, pingpong=None, k=6144)[3] is False
    assert gg._launch_config("f", 65536, 768, 128, 0, None, None, None, pingpong=None, k=1536)[3] is True
    assert gg._launch_config("f", 65536, 768, 128, 0, 256, None, None, pingpong=None, k=1536)[3] is False
    assert gg._launch_config("f", 65536, 768, 128, 0, None, None, None, pingpong=None, conflict="x",
                             k=1536)[3] is False
    assert gg._launch_config("f", 65536, 2048, 128, 0, None, None, None, pingpong=True)[0] == 192
    with pytest.raises(ValueError, match="f: pingpong needs tile_n"):
        gg._launch_config("f", 65536, 2048, 128, 0, 256, None, None, pingpong=True)
    with pytest.raises(ValueError, match="f: pingpong does not run with epilogue_warps"):
        gg._launch_config("f", 65536, 2048, 128, 0, None, None, None, pingpong=True, conflict="epilogue_warps")
    with pytest.raises(TypeError, match="f: pingpong must be a bool"):
        gg._launch_config("f", 65536, 2048, 128, 0, None, None, None, pingpong=1)


@pytest.mark.parametrize("activation,tile_n", [("swiglu", 192), (None, 128)])
def test_pingpong_forward_compiles(activation, tile_n):
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm

    assert compile_grouped_gemm(torch.bfloat16, tile_n, activation, True, False, 2, pingpong=True) is not None


def test_pingpong_rejects_what_it_cannot_run():
    import cutlass

    from te_fused_ops.backends.sm90.kernels.grouped_dact_sm90 import GroupedGemmDActSm90

    for opts in ({"tile_n": 256}, {"tile_n": 128, "epilogue_warps": True}):
        with pytest.raises(ValueError, match="pingpong needs"):
            GroupedGemmDActSm90(cutlass.BFloat16, activation="swiglu", pingpong=True, **opts)


def test_pingpong_conflicts_of_the_forward():
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import _forward_conflict

    assert _forward_conflict("swiglu", "nk", False) is None and _forward_conflict(None, "kn", False) is None
    assert _forward_conflict("swiglu", "kn", False) == "a GLU activation on weight_layout 'kn'"
    assert _forward_conflict(None, "nk", True) == "act_amax"


def test_fp8_overlapped_promotion_compiles():
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm_fp8

    assert compile_grouped_gemm_fp8(torch.bfloat16, "swiglu", False, False, 2, 128, overlap_promotion=True) is not None


def test_register_splits_fit_the_launch():
    """setmaxnreg only moves registers within the CTA's allocation (168 a thread over its three
    warpgroups): a split asking for more never completes its increase and the kernel hangs (a
    gathering ping-pong split of 32 / 240 did). Every schedule's split fits."""
    import cutlass

    from te_fused_ops.backends.sm90.kernels.grouped_act_sm90 import GroupedGemmActSm90, GroupedGemmGatheredSm90
    from te_fused_ops.backends.sm90.kernels.grouped_dact_sm90 import GroupedGemmDActGatheredSm90, GroupedGemmDActSm90
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad_sm90 import GroupedWgradGatheredSm90, GroupedWgradSm90

    bf16 = cutlass.BFloat16
    kernels = [GroupedGemmActSm90(bf16, 192, "swiglu", False, pingpong=p) for p in (False, True)]
    kernels += [GroupedGemmGatheredSm90(bf16, 192, "swiglu", False, pingpong=p) for p in (False, True)]
    kernels += [GroupedGemmDActSm90(bf16, 192, "swiglu", pingpong=p) for p in (False, True)]
    kernels += [GroupedGemmDActGatheredSm90(bf16, 256, "swiglu"), GroupedGemmDActGatheredSm90(bf16, 192, "swiglu",
                                                                                             pingpong=True),
                GroupedWgradSm90(bf16, 192, False, pingpong=True),
                GroupedWgradGatheredSm90(bf16, 256, gathered="x"), GroupedWgradGatheredSm90(bf16, 256, gathered="dy")]
    for kernel in kernels:
        assert kernel.threads == 384
        assert kernel.producer_registers * 128 + kernel.mma_registers * 256 <= 168 * 384, type(kernel).__name__


def test_gathered_pingpong_dact_takes_a_fifth_operand_stage():
    """The gathered ping-pong dActivation at tile 192 gives a store slot and a C stage to a fifth
    operand stage (measured 2-3% faster on an H100); the cooperative 256-wide kernel and the
    kernel on copied rows keep the core's split (slower with it); explicit options still win."""
    import cutlass

    from te_fused_ops.backends.sm90.kernels.grouped_dact_sm90 import GroupedGemmDActGatheredSm90, GroupedGemmDActSm90

    bf16 = cutlass.BFloat16
    gathered = GroupedGemmDActGatheredSm90(bf16, 192, "scaled_swiglu", pingpong=True)
    assert (gathered.ab_stages, gathered.epi_slots, gathered.c_stages) == (5, 1, 1)
    copy = GroupedGemmDActSm90(bf16, 192, "scaled_swiglu", pingpong=True)
    assert (copy.ab_stages, copy.epi_slots, copy.c_stages) == (4, 2, 2)
    cooperative = GroupedGemmDActGatheredSm90(bf16, 256, "scaled_swiglu")
    assert (cooperative.epi_slots, cooperative.c_stages) == (GroupedGemmDActSm90(bf16, 256, "scaled_swiglu").epi_slots, 2)
    explicit = GroupedGemmDActGatheredSm90(bf16, 192, "scaled_swiglu", pingpong=True, epi_slots=2, c_stages=2)
    assert (explicit.ab_stages, explicit.epi_slots, explicit.c_stages) == (4, 2, 2)
