"""The Transformer Engine integration without TE (CPU): window matching, reasons, install /
uninstall, and the fused op's parameter and gradient plumbing, against a stand-in for the parts of
TE 2.20's te.ops API it uses (the real thing is tested in test_te_integration_gpu.py)."""

import types

import pytest
import torch
from torch import nn

import te_fused_ops as tfo
from te_fused_ops.integrations import transformer_engine as tfo_te


class Ctx:
    """TE's OperationContext: save_for_backward sets to_save; the fuser hands it back."""

    def __init__(self, requires_grad=True):
        self.requires_grad, self.to_save, self.saved_tensors = requires_grad, None, None

    def save_for_backward(self, *tensors):
        self.to_save = tensors


class BasicOperation(nn.Module):
    num_extra_inputs = 0
    is_fused_op = False

    def get_input_quantizer(self):
        return None

    def get_grad_output_quantizer(self):
        return None


class FusedOperation(nn.Module):
    is_fused_op = True

    def __init__(self, basic_ops):
        super().__init__()
        self.basic_ops = nn.ModuleList(basic_ops)


class GroupedLinear(BasicOperation):
    """TE's per-group parameters: weight{i} (out, in) views of one packed buffer, then bias{i}."""

    num_extra_inputs = 1

    def __init__(self, groups, in_features, out_features, bias=True, accumulate_into_main_grad=False,
                 delay_wgrad_compute=False):
        super().__init__()
        self.num_groups, self.in_features, self.out_features = groups, in_features, out_features
        self.use_bias, self.single_grouped_weight, self.single_grouped_bias, self._scale_bias = bias, False, False, False
        self._accumulate_into_main_grad = accumulate_into_main_grad
        self.wgrad_store = types.SimpleNamespace(delay_wgrad_compute=lambda: delay_wgrad_compute)
        packed = torch.randn(groups, out_features, in_features) / in_features**0.5
        for i in range(groups):
            self.register_parameter(f"weight{i}", nn.Parameter(packed[i]))
        packed_bias = torch.randn(groups, out_features) if bias else None
        for i in range(groups):
            self.register_parameter(f"bias{i}", nn.Parameter(packed_bias[i]) if bias else None)

    def _get_weight_tensors(self):
        return [getattr(self, f"weight{i}") for i in range(self.num_groups)]

    def _get_packed_bias_tensor(self, dtype):
        return torch.stack([getattr(self, f"bias{i}") for i in range(self.num_groups)]).to(dtype)


class SwiGLU(BasicOperation):
    glu_interleave_size = None


class ScaledSwiGLU(BasicOperation):
    num_extra_inputs, glu_interleave_size = 1, None


class ClampedSwiGLU(BasicOperation):
    def __init__(self, limit=7.0, alpha=1.702, glu_linear_offset=1.0):
        super().__init__()
        self.limit, self.alpha, self.glu_linear_offset, self.glu_interleave_size = limit, alpha, glu_linear_offset, None


class GEGLU(BasicOperation):
    pass


class SReLU(BasicOperation):
    pass


class GELU(BasicOperation):
    pass


class Sequential(nn.Sequential):
    _module_groups = "fused"


class OperationFuser:
    forward_backward_fusion_functions: list = []


def register_forward_backward_fusion(func, prepend=False):
    OperationFuser.forward_backward_fusion_functions.insert(0 if prepend else len(OperationFuser.forward_backward_fusion_functions), func)


def dummy_wgrads(weights):
    for w in weights:
        if hasattr(w, "grad_added_to_main_grad"):
            w.grad_added_to_main_grad = True
    return [torch.zeros(w.shape) for w in weights]


FAKE_TE = (
    types.SimpleNamespace(
        GroupedLinear=GroupedLinear, SwiGLU=SwiGLU, ScaledSwiGLU=ScaledSwiGLU, ClampedSwiGLU=ClampedSwiGLU,
        GEGLU=GEGLU, SReLU=SReLU, BasicOperation=BasicOperation, FusedOperation=FusedOperation,
        Sequential=Sequential, register_forward_backward_fusion=register_forward_backward_fusion,
    ),
    types.SimpleNamespace(
        get_main_grad_from_param=lambda w, op_label=None: w.main_grad,
        get_accumulate_flag_in_param=lambda w: not getattr(w, "overwrite_main_grad", False),
        get_dummy_wgrads_for_params=dummy_wgrads,
    ),
    OperationFuser,
    lambda weight: False,
)


