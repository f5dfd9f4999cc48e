"""Fusion rules: each built-in rule equals the unfused chain, explain() shows it, user rules."""

import copy

import pytest
import torch

import reference as ref
import te_fused_ops as tfo
from te_fused_ops import (
    ClampedSwiGLU,
    FusionRule,
    GeGLU,
    GroupedLinear,
    Quantize,
    ScaledSwiGLU,
    Sequential,
    SReLU,
    SwiGLU,
    Transpose,
)
from te_fused_ops.quantization import get_recipe
from te_fused_ops.runner import saved_tensor_bytes

G, H, I = 4, 32, 16
SPLITS = torch.tensor([0, 13, 6, 0])  # zero groups first and last; rows 19.. are padding
ROWS = 24


def make_pair(*ops):
    """The same ops twice (same parameters): fused, and with fusion disabled."""
    fused = Sequential(*ops)
    unfused = Sequential(*[copy.deepcopy(op) for op in ops], fuse=False)
    return fused, unfused


def run(seq, x, probs=None):
    x = x.detach().clone().requires_grad_(True)
    side = {"split_sizes": SPLITS}
    if probs is not None:
        probs = probs.detach().clone().requires_grad_(True)
        side["probs"] = probs
    side = {k: v for k, v in side.items() if k in {n for op in seq for n in op.side_inputs}}
    y = seq(x, **side)
    torch.manual_seed(99)
    dy = torch.randn(y.shape, dtype=y.dtype)
    y.backward(dy)
    grads = [x.grad] + [p.grad for p in seq.parameters()] + ([probs.grad] if probs is not None else [])
    return y, grads


def fired(seq, x, passes="forward", **side):
    plan = seq.plan(x.detach().requires_grad_(True), split_sizes=SPLITS, **side)
    return {step.rule.name for step in getattr(plan, passes) if step.rule is not None}


