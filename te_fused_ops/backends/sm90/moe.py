"""The sm90 implementations of the MoE row-movement rules (`permute`, `unpermute` and their
backwards) on the row kernels (`kernels.moe_rows`): each token's row is read once and written to
its k expert rows, and the k expert rows of a token are summed in one pass, in float32, in slot
order (deterministic, no atomics). A shape the kernels do not take (hidden size not a multiple
of 8, more than 16 slots per token) runs the op's torch pass.

Expert parallel (``group=``): the same kernels move each token's rows to its send rows (the
routing's ``send_slot_rows``; unused send rows are not written: the receiving rank drops them)
and sum the rows that come back into the tokens (weighted by the probs in the combine); the
received rows are grouped by local expert (k = 1) and back.

FP8 dispatch (``permute+quantize``, a 1x128 Quantize after the permute): each token is cast once
and its E4M3 row and scales move instead of the 16-bit row (about half the bytes): on one GPU in
the scatter itself (`scatter_cast_rows`), to the ranks cast first and sent as fp16 words.
"""

import torch

from ...context import Recompute
from ...ops.moe import check_tokens
from ...quantization import high_precision_wgrad
from ...routing import ExpertParallelRouting, Routing
from .backend import SM90
from .kernels.block_quantize import block_columns_sm90, block_quantize_sm90
from .kernels.moe_rows import MAX_SLOTS, VEC, gather_sum, scatter_cast_rows, scatter_rows


def rows_supported_reason(ops, info):
    if info.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(info.dtype).removeprefix('torch.')} not supported (bf16, fp16)"
    if info.input_recipe[0] is not None:
        return "quantized input"
    return None


def _kernels_take(rows: torch.Tensor, routing: Routing) -> bool:
    """Whether the row kernels take these rows (hidden size, slots per token)."""
    slots = routing.slots_per_token if isinstance(routing, ExpertParallelRouting) else routing.top_k
    return rows.shape[1] % VEC == 0 and 1 <= slots <= MAX_SLOTS and rows.dtype in (torch.bfloat16, torch.float16)


def _weights(probs):
    return None if probs is None else probs.detach().to(torch.float32).contiguous()


def permuted_rows(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(T, H) -> (M, H) expert-ordered rows (also what the backward recomputes)."""
    return scatter_rows(x.contiguous(), routing.slot_rows, routing.num_kept)


def gather_tokens(ctx, x) -> tuple | None:
    """The permute's forward without its rows, for a kernel that reads them by index: (x (T, H),
    (M,) int32 token of each expert row), the permute's recompute of its rows left in ``ctx``;
    None (nothing done) where the row kernels would not move these rows or they go to other
    ranks."""
    routing = ctx.side["routing"]
    if (isinstance(routing, ExpertParallelRouting) or not isinstance(x, torch.Tensor) or x.dim() != 2
            or x.shape[0] == 0 or not _kernels_take(x, routing)):
        return None
    check_tokens("Permute", x, routing.slot_rows.shape[0], "tokens, hidden")
    ctx.recompute_output = Recompute(permuted_rows, x, routing)
    return x, routing.row_tokens  # x: the backend's prepared input


def rows_by_index(saved) -> tuple | None:
    """(x (T, H), token of each expert row (M,) int32) where ``saved`` (an op's saved input) is the
    one-GPU permute's recompute of its rows on the row kernels, for a kernel that reads the rows
    by index instead; else None."""
    if not (isinstance(saved, Recompute) and saved.fn is permuted_rows):
        return None
    x, routing = saved.args
    return x, routing.row_tokens


def _send_rows(x: torch.Tensor, routing: ExpertParallelRouting, scale=None, y=None, dot_out=None) -> torch.Tensor:
    """Tokens (T, H) -> this rank's send rows (N, H) (times the slot's ``scale``; with ``y``
    and ``dot_out`` also the slots' dots with the rows ``y`` came back in)."""
    return scatter_rows(x, routing.send_slot_rows, routing.send_kept, scale=scale, y=y, dot_out=dot_out,
                        num_rows=routing.send_slots.shape[0])


def _token_sums(sent: torch.Tensor, routing: ExpertParallelRouting, weights=None) -> torch.Tensor:
    """Send rows (N, H) -> each token's sum of its slots' rows (weighted)."""
    return gather_sum(sent, routing.send_slot_rows, routing.send_kept, weights=weights)


@SM90.implement("permute", supports=rows_supported_reason)
def permute_on_kernels(ops, ctxs, x):
    op, ctx = ops[0], ctxs[0]
    routing = ctx.side["routing"]
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and _kernels_take(x, routing)):
        return op.op_forward(ctx, x)
    if isinstance(routing, ExpertParallelRouting):
        check_tokens("Permute", x, routing.tokens, "tokens, hidden")
        return permuted_rows(routing.exchange(_send_rows(x.contiguous(), routing)), routing)
    return op.forward_rows(ctx, x, permuted_rows)


