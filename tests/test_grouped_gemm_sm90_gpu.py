"""GPU tests of the sm90 grouped GEMM + activation kernel against a float64 reference."""

import math

import pytest
import torch

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.activations import ACTIVATIONS
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_gemm_sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]

LIMIT, ALPHA = 7.0, 1.702


def offsets_from_splits(splits, device="cuda"):
    off = [0]
    for s in splits:
        off.append(off[-1] + s)
    return torch.tensor(off, dtype=torch.int32, device=device)


def reference(x, w, offsets, bias, activation, probs):
    """float64 (pre, act) from the natural [gate; up] weight/bias; rows past offsets[-1] are 0."""
    off = offsets.tolist()
    m, n = x.shape[0], w.shape[1]
    pre = torch.zeros(m, n, dtype=torch.float64, device=x.device)
    for g in range(w.shape[0]):
        s, e = off[g], off[g + 1]
        if e > s:
            pre[s:e] = x[s:e].double() @ w[g].double().T
            if bias is not None:
                pre[s:e] += bias[g].double()
    if activation is None:
        return pre, None
    if activation == "srelu":
        return pre, torch.relu(pre) ** 2
    gate, up = pre[:, : n // 2], pre[:, n // 2 :]
    if activation == "swiglu":
        act = torch.nn.functional.silu(gate) * up
    elif activation == "geglu":
        act = torch.nn.functional.gelu(gate, approximate="tanh") * up
    elif activation == "clamped_swiglu":
        g = gate.clamp(max=LIMIT)
        u = up.clamp(-LIMIT, LIMIT)
        act = g * torch.sigmoid(ALPHA * g) * (u + 1)
    else:  # scaled_swiglu
        act = torch.nn.functional.silu(gate) * up * probs.double()[:, None]
    act[off[-1] :] = 0
    return pre, act


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in output (unwritten or wrong)"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def poisoned_empty(shape, dtype):
    """Leave NaNs in the caching allocator's block of this size, so that an internal
    torch.empty of the same size sees them."""
    t = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    del t


def run_case(splits, m, k, n, activation, dtype, has_bias, tile_n=None, seed=0, cluster_m=2, **cfg):
    torch.manual_seed(seed)
    g = len(splits)
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    w = (torch.randn(g, n, k, device="cuda") / math.sqrt(k)).to(dtype)
    b = torch.randn(g, n, device="cuda").to(dtype) if has_bias else None
    probs = torch.rand(m, device="cuda") if activation == "scaled_swiglu" else None
    offsets = offsets_from_splits(splits)
    glu = activation is not None and ACTIVATIONS[activation].glu
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    if activation is not None:
        poisoned_empty((m, n // 2 if glu else n), dtype)
    pre, act = grouped_gemm_sm90(
        x, w, offsets, bias=b, activation=activation, probs=probs, limit=LIMIT, alpha=ALPHA,
        out=out, tile_n=tile_n, cluster_m=cluster_m, **cfg,
    )
    assert pre.data_ptr() == out.data_ptr()
    ref_pre, ref_act = reference(x, w, offsets, b, activation, probs)
    end = int(offsets[-1])
    assert rel_err(pre, ref_pre) <= 1e-2
    assert torch.all(pre[end:] == 0)
    if activation is None:
        assert act is None
    else:
        assert act.shape == (m, n // 2 if glu else n)
        assert rel_err(act, ref_act) <= 1e-2
        assert torch.all(act[end:] == 0)
    return pre, act


UNEVEN = [0, 300, 1, 0, 517, 129, 0]  # zero-row first and last groups, partial tiles; sum 947


def few_sms_margin(cluster_m):
    """An sm_margin that leaves one cluster: every CTA runs many tiles (both ping-pong warpgroups
    take turns, and pass over each other's tiles, padding tiles included)."""
    return torch.cuda.get_device_properties(0).multi_processor_count - cluster_m


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("tile_n", [128, 192])
@pytest.mark.parametrize("activation,n", [(None, 640), ("swiglu", 640), ("srelu", 320), ("scaled_swiglu", 1152),
                                          ("clamped_swiglu", 320)])
def test_pingpong(activation, n, tile_n, cluster_m):
    """Each MMA warpgroup on every other tile, the epilogues in 16-column chunks: equal to the float64
    reference, and bit for bit to the cooperative schedule (the same WGMMAs in the same K order, the
    same epilogue math), on one cluster and on the whole GPU."""
    for margin in (few_sms_margin(cluster_m), None):
        outs = [run_case(UNEVEN, 1000, 192, n, activation, torch.bfloat16, True, tile_n, 12, cluster_m,
                         pingpong=pingpong, sm_margin=margin) for pingpong in (True, False)]
        for a, b in zip(*outs):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("activation", ["geglu", None])
def test_pingpong_fp16(activation):
    outs = [run_case(UNEVEN, 1000, 256, 384, activation, torch.float16, activation is None, 192, 13, 2,
                     pingpong=pingpong, sm_margin=few_sms_margin(2)) for pingpong in (True, False)]
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", [None, *ACTIVATIONS])
@pytest.mark.parametrize("has_bias", [False, True])
def test_epilogues(activation, dtype, has_bias):
    run_case(UNEVEN, 1000, 256, 384, activation, dtype, has_bias)


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("tile_n", [128, 192, 256])
@pytest.mark.parametrize("activation", [None, "swiglu", "srelu"])
def test_tile_n_and_partial_n_tiles(tile_n, activation, cluster_m):
    # N=320: the second 256-wide tile is partial; GLU I=160 ends inside a tile
    run_case(UNEVEN, 1000, 192, 320, activation, torch.bfloat16, True, tile_n, 1, cluster_m)


@pytest.mark.parametrize(
    "splits,m",
    [
        ([0, 0, 777, 0], 777),  # one group holds all rows, offsets[G] == M
        ([333], 400),  # G = 1 with padding rows
        ([128, 256, 384], 768),  # tile-aligned
        ([0, 0, 0], 50),  # no rows at all: everything is padding
    ],
)
@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_routings(splits, m, activation):
    run_case(splits, m, 128, 256, activation, torch.bfloat16, False, seed=2)


# groups whose last 128-row tile holds 64 rows or fewer (the second MMA warpgroup of the
# cooperative schedule then skips its WGMMAs; a ping-pong warpgroup computes the first 64 rows
# only) and 65 (they must not): around the boundary
HALF_TAILS = [64, 65, 192, 193, 63, 0, 1, 129]


@pytest.mark.parametrize("tile_n,cluster_m,pingpong", [(128, 1, False), (256, 2, False), (192, 2, False),
                                                       (128, 2, True), (192, 1, True)])
def test_last_tile_half_full_or_less(tile_n, cluster_m, pingpong):
    run_case(HALF_TAILS, sum(HALF_TAILS) + 3, 256, 384, "swiglu", torch.bfloat16, False, tile_n, 8, cluster_m,
             pingpong=pingpong)


def test_many_groups():
    gen = torch.Generator().manual_seed(3)
    splits = torch.randint(0, 40, (256,), generator=gen)
    splits[torch.randperm(256, generator=gen)[:64]] = 0
    run_case(splits.tolist(), int(splits.sum()) + 77, 256, 256, "swiglu", torch.bfloat16, True)


@pytest.mark.parametrize("activation,n", [(None, 8), ("srelu", 8), ("swiglu", 64)])
def test_smallest_shapes(activation, n):
    run_case([5, 0, 20], 30, 8, n, activation, torch.bfloat16, True, seed=4)


def test_large_k_and_n():
    run_case([1500, 700, 1900], 4200, 2048, 1536, "swiglu", torch.bfloat16, False, seed=5)


# a group taller than RASTER_BAND m-tiles (22 tiles of 128 rows, 11 pairs) is walked in bands,
# the last one shorter
TALL = [0, 2700, 5, 2000]


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_tall_group_in_bands(cluster_m):
    run_case(TALL, sum(TALL) + 9, 128, 384, "swiglu", torch.bfloat16, False, 128, 7, cluster_m)


def test_no_host_sync_and_cuda_graph():
    torch.manual_seed(6)
    g, m, k, n = 8, 2048, 256, 512
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(g, n, k, device="cuda") / 16).to(torch.bfloat16)
    offsets = offsets_from_splits([256] * 8)
    grouped_gemm_sm90(x, w, offsets, activation="swiglu")  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_gemm_sm90(x, w, offsets, activation="swiglu")
    finally:
        torch.cuda.set_sync_debug_mode(0)

    pre_buf = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_gemm_sm90(x, w, offsets, activation="swiglu", out=pre_buf)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, act_buf = grouped_gemm_sm90(x, w, offsets, activation="swiglu", out=pre_buf)
    routings = [[0] * 7 + [2048], [300, 0, 17, 900, 0, 1, 500, 30], [100, 0, 0, 0, 0, 0, 0, 1]]
    for splits in routings:
        offsets.copy_(offsets_from_splits(splits))
        graph.replay()
        pre_e, act_e = grouped_gemm_sm90(x, w, offsets, activation="swiglu")
        torch.cuda.synchronize()
        assert torch.equal(pre_buf, pre_e) and torch.equal(act_buf, act_e)
        ref_pre, ref_act = reference(x, w, offsets, None, "swiglu", None)
        assert rel_err(pre_buf, ref_pre) <= 1e-2 and rel_err(act_buf, ref_act) <= 1e-2


def test_guard_after_output_and_bad_offsets():
    torch.manual_seed(7)
    g, m, k, n, guard = 4, 1000, 128, 256, 4096
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(g, n, k, device="cuda") / 16).to(torch.bfloat16)
    buf = torch.full((m * n + guard,), 3.0, dtype=torch.bfloat16, device="cuda")
    out = buf[: m * n].view(m, n)
    for offs in ([0, 100, 500, 900, 1000], [0, 700, 300, 5000, 99999], [-50, 10, -3, 2000, 7]):
        offsets = torch.tensor(offs, dtype=torch.int32, device="cuda")
        grouped_gemm_sm90(x, w, offsets, out=out)
        torch.cuda.synchronize()
        assert torch.all(buf[m * n :] == 3.0)
        assert not torch.isnan(out).any()
    offsets = torch.tensor([0, 100, 500, 900, 1000], dtype=torch.int32, device="cuda")
    pre, _ = grouped_gemm_sm90(x, w, offsets, out=out)
    ref_pre, _ = reference(x, w, offsets, None, None, None)
    assert rel_err(pre, ref_pre) <= 1e-2


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("tile_n", [128, 192, 256])
@pytest.mark.parametrize("activation", ["swiglu", "clamped_swiglu"])
def test_glu_half_ends_inside_n_tile(activation, tile_n, cluster_m):
    # N=192: I=96 is not a multiple of tile_n/2, so the last n-tile of each half is partial (the
    # only one for tile_n=256): gate rows past I are clipped (zeros), not up rows, and the gate/up
    # pairing, bias columns and stores of that tile must still match the natural-layout reference
    run_case(UNEVEN, 1000, 128, 192, activation, torch.bfloat16, True, tile_n, 8, cluster_m)


def act_amax_reference(act, end):
    """float32 max |act| over the finite values of rows < end (torch's per-tensor amax)."""
    values = act[:end].float().abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    return values.amax() if values.numel() else values.new_zeros(())


def check_act_amax(run, act_shape, cluster_m, end):
    """``run(act_amax)`` -> outputs: with act_amax the same (pre, act) bits, and parts whose max is
    the act's amax over rows < end; every part written (NaN-poisoned buffer), none negative."""
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import max_clusters
    from te_fused_ops.backends.sm90.kernels.launch import num_sms

    pre, act = run(False)
    poisoned_empty((max_clusters(num_sms(0), 0, cluster_m) * cluster_m * 8,), torch.float32)
    pre2, act2, parts = run(True)
    for got, want in ((pre2, pre), (act2, act)):  # bits: NaN rows included
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert parts.dtype == torch.float32 and parts.dim() == 1
    assert not torch.isnan(parts).any() and torch.all(parts >= 0)
    want = act_amax_reference(act, end)
    assert torch.equal(parts.max(), want), (parts.max().item(), want.item())


@pytest.mark.parametrize("activation,tile_n,cluster_m", [("swiglu", 256, 2), ("swiglu", 128, 1), ("srelu", 128, 2),
                                                         ("scaled_swiglu", 256, 1), ("clamped_swiglu", 128, 2),
                                                         ("swiglu", 192, 2), ("srelu", 192, 1)])
def test_act_amax_from_the_epilogue(activation, tile_n, cluster_m):
    """fp8_current's amax of the act from the epilogue: padding rows hold huge values (their act
    is not an output), one row's act is NaN and one's Inf (finite values only count)."""
    torch.manual_seed(1)
    splits, k, n = [300, 0, 1000, 77, 513], 256, 512
    m = sum(splits) + 100
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    x[sum(splits):] = 3e4
    x[10, 0] = float("nan")
    x[20] = 1e20  # pre ~1e21: the act overflows to Inf
    w = (torch.randn(len(splits), n, k, device="cuda") / math.sqrt(k)).to(torch.bfloat16)
    probs = torch.rand(m, device="cuda") if activation == "scaled_swiglu" else None
    offsets = offsets_from_splits(splits)

    def run(act_amax):
        return grouped_gemm_sm90(x, w, offsets, activation=activation, probs=probs, tile_n=tile_n,
                                 cluster_m=cluster_m, act_amax=act_amax)

    glu = ACTIVATIONS[activation].glu
    check_act_amax(run, (m, n // 2 if glu else n), cluster_m, sum(splits))


def test_argument_errors():
    x = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2, 64, 32, dtype=torch.bfloat16, device="cuda")
    off = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    with pytest.raises(TypeError, match="grouped_gemm_sm90: x"):
        grouped_gemm_sm90(x.float(), w, off)
    with pytest.raises(ValueError, match="grouped_gemm_sm90: act_amax needs an activation"):
        grouped_gemm_sm90(x, w, off, act_amax=True)
    with pytest.raises(TypeError, match="grouped_gemm_sm90: act_amax must be a bool"):
        grouped_gemm_sm90(x, w, off, activation="swiglu", act_amax=1)
    with pytest.raises(TypeError, match="grouped_gemm_sm90: weight"):
        grouped_gemm_sm90(x, w.half(), off)
    with pytest.raises(ValueError, match="grouped_gemm_sm90: x must be contiguous"):
        grouped_gemm_sm90(x.t().contiguous().t(), w, off)
    with pytest.raises(ValueError, match="grouped_gemm_sm90: x must be on a CUDA"):
        grouped_gemm_sm90(x.cpu(), w, off)
    with pytest.raises(ValueError, match="grouped_gemm_sm90: offsets"):
        grouped_gemm_sm90(x, w, off[:2])
    with pytest.raises(TypeError, match="grouped_gemm_sm90: offsets"):
        grouped_gemm_sm90(x, w, off.long())
    with pytest.raises(ValueError, match="K=36"):
        grouped_gemm_sm90(x.new_zeros(64, 36), w.new_zeros(2, 64, 36), off)
    with pytest.raises(ValueError, match="N=96"):
        grouped_gemm_sm90(x, torch.randn(2, 96, 32, dtype=torch.bfloat16, device="cuda"), off,
                          activation="swiglu")
    with pytest.raises(ValueError, match="probs"):
        grouped_gemm_sm90(x, w, off, activation="scaled_swiglu")
    with pytest.raises(ValueError, match="activation"):
        grouped_gemm_sm90(x, w, off, activation="relu")
