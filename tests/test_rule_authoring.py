"""User fusion rules: replace=True, and errors that name the rule when an implementation breaks the contract."""

import pytest
import torch

import te_fused_ops as tfo
from te_fused_ops import FusionRuleError, GroupedLinear, Sequential, SReLU
from te_fused_ops.fusion import FusionRuleTypeError, FusionRuleValueError

SPLITS = torch.tensor([3, 2])


@pytest.fixture
def rules():
    """Names of the rules a test registers; unregistered afterwards."""
    names = []
    yield names
    for name in names:
        tfo.unregister_rule(name)


def forward_rule(rules, fn, name="user_rule"):
    if name not in rules:
        rules.append(name)
    return tfo.fusion_rule(name=name, pattern=(GroupedLinear, SReLU), passes="forward", priority=100, replace=True)(fn)


def backward_rule(rules, fn, name="user_backward"):
    rules.append(name)
    return tfo.fusion_rule(name=name, pattern=(GroupedLinear, SReLU), passes="backward", priority=100)(fn)


def unfused_forward(ops, ctxs, x):
    return ops[1].op_forward(ctxs[1], ops[0].op_forward(ctxs[0], x))


def call(backward=True):
    torch.manual_seed(0)
    seq = Sequential(GroupedLinear(2, 8, 8), SReLU())
    y = seq(torch.randn(5, 8, requires_grad=True), split_sizes=SPLITS)
    if backward:
        y.sum().backward()
    return seq


def test_fusion_rule_replace(rules):
    forward_rule(rules, unfused_forward)
    with pytest.raises(ValueError, match="already registered"):
        tfo.fusion_rule(name="user_rule", pattern=(SReLU,), passes="forward")(unfused_forward)
    rule = forward_rule(rules, unfused_forward)  # a notebook cell run again
    assert [r for r in tfo.list_rules("forward") if r.name == "user_rule"] == [rule]


def test_forward_must_return_a_tensor(rules):
    forward_rule(rules, lambda ops, ctxs, x: (unfused_forward(ops, ctxs, x),))
    with pytest.raises(FusionRuleError, match=r"fusion rule 'user_rule' \(forward.*returned tuple of 1 \[Tensor\]; "
                                              r"a forward implementation must return the output tensor"):
        call()


def test_raising_implementation_names_rule_and_chains(rules):
    def broken(ops, ctxs, x):
        raise KeyError("weight")

    forward_rule(rules, broken)
    with pytest.raises(FusionRuleError, match=r"fusion rule 'user_rule' .*raised KeyError: 'weight'") as info:
        call()
    assert isinstance(info.value.__cause__, KeyError)


def test_bad_input_inside_a_rule_raises_as_the_unfused_op_does(rules):
    """An op's own input error passes through a rule unchanged: same type, same message."""
    forward_rule(rules, unfused_forward)
    errors = []
    for fuse in (True, False):
        seq = Sequential(GroupedLinear(2, 8, 8), SReLU(), fuse=fuse)
        with pytest.raises(ValueError, match=r"^GroupedLinear: argument 'x' must have shape") as info:
            seq(torch.randn(5, 7), split_sizes=SPLITS)
        errors.append(info.value)
    assert type(errors[0]) is type(errors[1]) and str(errors[0]) == str(errors[1])
    assert not isinstance(errors[0], FusionRuleError)


@pytest.mark.parametrize(
    "result",
    [None, "dx", (None,), (None, [{}]), (None, {}), (None, [{}, 3]), ([1.0], [{}, {}])],
    ids=["none", "str", "one", "short-list", "dict", "bad-entry", "bad-dx"],
)
def test_backward_must_return_dx_and_grads(rules, result):
    backward_rule(rules, lambda ops, ctxs, dy: result)
    with pytest.raises(FusionRuleError, match=r"fusion rule 'user_backward' \(backward.*must return \(dx, grads\).*"
                                              r"grads a list of 2 entries"):
        call()


