"""torch.compile: a Sequential is two custom ops; new routing never recompiles; results equal eager.

Each test compiles a whole training step (forward and loss; the backward runs through AOT autograd)
of a small model holding a Sequential, then runs it with fresh split tensors under
``error_on_recompile`` and compares output and every gradient with the same step run eagerly.
"""

import copy

import pytest
import torch
from torch import nn

import te_fused_ops as tfo
from te_fused_ops import GroupedLinear, ScaledSwiGLU, Sequential, SwiGLU

G, H, I, ROWS = 4, 16, 8, 40


class MoeModel(nn.Module):
    """A dense projection, then a grouped MLP over the routed rows."""

    def __init__(self, act, bias):
        super().__init__()
        self.proj = nn.Linear(H, H)
        self.experts = Sequential(GroupedLinear(G, H, 2 * I, bias=bias), act, GroupedLinear(G, I, H, bias=bias))

    def forward(self, x, **side):
        return self.experts(self.proj(x), **side)


def step(model, x, side):
    return model(x, **side).square().mean()


def routing(seed: int) -> dict:
    """Fresh split tensors (a padding tail of 0..7 rows, empty groups) and router probs."""
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 12, (G,), generator=gen)
    sizes[seed % G] = 0
    return {"split_sizes": sizes.clamp(max=ROWS // G), "probs": torch.rand(ROWS, generator=gen, requires_grad=True)}


def grads(model, x, side):
    return [x.grad, *(side["probs"].grad for _ in [0] if "probs" in side), *(p.grad for p in model.parameters())]


def check_training_matches_eager(act, bias, backend, fullgraph=True):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = MoeModel(act, bias)
    eager = copy.deepcopy(model)
    compiled = torch.compile(step, backend=backend, fullgraph=fullgraph)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    try:
        for seed in range(6):
            torch._dynamo.config.error_on_recompile = seed > 0
            results = []
            for fn, m in ((compiled, model), (step, eager)):
                x = torch.randn(ROWS, H, generator=torch.Generator().manual_seed(seed)).requires_grad_()
                side = routing(seed)
                if not isinstance(act, ScaledSwiGLU):
                    del side["probs"]
                loss = fn(m, x, side)
                loss.backward()
                results.append([loss, *grads(m, x, side)])
            for got, want in zip(*results):
                torch.testing.assert_close(got, want)
            for opt in optims:
                opt.step()
                opt.zero_grad(set_to_none=True)
    finally:
        torch._dynamo.config.error_on_recompile = False


@pytest.mark.parametrize(
    "act,bias",
    [(SwiGLU(), False), (SwiGLU(), True), (ScaledSwiGLU(), True)],
    ids=["swiglu", "swiglu-bias", "scaled-bias"],
)
def test_aot_eager_fullgraph_no_recompile_on_new_routing(act, bias):
    check_training_matches_eager(act, bias, "aot_eager")


def test_inductor_no_recompile_on_new_routing():
    check_training_matches_eager(ScaledSwiGLU(), True, "inductor")


def test_layers_compiled_one_by_one_past_dynamos_default_limit():
    """Per-block compile (fullgraph) of more layers than dynamo's default recompile limit: each
    layer is a graph of its own, so the README's remedy (the limit raised to the number of layers)
    compiles every layer, and each equals its eager call."""
    torch._dynamo.reset()
    layers = [MoeModel(ScaledSwiGLU(), False) for _ in range(10)]
    compiled = [torch.compile(layer, backend="aot_eager", fullgraph=True) for layer in layers]
    side = routing(0)
    x = torch.randn(ROWS, H)
    limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = len(layers)
    try:
        for layer, fn in zip(layers, compiled):
            torch.testing.assert_close(fn(x, **side), layer(x, **side), rtol=1e-6, atol=1e-6)
    finally:
        torch._dynamo.config.recompile_limit = limit
        torch._dynamo.reset()


def test_compiled_module_and_no_grad_call():
    torch._dynamo.reset()
    torch.manual_seed(0)
    seq = Sequential(GroupedLinear(G, H, 2 * I), SwiGLU(), GroupedLinear(G, I, H))
    compiled = torch.compile(seq, backend="aot_eager", fullgraph=True)
    x = torch.randn(ROWS, H)
    for seed in range(3):
        torch._dynamo.config.error_on_recompile = seed > 0
        try:
            side = {"split_sizes": routing(seed)["split_sizes"]}
            with torch.no_grad():
                torch.testing.assert_close(compiled(x, **side), seq(x, **side))
        finally:
            torch._dynamo.config.error_on_recompile = False


def test_rule_whose_fake_run_fails_is_named():
    @tfo.fusion_rule(name="host_only_rule", pattern=(GroupedLinear,), passes="forward", priority=10, replace=True)
    def host_only(ops, ctxs, x):
        ctxs[0].side["offsets"].tolist()  # fine eagerly on the CPU, impossible on meta tensors
        return ops[0].op_forward(ctxs[0], x)

    try:
        torch._dynamo.reset()
        seq = Sequential(GroupedLinear(G, H, H))
        x, side = torch.randn(ROWS, H), {"split_sizes": routing(0)["split_sizes"]}
        seq(x, **side)  # eager: runs
        with pytest.raises(Exception, match="fusion rule 'host_only_rule'"):
            torch.compile(seq, backend="aot_eager", fullgraph=True)(x, **side)
    finally:
        tfo.unregister_rule("host_only_rule")


def test_unsupported_configurations_raise_naming_the_op():
    torch._dynamo.reset()
    side = {"split_sizes": routing(0)["split_sizes"]}
    main_grad = Sequential(GroupedLinear(G, H, H, accumulate_main_grad=True))
    main_grad[0].weight.main_grad = torch.zeros(G, H, H)
    quantized = Sequential(GroupedLinear(G, H, H), tfo.Quantize("fp8_current"))
    for seq, match in ((main_grad, r"GroupedLinear \(op 0\): accumulate_main_grad"), (quantized, r"Quantize \(op 1\)")):
        with pytest.raises(Exception, match=match):
            torch.compile(seq, backend="aot_eager", fullgraph=True)(torch.randn(ROWS, H), **side)


def test_template_ids_name_their_structure():
    """A compiled call's template id (a constant in the graph inductor caches on disk) is a digest of
    its structure: another model cannot reuse a graph whose saved tensors have other shapes."""
    from te_fused_ops.custom_ops import _new_template_id
    from te_fused_ops.runner import get_plan, plan_info

    def made(out_features):
        ops = [GroupedLinear(2, 8, out_features)]
        info = plan_info(ops, torch.device("cpu"), torch.float32, True, frozenset(), [True], grad_on=True)
        return ops, get_plan(ops, info, {}, True)

    key = ("cpu", torch.float32, True, 2, True, (), ())
    (ops16, plan16), (ops32, plan32) = made(16), made(32)
    first, second = _new_template_id(ops16, plan16, key), _new_template_id(ops16, plan16, key)
    other = _new_template_id(ops32, plan32, key)
    assert first >> 20 == second >> 20 and first != second  # the same structure: one digest, counted apart
    assert other >> 20 != first >> 20


def test_settings_changed_between_compiled_calls_recompile():
    """``recompute_output`` decides what a step saves, ``accumulate_main_grad`` where the weight
    gradient goes: changed after a compiled call, the next call recompiles (equal to eager) or
    refuses, never reuses the old template."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    mlp = Sequential(GroupedLinear(G, H, 2 * I), SwiGLU(), GroupedLinear(G, I, H))
    side = routing(0)
    del side["probs"]
    x = torch.randn(ROWS, H, requires_grad=True)
    compiled = torch.compile(lambda x: mlp(x, **side).square().mean(), backend="aot_eager")
    for op, setting in ((1, False), (0, True), (2, True)):
        mlp[op].recompute_output = setting
        grads = []
        for fn in (compiled, lambda x: mlp(x, **side).square().mean()):
            x.grad = None
            mlp.zero_grad(set_to_none=True)
            fn(x).backward()
            grads.append([x.grad] + [p.grad for p in mlp.parameters()])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want)
    mlp[0].weight.main_grad = torch.zeros_like(mlp[0].weight)
    mlp[0].accumulate_main_grad = True
    with pytest.raises(Exception, match=r"GroupedLinear \(op 0\): accumulate_main_grad"):
        compiled(x)
