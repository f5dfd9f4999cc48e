"""GPU tests of the block-scaled FP8 grouped GEMM (+ activation) against a float64 reference of the
same quantized operands (differences only from fp32 accumulation order and the output rounding)."""

import math

import pytest
import torch
from test_grouped_gemm_sm90_gpu import (
    ALPHA,
    LIMIT,
    UNEVEN,
    check_act_amax,
    offsets_from_splits,
    reference,
    rel_err,
)

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.activations import ACTIVATIONS
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_gemm_fp8_sm90
from te_fused_ops.quantization import quantize, quantize_weight

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]


def _expand(scale, sizes):
    """Block multipliers repeated over their 128-wide blocks along the last len(sizes) dims."""
    for i, size in enumerate(sizes):
        dim = scale.dim() - len(sizes) + i
        scale = scale.repeat_interleave(128, dim=dim).narrow(dim, 0, size)
    return scale


def quantized_operands(x, w):
    """(x data, x scales, w data, w scales, x float64, w float64): the "fp8_blockwise" recipe's
    operands and the values they stand for, expanded here independently of the library."""
    qx = quantize(x, "fp8_blockwise")
    qw = quantize_weight(w, "fp8_blockwise")
    x64 = qx.rowwise_data.double() * _expand(qx.rowwise_scale_inv.double(), x.shape[-1:])
    w64 = qw.rowwise_data.double() * _expand(qw.rowwise_scale_inv.double(), w.shape[-2:])
    return qx.rowwise_data, qx.rowwise_scale_inv, qw.rowwise_data, qw.rowwise_scale_inv, x64, w64


