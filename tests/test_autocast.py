"""Autocast: float32 weights, bf16 compute, as nn.Linear; gradients reach the float32 tensors."""

import copy

import pytest
import torch

from te_fused_ops import GroupedLinear, ScaledSwiGLU, Sequential, SwiGLU

G, H, I, ROWS = 4, 32, 16, 40
SPLITS = torch.tensor([9, 0, 14, 11])  # 6 padding rows


def mlp(act, bias):
    torch.manual_seed(0)
    return Sequential(GroupedLinear(G, H, 2 * I, bias=bias), act, GroupedLinear(G, I, H, bias=bias))


def run(seq, x, probs, dy):
    """(y, x.grad, probs.grad or None, parameter grads) of one forward and backward."""
    side = {"split_sizes": SPLITS} if probs is None else {"split_sizes": SPLITS, "probs": probs}
    y = seq(x, **side)
    y.backward(dy)
    return y, x.grad, None if probs is None else probs.grad, [p.grad for p in seq.parameters()]


@pytest.mark.parametrize("act,bias", [(SwiGLU(), False), (ScaledSwiGLU(), True)], ids=["swiglu", "scaled-bias"])
def test_autocast_matches_a_hand_cast_bf16_model(act, bias):
    seq = mlp(act, bias)
    manual = copy.deepcopy(seq).to(torch.bfloat16)
    x = torch.randn(ROWS, H)
    dy = torch.randn(ROWS, H).bfloat16()
    probs = torch.rand(ROWS) if isinstance(act, ScaledSwiGLU) else None

    def leaf(t, dtype=None):
        return None if t is None else t.to(dtype or t.dtype).clone().requires_grad_()

    with torch.autocast("cpu", dtype=torch.bfloat16):
        y, dx, dprobs, dparams = run(seq, leaf(x), leaf(probs), dy)
    y_ref, dx_ref, dprobs_ref, dparams_ref = run(manual, leaf(x, torch.bfloat16), leaf(probs), dy)

    assert y.dtype == torch.bfloat16 and dx.dtype == torch.float32
    assert all(g.dtype == torch.float32 for g in dparams)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=0)
    torch.testing.assert_close(dx, dx_ref.float(), rtol=0, atol=0)
    for got, want in zip(dparams, dparams_ref):
        torch.testing.assert_close(got, want.float(), rtol=0, atol=0)
    if probs is not None:  # router probs stay float32
        assert dprobs.dtype == torch.float32
        torch.testing.assert_close(dprobs, dprobs_ref, rtol=0, atol=0)


def test_explain_under_autocast_plans_for_the_autocast_dtype():
    seq = mlp(SwiGLU(), False)
    x = torch.randn(ROWS, H)
    assert seq.explain(x, split_sizes=SPLITS).startswith("plan for cpu, dtype float32")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert seq.explain(x, split_sizes=SPLITS).startswith("plan for cpu, dtype bfloat16")


def test_autocast_off_inside_and_float64_untouched():
    seq = mlp(SwiGLU(), False).double()
    x = torch.randn(ROWS, H, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = seq(x, split_sizes=SPLITS)
    assert y.dtype == torch.float64  # autocast leaves float64 alone, as for nn.Linear
    torch.testing.assert_close(y, seq(x, split_sizes=SPLITS), rtol=0, atol=0)


def test_a_float64_input_under_autocast_is_refused_by_float32_weights():
    """As nn.Linear: autocast casts neither a float64 x nor, then, the weights, so the dtypes
    differ and the op says so (the weights were cast up to float64 and the call ran)."""
    seq = mlp(SwiGLU(), False)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(TypeError, match="GroupedLinear: .*float64"):
        seq(torch.randn(ROWS, H, dtype=torch.float64), split_sizes=SPLITS)


def test_autocast_under_torch_compile():
    torch._dynamo.reset()
    seq = mlp(ScaledSwiGLU(), True)
    x, probs = torch.randn(ROWS, H), torch.rand(ROWS)

    def step(seq, x, probs):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return seq(x, split_sizes=SPLITS, probs=probs).float().square().sum()

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    results = []
    for fn in (compiled, step):
        leaves = [x.clone().requires_grad_(), probs.clone().requires_grad_()]
        fn(seq, *leaves).backward()
        results.append([*(t.grad for t in leaves), *(p.grad for p in seq.parameters())])
        seq.zero_grad(set_to_none=True)
    for got, want in zip(*results):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want)
