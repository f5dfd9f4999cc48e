"""The sm90 implementations of the built-in rules, each with the check of what the kernels take.

Formats folded into a step (`te_fused_ops.context.Format`) run on the kernels too: an input
Quantize on the cast kernels (with the column-wise copy from the same read where the FP8 weight
gradient reads it), an output "fp8_blockwise" Quantize[, Transpose] in the GEMM's epilogue (the
output is never written in bf16), an output "fp8_current" Quantize after the kernel with the amax
from the epilogue. What the kernels do not take is a reason: the planner then folds less and the
remaining ops run as their own steps.
"""

import torch

from ... import env
from ...activations import ACTIVATIONS
from ...fusion_rules.dactivation_grouped_linear import backward_reference
from ...fusion_rules.grouped_linear_activation import activation_after_linear
from ...context import Recompute
from ...quantization import Float8BlockScaling, Float8CurrentScaling, high_precision_wgrad, is_quantized
from .backend import SM90, kernel_reason, sm_margin
from .moe import (
    combine_backward_cast,
    combine_backward_copies,
    dy_by_index,
    gather_tokens,
    permute_on_kernels,
    rows_supported_reason,
    unpermute_backward,
)
from .kernels.grouped_gemm import (
    CAST_COLUMNS_MULTIPLE,
    GATHER_K_MULTIPLE,
    grouped_gemm_gathered_sm90,
    grouped_dgrad_dact_fp8_sm90,
    grouped_dgrad_dact_sm90,
    sm90_grouped_dgrad_dact_fp8_unsupported_reason,
    sm90_grouped_dgrad_dact_unsupported_reason,
)
from .linear import (
    FP8_KERNEL_RECIPES,
    linear_output_sm90,
    backward_unsupported_reason,
    casts_on_kernel,
    columns_unsupported_reason,
    emulated_recipe_reason,
    epilogue_args,
    fp8_dgrad_operands,
    fp8_grad_casts,
    fp8_wgrad_applies,
    fp8_wgrad_shape_reason,
    kernel_unsupported_reason,
    linear_backward,
    linear_param_grads,
    quantize_rows,
    quantize_rows_and_columns,
    quantized_input_param_grads,
    rows_quantized,
    run_grouped_gemm,
)

# FC1 output widths up to which reading x's rows by index beats the permuted copy in the layer step
# (H100: 1.5-2.5% faster at 1536 and 4096, level at 5760; FC1 alone 1.4% slower at 28672).
GATHER_MAX_WIDTH = 4096

# FC2 input widths I up to which its backward reads dy's rows by index instead of the combine's
# backward writing dy's expert-ordered copy: the rows are read once per tile of I, the copy is
# written once (H200 layer step: 1.5-2.3% faster at I 768, 0.7% at 1024; level at 1408 and
# 2048; 1.3-2.4% slower at 2880, about 0.5% at 14336). Level up to 2048, and reading by index
# there lets FC2's weight gradient wait for d_pre to be freed: the step's peak falls (H100: dsv3
# 3505 -> 2929 MiB, I 1408 shapes 17-25% lower, their steps level)
GATHER_DY_MAX_WIDTH = 2048

# ---------------------------------------------------------------------------------------------
# casts: a lone Quantize, and a Quantize folded before a GroupedLinear


def recipe_cast_reason(recipe, dtype):
    """Why the cast kernels cannot cast a ``dtype`` tensor with ``recipe``, or None."""
    if not casts_on_kernel(recipe):
        return f"{recipe.name} cast runs in torch (the sm90 cast kernels make fp8_blockwise and fp8_current scales)"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(dtype).removeprefix('torch.')} not supported (bf16, fp16)"
    return None


def input_cast_reason(fmt, info):
    """Why the cast kernels cannot make the Quantize of input format ``fmt``, or None (a lone
    Transpose needs no kernel: the sm90 GEMMs read the rows in place)."""
    return None if fmt is None or fmt.recipe is None else recipe_cast_reason(fmt.recipe, info.dtype)


