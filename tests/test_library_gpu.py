"""GPU contracts of the library paths: no host sync, CUDA-graph capture, sm90 wiring."""

import pytest
import torch

import reference as ref
from te_fused_ops import GroupedLinear, Quantize, ScaledSwiGLU, Sequential, SwiGLU, Transpose

pytestmark = pytest.mark.gpu

G, H, I, ROWS = 8, 256, 128, 1024


def routing(seed: int, rows_used: int) -> torch.Tensor:
    """Uneven split sizes summing to rows_used, with empty groups, on the GPU."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.rand(G, generator=gen) ** 3
    weights[seed % G] = 0
    sizes = (weights / weights.sum() * rows_used).floor().to(torch.int64)
    sizes[(seed + 1) % G] += rows_used - sizes.sum()
    return sizes.cuda()


def mlp(act=None, fuse=True):
    torch.manual_seed(0)
    return Sequential(
        GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16, device="cuda"),
        act or SwiGLU(),
        GroupedLinear(G, I, H, dtype=torch.bfloat16, device="cuda"),
        fuse=fuse,
    )


def train_step(seq, x, dy, **side):
    y = seq(x, **side)
    y.backward(dy)
    return y


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_no_host_sync_forward_backward(fuse, backend, monkeypatch):
    if backend == "torch":
        monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    seq = mlp(ScaledSwiGLU(), fuse=fuse)
    x = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    probs = torch.rand(ROWS, device="cuda", requires_grad=True)
    dy = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16)
    split_sizes = routing(1, ROWS - 100)
    train_step(seq, x, dy, split_sizes=split_sizes, probs=probs)  # warm-up: compiles, caches
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = train_step(seq, x, dy, split_sizes=split_sizes, probs=probs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.all(y[ROWS - 100 :] == 0)


def test_no_host_sync_fp8_chain():
    torch.manual_seed(0)
    seq = Sequential(
        GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16, device="cuda"),
        SwiGLU(),
        Quantize("fp8_blockwise"),
        Transpose(),
        GroupedLinear(G, I, H, dtype=torch.bfloat16, device="cuda"),
    )
    x = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16)
    split_sizes = routing(2, ROWS)
    train_step(seq, x, dy, split_sizes=split_sizes)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step(seq, x, dy, split_sizes=split_sizes)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_cuda_graph_whole_step_replays_with_new_routing():
    seq = mlp()
    static_x = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    static_dy = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16)
    static_splits = routing(3, ROWS - 64)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            train_step(seq, static_x, static_dy, split_sizes=static_splits)
    torch.cuda.current_stream().wait_stream(side)
    for p in [static_x, *seq.parameters()]:
        p.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y = train_step(seq, static_x, static_dy, split_sizes=static_splits)
    for seed in (4, 5, 6):
        new_splits = routing(seed, ROWS - 8 * seed)
        static_splits.copy_(new_splits)
        graph.replay()
        torch.cuda.synchronize()
        got = [static_y.clone(), static_x.grad.clone(), *[p.grad.clone() for p in seq.parameters()]]
        x = static_x.detach().clone().requires_grad_(True)
        eager = mlp()
        eager.load_state_dict(seq.state_dict())
        y = train_step(eager, x, static_dy, split_sizes=new_splits.clone())
        want = [y, x.grad, *[p.grad for p in eager.parameters()]]
        for a, b in zip(got, want):
            assert ref.rel_err(a, b) <= 1e-2
        assert torch.all(got[0][ROWS - 8 * seed :] == 0)


def test_sm90_backend_is_selected_and_matches_torch(monkeypatch):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 backend needs a Hopper GPU")
    seq = mlp(ScaledSwiGLU())
    x = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(ROWS, device="cuda")
    split_sizes = routing(7, ROWS - 32)
    text = seq.explain(x, split_sizes=split_sizes, probs=probs)
    assert "rule 'grouped_linear+activation' (backend sm90)" in text, text
    assert "rule 'grouped_linear' (backend sm90)" in text, text
    y_sm90 = seq(x, split_sizes=split_sizes, probs=probs)
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    y_torch = seq(x, split_sizes=split_sizes, probs=probs)
    assert ref.rel_err(y_sm90, y_torch) <= 1e-2
    assert torch.all(y_sm90[ROWS - 32 :] == 0)


def test_sm90_weight_repack_follows_weight_updates():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 backend needs a Hopper GPU")
    seq = mlp()
    x = torch.randn(ROWS, H, device="cuda", dtype=torch.bfloat16)
    split_sizes = routing(8, ROWS)
    first = seq(x, split_sizes=split_sizes)
    with torch.no_grad():
        seq[0].weight.mul_(-1)  # in-place update, as an optimizer step
    second = seq(x, split_sizes=split_sizes)
    assert not torch.allclose(first, second)
    reference = Sequential(*list(seq), fuse=False)
    assert ref.rel_err(second, reference(x, split_sizes=split_sizes)) <= 1e-2
    assert set(seq.state_dict()) == {"0.weight", "2.weight"}
    assert seq.state_dict()["0.weight"].data_ptr() == seq[0].weight.data_ptr()
