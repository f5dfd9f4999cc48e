"""GPU tests of the sm90 grouped weight-gradient kernel against a float64 reference."""

import pytest
import torch

from te_fused_ops.backends.sm90.kernels import grouped_wgrad, sm90_unavailable_reason
from te_fused_ops.grouped_mm import grouped_row_sum
from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_column_sums_sm90, grouped_wgrad_sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]

PAD_VALUE = 1e4  # padding rows (>= offsets[G]) hold this; it must not reach dW


def offsets_from_splits(splits):
    off = [0]
    for s in splits:
        off.append(off[-1] + s)
    return torch.tensor(off, dtype=torch.int32, device="cuda")


def make_inputs(splits, m, n, k, dtype, seed):
    """dy (M, N), x (M, K) random, rows past sum(splits) set to PAD_VALUE; offsets (G+1,)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    dy = torch.randn(m, n, device="cuda", generator=gen).to(dtype)
    x = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    end = sum(splits)
    dy[end:] = PAD_VALUE
    x[end:] = PAD_VALUE
    return dy, x, offsets_from_splits(splits)


def reference(dy, x, offsets):
    """float64 dW (G, N, K) from offsets clamped like the kernel: [0, M], end >= start."""
    m = dy.shape[0]
    off = offsets.tolist()
    dw = torch.zeros(len(off) - 1, dy.shape[1], x.shape[1], dtype=torch.float64, device="cuda")
    for g in range(len(off) - 1):
        s = min(max(off[g], 0), m)
        e = max(min(off[g + 1], m), s)
        if e > s:
            dw[g] = dy[s:e].double().T @ x[s:e].double()
    return dw


def rel_err(out, ref):
    assert not torch.isnan(out).any(), "NaN in output (unwritten or wrong)"
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def check_dw(dw, ref, splits):
    assert rel_err(dw, ref) <= 1e-2
    for g, s in enumerate(splits):
        if s == 0:
            assert torch.all(dw[g] == 0), f"empty group {g} not zero"


def run_case(splits, m, n, k, dtype=torch.bfloat16, seed=0, tile_n=None, cluster_m=None, **cfg):
    dy, x, offsets = make_inputs(splits, m, n, k, dtype, seed)
    out = torch.full((len(splits), n, k), float("nan"), dtype=dtype, device="cuda")
    dw = grouped_wgrad_sm90(dy, x, offsets, out=out, tile_n=tile_n, cluster_m=cluster_m, **cfg)
    assert dw.data_ptr() == out.data_ptr() and dw.dtype == dtype
    check_dw(dw, reference(dy, x, offsets), splits)
    return dy, x, offsets, dw


UNEVEN = [1, 7, 0, 13, 300, 0, 129, 64, 0]  # unaligned starts, zero groups in the middle and last


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("tile_n", [128, 192, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_uneven_unaligned_splits(dtype, tile_n, cluster_m):
    # N=320 / K=320: partial m- and n-tiles, an odd m-tile count (a CTA pair's second tile
    # lies past N); 40 padding rows
    run_case(UNEVEN, sum(UNEVEN) + 40, 320, 320, dtype, seed=1, tile_n=tile_n,
             cluster_m=cluster_m)


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_tile_widths_are_bit_equal(cluster_m):
    """Each dW element is the same sum over the tokens in the same order at every tile width:
    192- and 256-wide tiles bit for bit the 128-wide ones (what would let a narrower tile, faster
    to compile, stand in for a wider one while it compiles)."""
    dws = [run_case(UNEVEN, sum(UNEVEN) + 40, 320, 640, seed=2, tile_n=tile_n, cluster_m=cluster_m)[3]
           for tile_n in (128, 192, 256)]
    assert torch.equal(dws[0], dws[1]) and torch.equal(dws[0], dws[2])


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("tile_n", [128, 192])
def test_pingpong(tile_n, cluster_m):
    """Each MMA warpgroup on every other tile (empty groups' zero tiles included), on one cluster
    (many tiles a CTA) and on the whole GPU: against float64, and bit for bit the cooperative
    schedule's dW."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for margin in (sms - cluster_m, None):
        dws = [run_case(UNEVEN, sum(UNEVEN) + 40, 320, 320, seed=1, tile_n=tile_n, cluster_m=cluster_m,
                        sm_margin=margin, pingpong=pingpong)[3] for pingpong in (True, False)]
        assert torch.equal(*dws)


@pytest.mark.parametrize(
    "splits,m",
    [
        ([0, 0, 777, 0], 777),  # one group holds all rows, offsets[G] == M
        ([0, 50, 0, 77, 0], 200),  # zero groups first, middle, last; padding
        ([333], 400),  # G = 1 with padding rows
        ([128, 256, 384], 768),  # tile-aligned
        ([0, 0, 0], 50),  # no rows at all: dW = 0
        ([65, 1, 1, 63, 130], 300),  # groups straddling 64-row k-tiles
    ],
)
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_routings(splits, m, cluster_m):
    run_case(splits, m, 256, 256, seed=2, cluster_m=cluster_m)


@pytest.mark.parametrize("g", [256, 600])  # 600 > SORT_MAX_G: groups in index order
def test_many_groups(g):
    gen = torch.Generator().manual_seed(3)
    splits = torch.randint(0, 40, (g,), generator=gen)
    splits[torch.randperm(g, generator=gen)[: g // 4]] = 0
    run_case(splits.tolist(), int(splits.sum()) + 77, 136, 264, seed=3)


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("n,k", [(8, 8), (8, 264), (264, 8)])
def test_smallest_shapes(n, k, cluster_m):
    run_case([5, 0, 20, 3], 40, n, k, seed=4, cluster_m=cluster_m)


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_large_groups(cluster_m):
    run_case([1500, 0, 701, 1900], 4200, 1536, 2048, seed=5, cluster_m=cluster_m)


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_tall_dw_in_bands(cluster_m):
    # N=2320: 19 m-tiles (10 pairs) per group, more than RASTER_BAND: walked in bands
    run_case([300, 0, 517], 900, 2320, 384, seed=6, tile_n=128, cluster_m=cluster_m)


@pytest.mark.parametrize(
    "splits,m",
    [(UNEVEN, sum(UNEVEN) + 40), ([0, 0, 777, 0], 777), ([333], 400), ([0, 0, 0], 50)],
)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_bias_gradient_column_sums(splits, m, dtype):
    """Per-group column sums (the bias gradient): the sm90 path (this kernel, ones operand; bf16 /
    fp16) and the torch reference on CUDA against float64, padding rows excluded, empty groups 0,
    run to run identical."""
    dy, _, offsets = make_inputs(splits, m, 264, 8, dtype, seed=7)
    want = reference(dy, torch.ones(m, 8, dtype=dtype, device="cuda"), offsets)[:, :, 0]
    paths = [grouped_row_sum] + ([grouped_column_sums_sm90] if dtype != torch.float32 else [])
    for sums in paths:
        got = sums(dy, offsets)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous(), sums.__name__
        if sum(splits):
            check_dw(got, want, splits)
        else:
            assert torch.all(got == 0), sums.__name__
        assert torch.equal(sums(dy, offsets), got), sums.__name__


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_main_grad_accumulates(dtype, tile_n, cluster_m):
    splits, n, k = UNEVEN, 320, 320
    dy, x, offsets = make_inputs(splits, sum(splits) + 9, n, k, dtype, seed=6)
    ref = reference(dy, x, offsets)
    cfg = dict(tile_n=tile_n, cluster_m=cluster_m)
    dw = grouped_wgrad_sm90(dy, x, offsets, **cfg)
    check_dw(dw, ref, splits)

    main_grad = torch.zeros(len(splits), n, k, dtype=torch.float32, device="cuda")
    for _ in range(2):
        res = grouped_wgrad_sm90(dy, x, offsets, main_grad=main_grad, **cfg)
        assert res is main_grad
    assert rel_err(main_grad, 2 * ref) <= 1e-2
    # fp32 accumulation of the same products: 2 x dW up to dW's own rounding
    assert rel_err(main_grad, 2 * dw.double()) <= 1e-2

    base = torch.randn(len(splits), n, k, device="cuda")
    main_grad = base.clone()
    grouped_wgrad_sm90(dy, x, offsets, main_grad=main_grad, **cfg)
    assert rel_err(main_grad - base, ref) <= 1e-2
    for g, s in enumerate(splits):
        if s == 0:
            assert torch.equal(main_grad[g], base[g])


def test_zero_rows_and_zero_groups():
    dy = torch.empty(0, 64, dtype=torch.bfloat16, device="cuda")
    x = torch.empty(0, 32, dtype=torch.bfloat16, device="cuda")
    offsets = torch.zeros(4, dtype=torch.int32, device="cuda")
    out = torch.full((3, 64, 32), float("nan"), dtype=torch.bfloat16, device="cuda")
    assert torch.all(grouped_wgrad_sm90(dy, x, offsets, out=out) == 0)
    mg = torch.ones(3, 64, 32, device="cuda")
    assert torch.all(grouped_wgrad_sm90(dy, x, offsets, main_grad=mg) == 1)
    dy = torch.randn(16, 64, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(16, 32, dtype=torch.bfloat16, device="cuda")
    empty = torch.zeros(1, dtype=torch.int32, device="cuda")
    assert grouped_wgrad_sm90(dy, x, empty).shape == (0, 64, 32)


@pytest.mark.parametrize("cluster_m", [1, 2])
def test_bad_offsets_stay_in_bounds(cluster_m):
    """Out-of-range offsets are clamped: inputs are read, outputs written only in bounds."""
    g, m, n, k, guard = 4, 1000, 392, 264, 4096
    gen = torch.Generator(device="cuda").manual_seed(7)
    # inputs inside NaN-filled buffers: a read before or after them would poison dW
    dy_buf = torch.full((guard + m * n + guard,), float("nan"), dtype=torch.bfloat16, device="cuda")
    x_buf = torch.full((guard + m * k + guard,), float("nan"), dtype=torch.bfloat16, device="cuda")
    dy = dy_buf[guard : guard + m * n].view(m, n)
    x = x_buf[guard : guard + m * k].view(m, k)
    dy.copy_(torch.randn(m, n, device="cuda", generator=gen))
    x.copy_(torch.randn(m, k, device="cuda", generator=gen))
    out_buf = torch.full((g * n * k + guard,), 3.0, dtype=torch.bfloat16, device="cuda")
    out = out_buf[: g * n * k].view(g, n, k)
    mg_buf = torch.full((g * n * k + guard,), 3.0, dtype=torch.float32, device="cuda")
    main_grad = mg_buf[: g * n * k].view(g, n, k)
    for offs in (
        [0, 100, 500, 900, 1000],
        [0, 700, 300, 5000, 99999],
        [-50, 10, -3, 2000, 7],
        [2**31 - 1, -(2**31), 2**31 - 1, 0, 1000],
    ):
        offsets = torch.tensor(offs, dtype=torch.int32, device="cuda")
        ref = reference(dy, x, offsets)
        grouped_wgrad_sm90(dy, x, offsets, out=out, cluster_m=cluster_m)
        main_grad.zero_()
        grouped_wgrad_sm90(dy, x, offsets, main_grad=main_grad, cluster_m=cluster_m)
        torch.cuda.synchronize()
        assert torch.all(out_buf[g * n * k :] == 3.0)
        assert torch.all(mg_buf[g * n * k :] == 3.0)
        assert rel_err(out, ref) <= 1e-2
        assert rel_err(main_grad, ref) <= 1e-2


def test_no_host_sync_and_cuda_graph():
    g, m, n, k = 8, 2048, 256, 384
    dy, x, offsets = make_inputs([256] * 8, m, n, k, torch.bfloat16, seed=8)
    grouped_wgrad_sm90(dy, x, offsets)  # compile outside the checks
    main_grad = torch.zeros(g, n, k, device="cuda")
    grouped_wgrad_sm90(dy, x, offsets, main_grad=main_grad)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_wgrad_sm90(dy, x, offsets)
        grouped_wgrad_sm90(dy, x, offsets, main_grad=main_grad, sm_margin=4)
    finally:
        torch.cuda.set_sync_debug_mode(0)

    out = torch.empty(g, n, k, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        grouped_wgrad_sm90(dy, x, offsets, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_wgrad_sm90(dy, x, offsets, out=out)
        main_grad.zero_()
        grouped_wgrad_sm90(dy, x, offsets, main_grad=main_grad)
    routings = [[0] * 7 + [2048], [300, 0, 17, 900, 0, 1, 500, 30], [100, 0, 0, 0, 0, 0, 0, 1]]
    for splits in routings:
        offsets.copy_(offsets_from_splits(splits))
        out.fill_(float("nan"))
        graph.replay()
        eager = grouped_wgrad_sm90(dy, x, offsets)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        ref = reference(dy, x, offsets)
        check_dw(out, ref, splits)
        assert rel_err(main_grad, ref) <= 1e-2


def test_sm_margin_identical(monkeypatch):
    splits = [700, 0, 13, 1100, 5, 230]
    dy, x, offsets = make_inputs(splits, 2100, 384, 520, torch.bfloat16, seed=9)
    a = grouped_wgrad_sm90(dy, x, offsets, sm_margin=0)
    b = grouped_wgrad_sm90(dy, x, offsets, sm_margin=16)
    c = grouped_wgrad_sm90(dy, x, offsets, sm_margin=100000)  # grid clamps to 1 CTA
    d = grouped_wgrad_sm90(dy, x, offsets, sm_margin=17, cluster_m=2)  # 57 pairs
    e = grouped_wgrad_sm90(dy, x, offsets, sm_margin=100000, cluster_m=2)  # one pair
    monkeypatch.setenv("TE_FUSED_OPS_SM_MARGIN", "16")  # read by the backend, not the wrapper: 0 here
    f = grouped_wgrad_sm90(dy, x, offsets)
    for other in (b, c, d, e, f):
        assert torch.equal(a, other)
    check_dw(a, reference(dy, x, offsets), splits)


def test_classic_call_path(monkeypatch):
    monkeypatch.setattr(grouped_wgrad, "tvm_ffi_available", lambda: False)
    monkeypatch.setattr(grouped_wgrad, "_LAUNCHERS", {})
    run_case(UNEVEN, sum(UNEVEN) + 3, 128, 136, seed=10)


def test_argument_errors(monkeypatch):
    dy = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 16, dtype=torch.bfloat16, device="cuda")
    off = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    name = "grouped_wgrad_sm90"
    with pytest.raises(TypeError, match=f"{name}: dy"):
        grouped_wgrad_sm90(dy.float(), x, off)
    with pytest.raises(TypeError, match=f"{name}: x"):
        grouped_wgrad_sm90(dy, x.half(), off)
    with pytest.raises(ValueError, match=f"{name}: x has 63 rows"):
        grouped_wgrad_sm90(dy, x[:63], off)
    with pytest.raises(ValueError, match=f"{name}: dy must be contiguous"):
        grouped_wgrad_sm90(dy.t().contiguous().t(), x, off)
    with pytest.raises(ValueError, match=f"{name}: dy must be on a CUDA"):
        grouped_wgrad_sm90(dy.cpu(), x, off)
    with pytest.raises(TypeError, match=f"{name}: offsets"):
        grouped_wgrad_sm90(dy, x, off.long())
    with pytest.raises(ValueError, match=f"{name}: offsets"):
        grouped_wgrad_sm90(dy, x, off[:0])
    with pytest.raises(ValueError, match="N=36"):
        grouped_wgrad_sm90(dy.new_zeros(64, 36), x, off)
    with pytest.raises(ValueError, match="K=12"):
        grouped_wgrad_sm90(dy, x.new_zeros(64, 12), off)
    with pytest.raises(ValueError, match=f"{name}: out must have shape"):
        grouped_wgrad_sm90(dy, x, off, out=dy.new_empty(3, 32, 16))
    with pytest.raises(TypeError, match=f"{name}: out"):
        grouped_wgrad_sm90(dy, x, off, out=dy.new_empty(2, 32, 16, dtype=torch.float32))
    with pytest.raises(TypeError, match=f"{name}: main_grad"):
        grouped_wgrad_sm90(dy, x, off, main_grad=dy.new_empty(2, 32, 16))
    with pytest.raises(ValueError, match=f"{name}: main_grad must have shape"):
        grouped_wgrad_sm90(dy, x, off, main_grad=torch.empty(2, 16, 32, device="cuda"))
    with pytest.raises(ValueError, match="at most one"):
        grouped_wgrad_sm90(dy, x, off, out=dy.new_empty(2, 32, 16),
                           main_grad=torch.empty(2, 32, 16, device="cuda"))
    with pytest.raises(ValueError, match="sm_margin"):
        grouped_wgrad_sm90(dy, x, off, sm_margin=-1)
    with pytest.raises(ValueError, match=f"{name}: cluster_m"):
        grouped_wgrad_sm90(dy, x, off, cluster_m=4)
    with pytest.raises(ValueError, match=f"{name}: tile_n"):
        grouped_wgrad_sm90(dy, x, off, tile_n=64)
    with pytest.raises(TypeError, match=f"{name}: pingpong must be a bool or None"):
        grouped_wgrad_sm90(dy, x, off, pingpong=1)
    with pytest.raises(ValueError, match=f"{name}: pingpong needs tile_n"):
        grouped_wgrad_sm90(dy, x, off, pingpong=True, tile_n=256)
    with pytest.raises(ValueError, match=f"{name}: pingpong needs tile_n .* and no main_grad"):
        grouped_wgrad_sm90(dy, x, off, pingpong=True, main_grad=torch.zeros(2, 32, 16, device="cuda"))
    monkeypatch.setenv("TE_FUSED_OPS_SM_MARGIN", "lots")  # the wrappers read no environment
    grouped_wgrad_sm90(dy, x, off)
