"""The one registry of activations that the fused GEMM kernels implement. Importable without cutlass.

A name maps to its shape rule and extra inputs; the math (forward value and derivatives) is defined
by the torch ops in ``te_fused_ops/ops/activation.py`` (``kernel_name`` points here), and the
kernels' device math (``activation_math_sm90``) is keyed by the same names.
GLU convention: the input is [gate, up] along the last dim (gate first), the output half as wide.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ActivationSpec:
    """name; glu: [gate, up] input -> half-width output; constants: names of the float scalars the
    math takes (passed to the kernels, ignored by activations that do not list them); takes_probs:
    the output is scaled by a per-row (M,) float32 factor, which gets a gradient too."""

    name: str
    glu: bool
    constants: tuple[str, ...] = ()
    takes_probs: bool = False


ACTIVATIONS: dict[str, ActivationSpec] = {
    spec.name: spec
    for spec in (
        ActivationSpec("swiglu", glu=True),
        ActivationSpec("geglu", glu=True),  # gelu with the tanh approximation
        ActivationSpec("srelu", glu=False),
        ActivationSpec("clamped_swiglu", glu=True, constants=("limit", "alpha")),
        ActivationSpec("scaled_swiglu", glu=True, takes_probs=True),
    )
}

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
