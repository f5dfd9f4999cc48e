"""Built-in fusion rules, one module per family. Each module is also a model for user rules:
build a `te_fused_ops.FusionRule`, add implementations per backend, register it."""

from . import dactivation_grouped_linear, grouped_linear, grouped_linear_activation, grouped_linear_quantize, quantize

__all__ = [
    "dactivation_grouped_linear",
    "grouped_linear",
    "grouped_linear_activation",
    "grouped_linear_quantize",
    "quantize",
]
