"""Torch grouped GEMM helpers: group alignment for torch._grouped_mm."""

import torch

from te_fused_ops.grouped_mm import align_groups, grouped_wgrad
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
