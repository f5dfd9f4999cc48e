"""GPU tests of the sm90 data-gradient kernels against float64 references.

``grouped_gemm_sm90(weight_layout="kn")``: y = x_g @ W[g] with W (G, K, N) read in place;
``grouped_dgrad_dact_sm90``: h = dy_g @ W2[g], then the activation's backward (d_pre, act, d_probs).
Outputs are NaN-poisoned (``out=`` or the caching allocator's blocks), so an unwritten element fails.
"""

import math

import pytest
import torch

import reference as ref
from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.activations import ACTIVATIONS
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_dgrad_dact_sm90, grouped_gemm_sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]

LIMIT, ALPHA = 7.0, 1.702
TOL = 1e-2
# unaligned 1 / 7 / 13-row groups, zero-row groups first, in the middle and last
UNEVEN = [0, 1, 7, 0, 13, 300, 129, 0]  # sum 450


def offsets_from_splits(splits):
    off = [0]
    for s in splits:
        off.append(off[-1] + s)
    return torch.tensor(off, dtype=torch.int32, device="cuda")


def rel_err(out, expected):
    assert not torch.isnan(out).any(), "NaN in output (unwritten or wrong)"
    expected = expected.double()
    return ((out.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def poison_allocator(*shapes_dtypes):
    """Leave NaN-filled blocks of these sizes in the caching allocator for the wrapper's outputs."""
    blocks = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes_dtypes]
    del blocks


def grouped_matmul_reference(a, w, offsets, layout):
    """float64 a_g @ W[g] ("kn") or a_g @ W[g].T ("nk"); rows past offsets[-1] are zero."""
    off = offsets.tolist()
    n = w.shape[2] if layout == "kn" else w.shape[1]
    out = torch.zeros(a.shape[0], n, dtype=torch.float64, device=a.device)
    for g in range(w.shape[0]):
        s, e = off[g], off[g + 1]
        if e > s:
            wg = w[g].double()
            out[s:e] = a[s:e].double() @ (wg if layout == "kn" else wg.T)
    return out


def act_reference(activation, x, probs):
    if activation == "clamped_swiglu":
        return ref.clamped_swiglu(x, LIMIT, ALPHA)
    if activation == "scaled_swiglu":
        return ref.scaled_swiglu(x, probs)
    return getattr(ref, activation)(x)


def dact_reference(dy, w, offsets, pre, activation, probs):
    """float64 (d_pre, act, d_probs) by autograd of the reference activation on the given
    (already rounded) pre; padding rows (>= offsets[-1]) are zero."""
    end = int(offsets[-1])
    h = grouped_matmul_reference(dy, w, offsets, "kn")
    x = pre.double().clone()
    x[end:] = 0
    x.requires_grad_()
    p = None
    if ACTIVATIONS[activation].takes_probs:
        p = probs.double().clone().requires_grad_()
    act = act_reference(activation, x, p)
    act.backward(h)
    return x.grad, act.detach(), None if p is None else p.grad


# ---------------------------------------------------------------- "kn": y = x_g @ W[g]


def run_kn(splits, m, k, n, dtype=torch.bfloat16, activation=None, has_bias=False, seed=0, **cfg):
    torch.manual_seed(seed)
    g = len(splits)
    x = torch.randn(m, k, dtype=dtype, device="cuda")
    w = (torch.randn(g, k, n, device="cuda") / math.sqrt(k)).to(dtype)
    b = torch.randn(g, n, device="cuda").to(dtype) if has_bias else None
    offsets = offsets_from_splits(splits)
    out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    glu = activation is not None and ACTIVATIONS[activation].glu
    if activation is not None:
        poison_allocator(((m, n // 2 if glu else n), dtype))
    pre, act = grouped_gemm_sm90(
        x, w, offsets, bias=b, activation=activation, out=out, weight_layout="kn", **cfg
    )
    assert pre.data_ptr() == out.data_ptr()
    expected = grouped_matmul_reference(x, w, offsets, "kn")
    end = int(offsets[-1])
    if b is not None:
        rows = torch.repeat_interleave(
            torch.arange(g, device="cuda"), torch.tensor(splits, device="cuda")
        )
        expected[:end] += b.double()[rows]
    assert rel_err(pre, expected) <= TOL
    assert torch.all(pre[end:] == 0)
    if activation is not None:
        expected_act = act_reference(activation, expected, None)
        expected_act[end:] = 0
        assert rel_err(act, expected_act) <= TOL
        assert torch.all(act[end:] == 0)
    return pre


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile_n,cluster_m", [(128, 2), (192, 2), (192, 1), (256, 1)])
def test_kn_uneven_splits(dtype, tile_n, cluster_m):
    # N=320: the last n-tile is partial for both tile widths; 50 padding rows
    run_kn(UNEVEN, 500, 192, 320, dtype, tile_n=tile_n, cluster_m=cluster_m)


def test_kn_swiglu_bias():
    run_kn(UNEVEN, 500, 128, 192, activation="swiglu", has_bias=True, seed=1, tile_n=128,
           cluster_m=2)


@pytest.mark.parametrize(
    "splits,m,k,n",
    [
        ([0, 0, 777, 0], 777, 128, 256),  # one group holds all rows, offsets[G] == M
        ([333], 400, 64, 128),  # G = 1 with padding rows
        ([5, 0, 20], 30, 8, 8),  # smallest K and N
        ([0, 0, 0], 50, 64, 64),  # no rows at all: everything is padding
    ],
)
def test_kn_routings(splits, m, k, n):
    run_kn(splits, m, k, n, seed=2, tile_n=128, cluster_m=2)


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_kn_tall_group_in_bands(cluster_m):
    # 22 m-tiles (11 pairs) in one group: more than RASTER_BAND, walked in bands
    run_kn([0, 2700, 5, 2000], 4709, 128, 384, seed=7, tile_n=128, cluster_m=cluster_m)


def test_dact_odd_n_tiles_split_tails():
    # I=288: 3 n-tiles of 128, so an odd last m-tile (groups of 1, 7, 13, 129 rows) goes to the
    # pair as one split n-tile pair plus one vertical pair; d_probs partials of every n-tile
    run_dact(UNEVEN, 500, 256, 288, "scaled_swiglu", seed=8, tile_n=128, cluster_m=2)


def test_dact_tall_group_in_bands():
    run_dact([2700, 0, 2000], 4710, 128, 160, "swiglu", seed=7, tile_n=128, cluster_m=2)


def test_kn_many_groups():
    gen = torch.Generator().manual_seed(3)
    splits = torch.randint(0, 40, (256,), generator=gen)
    splits[torch.randperm(256, generator=gen)[:64]] = 0
    run_kn(splits.tolist(), int(splits.sum()) + 77, 256, 256, seed=3, tile_n=128, cluster_m=2)


def test_kn_is_dgrad_of_nk():
    """dx = dy @ W[g] with W (G, out, in) read in place equals the "nk" GEMM on W[g].T copies."""
    torch.manual_seed(4)
    splits, g, n_out, n_in = [100, 0, 250, 37], 4, 256, 192
    dy = torch.randn(400, n_out, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(g, n_out, n_in, device="cuda") / 16).to(torch.bfloat16)
    offsets = offsets_from_splits(splits)
    dx, _ = grouped_gemm_sm90(dy, w, offsets, weight_layout="kn", tile_n=128, cluster_m=2)
    dx_nk, _ = grouped_gemm_sm90(dy, w.transpose(1, 2).contiguous(), offsets, tile_n=128, cluster_m=2)
    torch.testing.assert_close(dx, dx_nk, rtol=1e-2, atol=1e-2)


# ---------------------------------------------------------------- dgrad + dActivation


def run_dact(splits, m, h, i, activation, dtype=torch.bfloat16, seed=0, check=True, **cfg):
    torch.manual_seed(seed)
    g = len(splits)
    spec = ACTIVATIONS[activation]
    dy = torch.randn(m, h, dtype=dtype, device="cuda")
    w = (torch.randn(g, h, i, device="cuda") / math.sqrt(h)).to(dtype)
    # padding rows of pre hold garbage: the kernel must not use it
    pre = (2 * torch.randn(m, 2 * i if spec.glu else i, device="cuda")).to(dtype)
    if activation == "clamped_swiglu":  # exercise both clamps and their bounds
        pre[::7] *= 5
        pre[1, 0] = LIMIT
        pre[1, i] = -LIMIT
    probs = torch.rand(m, device="cuda") if spec.takes_probs else None
    offsets = offsets_from_splits(splits)
    n_parts = -(-i // 128)
    poison_allocator((tuple(pre.shape), dtype), ((m, i), dtype), ((n_parts, m), torch.float32))
    d_pre, act, d_probs = grouped_dgrad_dact_sm90(
        dy, w, offsets, pre, activation=activation, probs=probs, limit=LIMIT, alpha=ALPHA, **cfg
    )
    assert d_pre.shape == pre.shape and d_pre.dtype == dtype
    assert act.shape == (m, i) and act.dtype == dtype
    if check:
        exp_d_pre, exp_act, exp_d_probs = dact_reference(dy, w, offsets, pre, activation, probs)
        end = int(offsets[-1])
        assert rel_err(d_pre, exp_d_pre) <= TOL
        assert rel_err(act, exp_act) <= TOL
        assert torch.all(d_pre[end:] == 0) and torch.all(act[end:] == 0)
        if spec.takes_probs:
            assert d_probs.shape == (m,) and d_probs.dtype == torch.float32
            assert rel_err(d_probs, exp_d_probs) <= TOL
            assert torch.all(d_probs[end:] == 0)
    if not spec.takes_probs:
        assert d_probs is None
    return d_pre, act, d_probs


def dact_width(activation):
    # GLU I=160: partial last n-tile for both tile widths; srelu I=168 also ends inside a chunk
    return 160 if ACTIVATIONS[activation].glu else 168


@pytest.mark.parametrize("epilogue_warps", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_dact_activations(activation, dtype, epilogue_warps):
    run_dact(UNEVEN, 500, 256, dact_width(activation), activation, dtype, tile_n=128, cluster_m=2,
             epilogue_warps=epilogue_warps)


@pytest.mark.parametrize("epilogue_warps", [True, False])
@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu", "srelu"])
def test_dact_tile_256_without_cluster(activation, epilogue_warps):
    run_dact(UNEVEN, 500, 192, dact_width(activation), activation, seed=1, tile_n=256, cluster_m=1,
             epilogue_warps=epilogue_warps)


@pytest.mark.parametrize("epilogue_warps", [True, False])
@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu", "srelu"])
def test_dact_tile_192(activation, cluster_m, epilogue_warps):
    # I = 320: the last of two 192-wide tiles is partial
    run_dact(UNEVEN, 500, 192, 320, activation, seed=9, tile_n=192, cluster_m=cluster_m,
             epilogue_warps=epilogue_warps)


@pytest.mark.parametrize("tile_n", [128, 192])
@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu", "srelu", "clamped_swiglu"])
def test_dact_pingpong(activation, tile_n):
    """Each MMA warpgroup on every other tile (one cluster: many tiles a CTA; then the whole GPU),
    the C chunks loaded at the start of its epilogue's turn: against float64, and bit for bit
    the cooperative schedule's (d_probs partials included)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for margin in (sms - 2, None):
        outs = [run_dact(UNEVEN, 500, 192, 320, activation, seed=13, tile_n=tile_n, cluster_m=2, sm_margin=margin,
                         pingpong=pingpong) for pingpong in (True, False)]
        for a, b in zip(*outs):
            assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("tile_n", [128, 192])
@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu", "srelu"])
def test_dact_deep_operands(activation, tile_n):
    """Ping-pong with one C stage and one store slot, the rest of shared memory as operand stages
    (an autotuner candidate): against float64, and bit for bit the kernel's own split."""
    outs = [run_dact(UNEVEN, 500, 192, 320, activation, seed=15, tile_n=tile_n, cluster_m=2, pingpong=True,
                     deep_operands=deep) for deep in (True, False)]
    for a, b in zip(*outs):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("tile_n", [128, 192])
def test_kn_pingpong(tile_n):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    pingpong = run_kn(UNEVEN, 500, 192, 640, seed=14, tile_n=tile_n, cluster_m=2, sm_margin=sms - 2, pingpong=True)
    cooperative = run_kn(UNEVEN, 500, 192, 640, seed=14, tile_n=tile_n, cluster_m=2, sm_margin=sms - 2)
    assert torch.equal(pingpong, cooperative)


@pytest.mark.parametrize("cfg", [
    dict(tile_n=128, cluster_m=2, epilogue_warps=True), dict(tile_n=128, cluster_m=2, epilogue_warps=False),
    dict(tile_n=192, cluster_m=2, pingpong=True), dict(tile_n=256, cluster_m=1),
])
@pytest.mark.parametrize("activation", ["scaled_swiglu", "srelu"])
def test_dact_writes_d_pre_over_pre(activation, cfg):
    """``out=pre`` (the layer's backward writes d_pre over the saved pre-activation): each tile reads
    its pre before storing its d_pre there, groups ending inside tiles included, so the outputs are
    bit for bit those into a buffer of their own."""
    splits = [130, 0, 67, 301, 2]
    separate = run_dact(splits, 520, 192, 320, activation, seed=21, **cfg)
    torch.manual_seed(21)
    spec = ACTIVATIONS[activation]
    g, h, i, m = len(splits), 192, 320, 520
    dy = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(g, h, i, device="cuda") / math.sqrt(h)).to(torch.bfloat16)
    pre = (2 * torch.randn(m, 2 * i if spec.glu else i, device="cuda")).to(torch.bfloat16)
    probs = torch.rand(m, device="cuda") if spec.takes_probs else None
    in_place = grouped_dgrad_dact_sm90(dy, w, offsets_from_splits(splits), pre, activation=activation, probs=probs,
                                       limit=LIMIT, alpha=ALPHA, out=pre, **cfg)
    assert in_place[0].data_ptr() == pre.data_ptr()
    for a, b in zip(separate, in_place):
        assert (a is None and b is None) or torch.equal(a, b)


def test_dact_epilogue_warps_round_h_only():
    """The epilogue warps see h rounded to dy's dtype: act is bitwise the MMA-warpgroup epilogue's,
    d_pre within that rounding."""
    fused = run_dact(UNEVEN, 700, 256, 256, "scaled_swiglu", seed=4, tile_n=256, epilogue_warps=True)
    mma = run_dact(UNEVEN, 700, 256, 256, "scaled_swiglu", seed=4, tile_n=256, epilogue_warps=False)
    assert torch.equal(fused[1], mma[1])
    assert rel_err(fused[0], mma[0].double()) <= 4e-3


@pytest.mark.parametrize(
    "splits,m,h,i",
    [
        ([0, 0, 777, 0], 777, 128, 256),  # one group holds all rows, offsets[G] == M
        ([333], 400, 64, 96),  # G = 1 with padding rows
        ([5, 0, 20], 30, 8, 32),  # smallest H and GLU I
        ([0, 0, 0], 50, 64, 64),  # no rows at all: everything is padding
    ],
)
@pytest.mark.parametrize("activation", ["scaled_swiglu", "srelu"])
def test_dact_routings(splits, m, h, i, activation):
    if activation == "srelu" and h == 8:
        i = 8  # smallest srelu I
    run_dact(splits, m, h, i, activation, seed=2, tile_n=128, cluster_m=2)


# last tiles of 64 rows or fewer (the cooperative schedule's second MMA warpgroup skips its
# WGMMAs; a ping-pong warpgroup computes the first 64 rows only) and of 65 (they must not)
HALF_TAILS = [64, 65, 192, 193, 63, 0, 1, 129]


@pytest.mark.parametrize("tile_n,cluster_m,pingpong", [(128, 1, False), (256, 2, False), (128, 2, True),
                                                       (192, 2, True)])
def test_last_tile_half_full_or_less(tile_n, cluster_m, pingpong):
    m = sum(HALF_TAILS) + 3
    run_dact(HALF_TAILS, m, 256, 192, "swiglu", seed=8, tile_n=tile_n, cluster_m=cluster_m, pingpong=pingpong)
    run_kn(HALF_TAILS, m, 384, 256, seed=8, tile_n=tile_n, cluster_m=cluster_m, pingpong=pingpong)


def test_dact_many_groups():
    gen = torch.Generator().manual_seed(3)
    splits = torch.randint(0, 40, (256,), generator=gen)
    splits[torch.randperm(256, generator=gen)[:64]] = 0
    run_dact(splits.tolist(), int(splits.sum()) + 77, 256, 256, "scaled_swiglu", seed=3,
             tile_n=128, cluster_m=2)


# ---------------------------------------------------------------- sync-free, graphs, SM margin


def test_no_host_sync_and_cuda_graph():
    torch.manual_seed(6)
    g, m, h, i = 8, 2048, 256, 256
    dy = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(g, h, i, device="cuda") / 16).to(torch.bfloat16)
    pre = torch.randn(m, 2 * i, dtype=torch.bfloat16, device="cuda")
    probs = torch.rand(m, device="cuda")
    offsets = offsets_from_splits([256] * 8)

    def step():
        d_pre, act, d_probs = grouped_dgrad_dact_sm90(
            dy, w, offsets, pre, activation="scaled_swiglu", probs=probs
        )
        dx, _ = grouped_gemm_sm90(dy, w, offsets, weight_layout="kn")
        return d_pre, act, d_probs, dx

    step()  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = step()
    routings = [[0] * 7 + [2048], [300, 0, 17, 900, 0, 1, 500, 30], [100, 0, 0, 0, 0, 0, 0, 1]]
    for splits in routings:
        offsets.copy_(offsets_from_splits(splits))
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        for a, b in zip(graph_out, eager):
            assert torch.equal(a, b)
        exp_d_pre, exp_act, exp_d_probs = dact_reference(dy, w, offsets, pre, "scaled_swiglu", probs)
        d_pre, act, d_probs, dx = graph_out
        assert rel_err(d_pre, exp_d_pre) <= TOL and rel_err(act, exp_act) <= TOL
        assert rel_err(d_probs, exp_d_probs) <= TOL
        assert rel_err(dx, grouped_matmul_reference(dy, w, offsets, "kn")) <= TOL


def test_sm_margin_gives_identical_results(monkeypatch):
    # 32 x 8 = 256 tiles of 128 x 128: more than the SMs, so the margin changes the tile order
    splits, m, h, i = [1000, 0, 7, 2500, 300, 13], 4096, 512, 1024
    outs = {}
    for margin in (0, 16, "env"):
        kw = {"sm_margin": 16} if margin == 16 else {"sm_margin": 0} if margin == 0 else {}
        if margin == "env":
            monkeypatch.setenv("TE_FUSED_OPS_SM_MARGIN", "16")  # the wrappers ignore it: margin 0
        dact = run_dact(splits, m, h, i, "scaled_swiglu", seed=5, check=margin == 0,
                        tile_n=128, cluster_m=2, **kw)
        dx = run_kn(splits, m, h, i, seed=5, tile_n=128, cluster_m=2, **kw)
        outs[margin] = (*dact, dx)
    for a, b, c in zip(outs[0], outs[16], outs["env"]):  # every margin gives the same bits
        assert torch.equal(a, b) and torch.equal(a, c)


def test_bad_offsets_stay_in_bounds():
    """Bad split values (decreasing, negative, past M) read and write only inside the tensors;
    the outputs stay finite."""
    torch.manual_seed(7)
    m, h, i = 1000, 128, 128
    dy = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(4, h, i, device="cuda") / 16).to(torch.bfloat16)
    pre = torch.randn(m, 2 * i, dtype=torch.bfloat16, device="cuda")
    probs = torch.rand(m, device="cuda")
    for offs in ([0, 700, 300, 5000, 99999], [-50, 10, -3, 2000, 7]):
        offsets = torch.tensor(offs, dtype=torch.int32, device="cuda")
        poison_allocator(((m, 2 * i), torch.bfloat16), ((m, i), torch.bfloat16), ((1, m), torch.float32))
        outs = grouped_dgrad_dact_sm90(dy, w, offsets, pre, activation="scaled_swiglu", probs=probs)
        dx, _ = grouped_gemm_sm90(dy, w, offsets, weight_layout="kn")
        torch.cuda.synchronize()
        for t in (*outs, dx):
            assert torch.isfinite(t).all()


def test_preallocated_outputs():
    """out / act_out: NaN-poisoned buffers (padding rows included) are filled in place, equal to
    the allocating call; a wrong shape or dtype is a named error."""
    torch.manual_seed(11)
    m, h, i = 512, 128, 128
    offsets = offsets_from_splits(UNEVEN)  # 450 of 512 rows routed
    dy = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    w = (torch.randn(len(UNEVEN), h, i, device="cuda") / 16).to(torch.bfloat16)
    pre = torch.randn(m, 2 * i, dtype=torch.bfloat16, device="cuda")
    d_pre, act, _ = grouped_dgrad_dact_sm90(dy, w, offsets, pre, activation="swiglu")
    out = torch.full_like(pre, float("nan"))
    act_out = torch.full_like(act, float("nan"))
    got = grouped_dgrad_dact_sm90(dy, w, offsets, pre, activation="swiglu", out=out, act_out=act_out)
    assert got[0] is out and got[1] is act_out
    assert torch.equal(out, d_pre) and torch.equal(act_out, act)
    assert not out[450:].any() and not act_out[450:].any()
    name = "grouped_dgrad_dact_sm90"
    with pytest.raises(ValueError, match=f"{name}: out must have shape"):
        grouped_dgrad_dact_sm90(dy, w, offsets, pre, activation="swiglu", out=out[:, :i].contiguous())
    with pytest.raises(TypeError, match=f"{name}: act_out has dtype"):
        grouped_dgrad_dact_sm90(dy, w, offsets, pre, activation="swiglu", act_out=act_out.half())


def test_argument_errors():
    dy = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2, 32, 64, dtype=torch.bfloat16, device="cuda")
    pre = torch.randn(64, 128, dtype=torch.bfloat16, device="cuda")
    off = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    name = "grouped_dgrad_dact_sm90"
    with pytest.raises(TypeError, match=f"{name}: dy"):
        grouped_dgrad_dact_sm90(dy.float(), w, off, pre, activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: activation is required"):
        grouped_dgrad_dact_sm90(dy, w, off, pre, activation=None)
    with pytest.raises(ValueError, match=f"{name}: activation must be"):
        grouped_dgrad_dact_sm90(dy, w, off, pre, activation="relu")
    with pytest.raises(ValueError, match=f"{name}: pre must have shape"):
        grouped_dgrad_dact_sm90(dy, w, off, pre[:, :64].contiguous(), activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: weight has H=16"):
        grouped_dgrad_dact_sm90(dy, w[:, :16].contiguous(), off, pre, activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: probs is required"):
        grouped_dgrad_dact_sm90(dy, w, off, pre, activation="scaled_swiglu")
    with pytest.raises(ValueError, match=f"{name}: probs is only used"):
        grouped_dgrad_dact_sm90(dy, w, off, pre, activation="swiglu", probs=torch.rand(64, device="cuda"))
    with pytest.raises(ValueError, match=f"{name}: I=48"):
        grouped_dgrad_dact_sm90(dy, w[:, :, :48].contiguous(), off, pre[:, :96].contiguous(),
                                activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: sm_margin must be >= 0"):
        grouped_dgrad_dact_sm90(dy, w, off, pre, activation="swiglu", sm_margin=-1)
    with pytest.raises(TypeError, match=f"{name}: epilogue_warps must be a bool"):
        grouped_dgrad_dact_sm90(dy, w, off, pre, activation="swiglu", epilogue_warps="yes")
    with pytest.raises(TypeError, match=f"{name}: deep_operands must be a bool"):
        grouped_dgrad_dact_sm90(dy, w, off, pre, activation="swiglu", pingpong=True, deep_operands=1)
    with pytest.raises(ValueError, match=f"{name}: deep_operands needs the ping-pong schedule"):
        grouped_dgrad_dact_sm90(dy, w, off, pre, activation="swiglu", pingpong=False, deep_operands=True)
    with pytest.raises(ValueError, match="grouped_gemm_sm90: weight_layout"):
        grouped_gemm_sm90(dy, w, off, weight_layout="tn")
    with pytest.raises(ValueError, match="grouped_gemm_sm90: weight has K=64"):
        grouped_gemm_sm90(dy, w, off)  # (G, 32, 64) read as (G, N, K): K mismatch
