"""Permute and Unpermute alone, forward and backward: the MoE layer's row movement as rules, so a
backend can run it on its kernels (the references are the ops' own passes)."""

from te_fused_ops.fusion import FusionRule, register_rule
from te_fused_ops.ops import Permute, Unpermute
from te_fused_ops.quantization import Float8BlockScaling


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


def _cast_before_moving_reason(ops, info):
    fmt = info.output_format[0] if info.output_format else None
    if fmt is None or fmt.recipe is None:
        return "no Quantize after the permute"
    if not isinstance(fmt.recipe, Float8BlockScaling):
        return f"{fmt.recipe.name}: only row-local scales (1x128 blocks) let a token be cast before it is moved"
    if fmt.columns:
        return "a Transpose after the cast: the column-wise copy needs the grouped rows"
    return None


def _cast_before_moving(ops, ctxs, x):
    return ops[0].forward_cast_rows(ctxs[0], x, ctxs[0].output_format)


# the Quantize after the permute casts each token once (T rows, not T * k) and its E4M3 row and
# scales move (to the expert rows, or to the ranks as the FP8 payload); the weight gradient's
# column-wise copy of x is then made from the grouped E4M3 rows
permute_quantize = register_rule(FusionRule(
    "permute+quantize", pattern=(Permute,), passes="forward", supports=_cast_before_moving_reason,
    reference=_cast_before_moving, formats=(1,)))
