"""The MoE layer's routing ops: `TopKRouter`, `Permute` (dispatch) and `Unpermute` (combine).

A layer reads ``Sequential(TopKRouter(...), Permute(E), GroupedLinear(E, H, 2I), ScaledSwiGLU(),
GroupedLinear(E, I, H), Unpermute())(x)``, or, with routing computed elsewhere, the same without
the router called as ``layer(x, indices=idx, probs=p)``. The ops pass side values down the
sequence: the router produces ``indices`` (T, k) and ``probs`` (T, k); the permute produces the
``routing`` (`te_fused_ops.routing.Routing`) and the per-expert row counts as ``split_sizes``
(a device tensor: no host sync), which the grouped ops after it use.
"""

import math

import torch
from torch import nn

from .. import routing as rows
from ..errors import (
    OpInputError, OpTypeError, OpValueError, bool_argument, floating_dtype_argument, int_argument, real_argument,
)
from ..quantization import QuantizedTensor, high_precision_wgrad, quantize
from ..splits import remember_offsets, validation_enabled
from .base import BasicOp, OpContext, Recompute, is_quantized

_INDEX_DTYPES = (torch.int32, torch.int64)


def check_tokens(op_name: str, x, num_rows, what: str) -> None:
    """x a plain floating (num_rows, features) tensor (num_rows None: any)."""
    if not isinstance(x, torch.Tensor):
        raise OpTypeError(f"{op_name}: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
    if is_quantized(x):
        raise OpTypeError(f"{op_name}: argument 'x' is a QuantizedTensor; pass a bf16/fp16/fp32 tensor")
    if not x.is_floating_point():
        raise OpTypeError(f"{op_name}: argument 'x' must be a floating-point tensor, got {x.dtype}")
    if x.dim() != 2 or num_rows not in (None, x.shape[0]):
        raise OpValueError(f"{op_name}: argument 'x' must have shape ({'rows' if num_rows is None else num_rows}, features) ({what}), "
                           f"got {tuple(x.shape)}")


def _rows_like(x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A tensor shaped (num_rows, x's features) on x's device holding one element."""
    return torch.empty((1, 1), dtype=x.dtype, device=x.device).expand(num_rows, x.shape[-1])


def check_slot_probs(op_name: str, probs, slots: tuple, device: torch.device) -> None:
    """``probs`` floating on ``device``, one per slot: shape ``slots`` (T, k)."""
    if not isinstance(probs, torch.Tensor):
        raise OpTypeError(f"{op_name}: argument 'probs' must be a torch.Tensor, got {type(probs).__name__}")
    if not probs.is_floating_point():
        raise OpTypeError(f"{op_name}: argument 'probs' must be floating point, got {probs.dtype}")
    if tuple(probs.shape) != tuple(slots):
        raise OpValueError(f"{op_name}: argument 'probs' must have the shape of 'indices' "
                           f"{tuple(slots)} (tokens, k), got {tuple(probs.shape)}")
    if probs.device != device:
        raise OpValueError(f"{op_name}: argument 'probs' is on {probs.device} but the input is on {device}")


class Permute(BasicOp):
    """Dispatch: tokens (T, H) -> their routed rows grouped by expert (T * k, H).

    Side input ``indices`` (T, k) int32/int64: the expert of each slot; ``-1`` marks a dropped
    slot. On the CPU (and with TE_FUSED_OPS_VALIDATE=1) any other id outside [0, E) raises; on
    CUDA it is read as a dropped slot (checking would sync). Rows are ordered by expert, then by
    token; the dropped slots' rows come last as padding (zeros; the grouped ops give them zero
    output and gradient). Produces ``routing`` and ``split_sizes`` (E,) int32 for the ops after it.
    The output is not kept for the backward: whoever needs it there (the next GroupedLinear's
    weight gradient) gets it again from x, which is k times smaller.

    Expert parallelism: with ``group`` (a `torch.distributed` process group of W ranks) the E
    experts are split evenly over the ranks (rank r owns experts r * E / W ..), ``indices`` hold
    global ids, and each rank sends every destination rank at most
    C = min(ceil(capacity_factor * T * k / W), T * k) rows (static shapes: no host sync; slots past
    a destination's capacity are dropped, in the order expert, token, slot; ``permute.dropped``
    holds this rank's count of the last call, a device tensor). ``capacity_factor=None`` drops
    nothing: every slot is sent, the exchanged counts read on the host once per call to size the
    exchanges exactly (shapes change with the routing); without ``group`` nothing is dropped for
    capacity and ``capacity_factor`` is only checked. The output is the rows this rank received
    (W * C with a static capacity), grouped by its E / W local experts (``split_sizes`` (E / W,));
    the grouped ops after it hold the local experts. Pair it with ``Unpermute(group=...)``, which
    takes the probabilities. The rows move on the torch path (an all-to-all each way). Where values
    are checked (CPU, TE_FUSED_OPS_VALIDATE=1), ids out of range, capacities or widths of x that
    differ, or an input failing its checks on any rank (here or in the ``Unpermute``'s
    probabilities) raise on every rank.

    ``chunks=n`` (with ``group``) overlaps the exchanges with the experts: the ops up to the
    ``Unpermute`` run as n chunks of the local experts (chunk c: experts [c L/n, (c+1) L/n) of
    every rank, L = E / W), each chunk's dispatch and combine (and their backwards) on a side
    stream while another chunk's experts run (`te_fused_ops.overlap`); the capacity then applies
    per chunk (ceil(capacity_factor * T * k / (W * n)) rows per rank pair and chunk). While the
    chunks overlap, the GEMMs leave ``overlap_sms`` SMs free for the exchanges' kernels.
    """

    shared_on_copy = ("group",)  # a copy (an EMA model) routes over the same process group

    side_inputs = ("indices",)
    side_outputs = ("routing", "split_sizes")
    side_outputs_end = {"split_sizes": "routing"}  # the counts of expert-order rows: until the Unpermute

    def __init__(self, num_experts: int, group=None, capacity_factor: float | None = 1.0, chunks: int = 1,
                 overlap_sms: int = 16):
        super().__init__()
        num_experts = int_argument("Permute", "num_experts", num_experts)
        chunks = int_argument("Permute", "chunks", chunks)
        overlap_sms = int_argument("Permute", "overlap_sms", overlap_sms, low=0)
        self.num_experts, self.group, self.capacity_factor = num_experts, group, capacity_factor
        self.chunks, self.overlap_sms = chunks, overlap_sms
        self.dropped = None  # with group: () int64, this rank's slots dropped by the last call
        if group is None and chunks > 1:
            raise OpValueError("Permute: argument 'chunks' > 1 overlaps the exchanges of expert parallelism and "
                               "needs 'group'")
        if capacity_factor is not None and not 0 < real_argument("Permute", "capacity_factor",
                                                                 capacity_factor) < math.inf:
            raise OpValueError(f"Permute: argument 'capacity_factor' must be > 0 and finite, or None, got "
                               f"{capacity_factor!r}")
        if group is not None:
            import torch.distributed as dist

            if dist.get_rank(group) < 0:
                raise OpValueError(f"Permute: this rank ({dist.get_rank()}) is not a member of argument 'group'")
            world = dist.get_world_size(group)
            if num_experts % world:
                raise OpValueError(f"Permute: argument 'num_experts' ({num_experts}) must split evenly over the "
                                   f"{world} ranks of 'group'")
            if num_experts // world % chunks:
                raise OpValueError(f"Permute: argument 'chunks' ({chunks}) must divide the {num_experts // world} "
                                   "experts of each rank")

    def extra_repr(self) -> str:
        ep = "" if self.group is None else f", group of {self.world_size()}, capacity_factor={self.capacity_factor}"
        chunks = f", chunks={self.chunks}" if self.chunks > 1 else ""
        return f"num_experts={self.num_experts}{ep}{chunks}"

    def chunk_experts(self, chunk: int) -> tuple:
        """(first, stop): the local experts of chunk ``chunk`` (of ``chunks``)."""
        per_chunk = self.num_experts // self.world_size() // self.chunks
        return chunk * per_chunk, (chunk + 1) * per_chunk

    def capacity(self, indices: torch.Tensor):
        """C, the rows every rank sends every rank (per chunk) in this call, or None (dropless);
        at most the T k slots a rank has (more would drop nothing more)."""
        if self.capacity_factor is None:
            return None
        wanted = self.capacity_factor * indices.numel() / (self.world_size() * self.chunks)
        return max(1, min(math.ceil(wanted), indices.numel()))

    def agree_on_inputs(self, x: torch.Tensor, indices, local_error) -> None:
        """Where values are checked (CPU, ``TE_FUSED_OPS_VALIDATE=1``), before any exchange: one
        all-reduce over the group, so that an input failing its checks on any rank (``local_error``
        on this one), bad ids, capacities or widths that differ raise on every rank instead of
        leaving the others waiting in the exchange."""
        import torch.distributed as dist

        failed = local_error is not None
        capacity = 0 if failed else self.capacity(indices) or 0
        width = x.shape[1] if x.dim() == 2 else 0
        bounds = torch.tensor([int(failed), 0, capacity, -capacity, width, -width], device=x.device)
        if not failed:
            bounds[1] = ((indices < -1) | (indices >= self.num_experts)).sum()
        dist.all_reduce(bounds, op=dist.ReduceOp.MAX, group=self.group)
        if failed:
            raise local_error
        if int(bounds[0]):
            raise OpValueError("Permute: an input failed its checks on another rank of 'group' (that rank names it)")
        if int(bounds[1]):
            self.check_index_values(indices)  # names the id on the rank that holds it
            raise OpValueError(f"Permute: argument 'indices' holds ids outside [0, {self.num_experts}) on another "
                               "rank of 'group'")
        if int(bounds[2]) != -int(bounds[3]):
            raise OpValueError(f"Permute: the ranks of 'group' send {-int(bounds[3])} to {int(bounds[2])} rows per "
                               "rank pair (capacity_factor * tokens * k / ranks); every rank needs the same")
        if int(bounds[4]) != -int(bounds[5]):
            raise OpValueError(f"Permute: argument 'x' is {-int(bounds[5])} to {int(bounds[4])} wide on the ranks of "
                               "'group'; every rank needs the same width")

    def world_size(self) -> int:
        import torch.distributed as dist

        return 1 if self.group is None else dist.get_world_size(self.group)

    def plan_signature(self) -> tuple:
        return (Permute, self.num_experts, None if self.group is None else id(self.group), self.capacity_factor,
                self.chunks)

    def side_value_experts(self, name: str):
        return {"indices": self.num_experts, "split_sizes": self.num_experts // self.world_size()}.get(name)

    def compile_unsupported_reason(self):
        """Dropless exchanges size their buffers from counts read on the host."""
        if self.group is not None and self.capacity_factor is None:
            return "capacity_factor=None with group (the exchange's sizes are read on the host; pass a capacity_factor)"
        return None

    def check_index_values(self, indices: torch.Tensor) -> None:
        bad = indices[(indices < -1) | (indices >= self.num_experts)]
        if bad.numel():
            raise OpValueError(f"Permute: argument 'indices' holds {bad[0].item()}, outside [0, {self.num_experts}) "
                               "and not -1 (a dropped slot)")

    def check_indices(self, indices, x: torch.Tensor, values: bool = True) -> None:
        if not isinstance(indices, torch.Tensor):
            raise OpTypeError(f"Permute: argument 'indices' must be a torch.Tensor, got {type(indices).__name__}")
        if indices.dtype not in _INDEX_DTYPES:
            raise OpTypeError(f"Permute: argument 'indices' must have dtype int32 or int64, got {indices.dtype}")
        if indices.dim() != 2 or indices.shape[0] != x.shape[0] or indices.shape[1] == 0:
            raise OpValueError(f"Permute: argument 'indices' must have shape ({x.shape[0]}, k) (tokens, k >= 1), "
                               f"got {tuple(indices.shape)}")
        if indices.device != x.device:
            raise OpValueError(f"Permute: argument 'indices' is on {indices.device} but argument 'x' is on {x.device}")
        if values and validation_enabled(indices.device) and indices.device.type != "meta":
            self.check_index_values(indices)

    def bind_side_inputs(self, side: dict, x: torch.Tensor, memo: dict) -> dict:
        indices = side["indices"]
        agree = self.group is not None and validation_enabled(x.device) and x.device.type != "meta"
        try:
            if x.dim() != 2:
                raise OpValueError(f"Permute: argument 'x' must be 2-D (tokens, hidden), got shape {tuple(x.shape)}")
            self.check_indices(indices, x, values=self.group is None)  # with a group: checked by agree_on_inputs
        except OpInputError as error:
            if not agree:
                raise
            self.agree_on_inputs(x, indices, error)
        key = ("routing", id(indices), self.num_experts, id(self.group))
        if key not in memo:
            chunk = memo.get("chunk")
            if agree and chunk in (None, 0):
                self.agree_on_inputs(x, indices, None)
            if self.group is None:
                memo[key] = rows.route(indices, self.num_experts)
            elif chunk is None:
                memo[key] = rows.route_expert_parallel(indices, self.num_experts, self.group, self.capacity(indices))
                self.dropped = memo[key].dropped
            else:  # one chunk of a chunked segment: the routings of all chunks are made together
                shared = memo["chunks shared"]
                if "routings" not in shared:
                    shared["routings"] = rows.route_expert_parallel(indices, self.num_experts, self.group,
                                                                    self.capacity(indices), self.chunks)
                    self.dropped = shared["routings"][0].dropped
                memo[key] = shared["routings"][chunk]
                memo["chunk experts"] = self.chunk_experts(chunk)
        routing = memo[key]
        remember_offsets(memo, routing.counts, routing.row_slots.shape[0], routing.offsets)
        return {"routing": routing}

    def bound_side_outputs(self, ctx: OpContext) -> dict:
        routing = ctx.side["routing"]
        return {"routing": routing, "split_sizes": routing.counts}

    def output_like(self, ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
        return _rows_like(x, ctx.side["routing"].row_slots.shape[0])

    def forward_rows(self, ctx: OpContext, x, scatter) -> torch.Tensor:
        """The forward with ``scatter(x, routing)`` moving the rows (a backend's, or the torch one)."""
        routing = ctx.side["routing"]
        if isinstance(routing, rows.ExpertParallelRouting):  # send rows out, group what arrives
            check_tokens("Permute", x, routing.tokens, "tokens, hidden")
            return scatter(routing.exchange(routing.send_rows(x)), routing)
        check_tokens("Permute", x, routing.slot_rows.shape[0], "tokens, hidden")
        ctx.recompute_output = Recompute(scatter, x, routing)
        return scatter(x, routing)

    def op_forward(self, ctx: OpContext, x) -> torch.Tensor:
        return self.forward_rows(ctx, x, rows.scatter_rows)

    def forward_cast_rows(self, ctx: OpContext, x, fmt, cast_rows=None, scatter=rows.scatter_rows,
                          cast_sent=None) -> QuantizedTensor:
        """The permute with a 1x128 row-block cast (``fmt``, the folded Quantize) after it: each
        token is cast once (T rows, not T * k) and its E4M3 row and scales move instead of the
        16-bit row (about half the bytes): to the expert-ordered rows, or with a group to the
        ranks (sent, then grouped as `forward_rows` groups rows). The same values as casting the
        moved rows (the blocks are row-local). ``cast_rows(x, recipe, routing)``: (data (M, H)
        E4M3, scales (M, ceil(H/128)) float32) of the expert-ordered rows (a backend's kernels;
        default: `quantize`, then the torch movers). With the recipe's `high_precision_wgrad` the
        16-bit rows are the output's ``source``: on one GPU the permute's recompute (``scatter``,
        as `forward_rows` takes it; never written in the forward), with a group the 16-bit rows
        sent, then cast by ``cast_sent(rows, recipe, offsets)`` ((data, scales) of the rows that
        arrived; a backend's cast kernel, default `quantize`)."""
        routing = ctx.side["routing"]
        expert_parallel = isinstance(routing, rows.ExpertParallelRouting)
        hp_wgrad = high_precision_wgrad(fmt.recipe)
        if hp_wgrad and expert_parallel:
            sent = self.forward_rows(ctx, x, scatter)
            data, scale_inv = (cast_sent or _quantize_rows)(sent, fmt.recipe, fmt.offsets)
            return QuantizedTensor(sent.shape, x.dtype, x.device, recipe=fmt.recipe, role="activation",
                                   rowwise_data=data, rowwise_scale_inv=scale_inv, offsets=fmt.offsets, source=sent)
        check_tokens("Permute", x, routing.tokens if expert_parallel else routing.slot_rows.shape[0], "tokens, hidden")
        data, scale_inv = (cast_rows or _cast_then_move)(x, fmt.recipe, routing)
        source = None
        if hp_wgrad:
            source = ctx.recompute_output = Recompute(scatter, x, routing)
        return QuantizedTensor((data.shape[0], x.shape[1]), x.dtype, x.device, recipe=fmt.recipe, role="activation",
                               rowwise_data=data, rowwise_scale_inv=scale_inv, offsets=fmt.offsets, source=source)

    def op_backward(self, ctx: OpContext, dy):
        if not ctx.input_requires_grad:
            return None, {}
        routing = ctx.side["routing"]
        if isinstance(routing, rows.ExpertParallelRouting):
            return routing.sum_send_rows(routing.exchange_back(rows.gather_sum(dy, routing))), {}
        return rows.gather_sum(dy, routing), {}


def _agree_on_check(group, device, check) -> None:
    """Run ``check`` (raises an `OpInputError` for bad input), then one all-reduce over ``group``:
    its error on this rank, and an error naming the other rank's failure on every other one, so no
    rank waits in the next exchange."""
    import torch.distributed as dist

    try:
        check()
        error = None
    except OpInputError as raised:
        error = raised
    failed = torch.tensor([int(error is not None)], device=device)
    dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=group)
    if error is not None:
        raise error
    if int(failed[0]):
        raise OpValueError("Unpermute: an input failed its checks on another rank of 'group' (that rank names it)")


def _quantize_rows(x, recipe, offsets):
    """`Permute.forward_cast_rows`' torch cast of the rows that arrived: (data, scales)."""
    made = quantize(x, recipe, rowwise=True, offsets=offsets)
    return made.rowwise_data, made.rowwise_scale_inv


def _cast_then_move(x, recipe, routing):
    """`Permute.forward_cast_rows`'s torch path: each token cast (`quantize`), then its E4M3 row
    (as bytes) and scales moved to the expert rows (with a group: sent, then grouped)."""
    made = quantize(x, recipe, rowwise=True)

    def move(t):
        if isinstance(routing, rows.ExpertParallelRouting):
            t = routing.exchange(torch.cat([t, t.new_zeros(1, t.shape[1])]).index_select(0, routing.send_tokens()))
        return rows.scatter_rows(t, routing)

    return move(made.rowwise_data.view(torch.uint8)).view(made.rowwise_data.dtype), move(made.rowwise_scale_inv)


class Unpermute(BasicOp):
    """Combine: expert-ordered rows (T * k, H) -> tokens (T, H), each token's kept slots summed.

    The slots are weighted by the side input ``probs`` (T, k) unless an op since the `Permute`
    already applied them (`ScaledSwiGLU` fed the same ``probs``): then the combine is a plain sum
    and its backward a plain gather. Needs the ``routing`` of a `Permute` before it.

    With ``group`` (the group of an expert-parallel ``Permute(..., group=...)``) the rows go back
    to the ranks they came from (an all-to-all) and are summed there into their tokens, weighted
    by ``probs`` (T, k) of the rank's own tokens.
    """

    shared_on_copy = ("group",)  # a copy (an EMA model) routes over the same process group

    side_inputs = ("routing", "probs")
    optional_side_inputs = ("probs",)
    closes_chunks = True

    def __init__(self, group=None):
        super().__init__()
        self.group = group

    def plan_signature(self) -> tuple:
        return (Unpermute, None if self.group is None else id(self.group))

    def extra_repr(self) -> str:
        import torch.distributed as dist

        return "" if self.group is None else f"group of {dist.get_world_size(self.group)}"

    def bind_side_inputs(self, side: dict, x: torch.Tensor, memo: dict) -> dict:
        routing = side.get("routing")
        if routing is None:
            raise OpValueError("Unpermute: no 'routing'; a Permute must come before it in the sequence")
        expert_parallel = isinstance(routing, rows.ExpertParallelRouting)
        if expert_parallel != (self.group is not None):
            raise OpValueError("Unpermute: argument 'group' must be the group of the Permute before it "
                               f"(got {'None' if self.group is None else 'a group'}, the Permute has "
                               f"{'one' if expert_parallel else 'none'})")
        if expert_parallel and routing.group is not self.group:
            raise OpValueError("Unpermute: argument 'group' is another group object than the Permute's before it; "
                               "pass the same one")
        bound = {"routing": routing}
        probs = side.get("probs")
        if probs is not None and not memo.get("probs_applied"):
            slots = (routing.tokens, routing.slots_per_token) if expert_parallel else routing.slot_rows.shape
            if expert_parallel and validation_enabled(x.device) and x.device.type != "meta":
                _agree_on_check(self.group, x.device, lambda: check_slot_probs("Unpermute", probs, slots, x.device))
            else:
                check_slot_probs("Unpermute", probs, slots, x.device)
            bound["probs"] = probs
        return bound

    def output_like(self, ctx: OpContext, x: torch.Tensor) -> torch.Tensor:
        routing = ctx.side["routing"]
        return _rows_like(x, routing.tokens if isinstance(routing, rows.ExpertParallelRouting) else
                          routing.slot_rows.shape[0])

    def check_input(self, ctx: OpContext, y) -> None:
        check_tokens("Unpermute", y, ctx.side["routing"].row_slots.shape[0], "tokens * k rows in expert order")

    def keep_for_backward(self, ctx: OpContext, y: torch.Tensor) -> None:
        """The expert rows are kept only for the probabilities' gradient."""
        if "probs" in ctx.side and ctx.needs_grad("probs"):
            ctx.save_input(y)

    def op_forward(self, ctx: OpContext, y) -> torch.Tensor:
        self.check_input(ctx, y)
        routing = ctx.side["routing"]
        if isinstance(routing, rows.ExpertParallelRouting):
            back = routing.exchange_back(rows.gather_sum(y, routing))  # in this rank's send rows
            if "probs" in ctx.side and ctx.needs_grad("probs"):
                ctx.saved.returned_rows = back
            return _sum_into_tokens(back, routing, ctx.side.get("probs"))
        self.keep_for_backward(ctx, y)
        return rows.gather_sum(y, routing, ctx.side.get("probs"))

    def op_backward(self, ctx: OpContext, dy):
        routing, probs = ctx.side["routing"], ctx.side.get("probs")
        if isinstance(routing, rows.ExpertParallelRouting):
            return _expert_parallel_combine_backward(ctx, dy, routing, probs)
        dy_rows = rows.scatter_rows(dy, routing, probs) if ctx.input_requires_grad else None
        grads = {}
        if probs is not None and ctx.needs_grad("probs"):
            grads["probs"] = rows.slot_dots(dy, ctx.load_input(), routing).to(probs.dtype)
        return dy_rows, grads


def _send_row_weights(routing: "rows.ExpertParallelRouting", probs, like: torch.Tensor) -> torch.Tensor:
    """(N, 1): the probability of the slot each send row carried (0 for an unused row)."""
    flat = torch.cat([probs.reshape(-1), probs.new_zeros(1)])
    return flat.index_select(0, routing.send_slots).to(like.dtype).unsqueeze(1)


def _sum_into_tokens(back: torch.Tensor, routing: "rows.ExpertParallelRouting", probs) -> torch.Tensor:
    """Send-row results (N, H) -> tokens (T, H), each weighted by its slot's probability."""
    if probs is not None:
        back = back * _send_row_weights(routing, probs, back)
    return routing.sum_send_rows(back)


def _expert_parallel_combine_backward(ctx: OpContext, dy, routing: "rows.ExpertParallelRouting", probs):
    """The expert-parallel `Unpermute`'s backward: each send row's token gradient (weighted), back
    to the ranks that computed it, grouped as their rows; the probabilities' gradient from the
    rows that came back."""
    dy_rows = routing.send_rows(dy)
    grads = {}
    if probs is not None and ctx.needs_grad("probs"):
        dots = (dy_rows.to(torch.promote_types(dy.dtype, torch.float32)) * ctx.saved.returned_rows).sum(1)
        slots = dots.new_zeros(routing.tokens * routing.slots_per_token + 1).index_add_(0, routing.send_slots, dots)
        grads["probs"] = slots[:-1].view(routing.tokens, routing.slots_per_token).to(probs.dtype)
    if not ctx.input_requires_grad:
        return None, grads
    if probs is not None:
        dy_rows = dy_rows * _send_row_weights(routing, probs, dy_rows)
    return rows.scatter_rows(routing.exchange(dy_rows), routing), grads


_SCORES = ("softmax", "sigmoid")


def top_k_lowest_first(values: torch.Tensor, k: int) -> torch.Tensor:
    """(..., k) int64 indices of the k largest of ``values`` along the last dim, equal values taken
    lowest index first (`torch.topk` leaves which of them unspecified, and its CPU and CUDA
    kernels differ: a bf16 router ties at the k-th place on a few percent of tokens). Up to 32-bit
    values: one `topk` over int64 keys, the value's bits made order-preserving above the reversed
    index; float64: a stable sort."""
    if values.dtype == torch.float64:
        return values.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    bits = (values.float() + 0.0).view(torch.int32).long()  # + 0.0: -0.0 ranks as 0.0
    ordered = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # negative floats: larger magnitude lower
    reversed_index = torch.arange(values.shape[-1] - 1, -1, -1, device=values.device)
    return ((ordered << 32) | reversed_index).topk(k, -1).indices


class TopKRouter(BasicOp):
    """Router: x (T, H) passes through; produces ``indices`` (T, k) int64 and ``probs`` (T, k) float32
    (float64 for a float64 x).

    logits = x @ weight.T (E, H), scored with ``score`` ("softmax" over the experts, or "sigmoid");
    the top ``k`` experts by score (plus ``expert_bias`` when given: DeepSeek-V3's load-balancing
    bias, used for the choice only, a float32 buffer whatever the module's dtype or autocast, which
    the caller updates) within the ``group_topk`` best of ``num_groups`` expert groups
    (DeepSeek-V3's group-limited routing; a group scores as the sum of its top two, or its top one
    with softmax); probs = the chosen scores, divided by their sum when ``normalize`` (Qwen3,
    DeepSeek-V3), times ``scale``. ``aux_loss_coeff`` > 0: the load-balancing loss
    ``coeff * E * sum_e f_e * P_e`` (f_e: share of slots routed to expert e, P_e: mean score of e,
    scores normalized per token for sigmoid; Megatron's switch loss) is added to the training
    objective: its gradient joins the router's in the backward, and ``router.aux_loss`` holds its
    value (detached; None while the coefficient is 0) after each forward for logging. Hugging Face's
    ``load_balancing_loss_func`` is one loss over every layer's logits pooled, its f_e taken over
    tokens: with one MoE layer it is k times this loss (port its coefficient as k * coef); over L
    layers this library adds one loss per router, so k * coef / L per router gives the same total
    where every layer routes alike. Its gradient is added as is, whatever the caller scales the main
    loss by (divide the coefficient likewise when averaging over micro-batches or ranks; under
    fp16's ``torch.amp.GradScaler`` multiply it by the scale, or ``unscale_`` divides it away). The
    backward reads ``aux_loss_coeff``, ``scale`` and ``normalize`` as they are when it runs (so a
    CUDA graph or a compiled backward need not carry them): change them between steps, not between
    a forward and its backward. The choice is never differentiated; probs are.
    ``float32_logits``: a 16-bit x and weight multiplied in float32 (their products are exact
    there; Megatron's fp32 router dtype, Hugging Face DeepSeek-V3's router), its gradients computed
    in float32 and rounded once; under autocast a float32 weight is first rounded to the autocast
    dtype, as any op's (and nn.Linear's).
    ``router.tokens_per_expert``: (E,) float32 (float64 for a float64 x), detached, the slots routed
    to each expert by the last forward (they sum to T k): what DeepSeek-V3's update of
    ``expert_bias`` and load logging read. Equal scores (and equal group scores) are taken lowest
    expert index first, on every device.
    """

    side_outputs = ("indices", "probs")
    grad_side_outputs = ("probs",)
    param_names = ("weight", "expert_bias")
    float32_params = ("expert_bias",)

    def __init__(self, hidden: int, num_experts: int, k: int, score: str = "softmax", normalize: bool = False,
                 scale: float = 1.0, num_groups: int = 1, group_topk: int = 1, expert_bias: bool = False,
                 aux_loss_coeff: float = 0.0, float32_logits: bool = False, dtype=None, device=None):
        super().__init__()
        hidden, num_experts, k, num_groups, group_topk = (int_argument("TopKRouter", arg, value) for arg, value in (
            ("hidden", hidden), ("num_experts", num_experts), ("k", k), ("num_groups", num_groups),
            ("group_topk", group_topk)))
        if score not in _SCORES:
            raise OpValueError(f"TopKRouter: argument 'score' must be one of {_SCORES}, got {score!r}")
        if num_experts % num_groups or group_topk > num_groups:
            raise OpValueError(f"TopKRouter: argument 'num_groups' ({num_groups}) must divide num_experts "
                               f"({num_experts}) and be >= group_topk ({group_topk})")
        if k > num_experts // num_groups * group_topk:
            raise OpValueError(f"TopKRouter: argument 'k' ({k}) exceeds the experts of the chosen groups "
                               f"({num_experts // num_groups * group_topk})")
        if not 0 <= real_argument("TopKRouter", "aux_loss_coeff", aux_loss_coeff) < math.inf:
            raise OpValueError(f"TopKRouter: argument 'aux_loss_coeff' must be >= 0 and finite, got {aux_loss_coeff!r}")
        if not 0 < real_argument("TopKRouter", "scale", scale) < math.inf:
            raise OpValueError(f"TopKRouter: argument 'scale' must be positive and finite (the backward divides by "
                               f"it), got {scale!r}")
        self.hidden, self.num_experts, self.k = hidden, num_experts, k
        self.param_shapes = {"weight": (num_experts, hidden), "expert_bias": (num_experts,)}
        self.score, self.scale = score, float(scale)
        self.normalize = bool_argument("TopKRouter", "normalize", normalize)
        self.num_groups, self.group_topk = num_groups, group_topk
        self.aux_loss_coeff = float(aux_loss_coeff)
        self.float32_logits = bool_argument("TopKRouter", "float32_logits", float32_logits)
        expert_bias = bool_argument("TopKRouter", "expert_bias", expert_bias)
        dtype = floating_dtype_argument("TopKRouter", dtype)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, dtype=dtype, device=device))
        # a buffer, as Megatron and Hugging Face keep it: updated by the caller, never by gradients
        # or an optimizer (whose weight decay would shrink it)
        self.register_buffer("expert_bias", torch.zeros(num_experts, dtype=torch.float32, device=device)
                             if expert_bias else None)
        self.aux_loss = self.tokens_per_expert = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The weight ~ N(0, 1/hidden), the expert bias zeros (as constructed; after
        ``to_empty`` on a module built on the meta device)."""
        with torch.no_grad():
            nn.init.normal_(self.weight, std=self.hidden**-0.5)
            if self.expert_bias is not None:
                self.expert_bias.zero_()

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_experts={self.num_experts}, k={self.k}, score={self.score!r}, "
                f"normalize={self.normalize}, scale={self.scale}"
                + (f", num_groups={self.num_groups}, group_topk={self.group_topk}" if self.num_groups > 1 else "")
                + (", expert_bias=True" if self.expert_bias is not None else "")
                + (f", aux_loss_coeff={self.aux_loss_coeff}" if self.aux_loss_coeff else "")
                + (", float32_logits=True" if self.float32_logits else ""))

    def logits_operands(self, x: torch.Tensor, weight: torch.Tensor) -> tuple:
        """(x, weight) as the logits' product takes them: widened to float32 with
        ``float32_logits`` (16-bit products are exact in float32), else as they are."""
        if self.float32_logits and x.dtype in (torch.bfloat16, torch.float16):
            return x.float(), weight.float()
        return x, weight

    def plan_signature(self) -> tuple:
        # no rule reads the router's numbers (scale, aux_loss_coeff): a schedule that changes them
        # every step reuses one plan
        return (TopKRouter, self.num_experts, self.k, self.score, self.normalize, self.num_groups, self.group_topk)

    def side_value_experts(self, name: str):
        return self.num_experts if name == "indices" else None

    def scores(self, logits: torch.Tensor, dtype) -> torch.Tensor:
        """(T, E) scores in ``dtype`` (float32, or float64 for a float64 x) of 16-bit or wider logits."""
        if self.score == "softmax":
            return torch.softmax(logits, -1, dtype=dtype)
        return torch.sigmoid(logits.to(dtype))

    def choose(self, scores: torch.Tensor, bias) -> tuple:
        """((T, k) int64 expert ids of the top-k (no gradient), their (T, k) scores)."""
        ranking = scores if bias is None else scores + bias
        if self.num_groups > 1:
            grouped = ranking.view(ranking.shape[0], self.num_groups, self.num_experts // self.num_groups)
            top = min(2, grouped.shape[-1]) if self.score == "sigmoid" else 1
            group_scores = grouped.topk(top, -1).values.sum(-1)
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, top_k_lowest_first(group_scores, self.group_topk), True)
            ranking = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(ranking)
        indices = top_k_lowest_first(ranking, self.k)
        return indices, scores.gather(1, indices)

    def slot_probs(self, chosen: torch.Tensor) -> tuple:
        """(probs (T, k), the sum the chosen scores were divided by (T, 1), or None without
        ``normalize``)."""
        total = None
        if self.normalize:
            total = chosen.sum(-1, keepdim=True)
            if self.score == "sigmoid":  # a softmax's top k sum to at least k / E
                total = total + 1e-20
            chosen = chosen / total
        return (chosen * self.scale if self.scale != 1.0 else chosen), total

    def slots_per_expert(self, indices: torch.Tensor, dtype) -> torch.Tensor:
        """(E,) ``dtype``: how many of the (T, k) slots chose each expert (no host sync)."""
        routed = torch.zeros(self.num_experts, dtype=dtype, device=indices.device)
        return routed.scatter_add_(0, indices.reshape(-1), torch.ones(indices.numel(), dtype=dtype,
                                                                      device=indices.device))

    def balance_loss(self, scores: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        """0-d float32: ``coeff * E * sum_e f_e * P_e``; ``routed`` from `slots_per_expert`."""
        tokens = max(scores.shape[0], 1)
        share = routed / (tokens * self.k)
        per_token = scores if self.score == "softmax" else scores / (scores.sum(-1, keepdim=True) + 1e-20)
        return self.aux_loss_coeff * self.num_experts * (share * per_token.sum(0) / tokens).sum()

    def op_forward(self, ctx: OpContext, x) -> torch.Tensor:
        weight = ctx.params["weight"]
        check_tokens("TopKRouter", x, None, "tokens, hidden")
        if x.shape[1] != self.hidden:
            raise OpValueError(f"TopKRouter: argument 'x' must have shape (tokens, {self.hidden}), got {tuple(x.shape)}")
        if x.dtype != weight.dtype:
            raise OpTypeError(f"TopKRouter: argument 'x' has dtype {x.dtype} but the weight has {weight.dtype}")
        x_logits, w_logits = self.logits_operands(x, weight)
        scores = self.scores(x_logits @ w_logits.t(), torch.promote_types(x.dtype, torch.float32))
        indices, chosen = self.choose(scores, ctx.params.get("expert_bias"))
        probs, total = self.slot_probs(chosen)
        routed = self.slots_per_expert(indices, scores.dtype)
        self.tokens_per_expert = routed.detach()
        self.aux_loss = self.balance_loss(scores, routed).detach() if self.aux_loss_coeff else None
        ctx.produced = {"indices": indices, "probs": probs}
        if ctx.input_requires_grad or ctx.params_require_grad:
            ctx.saved.scores, ctx.saved.indices, ctx.saved.weight = scores, indices, weight
            ctx.saved.probs, ctx.saved.total, ctx.saved.routed = probs, total, routed
            ctx.save_input(x)
        return x

    def score_grads(self, scores, indices, probs, total, routed, d_probs) -> torch.Tensor:
        """d objective / d logits (T, E), the objective being ``<probs, d_probs>`` plus the balance
        loss (explicit: the backward may run where autograd records nothing, e.g. in a custom op).

        ``scores`` (T, E), ``probs`` (T, k), ``total`` (T, 1) or None and ``routed`` (E,) (the slot
        counts) as the forward made them.
        The probs' gradient reaches k scores a token: d chosen = scale * d_probs, then through the
        normalization (d chosen - <d chosen, probs / scale>) / total; the softmax's backward
        s * (d_s - <d_s, s>) then needs <d_s, s> over the k chosen only."""
        if not self.aux_loss_coeff and self.score == "softmax":
            if d_probs is None:
                return torch.zeros_like(scores)
            return self.softmax_logit_grads(scores, indices, probs, total, d_probs.to(scores.dtype))
        d_chosen = None
        if d_probs is not None:
            d_chosen = d_probs.to(scores.dtype)
            if self.scale != 1.0:
                d_chosen = d_chosen * self.scale
            if total is not None:
                unscaled = probs if self.scale == 1.0 else probs / self.scale
                d_chosen = (d_chosen - (d_chosen * unscaled).sum(-1, keepdim=True)) / total
        d_scores = torch.zeros_like(scores)
        if d_chosen is not None:
            d_scores.scatter_add_(1, indices, d_chosen)
        if self.aux_loss_coeff:
            tokens = max(scores.shape[0], 1)
            weight = self.aux_loss_coeff * self.num_experts * routed / (tokens * self.k) / tokens  # (E,)
            if self.score == "softmax":
                d_scores += weight
            else:
                total_scores = scores.sum(-1, keepdim=True) + 1e-20
                d_scores += weight / total_scores - (scores * weight).sum(-1, keepdim=True) / total_scores**2
        if self.score == "softmax":
            return scores * (d_scores - (d_scores * scores).sum(-1, keepdim=True))
        return d_scores * scores * (1 - scores)

    def softmax_logit_grads(self, scores, indices, probs, total, d_probs) -> torch.Tensor:
        """`score_grads` of a softmax router without the balance loss, from the probs (no gather of
        the chosen scores): the softmax's backward s * (d_s - <d_s, s>) with d_s nonzero at the k
        chosen experts, whose terms s_j d_s_j are p_j (d_j - <d, p> / scale) when normalized (and
        then sum to zero: the probs sum to scale) and p_j d_j when not."""
        if total is not None:
            weighted = (d_probs * probs).sum(-1, keepdim=True)
            chosen_terms = probs * (d_probs - (weighted if self.scale == 1.0 else weighted / self.scale))
            return torch.zeros_like(scores).scatter_(1, indices, chosen_terms)
        chosen_terms = probs * d_probs
        d_logits = scores * chosen_terms.sum(-1, keepdim=True).neg()
        return d_logits.scatter_add_(1, indices, chosen_terms)

    def op_backward(self, ctx: OpContext, dy):
        x, weight, saved = ctx.load_input(), ctx.saved.weight, ctx.saved
        x_logits, w_logits = self.logits_operands(x, weight.detach())
        d_logits = self.score_grads(saved.scores, saved.indices, saved.probs, saved.total, saved.routed,
                                    ctx.produced_grads.get("probs")).to(x_logits.dtype)
        grads = {"weight": (d_logits.t() @ x_logits).to(weight.dtype)} if ctx.needs_grad("weight") else {}
        dx = None
        if ctx.input_requires_grad:
            if dy is None:
                dx = (d_logits @ w_logits).to(x.dtype)
            else:
                dx = torch.addmm(dy.to(d_logits.dtype), d_logits, w_logits).to(dy.dtype)
        return dx, grads
