"""GroupedLinear and its casts on the sm90 kernels: the pieces the sm90 implementations of the
rules share (forward GEMM with its epilogues, backward, FP8 casts of activations, gradients and
weights)."""

import torch

from ... import env
from ...activations import ACTIVATIONS
from ...context import DeferredGrad
from ...ops import Activation, GroupedLinear
from ...quantization import (
    Float8BlockScaling,
    Float8CurrentScaling,
    QuantizedTensor,
    high_precision_wgrad,
    is_quantized,
    reuse_or_make,
)
from .backend import kernel_reason, sm_margin
from .kernels.block_quantize import (
    BlockColumns,
    block_columns_sm90,
    block_dequantize_sm90,
    block_quantize_sm90,
    tensor_quantize_sm90,
)
from .kernels.grouped_gemm import (
    grouped_gemm_act_quant_fp8_sm90,
    grouped_gemm_act_quant_sm90,
    grouped_gemm_fp8_sm90,
    grouped_gemm_sm90,
    sm90_act_quant_columns_unsupported_reason,
    sm90_grouped_gemm_fp8_unsupported_reason,
    sm90_grouped_gemm_unsupported_reason,
)
from .kernels.grouped_wgrad import (
    FP8_MAX_GROUPS,
    grouped_column_sums_sm90,
    grouped_wgrad_fp8_sm90,
    grouped_wgrad_gathered_sm90,
    grouped_wgrad_sm90,
    sm90_wgrad_unsupported_reason,
)
from .moe import rows_by_index

FP8_KERNEL_RECIPES = (Float8BlockScaling, Float8CurrentScaling)  # what the FP8 GEMM computes in


def kernel_unsupported_reason(linear: GroupedLinear, info, activation=None):
    """Why the sm90 grouped GEMM cannot run ``linear`` (the first matched op) + ``activation``.
    An fp8_blockwise or fp8_current input runs the block-scaled FP8 kernel (per-tensor
    multipliers broadcast to its blocks); mxfp8 stays emulated."""
    recipe = info.input_recipe[0]
    if recipe is not None:
        if not isinstance(recipe, FP8_KERNEL_RECIPES):
            return emulated_recipe_reason(recipe)
        return kernel_reason(
            sm90_grouped_gemm_fp8_unsupported_reason(info.dtype, linear.out_features, linear.in_features, activation)
        )
    return kernel_reason(
        sm90_grouped_gemm_unsupported_reason(
            info.dtype, linear.out_features, linear.in_features, activation, linear.bias is not None
        )
    )


def emulated_recipe_reason(recipe) -> str:
    """Why a quantized input of ``recipe`` (not one of FP8_KERNEL_RECIPES) runs emulated on sm90."""
    if recipe.name == "mxfp8":
        return "mxfp8 input: emulated on Hopper, which has no MX block-scaling hardware (quantize, dequantize, bf16 GEMM)"
    return f"{recipe.name} input: emulated (the sm90 FP8 kernels take fp8_blockwise and fp8_current)"


def backward_unsupported_reason(linear: GroupedLinear, info, index: int):
    """Why the sm90 kernels cannot run the backward of ``linear`` (op ``index`` of info's window);
    after an FP8_KERNEL_RECIPES input, the FP8 data gradient's conditions (`linear_backward`)."""
    recipe = info.input_recipe[index]
    if recipe is not None:
        if not isinstance(recipe, FP8_KERNEL_RECIPES):
            return emulated_recipe_reason(recipe)
        if info.input_requires_grad[index]:  # dx = dy (E4M3) @ W[g] (E4M3)
            reason = sm90_grouped_gemm_fp8_unsupported_reason(info.dtype, linear.in_features, linear.out_features, None)
            if reason:
                return kernel_reason(reason)
            if linear.in_features % 16:  # the K-major W^T is written in 16 x 16 byte blocks (out_features: above)
                return f"in_features={linear.in_features} not a multiple of 16 (FP8 data gradient's weight transpose)"
        if info.params_require_grad[index]:
            return kernel_reason(sm90_wgrad_unsupported_reason(info.dtype, linear.out_features, linear.in_features))
        return None
    if info.input_requires_grad[index]:  # dx (M, in) = dy (M, out) @ W[g]
        reason = sm90_grouped_gemm_unsupported_reason(info.dtype, linear.in_features, linear.out_features, None, False)
        if reason:
            return kernel_reason(reason)
    if info.params_require_grad[index]:
        return kernel_reason(sm90_wgrad_unsupported_reason(info.dtype, linear.out_features, linear.in_features))
    return None


