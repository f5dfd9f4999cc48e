"""Quantize alone (not folded into a neighbouring step): the row-wise cast."""

from te_fused_ops.fusion import FusionRule, register_rule
from te_fused_ops.ops import Quantize


def _reference(ops, ctxs, x):
    return ops[0].op_forward(ctxs[0], x)


quantize = register_rule(FusionRule("quantize", pattern=(Quantize,), passes="forward", reference=_reference))
