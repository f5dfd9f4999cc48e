"""The MoE layer ops (`TopKRouter`, `Permute`, `Unpermute`) on the torch path, against float64
references: forward, backward (x, weights, probs), edge cases of routing, bad input, side values
in the Sequential and in explain(), torch.compile, checkpointing, optimizer steps, saved bytes."""

import pytest
import torch
from reference import moe_layer, rel_err, saved_bytes

from te_fused_ops import (
    GroupedLinear,
    OpTypeError,
    OpValueError,
    Permute,
    ScaledSwiGLU,
    Sequential,
    SwiGLU,
    TopKRouter,
    Unpermute,
)
from te_fused_ops.routing import route
from te_fused_ops.runner import saved_tensor_bytes

E, H, I = 4, 8, 6
F64 = torch.float64


def layer(act="scaled", num_experts=E, dtype=F64, router=None):
    activation = ScaledSwiGLU() if act == "scaled" else SwiGLU()
    ops = [Permute(num_experts), GroupedLinear(num_experts, H, 2 * I, dtype=dtype), activation,
           GroupedLinear(num_experts, I, H, dtype=dtype), Unpermute()]
    return Sequential(*([router] if router is not None else []), *ops)


def inputs(tokens, k, seed=0, low=-1, num_experts=E):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, dtype=F64, generator=gen).requires_grad_()
    indices = torch.randint(low, num_experts, (tokens, k), generator=gen)
    probs = torch.rand(tokens, k, dtype=F64, generator=gen).requires_grad_()
    return x, indices, probs


ROUTINGS = {
    "random with drops": lambda t, k: torch.randint(-1, E, (t, k)),
    "all on one expert": lambda t, k: torch.full((t, k), 2),
    "every slot dropped": lambda t, k: torch.full((t, k), -1),
    "duplicate experts per token": lambda t, k: torch.randint(0, E, (t, 1)).expand(t, k).contiguous(),
    "empty experts": lambda t, k: torch.randint(0, 2, (t, k)),
}


