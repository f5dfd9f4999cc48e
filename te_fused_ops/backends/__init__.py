"""Kernel backends: one package per backend, each registering itself here.

A `Backend` has a name, a preference (lower runs first where several can), a check that says
why it cannot run a plan (device, capability, a missing package) or None, and its
implementations of fusion rules, by rule name. The reference backend runs each rule's
reference implementation (its ``reference`` function), on every device. The planner, the rules
and the runner only ever see this registry: a new backend is a new package that calls
`register_backend`, with no edit anywhere else.
"""

import inspect
from dataclasses import dataclass
from typing import Callable, Optional


def as_check(fn: Callable) -> Callable:
    """``fn`` as ``check(ops, info, backend_name)``: a check may take (ops, info) or
    (ops, info, backend)."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return fn
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params):
        return fn
    return lambda ops, info, backend: fn(ops, info)


@dataclass(frozen=True)
class Implementation:
    """A rule's implementation on one backend: ``run`` (the rule's implementation signature)
    and ``supports(ops, info)`` returning None or why it cannot run these ops."""

    run: Callable
    supports: Optional[Callable] = None


class Backend:
    """One kernel backend.

    ``unavailable_reason(info)``: None when it can run a plan with this `PlanInfo`, else why not;
    ``preference``: lower wins where several backends can run a rule; ``runs_reference``: it runs
    each rule's reference implementation (rules need no implementation registered for it);
    ``helpers``: its kernels for the library's own bookkeeping, by name, each returning None where
    it does not apply (the torch ops run then): ``split_offsets(split_sizes, num_rows)``,
    ``route(indices, num_experts)`` (the fields of a `routing.Routing` in order),
    ``slots_to_rows(slot_values, routing)`` and ``rows_to_slots(row_parts, routing, dtype)``;
    ``prepare_input(value)``: what the implementations registered with `implement` receive in
    place of a step's input (x forward, dy backward), e.g. a contiguous copy where the kernels need
    one (None: the input as it is).
    """

    def __init__(self, name: str, unavailable_reason: Callable, preference: int, runs_reference: bool = False,
                 helpers: Optional[dict] = None, prepare_input: Optional[Callable] = None):
        self.name = name
        self.unavailable_reason = unavailable_reason
        self.preference = preference
        self.runs_reference = runs_reference
        self.helpers = dict(helpers or {})
        self.prepare_input = prepare_input
        self.implementations: dict = {}

    def implement(self, rule_name: str, supports: Optional[Callable] = None):
        """Decorator registering ``fn`` as this backend's implementation of rule ``rule_name`` (run
        on the step's input through ``prepare_input``)."""

        def decorate(fn):
            run = fn
            if self.prepare_input is not None:
                prepare = self.prepare_input

                def run(ops, ctxs, value, fn=fn):
                    return fn(ops, ctxs, prepare(value))

            self.implementations[rule_name] = Implementation(run, supports)
            _version[0] += 1
            return fn

        return decorate

    def implementation_of(self, rule) -> Optional[Implementation]:
        """What runs ``rule`` here: the rule's own implementation for this backend, this backend's
        registered one, or (reference backend) the rule's reference; None if nothing."""
        own = rule.implementations.get(self.name) or self.implementations.get(rule.name)
        if own is None and self.runs_reference and rule.reference is not None:
            return Implementation(rule.reference)
        return own

    def __repr__(self) -> str:
        return f"Backend({self.name!r}, preference={self.preference})"


_backends: dict = {}
_version = [0]  # bumped by every registration change: part of the plan cache key


def backends_version() -> int:
    return _version[0]


def register_backend(backend: Backend) -> Backend:
    """Add ``backend`` (replacing one of the same name)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend: argument 'backend' must be a te_fused_ops Backend, got "
                        f"{type(backend).__name__}")
    _backends[backend.name] = backend
    _version[0] += 1
    return backend


def unregister_backend(name: str) -> None:
    """Remove the backend named ``name`` (KeyError naming the known ones if none)."""
    get_backend(name)
    del _backends[name]
    _version[0] += 1


def drop_implementations(rule_name: str) -> dict:
    """Forget every backend's implementation registered for the rule named ``rule_name``; returns
    them by backend name."""
    dropped = {}
    for backend in _backends.values():
        implementation = backend.implementations.pop(rule_name, None)
        if implementation is not None:
            dropped[backend.name] = implementation
            _version[0] += 1
    return dropped


def restore_implementations(rule_name: str, implementations: dict) -> None:
    """Give back implementations `drop_implementations` returned, to the backends still
    registered that have none for ``rule_name`` now."""
    for backend_name, implementation in implementations.items():
        backend = _backends.get(backend_name)
        if backend is not None and rule_name not in backend.implementations:
            backend.implementations[rule_name] = implementation
            _version[0] += 1


def list_backends() -> list:
    """The registered backends, most preferred first."""
    return sorted(_backends.values(), key=lambda b: b.preference)


def backend_names() -> tuple:
    return tuple(b.name for b in list_backends())


def get_backend(name: str) -> Backend:
    if name not in _backends:
        raise KeyError(f"unknown backend {name!r}; known: {', '.join(backend_names())}")
    return _backends[name]


def helper_kernel(name: str, *args):
    """What the first backend's helper kernel ``name`` (see `Backend`) makes of ``args``, or None
    where no backend's applies."""
    for backend in list_backends():
        helper = backend.helpers.get(name)
        if helper is not None:
            made = helper(*args)
            if made is not None:
                return made
    return None