def test_backward_rule_exception_names_rule(rules):
    def broken(ops, ctxs, dy):
        return ops[1].op_backward(ctxs[1], dy)[0] @ ctxs[0].params["weight"], [{}, {}]  # params are forward-only

    backward_rule(rules, broken)
    with pytest.raises(FusionRuleError, match=r"fusion rule 'user_backward' \(backward.*raised KeyError: 'weight'"):
        call()


def test_forward_rule_that_forgets_the_context(rules):
    forward_rule(rules, lambda ops, ctxs, x: torch.relu(ops[0].op_forward(ctxs[0], x)) ** 2)  # SReLU ctx left empty
    with pytest.raises(FusionRuleError, match=r"SReLU \(op 1\) backward raised AttributeError: ctx.saved has no "
                                              r"field 'input'.*; op 1 \(SReLU\) was run by forward rule 'user_rule'"
                                              r".*ctx.save_input"):
        call()


def test_correct_user_rules_match_unfused(rules):
    def backward(ops, ctxs, dy):
        d_pre, act_grads = ops[1].op_backward(ctxs[1], dy)
        dx, linear_grads = ops[0].op_backward(ctxs[0], d_pre)
        return dx, [linear_grads, act_grads]

    forward_rule(rules, unfused_forward)
    backward_rule(rules, backward)
    fused = call()
    assert [s.rule.name for s in fused.plan(torch.randn(5, 8, requires_grad=True), split_sizes=SPLITS).backward] == [
        "user_backward"
    ]
    while rules:
        tfo.unregister_rule(rules.pop())
    unfused = call()
    torch.testing.assert_close(fused[0].weight.grad, unfused[0].weight.grad)


def correct_backward(ops, ctxs, dy):
    d_pre, act_grads = ops[1].op_backward(ctxs[1], dy)
    dx, linear_grads = ops[0].op_backward(ctxs[0], d_pre)
    return dx, [linear_grads, act_grads]


@pytest.mark.parametrize("fault", ["misspelled", "no dx"])
def test_backward_result_contents_name_the_rule(rules, fault):
    """A gradient under a name that is not a parameter or side input of its op, or dx left out
    while the input needs one: errors naming the rule, not a KeyError or a silent None."""
    def backward(ops, ctxs, dy):
        dx, grads = correct_backward(ops, ctxs, dy)
        if fault == "misspelled":
            grads[0] = {"weigth": grads[0]["weight"]}
            return dx, grads
        return None, grads

    backward_rule(rules, backward)
    message = (r"rule 'user_backward'.*returned a gradient named 'weigth' for GroupedLinear \(op 0\), which has no such "
               r"parameter or side input" if fault == "misspelled" else
               r"fusion rule 'user_backward' \(backward.*returned dx None, but the input of op 0 needs a gradient")
    with pytest.raises(FusionRuleValueError, match=message):
        call()


@pytest.mark.parametrize("result", [False, True, 3])
def test_supports_must_return_none_or_a_reason(rules, result):
    rules.append("checked")
    tfo.fusion_rule(name="checked", pattern=(GroupedLinear, SReLU), passes="forward", priority=100,
                    supports=lambda ops, info: result)(unfused_forward)
    with pytest.raises(FusionRuleTypeError, match=r"fusion rule 'checked': its supports check must return None "
                                                      r"\(the rule applies\) or a str \(why not\), got"):
        call()


def test_raising_supports_names_the_rule(rules):
    def supports(ops, info):
        raise AttributeError("oops")

    rules.append("checked")
    tfo.fusion_rule(name="checked", pattern=(GroupedLinear, SReLU), passes="forward", priority=100,
                    supports=supports)(unfused_forward)
    with pytest.raises(FusionRuleError, match=r"fusion rule 'checked': its supports check raised AttributeError: oops"):
        call()


