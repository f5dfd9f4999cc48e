"""Permute and Unpermute alone, forward and backward: the MoE layer's row movement as rules, so a
backend can run it on its kernels (the references are the ops' own passes); the permute with a
cast after it; and the permute with FC1 + activation after it (rows read by index in the GEMM)."""

from te_fused_ops.fusion import FusionRule, register_rule
from te_fused_ops.ops import Activation, GroupedLinear, Permute, Unpermute
from te_fused_ops.quantization import Float8BlockScaling

from .grouped_linear_activation import activation_after_linear


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


def _single_gpu_reason(ops, info):
    return "expert parallel (group=): the rows come from other ranks" if ops[0].group is not None else None


def _permute_linear_activation(ops, ctxs, x):
    """The permute, then FC1 + activation on its rows (`grouped_linear+activation`'s reference)."""
    rows = ops[0].op_forward(ctxs[0], x)
    ctxs[1].input_recompute = ctxs[0].recompute_output
    pre = ops[1].op_forward(ctxs[1], rows)
    ops[2].check_input(pre)
    return activation_after_linear(ops[2], ctxs[1:], pre, ops[2].compute(ctxs[2].side, pre))


# FC1 + activation reading the permuted rows by index inside the GEMM: the permuted copy of x is
# never written (a backend may take it, e.g. the sm90 one where TE_FUSED_OPS_GATHER_ROWS allows)
permute_grouped_linear_activation = register_rule(FusionRule(
    "permute+grouped_linear+activation", pattern=(Permute, GroupedLinear, Activation), passes="forward",
    supports=_single_gpu_reason, reference=_permute_linear_activation))
