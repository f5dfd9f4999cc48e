"""The sm90 implementations of the MoE row-movement rules (`permute`, `unpermute` and their
backwards) on the row kernels (`kernels.moe_rows`): each token's row is read once and written to
its k expert rows, and the k expert rows of a token are summed in one pass, in float32, in slot
order (deterministic, no atomics). A shape the kernels do not take (hidden size not a multiple
of 8, more than 16 slots per token) runs the op's torch pass.
"""

import torch

from ...routing import Routing
from .backend import SM90
from .kernels.moe_rows import MAX_SLOTS, VEC, gather_sum, scatter_rows


def _supports(ops, info):
    if getattr(ops[0], "group", None) is not None:
        return "expert parallel (group=): the torch path moves the rows"
    if info.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {str(info.dtype).removeprefix('torch.')} not supported (bf16, fp16)"
    if info.input_recipe[0] is not None:
        return "quantized input"
    return None


def _kernels_take(rows: torch.Tensor, routing: Routing) -> bool:
    """Whether the row kernels take these rows (hidden size, slots per token)."""
    return rows.shape[1] % VEC == 0 and 1 <= routing.top_k <= MAX_SLOTS and rows.dtype in (torch.bfloat16,
                                                                                            torch.float16)


def _weights(probs):
    return None if probs is None else probs.detach().to(torch.float32).contiguous()


def permuted_rows(x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(T, H) -> (M, H) expert-ordered rows (also what the backward recomputes)."""
    return scatter_rows(x.contiguous(), routing.slot_rows, routing.num_kept)


@SM90.implement("permute", supports=_supports)
def _permute(ops, ctxs, x):
    op, ctx = ops[0], ctxs[0]
    if not (isinstance(x, torch.Tensor) and x.dim() == 2 and _kernels_take(x, ctx.side["routing"])):
        return op.op_forward(ctx, x)
    return op.forward_rows(ctx, x, permuted_rows)


@SM90.implement("permute_backward", supports=_supports)
def _permute_backward(ops, ctxs, dy):
    op, ctx = ops[0], ctxs[0]
    routing = ctx.side["routing"]
    if not ctx.input_requires_grad or not _kernels_take(dy, routing):
        dx, grads = op.op_backward(ctx, dy)
        return dx, [grads]
    return gather_sum(dy.contiguous(), routing.slot_rows, routing.num_kept), [{}]


@SM90.implement("unpermute", supports=_supports)
def _unpermute(ops, ctxs, y):
    op, ctx = ops[0], ctxs[0]
    routing = ctx.side["routing"]
    op.check_input(ctx, y)
    if not _kernels_take(y, routing):
        return op.op_forward(ctx, y)
    op.keep_for_backward(ctx, y)
    return gather_sum(y.contiguous(), routing.slot_rows, routing.num_kept, weights=_weights(ctx.side.get("probs")))


@SM90.implement("unpermute_backward", supports=_supports)
def _unpermute_backward(ops, ctxs, dy):
    op, ctx = ops[0], ctxs[0]
    routing, probs = ctx.side["routing"], ctx.side.get("probs")
    if not _kernels_take(dy, routing):
        dx, grads = op.op_backward(ctx, dy)
        return dx, [grads]
    dy = dy.contiguous()
    if probs is None or not ctx.needs_grad("probs"):
        dy_rows = scatter_rows(dy, routing.slot_rows, routing.num_kept, scale=_weights(probs))
        return (dy_rows if ctx.input_requires_grad else None), [{}]
    dots = torch.empty(routing.slot_rows.shape, dtype=torch.float32, device=dy.device)
    dy_rows = scatter_rows(dy, routing.slot_rows, routing.num_kept, scale=_weights(probs),
                           y=ctx.load_input().contiguous(), dot_out=dots)
    return (dy_rows if ctx.input_requires_grad else None), [{"probs": dots.to(probs.dtype)}]
