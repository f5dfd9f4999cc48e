"""Bad input raises ValueError/TypeError naming the op and the argument."""

import pytest
import torch

from te_fused_ops import (
    ClampedSwiGLU, FusionRule, GroupedLinear, Permute, Quantize, ScaledSwiGLU, Sequential, SwiGLU, TopKRouter, Unpermute,
    register_rule,
)
from te_fused_ops.quantization import quantize


def seq():
    return Sequential(GroupedLinear(3, 8, 16), SwiGLU(), GroupedLinear(3, 8, 8))


X = torch.randn(6, 8)
S = torch.tensor([1, 2, 3])


@pytest.mark.parametrize(
    "split_sizes, error, match",
    [
        (torch.tensor([1.0, 2.0, 3.0]), TypeError, r"GroupedLinear: argument 'split_sizes' must have dtype int32 or int64"),
        (torch.tensor([1, 2, 3, 0]), ValueError, r"GroupedLinear: argument 'split_sizes' must have shape \(3,\)"),
        (torch.tensor([[1, 2, 3]]), ValueError, r"GroupedLinear: argument 'split_sizes' must have shape \(3,\)"),
        ([1, 2, 3], TypeError, r"GroupedLinear: argument 'split_sizes' must be a torch.Tensor"),
        (torch.tensor([1, 2, 3], device="meta"), ValueError, r"GroupedLinear: argument 'split_sizes' is on meta"),
    ],
)
def test_bad_split_sizes(split_sizes, error, match):
    with pytest.raises(error, match=match):
        seq()(X, split_sizes=split_sizes)


def test_missing_and_unknown_side_inputs():
    with pytest.raises(ValueError, match=r"GroupedLinear \(op 0\): missing side input 'split_sizes'"):
        seq()(X)
    with pytest.raises(ValueError, match=r"ScaledSwiGLU \(op 0\): missing side input 'probs'"):
        ScaledSwiGLU()(torch.randn(4, 8))
    with pytest.raises(ValueError, match=r"Sequential: side input\(s\) 'probs' not consumed"):
        seq()(X, split_sizes=S, probs=torch.rand(6))


def test_in_features_mismatch():
    with pytest.raises(ValueError, match=r"GroupedLinear: argument 'x' must have shape \(tokens, 8\) \(in_features\)"):
        seq()(torch.randn(6, 9), split_sizes=S)
    with pytest.raises(ValueError, match=r"GroupedLinear: argument 'x' must be 2-D"):
        seq()(torch.randn(6, 8, 1), split_sizes=S)


def test_dtype_mismatch():
    with pytest.raises(TypeError, match=r"GroupedLinear: argument 'x' has dtype torch.float64 but the weight has torch.float32"):
        seq()(X.double(), split_sizes=S)


def test_odd_glu_dimension():
    with pytest.raises(ValueError, match=r"SwiGLU: argument 'x' last dimension 7 is odd"):
        SwiGLU()(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"SwiGLU: argument 'x' last dimension 15 is odd"):
        Sequential(GroupedLinear(3, 8, 15), SwiGLU())(X, split_sizes=S)


def test_bad_probs():
    op = ScaledSwiGLU()
    with pytest.raises(ValueError, match=r"ScaledSwiGLU: argument 'probs' must have shape \(4,\)"):
        op(torch.randn(4, 8), probs=torch.rand(5))
    with pytest.raises(TypeError, match=r"ScaledSwiGLU: argument 'probs' must be floating point"):
        op(torch.randn(4, 8), probs=torch.ones(4, dtype=torch.int32))


def test_quantize_errors():
    with pytest.raises(TypeError, match=r"Quantize: argument 'x' has dtype torch.int32"):
        Quantize("fp8_blockwise")(torch.ones(4, 128, dtype=torch.int32))
    with pytest.raises(TypeError, match=r"Quantize: argument 'x' has dtype torch.int32"):
        quantize(torch.ones(4, 128, dtype=torch.int32), "fp8_current")
    with pytest.raises(ValueError, match=r"Quantize: unknown recipe 'fp4'.*argument 'recipe'"):
        Quantize("fp4")
    with pytest.raises(TypeError, match=r"argument 'recipe'"):
        Quantize(3)