def columns_unsupported_reason(recipe, cols: int, groups: int):
    """Why a cast epilogue cannot also write the per-group column-wise copy (a Transpose after the
    Quantize) of a ``cols``-column output over ``groups`` groups; the copy is then made later
    (rule 'transpose+grouped_linear' skips it: the FP8 weight gradient makes it from the rows)."""
    if not isinstance(recipe, Float8BlockScaling):
        return f"{recipe.name}: no block-padded column-wise copy for this recipe (rule 'transpose+grouped_linear')"
    return kernel_reason(sm90_act_quant_columns_unsupported_reason(cols, groups))


def epilogue_args(act: Activation, ctx) -> dict:
    """Keyword arguments of the activation's kernel epilogue: the constants its registry entry
    names, read from the op, and the router probabilities of an activation that takes them."""
    spec = ACTIVATIONS[act.kernel_name]
    args = {name: getattr(act, name) for name in spec.constants}
    if spec.takes_probs:
        args["probs"] = ctx.side["probs"].detach().float()
    return args


def run_grouped_gemm(linear: GroupedLinear, ctx, x: torch.Tensor, activation=None, act_cast=None, columns=False,
                     **epilogue):
    """The sm90 kernel on the weight (natural layout, GLU too) this call read; fills ctx like the op.

    A quantized ``x`` (FP8_KERNEL_RECIPES) runs the block-scaled FP8 kernel on the weight cast
    with the same recipe on this call. Returns (pre, act), or with ``act_amax=True`` in
    ``epilogue`` (pre, act, amax parts), as `grouped_gemm_sm90`; with ``act_cast`` (a
    Float8BlockScaling recipe; a GLU activation, or for bf16/fp16 x none) the act, or without an
    activation the output, is cast to E4M3 in the epilogue and not written: (pre or None, data,
    multipliers[, `BlockColumns` with ``columns``]), as `grouped_gemm_act_quant_sm90` /
    `grouped_gemm_act_quant_fp8_sm90`.
    """
    weight, bias = ctx.params["weight"], ctx.params.get("bias")
    linear.check_input(x, weight)
    bias = None if bias is None else bias.detach()
    offsets = ctx.side["offsets"]
    if is_quantized(x):
        # with a data gradient ahead, the cast also writes its transposed copy, kept for it
        w_data, w_scale_inv, *w_transposed = quantize_weight_blocks(
            weight, x.recipe, ctx.reuse_scope, transposed=ctx.input_requires_grad
        )
        operands = (x.rowwise_data, block_multipliers(x.rowwise_scale_inv, x.shape), w_data, w_scale_inv, offsets)
        if act_cast is not None:
            outputs = grouped_gemm_act_quant_fp8_sm90(
                *operands, activation=activation, bias=bias, out_dtype=x.dtype, power_2_scales=act_cast.power_2_scales,
                columns=columns, sm_margin=sm_margin(), **epilogue,
            )
        else:
            outputs = grouped_gemm_fp8_sm90(*operands, bias=bias, activation=activation, out_dtype=x.dtype,
                                            sm_margin=sm_margin(), **epilogue)
        linear.keep_for_backward(ctx, _kept_for_weight_gradient(ctx, x), x.recipe)
        if w_transposed:
            ctx.saved.weight_fp8_t = tuple(w_transposed)
        return outputs
    if act_cast is not None:
        outputs = grouped_gemm_act_quant_sm90(
            x, weight.detach(), offsets, activation=activation, bias=bias,
            power_2_scales=act_cast.power_2_scales, columns=columns, sm_margin=sm_margin(), **epilogue,
        )
        linear.keep_for_backward(ctx, x, None, linear_output_sm90)
        return outputs
    outputs = grouped_gemm_sm90(x, weight.detach(), offsets, bias=bias, activation=activation,
                                sm_margin=sm_margin(), **epilogue)
    linear.keep_for_backward(ctx, x, None, linear_output_sm90)
    return outputs


def _kept_for_weight_gradient(ctx, x: QuantizedTensor) -> QuantizedTensor:
    """What a GroupedLinear keeps of its quantized input ``x``: x, or only its block-padded
    column-wise copy when x carries one and the weight gradient runs on the FP8 kernel (the row-wise
    copy is then dead after the forward GEMM)."""
    if x.block_columns_data is None or not fp8_wgrad_applies(ctx, x.recipe, x):
        return x
    return QuantizedTensor(x.shape, x.dtype, x.device, recipe=x.recipe, role=x.role, offsets=x.offsets,
                           block_columns_data=x.block_columns_data, block_columns_scale_inv=x.block_columns_scale_inv)


