"""Environment switches: every ``TE_FUSED_OPS_*`` variable is read here, at use time, and validated.

`read(name)` returns the parsed value (the default when the variable is unset or empty) or raises
a ValueError naming the variable and listing the accepted values. `SWITCHES` is the one table
behind the README's list and ``help(te_fused_ops)``.
"""

import contextlib
import contextvars
import os
import warnings
from dataclasses import dataclass
from typing import Callable

from .backends import backend_names

PREFIX = "TE_FUSED_OPS_"
_TRUE, _FALSE = ("1", "true", "on"), ("0", "false", "off")


def _flag(raw: str) -> bool:
    value = raw.lower()
    if value not in _TRUE + _FALSE:
        raise ValueError
    return value in _TRUE


def _flag_or_auto(raw: str) -> bool | None:
    return None if raw.lower() == "auto" else _flag(raw)


def _gather_rows(raw: str) -> bool | str | None:
    return "wgrad" if raw.lower() == "wgrad" else _flag_or_auto(raw)


def _backend_names() -> tuple:
    return backend_names()


def _backend(raw: str) -> str:
    if raw not in _backend_names():
        raise ValueError
    return raw


def _count(raw: str) -> int:
    value = int(raw)
    if value < 0:
        raise ValueError
    return value


def _path(raw: str) -> str:
    return raw


_FLAG_VALUES = "one of 1, 0, true, false, on, off (any case)"


@dataclass(frozen=True)
class Switch:
    """One variable: ``parse`` maps a stripped, non-empty value to the setting or raises ValueError."""

    name: str
    parse: Callable[[str], object]
    accepted: Callable[[], str]  # for errors and docs; a function, as backends register themselves
    default: object  # the setting when the variable is unset or empty
    default_text: str
    doc: str


SWITCHES = {
    s.name: s
    for s in (
        Switch(
            "TE_FUSED_OPS_FUSION", _flag, lambda: _FLAG_VALUES, True, "1",
            "0 runs every op unfused, as `Sequential(..., fuse=False)`",
        ),
        Switch(
            "TE_FUSED_OPS_BACKEND", _backend, lambda: f"one of {', '.join(_backend_names())}, or empty", None,
            "empty (the fastest available)",
            "forces that kernel backend for every rule, e.g. `torch` for comparisons",
        ),
        Switch(
            "TE_FUSED_OPS_COMPILE", _flag, lambda: _FLAG_VALUES, True, "1",
            "0 runs the torch activation math eagerly on CUDA; by default it runs through "
            "`torch.compile`, one elementwise kernel per activation",
        ),
        Switch(
            "TE_FUSED_OPS_VALIDATE", _flag, lambda: _FLAG_VALUES, False, "0",
            "1 checks split values on the GPU too (negative, sum too large) and raises, as "
            "`with tfo.validation():`; costs a host sync (without it, out-of-range values are clamped on "
            "the device); split sizes on the CPU are always checked",
        ),
        Switch(
            "TE_FUSED_OPS_SM_MARGIN", _count, lambda: "an integer >= 0", 0, "0",
            "SMs the sm90 GEMMs leave free for kernels running beside them (e.g. all-to-all); "
            "`sm_margin=` of the kernel wrappers overrides it",
        ),
        Switch(
            "TE_FUSED_OPS_KERNEL_CACHE", _flag, lambda: _FLAG_VALUES, True, "1",
            "0 compiles every sm90 kernel in each process; by default a compiled kernel is written to "
            "the kernel cache directory once and loaded by later processes",
        ),
        Switch(
            "TE_FUSED_OPS_AUTOTUNE", _flag, lambda: _FLAG_VALUES, False, "0",
            "1 times the launch configurations of an sm90 GEMM kernel the first time a problem class "
            "(kernel, dtype, groups, N, K, rows to a power of two) runs, keeps the fastest whose results "
            "equal the default's bit for bit, and stores it beside the cached kernels (a host sync, "
            "once per class); stored choices are used without it",
        ),
        Switch(
            "TE_FUSED_OPS_GATHER_ROWS", _gather_rows, lambda: f"auto, wgrad, or {_FLAG_VALUES}", None, "auto",
            "whether FC1 + activation right after a single-GPU `Permute` reads the token rows by index "
            "inside the sm90 GEMM (rule `permute+grouped_linear+activation`, 16-bit, hidden size a "
            "multiple of 64) instead of reading the permuted copy: 1 always, 0 never, auto where FC1's "
            "output width is at most 4096 (where it measured faster); and whether FC1's weight gradient "
            "reads them by index instead of permuting x again: 1 always, 0 never, auto where FC1's "
            "output width is at most 4096; and whether FC2's data gradient + dActivation and weight "
            "gradient read dy's token rows by index where the combine is a plain sum (rule "
            "`dactivation+grouped_linear+unpermute`): 1 always, 0 never, auto where FC2's input width "
            "is at most 2048, and past that the weight gradient alone where it would otherwise hold dy's "
            "copy while it waits for d_pre to be freed; wgrad: both weight gradients read the rows by "
            "index, last in the backward, and every other GEMM reads the copies, freed before them (the "
            "peak of 1; faster than 1 where FC1's forward gathers at a loss)",
        ),
        Switch(
            "TE_FUSED_OPS_KERNEL_CACHE_DIR", _path, lambda: "a directory path", None,
            "`$XDG_CACHE_HOME/te_fused_ops/kernels`, else `~/.cache/te_fused_ops/kernels`",
            "where compiled kernels are kept; it must be owned by you and not writable by group or "
            "others (else it is not used), unless `TE_FUSED_OPS_KERNEL_CACHE_TRUST=1`",
        ),
        Switch(
            "TE_FUSED_OPS_KERNEL_CACHE_TRUST", _flag, lambda: _FLAG_VALUES, False, "0",
            "1 loads kernels from a cache directory owned by someone else or writable by others (a "
            "shared one, e.g. filled by `python -m te_fused_ops.precompile` on a shared filesystem): "
            "set it only when you trust everyone who can write there; digests and symlinks are checked "
            "either way",
        ),
    )
}


