"""The one registry of activations that the fused GEMM kernels implement. Importable without cutlass.

A name maps to its shape rule and extra inputs; the math (forward value and derivatives) is defined
by the torch ops in ``te_fused_ops/ops/activation.py`` (``kernel_name`` points here), and the
kernels' device math (``activation_math_sm90``) is keyed by the same names.
GLU convention: the input is [gate, up] along the last dim (gate first), the output half as wide.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class ActivationSpec:
    """name; glu: [gate, up] input -> half-width output; constants: names of the float scalars the
    math takes (passed to the kernels, ignored by activations that do not list them), each with its
    default in ``defaults``; takes_probs: the output is scaled by a per-row (M,) float32 factor,
    which gets a gradient too."""

    name: str
    glu: bool
    constants: tuple[str, ...] = ()
    takes_probs: bool = False
    defaults: Mapping[str, float] = field(default_factory=dict, hash=False)

    def __post_init__(self):
        if set(self.defaults) != set(self.constants):
            raise ValueError(f"activation {self.name!r}: defaults {tuple(self.defaults)} must name exactly its "
                             f"constants {self.constants}")
        object.__setattr__(self, "defaults", MappingProxyType({c: float(self.defaults[c]) for c in self.constants}))


ACTIVATIONS: dict[str, ActivationSpec] = {
    spec.name: spec
    for spec in (
        ActivationSpec("swiglu", glu=True),
        ActivationSpec("geglu", glu=True),  # gelu with the tanh approximation
        ActivationSpec("srelu", glu=False),
        ActivationSpec("clamped_swiglu", glu=True, constants=("limit", "alpha"),
                       defaults={"limit": 7.0, "alpha": 1.702}),
        ActivationSpec("scaled_swiglu", glu=True, takes_probs=True),
    )
}



def _constant_defaults() -> dict[str, float]:
    defaults: dict[str, float] = {}
    for spec in ACTIVATIONS.values():
        for name, value in spec.defaults.items():
            if defaults.setdefault(name, value) != value:
                raise ValueError(f"activation constant {name!r}: one default for every activation that "
                                 f"takes it, got {defaults[name]} and {value} ({spec.name!r})")
    return defaults


CONSTANT_DEFAULTS: Mapping[str, float] = MappingProxyType(_constant_defaults())
"""Every activation constant of the registry (first-listed order) and its default: the order of
the constants the kernels take (``activation_math_sm90.ActivationConstants``)."""
_DEFAULT_CONSTANTS = tuple(CONSTANT_DEFAULTS.values())


def activation_constants(where: str, given: Mapping[str, object]) -> tuple[float, ...]:
    """The kernels' constants (`CONSTANT_DEFAULTS` order) from the keyword arguments ``given`` to
    the wrapper ``where``, defaults for the rest; TypeError naming ``where`` for a name that is no
    activation constant."""
    if not given:
        return _DEFAULT_CONSTANTS
    unknown = [name for name in given if name not in CONSTANT_DEFAULTS]
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r} (activation constants: "
                        f"{tuple(CONSTANT_DEFAULTS)})")
    return tuple(float(given.get(name, default)) for name, default in CONSTANT_DEFAULTS.items())


GLU_N_MULTIPLE = 64
"""GLU outputs of the sm90 kernels: the [gate, up] width must be a multiple of this (each half
whole 32-column epilogue chunks)."""


def activation_spec(name: str | None, where: str) -> ActivationSpec | None:
    """The spec of ``name`` (None for no activation); ValueError naming ``where`` if unknown."""
    if name is None:
        return None
    spec = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise ValueError(
            f"{where}: activation must be None or one of {tuple(ACTIVATIONS)}, got {name!r}"
        )
    return spec
