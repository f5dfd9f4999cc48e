"""The rule-based fusion pass: rules, the registry, kernel backends and the planner.

A rule matches a contiguous sequence of op types (``pattern``, in forward order) for one pass
("forward" or "backward") and has one implementation per backend. Implementations:

- forward:  ``impl(ops, ctxs, x) -> y``
- backward: ``impl(ops, ctxs, dy) -> (dx, grads)``, ``grads`` a list (one per op) of dicts
  mapping parameter or side-input names to gradients.

``ctxs`` are the ops' `OpContext` objects; a rule fills them the way the unfused ops would,
so the other pass can be planned independently.
"""

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from . import env

PASSES = ("forward", "backward")


@dataclass(frozen=True)
class PlanInfo:
    """Everything a plan may depend on (never split values)."""

    device_type: str
    capability: Optional[tuple]
    dtype: torch.dtype
    input_requires_grad: tuple  # per op: does the op's input need a gradient
    params_require_grad: tuple  # per op: does any of its parameters need a gradient
    input_recipe: tuple  # per op: the Recipe of a QuantizedTensor input, else None

    def window(self, start: int, stop: int) -> "PlanInfo":
        """The same info with the per-op fields cut to ops[start:stop] (what a rule's supports() sees)."""
        return PlanInfo(
            self.device_type,
            self.capability,
            self.dtype,
            self.input_requires_grad[start:stop],
            self.params_require_grad[start:stop],
            self.input_recipe[start:stop],
        )

    @property
    def device_label(self) -> str:
        if self.capability is None:
            return self.device_type
        return f"{self.device_type}:sm{self.capability[0]}{self.capability[1]}"


# ---------------------------------------------------------------------------------------------
# backends


def _torch_backend_reason(info: PlanInfo) -> Optional[str]:
    return None


def _sm90_backend_reason(info: PlanInfo) -> Optional[str]:
    if info.device_type != "cuda":
        return "no CUDA device"
    if info.capability != (9, 0):
        return f"compute capability {info.capability[0]}.{info.capability[1]}, needs 9.0"
    from .backends.sm90.kernels import sm90_unavailable_reason

    reason = sm90_unavailable_reason()
    return reason.removeprefix("sm90 backend: ") if reason else None


BACKENDS: dict = {"sm90": _sm90_backend_reason, "torch": _torch_backend_reason}
"""Backend name -> availability check, in order of preference."""


def forced_backend() -> Optional[str]:
    """TE_FUSED_OPS_BACKEND=torch (or another backend name) forces that backend for every rule."""
    return env.read("TE_FUSED_OPS_BACKEND")


def fusion_enabled_by_env() -> bool:
    """TE_FUSED_OPS_FUSION=0 turns every rule off."""
    return env.read("TE_FUSED_OPS_FUSION")


# ---------------------------------------------------------------------------------------------
# rules


