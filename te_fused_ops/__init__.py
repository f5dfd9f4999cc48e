"""te_fused_ops: fused grouped-MLP ops for MoE training, TE-style, with CuTe DSL kernels for Hopper.

Compose basic ops (`GroupedLinear`, `SwiGLU`, ...) in a `Sequential`; the fusion pass runs fused
rules where they apply (`Sequential.explain()` says which, and why others did not fire).

Environment switches (read at each use; a bad value raises ValueError listing the accepted ones):

"""

from . import env, ops
from .cuda_graphs import CudaGraphStep
from .fusion import FusionRule, FusionRuleError, PlanInfo, fusion_rule, list_rules, register_rule, unregister_rule
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
__doc__ += env.markdown_table() + "\n"

__all__ = [
    "ClampedSwiGLU",
    "CudaGraphStep",
    "FusionRule",
    "FusionRuleError",
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

env.warn_unknown()
