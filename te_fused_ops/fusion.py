"""The rule-based fusion pass: rules, the rule registry and the planner.

A rule matches a contiguous sequence of op types (``pattern``, in forward order) for one pass
("forward" or "backward"). Its ``reference`` implementation runs on every device (the reference
backend); backends add their own implementations (`te_fused_ops.backends`). Implementations:

- forward:  ``impl(ops, ctxs, x) -> y``
- backward: ``impl(ops, ctxs, dy) -> (dx, grads)``, ``grads`` a list (one per op) of dicts
  mapping parameter or side-input names to gradients.

``ops``/``ctxs`` are the matched pattern ops and their `OpContext`s; a rule fills the contexts
the way the unfused ops would, so the other pass can be planned independently.

Formats: a rule lists in ``formats`` the boundaries of its pattern (0 before the first op, i
between op i-1 and op i, ``len(pattern)`` after the last) where the planner may fold a
``Quantize[, Transpose]`` (or a lone ``Transpose``): the step then spans those ops too, and the
implementation finds them as ``ctxs[i].input_format`` / ``ctxs[i - 1].output_format`` (a
`Format`: recipe, columns, the folded ops). So one rule carries the recipe as data instead of
one rule per placement of the casts.
"""

import inspect
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch
from torch import nn

from . import env
from .backends import (
    Implementation,
    as_check,
    backend_names,
    drop_implementations,
    restore_implementations,
    get_backend,
    list_backends,
)
from .context import Format
from .errors import OpInputError
from .overlap import Segment, find_segment, segment_steps

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

    def needs_backward(self, start: int, stop: int) -> bool:
        """Whether any of ops[start:stop] needs its backward: a gradient for its input, or for its
        parameters and side inputs. The ops that need none form a prefix of the sequence (once one
        needs a gradient, every later op's input does), so the backward runs none of them and the
        sequence's input gets no gradient."""
        return any(self.input_requires_grad[i] or self.params_require_grad[i] for i in range(start, stop))

    def select(self, indices, input_format=None, output_format=None) -> "StepInfo":
        """The info with the per-op fields cut to ``ops[i] for i in indices``, with the formats
        folded before and after each of them (default: none)."""
        n = len(indices)
        return StepInfo(
            self.device_type, self.capability, self.dtype,
            tuple(self.input_requires_grad[i] for i in indices),
            tuple(self.params_require_grad[i] for i in indices),
            tuple(self.input_recipe[i] for i in indices),
            tuple(input_format or (None,) * n), tuple(output_format or (None,) * n),
        )

    def window(self, start: int, stop: int) -> "StepInfo":
        """The info with the per-op fields cut to ops[start:stop]."""
        return self.select(range(start, stop))

    @property
    def device_label(self) -> str:
        if self.capability is None:
            return self.device_type
        return f"{self.device_type}:sm{self.capability[0]}{self.capability[1]}"


@dataclass(frozen=True)
class StepInfo(PlanInfo):
    """`PlanInfo` aligned with a rule's matched ops, plus per op the `Format` folded before
    (``input_format``) and after it (``output_format``), or None. What ``supports`` sees."""

    input_format: tuple = ()
    output_format: tuple = ()

    def window(self, start: int, stop: int) -> "StepInfo":
        per_op = ("input_requires_grad", "params_require_grad", "input_recipe", "input_format", "output_format")
        return replace(self, **{name: getattr(self, name)[start:stop] for name in per_op})


def forced_backend() -> Optional[str]:
    """TE_FUSED_OPS_BACKEND=<name> forces that backend for every rule."""
    return env.read("TE_FUSED_OPS_BACKEND")


def fusion_enabled_by_env() -> bool:
    """TE_FUSED_OPS_FUSION=0 turns every rule off."""
    return env.read("TE_FUSED_OPS_FUSION")


# ---------------------------------------------------------------------------------------------
# rules