CASES = {  # "<the rule that fires>[/variant]": the ops
    "grouped_linear+activation": lambda: (GroupedLinear(G, H, 2 * I), SwiGLU(), GroupedLinear(G, I, H)),
    "grouped_linear+activation/geglu": lambda: (GroupedLinear(G, H, 2 * I, bias=True), GeGLU(), GroupedLinear(G, I, H)),
    "grouped_linear+activation/srelu": lambda: (GroupedLinear(G, H, I), SReLU(), GroupedLinear(G, I, H)),
    "grouped_linear+activation/clamped": lambda: (GroupedLinear(G, H, 2 * I), ClampedSwiGLU(), GroupedLinear(G, I, H)),
    "grouped_linear+activation/output_format": lambda: (
        GroupedLinear(G, H, 2 * I),
        SwiGLU(),
        Quantize("fp8_blockwise"),
        GroupedLinear(G, I, H),
    ),
    "grouped_linear+activation/output_format_columns": lambda: (
        GroupedLinear(G, H, 2 * I),
        SwiGLU(),
        Quantize("mxfp8", quantize_grad=True),
        Transpose(),
        GroupedLinear(G, I, H),
    ),
    "grouped_linear+activation/input_and_output_formats": lambda: (
        Quantize("fp8_current"),
        GroupedLinear(G, H, 2 * I),
        SwiGLU(),
        Quantize("fp8_current"),
        GroupedLinear(G, I, H),
    ),
    "grouped_linear/output_format": lambda: (GroupedLinear(G, H, 2 * I), Quantize("fp8_current"), SwiGLU()),
    "grouped_linear/input_format_columns": lambda: (Quantize("fp8_blockwise"), Transpose(), GroupedLinear(G, H, I)),
    "grouped_linear/input_format": lambda: (Quantize("fp8_blockwise"), GroupedLinear(G, H, I)),
    "grouped_linear/lone_transpose": lambda: (Transpose(), GroupedLinear(G, H, I)),
    "grouped_linear/output_format_columns": lambda: (
        GroupedLinear(G, H, I),
        Quantize("fp8_blockwise"),
        Transpose(),
        GroupedLinear(G, I, H),
    ),
    "quantize": lambda: (Quantize("fp8_blockwise"), SReLU(), GroupedLinear(G, H, I)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_rule_fused_equals_unfused(case):
    torch.manual_seed(7)
    fused, unfused = make_pair(*CASES[case]())
    x = torch.randn(ROWS, H)
    rule = case.split("/")[0]
    assert rule in fired(fused, x), fused.explain(x, split_sizes=SPLITS)
    assert not fired(unfused, x)
    y_f, grads_f = run(fused, x)
    y_u, grads_u = run(unfused, x)
    assert ref.rel_err(y_f, y_u) <= 1e-6
    for gf, gu in zip(grads_f, grads_u):
        assert ref.rel_err(gf, gu) <= 1e-6
    assert torch.all(y_f[19:] == 0) and torch.all(grads_f[0][19:] == 0)


def test_scaled_swiglu_rule_with_probs():
    torch.manual_seed(8)
    fused, unfused = make_pair(GroupedLinear(G, H, 2 * I), ScaledSwiGLU(), GroupedLinear(G, I, H))
    x, probs = torch.randn(ROWS, H), torch.rand(ROWS)
    assert "grouped_linear+activation" in fired(fused, x, probs=probs)
    y_f, grads_f = run(fused, x, probs)
    y_u, grads_u = run(unfused, x, probs)
    assert ref.rel_err(y_f, y_u) <= 1e-6
    for gf, gu in zip(grads_f, grads_u):
        assert ref.rel_err(gf, gu) <= 1e-6


@pytest.mark.parametrize("act", ["swiglu", "clamped"])
def test_backward_rule_fires_and_matches_float64(act):
    torch.manual_seed(9)
    act_op, fn = (SwiGLU(), ref.swiglu) if act == "swiglu" else (ClampedSwiGLU(), ref.clamped_swiglu)
    seq = Sequential(GroupedLinear(G, H, 2 * I, bias=True), act_op, GroupedLinear(G, I, H))
    x = torch.randn(ROWS, H) * 2
    assert fired(seq, x, passes="backward") == {"dactivation+grouped_linear", "grouped_linear_backward"}
    y, grads = run(seq, x)

    x64 = x.double().requires_grad_(True)
    w1, b1, w2 = (p.detach().double().requires_grad_(True) for p in seq.parameters())
    splits = SPLITS.tolist()
    y64 = ref.grouped_linear(fn(ref.grouped_linear(x64, w1, b1, splits)), w2, None, splits)
    torch.manual_seed(99)
    y64.backward(torch.randn(y.shape).double())
    assert ref.rel_err(y, y64) <= 1e-5
    for got, want in zip(grads, [x64.grad, w1.grad, b1.grad, w2.grad]):
        assert ref.rel_err(got, want) <= 1e-5


def test_fused_forward_saves_less_than_unfused():
    torch.manual_seed(10)
    fused, unfused = make_pair(GroupedLinear(G, H, 2 * I), SwiGLU(), GroupedLinear(G, I, H))
    x = torch.randn(ROWS, H, requires_grad=True)
    saved_fused = saved_tensor_bytes(fused(x, split_sizes=SPLITS))
    saved_unfused = saved_tensor_bytes(unfused(x, split_sizes=SPLITS))
    # unfused keeps x, pre (M, 2I) and the activation output (M, I); fused recomputes the last;
    # both keep the int32 group offsets (G+1,); parameters are not counted
    assert saved_unfused - saved_fused == ROWS * I * 4
    assert saved_fused == ROWS * H * 4 + ROWS * 2 * I * 4 + (G + 1) * 4


def test_explain_names_rules_backends_and_reasons():
    seq = Sequential(GroupedLinear(G, H, 2 * I), SwiGLU(), GroupedLinear(G, I, H))
    text = seq.explain(torch.randn(ROWS, H), split_sizes=SPLITS)
    assert "[0:2] GroupedLinear, SwiGLU -> rule 'grouped_linear+activation' (backend torch)" in text
    assert "sm90 backend: no CUDA device" in text
    assert "backward:" in text and "dactivation+grouped_linear" in text
    assert "basic op" in Sequential(SwiGLU()).explain(torch.randn(2, 4))
    with pytest.raises(TypeError, match=r"Sequential.plan: argument 'x' must be a torch.Tensor or None, got list"):
        seq.explain([1, 2], split_sizes=SPLITS)


def test_explain_reports_first_failing_condition_of_user_rule():
    rule = FusionRule(
        "needs_fp64", pattern=(GroupedLinear, SReLU), passes="forward",
        supports=lambda ops, info, backend: None if info.dtype == torch.float64 else f"dtype {info.dtype} not supported",
    )
    rule.set_reference(lambda ops, ctxs, x: ops[1].op_forward(ctxs[1], ops[0].op_forward(ctxs[0], x)))
    tfo.register_rule(rule, priority=100)
    try:
        seq = Sequential(GroupedLinear(G, H, I), SReLU())
        text = seq.explain(torch.randn(ROWS, H), split_sizes=SPLITS)
        assert "not fired: rule 'needs_fp64' on [0:2]: dtype torch.float32 not supported" in text
    finally:
        tfo.unregister_rule("needs_fp64")


def test_user_rule_fires_and_unregisters():
    calls = []

    @tfo.fusion_rule(name="test_linear_srelu", pattern=(GroupedLinear, SReLU), passes="forward", priority=50)
    def linear_srelu(ops, ctxs, x):
        calls.append(len(ops))
        y = ops[0].op_forward(ctxs[0], x)
        return ops[1].op_forward(ctxs[1], y)

    try:
        assert linear_srelu in tfo.list_rules("forward")
        assert tfo.list_rules("forward").index(linear_srelu) < tfo.list_rules("forward").index(
            next(r for r in tfo.list_rules() if r.name == "grouped_linear+activation")
        )
        torch.manual_seed(11)
        seq = Sequential(GroupedLinear(G, H, I), SReLU())
        x = torch.randn(ROWS, H)
        assert "test_linear_srelu" in fired(seq, x)
        y = seq(x, split_sizes=SPLITS)
        assert calls == [2]
        expected = ref.srelu(ref.grouped_linear(x.double(), seq[0].weight.double(), None, SPLITS.tolist()))
        assert ref.rel_err(y, expected) <= 1e-5
    finally:
        tfo.unregister_rule("test_linear_srelu")
    assert "test_linear_srelu" not in [r.name for r in tfo.list_rules()]
    assert "grouped_linear+activation" in fired(seq, x)
    seq(x, split_sizes=SPLITS)
    assert calls == [2]


def test_duplicate_registration_and_unknown_unregister():
    with pytest.raises(ValueError, match="already registered"):
        tfo.register_rule(tfo.list_rules("forward")[0])
    with pytest.raises(KeyError, match="no rule named"):
        tfo.unregister_rule("does-not-exist")
    with pytest.raises(ValueError, match=r"list_rules: argument 'passes' must be one of \('forward', 'backward'\)"):
        tfo.list_rules("sideways")


def test_plan_cached_per_key_not_per_split_values():
    seq = Sequential(GroupedLinear(G, H, 2 * I), SwiGLU(), GroupedLinear(G, I, H))
    x = torch.randn(ROWS, H)
    seq(x, split_sizes=SPLITS)
    seq(x, split_sizes=torch.tensor([5, 5, 5, 5]))
    seq(torch.randn(ROWS + 8, H), split_sizes=SPLITS)
    assert len(seq._plans) == 1
    plan = seq.plan(x, split_sizes=SPLITS)
    assert seq.plan(x, split_sizes=torch.tensor([1, 2, 3, 4])) is plan
    seq(x.requires_grad_(True), split_sizes=SPLITS)
    assert len(seq._plans) == 2
    with torch.no_grad():
        seq(x, split_sizes=SPLITS)
    assert len(seq._plans) == 3


def test_plan_cache_invalidated_by_registry_changes():
    seq = Sequential(GroupedLinear(G, H, I), SReLU())
    x = torch.randn(ROWS, H)
    before = seq.plan(x, split_sizes=SPLITS)
    rule = FusionRule("temporary", pattern=(SReLU,), passes="forward")
    rule.set_reference(lambda ops, ctxs, x: ops[0].op_forward(ctxs[0], x))
    tfo.register_rule(rule)
    try:
        assert seq.plan(x, split_sizes=SPLITS) is not before
    finally:
        tfo.unregister_rule(rule)


def test_plans_of_older_registries_are_dropped():
    """A rule registered and removed again and again (a notebook re-running its cell) leaves one
    plan per live key in the cache, not one per registry version."""
    seq = Sequential(GroupedLinear(G, H, I), SReLU())
    x = torch.randn(ROWS, H)
    for _ in range(5):
        rule = FusionRule("temporary", pattern=(SReLU,), passes="forward")
        rule.set_reference(lambda ops, ctxs, x: ops[0].op_forward(ctxs[0], x))
        tfo.register_rule(rule)
        try:
            seq(x, split_sizes=SPLITS)
            with torch.no_grad():
                seq(x, split_sizes=SPLITS)
        finally:
            tfo.unregister_rule(rule)
        assert len(seq._plans) == 2
    seq(x, split_sizes=SPLITS)
    assert len(seq._plans) == 1


def test_fusion_disabled_by_env(monkeypatch):
    seq = Sequential(GroupedLinear(G, H, 2 * I), SwiGLU())
    x = torch.randn(ROWS, H)
    monkeypatch.setenv("TE_FUSED_OPS_FUSION", "0")
    assert not fired(seq, x)
    monkeypatch.setenv("TE_FUSED_OPS_FUSION", "1")
    assert fired(seq, x) == {"grouped_linear+activation"}


def test_forced_torch_backend(monkeypatch):
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    seq = Sequential(GroupedLinear(G, H, 2 * I), SwiGLU())
    plan = seq.plan(torch.randn(ROWS, H), split_sizes=SPLITS)
    assert [s.backend for s in plan.forward] == ["torch"]
    assert "sm90" not in plan.explain(list(seq))


def _sm90_info(ops, dtype=torch.bfloat16, capability=(9, 0), input_recipe=None):
    n = len(ops)
    recipe = None if input_recipe is None else get_recipe(input_recipe)
    return tfo.PlanInfo("cuda", capability, dtype, (False,) * n, (True,) * n, (recipe,) + (None,) * (n - 1))


def test_planner_prefers_a_shorter_sm90_rule_over_a_longer_torch_one(monkeypatch):
    """fp8_blockwise chain on an input quantized upstream: GroupGemm + activation with the
    Quantize + Transpose folded as its output runs only in torch there (the FP8 kernel has no
    act-cast epilogue); GroupGemm + activation on the FP8 kernel wins, the casts join the next
    GroupedLinear as its input format; a priority still overrides."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # compile-only mode: CuTe DSL counts as available
    ops = [GroupedLinear(4, 64, 256), SwiGLU(), Quantize("fp8_blockwise"), Transpose(), GroupedLinear(4, 128, 64)]
    recipe = get_recipe("fp8_blockwise")
    info = tfo.PlanInfo("cuda", (9, 0), torch.bfloat16, (True,) * 5, (True,) * 5, (recipe, recipe, None, recipe, recipe))
    plan = tfo.fusion.make_plan(ops, info)
    chosen = [(s.rule.name if s.rule else None, s.start, s.stop, s.backend) for s in plan.forward]
    assert chosen == [("grouped_linear+activation", 0, 2, "sm90"), ("grouped_linear", 2, 5, "sm90")]
    text = plan.explain(ops)
    assert ("rule 'grouped_linear+activation' on [0:4]: ran on [0:2] instead; sm90 backend: quantized input") in text
    assert "rule 'quantize' on [2:3]: overlaps rule 'grouped_linear' chosen first" in text, text
    backward = [(s.rule.name, s.start, s.backend) for s in plan.backward if s.rule is not None]
    # FC1's FP8 backward fed d_pre's E4M3 copies by the dAct kernel's epilogue
    assert backward == [("grouped_linear+dactivation+grouped_linear", 0, "sm90")]
    pattern = (GroupedLinear, SwiGLU, Quantize, Transpose)
    tfo.fusion_rule("preferred_torch", pattern, "forward", priority=1)(lambda ops, ctxs, x: x)
    try:
        first = tfo.fusion.make_plan(ops, info).forward[0]
        assert (first.rule.name, first.backend) == ("preferred_torch", "torch")
    finally:
        tfo.unregister_rule("preferred_torch")


def test_explain_reports_rules_at_covered_positions():
    """A higher-priority rule whose first op lies inside an earlier step does not fire, and
    explain() says which rule covered it; the documented order: the first uncovered position
    decides, priority only among the rules matching there."""
    tfo.fusion_rule("act_then_linear", (SwiGLU, GroupedLinear), "forward", priority=10)(
        lambda ops, ctxs, x: ops[1].op_forward(ctxs[1], ops[0].op_forward(ctxs[0], x)))
    try:
        assert tfo.list_rules("forward")[0].name == "act_then_linear"
        seq = Sequential(GroupedLinear(G, H, 2 * I), SwiGLU(), GroupedLinear(G, I, H))
        x = torch.randn(ROWS, H)
        assert fired(seq, x) == {"grouped_linear+activation", "grouped_linear"}
        text = seq.explain(x, split_sizes=SPLITS)
        assert ("not fired: rule 'act_then_linear' on [1:3]: positions already covered by rule "
                "'grouped_linear+activation' (priority 0)") in text, text
        seq2 = Sequential(SReLU(), SwiGLU(), GroupedLinear(G, I, H))  # nothing covers SwiGLU: it fires
        assert "act_then_linear" in fired(seq2, torch.randn(ROWS, 2 * I))
    finally:
        tfo.unregister_rule("act_then_linear")


def test_sm90_supports_reports_kernel_limits_in_explain(monkeypatch):
    """What the sm90 kernel cannot do shows up as the rule's reason, and the torch backend runs."""
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # compile-only mode: CuTe DSL counts as available
    rule = next(r for r in tfo.list_rules() if r.name == "grouped_linear+activation")
    ok = [GroupedLinear(4, 64, 128), SwiGLU()]
    assert rule.first_failure(ok, _sm90_info(ok), "sm90") is None
    cases = [
        ([GroupedLinear(4, 100, 128), SwiGLU()], {}, "K=100 not a multiple of 8"),
        ([GroupedLinear(4, 64, 96), SwiGLU()], {}, "N=96 not a multiple of 64 for a GLU activation"),
        (ok, {"dtype": torch.float32}, "dtype float32 not supported"),
        (ok, {"capability": (8, 0)}, "compute capability 8.0, needs 9.0"),
        (ok, {"input_recipe": "mxfp8"}, "mxfp8 input: emulated on Hopper, which has no MX block-scaling hardware"),
        ([GroupedLinear(4, 64, 192), SwiGLU()], {"input_recipe": "fp8_blockwise"},
         "N=192 not a multiple of 128 (FP8, activation 'swiglu')"),
        ([GroupedLinear(4, 72, 128), SwiGLU()], {"input_recipe": "fp8_blockwise"}, "K=72 not a multiple of 16"),
    ]
    for recipe in ("fp8_blockwise", "fp8_current"):
        assert rule.first_failure(ok, _sm90_info(ok, input_recipe=recipe), "sm90") is None
    for ops, kw, reason in cases:
        assert reason in rule.first_failure(ops, _sm90_info(ops, **kw), "sm90")
    ops = [GroupedLinear(4, 100, 128), SwiGLU(), GroupedLinear(4, 64, 96)]
    plan = tfo.fusion.make_plan(ops, _sm90_info(ops))
    first, second = plan.forward
    assert (first.rule.name, first.backend) == ("grouped_linear+activation", "torch")
    assert "sm90 backend: K=100 not a multiple of 8" in plan.explain(ops)
    assert (second.rule.name, second.backend) == ("grouped_linear", "sm90")