@pytest.mark.parametrize("act", ["scaled", "combine"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("tokens,k", [(0, 2), (1, 1), (13, 1), (17, 3)])
def test_layer_matches_float64_reference(act, routing, tokens, k):
    torch.manual_seed(tokens * 10 + k)
    moe = layer(act)
    x, _, probs = inputs(tokens, k)
    indices = ROUTINGS[routing](tokens, k)
    y = moe(x, indices=indices, probs=probs)
    dy = torch.randn_like(y)
    y.backward(dy)
    w1, w2 = moe[1].weight, moe[3].weight
    ref = moe_layer(x, indices, probs, w1, w2) + 0 * (x.sum() + probs.sum() + w1.sum() + w2.sum())
    grads = torch.autograd.grad(ref, (x, probs, w1, w2), dy)
    assert y.shape == (tokens, H)
    assert rel_err(y, ref) <= 1e-12
    for got, want in zip((x.grad, probs.grad, w1.grad, w2.grad), grads):
        assert rel_err(got, want) <= 1e-12


def test_routing_is_sync_free_shaped_and_stable():
    indices = torch.tensor([[1, -1], [0, 1], [1, 7], [0, 0]])
    routing = route(indices, 2)
    assert routing.counts.tolist() == [3, 3]
    assert routing.offsets.tolist() == [0, 3, 6]  # rows 6 and 7: the dropped slots
    # rows by expert, then slot order; dropped slots (-1 and 7) last
    assert routing.row_slots.tolist() == [2, 6, 7, 0, 3, 4, 1, 5]
    flat = routing.slot_rows.flatten()
    assert torch.equal(flat[routing.row_slots], torch.arange(8, dtype=torch.int32))


@pytest.mark.parametrize("score,normalize,groups,group_topk,bias,aux,scale", [
    ("softmax", True, 1, 1, False, 0.01, 2.5), ("softmax", False, 1, 1, False, 0.01, 2.5),
    ("sigmoid", True, 4, 2, True, 0.01, 2.5),
    # without the balance loss a softmax router's backward starts from the probs (`softmax_logit_grads`)
    ("softmax", True, 1, 1, False, 0.0, 2.5), ("softmax", True, 4, 2, True, 0.0, 1.0),
    ("softmax", False, 1, 1, False, 0.0, 2.5),
])
def test_router_matches_autograd_reference(score, normalize, groups, group_topk, bias, aux, scale):
    torch.manual_seed(0)
    tokens, k, num_experts = 24, 3, 8
    router = TopKRouter(H, num_experts, k, score=score, normalize=normalize, scale=scale, num_groups=groups,
                        group_topk=group_topk, expert_bias=bias, aux_loss_coeff=aux, dtype=F64)
    if bias:
        router.expert_bias.data.normal_()
    moe = layer(num_experts=num_experts, router=router)
    x = torch.randn(tokens, H, dtype=F64, requires_grad=True)
    y = moe(x)
    dy = torch.randn_like(y)
    y.backward(dy)

    logits = x @ router.weight.t()
    scores = torch.softmax(logits, -1) if score == "softmax" else torch.sigmoid(logits)
    ranking = scores.detach() + (router.expert_bias if bias else 0)
    if groups > 1:
        grouped = ranking.view(tokens, groups, -1)
        best = grouped.topk(2 if score == "sigmoid" else 1, -1).values.sum(-1).topk(group_topk, -1).indices
        mask = torch.ones(tokens, groups, dtype=torch.bool).scatter_(1, best, False)
        ranking = grouped.masked_fill(mask[..., None], -float("inf")).view(tokens, -1)
    indices = ranking.topk(k, -1).indices
    probs = scores.gather(1, indices)
    if normalize:
        probs = probs / probs.sum(-1, keepdim=True)
    probs = probs * scale
    share = torch.zeros(num_experts, dtype=F64).index_add_(0, indices.flatten(), torch.ones(tokens * k, dtype=F64))
    per_token = scores if score == "softmax" else scores / scores.sum(-1, keepdim=True)
    balance = aux * num_experts * (share / (tokens * k) * per_token.mean(0)).sum()
    ref = moe_layer(x, indices, probs, moe[2].weight, moe[4].weight)
    params = (x, router.weight, moe[2].weight, moe[4].weight)
    grads = torch.autograd.grad((ref * dy).sum() + balance, params)
    assert rel_err(y, ref) <= 1e-12
    assert torch.equal(router.tokens_per_expert, share)
    if aux:
        assert abs(router.aux_loss.item() - balance.item()) <= 1e-12
    for param, want in zip(params, grads):
        assert rel_err(param.grad, want) <= 1e-10


@pytest.mark.parametrize("score,groups,bias", [("softmax", 1, False), ("sigmoid", 4, True), ("softmax", 2, False)])
def test_router_on_no_tokens(score, groups, bias):
    """An empty batch through every routing form (group-limited too): an empty output, zero
    gradients, a zero balance loss."""
    router = TopKRouter(H, 8, 3, score=score, num_groups=groups, group_topk=min(2, groups), expert_bias=bias,
                        aux_loss_coeff=0.01, dtype=F64)
    moe = layer(num_experts=8, router=router)
    x = torch.randn(0, H, dtype=F64, requires_grad=True)
    y = moe(x)
    y.sum().backward()
    assert y.shape == (0, H) and x.grad.shape == (0, H)
    assert router.aux_loss.item() == 0.0 and not router.weight.grad.any()


def test_expert_bias_stays_float32_through_module_casts_and_autocast():
    """DeepSeek-V3's selection bias takes small updates: a bf16 module keeps it in float32 (moved,
    never rounded), and autocast adds it to the float32 scores unrounded."""
    router = TopKRouter(H, 8, 2, score="sigmoid", expert_bias=True)
    router.expert_bias.data = torch.linspace(0, 1e-3, 8)
    want = router.expert_bias.detach().clone()
    moe = layer(num_experts=8, router=router, dtype=torch.float32).to(torch.bfloat16)
    assert router.weight.dtype == torch.bfloat16 and moe[2].weight.dtype == torch.bfloat16
    assert router.expert_bias.dtype == torch.float32 and torch.equal(router.expert_bias, want)
    moe.half().float()
    assert torch.equal(router.expert_bias, want)
    seen = []
    choose = router.choose
    router.choose = lambda scores, bias: seen.append(bias) or choose(scores, bias)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        moe(torch.randn(5, H))
    assert seen[0].dtype == torch.float32 and torch.equal(seen[0], want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_top_k_takes_equal_values_lowest_index_first(dtype):
    """The router's choice among equal scores is a rule, not `torch.topk`'s unspecified order
    (which its CPU and CUDA kernels do not share): values of a few levels, -inf, and both zeros."""
    from te_fused_ops.ops.moe import top_k_lowest_first

    torch.manual_seed(0)
    values = (torch.randn(64, 16) * 3).round().to(dtype)
    values[0] = float("-inf")
    values[1, 3], values[1, 5] = -0.0, 0.0
    for k in (1, 5, 16):
        expected = [sorted(range(16), key=lambda i: (-float(row[i]), i))[:k] for row in values]
        assert top_k_lowest_first(values, k).tolist() == expected


@pytest.mark.parametrize("groups,expected", [(1, [1, 2]), (4, [2, 3])])
def test_router_ties_go_to_the_lowest_experts(groups, expected):
    """Scores all equal but expert 0's: the two lowest of the rest (4 groups of 2, 2 kept: group 0
    scores lower, groups 1 and 2 tie with 3 and are kept, then their lowest experts)."""
    router = TopKRouter(16, 8, 2, score="sigmoid", num_groups=groups, group_topk=2 if groups > 1 else 1)
    scores = torch.full((5, 8), 0.5)
    scores[:, 0] = 0.1
    indices, chosen = router.choose(scores, None)
    assert indices.tolist() == [expected] * 5 and torch.equal(chosen, torch.full((5, 2), 0.5))


def test_router_with_float32_logits_on_16_bit_operands():
    """``float32_logits``: a bf16 router's logits as the float32 product of its bf16 operands (the
    choice of experts of that product), gradients within a bf16 rounding of the float32 autograd
    reference."""
    torch.manual_seed(2)
    tokens, num_experts, k = 64, 16, 4
    router = TopKRouter(H, num_experts, k, score="sigmoid", normalize=True, float32_logits=True,
                        aux_loss_coeff=0.01, dtype=torch.bfloat16)
    assert "float32_logits=True" in repr(router)
    moe = layer(num_experts=num_experts, router=router, dtype=torch.bfloat16)
    x = torch.randn(tokens, H, dtype=torch.bfloat16, requires_grad=True)
    seen = []
    choose = router.choose
    router.choose = lambda scores, bias: seen.append(scores) or choose(scores, bias)
    y = moe(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    logits = x.detach().double() @ router.weight.detach().double().t()
    assert seen[0].dtype == torch.float32 and rel_err(seen[0], torch.sigmoid(logits)) <= 1e-6
    x_ref = x.detach().float().requires_grad_()
    w_ref = router.weight.detach().float().requires_grad_()
    scores = torch.sigmoid(x_ref @ w_ref.t())
    top, indices = scores.topk(k, -1)
    assert torch.equal(indices.sort(-1).values, router_indices(moe, x).sort(-1).values)
    probs = top / top.sum(-1, keepdim=True)
    w1, w2 = (moe[i].weight.detach().float() for i in (2, 4))
    ref = moe_layer(x_ref.double(), indices, probs.double(), w1.double(), w2.double())
    share = router.tokens_per_expert.double() / (tokens * k)
    balance = 0.01 * num_experts * (share * (scores / scores.sum(-1, keepdim=True)).mean(0)).sum()
    ((ref * dy.double()).sum() + balance).backward()
    assert rel_err(router.weight.grad, w_ref.grad) <= 2e-2 and rel_err(x.grad, x_ref.grad) <= 2e-2


def test_router_coefficient_scheduled_during_training():
    """A balance-loss coefficient changed between steps (a schedule) is used by the next step's
    loss and gradient, reuses the layer's one plan, and switched off leaves no stale
    ``aux_loss``."""
    torch.manual_seed(3)
    router = TopKRouter(H, E, 2, aux_loss_coeff=0.01, dtype=F64)
    moe = layer(router=router)
    x = torch.randn(16, H, dtype=F64)
    losses = []
    for coeff in (0.01, 0.02, 0.03):
        router.aux_loss_coeff = coeff
        moe(x)
        losses.append(float(router.aux_loss))
    assert losses[1] == pytest.approx(2 * losses[0]) and losses[2] == pytest.approx(3 * losses[0])
    assert len(moe._plans) == 1
    router.aux_loss_coeff = 0.0
    moe.zero_grad()
    moe(x).sum().backward()
    assert router.aux_loss is None
    with_loss = router.weight.grad.clone()
    plain = layer(router=TopKRouter(H, E, 2, dtype=F64))
    plain.load_state_dict(moe.state_dict())
    plain(x).sum().backward()
    assert torch.equal(with_loss, plain[0].weight.grad)
    assert "aux_loss_coeff" not in repr(router) and "aux_loss_coeff=0.01" in repr(TopKRouter(H, E, 2, aux_loss_coeff=0.01))


def router_indices(moe, x):
    """The experts ``moe``'s router chooses for ``x`` (its forward run again, without gradients)."""
    got = []
    permute = moe[1]
    bind = permute.bind_side_inputs
    permute.bind_side_inputs = lambda side, x, memo: got.append(side["indices"]) or bind(side, x, memo)
    with torch.no_grad():
        moe(x)
    del permute.bind_side_inputs
    return got[0]


def test_explain_names_the_side_values():
    moe = layer()
    x, indices, probs = inputs(8, 2)
    text = moe.explain(x, indices=indices, probs=probs)
    assert "Permute" in text and "Unpermute" in text
    assert "side values: Permute (op 0) -> routing [ops 4], split_sizes [ops 1, 3]" in text
    router = TopKRouter(H, E, 2, dtype=F64)
    text = layer(router=router).explain(x)
    assert "side values: TopKRouter (op 0) -> indices [ops 1], probs [ops 3, 5]; Permute (op 1)" in text


def test_fp8_layer_casts_in_dispatch_and_combine_backward():
    """The FP8 layer (a 1x128 Quantize after the permute, FC2's input cast with its column copy):
    the dispatch folds the cast (each token cast once), the combine's backward folds FC2's cast of
    dy; on the torch path both are the ops' own passes: bit for bit the unfused layer."""
    from te_fused_ops import Quantize, Transpose

    def fp8_layer(fuse):
        torch.manual_seed(0)
        return Sequential(Permute(E), Quantize("fp8_blockwise"), GroupedLinear(E, 128, 256), ScaledSwiGLU(),
                          Quantize("fp8_blockwise"), Transpose(), GroupedLinear(E, 128, 128), Unpermute(), fuse=fuse)

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 128, generator=gen).requires_grad_()
    indices = torch.randint(-1, E, (24, 2), generator=gen)
    probs = torch.rand(24, 2, generator=gen).requires_grad_()
    fused, unfused = fp8_layer(True), fp8_layer(False)
    text = fused.explain(x, indices=indices, probs=probs)
    assert "[0:2] Permute, Quantize -> rule 'permute+quantize'" in text
    assert "rule 'grouped_linear+dactivation+grouped_linear+unpermute'" in text
    results = []
    for moe in (fused, unfused):
        x.grad = probs.grad = None
        y = moe(x, indices=indices, probs=probs)
        y.square().sum().backward()
        results.append([y.detach(), x.grad.clone(), probs.grad.clone(), moe[2].weight.grad, moe[6].weight.grad])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    x16, indices16, probs16 = inputs(8, 2)
    plain_text = layer().explain(x16, indices=indices16, probs=probs16)  # no casts: the combine's own backward
    assert "grouped_linear+dactivation+grouped_linear+unpermute" not in plain_text.split("not fired")[0]


def test_fp8_layer_with_16_bit_weight_gradients():
    """Float8BlockScaling(high_precision_wgrad=True): the forward and data gradients are the FP8
    layer's bit for bit, the weight gradients 16-bit GEMMs on the unquantized expert rows of x and
    act and on the unquantized dy (closer to the unquantized layer's than the FP8 ones); fused and
    unfused plans agree bit for bit."""
    from te_fused_ops import Quantize, Transpose
    from te_fused_ops.quantization import Float8BlockScaling

    def fp8_layer(recipe, fuse=True, quantize=True):
        torch.manual_seed(0)
        casts = (lambda: [Quantize(recipe)]) if quantize else list
        return Sequential(Permute(E), *casts(), GroupedLinear(E, 128, 256), ScaledSwiGLU(), *casts(),
                          *([Transpose()] if quantize else []), GroupedLinear(E, 128, 128), Unpermute(), fuse=fuse)

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(24, 128, generator=gen).requires_grad_()
    indices = torch.randint(-1, E, (24, 2), generator=gen)
    probs = torch.rand(24, 2, generator=gen).requires_grad_()
    dy = torch.randn(24, 128, generator=gen)
    hp = Float8BlockScaling(high_precision_wgrad=True)
    assert hp != Float8BlockScaling() and hp.name == "fp8_blockwise"

    def run(moe):
        x.grad = probs.grad = None
        fc1, fc2 = (op for op in moe if isinstance(op, GroupedLinear))
        y = moe(x, indices=indices, probs=probs)
        y.backward(dy)
        return [y.detach(), x.grad.clone(), probs.grad.clone(), fc1.weight.grad, fc2.weight.grad]

    hp_fused, hp_unfused = run(fp8_layer(hp)), run(fp8_layer(hp, fuse=False))
    fp8, plain = run(fp8_layer("fp8_blockwise")), run(fp8_layer(None, quantize=False))
    for a, b in zip(hp_fused, hp_unfused):
        assert torch.equal(a, b)
    for a, b in zip(hp_fused[:3], fp8[:3]):  # output, dx, d_probs
        assert torch.equal(a, b)
    for got, fp8_grad, want in zip(hp_fused[3:], fp8[3:], plain[3:]):
        assert rel_err(got, want) < rel_err(fp8_grad, want)


def test_bad_input_names_op_and_argument():
    moe = layer()
    x, indices, probs = inputs(8, 2)
    with pytest.raises(OpValueError, match=r"Permute: argument 'indices' holds 9"):
        moe(x, indices=torch.full((8, 2), 9), probs=probs)
    with pytest.raises(OpValueError, match=r"Permute: argument 'indices' holds -3"):
        moe(x, indices=torch.full((8, 2), -3), probs=probs)
    with pytest.raises(OpTypeError, match=r"Permute: argument 'indices' must have dtype int32 or int64"):
        moe(x, indices=indices.float(), probs=probs)
    with pytest.raises(OpValueError, match=r"Permute: argument 'indices' must have shape \(8, k\)"):
        moe(x, indices=indices[:5], probs=probs)
    with pytest.raises(OpValueError, match=r"ScaledSwiGLU: argument 'probs' must have the shape"):
        moe(x, indices=indices, probs=probs[:, :1])
    with pytest.raises(OpTypeError, match=r"ScaledSwiGLU: argument 'probs' must be floating point"):
        moe(x, indices=indices, probs=indices)
    with pytest.raises(OpValueError, match=r"Unpermute: argument 'probs' must have the shape"):
        layer("combine")(x, indices=indices, probs=probs[:, :1])
    with pytest.raises(ValueError, match=r"Permute \(op 0\): missing side input 'indices'"):
        moe(x, probs=probs)
    with pytest.raises(ValueError, match=r"'split_sizes' is produced by Permute"):
        moe(x, indices=indices, probs=probs, split_sizes=torch.ones(E, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"Unpermute \(op 0\): missing side input 'routing'"):
        Sequential(Unpermute())(x)
    with pytest.raises(OpValueError, match=r"ScaledSwiGLU: argument 'probs' must have shape \(16,\) \(one per row\) "
                                           r"or, as the tokens' probabilities, the shape of the permute's 'indices' "
                                           r"\(8, 2\), got \(8,\)"):
        moe(x, indices=indices, probs=probs[:, 0])
    with pytest.raises(OpValueError, match=r"Permute: argument 'capacity_factor' must be > 0 and finite, or None, got -1"):
        Permute(E, capacity_factor=-1)


def test_expert_counts_that_disagree_are_refused_when_the_plan_is_made():
    x, indices, probs = inputs(8, 2)
    wide_permute = Sequential(Permute(E + 1), GroupedLinear(E, H, 2 * I, dtype=F64), ScaledSwiGLU(),
                              GroupedLinear(E, I, H, dtype=F64), Unpermute())
    with pytest.raises(OpValueError, match=r"GroupedLinear \(op 1\): side input 'split_sizes' from Permute \(op 0\) "
                                           r"spans 5 experts, this op has 4"):
        wide_permute(x, indices=indices, probs=probs)
    narrow_fc2 = Sequential(Permute(E), GroupedLinear(E, H, 2 * I, dtype=F64), ScaledSwiGLU(),
                            GroupedLinear(E - 1, I, H, dtype=F64), Unpermute())
    with pytest.raises(OpValueError, match=r"GroupedLinear \(op 3\): .* spans 4 experts, this op has 3"):
        narrow_fc2(x, indices=indices, probs=probs)
    routed = layer(router=TopKRouter(H, 2 * E, 2, dtype=F64))
    with pytest.raises(OpValueError, match=r"Permute \(op 1\): side input 'indices' from TopKRouter \(op 0\) "
                                           r"spans 8 experts, this op has 4"):
        routed(x)
    assert layer(router=TopKRouter(H, E, 2, dtype=F64))(x).shape == x.shape


def test_expert_counts_consumed_after_the_unpermute_are_refused():
    """A grouped op after the Unpermute would split token-order rows by the expert counts (with
    k = 1 the row counts even agree): refused when the plan is made, whatever k is."""
    for k in (1, 2):
        x, indices, probs = inputs(8, k)
        late_fc2 = Sequential(Permute(E), GroupedLinear(E, H, 2 * I, dtype=F64), SwiGLU(), Unpermute(),
                              GroupedLinear(E, I, H, dtype=F64))
        with pytest.raises(OpValueError, match=r"GroupedLinear \(op 4\): side input 'split_sizes' from Permute "
                                               r"\(op 0\) describes rows that Unpermute \(op 3\) has already consumed"):
            late_fc2(x, indices=indices, probs=probs)


def test_compiled_layer_compiles_once_for_new_routing():
    moe = layer("scaled", dtype=torch.float32)
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    compiled = torch.compile(moe, backend=backend, dynamic=False)
    for step in range(3):
        x, indices, probs = inputs(16, 2, seed=step)
        x, probs = x.float().detach().requires_grad_(), probs.float().detach().requires_grad_()
        y = compiled(x, indices=indices, probs=probs)
        y.square().sum().backward()
        want = moe(x, indices=indices, probs=probs)
        grads = torch.autograd.grad(want.square().sum(), (x, probs))
        assert torch.equal(y, want)
        assert torch.equal(x.grad, grads[0]) and torch.equal(probs.grad, grads[1])
    assert len(frames) == 1


@pytest.mark.parametrize("with_router", [False, True])
def test_compiled_layer_takes_a_new_token_count_without_recompiling_each(with_router):
    """Batches of another length: dynamo recompiles once with a symbolic token count (the fake run
    of the ops sees SymInt shapes), then every later length runs that graph; results equal eager."""
    torch._dynamo.reset()  # dynamo remembers sizes it saw change per code object, across modules
    torch.manual_seed(1)
    router = TopKRouter(H, E, 2, normalize=True, aux_loss_coeff=0.01, dtype=torch.float32) if with_router else None
    moe = layer("scaled", dtype=torch.float32, router=router)
    frames = []

    def backend(gm, example_inputs):
        frames.append(gm)
        return gm

    compiled = torch.compile(moe, backend=backend)
    for step, tokens in enumerate((16, 12, 21, 7, 30)):
        x, indices, probs = inputs(tokens, 2, seed=step)
        x, probs = x.float().detach().requires_grad_(), probs.float().detach().requires_grad_()
        side = {} if with_router else {"indices": indices, "probs": probs}
        y = compiled(x, **side)
        y.square().sum().backward()
        got = [x.grad, *(p.grad for p in moe.parameters())]
        x.grad = None
        moe.zero_grad(set_to_none=True)
        want = moe(x, **side)
        want.square().sum().backward()
        assert torch.equal(y, want)
        for a, b in zip(got, [x.grad, *(p.grad for p in moe.parameters())]):
            assert torch.equal(a, b)
        moe.zero_grad(set_to_none=True)
    assert len(frames) == 2


@pytest.mark.parametrize("act", ["scaled", "plain"])
def test_a_dropped_slot_adds_nothing_whatever_its_probability(act):
    """A dropped slot's probability is never read: inf or NaN there leaves the token's output, and
    every gradient, equal to the same layer's with that probability 0 (the weighted combine
    multiplied it by a 0 mask, and inf * 0 is NaN)."""
    torch.manual_seed(4)
    moe = layer(act)
    x, indices, probs = inputs(6, 3, seed=4)
    indices[0, 1] = indices[2, 0] = indices[5, 2] = -1
    results = []
    for fill in (0.0, float("inf"), float("nan")):
        p = probs.detach().clone()
        p[indices < 0] = fill
        p.requires_grad_()
        y = moe(x, indices=indices, probs=p)
        y.square().sum().backward()
        results.append((y.detach(), x.grad, p.grad.masked_fill(indices < 0, 0), *(q.grad for q in moe.parameters())))
        x.grad = None
        moe.zero_grad(set_to_none=True)
    assert all(torch.isfinite(t).all() for t in results[1] + results[2])
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert torch.equal(a, b)


def test_compiled_function_with_two_symbols_for_the_token_count():
    """A compiled function whose arguments dynamo names x, idx, p gives x's and the
    probabilities' token counts two symbols it cannot prove equal, and ScaledSwiGLU's output rows
    take the probabilities' one: FC2 must still find the permute's offsets (computing them again
    made the trace save other values than its first run, an error at the second token count)."""
    torch._dynamo.reset()
    torch.manual_seed(3)
    moe = layer("scaled", dtype=torch.float32)

    @torch.compile(backend="aot_eager", fullgraph=True)
    def loss(x, idx, p):
        return moe(x, indices=idx, probs=p).square().sum()

    for step, tokens in enumerate((24, 16, 9)):
        x, indices, probs = inputs(tokens, 2, seed=step)
        x, probs = x.float().detach().requires_grad_(), probs.float().detach().requires_grad_()
        got = torch.autograd.grad(loss(x, indices, probs), (x, probs, *moe.parameters()))
        want = torch.autograd.grad(moe(x, indices=indices, probs=probs).square().sum(), (x, probs, *moe.parameters()))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("fuse", [True, False])
def test_frozen_router_and_an_input_needing_no_gradient(fuse):
    """Fine-tuning the experts alone: with the router frozen and x needing no gradient the
    router's backward is not run (it saved nothing), and the experts' gradients are those of the
    same layer whose router trains."""
    grads = {}
    for frozen in (True, False):
        torch.manual_seed(5)
        router = TopKRouter(H, E, 2, dtype=F64)
        model = Sequential(router, *layer()[:], fuse=fuse)
        router.weight.requires_grad_(not frozen)
        x = torch.randn(11, H, dtype=F64)
        model(x).sum().backward()
        grads[frozen] = [p.grad for p in model.parameters()]
    assert grads[True][0] is None and grads[False][0] is not None
    for got, want in zip(grads[True][1:], grads[False][1:]):
        assert torch.equal(got, want)


def test_router_layer_under_compile_equals_eager():
    torch.manual_seed(0)
    moe = layer("scaled", dtype=torch.float32, router=TopKRouter(H, E, 2, normalize=True, aux_loss_coeff=0.01))
    compiled = torch.compile(moe, backend="eager", dynamic=False)
    x = torch.randn(16, H, requires_grad=True)
    compiled(x).sum().backward()
    got = [x.grad] + [p.grad for p in moe.parameters()]
    x.grad = None
    moe.zero_grad(set_to_none=True)
    moe(x).sum().backward()
    for a, b in zip(got, [x.grad] + [p.grad for p in moe.parameters()]):
        assert torch.equal(a, b)


def test_router_setting_changed_between_compiled_steps_recompiles():
    """``normalize`` changes the plan (it decides what the router saves): a compiled layer whose
    router changes it between steps recompiles and equals eager, both ways."""
    torch.manual_seed(0)
    router = TopKRouter(H, E, 2, normalize=True)
    moe = layer("scaled", dtype=torch.float32, router=router)
    compiled = torch.compile(moe, backend="aot_eager", dynamic=False)
    x = torch.randn(16, H, requires_grad=True)
    for normalize in (True, False, True):
        router.normalize = normalize
        results = []
        for fn in (compiled, moe):
            x.grad = None
            moe.zero_grad(set_to_none=True)
            y = fn(x)
            y.sum().backward()
            results.append([y, x.grad] + [p.grad for p in moe.parameters()])
        for a, b in zip(*results):
            torch.testing.assert_close(a, b)


def test_two_runs_are_bit_equal():
    moe = layer(dtype=torch.float32)
    x, indices, probs = inputs(33, 4)
    x, probs = x.float().detach().requires_grad_(), probs.float().detach().requires_grad_()
    results = []
    for _ in range(2):
        moe.zero_grad(set_to_none=True)
        x.grad = probs.grad = None
        y = moe(x, indices=indices, probs=probs)
        y.square().sum().backward()
        results.append([y, x.grad, probs.grad] + [p.grad for p in moe.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_activation_checkpointing_and_fused_adamw_train_like_the_reference():
    torch.manual_seed(0)
    moe = layer(dtype=torch.float32)
    w1 = moe[1].weight.detach().clone().requires_grad_()
    w2 = moe[3].weight.detach().clone().requires_grad_()
    opt = torch.optim.AdamW(moe.parameters(), lr=1e-2, fused=True)
    opt_ref = torch.optim.AdamW([w1, w2], lr=1e-2, fused=True)
    for step in range(5):
        x, indices, probs = inputs(24, 2, seed=step)
        x, probs = x.float().detach(), probs.float().detach()
        y = torch.utils.checkpoint.checkpoint(moe, x, indices=indices, probs=probs, use_reentrant=False)
        y.square().mean().backward()
        moe_layer(x, indices, probs, w1, w2).square().mean().backward()
        opt.step(), opt_ref.step()
        opt.zero_grad(set_to_none=True), opt_ref.zero_grad(set_to_none=True)
        assert rel_err(moe[1].weight, w1) <= 1e-5 and rel_err(moe[3].weight, w2) <= 1e-5


def plain_torch_layer(x, indices, probs, w1, w2):
    """The layer as a user writes it in torch: argsort permute, per-expert GEMMs, gather combine."""
    tokens, k = indices.shape
    flat = indices.flatten()
    key = torch.where(flat >= 0, flat, w1.shape[0])
    order = torch.sort(key, stable=True).indices
    x_perm = x.index_select(0, order // k)
    counts = torch.bincount(key, minlength=w1.shape[0] + 1).tolist()
    h, start = [], 0
    for e, n in enumerate(counts[:-1]):
        h.append(x_perm[start:start + n] @ w1[e].t())
        start += n
    h.append(x_perm.new_zeros(counts[-1], w1.shape[1]))
    act = SwiGLU().act(torch.cat(h))
    y, start = [], 0
    for e, n in enumerate(counts[:-1]):
        y.append(act[start:start + n] @ w2[e].t())
        start += n
    y.append(act.new_zeros(counts[-1], w2.shape[1]))
    y = torch.cat(y)
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel())).view(tokens, k)
    kept = (indices >= 0).to(x.dtype)
    return (y[rows] * (probs * kept)[..., None]).sum(1)


def test_saved_bytes_below_sixty_percent_of_the_plain_torch_layer():
    torch.manual_seed(0)
    moe = layer(dtype=torch.float32)
    x, indices, probs = inputs(256, 4, low=0)
    x, probs = x.float().detach().requires_grad_(), probs.float().detach().requires_grad_()
    w1, w2 = moe[1].weight, moe[3].weight
    ours = saved_bytes(lambda: moe(x, indices=indices, probs=probs))
    theirs = saved_bytes(lambda: plain_torch_layer(x, indices, probs, w1, w2))
    assert rel_err(moe(x, indices=indices, probs=probs), plain_torch_layer(x, indices, probs, w1, w2)) <= 1e-5
    y = moe(x, indices=indices, probs=probs)
    assert saved_tensor_bytes(y) <= ours
    assert ours <= 0.6 * theirs, (ours, theirs)


@pytest.mark.parametrize("act_op", [ScaledSwiGLU, SwiGLU])
def test_activation_output_kept_for_the_backward(act_op):
    """``recompute_output=False`` keeps the activation's output for FC2's weight gradient instead of
    recomputing it from the saved pre-activation: the same output and gradients, one (M, I)
    tensor more saved."""
    tokens, k = 32, 3
    torch.manual_seed(0)
    moe = layer("scaled" if act_op is ScaledSwiGLU else "combine")
    kept = Sequential(*(act_op(recompute_output=False) if i == 2 else op for i, op in enumerate(moe)))
    assert "recompute_output=False" in repr(kept[2])
    x, indices, probs = inputs(tokens, k, low=0)
    results = []
    for model in (moe, kept):
        for t in (x, probs, *model.parameters()):
            t.grad = None
        y = model(x, indices=indices, probs=probs)
        y.backward(torch.ones_like(y))
        results.append([y.detach(), x.grad, probs.grad, *(p.grad for p in model.parameters())])
    for a, b in zip(*results):
        assert torch.equal(a, b)
    recomputed = saved_bytes(lambda: moe(x, indices=indices, probs=probs))
    held = saved_bytes(lambda: kept(x, indices=indices, probs=probs))
    assert held - recomputed == tokens * k * I * x.element_size()


def test_activation_recompute_output_must_be_a_bool():
    with pytest.raises(TypeError, match="SwiGLU: argument 'recompute_output' must be a bool"):
        SwiGLU(recompute_output=1)


def test_router_initializes_after_meta_construction_and_keeps_its_bias_as_a_float32_buffer():
    """Large-model init: built on the meta device, ``to_empty`` then ``reset_parameters()`` gives
    the constructor's values; ``expert_bias`` is a buffer (no gradient, no optimizer, no weight
    decay; in the state dict) that stays float32 through loads of 16-bit checkpoints and casts."""
    with torch.device("meta"):
        router = TopKRouter(256, 8, 2, score="sigmoid", expert_bias=True)
    router.to_empty(device="cpu")
    for module in router.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    assert torch.equal(router.expert_bias, torch.zeros(8))
    assert abs(router.weight.std().item() - 256**-0.5) < 0.1 * 256**-0.5
    assert [name for name, _ in router.named_parameters()] == ["weight"]
    assert "expert_bias" in router.state_dict() and [name for name, _ in router.named_buffers()] == ["expert_bias"]
    router.requires_grad_(True)
    assert not router.expert_bias.requires_grad
    state = {name: t.bfloat16() for name, t in router.state_dict().items()}
    with torch.device("meta"):
        loaded = TopKRouter(256, 8, 2, score="sigmoid", expert_bias=True)
    loaded.load_state_dict(state, assign=True)
    assert loaded.expert_bias.dtype == torch.float32 and loaded.weight.dtype == torch.bfloat16
    loaded.float()
    assert loaded.expert_bias.dtype == torch.float32
    loaded.half()
    assert loaded.expert_bias.dtype == torch.float32 and loaded.weight.dtype == torch.float16


def test_a_meta_module_is_named_with_how_to_materialize_it():
    with torch.device("meta"):
        moe = layer(router=TopKRouter(H, E, 2, dtype=F64))
    with pytest.raises(ValueError, match=r"is on meta .*to_empty"):
        moe(torch.randn(4, H, dtype=F64))