def _is_op_type(entry) -> bool:
    return inspect.isclass(entry) and issubclass(entry, nn.Module) and callable(getattr(entry, "op_forward", None))


@dataclass(frozen=True)
class Match:
    """Where a rule matched: ops[start:stop], its pattern ops at ``base`` (indices into ops) and
    the folded formats as ``{boundary: (first op, stop)}``."""

    start: int
    stop: int
    base: tuple
    formats: tuple  # ((boundary, first, stop), ...)


class FusionRule:
    """A named pattern of op types for one pass, with a reference implementation (every device)
    and implementations per backend.

    ``supports(ops, info)`` returns None when the rule applies to these ops or the first failing
    condition as a short string (whatever the backend); each backend implementation may add its
    own check. ``formats``: the pattern boundaries where a Quantize[, Transpose] may be folded
    (see the module docstring). Build one directly or with `fusion_rule`.
    """

    def __init__(self, name: str, pattern, passes: str, supports: Optional[Callable] = None,
                 reference: Optional[Callable] = None, formats=()):
        if not isinstance(name, str) or not name:
            raise ValueError("FusionRule: argument 'name' must be a non-empty string")
        pattern = tuple(pattern) if isinstance(pattern, (list, tuple)) else (pattern,)
        if not pattern:
            raise ValueError(f"FusionRule '{name}': argument 'pattern' is empty")
        for entry in pattern:
            if not _is_op_type(entry):
                raise TypeError(
                    f"FusionRule '{name}': argument 'pattern' must hold op types (BasicOp subclasses), got {entry!r}"
                )
        if passes not in PASSES:
            raise ValueError(f"FusionRule '{name}': argument 'passes' must be 'forward' or 'backward', got {passes!r}")
        if supports is not None and not callable(supports):
            raise TypeError(f"FusionRule '{name}': argument 'supports' must be callable")
        if not isinstance(formats, (list, tuple, set, frozenset, range)):
            raise TypeError(f"FusionRule '{name}': argument 'formats' must be a collection of boundaries "
                            f"0..{len(pattern)}, got {formats!r}")
        formats = tuple(formats)
        if any(not isinstance(b, int) or not 0 <= b <= len(pattern) for b in formats):
            raise ValueError(f"FusionRule '{name}': argument 'formats' must hold boundaries 0..{len(pattern)}")
        self.name = name
        self.pattern = pattern
        self.passes = passes
        self.formats = frozenset(formats)
        self.reference = reference
        self.implementations: dict = {}  # backend name -> Implementation, added by the rule's author
        self._supports = None if supports is None else as_check(supports)

    def set_reference(self, fn):
        """Decorator setting the reference implementation (runs on every device)."""
        self.reference = fn
        _registry_version[0] += 1  # plans made before it are stale
        return fn

    def implementation(self, backend: str, supports: Optional[Callable] = None):
        """Decorator registering ``fn`` as this rule's implementation on backend ``backend``
        (its ``supports(ops, info)`` check optional)."""
        if backend not in backend_names():
            raise ValueError(f"FusionRule '{self.name}': unknown backend {backend!r}; known: {', '.join(backend_names())}")

        def decorate(fn):
            self.implementations[backend] = Implementation(fn, supports)
            _registry_version[0] += 1
            return fn

        return decorate

    def supports(self, fn):
        """Decorator setting the rule's ``supports(ops, info)`` check."""
        self._supports = as_check(fn)
        _registry_version[0] += 1
        return fn

    def has_implementation(self) -> bool:
        return self.reference is not None or bool(self.implementations) or any(
            self.name in b.implementations for b in list_backends())

    def matches(self, ops) -> bool:
        """Whether ``ops`` are exactly the pattern (no formats folded)."""
        return len(ops) == len(self.pattern) and all(isinstance(op, t) for op, t in zip(ops, self.pattern))

    def matches_at(self, ops, start: int) -> list:
        """Every `Match` starting at ``ops[start]``, the most folded first."""
        found: list = []
        self._extend(ops, start, start, 0, (), (), found)
        return sorted(found, key=lambda m: -(m.stop - m.start))

    def _extend(self, ops, start: int, pos: int, k: int, base: tuple, formats: tuple, found: list) -> None:
        """Match pattern ops k.. from ops[pos] on (``base``/``formats``: what matched so far)."""
        for length in _format_lengths(ops, pos) if k in self.formats else (0,):
            p = pos + length
            folded = formats + ((k, pos, p),) if length else formats
            if k == len(self.pattern):
                found.append(Match(start, p, base, folded))
            elif p < len(ops) and isinstance(ops[p], self.pattern[k]):
                self._extend(ops, start, p + 1, k + 1, base + (p,), folded, found)

    def step_info(self, ops, info: PlanInfo, match: Match) -> StepInfo:
        """``info`` aligned with the match's pattern ops, with the folded formats."""
        inputs, outputs = [None] * len(match.base), [None] * len(match.base)
        for boundary, first, stop in match.formats:
            fmt = Format(list(ops[first:stop]), [])
            if boundary < len(match.base):
                inputs[boundary] = fmt
            if boundary > 0:
                outputs[boundary - 1] = fmt
        return info.select(match.base, inputs, outputs)

    def rule_failure(self, ops, info: StepInfo) -> Optional[str]:
        """Why the rule's own conditions (whatever the backend) fail for ``ops``, or None."""
        return None if self._supports is None else self._checked(self._supports, ops, info, None)

    def _checked(self, check, ops, info, backend: Optional[str]) -> Optional[str]:
        """``check(ops, info, backend)`` (a rule's or an implementation's ``supports``): None or a
        reason; a check that raises, or returns anything else, is the rule author's error."""
        where = f"fusion rule '{self.name}'" + ("" if backend is None else f" (backend {backend})")
        return _reason_of(lambda: check(ops, info, backend), f"{where}: its supports check", "the rule applies")

    def first_failure(self, ops, info: PlanInfo, backend: str) -> Optional[str]:
        """Why this rule cannot run ``ops`` (exactly its pattern, or a `StepInfo`'s ops) on
        ``backend``, or None."""
        if not isinstance(info, StepInfo):
            info = info.select(range(len(ops)))
        return self.rule_failure(ops, info) or self._backend_failure(ops, info, get_backend(backend))

    def _backend_failure(self, ops, info: StepInfo, backend) -> Optional[str]:
        """Why ``backend`` cannot run these ops (availability, its implementation's check), or None."""
        implementation = backend.implementation_of(self)
        if implementation is None:
            return "no implementation"
        reason = _reason_of(lambda: backend.unavailable_reason(info),
                            f"backend '{backend.name}': its unavailable_reason check", "available")
        if reason is None and implementation.supports is not None:
            reason = self._checked(as_check(implementation.supports), ops, info, backend.name)
        return reason

    def __repr__(self) -> str:
        names = ", ".join(t.__name__ for t in self.pattern)
        with_backends = [b.name for b in list_backends() if b.implementation_of(self) is not None]
        return f"FusionRule({self.name!r}, [{names}], {self.passes}, backends={with_backends})"