@pytest.fixture(autouse=True)
def fake_te(monkeypatch):
    monkeypatch.setattr(tfo_te, "_te", lambda: FAKE_TE)
    tfo_te._fused_class.cache_clear()
    # on the CPU te_fused_ops' plan runs its torch backend; the window is taken anyway so that
    # the plumbing around the plan runs here
    monkeypatch.setattr(tfo_te, "_plan_reason", lambda ops, dtype, device: None)
    OperationFuser.forward_backward_fusion_functions.clear()
    tfo_te.install()
    yield
    tfo_te._fused_class.cache_clear()


def ops_of(act, bias=True, **kwargs):
    torch.manual_seed(0)
    g, h, i = 3, 8, 4
    fc1_out = i if isinstance(act, SReLU) else 2 * i
    return [GroupedLinear(g, h, fc1_out, bias=bias, **kwargs), act, GroupedLinear(g, i, h, bias=bias, **kwargs)]


def test_windows_and_reasons():
    mlp = ops_of(SwiGLU())
    lone = GroupedLinear(2, 8, 8)
    fused = tfo_te.fuse([*mlp, GELU(), lone], recipe=None)
    assert [type(op).__name__ for op in fused] == ["TEGroupedOps", "GELU", "TEGroupedOps"]
    assert list(fused[0].basic_ops) == mlp and list(fused[2].basic_ops) == [lone]
    # an FP8 recipe: nothing taken, the reason recorded
    assert tfo_te.fuse(mlp, recipe=object()) == mlp
    assert "recipe object: FP8 is not wired to TE yet" in tfo_te.explain(Sequential(*mlp))
    # interleaved GLU: the activation stays TE's, both linears are taken alone
    act = SwiGLU()
    act.glu_interleave_size = 32
    mlp = ops_of(act)
    fused = tfo_te.fuse(mlp, recipe=None)
    assert [type(op).__name__ for op in fused] == ["TEGroupedOps", "SwiGLU", "TEGroupedOps"]
    text = tfo_te.explain(Sequential(*mlp))
    assert "[0:3] GroupedLinear, SwiGLU, GroupedLinear -> TE: SwiGLU(glu_interleave_size=32)" in text, text
    assert "[0] GroupedLinear -> te_fused_ops" in text and "[2] GroupedLinear -> te_fused_ops" in text
    # options the kernels do not have
    assert "glu_linear_offset" in tfo_te._decide(ops_of(ClampedSwiGLU(glu_linear_offset=0.5)), None).reason
    assert "delay_wgrad_compute" in tfo_te._decide(ops_of(SwiGLU(), delay_wgrad_compute=True), None).reason


def test_explain_describes_a_fused_module_as_it_runs():
    mlp = ops_of(SwiGLU())
    seq = Sequential(*mlp)
    seq._module_groups = [types.SimpleNamespace(_forward_ops=[(op, [0]) for op in tfo_te.fuse(mlp, recipe=None)])]
    text = tfo_te.explain(seq)
    assert "[0:3] GroupedLinear, SwiGLU, GroupedLinear -> te_fused_ops" in text and "not run yet" not in text, text
    # fused again without the integration (uninstall(seq), then a forward): TE's ops, whatever was decided before
    seq._module_groups = [types.SimpleNamespace(_forward_ops=[(op, [i]) for i, op in enumerate(mlp)])]
    text = tfo_te.explain(seq)
    want = "-> TE: its own ops (the module fused while te_fused_ops was not installed)"
    assert f"[0:3] GroupedLinear, SwiGLU, GroupedLinear {want}" in text and "-> te_fused_ops" not in text, text
    # a module not run yet: what it would do
    assert "-> te_fused_ops (sm90 kernels, forward + backward) (not run yet)" in tfo_te.explain(Sequential(*ops_of(SwiGLU())))


def test_install_is_idempotent_and_uninstall_refreshes():
    seq = Sequential(*ops_of(SwiGLU()))
    tfo_te.install()
    tfo_te.install()
    assert OperationFuser.forward_backward_fusion_functions == [tfo_te.fuse] and tfo_te.installed()
    tfo_te.uninstall(seq)
    assert not tfo_te.installed() and seq._module_groups is None
    assert tfo_te.explain(seq).startswith("te_fused_ops integration: not installed")


