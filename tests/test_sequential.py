"""Sequential behaves like torch.nn.Sequential; side inputs; padding and clamping contracts."""

import numpy as np
import pytest
import torch

import reference as ref
from te_fused_ops import GroupedLinear, Quantize, Sequential, SReLU, SwiGLU, Transpose, validation


def mlp(**kw):
    return Sequential(GroupedLinear(3, 16, 32, bias=True, **kw), SwiGLU(), GroupedLinear(3, 16, 16, **kw))


def test_nn_module_conventions():
    seq = mlp()
    assert len(seq) == 3 and isinstance(seq[0], GroupedLinear) and isinstance(seq[1], SwiGLU)
    assert [type(op) for op in seq] == [GroupedLinear, SwiGLU, GroupedLinear]
    assert len(seq[0:2]) == 2
    assert [name for name, _ in seq.named_parameters()] == ["0.weight", "0.bias", "2.weight"]
    assert sum(p.numel() for p in seq.parameters()) == 3 * 32 * 16 + 3 * 32 + 3 * 16 * 16
    seq.eval()
    assert not seq.training and not seq[0].training
    seq.train()
    assert seq[2].training
    seq.to(torch.float64)
    assert seq[0].weight.dtype == torch.float64
    seq.append(SReLU())
    assert len(seq) == 4


def test_state_dict_round_trip_keeps_natural_layout():
    torch.manual_seed(0)
    a, b = mlp(), mlp()
    state = a.state_dict()
    assert set(state) == {"0.weight", "0.bias", "2.weight"}
    assert state["0.weight"].shape == (3, 32, 16)
    b.load_state_dict(state)
    x, s = torch.randn(10, 16), torch.tensor([4, 0, 6])
    assert torch.equal(a(x, split_sizes=s), b(x, split_sizes=s))
    # natural [gate; up] layout: the first half of output features is the gate
    gate_only = Sequential(GroupedLinear(3, 16, 32, bias=True))
    gate_only.load_state_dict({"0.weight": state["0.weight"], "0.bias": state["0.bias"]})
    pre = gate_only(x, split_sizes=s)
    assert torch.allclose(a[1](pre), ref.swiglu(pre.double()).float(), atol=1e-6)


def test_op_called_alone_and_in_sequence_agree():
    torch.manual_seed(1)
    seq = mlp()
    x, s = torch.randn(9, 16), torch.tensor([2, 3, 4])
    by_hand = seq[2](seq[1](seq[0](x, split_sizes=s)), split_sizes=s)
    assert torch.allclose(seq(x, split_sizes=s), by_hand, atol=1e-6)


def test_cpu_split_values_are_checked_by_default():
    seq = mlp(dtype=torch.float64)
    x = torch.randn(10, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"GroupedLinear: argument 'split_sizes' has negative entries: \[6, -3, 1\]"):
        seq(x, split_sizes=torch.tensor([6, -3, 1]))
    with pytest.raises(ValueError, match=r"GroupedLinear: argument 'split_sizes' sums to 11 but the input has 10 rows"):
        seq(x, split_sizes=torch.tensor([6, 4, 1]))
    assert torch.all(seq(x, split_sizes=torch.tensor([2, 3, 1]))[6:] == 0)  # a smaller sum: padding rows


def test_out_of_range_split_values_are_clamped_without_validation():
    torch.manual_seed(2)
    seq = mlp(dtype=torch.float64)
    x = torch.randn(10, 16, dtype=torch.float64, requires_grad=True)
    with validation(False):  # what a GPU run does without validation: clamp on the device
        y = seq(x, split_sizes=torch.tensor([6, -3, 9]))  # negative, and sum larger than rows
    effective = [6, 0, 4]
    w1, b1, w2 = (p.detach() for p in seq.parameters())
    expected = ref.grouped_linear(ref.swiglu(ref.grouped_linear(x.detach(), w1, b1, effective)), w2, None, effective)
    assert ref.rel_err(y, expected) <= 1e-12
    y.sum().backward()
    assert torch.isfinite(x.grad).all()


def test_no_grad_path_and_eval():
    seq = mlp()
    with torch.no_grad():
        y = seq(torch.randn(5, 16), split_sizes=torch.tensor([1, 1, 1]))
    assert y.grad_fn is None and torch.all(y[3:] == 0)


def test_transpose_plain_tensor_contents():
    x = torch.randn(7, 5)
    y = Transpose()(x, split_sizes=torch.tensor([3, 4]))
    assert torch.equal(y, x)
    assert torch.equal(y.te_columnwise, x.t()) and y.te_columnwise.is_contiguous()


