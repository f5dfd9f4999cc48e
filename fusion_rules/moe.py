"""Permute and Unpermute alone, forward and backward: the MoE layer's row movement as rules, so a
backend can run it on its kernels (the references are the ops' own passes)."""

from te_fused_ops.fusion import FusionRule, register_rule
from te_fused_ops.ops import Permute, Unpermute


def _forward_reference(ops, ctxs, x):
    return ops[0].op_forward(ctxs[0], x)


def _backward_reference(ops, ctxs, dy):
    dx, grads = ops[0].op_backward(ctxs[0], dy)
    return dx, [grads]


permute = register_rule(FusionRule("permute", pattern=(Permute,), passes="forward", reference=_forward_reference))
permute_backward = register_rule(FusionRule(
    "permute_backward", pattern=(Permute,), passes="backward", reference=_backward_reference))
unpermute = register_rule(FusionRule(
    "unpermute", pattern=(Unpermute,), passes="forward", reference=_forward_reference))
unpermute_backward = register_rule(FusionRule(
    "unpermute_backward", pattern=(Unpermute,), passes="backward", reference=_backward_reference))