def test_grouped_linear_constructor():
    with pytest.raises(ValueError, match=r"GroupedLinear: argument 'in_features' must be a positive int"):
        GroupedLinear(2, 0, 4)
    with pytest.raises(ValueError, match=r"GroupedLinear: argument 'num_groups' must be a positive int"):
        GroupedLinear(-1, 4, 4)


@pytest.mark.parametrize("kwargs, match", [
    (dict(k=0), "'k' must be a positive int"),
    (dict(score="relu"), "'score' must be one of"),
    (dict(num_groups=3), "'num_groups' \\(3\\) must divide num_experts"),
    (dict(k=5, num_groups=4, group_topk=2), "'k' \\(5\\) exceeds the experts of the chosen groups"),
    (dict(aux_loss_coeff=-1.0), "'aux_loss_coeff' must be >= 0 and finite"),
    (dict(aux_loss_coeff=float("inf")), "'aux_loss_coeff' must be >= 0 and finite"),
    (dict(scale=0.0), "'scale' must be positive and finite"),
    (dict(scale=float("nan")), "'scale' must be positive and finite"),
])
def test_top_k_router_constructor(kwargs, match):
    args = dict(hidden=8, num_experts=8, k=2) | kwargs
    with pytest.raises(ValueError, match="TopKRouter: argument " + match):
        TopKRouter(**args)


@pytest.mark.parametrize("make, match", [
    (lambda: ClampedSwiGLU(limit="7"), r"ClampedSwiGLU: argument 'limit' must be a real number"),
    (lambda: ClampedSwiGLU(alpha=None), r"ClampedSwiGLU: argument 'alpha' must be a real number"),
    (lambda: Permute(4, capacity_factor="1.0"), r"Permute: argument 'capacity_factor' must be a real number"),
    (lambda: TopKRouter(8, 8, 2, aux_loss_coeff="x"), r"TopKRouter: argument 'aux_loss_coeff' must be a real number"),
    (lambda: TopKRouter(8, 8, 2, scale="2"), r"TopKRouter: argument 'scale' must be a real number"),
    (lambda: TopKRouter(8, 8, 2, normalize="false"), r"TopKRouter: argument 'normalize' must be a bool, got 'false'"),
    (lambda: TopKRouter(8, 8, 2, float32_logits=1), r"TopKRouter: argument 'float32_logits' must be a bool"),
    (lambda: TopKRouter(8, 8, 2, expert_bias="no"), r"TopKRouter: argument 'expert_bias' must be a bool"),
    (lambda: GroupedLinear(4, 8, 8, bias="False"), r"GroupedLinear: argument 'bias' must be a bool"),
    (lambda: GroupedLinear(4, 8, 8, accumulate_main_grad=0), r"GroupedLinear: argument 'accumulate_main_grad'"),
    (lambda: GroupedLinear(4, 8, 8, recompute_output=None), r"GroupedLinear: argument 'recompute_output'"),
    (lambda: TopKRouter(8, 8, 2, dtype=torch.int64), r"TopKRouter: argument 'dtype' must be a floating torch.dtype"),
    (lambda: GroupedLinear(4, 8, 8, dtype=torch.int32), r"GroupedLinear: argument 'dtype' must be a floating"),
    (lambda: GroupedLinear(4, 8, 8, dtype="bf16"), r"GroupedLinear: argument 'dtype' must be a floating"),
])
def test_constructor_arguments_of_the_wrong_type(make, match):
    with pytest.raises(TypeError, match=match):
        make()


def test_numpy_numbers_and_bools_are_arguments_like_python_ones():
    import numpy as np

    router = TopKRouter(8, 8, 2, scale=np.float32(2.5), aux_loss_coeff=np.float64(0.01), normalize=np.bool_(True))
    assert (router.scale, router.aux_loss_coeff, router.normalize) == (2.5, 0.01, True)
    assert GroupedLinear(2, 8, 8, bias=np.bool_(True)).bias is not None


