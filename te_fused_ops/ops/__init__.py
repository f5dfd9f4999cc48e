"""Basic ops: compose them in `te_fused_ops.Sequential` or call one on its own."""

from .activation import Activation, ClampedSwiGLU, GeGLU, ScaledSwiGLU, SReLU, SwiGLU
from .base import BasicOp, OpContext, Recompute
from .grouped_linear import GroupedLinear
from .moe import Permute, TopKRouter, Unpermute
from .quantize import Quantize
from .transpose import Transpose

__all__ = [
    "Activation",
    "BasicOp",
    "ClampedSwiGLU",
    "GeGLU",
    "GroupedLinear",
    "OpContext",
    "Permute",
    "Quantize",
    "Recompute",
    "SReLU",
    "ScaledSwiGLU",
    "SwiGLU",
    "TopKRouter",
    "Transpose",
    "Unpermute",
]
