"""te_fused_ops: fused grouped-MLP ops for MoE training, TE-style, with CuTe DSL kernels for Hopper."""

from . import ops
from .fusion import FusionRule, PlanInfo, fusion_rule, list_rules, register_rule, unregister_rule
from .ops import (
    ClampedSwiGLU,
    GeGLU,
    GroupedLinear,
    Quantize,
    ScaledSwiGLU,
    SReLU,
    SwiGLU,
    Transpose,
)
from .quantization import reuse_quantized_weights
from .sequential import Sequential
from .splits import validation

__version__ = "0.1.0"

__all__ = [
    "ClampedSwiGLU",
    "FusionRule",
    "GeGLU",
    "GroupedLinear",
    "PlanInfo",
    "Quantize",
    "SReLU",
    "ScaledSwiGLU",
    "Sequential",
    "SwiGLU",
    "Transpose",
    "fusion_rule",
    "list_rules",
    "ops",
    "register_rule",
    "reuse_quantized_weights",
    "unregister_rule",
    "validation",
]

import fusion_rules as _builtin_rules  # noqa: E402,F401  (registers the built-in rules)
