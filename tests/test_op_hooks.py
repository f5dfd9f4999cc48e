"""Module forward hooks registered on the ops of a Sequential run (the Sequential never calls
``op.__call__``): once per call, on the sequence's input and output, with ``with_kwargs``,
``always_call`` and hooks that replace arguments or outputs handled as ``nn.Module.__call__`` does."""

import pytest
import torch

import reference as ref
from te_fused_ops import GroupedLinear, ScaledSwiGLU, Sequential, SwiGLU

G, H, I, ROWS = 4, 16, 8, 24
SPLITS = torch.tensor([5, 0, 11, 6])


def make(seed=0):
    torch.manual_seed(seed)
    return Sequential(GroupedLinear(G, H, 2 * I, bias=True), SwiGLU(), GroupedLinear(G, I, H))


def test_forward_hook_fires_once_per_call_on_sequence_output():
    seq, x = make(), torch.randn(ROWS, H)
    seen = []
    handle = seq[2].register_forward_hook(lambda op, args, out: seen.append((op, args[0], out)))
    for _ in range(3):
        y = seq(x, split_sizes=SPLITS)
    assert len(seen) == 3 and all(op is seq[2] and a is x for op, a, _ in seen) and seen[-1][2] is y
    handle.remove()
    seq(x, split_sizes=SPLITS)
    assert len(seen) == 3


def test_pre_hooks_replace_input_and_side_inputs_in_op_order():
    seq, x = make(), torch.randn(ROWS, H)
    want = seq(2 * x, split_sizes=torch.tensor([ROWS, 0, 0, 0]))
    order = []

    def double(op, args):
        order.append("double")
        return 2 * args[0]  # a bare value stands for a 1-tuple, as in nn.Module

    def route_all_to_group_0(op, args, kwargs):
        order.append(("route", args[0] is not x, sorted(kwargs)))
        return args, {"split_sizes": torch.tensor([ROWS, 0, 0, 0])}

    seq[0].register_forward_pre_hook(double)
    seq[2].register_forward_pre_hook(route_all_to_group_0, with_kwargs=True)
    assert torch.equal(seq(x, split_sizes=SPLITS), want)
    assert order == ["double", ("route", True, ["split_sizes"])]


def test_forward_hooks_replace_output_and_see_kwargs():
    seq = Sequential(GroupedLinear(G, H, 2 * I), ScaledSwiGLU(), GroupedLinear(G, I, H))
    x, probs = torch.randn(ROWS, H, requires_grad=True), torch.rand(ROWS, requires_grad=True)
    plain = seq(x, split_sizes=SPLITS, probs=probs)
    got = {}

    def scale(op, args, kwargs, out):
        got["kwargs"] = sorted(kwargs)
        return 3 * out

    seq[1].register_forward_hook(scale, with_kwargs=True)
    seq[2].register_forward_hook(lambda op, args, out: out + 1)
    y = seq(x, split_sizes=SPLITS, probs=probs)
    assert got["kwargs"] == ["probs"]  # the side inputs that op consumes
    assert ref.rel_err(y, 3 * plain + 1) <= 1e-6
    y.sum().backward()  # gradients flow through the hooks' outputs
    assert x.grad is not None and probs.grad is not None


def test_always_call_hooks_run_after_an_error():
    seq = make()
    calls = []
    seq[0].register_forward_hook(lambda op, args, out: calls.append(out), always_call=True)
    seq[2].register_forward_hook(lambda op, args, out: calls.append("plain"))
    with pytest.raises(ValueError):
        seq(torch.randn(ROWS, H + 1), split_sizes=SPLITS)
    assert calls == [None]


def test_pre_hook_changing_arity_is_an_error():
    seq = make()
    seq[0].register_forward_pre_hook(lambda op, args: (args[0], args[0]))
    with pytest.raises(TypeError, match=r"GroupedLinear \(op 0\).*2 positional"):
        seq(torch.randn(ROWS, H), split_sizes=SPLITS)


def test_op_placed_twice_runs_its_hooks_once():
    lin = GroupedLinear(G, H, H)
    seq = Sequential(lin, lin)
    calls = []
    lin.register_forward_pre_hook(lambda op, args: calls.append("pre"))
    lin.register_forward_hook(lambda op, args, out: calls.append("post"))
    seq(torch.randn(ROWS, H), split_sizes=SPLITS)
    assert calls == ["pre", "post"]