@SM90.implement("permute_backward", supports=rows_supported_reason)
def _permute_backward(ops, ctxs, dy):
    op, ctx = ops[0], ctxs[0]
    routing = ctx.side["routing"]
    if not ctx.input_requires_grad or not _kernels_take(dy, routing):
        dx, grads = op.op_backward(ctx, dy)
        return dx, [grads]
    received = gather_sum(dy.contiguous(), routing.slot_rows, routing.num_kept)
    if isinstance(routing, ExpertParallelRouting):
        return _token_sums(routing.exchange_back(received), routing), [{}]
    return received, [{}]


@SM90.implement("unpermute", supports=rows_supported_reason)
def _unpermute(ops, ctxs, y):
    op, ctx = ops[0], ctxs[0]
    routing = ctx.side["routing"]
    op.check_input(ctx, y)
    if not _kernels_take(y, routing):
        return op.op_forward(ctx, y)
    probs = _weights(ctx.side.get("probs"))
    if isinstance(routing, ExpertParallelRouting):
        back = routing.exchange_back(gather_sum(y.contiguous(), routing.slot_rows, routing.num_kept))
        if "probs" in ctx.side and ctx.needs_grad("probs"):
            ctx.saved.returned_rows = back
        return _token_sums(back, routing, probs)
    op.keep_for_backward(ctx, y)
    return gather_sum(y.contiguous(), routing.slot_rows, routing.num_kept, weights=probs)


def combine_backward_copies(ctx, dy) -> bool:
    """Whether the combine's backward only copies each token's row of dy to its expert rows, so
    the GroupedLinear before it can take dy in token order (cast once per token,
    `combine_backward_cast`, or read by index, `dy_by_index`): one GPU, no probabilities applied
    in the combine, the combine's input needing its gradient, rows the kernels take. Otherwise
    its backward runs as usual."""
    routing = ctx.side["routing"]
    return not (isinstance(routing, ExpertParallelRouting) or ctx.side.get("probs") is not None
                or not ctx.input_requires_grad or dy.dim() != 2 or not _kernels_take(dy, routing))


def combine_backward_cast(ctx, dy, recipe, offsets, columns: bool):
    """The combine's backward with the next GroupedLinear's 1x128 cast of dy in it, where
    `combine_backward_copies`: each token's row of dy (T, H) cast once (all its expert rows are
    copies of it) and written with its scales to the token's kept expert rows
    (`scatter_cast_rows`), and with ``columns`` the per-group column-wise copy made from them
    (`block_columns_sm90` on E4M3 rows). ((data (M, H), multipliers (M, ceil(H/128))),
    `BlockColumns` or None), as `fp8_grad_casts` returns them."""
    routing = ctx.side["routing"]
    rows = scatter_cast_rows(dy.contiguous(), routing.slot_rows, routing.num_kept, recipe.power_2_scales)
    if not columns:
        return rows, None
    return rows, block_columns_sm90(rows[0], offsets, x_scale_inv=rows[1], power_2_scales=recipe.power_2_scales)