def run_case(splits, m, k, n, activation, dtype=torch.bfloat16, has_bias=False, seed=0, cluster_m=None, tile_n=None,
             **cfg):
    torch.manual_seed(seed)
    g = len(splits)
    x = torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 4  # rows of varied range
    # W's 128-row scale blocks 1x, 4x, 16x apart: a column promoted with a neighbouring block's
    # multiplier is off by 4x or more
    contrast = 4.0 ** (torch.arange(n, device="cuda") // 128 % 3)
    w = torch.randn(g, n, k, device="cuda") / math.sqrt(k) * contrast[:, None]
    bias = torch.randn(g, n, device="cuda").to(dtype) if has_bias else None
    probs = torch.rand(m, device="cuda") if activation == "scaled_swiglu" else None
    offsets = offsets_from_splits(splits)
    xq, xs, wq, ws, x64, w64 = quantized_operands(x, w)
    glu = activation is not None and ACTIVATIONS[activation].glu
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    act_out = None
    if activation is not None:
        act_out = torch.full((m, n // 2 if glu else n), float("nan"), dtype=dtype, device="cuda")
    pre, act = grouped_gemm_fp8_sm90(
        xq, xs, wq, ws, offsets, bias=bias, activation=activation, probs=probs, limit=LIMIT, alpha=ALPHA,
        out_dtype=dtype, out=out, act_out=act_out, cluster_m=cluster_m, tile_n=tile_n, **cfg,
    )
    ref_pre, ref_act = reference(x64, w64, offsets, bias, activation, probs)
    end = int(offsets[-1])
    assert rel_err(pre, ref_pre) <= 1e-2
    assert torch.all(pre[end:] == 0)
    if activation is not None:
        assert rel_err(act, ref_act) <= 1e-2
        assert torch.all(act[end:] == 0)
    return pre, act


@pytest.mark.parametrize("activation,cluster_m,tile_n", [("swiglu", 2, 128), ("srelu", 1, 192), ("scaled_swiglu", 2, 192)])
def test_act_amax_from_the_epilogue(activation, cluster_m, tile_n):
    """The FP8 kernel's act amax parts (fp8_current after an FP8 FC1): as the bf16 kernel's."""
    torch.manual_seed(2)
    splits, k, n = [0, 700, 129, 1000], 384, 768
    m = sum(splits) + 60
    x = torch.randn(m, k, device="cuda")
    x[sum(splits):] = 1e4
    w = torch.randn(len(splits), n, k, device="cuda") / math.sqrt(k)
    probs = torch.rand(m, device="cuda") if activation == "scaled_swiglu" else None
    xq, xs, wq, ws, _, _ = quantized_operands(x, w)
    offsets = offsets_from_splits(splits)

    def run(act_amax):
        return grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation=activation, probs=probs, tile_n=tile_n,
                                     cluster_m=cluster_m, act_amax=act_amax)

    glu = ACTIVATIONS[activation].glu
    check_act_amax(run, (m, n // 2 if glu else n), cluster_m, sum(splits))


@pytest.mark.parametrize("activation", [None, "swiglu", "scaled_swiglu", "srelu"])
@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("tile_n", [128, 192, 256])
def test_epilogues(activation, cluster_m, tile_n):
    run_case(UNEVEN, 1000, 512, 256, activation, has_bias=activation == "swiglu", cluster_m=cluster_m, tile_n=tile_n)


@pytest.mark.parametrize("activation,n", [(None, 384), (None, 520), ("swiglu", 768), ("swiglu", 1280)])
def test_tile_192_crosses_scale_blocks(activation, n):
    # 192 columns (GLU: two boxes of 96 rows) start at 0 / 64 (GLU: 0 / 32 / 64 / 96) inside a
    # 128-row block of W, so a tile's columns take the multipliers of two blocks; n 520: a partial
    # last tile in a partial last block
    run_case(UNEVEN, 1000, 384, n, activation, tile_n=192)


@pytest.mark.parametrize("activation,n", [(None, 768), (None, 520), ("swiglu", 768), ("swiglu", 1536),
                                          ("swiglu", 640), ("scaled_swiglu", 384), ("swiglu", 5760)])
def test_tile_256_halves_take_their_scale_blocks(activation, n):
    """Tile 256 takes each block's product in two 128-column halves, each promoted with its own W
    block's multipliers (blocks 1x / 4x / 16x apart: a half scaled with its neighbour's is off by
    4x); several n-tiles, a partial last tile (n 520), and for GLU the up half of each tile from
    the second half of W; bit for bit the 128-wide tile (the same block sums in the same order).
    N/2 an odd multiple of 64 (320, 192, gpt-oss's 2880): the up half starts 64 rows into a W block,
    its two 64-column parts take two blocks' multipliers, and the last tile is half full."""
    wide = run_case(UNEVEN, 1000, 384, n, activation, tile_n=256)
    narrow = run_case(UNEVEN, 1000, 384, n, activation, tile_n=128, overlap_promotion=False)
    for a, b in zip(wide, narrow):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("k", [16, 208, 384, 1024])  # 1, 2 (partial last), 3 and 8 blocks
@pytest.mark.parametrize("activation", [None, "swiglu", "scaled_swiglu"])
def test_overlapped_promotion(activation, k):
    """Two block products in flight (odd and even block counts, one block; explicitly and as the
    default at tile 128): against float64, and bit for bit the kernel that promotes each block
    before the next one's WGMMAs (the same sum order)."""
    n = 256 if activation else 320
    overlapped, default, one_product = (run_case(UNEVEN, 1000, k, n, activation, seed=7, tile_n=128,
                                                 overlap_promotion=overlap) for overlap in (True, None, False))
    for outs in (default, one_product):
        for a, b in zip(overlapped, outs):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("k", [16, 208, 1024])  # one partial block, a partial last block, 8 blocks
def test_k_tails(k):
    run_case([100, 0, 400], 600, k, 128, None)


@pytest.mark.parametrize("tile_n", [128, 192])
def test_glu_halves_at_odd_scale_blocks(tile_n):
    # N/2 = 192: the up half starts inside W's second 128-row scale block
    run_case(UNEVEN, 1000, 256, 384, "swiglu", tile_n=tile_n)


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_tall_group_in_bands(cluster_m):
    # 22 m-tiles (11 pairs) in one group, more than RASTER_BAND: walked in bands
    run_case([0, 2700, 5, 2000], 4709, 256, 384, "swiglu", seed=7, cluster_m=cluster_m)


def test_fp16_output_many_groups_and_empty_rows():
    splits = [0] * 5 + [37] * 100 + [0] * 23
    run_case(splits, 4000, 256, 128, None, dtype=torch.float16)


def test_no_rows():
    xq = torch.zeros(0, 128, device="cuda").to(torch.float8_e4m3fn)
    wq = torch.zeros(2, 128, 128, device="cuda").to(torch.float8_e4m3fn)
    pre, act = grouped_gemm_fp8_sm90(
        xq, torch.ones(0, 1, device="cuda"), wq, torch.ones(2, 1, 1, device="cuda"),
        torch.zeros(3, dtype=torch.int32, device="cuda"),
    )
    assert pre.shape == (0, 128) and act is None


def test_no_host_sync_and_cuda_graph():
    torch.manual_seed(1)
    m, k, n, g = 512, 256, 256, 4
    x, w = torch.randn(m, k, device="cuda"), torch.randn(g, n, k, device="cuda") / 16
    xq, xs, wq, ws, x64, w64 = quantized_operands(x, w)
    offsets = offsets_from_splits([100, 200, 0, 150])
    grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu")  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    pre_buf = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, act_buf = grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu", out=pre_buf)
    for splits in ([100, 200, 0, 150], [0, 0, 512, 0], [10, 20, 30, 40]):
        offsets.copy_(offsets_from_splits(splits))
        graph.replay()
        pre_e, act_e = grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu")
        torch.cuda.synchronize()
        assert torch.equal(pre_buf, pre_e) and torch.equal(act_buf, act_e)
        ref_pre, ref_act = reference(x64, w64, offsets, None, "swiglu", None)
        assert rel_err(pre_buf, ref_pre) <= 1e-2 and rel_err(act_buf, ref_act) <= 1e-2


def test_argument_errors():
    xq = torch.zeros(64, 128, device="cuda").to(torch.float8_e4m3fn)
    wq = torch.zeros(2, 128, 128, device="cuda").to(torch.float8_e4m3fn)
    xs, ws = torch.ones(64, 1, device="cuda"), torch.ones(2, 1, 1, device="cuda")
    off = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    name = "grouped_gemm_fp8_sm90"
    grouped_gemm_fp8_sm90(xq, xs, wq, ws, off)  # a valid call first: its memo entry is warm below
    with pytest.raises(TypeError, match=f"{name}: x has dtype"):
        grouped_gemm_fp8_sm90(xq.bfloat16(), xs, wq, ws, off)
    with pytest.raises(TypeError, match=f"{name}: weight has dtype"):
        grouped_gemm_fp8_sm90(xq, xs, wq.view(torch.int8), ws, off)
    with pytest.raises(ValueError, match=f"{name}: x_scale_inv must have shape"):
        grouped_gemm_fp8_sm90(xq, torch.ones(64, 2, device="cuda"), wq, ws, off)
    with pytest.raises(ValueError, match=f"{name}: weight_scale_inv must have shape"):
        grouped_gemm_fp8_sm90(xq, xs, wq, torch.ones(2, 2, 1, device="cuda"), off)
    with pytest.raises(TypeError, match=f"{name}: weight_scale_inv has dtype"):
        grouped_gemm_fp8_sm90(xq, xs, wq, ws.double(), off)
    with pytest.raises(ValueError, match=f"{name}: x_scale_inv must be contiguous"):
        grouped_gemm_fp8_sm90(xq.new_zeros(64, 256), torch.ones(2, 64, device="cuda").t(),
                              wq.new_zeros(2, 128, 256), torch.ones(2, 1, 2, device="cuda"), off)
    with pytest.raises(ValueError, match="K=24"):
        grouped_gemm_fp8_sm90(xq[:, :24].contiguous(), xs, wq[:, :, :24].contiguous(), ws, off)
    with pytest.raises(ValueError, match="N=192 .* multiple of 128"):
        grouped_gemm_fp8_sm90(xq, xs, wq.new_zeros(2, 192, 128), torch.ones(2, 2, 1, device="cuda"), off,
                              activation="swiglu")
    with pytest.raises(TypeError, match=f"{name}: out_dtype"):
        grouped_gemm_fp8_sm90(xq, xs, wq, ws, off, out_dtype=torch.float32)
    with pytest.raises(ValueError, match=f"{name}: tile_n must be 128, 192 or 256"):
        grouped_gemm_fp8_sm90(xq, xs, wq, ws, off, tile_n=64)
    with pytest.raises(ValueError, match=f"{name}: overlap_promotion needs tile_n 128"):
        grouped_gemm_fp8_sm90(xq, xs, wq, ws, off, tile_n=192, overlap_promotion=True)
    with pytest.raises(TypeError, match=f"{name}: overlap_promotion must be a bool"):
        grouped_gemm_fp8_sm90(xq, xs, wq, ws, off, overlap_promotion=1)