def test_validation_mode_context_and_env(monkeypatch):
    seq = mlp()
    x = torch.randn(10, 16)
    with validation():
        seq(x, split_sizes=torch.tensor([3, 3, 4]))
        with pytest.raises(ValueError, match="GroupedLinear: argument 'split_sizes' has negative entries"):
            seq(x, split_sizes=torch.tensor([3, -1, 4]))
        with pytest.raises(ValueError, match="GroupedLinear: argument 'split_sizes' sums to 11 but the input has 10 rows"):
            seq(x, split_sizes=torch.tensor([3, 4, 4]))
    monkeypatch.setenv("TE_FUSED_OPS_VALIDATE", "1")
    with pytest.raises(ValueError, match="sums to 11"):
        seq(x, split_sizes=torch.tensor([3, 4, 4]))


@pytest.mark.parametrize("fc2_input_cast", [False, True])
@pytest.mark.parametrize("fuse", [True, False])
def test_frozen_first_linear_of_an_fp8_chain_with_an_input_needing_no_gradient(fuse, fc2_input_cast):
    """Quantize, FC1 (frozen), SwiGLU, [Quantize, Transpose,] FC2 on an input that needs no
    gradient: only FC2's backward runs (the ops before it get no dy to quantize, and no backward
    rule takes FC1 or the activation with FC2), and FC2's weight gradient is the one of the same
    chain whose FC1 trains."""
    grads = {}
    for frozen in (True, False):
        torch.manual_seed(3)
        casts = [Quantize("fp8_blockwise"), Transpose()] if fc2_input_cast else []
        chain = Sequential(Quantize("fp8_blockwise"), GroupedLinear(2, 128, 256), SwiGLU(), *casts,
                           GroupedLinear(2, 128, 128), fuse=fuse)
        chain[1].weight.requires_grad_(not frozen)
        x, split_sizes = torch.randn(16, 128), torch.tensor([8, 8])
        chain(x, split_sizes=split_sizes).sum().backward()
        grads[frozen] = (chain[1].weight.grad, chain[-1].weight.grad)
        if frozen:
            backward = chain.explain(x, split_sizes=split_sizes).split("backward:")[1]
            assert "[1] GroupedLinear -> basic op (backend torch); not run: no gradient needed" in backward
    assert grads[True][0] is None and grads[False][0] is not None
    assert torch.equal(grads[True][1], grads[False][1])


def test_repr_names_every_option():
    assert repr(GroupedLinear(2, 4, 6, recompute_output=True, accumulate_main_grad=True)) == (
        "GroupedLinear(num_groups=2, in_features=4, out_features=6, bias=False, recompute_output=True, "
        "accumulate_main_grad=True)")


