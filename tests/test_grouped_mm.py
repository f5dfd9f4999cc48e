"""Torch grouped GEMM helpers: group alignment for torch._grouped_mm, the per-group bias sums."""

import pytest
import torch

from te_fused_ops.grouped_mm import align_groups, grouped_row_sum, grouped_wgrad
from te_fused_ops.splits import split_offsets


def test_align_groups_layout_and_wgrad():
    torch.manual_seed(0)
    rows = 50
    offsets = split_offsets(torch.tensor([0, 7, 13, 0, 9, 1]), rows)  # 20 padding rows
    dy, x = torch.randn(rows, 16), torch.randn(rows, 24)
    dy_aligned, x_aligned, ends = align_groups(offsets, dy, x)
    assert ends.tolist() == [0, 8, 24, 24, 40, 48]
    assert dy_aligned.shape == (rows + 6 * 7 + 1, 16)
    assert torch.equal(dy_aligned[8:21], dy[7:20]) and torch.all(dy_aligned[21:24] == 0)
    assert torch.equal(x_aligned[40:41], x[29:30]) and torch.all(x_aligned[41:-1] == 0)
    dw = torch._grouped_mm(dy_aligned.t(), x_aligned, offs=ends)
    assert torch.allclose(dw, grouped_wgrad(dy, x, offsets), atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_grouped_row_sum_keeps_the_precision_of_its_dtype(dtype):
    """The bias gradient on the CPU: float64 sums in float64 (it summed in float32 before, 1e-8 off),
    float32 in float32, 16-bit dy in float32 rounded once."""
    torch.manual_seed(1)
    offsets = split_offsets(torch.tensor([5, 0, 300, 2]), 310)  # 3 padding rows
    dy = torch.randn(310, 7, dtype=torch.float64)
    want = torch.stack([dy[0:5].sum(0), dy.new_zeros(7), dy[5:305].sum(0), dy[305:307].sum(0)])
    got = grouped_row_sum(dy.to(dtype), offsets)
    assert got.dtype == dtype
    exact = torch.stack([dy.to(dtype).double()[a:b].sum(0) for a, b in ((0, 5), (5, 5), (5, 305), (305, 307))])
    tolerance = {torch.float64: 1e-13, torch.float32: 1e-5, torch.bfloat16: 1e-2}[dtype]
    assert (got.double() - exact).abs().max() <= tolerance * exact.abs().max()
    if dtype == torch.float64:
        assert (got - want).abs().max() <= 1e-13 * want.abs().max()
