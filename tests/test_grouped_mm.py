"""Torch grouped GEMM helpers: group alignment for torch._grouped_mm, no leaked saved tensors."""

import gc
import weakref

import torch

import te_fused_ops as tfo
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


def test_forward_only_call_frees_saved_tensors_without_gc():
    seq = tfo.Sequential(tfo.GroupedLinear(2, 8, 16), tfo.SwiGLU(), tfo.GroupedLinear(2, 8, 8))
    x = torch.randn(10, 8, requires_grad=True)
    gc.disable()
    try:
        y = seq(x, split_sizes=torch.tensor([4, 6]))
        pre = weakref.ref(y.grad_fn.run.ctxs[1].saved["input"])
        del y
        assert pre() is None, "a reference cycle keeps the pre-activation alive"
    finally:
        gc.enable()


def test_backward_releases_saved_tensors():
    seq = tfo.Sequential(tfo.GroupedLinear(2, 8, 16), tfo.SwiGLU(), tfo.GroupedLinear(2, 8, 8))
    y = seq(torch.randn(10, 8, requires_grad=True), split_sizes=torch.tensor([4, 6]))
    run = y.grad_fn.run
    y.sum().backward()
    assert all(not ctx.saved for ctx in run.ctxs)
