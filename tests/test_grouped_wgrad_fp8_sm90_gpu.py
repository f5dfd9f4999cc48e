"""GPU tests of the block-scaled FP8 grouped weight gradient against a float64 reference of the same
quantized operands (the per-group column-wise copies `quantize(..., columnwise=True)` makes, laid
out block-padded here); differences only from the fp32 accumulation order and the output rounding."""

import pytest
import torch
from test_grouped_wgrad_sm90_gpu import PAD_VALUE, offsets_from_splits, rel_err

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.backends.sm90.kernels.block_quantize import BlockColumns
from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_fp8_sm90
from te_fused_ops.quantization import group_block_index, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]


def block_padded(data, scale_inv, offsets):
    """`BlockColumns` of a column-wise copy (data (C, M), scale_inv (C, blocks)) of the grouped
    rows: token r of group g at column 128 * block(r) + (r - start_g) % 128, zeros elsewhere."""
    m = data.shape[1]
    block, blocks = group_block_index(offsets, m, 128)
    ends = offsets[1:].long().clamp(0, m).cummax(0).values
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    rows = torch.arange(m, device=data.device)
    group = torch.searchsorted(ends, rows, right=True)
    grouped = group < len(ends)
    position = 128 * block[grouped] + (rows[grouped] - starts[group[grouped]]) % 128
    padded = torch.zeros(data.shape[0], 128 * blocks, dtype=torch.uint8, device=data.device)
    padded[:, position] = data.view(torch.uint8)[:, grouped]
    return BlockColumns(padded.view(torch.float8_e4m3fn), scale_inv.t().contiguous(), m)


def column_copy(t, offsets):
    """(`BlockColumns`, values (C, M) float64) of t (M, C)'s per-group column-wise copy; the values
    expanded here from data and scales independently of the library."""
    q = quantize(t, "fp8_blockwise", rowwise=False, columnwise=True, offsets=offsets)
    block, _ = group_block_index(offsets, t.shape[0], 128)
    values = q.columnwise_data.double() * q.columnwise_scale_inv.double()[:, block]
    return block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets), values