def test_a_called_layer_pickles_without_its_plans():
    """torch.save of a whole module after a call: the plan cache (rules and their checks, of this
    process's registry) stays behind, and the loaded copy plans again and computes the same."""
    import io

    from te_fused_ops import Permute, Unpermute

    torch.manual_seed(2)
    layer = Sequential(Permute(4), GroupedLinear(4, 16, 16), SwiGLU(), GroupedLinear(4, 8, 16), Unpermute())
    x, indices, probs = torch.randn(8, 16), torch.randint(0, 4, (8, 2)), torch.rand(8, 2)
    y = layer(x, indices=indices, probs=probs)
    buffer = io.BytesIO()
    torch.save(layer, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert loaded._plans == {} and torch.equal(loaded(x, indices=indices, probs=probs), y)


def test_a_deepcopy_of_a_parametrized_op_is_an_owner_of_its_own():
    """torch.nn.utils.parametrize gives the op a class whose deepcopy copies __dict__ directly
    (skipping __getstate__) unless the class defines __deepcopy__: the copy must still get its own
    id, by which torch.compile finds the module it runs, and no plans of the original."""
    import copy

    from torch.nn.utils import parametrize

    from te_fused_ops.context import registered_owner

    class Scaled(torch.nn.Module):
        def forward(self, weight):
            return 2 * weight

    torch.manual_seed(3)
    op = GroupedLinear(2, 8, 8)
    parametrize.register_parametrization(op, "weight", Scaled())
    x, splits = torch.randn(6, 8), torch.tensor([2, 4])
    y = op(x, split_sizes=splits)
    replica = copy.deepcopy(op)
    assert replica._owner_id != op._owner_id and registered_owner(replica._owner_id) is replica
    assert replica._plans == {} and op._plans
    with torch.no_grad():
        replica.parametrizations.weight.original.mul_(0.5)
    assert torch.equal(op(x, split_sizes=splits), y)
    torch.testing.assert_close(replica(x, split_sizes=splits), y / 2)


def test_a_deepcopy_of_an_expert_parallel_layer_shares_its_process_group(tmp_path):
    """An EMA copy of a layer with ``group=``: a process group cannot be copied (nor pickled), so
    the copy routes over the same group, with parameters of its own."""
    import copy

    import torch.distributed as dist

    from te_fused_ops import Permute, Unpermute

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(4)
        layer = Sequential(Permute(4, group=dist.group.WORLD, capacity_factor=2.0), GroupedLinear(4, 16, 16),
                           Unpermute(group=dist.group.WORLD))
        x, indices, probs = torch.randn(8, 16), torch.randint(0, 4, (8, 2)), torch.rand(8, 2)
        y = layer(x, indices=indices, probs=probs)
        replica = copy.deepcopy(layer)
        assert replica[0].group is layer[0].group and replica[2].group is layer[2].group
        assert replica[1].weight is not layer[1].weight
        assert torch.equal(replica(x, indices=indices, probs=probs), y)
    finally:
        dist.destroy_process_group()


def test_explain_plans_a_meta_module():
    """Planning reads only metadata: a module built on the meta device explains its plan."""
    with torch.device("meta"):
        layer = Sequential(GroupedLinear(4, 16, 32), SwiGLU(), GroupedLinear(4, 16, 16))
    text = layer.explain(torch.randn(30, 16, device="meta"), split_sizes=torch.tensor([5, 5, 10, 10], device="meta"))
    assert text.startswith("plan for meta, dtype float32\nforward:")


def test_side_input_errors_are_op_value_errors():
    """A missing, unknown or self-produced side input is bad input like a wrong shape: an
    OpValueError (so also a ValueError) naming the op or the sequence."""
    from te_fused_ops import OpValueError, Permute, Unpermute

    with pytest.raises(OpValueError, match=r"GroupedLinear \(op 0\): missing side input 'split_sizes'"):
        GroupedLinear(4, 16, 8)(torch.randn(20, 16))
    with pytest.raises(OpValueError, match=r"side input\(s\) 'foo' not consumed by any op"):
        mlp()(torch.randn(6, 16), split_sizes=torch.tensor([2, 2, 2]), foo=1)
    layer = Sequential(Permute(2), GroupedLinear(2, 4, 4), Unpermute())
    with pytest.raises(OpValueError, match=r"side input 'routing' is produced by Permute in this sequence"):
        layer(torch.randn(3, 4), indices=torch.zeros(3, 1, dtype=torch.long), probs=torch.ones(3, 1), routing=None)


def test_slices_keep_names_and_the_container_refuses_in_place_edits():
    """A slice keeps the parent's names (its state_dict loads from the parent's, as with
    torch.nn.Sequential); append and extend continue after the last name; inserting, removing or
    replacing an op is refused naming Sequential; ``fuse`` must be a bool."""
    from te_fused_ops import OpValueError, Permute, Unpermute

    layer = Sequential(Permute(4), GroupedLinear(4, 16, 32), SwiGLU(), GroupedLinear(4, 16, 16), Unpermute())
    experts = layer[1:4]
    assert list(experts.state_dict()) == ["1.weight", "3.weight"]
    experts.load_state_dict({k: v for k, v in layer.state_dict().items()}, strict=True)
    experts.extend([Unpermute()])
    assert list(experts._modules) == ["1", "2", "3", "4"] and experts[1] is layer[2]
    for edit in (lambda: experts.insert(0, SwiGLU()), lambda: experts.pop(), lambda: experts.__delitem__(0),
                 lambda: experts.__setitem__(0, SwiGLU())):
        with pytest.raises(TypeError, match="Sequential: ops are appended, never inserted, removed or replaced"):
            edit()
    with pytest.raises(IndexError, match="Sequential: index 5 out of range for 5 ops"):
        layer[5]
    with pytest.raises(TypeError, match="Sequential: argument 'fuse' must be a bool, got 'no'"):
        Sequential(SwiGLU(), fuse="no")
    assert Sequential(SwiGLU(), fuse=np.bool_(False)).fuse is False
    with pytest.raises(OpValueError, match=r"side input\(s\) 'foo' not consumed"):
        mlp().explain(torch.randn(6, 16), split_sizes=torch.tensor([2, 2, 2]), foo=1)
    with pytest.raises(OpValueError, match=r"GroupedLinear \(op 0\): missing side input 'split_sizes'"):
        mlp().plan(torch.randn(6, 16))


def test_append_after_a_named_op_takes_the_next_number():
    seq = Sequential(GroupedLinear(2, 8, 16), SwiGLU())
    seq.add_module("extra", GroupedLinear(2, 8, 8))
    seq.append(SwiGLU())
    assert list(seq._modules) == ["0", "1", "extra", "2"]