class FusionRule:
    """A named pattern of op types for one pass, with implementations per backend.

    ``supports(ops, info, backend)`` returns None when the rule can run on ``backend`` or the
    first failing condition as a short string; ``info`` is a `PlanInfo` whose per-op fields are
    aligned with ``ops`` (the matched ops). Build one directly or with `fusion_rule`.
    """

    def __init__(self, name: str, pattern, passes: str, supports: Optional[Callable] = None):
        from .ops.base import BasicOp

        if not isinstance(name, str) or not name:
            raise ValueError("FusionRule: argument 'name' must be a non-empty string")
        pattern = tuple(pattern) if isinstance(pattern, (list, tuple)) else (pattern,)
        if not pattern:
            raise ValueError(f"FusionRule '{name}': argument 'pattern' is empty")
        for entry in pattern:
            if not (inspect.isclass(entry) and issubclass(entry, BasicOp)):
                raise TypeError(
                    f"FusionRule '{name}': argument 'pattern' must hold op types (BasicOp subclasses), got {entry!r}"
                )
        if passes not in PASSES:
            raise ValueError(f"FusionRule '{name}': argument 'passes' must be 'forward' or 'backward', got {passes!r}")
        if supports is not None and not callable(supports):
            raise TypeError(f"FusionRule '{name}': argument 'supports' must be callable")
        self.name = name
        self.pattern = pattern
        self.passes = passes
        self.implementations: dict = {}
        self._supports = supports

    def implementation(self, backend: str):
        """Decorator registering ``fn`` as this rule's implementation for ``backend``."""
        if backend not in BACKENDS:
            raise ValueError(f"FusionRule '{self.name}': unknown backend {backend!r}; known: {', '.join(BACKENDS)}")

        def decorate(fn):
            self.implementations[backend] = fn
            return fn

        return decorate

    def supports(self, fn):
        """Decorator setting the ``supports(ops, info, backend)`` check."""
        self._supports = fn
        return fn

    def matches(self, ops) -> bool:
        return len(ops) == len(self.pattern) and all(isinstance(op, t) for op, t in zip(ops, self.pattern))

    def first_failure(self, ops, info: PlanInfo, backend: str) -> Optional[str]:
        if backend not in self.implementations:
            return "no implementation"
        reason = BACKENDS[backend](info)
        if reason is None and self._supports is not None:
            reason = self._supports(ops, info, backend)
        return reason

    def __repr__(self) -> str:
        names = ", ".join(t.__name__ for t in self.pattern)
        return f"FusionRule({self.name!r}, [{names}], {self.passes}, backends={list(self.implementations)})"


@dataclass
class _Entry:
    rule: FusionRule
    priority: int
    order: int


_registry: dict = {}
_registry_version = [0]


def registry_version() -> int:
    return _registry_version[0]


def register_rule(rule: FusionRule, priority: int = 0, replace: bool = False) -> FusionRule:
    """Add ``rule``. Where rules match at the same position the planner takes the higher
    ``priority``, then the better backend, then the longer pattern, then the older rule."""
    if not isinstance(rule, FusionRule):
        raise TypeError(f"register_rule: argument 'rule' must be a FusionRule, got {type(rule).__name__}")
    if not rule.implementations:
        raise ValueError(f"register_rule: rule '{rule.name}' has no implementation")
    if rule.name in _registry and not replace:
        raise ValueError(f"register_rule: a rule named '{rule.name}' is already registered (pass replace=True)")
    _registry[rule.name] = _Entry(rule, int(priority), _registry_version[0])
    _registry_version[0] += 1
    return rule


def unregister_rule(rule) -> None:
    """Remove a rule by name or object; unknown names raise KeyError."""
    name = rule.name if isinstance(rule, FusionRule) else rule
    if name not in _registry:
        raise KeyError(f"unregister_rule: no rule named {name!r}")
    del _registry[name]
    _registry_version[0] += 1


def list_rules(passes: Optional[str] = None) -> list:
    """Registered rules in the order the planner tries them."""
    entries = sorted(_registry.values(), key=lambda e: (-e.priority, -len(e.rule.pattern), e.order))
    return [e.rule for e in entries if passes is None or e.rule.passes == passes]


def fusion_rule(
    name: str, pattern, passes: str, backend: str = "torch", supports=None, priority: int = 0, replace: bool = False
):
    """Decorator: make a one-backend rule from an implementation function and register it
    (``replace=True``: over a rule of the same name, e.g. when a notebook cell runs again)."""

    def decorate(fn):
        rule = FusionRule(name, pattern, passes, supports=supports)
        rule.implementation(backend)(fn)
        register_rule(rule, priority=priority, replace=replace)
        return rule

    return decorate


# ---------------------------------------------------------------------------------------------
# plans


class FusionRuleError(RuntimeError):
    """A fusion rule's implementation raised or broke the implementation contract; names the rule.

    Raised from a ValueError or TypeError (e.g. bad input met inside a rule), it is one of those too.
    """


class FusionRuleValueError(FusionRuleError, ValueError):
    pass


class FusionRuleTypeError(FusionRuleError, TypeError):
    pass


def _error_class(error: Exception) -> type:
    if isinstance(error, ValueError):
        return FusionRuleValueError
    return FusionRuleTypeError if isinstance(error, TypeError) else FusionRuleError