def linear_output_sm90(x, weight, bias, offsets) -> torch.Tensor:
    """A GroupedLinear's output on the sm90 kernel, recomputed in the backward (``recompute_output``)."""
    return grouped_gemm_sm90(x, weight.detach(), offsets, bias=None if bias is None else bias.detach(),
                             sm_margin=sm_margin())[0]


def block_multipliers(scale_inv: torch.Tensor, shape) -> torch.Tensor:
    """The FP8 kernel's multipliers for an operand of ``shape``: (M, ceil(K/128)) for (M, K),
    (G, ceil(N/128), ceil(K/128)) for (G, N, K). Block scales pass as they are; a per-tensor
    scale is broadcast to that grid."""
    if scale_inv.dim():
        return scale_inv
    if len(shape) == 2:
        grid = (shape[0], -(-shape[1] // 128))
    else:
        grid = (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    return scale_inv.expand(grid).contiguous()


def casts_on_kernel(recipe) -> bool:
    """Whether the cast kernels make ``recipe``'s data and scales: fp8_blockwise (float32 or
    power-of-two scales) on `block_quantize_sm90`, fp8_current on `tensor_quantize_sm90`."""
    return isinstance(recipe, FP8_KERNEL_RECIPES)


def cast_kernel(x: torch.Tensor, recipe, block_rows: int, offsets=None, amax_parts=None, transposed=False,
                out=None):
    """(data, multipliers) of ``x`` cast with ``recipe`` (`casts_on_kernel`) in 1 x 128
    (block_rows 1, x (M, K)) or 128 x 128 blocks (x (G, N, K); ``transposed``: followed by both
    transposed per group); a per-tensor scale fills its grid. ``offsets``: the grouped rows of x
    (M, K), which alone set a per-tensor scale; ``amax_parts``: that scale's amax from the kernel
    that wrote x (fp8_current); ``out``: an earlier call's outputs, written instead."""
    if isinstance(recipe, Float8BlockScaling):
        return block_quantize_sm90(x, block_rows, recipe.power_2_scales, transposed=transposed, out=out)
    return tensor_quantize_sm90(x, block_rows, offsets, amax_parts, transposed=transposed, out=out)


def quantize_rows(x: torch.Tensor, recipe, offsets, amax_parts=None) -> QuantizedTensor:
    """``x`` (..., K) as the Quantize op makes it (row-wise data and scales), on the cast kernels;
    ``amax_parts``: fp8_current's amax from the GEMM epilogue that wrote x."""
    data, scale_inv = cast_kernel(x.reshape(-1, x.shape[-1]), recipe, 1, offsets, amax_parts)
    return rows_quantized(data, scale_inv, x.shape, x.dtype, recipe, offsets)


def quantize_rows_and_columns(x: torch.Tensor, recipe, offsets) -> QuantizedTensor:
    """``x`` (M, K) as the Quantize op makes it (fp8_blockwise row-wise copy) and, from the same
    read, its block-padded column-wise copy (`block_columns_sm90`, rows past offsets[G] not
    written): for a GroupedLinear whose FP8 weight gradient reads x's columns."""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    if rows.data_ptr() % 16:  # the kernel's 16-byte accesses
        rows = rows.clone()
    columns, data, scale_inv = block_columns_sm90(rows, offsets, rows=True, power_2_scales=recipe.power_2_scales)
    return rows_quantized(data, scale_inv, x.shape, x.dtype, recipe, offsets, columns)


def rows_quantized(data, scale_inv, shape, dtype, recipe, offsets, columns=None) -> QuantizedTensor:
    """The Quantize op's row-wise QuantizedTensor of ``shape`` / ``dtype`` from a 1 x 128 cast's
    (data (M, K) E4M3, multipliers (M, ceil(K/128))) with ``recipe``; ``columns``: the same
    cast's `BlockColumns` (a Transpose after the Quantize), kept as its block-padded copy."""
    if isinstance(recipe, Float8BlockScaling):
        scale_inv = scale_inv.view(*shape[:-1], -1)
    else:  # one scale, repeated over the grid
        scale_inv = scale_inv.view(-1)[0] if scale_inv.numel() else torch.ones((), device=data.device)
    blocks = {} if columns is None else dict(block_columns_data=columns.data, block_columns_scale_inv=columns.scale_inv)
    return QuantizedTensor(shape, dtype, data.device, recipe=recipe, role="activation",
                           rowwise_data=data.view(shape), rowwise_scale_inv=scale_inv, offsets=offsets, **blocks)


def dequantize_rows(x):
    """The bf16/fp16 values of a quantized activation or gradient x (M, K), as
    `QuantizedTensor.dequantize` gives them: on the dequantize kernel from the row-wise copy of
    an FP8_KERNEL_RECIPES tensor, else in torch."""
    if isinstance(x.recipe, FP8_KERNEL_RECIPES) and x.has_rowwise and x.dim() == 2 and x.shape[-1] % 8 == 0:
        return block_dequantize_sm90(x.rowwise_data, block_multipliers(x.rowwise_scale_inv, x.shape), x.dtype)
    return x.dequantize()


def quantize_weight_blocks(weight: torch.Tensor, recipe, reuse_scope, transposed: bool = False):
    """(data (G, N, K) E4M3, multipliers (G, N/128, K/128)) of ``weight`` cast with ``recipe``
    (128 x 128 blocks, or one scale broadcast to them); with ``transposed`` followed by both
    per-group transposed ((G, K, N), (G, K/128, N/128): the data gradient's K-major operand),
    written by the same cast (one read of the weight). Made on every call, unless
    ``reuse_scope`` (the op context's) is open. ``weight``: the parameter itself, not a detached
    alias, so that a kept copy is recast from its data of the moment (``p.data = t`` too) and is
    found as that parameter's."""

    def make(out=None):
        return cast_kernel(weight.detach().contiguous(), recipe, 128, transposed=transposed, out=out)

    return reuse_or_make(weight, recipe, "blocks and transposed" if transposed else "blocks", make, reuse_scope,
                         make_into=lambda kept: make(out=kept))


# FC1 output widths up to which its weight gradient reads x's rows by index instead of permuting x
# again (kernel with its permute, H200, each token id read once: 1.04x at 1536, 0.99x at 4096;
# H100 before that: 0.88x at 5760, 0.93x at 28672). Up to 4096, with FC2's backward reading dy by
# index too, both weight gradients run last and the layer step's peak falls at a level step (H100:
# dsv3 3505 -> 2929 MiB, 14.734 / 14.735 ms; FC1 2816 wide 17-25% lower, level or 0.9% faster)
GATHER_WGRAD_MAX_WIDTH = 4096


def gather_wgrad(dy: torch.Tensor) -> bool:
    """Whether a weight gradient with ``dy`` (M, N) reads a permute's rows by index:
    ``TE_FUSED_OPS_GATHER_ROWS`` 1 or wgrad, or auto and N at most `GATHER_WGRAD_MAX_WIDTH`."""
    setting = env.read("TE_FUSED_OPS_GATHER_ROWS", "sm90 backend")
    return setting in (True, "wgrad") or (setting is None and dy.shape[1] <= GATHER_WGRAD_MAX_WIDTH)


def deferred_if(defer: bool, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` now, or with ``defer`` as a `DeferredGrad` the backward calls last."""
    return DeferredGrad(fn, *args, **kwargs) if defer else fn(*args, **kwargs)


def linear_param_grads(ctx, dy: torch.Tensor, x=None, dy_columns=None, out_dtype=None, dy_index=None,
                       defer: bool = False) -> dict:
    """GroupedLinear's weight gradient (varlen-K kernel, dy and x read in place; accumulated into
    ``weight.main_grad`` when the op asks for it) and bias gradient (from dy). An input saved as
    the permute's recompute of x's rows is read by index instead where `gather_wgrad` says
    (`grouped_wgrad_gathered_sm90`): the permuted copy is not made again, and the
    gradient is a `DeferredGrad`, computed once the permute's backward has freed the expert-ordered
    data gradient.

    ``x``: the op's input (default: what its forward saved). With ``dy_columns`` (`BlockColumns`
    of dy) x is x's `BlockColumns` too and the weight gradient runs on the FP8 kernel, into
    ``out_dtype`` (default dy's; dy may then be None when no bias gradient is needed). With
    ``dy_index`` (M,) int32 dy is (T, N) in token order and its rows are read by index
    (`grouped_wgrad_gathered_sm90` with ``gathered="dy"``; no main_grad, no bias). ``defer``: a
    16-bit weight gradient not accumulated into main_grad is a `DeferredGrad`."""
    offsets, grads = ctx.side["offsets"], {}
    if dy_index is not None:
        if ctx.main_grads.get("weight") is not None or ctx.needs_grad("bias"):
            raise ValueError("linear_param_grads: dy_index takes no main_grad and no bias gradient")
        if ctx.needs_grad("weight"):
            grads["weight"] = deferred_if(defer, grouped_wgrad_gathered_sm90, dy, ctx.load_input() if x is None else x,
                                          dy_index, offsets, gathered="dy", out=ctx.grad_buffers.get("weight"),
                                          sm_margin=sm_margin())
        return grads
    if ctx.needs_grad("weight"):
        main_grad = ctx.main_grads.get("weight")  # accumulated in place by the kernel's epilogue
        out = ctx.grad_buffers.get("weight") if main_grad is None else None  # a chunk's slice of the gradient
        gathered = None
        if dy_columns is None and x is None and main_grad is None and gather_wgrad(dy):
            gathered = rows_by_index(ctx.saved.input)
        if gathered is not None and gathered[0].dtype == dy.dtype:
            # after the permute's backward: its expert-ordered data gradient is freed before dW exists
            dw = DeferredGrad(grouped_wgrad_gathered_sm90, dy, *gathered, offsets, out=out, sm_margin=sm_margin())
        elif dy_columns is None:
            dw = deferred_if(defer and main_grad is None, grouped_wgrad_sm90, dy, ctx.load_input() if x is None else x,
                             offsets, main_grad=main_grad, out=out, sm_margin=sm_margin())
        else:
            out_dtype = dy.dtype if out_dtype is None else out_dtype
            dw = grouped_wgrad_fp8_sm90(dy_columns, x, offsets, out_dtype=out_dtype, main_grad=main_grad,
                                        out=out if out is not None and out.dtype == out_dtype else None,
                                        sm_margin=sm_margin())
        if main_grad is None:
            grads["weight"] = dw
    if ctx.needs_grad("bias"):
        grads["bias"] = grouped_column_sums_sm90(dy, offsets, sm_margin=sm_margin())
    return grads


def linear_backward(linear: GroupedLinear, ctx, dy, dy_amax_parts=None, x=None):
    """GroupedLinear's backward on sm90: dx = dy @ W[g] (W read in place) and the parameter grads
    (``x``: the op's saved input when the caller loaded it already, else loaded here if needed).

    After an FP8 forward the data gradient is an FP8 GEMM: dy cast with the forward's recipe
    (fp8_current: its amax from ``dy_amax_parts`` when the kernel that wrote dy made them), W as
    the forward cast it, transposed (the kernel reads K-major operands); the weight gradient as
    `fp8_grad_casts` and `quantized_input_param_grads` say. A quantized dy takes the torch path."""
    recipe = ctx.saved.recipe
    if is_quantized(dy):
        return linear.op_backward(ctx, dy)
    dy = dy.contiguous()
    offsets = ctx.side["offsets"]
    dx = None
    if recipe is None:
        # the weight gradient first: an input the backward recomputes (a Permute's rows) is freed
        # before dx is allocated, so the two never coexist at the step's peak
        grads = linear_param_grads(ctx, dy)
        if ctx.input_requires_grad:
            dx = grouped_gemm_sm90(dy, ctx.saved.weight.detach(), offsets, weight_layout="kn", sm_margin=sm_margin())[0]
        return dx, grads
    if high_precision_wgrad(recipe):
        # the 16-bit weight gradient first (on x as given or as its kernel reads it, perhaps by
        # index): a recomputed input is freed before dy's cast and dx are allocated
        grads = linear_param_grads(ctx, dy, x)
        if ctx.input_requires_grad:
            dx = fp8_data_grad(ctx, fp8_grad_casts(ctx, dy, recipe, None, True, dy_amax_parts)[0], recipe, dy.dtype)
        return dx, grads
    if x is None and ctx.needs_grad("weight"):
        x = ctx.load_input()
    dy_rows, dy_columns = fp8_grad_casts(ctx, dy, recipe, x, ctx.input_requires_grad, dy_amax_parts)
    if ctx.input_requires_grad:
        dx = fp8_data_grad(ctx, dy_rows, recipe, dy.dtype)
    return dx, quantized_input_param_grads(ctx, dy, x, dy_columns)


def fp8_wgrad_shape_reason(linear: GroupedLinear):
    """Why the FP8 weight-gradient kernel cannot take ``linear``'s shape (N and K multiples of 16,
    G <= 512), or None."""
    if linear.in_features % 16 or linear.out_features % 16 or linear.num_groups > FP8_MAX_GROUPS:
        return (f"the FP8 weight gradient does not run (in_features={linear.in_features}, out_features="
                f"{linear.out_features}: multiples of 16; {linear.num_groups} groups: at most {FP8_MAX_GROUPS})")
    return None


def fp8_wgrad_applies(ctx, recipe, x) -> bool:
    """Whether a GroupedLinear's weight gradient after an FP8 forward, on its saved input ``x``
    (None: no weight gradient), runs on the FP8 kernel: fp8_blockwise (1 x 128 blocks along each
    group's tokens, the torch backend's column-wise copies), x 2-D with a row-wise or block-padded
    column-wise copy, the shape `fp8_wgrad_shape_reason` takes, and not `high_precision_wgrad`.
    Otherwise it is 16-bit, on dy as it came and x's ``source`` (`high_precision_wgrad`) or x
    dequantized (fp8_current)."""
    return (
        x is not None
        and isinstance(recipe, Float8BlockScaling) and not recipe.high_precision_wgrad
        and is_quantized(x) and (x.has_rowwise or x.block_columns_data is not None) and x.dim() == 2
        and fp8_wgrad_shape_reason(ctx.op) is None
    )


def fp8_grad_casts(ctx, dy, recipe, x, rows: bool, dy_amax_parts=None):
    """dy's FP8 copies in the backward of a GroupedLinear after an FP8 forward, ``x`` its saved
    input or None: (row-wise (data, multipliers) for the data gradient with ``rows``, else None;
    dy's `BlockColumns` where the weight gradient runs in FP8 (`fp8_wgrad_applies`), else
    None), both from one read of dy."""
    offsets = ctx.side["offsets"]
    if fp8_wgrad_applies(ctx, recipe, x):
        made = block_columns_sm90(dy, offsets, rows=rows, power_2_scales=recipe.power_2_scales)
        return (tuple(made[1:]), made[0]) if rows else (None, made)
    return (cast_kernel(dy, recipe, 1, offsets, dy_amax_parts) if rows else None), None


def fp8_dgrad_operands(ctx, dy_rows, recipe):
    """(dy data, multipliers, W^T data (G, in, out), multipliers) of a GroupedLinear's FP8 data
    gradient after an FP8 forward: dy's row-wise cast ``dy_rows`` (`fp8_grad_casts`), and W's
    transposed copy the forward's cast wrote (FP8 WGMMA reads K-major operands)."""
    w_transposed = ctx.saved.get("weight_fp8_t")
    if w_transposed is None:
        w_transposed = quantize_weight_blocks(ctx.saved.weight, recipe, ctx.reuse_scope, True)[2:]
    return (*dy_rows, *w_transposed)


def fp8_data_grad(ctx, dy_rows, recipe, out_dtype) -> torch.Tensor:
    """A GroupedLinear's FP8 data gradient after an FP8 forward: dy's row-wise copy ``dy_rows``
    (data, multipliers) @ W[g] (`fp8_dgrad_operands`), in ``out_dtype``."""
    return grouped_gemm_fp8_sm90(*fp8_dgrad_operands(ctx, dy_rows, recipe), ctx.side["offsets"],
                                 out_dtype=out_dtype, sm_margin=sm_margin())[0]


def quantized_input_param_grads(ctx, dy, x, dy_columns=None, out_dtype=None) -> dict:
    """`linear_param_grads` of a GroupedLinear whose forward saved a quantized input ``x`` (None
    when no weight gradient is needed): with ``dy_columns`` the FP8 weight gradient on the
    column-wise copies of dy and of x (the block-padded copy x carries, else made from its
    row-wise copy, as `add_columnwise` does; ``out_dtype`` as there), else the bf16 one on x
    dequantized; x None (not loaded yet) or a 16-bit tensor (a `high_precision_wgrad` source):
    the 16-bit weight gradient on it."""
    if x is None or not is_quantized(x):
        return linear_param_grads(ctx, dy, x)
    if dy_columns is None:
        return linear_param_grads(ctx, dy, dequantize_rows(x))
    if x.block_columns_data is not None:
        x_columns = BlockColumns(x.block_columns_data, x.block_columns_scale_inv, x.shape[0])
    else:
        x_columns = block_columns_sm90(x.rowwise_data, ctx.side["offsets"], x_scale_inv=x.rowwise_scale_inv,
                                       power_2_scales=x.recipe.power_2_scales)
    return linear_param_grads(ctx, dy, x_columns, dy_columns, out_dtype)
