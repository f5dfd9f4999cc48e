"""te_fused_ops: fused grouped-MLP ops for MoE training, TE-style, with CuTe DSL kernels for Hopper.

Compose basic ops (`GroupedLinear`, `SwiGLU`, ...) in a `Sequential`; the fusion pass runs fused
rules where they apply (`Sequential.explain()` says which, and why others did not fire).

Environment switches (read at each use; a bad value raises ValueError listing the accepted ones, and
importing the package warns about it and about unknown TE_FUSED_OPS_* names):

"""

import importlib
import importlib.util
import pathlib
import sys

from . import env, ops
from .backends import backend_names, list_backends, register_backend
from .cuda_graphs import CudaGraphStep
from .errors import OpInputError, OpTypeError, OpValueError
from .fusion import (
    FusionRule,
    FusionRuleError,
    PlanInfo,
    fusion_rule,
    get_rule,
    list_rules,
    register_rule,
    unregister_rule,
)
from .ops import (
    ClampedSwiGLU,
    GeGLU,
    GroupedLinear,
    Permute,
    Quantize,
    ScaledSwiGLU,
    SReLU,
    SwiGLU,
    TopKRouter,
    Transpose,
    Unpermute,
)
from .quantization import cast_weights_once_per_step, reuse_quantized_weights
from .sequential import Sequential
from .splits import validation

__version__ = "0.1.0"

__all__ = [
    "ClampedSwiGLU",
    "CudaGraphStep",
    "FusionRule",
    "FusionRuleError",
    "GeGLU",
    "GroupedLinear",
    "OpInputError",
    "OpTypeError",
    "OpValueError",
    "Permute",
    "PlanInfo",
    "Quantize",
    "SReLU",
    "ScaledSwiGLU",
    "Sequential",
    "SwiGLU",
    "TopKRouter",
    "Transpose",
    "Unpermute",
    "backend_names",
    "cast_weights_once_per_step",
    "fusion_rule",
    "get_rule",
    "list_backends",
    "list_rules",
    "ops",
    "register_backend",
    "register_rule",
    "reuse_quantized_weights",
    "unregister_rule",
    "validation",
]


def _load_builtin_rules() -> None:
    """Import the built-in rules as ``te_fused_ops.fusion_rules``: installed there from the
    repository's top-level ``fusion_rules/`` folder, or, in a source checkout on ``sys.path``,
    loaded from that folder under the same name (never by the top-level name, which a user's
    own ``fusion_rules`` module may hold)."""
    name = __name__ + ".fusion_rules"
    if importlib.util.find_spec(name) is None:
        folder = pathlib.Path(__file__).resolve().parent.parent / "fusion_rules"
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    importlib.import_module(name)


_load_builtin_rules()
from .backends import sm90 as _sm90, torch as _torch  # noqa: E402,F401  (the backends register themselves)

__doc__ += env.markdown_table() + "\n"
env.warn_about_environment()