def _describe(value, depth: int = 0) -> str:
    """Short structure of a returned value: ``tuple of 2 [Tensor, list of 1 [dict]]``."""
    if isinstance(value, (list, tuple)) and depth < 2:
        items = ", ".join(_describe(v, depth + 1) for v in value[:4])
        return f"{type(value).__name__} of {len(value)} [{items}{', ...' if len(value) > 4 else ''}]"
    return type(value).__name__


def _is_backward_result(result, num_ops: int) -> bool:
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        return False
    dx, grads = result
    return (
        (dx is None or isinstance(dx, torch.Tensor))
        and isinstance(grads, (list, tuple))
        and len(grads) == num_ops
        and all(g is None or isinstance(g, dict) for g in grads)
    )


def _context_hint(ctxs, error: Exception) -> str:
    """For a KeyError in a backward: what the contexts hold and which forward rule filled them."""
    if not isinstance(error, KeyError):
        return ""
    hints = [
        f"op {ctx.index} ({ctx.op.op_name}) was run by forward rule '{ctx.forward_rule}' and its context holds "
        f"saved {sorted(ctx.saved)}, side {sorted(ctx.side)}"
        for ctx in ctxs
        if ctx.forward_rule
    ]
    if not hints:
        return ""
    return (
        "; " + "; ".join(hints) + ". A forward rule must fill each op's context as the op's own forward "
        "would (ctx.save_input(x), ctx.saved[...]); the backward sees only ctx.saved and ctx.side"
    )


@dataclass
class Step:
    """One unit of a pass: ops[start:stop] run by ``rule`` on ``backend`` (rule None: the basic op)."""

    start: int
    stop: int
    rule: Optional[FusionRule] = None
    backend: str = "torch"
    skipped_backends: list = field(default_factory=list)  # [(backend, reason)] tried before this one

    def run(self, ops, ctxs, value, passes: str):
        """The step's result; a rule's failure or wrong result raises `FusionRuleError` naming it."""
        if self.rule is None:
            return self._run_op(ops[self.start], ctxs[self.start], value, passes)
        window, window_ctxs = ops[self.start : self.stop], ctxs[self.start : self.stop]
        try:
            result = self.rule.implementations[self.backend](window, window_ctxs, value)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            hint = _context_hint(window_ctxs, error) if passes == "backward" else ""
            message = f"raised {type(error).__name__}: {error}{hint}"
            raise _error_class(error)(self._where(window, passes) + message) from error
        if passes == "forward":
            if not isinstance(result, torch.Tensor):
                raise FusionRuleError(
                    f"{self._where(window, passes)}returned {_describe(result)}; "
                    "a forward implementation must return the output tensor"
                )
            for ctx in window_ctxs:
                ctx.forward_rule = self.rule.name
        elif not _is_backward_result(result, len(window)):
            raise FusionRuleError(
                f"{self._where(window, passes)}returned {_describe(result)}; a backward implementation must "
                f"return (dx, grads): dx a tensor or None, grads a list of {len(window)} entries (one per op, "
                "each a dict from parameter or side-input name to gradient, or None)"
            )
        return result

    def _run_op(self, op, ctx, value, passes: str):
        if passes == "forward":
            return op.op_forward(ctx, value)
        try:
            dx, grads = op.op_backward(ctx, value)
        except KeyError as error:
            hint = _context_hint([ctx], error)
            if not hint:
                raise
            raise FusionRuleError(f"{op.op_name} (op {ctx.index}) backward raised KeyError: {error}{hint}") from error
        return dx, [grads]

    def _where(self, window, passes: str) -> str:
        names = ", ".join(op.op_name for op in window)
        return f"fusion rule '{self.rule.name}' ({passes}, backend {self.backend}, ops [{self.start}:{self.stop}] {names}) "