def _reason_of(check, what: str, none_means: str) -> Optional[str]:
    """``check()``: None or a reason (a str); a check that raises, or returns anything else (a
    bool), is its author's error, named by ``what``. Bad input raises as it is."""
    try:
        reason = check()
    except OpInputError:
        raise
    except Exception as error:
        raise FusionRuleError(f"{what} raised {type(error).__name__}: {error}") from error
    if reason is not None and not isinstance(reason, str):
        raise FusionRuleTypeError(f"{what} must return None ({none_means}) or a str (why not), got "
                                  f"{type(reason).__name__} {reason!r}")
    return "(no reason given)" if reason == "" else reason


def _format_lengths(ops, pos: int) -> tuple:
    """How many ops a format at ``ops[pos]`` may fold, longest first, then 0: Quantize,
    Transpose / Quantize / Transpose (ops declare their ``format_role``)."""
    role = lambda i: getattr(ops[i], "format_role", None) if i < len(ops) else None  # noqa: E731
    if role(pos) == "quantize":
        return (2, 1, 0) if role(pos + 1) == "transpose" else (1, 0)
    if role(pos) == "transpose":
        return (1, 0)
    return (0,)


@dataclass
class _Entry:
    rule: FusionRule
    priority: int
    order: int


_registry: dict = {}
_registry_version = [0]