# CPython keeps os.environ's encoded entries in `_data`: one lookup there costs ~30 ns against
# ~600 ns for os.environ.get, and sees every change made through os.environ.
_ENVIRON_STORE = getattr(os.environ, "_data", None)


def hot_switch(name: str, where: str = "te_fused_ops") -> Callable[[], object]:
    """A function returning switch ``name``'s setting, for a hot path: its raw value looked up
    cheaply at every call, parsed (and validated, errors prefixed by ``where``) again only when
    that changed."""
    key = os.environ.encodekey(name) if _ENVIRON_STORE is not None else None
    last = [object(), None]  # [raw value, setting] of the latest successful read

    def setting():
        applied = _PLAN_APPLIED.get()
        if applied is not None and name in applied:
            return applied[name]
        raw = _ENVIRON_STORE.get(key) if _ENVIRON_STORE is not None else os.environ.get(name)
        if raw != last[0]:
            last[1] = read(name, where)
            last[0] = raw
        return last[1]

    return setting


PLAN_SWITCHES = ("TE_FUSED_OPS_GATHER_ROWS",)  # switches a backend's rule checks read: part of a plan's key
_PLAN_READS = tuple(hot_switch(name) for name in PLAN_SWITCHES)
_PLAN_APPLIED = contextvars.ContextVar("te_fused_ops_plan_settings", default=None)  # name -> setting, or None


def plan_settings() -> tuple:
    """The current values of `PLAN_SWITCHES` (a cached plan is made again when they change)."""
    return tuple(setting() for setting in _PLAN_READS)


@contextlib.contextmanager
def settings_of_plan(settings: tuple):
    """Within it, `PLAN_SWITCHES` read as ``settings`` (what `plan_settings` gave when a plan was
    made; () leaves them to the environment): a backward follows the plan its forward ran, even
    where the environment changed in between."""
    token = _PLAN_APPLIED.set(dict(zip(PLAN_SWITCHES, settings)) if settings else None)
    try:
        yield
    finally:
        _PLAN_APPLIED.reset(token)


def read(name: str, where: str = "te_fused_ops"):
    """The current setting of switch ``name`` (a plan's, inside `settings_of_plan`); ValueError
    (prefixed by ``where``) for a bad value."""
    applied = _PLAN_APPLIED.get()
    if applied is not None and name in applied:
        return applied[name]
    switch = SWITCHES[name]
    raw = os.environ.get(name, "").strip()
    if not raw:
        return switch.default
    try:
        return switch.parse(raw)
    except ValueError:
        raise ValueError(
            f"{where}: environment variable {name} must be {switch.accepted()}, got {raw!r}"
        ) from None


def warn_about_environment() -> None:
    """Warn (at import) about ``TE_FUSED_OPS_*`` variables that are not switches (typos are
    otherwise ignored) and about switches set to a bad value: each raises only where it is read,
    and some are read on CUDA paths alone."""
    unknown = sorted(n for n in os.environ if n.startswith(PREFIX) and n not in SWITCHES)
    if unknown:
        warnings.warn(
            f"te_fused_ops: unknown environment variable(s) {', '.join(unknown)} ignored; "
            f"known: {', '.join(SWITCHES)}",
            stacklevel=3,
        )
    for name in SWITCHES:
        try:
            read(name)
        except ValueError as error:
            warnings.warn(f"{error} (raised where it is read)", stacklevel=3)


def markdown_table() -> str:
    """The switches as a Markdown table: name, accepted values, default, effect."""
    lines = ["| variable | accepted values | default | effect |", "|---|---|---|---|"]
    for s in SWITCHES.values():
        lines.append(f"| `{s.name}` | {s.accepted()} | {s.default_text} | {s.doc} |")
    return "\n".join(lines)