@dataclass
class Plan:
    info: PlanInfo
    forward: list
    backward: list  # in execution order (last ops first)
    not_fired: dict  # pass -> [(rule name, start, stop, reason)]
    templates: dict = field(default_factory=dict)  # call signature -> custom_ops.RunTemplate (torch.compile)

    def explain(self, ops) -> str:
        lines = [f"plan for {self.info.device_label}, dtype {str(self.info.dtype).removeprefix('torch.')}"]
        for passes, steps in (("forward", self.forward), ("backward", self.backward)):
            lines.append(f"{passes}:")
            for step in steps:
                names = ", ".join(op.op_name for op in ops[step.start : step.stop])
                where = f"[{step.start}]" if step.stop - step.start == 1 else f"[{step.start}:{step.stop}]"
                what = f"rule '{step.rule.name}'" if step.rule is not None else "basic op"
                line = f"  {where} {names} -> {what} (backend {step.backend})"
                if step.skipped_backends:
                    line += "; " + "; ".join(f"{b} backend: {r}" for b, r in step.skipped_backends)
                lines.append(line)
            for name, start, stop, reason in self.not_fired[passes]:
                lines.append(f"  not fired: rule '{name}' on [{start}:{stop}]: {reason}")
        return "\n".join(lines)


def _choose_backend(rule: FusionRule, ops, info: PlanInfo):
    """(backend, skipped) for the first backend that can run, or (None, skipped)."""
    forced = forced_backend()
    order = [forced] if forced else list(BACKENDS)
    skipped = []
    for backend in order:
        if backend not in rule.implementations:
            continue
        reason = rule.first_failure(ops, info, backend)
        if reason is None:
            return backend, skipped
        skipped.append((backend, reason))
    if not skipped:
        skipped.append((forced or "any", "no implementation for this backend"))
    return None, skipped


def _plan_pass(ops, info: PlanInfo, passes: str, fuse: bool):
    """Greedy cover of the ops by rules (forward from the first op, backward from the last).

    Of the rules that match at a position and can run, the planner takes the highest priority,
    then the best backend (BACKENDS order: a shorter rule on the sm90 kernels beats a longer one
    in torch), then the longer pattern, then the older rule."""
    rules = list_rules(passes) if fuse else []
    backend_rank = {name: i for i, name in enumerate(BACKENDS)}
    steps, not_fired = [], []
    n = len(ops)
    covered_until = 0 if passes == "forward" else n
    positions = range(n) if passes == "forward" else range(n - 1, -1, -1)
    for pos in positions:
        if (passes == "forward" and pos < covered_until) or (passes == "backward" and pos >= covered_until):
            continue
        candidates = []
        for rule in rules:
            size = len(rule.pattern)
            start = pos if passes == "forward" else pos - size + 1
            if start < 0 or start + size > n or not rule.matches(ops[start : start + size]):
                continue
            backend, skipped = _choose_backend(rule, ops[start : start + size], info.window(start, start + size))
            if backend is None:
                reason = "; ".join(f"{b} backend: {r}" for b, r in skipped)
                not_fired.append((rule.name, start, start + size, reason))
                continue
            candidates.append(Step(start, start + size, rule, backend, skipped))
        if candidates:  # min() keeps list_rules' order among equals
            chosen = min(candidates, key=lambda s: (-_registry[s.rule.name].priority, backend_rank[s.backend]))
            for step in candidates:
                if step is not chosen:  # with why its better backends could not take it
                    reason = "".join([f"overlaps rule '{chosen.rule.name}' chosen first"] + [
                        f"; {b} backend: {r}" for b, r in step.skipped_backends])
                    not_fired.append((step.rule.name, step.start, step.stop, reason))
        else:
            chosen = Step(pos, pos + 1)
        steps.append(chosen)
        covered_until = chosen.stop if passes == "forward" else chosen.start
    return steps, not_fired


def make_plan(ops, info: PlanInfo, fuse: bool = True) -> Plan:
    fuse = fuse and fusion_enabled_by_env()
    forward, fwd_not_fired = _plan_pass(ops, info, "forward", fuse)
    backward, bwd_not_fired = _plan_pass(ops, info, "backward", fuse)
    return Plan(info, forward, backward, {"forward": fwd_not_fired, "backward": bwd_not_fired})
