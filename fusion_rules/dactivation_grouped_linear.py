"""Backward GroupGemm + dActivation (+ Quantize (+ Transpose)).

In forward order the ops are ``Activation, [Quantize, [Transpose,]] GroupedLinear``. A fused
kernel runs the GroupedLinear's data-gradient GEMM with the activation's backward in its
epilogue, ``d_pre = act'(pre) * (dy @ W[g])``, and emits the activation output the weight
gradient needs from the saved ``pre`` (the fused forward keeps no activation output). The torch
backend is the reference for it: the same steps in sequence, one rule, one plan step.
"""

from te_fused_ops import FusionRule, register_rule
from te_fused_ops.ops import Activation, GroupedLinear, Quantize, Transpose


def _backward_torch(ops, ctxs, dy):
    grads = [None] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        dy, grads[i] = ops[i].op_backward(ctxs[i], dy)
    return dy, grads


def _rule(name: str, pattern) -> FusionRule:
    rule = FusionRule(name, pattern=pattern, passes="backward")
    rule.implementation("torch")(_backward_torch)
    return register_rule(rule)


dactivation_grouped_linear = _rule("dactivation+grouped_linear", (Activation, GroupedLinear))
dactivation_quantize_grouped_linear = _rule(
    "dactivation+quantize+grouped_linear", (Activation, Quantize, GroupedLinear)
)
dactivation_quantize_transpose_grouped_linear = _rule(
    "dactivation+quantize+transpose+grouped_linear", (Activation, Quantize, Transpose, GroupedLinear)
)