def cast_rows(quantize, ctx, x):
    """The Quantize op's row-wise cast of ``x`` on the cast kernels (in torch where the kernel's
    16-byte accesses do not fit the rows: the same bytes); x its ``source`` as the op keeps it."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.shape[-1] % 8 or rows.data_ptr() % 16:
        return quantize.op_forward(ctx, x)
    made = quantize_rows(rows.view(x.shape), quantize.recipe, ctx.side["offsets"])
    if high_precision_wgrad(quantize.recipe):
        made.source = x.detach()
    return made


def cast_input(linear, ctx, x):
    """``x`` through the input format of ``linear`` (its context's): fp8_blockwise with the
    block-padded column-wise copy from the same read where the weight gradient runs in FP8, else
    the row-wise cast; a Transpose adds nothing (the kernels read the rows in place)."""
    fmt = ctx.input_format
    if fmt is None or fmt.recipe is None:
        return x
    if is_quantized(x):  # requantized in torch, as the Quantize op does
        return fmt.apply(x)
    if input_columns_wanted(linear, ctx, fmt):
        return quantize_rows_and_columns(x, fmt.recipe, fmt.offsets)
    return cast_rows(fmt.ops[0], fmt.ctxs[0], x)


def input_columns_wanted(linear, ctx, fmt) -> bool:
    """Whether the cast of ``linear``'s input also writes the block-padded column-wise copy: where
    its FP8 weight gradient reads it (fp8_blockwise, a weight gradient, a shape it takes)."""
    return (isinstance(fmt.recipe, Float8BlockScaling) and not fmt.recipe.high_precision_wgrad
            and ctx.params_require_grad and fp8_wgrad_shape_reason(linear) is None)


def _supports_quantize(ops, info):
    if info.input_recipe[0] is not None:
        return "quantized input (dequantized and requantized in torch)"
    return recipe_cast_reason(ops[0].recipe, info.dtype)


@SM90.implement("quantize", supports=_supports_quantize)
def _quantize(ops, ctxs, x):
    return cast_rows(ops[0], ctxs[0], x)


# ---------------------------------------------------------------------------------------------
# GroupGemm (+ Activation) forward


def output_cast_reason(fmt, info, cols: int, groups: int, act=None):
    """Why the GEMM (with ``act``) cannot cast its ``cols``-column output to ``fmt`` in the
    epilogue, or None."""
    if fmt is None:
        return None
    if fmt.recipe is None:
        return "a Transpose after the GEMM without a Quantize runs as its own op"
    if act is not None and isinstance(fmt.recipe, Float8CurrentScaling):
        if fmt.columns:
            return "fp8_current: the epilogue writes no column-wise copy (the Transpose runs after the cast)"
        return None  # the act's amax from the epilogue, then the cast kernel
    if not isinstance(fmt.recipe, Float8BlockScaling):
        return f"{fmt.recipe.name}: no cast epilogue for this recipe (the output is cast after the kernel, rule 'quantize')"
    if info.input_recipe[0] is not None:
        return fp8_act_cast_reason(fmt, act, cols)
    if act is not None and not ACTIVATIONS[act.kernel_name].glu:
        return f"{act.op_name}: the act-cast epilogue takes GLU activations (the act is cast after the kernel)"
    if not fmt.columns or high_precision_wgrad(fmt.recipe):  # no column copy with 16-bit weight gradients
        return None
    return columns_unsupported_reason(fmt.recipe, cols, groups)


def fp8_act_cast_reason(fmt, act, cols: int):
    """Why the FP8 GEMM (quantized input) cannot cast its GLU act of ``cols`` columns to ``fmt``
    (fp8_blockwise) in the epilogue (`grouped_gemm_act_quant_fp8_sm90`), or None: only with 16-bit
    weight gradients (no column-wise copy; with it the epilogue measured level with the cast
    after the kernel), a GLU activation, ``cols`` a multiple of 128."""
    after = "the output is cast after it, rule 'quantize'"
    if not high_precision_wgrad(fmt.recipe):
        return (f"quantized input with FP8 weight gradients: the FP8 kernel's act cast with the column-wise copy "
                f"measured no faster than the cast after the kernel ({after})")
    if act is None or not ACTIVATIONS[act.kernel_name].glu:
        return f"quantized input: the FP8 kernel's act cast takes a GLU activation ({after})"
    if cols % CAST_COLUMNS_MULTIPLE:
        return f"quantized input: the FP8 kernel's act cast needs I a multiple of {CAST_COLUMNS_MULTIPLE}, got {cols} ({after})"
    return None


def _supports_grouped_linear(ops, info):
    linear = ops[0]
    return (input_cast_reason(info.input_format[0], info) or kernel_unsupported_reason(linear, info)
            or output_cast_reason(info.output_format[0], info, linear.out_features, linear.num_groups))


@SM90.implement("grouped_linear", supports=_supports_grouped_linear)
def _grouped_linear(ops, ctxs, x):
    linear, ctx = ops[0], ctxs[0]
    x = cast_input(linear, ctx, x)
    out = ctx.output_format
    if out is None:
        return run_grouped_gemm(linear, ctx, x)[0]
    _, data, scale_inv, *made = run_grouped_gemm(linear, ctx, x, act_cast=out.recipe, columns=out.columns)
    return rows_quantized(data, scale_inv, data.shape, x.dtype, out.recipe, out.offsets, *made)


def _supports_grouped_linear_activation(ops, info):
    linear, act = ops
    if act.kernel_name is None:
        return f"no kernel epilogue for {act.op_name}"
    return (input_cast_reason(info.input_format[0], info) or kernel_unsupported_reason(linear, info, act.kernel_name)
            or output_cast_reason(info.output_format[1], info, linear.out_features // 2 if act.glu else
                                  linear.out_features, linear.num_groups, act))


@SM90.implement("grouped_linear+activation", supports=_supports_grouped_linear_activation)
def _grouped_linear_activation(ops, ctxs, x):
    linear, act = ops
    x = cast_input(linear, ctxs[0], x)
    epilogue, out = epilogue_args(act, ctxs[1]), ctxs[1].output_format
    if out is None:
        pre, y = run_grouped_gemm(linear, ctxs[0], x, act.kernel_name, **epilogue)
        return activation_after_linear(act, ctxs, pre, y)
    if isinstance(out.recipe, Float8BlockScaling):
        hp_wgrad = out.recipe.high_precision_wgrad
        pre, data, scale_inv, *made = run_grouped_gemm(linear, ctxs[0], x, act.kernel_name, act_cast=out.recipe,
                                                       columns=out.columns and not hp_wgrad, **epilogue)
        activation_after_linear(act, ctxs, pre)
        act_rows = rows_quantized(data, scale_inv, data.shape, pre.dtype, out.recipe, out.offsets, *made)
        if hp_wgrad:  # the act is not written in 16 bits: the weight gradient recomputes it from pre
            act_rows.source = Recompute(act.compute, ctxs[1].side, ctxs[1].saved.input)
        return act_rows
    pre, y, amax_parts = run_grouped_gemm(linear, ctxs[0], x, act.kernel_name, act_amax=True, **epilogue)
    activation_after_linear(act, ctxs, pre)
    return quantize_rows(y, out.recipe, out.offsets, amax_parts)


def _gather_rows_reason(reader, copy, hidden, weight_gradient=False, what=None, width=0, limit=None):
    """Why ``TE_FUSED_OPS_GATHER_ROWS`` has ``reader`` read ``copy`` (0; wgrad, unless
    ``weight_gradient``: the reader includes a weight gradient, which then reads by index; auto and
    ``what``, the width ``width``, past ``limit`` where one is given), or why gathered rows cannot
    run (``hidden`` not a multiple of 64); None where the rows may be read by index."""
    gather = env.read("TE_FUSED_OPS_GATHER_ROWS", "sm90 backend")
    if gather is False or (gather == "wgrad" and not weight_gradient):
        return f"TE_FUSED_OPS_GATHER_ROWS={int(gather) if gather is False else gather} ({reader} reads {copy})"
    if gather is None and limit is not None and width > limit:
        return (f"{what} {width} > {limit}: {copy} measured faster (TE_FUSED_OPS_GATHER_ROWS=1 reads the "
                "rows by index anyway)")
    if hidden % GATHER_K_MULTIPLE:
        return f"hidden size {hidden} not a multiple of {GATHER_K_MULTIPLE} (gathered rows)"
    return None


def _supports_gathered_fc1(ops, info):
    """`_gather_rows_reason` (auto: FC1 at most `GATHER_MAX_WIDTH` wide), the permute on the row
    kernels' terms, FC1 + activation on the 16-bit kernel with no cast before or after it."""
    linear = ops[1]
    reason = _gather_rows_reason("FC1", "the permuted copy", linear.in_features, what="FC1 width",
                                 width=linear.out_features, limit=GATHER_MAX_WIDTH)
    if reason:
        return reason
    return rows_supported_reason(ops[:1], info.window(0, 1)) or _supports_grouped_linear_activation(
        ops[1:], info.window(1, 3))


@SM90.implement("permute+grouped_linear+activation", supports=_supports_gathered_fc1)
def _permute_gathered_grouped_linear_activation(ops, ctxs, x):
    """FC1 + activation reading x's rows by index (`grouped_gemm_gathered_sm90`): the permuted
    copy is never written; FC1's weight gradient gets it as the permute's recompute. Rows the
    kernels do not take: the permute, then `grouped_linear+activation`."""
    _, linear, act = ops
    tokens = gather_tokens(ctxs[0], x)
    if tokens is None:
        rows = permute_on_kernels(ops[:1], ctxs[:1], x)
        ctxs[1].input_recompute = ctxs[0].recompute_output
        return _grouped_linear_activation(ops[1:], ctxs[1:], rows)
    x, index = tokens
    ctxs[1].input_recompute = ctxs[0].recompute_output
    weight, bias = ctxs[1].params["weight"], ctxs[1].params.get("bias")
    linear.check_input(x, weight)
    pre, y = grouped_gemm_gathered_sm90(
        x, index, weight.detach(), ctxs[1].side["offsets"], bias=None if bias is None else bias.detach(),
        activation=act.kernel_name, sm_margin=sm_margin(), pingpong=None, **epilogue_args(act, ctxs[2]))
    linear.keep_for_backward(ctxs[1], ctxs[0].recompute_output, None, linear_output_sm90)
    return activation_after_linear(act, ctxs[1:], pre, y)


# ---------------------------------------------------------------------------------------------
# backward: GroupedLinear, GroupGemm + dActivation (+ the preceding GroupedLinear)


@SM90.implement("grouped_linear_backward", supports=lambda ops, info: backward_unsupported_reason(ops[0], info, 0))
def _grouped_linear_backward(ops, ctxs, dy):
    dx, grads = linear_backward(ops[0], ctxs[0], dy)
    return dx, [grads]


def _supports_dactivation(ops, info):
    """bf16: (Activation, [Transpose,] GroupedLinear); FP8: (Activation, Quantize[, Transpose],
    GroupedLinear) after an FP8 forward of the GroupedLinear."""
    act, linear = ops
    if act.kernel_name is None:
        return f"no kernel epilogue for {act.op_name}"
    if not info.input_requires_grad[0]:
        return "the activation's input needs no gradient"
    fmt = info.input_format[1]
    if fmt is None or fmt.recipe is None:
        unsupported = sm90_grouped_dgrad_dact_unsupported_reason
    else:
        if fmt.quantize_grad:
            return "Quantize(quantize_grad=True) casts the gradient between the GEMM and the dActivation"
        if not isinstance(info.input_recipe[1], FP8_KERNEL_RECIPES):
            return emulated_recipe_reason(info.input_recipe[1])
        unsupported = sm90_grouped_dgrad_dact_fp8_unsupported_reason
    return (kernel_reason(unsupported(info.dtype, linear.out_features, linear.in_features, act.kernel_name))
            or backward_unsupported_reason(linear, info, 1))


def _act_grads(act_ctx, d_probs) -> dict:
    """The activation's side-input gradients from the kernel's d_probs (its (P, M) partials: the
    kernels are called with ``d_probs_parts``, so their sum rides in the pass to the slots)."""
    return act_ctx.op.probs_grads(act_ctx, d_probs) if act_ctx.needs_grad("probs") else {}


def _dact_bf16(ops, ctxs, dy, dy_index=None, wgrad_dy=None, wgrad_dy_to_wait=False):
    """One kernel: d_pre = act'(pre) * (dy @ W[g]) and act(pre) (the weight gradient's operand, unless the
    forward kept it: `Activation.recompute_output`);
    then the varlen-K weight gradient. d_pre is written over pre where the forward made pre for
    this backward alone (`OpContext.input_overwritable`): each tile reads its pre before it stores
    its d_pre there, so the two never occupy memory together. With ``dy_index`` (M,) int32 dy is
    the caller's (T, N) in token order and both kernels read its rows by index; with ``wgrad_dy``
    ((T, N) dy, (M,) index) the weight gradient alone reads those, or with ``wgrad_dy_to_wait``
    only where its wait for d_pre would otherwise hold dy (expert-ordered rows) to the end."""
    act, linear = ops
    act_ctx, linear_ctx = ctxs
    if linear_ctx.saved.recipe is not None or is_quantized(dy):
        return backward_reference(ops, ctxs, dy)
    dy = dy.contiguous()
    # the act FC2's weight gradient reads (none for a frozen weight): written by the kernel where
    # the forward kept it as a recompute from pre (`act_from_pre`), else loaded before the kernel
    # (a recompute must run before d_pre takes pre's place)
    wants_act = linear_ctx.needs_grad("weight")
    emit_act = wants_act and act_from_pre(act, linear_ctx)
    kept_act = linear_ctx.load_input() if wants_act and not emit_act else None
    pre = act_ctx.load_input()
    over_pre = act_ctx.input_overwritable()
    d_pre, out, d_probs = grouped_dgrad_dact_sm90(
        dy, linear_ctx.saved.weight.detach(), linear_ctx.side["offsets"], pre, dy_index=dy_index,
        activation=act.kernel_name, out=pre if over_pre else None, sm_margin=sm_margin(),
        d_probs_parts=True, emit_act=emit_act, **epilogue_args(act, act_ctx),
    )
    if not emit_act:
        out = kept_act
    if wgrad_dy_to_wait and not (over_pre and _waits_for_d_pre(linear_ctx, d_pre, out, dy)):
        wgrad_dy = None  # no wait, or not one holding dy: the weight gradient reads dy's rows now
    if wgrad_dy is not None:
        dy, dy_index = wgrad_dy
    held = (out,) if dy_index is not None else (out, dy)  # dy in token order: the caller's, alive anyway
    defer = _wgrad_after_d_pre(act_ctx, linear_ctx, d_pre if over_pre else None, *held)
    return d_pre, [_act_grads(act_ctx, d_probs),
                   linear_param_grads(linear_ctx, dy, x=out, dy_index=dy_index, defer=defer)]


def _wgrad_after_d_pre(act_ctx, linear_ctx, d_pre, *held) -> bool:
    """Where ``d_pre`` was written over the saved pre-activation (else None): hands it to the
    runner to free once FC1's backward has read it (`OpContext.grad_over_input`) and says whether
    FC2's weight gradient waits until then (a `DeferredGrad`, so it never meets d_pre and FC1's
    weight gradient at the peak). It waits where the tensors the wait keeps alive (``held``: its
    operands) are no larger than the gradient (so FC1's backward peaks lower) nor than d_pre (so
    the end of the backward peaks no higher than dW1 + dW2 + d_pre did): FC2's weight gradient
    reading dy by index, whose act is half of d_pre. Not in a chunked segment, which merges its
    chunks' gradients itself (``grad_buffers``)."""
    if d_pre is None:
        return False
    act_ctx.grad_over_input = d_pre
    return _waits_for_d_pre(linear_ctx, d_pre, *held)


def _waits_for_d_pre(linear_ctx, d_pre, *held) -> bool:
    """Whether FC2's weight gradient, its operands ``held``, waits for d_pre's storage to be freed
    (`_wgrad_after_d_pre`)."""
    if linear_ctx.grad_buffers or not linear_ctx.needs_grad("weight"):
        return False  # a frozen weight holds no act (None)
    return sum(t.numel() for t in held) <= min(linear_ctx.saved.weight.numel(), d_pre.numel())


def _dact_fp8(ops, ctxs, dy, d_pre_amax: bool = False, dy_casts=None):
    """One kernel: d_pre = act'(pre) * (dy @ W[g]) on FP8 operands (the forward's recipe),
    written over pre where the forward made pre for this backward alone; then the weight gradient
    (`fp8_grad_casts`: FP8 for fp8_blockwise, else bf16 on the dequantized input). A quantized dy
    takes the reference. ``dy_casts``: a `Recompute` making dy's copies as `fp8_grad_casts` makes
    them (the weight gradient must then run in FP8, or on dy: None, or a `Recompute` of the 16-bit
    rows made after the kernel); called here, so the copies live only while this backward runs.
    Returns (d_pre, grads, d_pre's amax parts with ``d_pre_amax``, else None)."""
    act, _ = ops
    act_ctx, linear_ctx = ctxs
    if dy_casts is None:
        if is_quantized(dy):
            return (*backward_reference(ops, ctxs, dy), None)
        dy = dy.contiguous()
    recipe = linear_ctx.saved.recipe
    # the act FC2's weight gradient reads: written by the kernel where the forward kept it as a
    # recompute from pre (`act_from_pre`), else loaded before the kernel (a recompute must run
    # before d_pre takes pre's place)
    emit_act = linear_ctx.needs_grad("weight") and act_from_pre(act, linear_ctx)
    x = linear_ctx.load_input() if linear_ctx.needs_grad("weight") and not emit_act else None
    dy_rows, dy_columns = dy_casts() if dy_casts is not None else fp8_grad_casts(linear_ctx, dy, recipe, x, True)
    pre = act_ctx.load_input()
    operands = (*fp8_dgrad_operands(linear_ctx, dy_rows, recipe), linear_ctx.side["offsets"], pre)
    kwargs = dict(activation=act.kernel_name, sm_margin=sm_margin(), d_probs_parts=True, **epilogue_args(act, act_ctx))
    outputs = grouped_dgrad_dact_fp8_sm90(*operands, d_pre_amax=d_pre_amax, emit_act=emit_act,
                                          out=pre if act_ctx.input_overwritable() else None, **kwargs)
    if emit_act:
        x, outputs = outputs[1], (outputs[0], *outputs[2:])
    del operands, dy_rows  # dy's E4M3 rows are read by the kernel alone
    if isinstance(dy, Recompute):
        dy = dy()
    grads = [_act_grads(act_ctx, outputs[1]),
             quantized_input_param_grads(linear_ctx, dy, x, dy_columns, out_dtype=pre.dtype)]
    return outputs[0], grads, outputs[2] if d_pre_amax else None


def act_from_pre(act, linear_ctx) -> bool:
    """Whether FC2's saved input is ``act`` recomputed from pre (FC1, bf16 or FP8, casting its act in
    the epilogue with 16-bit weight gradients, `_grouped_linear_activation`): the dActivation kernel
    then writes that act itself."""
    source = linear_ctx.saved.get("input")
    return isinstance(source, Recompute) and source.fn == act.compute


@SM90.implement("dactivation+grouped_linear", supports=_supports_dactivation)
def _dactivation_grouped_linear(ops, ctxs, dy):
    fmt = ctxs[1].input_format
    if fmt is None or fmt.recipe is None:
        return _dact_bf16(ops, ctxs, dy)
    return _dact_fp8(ops, ctxs, dy)[:2]


def _supports_with_fc1(ops, info):
    """FC1's input fp8_current or fp8_blockwise (FC2's is quantized: the rule's own check), FC1's
    input needing its gradient, both backwards on the kernels."""
    recipe = info.input_recipe[0]
    if not isinstance(recipe, (Float8CurrentScaling, Float8BlockScaling)):
        return "FC1's input is neither fp8_current nor fp8_blockwise (no cast of d_pre to feed)"
    if not info.input_requires_grad[0]:
        return "FC1's input needs no gradient (no cast of d_pre)"
    return _supports_dactivation(ops[1:], info.window(1, 3)) or backward_unsupported_reason(ops[0], info, 0)


@SM90.implement("grouped_linear+dactivation+grouped_linear", supports=_supports_with_fc1)
def _grouped_linear_dactivation_grouped_linear(ops, ctxs, dy, dy_casts=None, dy_rows16=None):
    """`_dact_fp8`, d_pre written in 16 bits over the saved pre-activation, then FC1's backward
    (`linear_backward`) on it. fp8_current: d_pre's amax comes from the kernel's epilogue, and
    FC1's cast of d_pre takes it. fp8_blockwise: FC1's backward casts d_pre to its two E4M3 copies
    in one kernel (`block_columns_sm90`: rows and columns from one read), which measured faster
    than casting them in the dActivation's epilogue. ``dy_casts``: a `Recompute` of FC2's copies of
    dy (`_dact_fp8`); dy is then not read, and ``dy_rows16`` (a `Recompute`) the 16-bit
    expert rows FC2's `high_precision_wgrad` weight and bias gradients read (None: none). Both are
    made inside FC2's backward and freed after it, before FC1's backward allocates."""
    fc1, fc1_ctx = ops[0], ctxs[0]
    current = isinstance(fc1_ctx.saved.recipe, Float8CurrentScaling)
    fc2_dy = dy if dy_casts is None else dy_rows16
    d_pre, grads, amax_parts = _dact_fp8(ops[1:], ctxs[1:], fc2_dy, d_pre_amax=current, dy_casts=dy_casts)
    dx, fc1_grads = linear_backward(fc1, fc1_ctx, d_pre, amax_parts)
    return dx, [fc1_grads, *grads]


def _supports_combine_cast(ops, info):
    """The three-op rule's kernels, FC2 without a bias (its gradient would sum dy's expert rows,
    which are made in 16 bits only with FC2's `high_precision_wgrad`), the combine's rows on the
    row kernels."""
    fc2 = ops[2]
    bias_reason = None
    if fc2.bias is not None and not high_precision_wgrad(info.input_recipe[2]):
        bias_reason = "FC2 has a bias (its gradient sums dy's expert rows)"
    return (_supports_with_fc1(ops[:3], info.window(0, 3)) or bias_reason
            or rows_supported_reason(ops[3:], info.window(3, 4)))


@SM90.implement("grouped_linear+dactivation+grouped_linear+unpermute", supports=_supports_combine_cast)
def _experts_and_combine_backward(ops, ctxs, dy):
    """The combine's backward with FC2's cast of dy in it (`combine_backward_cast`: each token's
    row cast once, its E4M3 row and scales moved to its expert rows, the column-wise copy made
    from them), then the three-op backward on those copies; where that cast does not apply, the
    combine's backward on the row kernels, then the three-op backward."""
    fc2_ctx, combine_ctx = ctxs[2], ctxs[3]
    recipe, offsets = fc2_ctx.saved.recipe, fc2_ctx.side["offsets"]
    if combine_backward_copies(combine_ctx, dy):
        # dy's copies made where FC2's backward reads them (`_dact_fp8`), so none outlives it
        if high_precision_wgrad(recipe):
            # the E4M3 rows for FC2's data gradient cast in the scatter, the 16-bit ones (where its
            # weight or bias gradient reads them) moved beside
            dy_casts = Recompute(combine_backward_cast, combine_ctx, dy, recipe, offsets, False)
            rows16 = None
            if fc2_ctx.needs_grad("weight") or fc2_ctx.needs_grad("bias"):
                rows16 = Recompute(_expert_rows, ops[3:], ctxs[3:], dy)
            dx, grads = _grouped_linear_dactivation_grouped_linear(ops[:3], ctxs[:3], dy, dy_casts, rows16)
            return dx, [*grads, {}]
        x = fc2_ctx.load_input() if fc2_ctx.needs_grad("weight") else None
        if isinstance(recipe, Float8BlockScaling) and (x is None or fp8_wgrad_applies(fc2_ctx, recipe, x)):
            dy_casts = Recompute(combine_backward_cast, combine_ctx, dy, recipe, offsets, x is not None)
            dx, grads = _grouped_linear_dactivation_grouped_linear(ops[:3], ctxs[:3], dy, dy_casts)
            return dx, [*grads, {}]
    dy_rows, combine_grads = unpermute_backward(ops[3:], ctxs[3:], dy)
    dx, grads = _grouped_linear_dactivation_grouped_linear(ops[:3], ctxs[:3], dy_rows)
    return dx, [*grads, *combine_grads]


def _expert_rows(ops, ctxs, dy):
    """The combine's backward: dy's expert rows (`unpermute_backward`)."""
    return unpermute_backward(ops, ctxs, dy)[0]


def _supports_dy_by_index(ops, info):
    """`_gather_rows_reason` (auto at any width: past `GATHER_DY_MAX_WIDTH` the rule reads dy by
    index in the weight gradient alone, where that spares a copy), the 16-bit dActivation kernel,
    FC2 without a bias, the combine's rows on the row kernels."""
    linear = ops[1]
    reason = _gather_rows_reason("FC2's backward", "dy's expert-ordered copy", linear.out_features,
                                 weight_gradient=True)
    if reason:
        return reason
    if linear.bias is not None:
        return "FC2 has a bias (its gradient sums dy's expert rows)"
    fmt = info.input_format[1]
    if fmt is not None and fmt.recipe is not None:
        return "FC2's input is quantized (its FP8 backward reads dy's cast copies)"
    return _supports_dactivation(ops[:2], info.window(0, 2)) or rows_supported_reason(ops[2:], info.window(2, 3))


@SM90.implement("dactivation+grouped_linear+unpermute", supports=_supports_dy_by_index)
def _dactivation_grouped_linear_dy_by_index(ops, ctxs, dy):
    """FC2's data gradient + dActivation and its weight gradient reading dy's rows by index
    (`dy_by_index`): the combine's backward writes nothing. With ``TE_FUSED_OPS_GATHER_ROWS=wgrad``
    the weight gradient alone: the data gradient reads the combine's backward's rows, freed before
    the weight gradient runs. Auto past `GATHER_DY_MAX_WIDTH`: the data gradient reads those rows,
    and the weight gradient reads dy by index only where its wait for d_pre would otherwise hold
    them to the end of the backward (`_dact_bf16`'s ``wgrad_dy_to_wait``). Where the combine applies
    the probabilities, runs on other ranks or FC2 accumulates into main_grad: the combine's
    backward, then `dactivation+grouped_linear`."""
    linear_ctx, combine_ctx = ctxs[1:]
    tokens = None
    if linear_ctx.saved.recipe is None and not is_quantized(dy) and linear_ctx.main_grads.get("weight") is None:
        tokens = dy_by_index(combine_ctx, dy)
    gather = env.read("TE_FUSED_OPS_GATHER_ROWS", "sm90 backend")
    wide = gather is None and ops[1].in_features > GATHER_DY_MAX_WIDTH
    if tokens is None or gather == "wgrad" or wide:
        dy_rows, combine_grads = unpermute_backward(ops[2:], ctxs[2:], dy)
        if tokens is None:
            d_pre, grads = _dactivation_grouped_linear(ops[:2], ctxs[:2], dy_rows)
        else:
            d_pre, grads = _dact_bf16(ops[:2], ctxs[:2], dy_rows, wgrad_dy=tokens, wgrad_dy_to_wait=wide)
        return d_pre, [*grads, *combine_grads]
    d_pre, grads = _dact_bf16(ops[:2], ctxs[:2], *tokens)
    return d_pre, [*grads, {}]
