"""GroupedLinear(recompute_output=True): the consumer's backward reruns the GEMM instead of keeping
its output. Same results bit for bit, less saved, and a clear error where it does not apply."""

import pytest
import torch

from te_fused_ops import GroupedLinear, Quantize, ScaledSwiGLU, Sequential, SwiGLU

G, H, I, ROWS = 4, 64, 32, 100
SPLITS = torch.tensor([30, 0, 50, 10])  # 10 padding rows


def mlp(recompute: bool, fuse: bool, act=SwiGLU):
    torch.manual_seed(0)
    return Sequential(
        GroupedLinear(G, H, 2 * I, bias=True, recompute_output=recompute), act(), GroupedLinear(G, I, H), fuse=fuse
    )


def step_with_saved_bytes(seq, x, dy, **side):
    """(output and gradients, bytes of the tensors autograd saved)."""
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    leaves = (x, *side.values(), *seq.parameters())
    for t in leaves:
        t.grad = None
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = seq(x, split_sizes=SPLITS, **side)
    y.backward(dy)
    return [y.detach(), *[t.grad for t in leaves]], sum(saved)


@pytest.mark.parametrize("fuse", [True, False])
@pytest.mark.parametrize("act", [SwiGLU, ScaledSwiGLU])
def test_same_results_less_saved(fuse, act):
    x = torch.randn(ROWS, H, requires_grad=True)
    dy = torch.randn(ROWS, H)
    side = {"probs": torch.rand(ROWS, requires_grad=True)} if act is ScaledSwiGLU else {}
    kept, kept_bytes = step_with_saved_bytes(mlp(False, fuse, act), x, dy, **side)
    recomputed, recomputed_bytes = step_with_saved_bytes(mlp(True, fuse, act), x, dy, **side)
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)
    pre_bytes = ROWS * 2 * I * 4
    bias_bytes = G * 2 * I * 4  # the recompute keeps FC1's bias, which its gradient alone does not need
    assert recomputed_bytes == kept_bytes - pre_bytes + bias_bytes, (kept_bytes, recomputed_bytes)


def test_quantized_input_is_refused():
    seq = Sequential(Quantize("fp8_blockwise"), GroupedLinear(G, H, 2 * I, recompute_output=True), SwiGLU())
    with pytest.raises(ValueError, match="recompute_output=True takes a bf16/fp16 input"):
        seq(torch.randn(ROWS, H), split_sizes=SPLITS)


def test_repr_names_it():
    assert "recompute_output=True" in repr(GroupedLinear(G, H, I, recompute_output=True))
    assert "recompute_output" not in repr(GroupedLinear(G, H, I))
