"""Backward GroupGemm + dActivation: the GroupedLinear's data-gradient GEMM with the
activation's backward in its epilogue, ``d_pre = act'(pre) * (dy @ W[g])``.

In forward order the ops are ``Activation, [Quantize[, Transpose]], GroupedLinear``: the casts
are the GroupedLinear's input format (an FP8 forward, so an FP8 data gradient). The second rule
also takes the preceding GroupedLinear (FC1), whose backward a kernel backend may feed from the
same epilogue (d_pre's amax, or d_pre already cast): it applies where both GroupedLinears'
inputs are quantized. The third also takes the combine (`Unpermute`) after FC2: with 1x128 row
blocks a token's gradient is cast once for all its expert rows, in the combine's backward. The
fourth takes the combine after the 16-bit FC2: where the combine is a plain sum, each expert row
of its gradient is a copy of its token's, so a backend may read dy's rows by index in FC2's data
and weight gradients instead of writing them in expert order. The reference runs the ops' own
backwards in sequence.
"""

from te_fused_ops.fusion import FusionRule, register_rule
from te_fused_ops.ops import Activation, GroupedLinear, Unpermute
from te_fused_ops.quantization import Float8BlockScaling


def backward_reference(ops, ctxs, dy):
    """Each op's own backward, last op first, with the folded formats' (straight-through)."""
    grads = [None] * len(ops)
    for i in range(len(ops) - 1, -1, -1):
        dy, grads[i] = ops[i].op_backward(ctxs[i], dy)
        if ctxs[i].input_format is not None:
            dy = ctxs[i].input_format.backward(dy)
    return dy, grads


def _feeds_fc1_cast(ops, info):
    """The rule exists to feed FC1's cast of d_pre: both GroupedLinears' inputs quantized."""
    if info.input_recipe[0] is None:
        return "FC1's input is not quantized (no cast of d_pre to feed)"
    fmt = info.input_format[2]
    if fmt is None or fmt.recipe is None:
        return "FC2's input is not quantized (no FP8 data gradient whose epilogue feeds FC1)"
    return None


dactivation_grouped_linear = register_rule(FusionRule(
    "dactivation+grouped_linear", pattern=(Activation, GroupedLinear), passes="backward",
    reference=backward_reference, formats=(1,)))
grouped_linear_dactivation_grouped_linear = register_rule(FusionRule(
    "grouped_linear+dactivation+grouped_linear", pattern=(GroupedLinear, Activation, GroupedLinear),
    passes="backward", supports=_feeds_fc1_cast, reference=backward_reference, formats=(2,)))


def _combine_casts_dy(ops, info):
    """The rule exists to cast dy once per token in the combine's backward: FC2's input cast with
    1x128 row blocks (a token's rows are copies of one row), FC1's cast fed as above."""
    reason = _feeds_fc1_cast(ops, info)
    if reason:
        return reason
    if getattr(ops[3], "group", None) is not None:
        return "expert parallel: the combine's rows come back from the ranks (its backward runs alone)"
    recipe = info.input_format[2].recipe
    if not isinstance(recipe, Float8BlockScaling):
        return f"FC2's input is {recipe.name}: only 1x128 row blocks let a token's gradient be cast once for its slots"
    return None


grouped_linear_dactivation_grouped_linear_unpermute = register_rule(FusionRule(
    "grouped_linear+dactivation+grouped_linear+unpermute",
    pattern=(GroupedLinear, Activation, GroupedLinear, Unpermute), passes="backward", supports=_combine_casts_dy,
    reference=backward_reference, formats=(2,)))


def _single_gpu(ops, info):
    if getattr(ops[2], "group", None) is not None:
        return "expert parallel: the combine's rows come back from the ranks (its backward runs alone)"
    return None


dactivation_grouped_linear_unpermute = register_rule(FusionRule(
    "dactivation+grouped_linear+unpermute", pattern=(Activation, GroupedLinear, Unpermute), passes="backward",
    supports=_single_gpu, reference=backward_reference))