def registry_version() -> int:
    return _registry_version[0]


_set_aside: dict = {}  # id(rule) -> (rule, {backend name: Implementation}) of rules replaced or removed


def _set_implementations_aside(rule: FusionRule) -> None:
    """The implementations backends registered by ``rule``'s name leave with it (they were written
    for its pattern); registering this rule object again brings them back."""
    _set_aside[id(rule)] = (rule, drop_implementations(rule.name))


def register_rule(rule: FusionRule, priority: int = 0, replace: bool = False) -> FusionRule:
    """Add ``rule``. See `make_plan` for how priorities decide between rules (``priority``: an
    int). ``replace=True`` replaces a registered rule of the same name, and the implementations
    backends registered by that name (`Backend.implement`) go with it: they were written for the
    other rule's pattern (as with `unregister_rule`). A rule registered again after it was
    replaced or removed gets its backends' implementations back."""
    if not isinstance(rule, FusionRule):
        raise TypeError(f"register_rule: argument 'rule' must be a FusionRule, got {type(rule).__name__}")
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise TypeError(f"register_rule: argument 'priority' must be an int, got {priority!r}")
    if not rule.has_implementation():
        raise ValueError(f"register_rule: rule '{rule.name}' has no implementation")
    if rule.name in _registry and not replace:
        raise ValueError(f"register_rule: a rule named '{rule.name}' is already registered (pass replace=True)")
    if rule.name in _registry and _registry[rule.name].rule is not rule:
        _set_implementations_aside(_registry[rule.name].rule)
    _, implementations = _set_aside.pop(id(rule), (None, {}))
    restore_implementations(rule.name, implementations)
    _registry[rule.name] = _Entry(rule, priority, _registry_version[0])
    _registry_version[0] += 1
    return rule


def unregister_rule(rule) -> None:
    """Remove a rule by name or object, with the implementations backends registered by its name
    (`register_rule` of the same rule object brings them back); unknown names raise KeyError."""
    name = rule.name if isinstance(rule, FusionRule) else rule
    if name not in _registry:
        raise KeyError(f"unregister_rule: no rule named {name!r}")
    _set_implementations_aside(_registry.pop(name).rule)
    _registry_version[0] += 1


def get_rule(name: str) -> FusionRule:
    """The registered rule named ``name`` (KeyError if none)."""
    if name not in _registry:
        raise KeyError(f"get_rule: no rule named {name!r}")
    return _registry[name].rule


def list_rules(passes: Optional[str] = None) -> list:
    """Registered rules in the order the planner tries them at one position: higher priority
    first, then the longer pattern, then the older rule."""
    if passes is not None and passes not in PASSES:
        raise ValueError(f"list_rules: argument 'passes' must be one of {PASSES} or None, got {passes!r}")
    entries = sorted(_registry.values(), key=lambda e: (-e.priority, -len(e.rule.pattern), e.order))
    return [e.rule for e in entries if passes is None or e.rule.passes == passes]