def test_late_changes_to_a_registered_rule_reach_plans_already_made(rules):
    """A check or an implementation added to a registered rule applies to the next call of a
    Sequential that already ran (its cached plan was made without it)."""
    calls = []

    def traced(ops, ctxs, x):
        calls.append(1)
        return unfused_forward(ops, ctxs, x)

    rule = forward_rule(rules, unfused_forward)
    seq = Sequential(GroupedLinear(2, 8, 8), SReLU())
    x = torch.randn(5, 8)
    seq(x, split_sizes=SPLITS)
    rule.set_reference(traced)
    seq(x, split_sizes=SPLITS)
    assert calls == [1]
    rule.supports(lambda ops, info: "disabled now")
    seq(x, split_sizes=SPLITS)
    assert calls == [1] and "disabled now" in seq.explain(x, split_sizes=SPLITS)


def test_replacing_a_rule_drops_the_backend_implementations_of_its_name(rules):
    """Implementations a backend registered by name were written for the replaced rule's pattern:
    the new rule of that name does not inherit them."""
    from te_fused_ops.backends import Backend, register_backend, unregister_backend

    fast = register_backend(Backend("fast_user", lambda info: None, preference=5))
    try:
        fast.implement("user_rule")(lambda ops, ctxs, x: ops[0].op_forward(ctxs[0], x))  # for a one-op pattern
        forward_rule(rules, unfused_forward)
        forward_rule(rules, unfused_forward)  # replaced: a new rule object of the same name
        assert "user_rule" not in fast.implementations
        seq = call(backward=False)
        assert "backend torch" in seq.explain(torch.randn(5, 8), split_sizes=SPLITS).split("backward:")[0]
    finally:
        unregister_backend("fast_user")


@pytest.mark.parametrize("fault", ["no weight gradient", "weight gradient of another shape"])
def test_backward_results_missing_or_misshapen_gradients_name_the_rule(rules, fault):
    """A weight that needs a gradient and gets none (the optimizer would skip it), or one of
    another shape (autograd would sum a leading dimension away): errors naming the rule."""
    def backward(ops, ctxs, dy):
        dx, grads = correct_backward(ops, ctxs, dy)
        grads[0] = {} if fault == "no weight gradient" else {"weight": grads[0]["weight"].expand(3, -1, -1, -1)}
        return dx, grads

    backward_rule(rules, backward)
    message = (r"rule 'user_backward'.*returned no gradient for 'weight' of GroupedLinear \(op 0\), which needs one"
               if fault == "no weight gradient" else
               r"rule 'user_backward'.*returned a gradient of shape \(3, 2, 8, 8\) for parameter 'weight' of "
               r"GroupedLinear \(op 0\), which has shape \(2, 8, 8\)")
    with pytest.raises(FusionRuleValueError, match=message):
        call()


def test_a_side_input_gradient_is_required_where_needed_and_dropped_where_not(rules):
    from te_fused_ops import ScaledSwiGLU

    def backward(ops, ctxs, dy, keep_probs):
        d_act, linear_grads = ops[1].op_backward(ctxs[1], dy)
        dx, act_grads = ops[0].op_backward(ctxs[0], d_act)
        return dx, [act_grads if keep_probs else {}, linear_grads]

    for keep_probs in (True, False):
        rules.append(f"scaled_{keep_probs}")
        tfo.fusion_rule(name=f"scaled_{keep_probs}", pattern=(ScaledSwiGLU, GroupedLinear), passes="backward",
                        priority=100)(lambda ops, ctxs, dy, keep=keep_probs: backward(ops, ctxs, dy, keep))
        seq = Sequential(ScaledSwiGLU(), GroupedLinear(2, 4, 8))
        x = torch.randn(5, 8, requires_grad=True)
        for probs_grad in (False, True):
            probs = torch.rand(5, requires_grad=probs_grad)
            y = seq(x, split_sizes=SPLITS, probs=probs)
            if probs_grad and not keep_probs:
                with pytest.raises(FusionRuleValueError, match=r"returned no gradient for 'probs' of ScaledSwiGLU"):
                    y.sum().backward()
            else:
                y.sum().backward()  # a probs gradient nobody needs is dropped
                assert (probs.grad is not None) == probs_grad
        tfo.unregister_rule(rules.pop())