def reference(ops, act_ours, x, splits, probs, dy):
    """te_fused_ops' own Sequential on the same weights: (y, dx, dprobs, grads by TE name)."""
    fc1, _, fc2 = ops
    seq = tfo.Sequential(
        tfo.GroupedLinear(fc1.num_groups, fc1.in_features, fc1.out_features, bias=fc1.use_bias),
        act_ours,
        tfo.GroupedLinear(fc2.num_groups, fc2.in_features, fc2.out_features, bias=fc2.use_bias),
    )
    with torch.no_grad():
        for ours, theirs in ((seq[0], fc1), (seq[2], fc2)):
            ours.weight.copy_(torch.stack(theirs._get_weight_tensors()))
            if theirs.use_bias:
                ours.bias.copy_(theirs._get_packed_bias_tensor(torch.float32))
    x = x.clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    side = {"probs": probs} if isinstance(act_ours, tfo.ScaledSwiGLU) else {}
    y = seq(x, split_sizes=splits, **side)
    y.backward(dy)
    grads = {}
    for k, op in ((0, seq[0]), (2, seq[2])):
        grads[k] = list(op.weight.grad.unbind(0)) + (list(op.bias.grad.unbind(0)) if op.bias is not None else [])
    return y, x.grad, probs.grad if side else None, grads


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act,ours", [(SwiGLU, tfo.SwiGLU), (ScaledSwiGLU, tfo.ScaledSwiGLU), (SReLU, tfo.SReLU)])
def test_fused_op_forward_backward_in_te_conventions(act, ours, bias):
    ops = ops_of(act(), bias=bias)
    (fused,) = tfo_te.fuse(ops, recipe=None)
    splits = torch.tensor([5, 0, 6])
    x, probs, dy = torch.randn(13, 8), torch.rand(13, requires_grad=True), torch.randn(13, 8)
    extra = [(splits,), (probs,) if act is ScaledSwiGLU else (), (splits,)]
    ctxs = [Ctx(), Ctx(), Ctx()]
    y, extra_out = fused.fuser_forward(
        ctxs, x, basic_op_extra_inputs=extra, prev_op_grad_output_quantizer=None,
        next_op_input_quantizer=None, basic_op_kwargs=[{}, {}, {}],
    )
    assert extra_out == [(), (), ()] and ctxs[1].to_save is None
    ctxs[0].saved_tensors = ctxs[0].to_save  # what TE's fuser does between the passes
    dx, grad_params, grad_extra = fused.fuser_backward(ctxs, dy, basic_op_grad_extra_outputs=[(), (), ()])
    y_ref, dx_ref, dprobs_ref, grads_ref = reference(ops, ours(), x, splits, probs, dy)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(dx, dx_ref)
    assert [len(g) for g in grad_params] == [len(list(op.parameters())) for op in ops]
    for k in (0, 2):
        for got, want in zip(grad_params[k], grads_ref[k]):
            torch.testing.assert_close(got, want)
    assert grad_extra[0] == (None,) and grad_extra[2] == (None,)
    assert "stacked" not in tfo_te.explain(Sequential(*ops))  # TE's weights are views of one buffer
    if act is ScaledSwiGLU:
        torch.testing.assert_close(grad_extra[1][0], dprobs_ref)
    else:
        assert grad_extra[1] == ()


def test_main_grad_accumulates_in_place_and_dummy_grads_are_returned():
    ops = ops_of(SwiGLU(), bias=False, accumulate_into_main_grad=True)
    buffers = []
    for fc in (ops[0], ops[2]):
        main = torch.zeros(fc.num_groups, fc.out_features, fc.in_features)
        buffers.append(main)
        for i, w in enumerate(fc._get_weight_tensors()):
            w.main_grad, w.grad_added_to_main_grad = main[i], False
    (fused,) = tfo_te.fuse(ops, recipe=None)
    splits = torch.tensor([4, 4, 5])
    x, dy = torch.randn(13, 8), torch.randn(13, 8)
    for _ in range(2):
        ctxs = [Ctx(), Ctx(), Ctx()]
        fused.fuser_forward(ctxs, x, basic_op_extra_inputs=[(splits,), (), (splits,)], prev_op_grad_output_quantizer=None,
                            next_op_input_quantizer=None, basic_op_kwargs=[{}, {}, {}])
        ctxs[0].saved_tensors = ctxs[0].to_save
        _, grad_params, _ = fused.fuser_backward(ctxs, dy, basic_op_grad_extra_outputs=[(), (), ()])
    _, _, _, grads_ref = reference(ops, tfo.SwiGLU(), x, splits, torch.rand(13), dy)
    for k, main in zip((0, 2), buffers):
        torch.testing.assert_close(main, 2 * torch.stack(grads_ref[k]))
        assert all(w.grad_added_to_main_grad for w in ops[k]._get_weight_tensors())
        assert all(torch.count_nonzero(g) == 0 for g in grad_params[k])  # TE's dummy gradients


