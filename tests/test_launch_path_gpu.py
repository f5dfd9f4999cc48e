"""GPU tests of the lean launch path: wrappers keyed on shapes (TVM-FFI checks the rest on every
call), preallocated outputs, and the one-launch split-offsets kernel."""

import pytest
import torch

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_dgrad_dact_sm90, grouped_gemm_sm90
from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_sm90
from te_fused_ops.splits import split_offsets

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]


def misaligned(t):
    """``t``'s values in a contiguous tensor of the same shape whose data pointer is 2 bytes off."""
    buf = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)
    view = buf[1 : 1 + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def strided(t):
    """``t``'s values in a non-contiguous tensor of the same shape."""
    return t.t().contiguous().t()


def _inputs():
    torch.manual_seed(3)
    x = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2, 128, 32, dtype=torch.bfloat16, device="cuda") / 8
    off = torch.tensor([0, 24, 64], dtype=torch.int32, device="cuda")
    return x, w, off


def _bad_variants(name, tensors: dict):
    """(one tensor replaced, expected error type, message) with the shapes of the valid call, so
    its memo entry is hit and the compiled function rejects the call; ``tensors`` in argument order."""
    cases = []
    for i, (arg, t) in enumerate(tensors.items()):
        if i > 0:  # the first tensor's dtype is part of the memo key (it selects the kernel)
            other = torch.float16 if t.dtype == torch.bfloat16 else torch.int64
            cases.append(({arg: t.to(other)}, TypeError, f"{name}: {arg} has dtype"))
        if t.dim() == 2 and t.shape[0] > 1 and t.shape[1] > 1:
            cases.append(({arg: strided(t)}, ValueError, f"{name}: {arg} must be contiguous"))
        if t.element_size() == 2:
            cases.append(({arg: misaligned(t)}, ValueError, f"{name}: {arg} data pointer"))
        cases.append(({arg: t.cpu()}, ValueError, f"{name}: {arg} (is|must be) on"))
    return cases


def test_forward_errors_after_a_valid_call_then_still_correct():
    x, w, off = _inputs()
    pre, act = grouped_gemm_sm90(x, w, off, activation="swiglu")
    torch.cuda.synchronize()
    for replaced, error, message in _bad_variants("grouped_gemm_sm90", {"x": x, "weight": w, "offsets": off}):
        args = {"x": x, "weight": w, "offsets": off, **replaced}
        with pytest.raises(error, match=message):
            grouped_gemm_sm90(args["x"], args["weight"], args["offsets"], activation="swiglu")
    pre2, act2 = grouped_gemm_sm90(x, w, off, activation="swiglu")
    torch.cuda.synchronize()
    assert torch.equal(pre, pre2) and torch.equal(act, act2)


def test_forward_preallocated_outputs():
    x, w, off = _inputs()
    pre, act = grouped_gemm_sm90(x, w, off, activation="swiglu")
    pre_buf = torch.full_like(pre, float("nan"))
    act_buf = torch.full_like(act, float("nan"))
    pre2, act2 = grouped_gemm_sm90(x, w, off, activation="swiglu", out=pre_buf, act_out=act_buf)
    assert pre2 is pre_buf and act2 is act_buf
    assert torch.equal(pre, pre2) and torch.equal(act, act2)
    with pytest.raises(ValueError, match="grouped_gemm_sm90: act_out must have shape"):
        grouped_gemm_sm90(x, w, off, activation="swiglu", act_out=pre_buf)
    with pytest.raises(ValueError, match="grouped_gemm_sm90: act_out given but there is no activation"):
        grouped_gemm_sm90(x, w, off, act_out=act_buf)
    with pytest.raises(TypeError, match="grouped_gemm_sm90: act_out has dtype"):
        grouped_gemm_sm90(x, w, off, activation="swiglu", out=pre_buf, act_out=act_buf.half())
    with pytest.raises(ValueError, match="grouped_gemm_sm90: out must be contiguous"):
        grouped_gemm_sm90(x, w, off, activation="swiglu", out=strided(pre_buf), act_out=act_buf)


def test_dgrad_dact_errors_after_a_valid_call():
    torch.manual_seed(4)
    dy = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2, 32, 64, dtype=torch.bfloat16, device="cuda") / 8
    pre = torch.randn(64, 128, dtype=torch.bfloat16, device="cuda")
    off = torch.tensor([0, 40, 64], dtype=torch.int32, device="cuda")
    d_pre, act, _ = grouped_dgrad_dact_sm90(dy, w, off, pre, activation="swiglu")
    torch.cuda.synchronize()
    tensors = {"dy": dy, "weight": w, "offsets": off, "pre": pre}
    for replaced, error, message in _bad_variants("grouped_dgrad_dact_sm90", tensors):
        args = {**tensors, **replaced}
        with pytest.raises(error, match=message):
            grouped_dgrad_dact_sm90(args["dy"], args["weight"], args["offsets"], args["pre"], activation="swiglu")
    d_pre2, act2, _ = grouped_dgrad_dact_sm90(dy, w, off, pre, activation="swiglu")
    assert torch.equal(d_pre, d_pre2) and torch.equal(act, act2)


def test_wgrad_errors_after_a_valid_call():
    torch.manual_seed(5)
    dy = torch.randn(64, 32, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(64, 16, dtype=torch.bfloat16, device="cuda")
    off = torch.tensor([0, 40, 64], dtype=torch.int32, device="cuda")
    dw = grouped_wgrad_sm90(dy, x, off)
    torch.cuda.synchronize()
    tensors = {"dy": dy, "x": x, "offsets": off}
    for replaced, error, message in _bad_variants("grouped_wgrad_sm90", tensors):
        args = {**tensors, **replaced}
        with pytest.raises(error, match=message):
            grouped_wgrad_sm90(args["dy"], args["x"], args["offsets"])
    assert torch.equal(dw, grouped_wgrad_sm90(dy, x, off))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_groups", [1, 5, 32, 33, 1024, 1025, 5000])
def test_split_offsets_kernel_matches_torch(dtype, num_groups):
    torch.manual_seed(num_groups)
    info = torch.iinfo(dtype)
    for rows in (0, 1, 777, 2**20):
        sizes = [
            torch.randint(0, max(1, 2 * rows // num_groups + 2), (num_groups,)),
            torch.randint(-5, 6, (num_groups,)),
            torch.randint(info.min, info.max, (num_groups,), dtype=torch.int64),
            torch.full((num_groups,), info.max, dtype=torch.int64),
        ]
        for s in sizes:
            s = s.to(dtype)
            expected = split_offsets(s, rows)  # CPU: the torch ops
            got = split_offsets(s.cuda(), rows)
            assert got.dtype == torch.int32 and got.shape == (num_groups + 1,)
            assert torch.equal(got.cpu(), expected), (rows, s[:8])
    wide = torch.randint(0, 50, (num_groups, 2), dtype=dtype)
    assert torch.equal(split_offsets(wide[:, 0].cuda(), 10_000).cpu(), split_offsets(wide[:, 0], 10_000))


def test_split_offsets_kernel_in_a_cuda_graph():
    sizes = torch.zeros(64, dtype=torch.int64, device="cuda")
    split_offsets(sizes, 4096)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        offsets = split_offsets(sizes, 4096)
    for seed in range(3):
        new = torch.randint(0, 128, (64,), generator=torch.Generator().manual_seed(seed))
        sizes.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(offsets.cpu(), split_offsets(new, 4096))