@pytest.mark.parametrize("fuse", [True, False])
def test_parameters_of_another_shape_are_named_before_any_kernel(fuse):
    """A weight substituted with another expert count or layout (functional_call, .data, a
    parametrization) is the op's own error, fused or not, never zero rows or a rule's error."""
    model = Sequential(TopKRouter(8, 4, 2), Permute(4), GroupedLinear(4, 8, 16, bias=True), SwiGLU(),
                       GroupedLinear(4, 8, 8), Unpermute(), fuse=fuse)
    x = torch.randn(6, 8)
    cases = {
        "2.weight": (torch.randn(3, 16, 8), r"GroupedLinear \(op 2\): parameter 'weight' must have shape \(4, 16, 8\)"),
        "4.weight": (torch.randn(4, 8, 8).transpose(1, 2)[:, :, :4], r"GroupedLinear \(op 4\): parameter 'weight'"),
        "2.bias": (torch.randn(3, 16), r"GroupedLinear \(op 2\): parameter 'bias' must have shape \(4, 16\)"),
        "0.weight": (torch.randn(5, 8), r"TopKRouter \(op 0\): parameter 'weight' must have shape \(4, 8\)"),
    }
    for name, (value, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            torch.func.functional_call(model, {name: value}, (x,))
    model(x).sum().backward()  # the module's own parameters still run


def test_torch_func_transforms_are_refused_by_name():
    mlp = seq()
    params = {n: p.detach() for n, p in mlp.named_parameters()}
    with pytest.raises(NotImplementedError, match="Sequential: torch.func transforms"):
        torch.func.grad(lambda p: torch.func.functional_call(mlp, p, (X,), {"split_sizes": S}).sum())(params)
    with pytest.raises(NotImplementedError, match="GroupedLinear: torch.func transforms"):
        torch.func.vmap(lambda x: mlp[0](x, split_sizes=S))(X.expand(2, -1, -1))
    torch.func.functional_call(mlp, params, (X,), {"split_sizes": S}).sum()  # outside a transform: runs


def test_double_backward_is_refused_by_name():
    """create_graph=True (a gradient penalty): refused naming the ops, never a first-order
    gradient with no graph that would silently drop the penalty's term."""
    x = X.clone().requires_grad_(True)
    y = seq()(x, split_sizes=S)
    with pytest.raises(NotImplementedError, match=r"te_fused_ops \(GroupedLinear, SwiGLU\): double backward"):
        torch.autograd.grad(y, x, torch.randn_like(y), create_graph=True)


def test_sequential_rejects_non_ops():
    with pytest.raises(TypeError, match=r"Sequential: argument 'ops' \[1\] must be a te_fused_ops basic op"):
        Sequential(GroupedLinear(2, 4, 4), torch.nn.ReLU())
    with pytest.raises(TypeError, match=r"Sequential: argument 'x' must be a torch.Tensor"):
        seq()([1.0], split_sizes=S)


def test_rule_definition_errors():
    with pytest.raises(ValueError, match=r"FusionRule 'empty': argument 'pattern' is empty"):
        FusionRule("empty", pattern=(), passes="forward")
    with pytest.raises(TypeError, match=r"FusionRule 'bad': argument 'pattern' must hold op types"):
        FusionRule("bad", pattern=(GroupedLinear, torch.nn.ReLU), passes="forward")
    with pytest.raises(TypeError, match=r"FusionRule 'bad': argument 'pattern' must hold op types"):
        FusionRule("bad", pattern=("GroupedLinear",), passes="forward")
    with pytest.raises(ValueError, match=r"FusionRule 'bad': argument 'passes'"):
        FusionRule("bad", pattern=(SwiGLU,), passes="sideways")
    rule = FusionRule("no_impl", pattern=(SwiGLU,), passes="forward")
    with pytest.raises(ValueError, match=r"FusionRule 'no_impl': unknown backend 'cuda'"):
        rule.implementation("cuda")
    with pytest.raises(ValueError, match=r"register_rule: rule 'no_impl' has no implementation"):
        register_rule(rule)
    with pytest.raises(TypeError, match=r"register_rule: argument 'rule' must be a FusionRule"):
        register_rule("no_impl")


def test_parameters_on_another_device_raise_before_any_kernel():
    """Weights on meta (or another device) with x on the CPU: a clear error naming op and
    parameter, never a tensor of uninitialised memory."""
    op = GroupedLinear(4, 32, 64, device="meta")
    with pytest.raises(ValueError, match=r"GroupedLinear \(op 0\): parameter 'weight' is on meta but argument 'x' "
                                         r"is on cpu; materialize it first \(module.to_empty"):
        op(torch.randn(8, 32), split_sizes=torch.tensor([2, 2, 2, 2]))
    mixed = Sequential(GroupedLinear(3, 8, 16), SwiGLU(), GroupedLinear(3, 8, 8, device="meta"))
    with pytest.raises(ValueError, match=r"GroupedLinear \(op 2\): parameter 'weight' is on meta"):
        mixed(X, split_sizes=S)


def test_input_on_meta_raises_naming_the_argument():
    with pytest.raises(ValueError, match=r"Sequential: argument 'x' is on the meta device"):
        seq()(torch.randn(6, 8, device="meta"), split_sizes=S)
    with pytest.raises(ValueError, match=r"GroupedLinear: argument 'x' is on the meta device"):
        GroupedLinear(3, 8, 16)(torch.randn(6, 8, device="meta"), split_sizes=S)


@pytest.mark.parametrize("fuse", [True, False])
def test_dtype_mismatch_is_the_ops_own_error_fused_or_not(fuse):
    """A fused rule surfaces the op's own TypeError, as the unfused op does (not a rule error)."""
    from te_fused_ops import FusionRuleError

    model = Sequential(GroupedLinear(3, 8, 16), SwiGLU(), GroupedLinear(3, 8, 8), fuse=fuse)
    with pytest.raises(TypeError) as info:
        model(X.double(), split_sizes=S)
    assert not isinstance(info.value, FusionRuleError)
    assert str(info.value) == "GroupedLinear: argument 'x' has dtype torch.float64 but the weight has torch.float32"


@pytest.mark.parametrize("fuse", [True, False])
def test_a_bias_of_another_dtype_than_its_weight_raises_naming_the_op(fuse):
    """A bias left in float64 (a checkpoint loaded with assign=True) would make a float64 output and
    fail in the backward's GEMM or in the next op: refused before anything runs."""
    model = Sequential(GroupedLinear(3, 8, 16), SwiGLU(), GroupedLinear(3, 8, 8, bias=True), fuse=fuse)
    model[2].bias.data = model[2].bias.data.double()
    with pytest.raises(TypeError, match=r"GroupedLinear \(op 2\): parameter 'bias' has dtype torch.float64 but "
                                        r"parameter 'weight' has torch.float32"):
        model(X, split_sizes=S)


def test_a_module_that_is_not_an_op_cannot_join_a_sequential():
    model = seq()
    with pytest.raises(TypeError, match=r"Sequential: module 'drop' must be a te_fused_ops basic op, got Dropout"):
        model.add_module("drop", torch.nn.Dropout())
    with pytest.raises(TypeError, match=r"Sequential: attribute 'extra' would add a Linear"):
        model.extra = torch.nn.Linear(8, 8)
    assert len(model) == 3 and model(X, split_sizes=S).shape == (6, 8)


def test_sizes_take_any_integral_number():
    """Sizes computed with numpy (np.int64) are accepted as nn.Linear accepts them, and stored as int."""
    np = pytest.importorskip("numpy")
    from te_fused_ops import Permute, TopKRouter

    op = GroupedLinear(np.int64(3), np.int32(8), 16)
    assert (op.num_groups, op.in_features) == (3, 8) and type(op.num_groups) is int
    assert type(Permute(np.int64(4), chunks=np.int64(1)).num_experts) is int
    assert TopKRouter(np.int64(8), 4, np.int64(2)).k == 2
    with pytest.raises(ValueError, match=r"GroupedLinear: argument 'num_groups' must be a positive int, got 3.0"):
        GroupedLinear(3.0, 8, 16)


def test_batched_gradients_are_refused_naming_the_ops():
    """is_grads_batched / jacobian(vectorize=True) vmap the backward: a clear refusal, not a rule's
    failure inside a batched matmul."""
    model = seq()
    x = X.clone().requires_grad_()
    y = model(x, split_sizes=S)
    with pytest.raises(NotImplementedError, match=r"te_fused_ops \(GroupedLinear, SwiGLU\): batched gradients"):
        torch.autograd.grad(y, x, torch.randn(2, *y.shape), is_grads_batched=True)
    with pytest.raises(NotImplementedError, match=r"batched gradients"):
        torch.autograd.functional.jacobian(lambda x: model(x, split_sizes=S), X, vectorize=True)


@pytest.mark.gpu
def test_parameters_on_the_cpu_with_x_on_cuda_raise():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    with pytest.raises(ValueError, match=r"GroupedLinear \(op 0\): parameter 'weight' is on cpu but argument 'x' "
                                         r"is on cuda:0"):
        seq()(X.cuda(), split_sizes=S.cuda())