def test_runtime_fallback_runs_te_ops_and_is_explained():
    ops = ops_of(SwiGLU())
    calls = []
    for op in ops:
        def forward(ctxs, x, op=op, **kwargs):
            calls.append(type(op).__name__)
            return x, [()]
        op.fuser_forward = forward
    (fused,) = tfo_te.fuse(ops, recipe=None)
    splits = torch.tensor([5, 0, 8])
    fused.fuser_forward([Ctx(), Ctx(), Ctx()], torch.randn(13, 8), basic_op_extra_inputs=[(splits,), (), (splits.clone(),)],
                        prev_op_grad_output_quantizer=None, next_op_input_quantizer=None, basic_op_kwargs=[{}, {}, {}])
    assert calls == ["GroupedLinear", "SwiGLU", "GroupedLinear"]
    assert "the latest call ran TE's ops: FC1 and FC2 got different split_sizes tensors" in tfo_te.explain(Sequential(*ops))


def test_weights_not_in_one_buffer_are_stacked_and_explained():
    ops = ops_of(SwiGLU(), bias=False)
    with torch.no_grad():  # what copy.deepcopy does to TE's parameters: one storage each
        for i, w in enumerate(ops[0]._get_weight_tensors()):
            setattr(ops[0], f"weight{i}", nn.Parameter(w.clone()))
    (fused,) = tfo_te.fuse(ops, recipe=None)
    splits = torch.tensor([4, 4, 5])
    x, dy = torch.randn(13, 8), torch.randn(13, 8)
    ctxs = [Ctx(), Ctx(), Ctx()]
    y, _ = fused.fuser_forward(ctxs, x, basic_op_extra_inputs=[(splits,), (), (splits,)], prev_op_grad_output_quantizer=None,
                               next_op_input_quantizer=None, basic_op_kwargs=[{}, {}, {}])
    torch.testing.assert_close(y, reference(ops, tfo.SwiGLU(), x, splits, torch.rand(13), dy)[0])
    assert "stacked the per-group weights" in tfo_te.explain(Sequential(*ops))


def test_weight_view_follows_updates_and_replaced_parameters():
    """The per-step weight view is memoized; in-place updates (optimizer steps) reach it, and a
    replaced parameter (`.data` swap, a new Parameter) makes the next step re-check and stack."""
    ops = ops_of(SwiGLU(), bias=False)
    (fused,) = tfo_te.fuse(ops, recipe=None)
    splits = torch.tensor([4, 4, 5])
    x, dy = torch.randn(13, 8), torch.randn(13, 8)

    def check():
        y, _ = fused.fuser_forward([Ctx(), Ctx(), Ctx()], x, basic_op_extra_inputs=[(splits,), (), (splits,)],
                                   prev_op_grad_output_quantizer=None, next_op_input_quantizer=None,
                                   basic_op_kwargs=[{}, {}, {}])
        torch.testing.assert_close(y, reference(ops, tfo.SwiGLU(), x, splits, torch.rand(13), dy)[0])
        return tfo_te.explain(Sequential(*ops))

    assert "stacked" not in check()
    assert "stacked" not in check()  # memo hit
    with torch.no_grad():
        ops[0].weight1.mul_(-2.0)  # in place, as an optimizer step
    assert "stacked" not in check()
    ops[2].weight2.data = torch.randn(8, 4)  # off the packed buffer
    assert "stacked the per-group weights" in check()
    with torch.no_grad():
        ops[2].weight2.add_(1.0)
    check()
