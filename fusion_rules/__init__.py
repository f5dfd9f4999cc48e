"""Built-in fusion rules, one module per family; installed as ``te_fused_ops.fusion_rules``.

Each module is also a model for user rules: build a `te_fused_ops.FusionRule` with a pattern, a
reference implementation and the format boundaries it takes, and register it. Rules name no
backend: backend packages (`te_fused_ops.backends`) register their implementations by rule name.
"""

from . import (
    dactivation_grouped_linear,
    grouped_linear,
    grouped_linear_activation,
    moe,
    quantize,
)

__all__ = ["dactivation_grouped_linear", "grouped_linear", "grouped_linear_activation", "moe", "quantize"]