def make_inputs(splits, m, n, k, seed):
    """dy (M, N), x (M, K) with token rows and feature columns of contrasting ranges (a value scaled
    with another block's multiplier is off by 4x or more), rows past sum(splits) PAD_VALUE."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = 4.0 ** (torch.arange(m, device="cuda") // 37 % 3)[:, None]
    dy = torch.randn(m, n, device="cuda", generator=gen) * rows * 4.0 ** (torch.arange(n, device="cuda") // 128 % 2)
    x = torch.randn(m, k, device="cuda", generator=gen) * rows.flip(0) * 4.0 ** (torch.arange(k, device="cuda") // 64 % 3)
    end = sum(splits)
    dy[end:] = PAD_VALUE
    x[end:] = PAD_VALUE
    return dy.bfloat16(), x.bfloat16(), offsets_from_splits(splits)


def reference(dy_values, x_values, splits):
    """float64 dW (G, N, K) from the column-wise values (C, M)."""
    dw = torch.zeros(len(splits), dy_values.shape[0], x_values.shape[0], dtype=torch.float64, device="cuda")
    start = 0
    for g, rows in enumerate(splits):
        dw[g] = dy_values[:, start:start + rows] @ x_values[:, start:start + rows].T
        start += rows
    return dw


def run_case(splits, m, n, k, seed=0, cluster_m=None, main_grad=False, tol=5e-3):
    dy, x, offsets = make_inputs(splits, m, n, k, seed)
    dy_cols, dy_values = column_copy(dy, offsets)
    x_cols, x_values = column_copy(x, offsets)
    ref = reference(dy_values, x_values, splits)
    if main_grad:
        start = torch.randn(len(splits), n, k, device="cuda")
        acc = start.clone()
        out = grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, main_grad=acc, cluster_m=cluster_m)
        assert out.data_ptr() == acc.data_ptr()
        assert rel_err(acc - start, ref) <= tol
        return
    out = torch.full((len(splits), n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    dw = grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, out=out, cluster_m=cluster_m)
    assert dw.data_ptr() == out.data_ptr()
    assert rel_err(dw, ref) <= tol
    for g, rows in enumerate(splits):
        if rows == 0:
            assert torch.all(dw[g] == 0), f"empty group {g} not zero"


UNEVEN = [0, 1, 127, 128, 129, 300, 0, 513, 17, 256]


@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("main_grad", [False, True])
def test_uneven_unaligned_groups(cluster_m, main_grad):
    """Groups start anywhere; partial last blocks, empty groups, padding rows after the last group."""
    run_case(UNEVEN, sum(UNEVEN) + 48 - sum(UNEVEN) % 16, 384, 256, cluster_m=cluster_m, main_grad=main_grad,
             tol=1e-3 if main_grad else 5e-3)


@pytest.mark.parametrize("n, k", [(16, 16), (48, 208), (272, 144)])
def test_edge_tiles(n, k):
    """N and K not multiples of the 128 x 128 tile: clipped loads of the multipliers and stores."""
    run_case([33, 200, 95], 336, n, k, seed=1)


def test_many_groups():
    splits = [(g * 37) % 150 for g in range(200)]
    m = sum(splits) + 16 - sum(splits) % 16
    run_case(splits, m, 128, 256, seed=2)


def test_large_groups():
    run_case([4096, 2048 + 5, 1000], 7168, 512, 384, seed=3)


def test_nan_in_another_group_stays_there():
    """A NaN in group 1's tokens must not reach group 0 through group 0's last, partial block."""
    splits = [100, 60]
    dy, x, offsets = make_inputs(splits, 160, 128, 128, 4)
    x[110] = float("nan")  # inside the 128 tokens of group 0's only block
    dy_cols, dy_values = column_copy(dy, offsets)
    x_cols, _ = column_copy(x, offsets)
    dw = grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets)
    _, x_values = column_copy(x[:112], offsets_from_splits([100]))
    assert rel_err(dw[0], dy_values[:, :100] @ x_values[:, :100].T) <= 5e-3


def test_no_host_sync_and_cuda_graph():
    splits = [300, 0, 129, 64]
    dy, x, offsets = make_inputs(splits, 512, 256, 128, 5)
    dy_cols, dy_values = column_copy(dy, offsets)
    x_cols, x_values = column_copy(x, offsets)
    out = torch.empty(4, 256, 128, dtype=torch.bfloat16, device="cuda")
    grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, out=out)  # compile, memo
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, out=out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(dy_values, x_values, splits)) <= 5e-3


VARIANTS = {  # name: keyword arguments of a mainloop bit-equal to the 128-wide tile's
    "default": {},  # `tuning.fp8_tile_n` of K
    "overlapped promotion": dict(overlap_promotion=True),  # two block products in flight
    "tile 192": dict(tile_n=192),  # one 96-register block product, the column multipliers read as used
    "tile 256": dict(tile_n=256),  # each block's product in two 128-column halves
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("cluster_m", [1, 2])
@pytest.mark.parametrize("main_grad", [False, True])
@pytest.mark.parametrize("n, k", [(384, 256), (272, 208), (128, 112)])
def test_mainloop_variants_are_bit_equal(variant, cluster_m, main_grad, n, k):
    """The same sums in the same order as the 128-wide tile's mainloop, over groups of 1 to 32 scale
    blocks (odd and even counts: the overlapped loop takes blocks in pairs), empty groups, K not
    a multiple of the tile (a 256 tile's second half partly or wholly past K), and within the
    float64 tolerance."""
    splits = [1, 0, 128, 129, 300, 513, 640, 4096, 17, 0, 1000]
    m = sum(splits) + 16 - sum(splits) % 16
    dy, x, offsets = make_inputs(splits, m, n, k, 6)
    dy_cols, dy_values = column_copy(dy, offsets)
    x_cols, x_values = column_copy(x, offsets)
    results = []
    for options in (dict(tile_n=128), VARIANTS[variant]):
        if main_grad:
            out = torch.randn(len(splits), n, k, device="cuda", generator=torch.Generator("cuda").manual_seed(7))
            grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, main_grad=out, cluster_m=cluster_m, **options)
        else:
            out = torch.full((len(splits), n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
            grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, out=out, cluster_m=cluster_m, **options)
        results.append(out)
    assert torch.equal(results[0], results[1])
    if not main_grad:
        assert rel_err(results[1], reference(dy_values, x_values, splits)) <= 5e-3
        assert torch.all(results[1][[1, 9]] == 0)


def test_argument_errors():
    offsets = offsets_from_splits([16, 16])
    cols = BlockColumns(torch.zeros(32, 384, dtype=torch.float8_e4m3fn, device="cuda"), torch.ones(3, 32, device="cuda"), 32)
    with pytest.raises(TypeError, match="dy_columns.data has dtype"):
        grouped_wgrad_fp8_sm90(cols._replace(data=cols.data.float()), cols, offsets)
    with pytest.raises(ValueError, match=r"dy_columns.scale_inv must have shape \(3, 32\)"):
        grouped_wgrad_fp8_sm90(cols._replace(scale_inv=cols.scale_inv[:2]), cols, offsets)
    with pytest.raises(ValueError, match="dy_columns has 48 tokens, x_columns 32"):
        grouped_wgrad_fp8_sm90(cols._replace(num_tokens=48), cols, offsets)
    with pytest.raises(ValueError, match="G <= 512"):
        grouped_wgrad_fp8_sm90(cols, cols, offsets_from_splits([0] * 600))
    with pytest.raises(TypeError, match="must be BlockColumns"):
        grouped_wgrad_fp8_sm90(cols.data, cols, offsets)
    with pytest.raises(TypeError, match="overlap_promotion must be a bool"):
        grouped_wgrad_fp8_sm90(cols, cols, offsets, overlap_promotion="yes")
    with pytest.raises(ValueError, match="tile_n must be 128, 192 or 256, got 64"):
        grouped_wgrad_fp8_sm90(cols, cols, offsets, tile_n=64)
    with pytest.raises(ValueError, match="overlap_promotion needs tile_n 128"):
        grouped_wgrad_fp8_sm90(cols, cols, offsets, tile_n=256, overlap_promotion=True)