def test_a_removed_or_replaced_rule_takes_its_backend_implementations_and_gets_them_back(rules):
    """unregister_rule drops what backends registered by the rule's name, as replace=True does, so
    a new rule of that name never runs them; registering the same rule object again (a built-in put
    back after a temporary replacement) restores them."""
    from te_fused_ops.backends import Backend, register_backend, unregister_backend

    fast = register_backend(Backend("fast_user", lambda info: None, preference=5))
    try:
        fast.implement("user_rule")(lambda ops, ctxs, x: unfused_forward(ops, ctxs, x))
        original = forward_rule(rules, unfused_forward)
        assert "backend fast_user" in call(backward=False).explain(torch.randn(5, 8), split_sizes=SPLITS)
        tfo.unregister_rule("user_rule")
        assert "user_rule" not in fast.implementations
        tfo.register_rule(original, priority=100)
        assert "user_rule" in fast.implementations
        replacement = tfo.FusionRule("user_rule", (GroupedLinear, SReLU), "forward", reference=unfused_forward)
        tfo.register_rule(replacement, priority=100, replace=True)
        assert "user_rule" not in fast.implementations
        tfo.register_rule(original, priority=100, replace=True)
        assert "user_rule" in fast.implementations
    finally:
        unregister_backend("fast_user")


@pytest.mark.parametrize("check", [lambda info: True, lambda info: 1 / 0])
def test_a_backend_availability_check_is_held_to_the_rules_of_checks(rules, check):
    from te_fused_ops.backends import Backend, register_backend, unregister_backend

    mine = register_backend(Backend("mine", check, preference=5))
    try:
        mine.implement("user_rule")(unfused_forward)
        forward_rule(rules, unfused_forward)
        with pytest.raises(FusionRuleError, match=r"backend 'mine': its unavailable_reason check (must return None|raised "
                                                  r"ZeroDivisionError)"):
            call(backward=False)
    finally:
        unregister_backend("mine")


def test_a_swiglu_subclass_with_its_own_gate_is_not_the_swiglu_kernel():
    from te_fused_ops import ScaledSwiGLU, SwiGLU

    class SiGLU(SwiGLU):
        def gate_fn(self, gate):
            s = torch.sigmoid(gate)
            return s, s * (1 - s)

    class NamedSwiGLU(SwiGLU):
        pass

    assert SiGLU.kernel_name is None and NamedSwiGLU.kernel_name == "swiglu" and ScaledSwiGLU.kernel_name == "scaled_swiglu"


def test_priority_must_be_an_int(rules):
    rule = tfo.FusionRule("user_rule", (GroupedLinear, SReLU), "forward", reference=unfused_forward)
    for bad in (0.9, "10", None, True):
        with pytest.raises(TypeError, match="register_rule: argument 'priority' must be an int"):
            tfo.register_rule(rule, priority=bad)


def test_rule_and_backend_arguments_are_checked_by_name():
    from te_fused_ops.backends import register_backend
    from te_fused_ops.fusion import FusionRule

    with pytest.raises(TypeError, match=r"FusionRule 'mine': argument 'formats' must be a collection of boundaries "
                                        r"0..1, got 0"):
        FusionRule("mine", [GroupedLinear], "forward", formats=0)
    with pytest.raises(ValueError, match=r"FusionRule 'mine': argument 'formats' must hold boundaries 0..1"):
        FusionRule("mine", [GroupedLinear], "forward", formats=[2])
    with pytest.raises(TypeError, match=r"register_backend: argument 'backend' must be a te_fused_ops Backend, got str"):
        register_backend("x")