def dy_by_index(ctx, dy) -> tuple | None:
    """The combine's backward without its rows, for kernels that read dy's rows by index: (dy
    (T, H), (M,) int32 token of each expert row) where `combine_backward_copies`, else None."""
    if not combine_backward_copies(ctx, dy):
        return None
    return dy.contiguous(), ctx.side["routing"].row_tokens


@SM90.implement("unpermute_backward", supports=rows_supported_reason)
def unpermute_backward(ops, ctxs, dy):
    op, ctx = ops[0], ctxs[0]
    routing, probs = ctx.side["routing"], ctx.side.get("probs")
    if not _kernels_take(dy, routing):
        dx, grads = op.op_backward(ctx, dy)
        return dx, [grads]
    dy = dy.contiguous()
    expert_parallel = isinstance(routing, ExpertParallelRouting)
    grads, dots, returned = {}, None, None
    if probs is not None and ctx.needs_grad("probs"):
        dots = torch.empty((routing.tokens, routing.slots_per_token) if expert_parallel else routing.slot_rows.shape,
                           dtype=torch.float32, device=dy.device)
        returned = (ctx.saved.returned_rows if expert_parallel else ctx.load_input()).contiguous()
        grads["probs"] = dots
    if expert_parallel:
        dy_rows = _send_rows(dy, routing, _weights(probs), returned, dots)
        dy_rows = permuted_rows(routing.exchange(dy_rows), routing) if ctx.input_requires_grad else None
    else:
        dy_rows = scatter_rows(dy, routing.slot_rows, routing.num_kept, scale=_weights(probs), y=returned, dot_out=dots)
    if dots is not None:
        grads["probs"] = dots.to(probs.dtype)
    return (dy_rows if ctx.input_requires_grad else None), [grads]


def _moved_as_half(t: torch.Tensor, routing: ExpertParallelRouting) -> torch.Tensor:
    """Per-token rows of any dtype (T, n), whole 16-byte vectors, viewed as fp16, sent and grouped."""
    half = t.contiguous().view(torch.float16)
    return permuted_rows(routing.exchange(_send_rows(half, routing)), routing).view(t.dtype)


def _cast_rows(x: torch.Tensor, recipe, routing: Routing):
    """The expert rows of x cast in 1x128 blocks, each token cast once: on one GPU in the scatter
    (`scatter_cast_rows`); expert parallel, cast on the cast kernel, then the E4M3 rows and scales
    sent and grouped as fp16 words."""
    x = x.contiguous()
    if not isinstance(routing, ExpertParallelRouting):
        return scatter_cast_rows(x, routing.slot_rows, routing.num_kept, recipe.power_2_scales)
    data, scales = block_quantize_sm90(x, 1, recipe.power_2_scales)
    return _moved_as_half(data, routing), _moved_as_half(scales, routing)


def _cast_sent(rows: torch.Tensor, recipe, offsets):
    """The 16-bit rows that arrived (expert parallel, `high_precision_wgrad`) cast in 1x128 blocks
    on the cast kernel: (data, scales)."""
    return block_quantize_sm90(rows.contiguous(), 1, recipe.power_2_scales)


@SM90.implement("permute+quantize", supports=rows_supported_reason)
def _permute_cast(ops, ctxs, x):
    """The FP8 dispatch on the row kernels (`_cast_rows`; expert parallel with
    `high_precision_wgrad`, the 16-bit rows sent and cast on arrival, `_cast_sent`)."""
    op, ctx = ops[0], ctxs[0]
    routing = ctx.side["routing"]
    hidden = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 2 else 0
    # E4M3 rows and their scales travel as 16-byte vectors: H / 128 scales a multiple of 4
    sends_e4m3 = isinstance(routing, ExpertParallelRouting) and not high_precision_wgrad(ctx.output_format.recipe)
    whole_vectors = hidden % 512 == 0 if sends_e4m3 else hidden > 0
    if not whole_vectors or not _kernels_take(x, routing):
        return op.forward_cast_rows(ctx, x, ctx.output_format)
    return op.forward_cast_rows(ctx, x, ctx.output_format, _cast_rows, permuted_rows, _cast_sent)