def fusion_rule(name: str, pattern, passes: str, backend: Optional[str] = None, supports=None, priority: int = 0,
                replace: bool = False, formats=()):
    """Decorator: make a rule whose reference implementation is the decorated function (or, with
    ``backend``, whose implementation on that backend it is) and register it (``replace=True``:
    over a rule of the same name, e.g. when a notebook cell runs again)."""

    def decorate(fn):
        rule = FusionRule(name, pattern, passes, supports=supports, formats=formats)
        if backend is None or get_backend(backend).runs_reference:
            rule.reference = fn
        else:
            rule.implementation(backend)(fn)
        register_rule(rule, priority=priority, replace=replace)
        return rule

    return decorate


# ---------------------------------------------------------------------------------------------
# plans


class FusionRuleError(RuntimeError):
    """A fusion rule's implementation raised or broke the implementation contract; names the rule.

    Raised from a ValueError or TypeError inside the rule's code, it is one of those too. Bad
    input that an op itself rejects (`te_fused_ops.errors.OpInputError`) passes unchanged.
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
    """For a missing saved value in a backward: what the contexts hold and which forward rule
    filled them."""
    if not isinstance(error, (KeyError, AttributeError)):
        return ""
    hints = [
        f"op {ctx.index} ({ctx.op.op_name}) was run by forward rule '{ctx.forward_rule}' and its context holds "
        f"saved {sorted(vars(ctx.saved))}, side {sorted(ctx.side)}"
        for ctx in ctxs
        if ctx.forward_rule
    ]
    if not hints:
        return ""
    return (
        "; " + "; ".join(hints) + ". A forward rule must fill each op's context as the op's own forward "
        "would (ctx.save_input(x), ctx.saved.<name> = ...); the backward sees only ctx.saved and ctx.side"
    )


@dataclass
class Step:
    """One unit of a pass: ops[start:stop] run by ``rule`` on ``backend`` (rule None: the basic op).

    ``base``: indices of the rule's pattern ops; ``formats``: ((boundary, first, stop), ...) of
    the folded Quantize/Transpose ops; ``skipped_backends``: [(backend, reason)] tried first;
    ``implementation``: the function that runs the rule, resolved when the plan is made (the
    backend's, or the rule's reference for torch.compile's fake run).
    """

    start: int
    stop: int
    rule: Optional[FusionRule] = None
    backend: Optional[str] = None
    skipped_backends: list = field(default_factory=list)
    base: tuple = ()
    formats: tuple = ()
    implementation: Optional[Callable] = None

    def run(self, ops, ctxs, value, passes: str):
        """The step's result; a rule's failure or wrong result raises `FusionRuleError` naming it."""
        if self.rule is None:
            return self._run_op(ops[self.start], ctxs[self.start], value, passes)
        window_ctxs = ctxs[self.start : self.stop]
        base_ops, base_ctxs = [ops[i] for i in self.base], [ctxs[i] for i in self.base]
        self._bind_formats(ops, ctxs, base_ctxs)
        try:
            result = self.implementation(base_ops, base_ctxs, value)
        except (torch.OutOfMemoryError, OpInputError):
            raise
        except Exception as error:
            hint = _context_hint(window_ctxs, error) if passes == "backward" else ""
            message = f"raised {type(error).__name__}: {error}{hint}"
            raise _error_class(error)(self._where(ops, passes) + message) from error
        finally:
            for ctx in base_ctxs:
                ctx.input_format = ctx.output_format = None
        if passes == "forward":
            if not isinstance(result, torch.Tensor):
                raise FusionRuleError(
                    f"{self._where(ops, passes)}returned {_describe(result)}; "
                    "a forward implementation must return the output tensor"
                )
            for ctx in window_ctxs:
                ctx.forward_rule = self.rule.name
            return result
        if not _is_backward_result(result, len(base_ops)):
            raise FusionRuleError(
                f"{self._where(ops, passes)}returned {_describe(result)}; a backward implementation must "
                f"return (dx, grads): dx a tensor or None, grads a list of {len(base_ops)} entries (one per op, "
                "each a dict from parameter or side-input name to gradient, or None)"
            )
        dx, base_grads = result
        self._check_backward_contents(ops, passes, window_ctxs[0], dx)
        grads = [{} for _ in range(self.start, self.stop)]
        for i, grad in zip(self.base, base_grads):
            grads[i - self.start] = grad
        return dx, grads

    def _check_backward_contents(self, ops, passes, first_ctx, dx) -> None:
        """FusionRuleValueError naming the rule where a backward result leaves out dx while the
        step's input needs a gradient (the gradients' names are checked by the runner)."""
        if dx is None and first_ctx.input_requires_grad:
            raise FusionRuleValueError(
                f"{self._where(ops, passes)}returned dx None, but the input of op {self.start} needs a gradient")

    def _bind_formats(self, ops, ctxs, base_ctxs) -> None:
        for boundary, first, stop in self.formats:
            fmt = Format(list(ops[first:stop]), list(ctxs[first:stop]))
            if boundary < len(base_ctxs):
                base_ctxs[boundary].input_format = fmt
            if boundary > 0:
                base_ctxs[boundary - 1].output_format = fmt

    def _run_op(self, op, ctx, value, passes: str):
        if passes == "forward":
            return op.op_forward(ctx, value)
        try:
            dx, grads = op.op_backward(ctx, value)
        except (KeyError, AttributeError) as error:
            hint = _context_hint([ctx], error)
            if not hint:
                raise
            raise FusionRuleError(
                f"{op.op_name} (op {ctx.index}) backward raised {type(error).__name__}: {error}{hint}") from error
        return dx, [grads]

    def _where(self, ops, passes: str) -> str:
        names = ", ".join(op.op_name for op in ops[self.start : self.stop])
        return f"fusion rule '{self.rule.name}' ({passes}, backend {self.backend}, ops [{self.start}:{self.stop}] {names}) "

    def label(self, ops) -> str:
        """``[start:stop] Op, Op -> rule 'name' (backend b)``."""
        names = ", ".join(op.op_name for op in ops[self.start : self.stop])
        where = f"[{self.start}]" if self.stop - self.start == 1 else f"[{self.start}:{self.stop}]"
        what = f"rule '{self.rule.name}'" if self.rule is not None else "basic op"
        return f"{where} {names} -> {what} (backend {self.backend})"


@dataclass
class Plan:
    info: PlanInfo
    forward: list
    backward: list  # in execution order (last ops first)
    not_fired: dict  # pass -> [(rule name, start, stop, reason)]
    templates: dict = field(default_factory=dict)  # call signature -> custom_ops.RunTemplate (torch.compile)
    segment: Optional[Segment] = None  # the chunked segment (`overlap`), if an op opens one
    segment_steps: dict = field(default_factory=dict)  # pass -> (first, stop) indices of its steps over it
    settings: tuple = ()  # `env.plan_settings()` its rule checks read; its backward runs under them

    def explain(self, ops) -> str:
        lines = [f"plan for {self.info.device_label}, dtype {str(self.info.dtype).removeprefix('torch.')}"]
        produced = _side_value_lines(ops)
        if produced:
            lines.append("side values: " + "; ".join(produced))
        segment = self.segment
        if segment is not None:
            lines.append(f"chunked: ops [{segment.start}:{segment.stop}] run as {segment.chunks} chunks of the experts, "
                         "the first and last steps (the exchanges) on a side stream beside the others")
        for passes, steps in (("forward", self.forward), ("backward", self.backward)):
            lines.append(f"{passes}:")
            for step in steps:
                line = "  " + step.label(ops)
                if step.skipped_backends:
                    line += "; " + _reasons(step.skipped_backends)
                if passes == "backward" and not self.info.needs_backward(step.start, step.stop):
                    line += "; not run: no gradient needed"
                lines.append(line)
            for name, start, stop, reason in self.not_fired[passes]:
                lines.append(f"  not fired: rule '{name}' on [{start}:{stop}]: {reason}")
        return "\n".join(lines)


def side_value_users(ops, i: int, name: str) -> list:
    """Indices of the ops after op ``i`` that consume its side value ``name``, up to the next op
    producing the same name."""
    users = []
    for j in range(i + 1, len(ops)):
        if name in ops[j].side_inputs:
            users.append(j)
        if name in ops[j].side_outputs:
            break
    return users


def _side_value_lines(ops) -> list:
    """Per op producing side values: ``"Permute (op 0) -> routing [ops 4], split_sizes [ops 1, 3]"``
    (`side_value_users`)."""
    lines = []
    for i, op in enumerate(ops):
        values = []
        for name in op.side_outputs:
            users = side_value_users(ops, i, name)
            values.append(f"{name} [ops {', '.join(map(str, users))}]" if users else f"{name} [unused]")
        if values:
            lines.append(f"{op.op_name} (op {i}) -> {', '.join(values)}")
    return lines


def _choose_backend(rule: FusionRule, ops, info: StepInfo):
    """(backend name, skipped) for the most preferred backend that can run, or (None, skipped)."""
    reason = rule.rule_failure(ops, info)
    if reason is not None:
        return None, [(None, reason)]
    forced = forced_backend()
    order = [get_backend(forced)] if forced else list_backends()
    skipped = []
    for backend in order:
        if backend.implementation_of(rule) is None:
            continue
        reason = rule._backend_failure(ops, info, backend)
        if reason is None:
            return backend.name, skipped
        skipped.append((backend.name, reason))
    if not skipped:
        skipped.append((forced or "any", "no implementation for this backend"))
    return None, skipped


def _candidates(rules, ops, info: PlanInfo, pos: int, passes: str, not_fired: list) -> list:
    """Steps of the rules that can run and match with their first op (forward) or last op
    (backward) at ``pos``: per rule, its match on the most preferred backend, the most folded
    there. Rules that match but cannot run add (name, start, stop, reason) to ``not_fired``."""
    preference = {b.name: b.preference for b in list_backends()}
    starts = range(pos, pos + 1) if passes == "forward" else range(pos, -1, -1)
    steps = []
    for rule in rules:
        matches = sorted((m for start in starts for m in rule.matches_at(ops, start)
                          if passes == "forward" or m.stop == pos + 1), key=lambda m: m.start - m.stop)
        attempts = []  # (match, step or None, skipped), the most folded first
        for match in matches:
            base_ops = [ops[i] for i in match.base]
            step_info = rule.step_info(ops, info, match)
            idle = _without_backward(base_ops, step_info) if passes == "backward" else None
            if idle:
                attempts.append((match, None, [(None, idle)]))
                continue
            backend, skipped = _choose_backend(rule, base_ops, step_info)
            step = None if backend is None else Step(
                match.start, match.stop, rule, backend, skipped, match.base, match.formats,
                get_backend(backend).implementation_of(rule).run)
            attempts.append((match, step, skipped))
        runnable = [step for _, step, _ in attempts if step is not None]
        if not runnable:
            if attempts:
                match, _, skipped = attempts[0]
                not_fired.append((rule.name, match.start, match.stop, _reasons(skipped)))
            continue
        chosen = min(runnable, key=lambda s: (preference[s.backend], s.start - s.stop))
        steps.append(chosen)
        match, _, skipped = attempts[0]  # why the most folded match did not take the chosen backend
        better = [(b, r) for b, r in skipped if b is None or preference[b] <= preference[chosen.backend]]
        if match.stop - match.start > chosen.stop - chosen.start and better:
            not_fired.append((rule.name, match.start, match.stop,
                              f"ran on [{chosen.start}:{chosen.stop}] instead; {_reasons(better)}"))
    return steps


def _without_backward(ops, info: StepInfo) -> Optional[str]:
    """Why a backward rule may not take these ops: some need no gradient (neither for their input
    nor for their parameters and side inputs), so their backward does not run (`runner`), or None."""
    idle = [op.op_name for k, op in enumerate(ops) if not info.needs_backward(k, k + 1)]
    if not idle:
        return None
    one = len(idle) == 1
    return f"{', '.join(idle)} need{'s' if one else ''} no gradient ({'its' if one else 'their'} backward does not run)"


def _reasons(skipped) -> str:
    """``[(backend or None for the rule's own check, reason)]`` as one line."""
    return "; ".join(r if b is None else f"{b} backend: {r}" for b, r in skipped)


def _plan_pass(ops, info: PlanInfo, passes: str, fuse: bool):
    """Greedy cover of the ops by rules: forward from the first op, backward from the last.

    At each position not yet covered, of the rules that match there (their first op there in the
    forward, their last op in the backward) and can run, the planner takes the highest
    priority, then the most preferred backend (a shorter rule on a kernel backend beats a longer
    one on the reference backend), then the longer span, then the longer pattern, then the older
    rule; the positions it
    spans are then covered. A rule matching at a covered position does not fire: explain() says
    which rule covered it."""
    rules = list_rules(passes) if fuse else []
    priority = {e.rule.name: e.priority for e in _registry.values()}
    preference = {b.name: b.preference for b in list_backends()}
    steps, not_fired = [], []
    n = len(ops)
    covered_by = [None] * n
    positions = range(n) if passes == "forward" else range(n - 1, -1, -1)
    for pos in positions:
        owner = covered_by[pos]
        if owner is not None:  # every rule matching here, runnable or not, lost to the owner
            failed: list = []
            candidates = _candidates(rules, ops, info, pos, passes, failed)
            spans = {(s.rule.name, s.start, s.stop) for s in candidates} | {f[:3] for f in failed}
            for name, start, stop in sorted(spans, key=lambda span: (span[1], span[0])):
                if name != owner.rule.name:
                    not_fired.append((name, start, stop, f"positions already covered by rule '{owner.rule.name}' "
                                                         f"(priority {priority[owner.rule.name]})"))
            continue
        candidates = _candidates(rules, ops, info, pos, passes, not_fired)
        if candidates:  # min() keeps list_rules' order among equals
            chosen = min(candidates, key=lambda s: (-priority[s.rule.name], preference[s.backend], s.start - s.stop))
            for step in candidates:
                if step is not chosen:  # with why its better backends could not take it
                    reason = f"overlaps rule '{chosen.rule.name}' chosen first" + (
                        f"; {_reasons(step.skipped_backends)}" if step.skipped_backends else "")
                    not_fired.append((step.rule.name, step.start, step.stop, reason))
        else:
            chosen = Step(pos, pos + 1, backend=_basic_backend())
        steps.append(chosen)
        if chosen.rule is not None:
            covered_by[chosen.start : chosen.stop] = [chosen] * (chosen.stop - chosen.start)
    return steps, not_fired


def _basic_backend() -> str:
    """The backend that runs basic ops (their own op_forward/op_backward): the reference one."""
    return next((b.name for b in list_backends() if b.runs_reference), "reference")


def make_plan(ops, info: PlanInfo, fuse: bool = True) -> Plan:
    fuse = fuse and fusion_enabled_by_env()
    forward, fwd_not_fired = _plan_pass(ops, info, "forward", fuse)
    backward, bwd_not_fired = _plan_pass(ops, info, "backward", fuse)
    plan = Plan(info, forward, backward, {"forward": fwd_not_fired, "backward": bwd_not_fired},
                settings=env.plan_settings())
    plan.segment = find_segment(ops)
    if plan.segment is not None:
        plan.segment_steps = {passes: segment_steps(ops, plan.segment, steps, passes)
                              for passes, steps in (("forward", forward), ("backward", backward))}
    return plan
