"""fp32 device math of the registered activations (``activations.ACTIVATIONS``), for epilogues.

``ACTIVATION_MATH[name](x, u, c)`` returns ``(value, d_x, d_u)`` for one element, ``c`` the
`ActivationConstants` (float32, by name: ``c.limit``), each activation reading the ones its
registry entry lists:
GLU: x = gate, u = up, value = act(gate) * up (before any probs scale), d_x / d_u its partial
derivatives; srelu: u is None, d_u None. A forward epilogue uses only ``value``; the compiler drops
the rest. Sigmoid and tanh go through one ``tanh.approx.f32`` (max rel. error ~2^-11).
The reference math is ``te_fused_ops/ops/activation.py``.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cutlass_dsl import T, dsl_user_op

from ....activations import CONSTANT_DEFAULTS
from .ptx_sm90 import ptx_value

ActivationConstants = NamedTuple("ActivationConstants", [(name, Float32) for name in CONSTANT_DEFAULTS])
"""Every activation constant of the registry (``activations.CONSTANT_DEFAULTS`` order) as a float32
scalar: one argument of the kernels' host entries, one field of their epilogue params."""


def default_constants() -> ActivationConstants:
    """The registry's defaults (what the kernels are compiled with; the values are runtime)."""
    return ActivationConstants(*(Float32(value) for value in CONSTANT_DEFAULTS.values()))


_GELU_K = 0.7978845608028654  # sqrt(2 / pi)
_GELU_C = 0.044715


@dsl_user_op
def tanh_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """tanh.approx.f32: one SFU op."""
    return Float32(ptx_value(T.f32(), [Float32(x)], "tanh.approx.f32 $0, $1;", "=f,f", loc=loc, ip=ip))


@cute.jit
def _sigmoid(x: Float32) -> Float32:
    return 0.5 + 0.5 * tanh_approx(0.5 * x)


@cute.jit
def _swiglu(x: Float32, u: Float32, c: ActivationConstants):
    s = _sigmoid(x)
    silu = x * s
    return silu * u, u * s * (1.0 + x * (1.0 - s)), silu


@cute.jit
def _geglu(x: Float32, u: Float32, c: ActivationConstants):
    t = tanh_approx(_GELU_K * (x + _GELU_C * x * x * x))
    gelu = 0.5 * x * (1.0 + t)
    d_gelu = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * _GELU_K * (1.0 + 3.0 * _GELU_C * x * x)
    return gelu * u, u * d_gelu, gelu


@cute.jit
def _clamped_swiglu(x: Float32, u: Float32, c: ActivationConstants):
    """g sigmoid(alpha g) (uc + 1), g = min(x, limit), uc = clamp(u, -limit, limit); the clamps
    pass gradient inside their bounds (inclusive)."""
    limit, alpha = c.limit, c.alpha
    g = cutlass.min(x, limit)
    uc = cutlass.min(cutlass.max(u, -limit), limit)
    s = _sigmoid(alpha * g)
    glu = g * s
    d_x = Float32(0.0)
    if x <= limit:
        d_x = (uc + 1.0) * (s + alpha * glu * (1.0 - s))
    d_u = Float32(0.0)
    if u >= -limit and u <= limit:
        d_u = glu
    return glu * (uc + 1.0), d_x, d_u


@cute.jit
def _srelu(x: Float32, u, c: ActivationConstants):
    r = cutlass.max(x, Float32(0.0))
    return r * r, 2.0 * r, None


ACTIVATION_MATH = {
    "swiglu": _swiglu,
    "geglu": _geglu,
    "srelu": _srelu,
    "clamped_swiglu": _clamped_swiglu,
    "scaled_swiglu": _swiglu,  # the probs scale is applied by the epilogue
}
