"""Forward GroupGemm + Activation, with optional input and output formats.

The fused forward keeps the pre-activation (which the activation's backward needs anyway) and
not the activation output: the next GroupedLinear's weight gradient recomputes it (memory
contract: less saved than the unfused chain, which keeps both). With
``GroupedLinear(recompute_output=True)`` it keeps neither: the backward reruns the GEMM for pre.
A Quantize[, Transpose] after the activation is its output format (a kernel backend may cast in
the GEMM's epilogue and never write the activation in bf16); one before the GroupedLinear is its
input format.
"""

from te_fused_ops.fusion import FusionRule, register_rule
from te_fused_ops.ops import Activation, GroupedLinear


def activation_after_linear(act: Activation, ctxs, pre, out=None):
    """Fill the activation's context after the GroupedLinear's (``ctxs``: both) produced ``pre``:
    its input is recomputable where the linear's output is, and private to the call (its backward
    may write over it); its output is recomputable from ``pre`` unless the step casts it (an
    output format) or the op keeps it (``recompute_output=False``). Returns ``out``."""
    ctxs[1].input_recompute = ctxs[0].recompute_output
    ctxs[1].input_private = True
    act.keep_for_backward(ctxs[1], pre, output_recomputable=ctxs[1].output_format is None and act.recompute_output)
    return out


def _reference(ops, ctxs, x):
    linear, act = ops
    if ctxs[0].input_format is not None:
        x = ctxs[0].input_format.apply(x)
    pre = linear.op_forward(ctxs[0], x)
    act.check_input(pre)
    y = activation_after_linear(act, ctxs, pre, act.compute(ctxs[1].side, pre))
    return y if ctxs[1].output_format is None else ctxs[1].output_format.apply(y)


grouped_linear_activation = register_rule(FusionRule(
    "grouped_linear+activation", pattern=(GroupedLinear, Activation), passes="forward", reference=_reference,
    formats=(0, 2)))
