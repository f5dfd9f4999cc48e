"""Token routing for the MoE layer ops: top-k expert ids -> expert-ordered rows, on the device.

T tokens, k slots per token, M = T * k rows. Slot (t, j) is routed to expert ``indices[t, j]``;
an id outside ``[0, E)`` (``-1`` by convention) marks a dropped slot. Rows are ordered by expert,
and within an expert by slot (a stable sort: deterministic, tokens in order); the rows of the
dropped slots come last and are padding: the grouped ops after the permute give them zero output
and zero gradient. Everything here is sync-free (no value reaches the host).

The torch functions below are the reference row movers (every device); a backend may run the
same contracts on its kernels (`scatter_rows`, `gather_sum`).
"""

from dataclasses import dataclass

import torch

from .backends import helper_kernel
from .cuda_graphs import capturing


@dataclass(frozen=True)
class Routing:
    """Where each slot's row lives in expert order.

    slot_rows:  (T, k) int32, the row of slot (t, j); flattened, a permutation of [0, M)
    row_slots:  (M,) int64, the slot (t * k + j) of each row (the inverse permutation)
    row_tokens: (M,) int32, the token of each row (row_slots // k), for kernels that read x's
                or dy's rows by index
    offsets:    (E + 1,) int32, expert e owns rows offsets[e]:offsets[e+1]; rows from
                offsets[E] on are the dropped slots' (padding)
    counts:     (E,) int32, rows per expert (the grouped ops' ``split_sizes``)
    """

    slot_rows: torch.Tensor
    row_slots: torch.Tensor
    row_tokens: torch.Tensor
    offsets: torch.Tensor
    counts: torch.Tensor

    @property
    def num_kept(self) -> torch.Tensor:
        """(1,) int32 view: rows below it belong to an expert."""
        return self.offsets[-1:]

    @property
    def top_k(self) -> int:
        return self.slot_rows.shape[1]

    def kept_slots(self) -> torch.Tensor:
        """(T, k) bool: the slot reached an expert."""
        return self.slot_rows < self.offsets[-1]

    def kept_rows(self) -> torch.Tensor:
        """(M, 1) bool: the row belongs to an expert."""
        rows = torch.arange(self.row_slots.shape[0], device=self.offsets.device, dtype=torch.int32)
        return (rows < self.offsets[-1]).unsqueeze(1)


def route(indices: torch.Tensor, num_experts: int) -> Routing:
    """The `Routing` of top-k expert ids ``indices`` (T, k) int32/int64 (checked by the caller).

    A backend's routing kernel takes them where it applies (`backends.helper_kernel`), else
    `route_torch`."""
    made = helper_kernel("route", indices, num_experts)
    return route_torch(indices, num_experts) if made is None else Routing(*made)


def route_torch(indices: torch.Tensor, num_experts: int) -> Routing:
    """`route` in torch ops on any device: each slot's sort key is its expert, or ``num_experts``
    for a dropped slot (ids clamped into [-1, E], then -1 taken to E), as int32, which the radix
    sort orders in half the passes of int64; the offsets are where each expert's keys start in
    the sorted keys (one search), the counts their differences."""
    device = indices.device
    flat = indices.reshape(-1)
    num_rows = flat.shape[0]
    expert = torch.remainder(flat.clamp(-1, num_experts).to(torch.int32), num_experts + 1)
    keys, row_slots = torch.sort(expert, stable=True)
    slot_rows = torch.empty(num_rows, dtype=torch.int32, device=device)
    slot_rows.scatter_(0, row_slots, torch.arange(num_rows, dtype=torch.int32, device=device))
    offsets = torch.searchsorted(keys, torch.arange(num_experts + 1, dtype=torch.int32, device=device),
                                 out_int32=True)
    row_tokens = (row_slots // indices.shape[1]).to(torch.int32)
    return Routing(slot_rows.view(indices.shape), row_slots, row_tokens, offsets, offsets[1:] - offsets[:-1])


def _math(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def scatter_rows(x: torch.Tensor, routing: Routing, scale=None) -> torch.Tensor:
    """(T, H) -> (M, H): row ``slot_rows[t, j]`` gets ``x[t]`` (times ``scale[t, j]``); padding
    rows get zeros. The permute's forward; with the probs, the combine's backward."""
    k = routing.top_k
    rows = x.index_select(0, routing.row_slots // k)
    if scale is not None:
        rows = (_math(rows) * _math(scale).reshape(-1)[routing.row_slots].unsqueeze(1)).to(x.dtype)
    return rows.masked_fill(~routing.kept_rows(), 0)


def gather_sum(src: torch.Tensor, routing: Routing, weights=None) -> torch.Tensor:
    """(M, H) -> (T, H): ``sum_j weights[t, j] * src[slot_rows[t, j]]`` over the kept slots, in
    float32, rounded once. The combine's forward; without weights, the permute's backward."""
    picked = _math(src)[routing.slot_rows.long()]  # (T, k, H)
    if weights is not None:
        picked = picked * _math(weights).unsqueeze(-1)
    # a dropped slot adds nothing, whatever its weight (an inf or NaN probability times 0 is NaN)
    return torch.where(routing.kept_slots().unsqueeze(-1), picked, 0).sum(1).to(src.dtype)


def slot_dots(dy: torch.Tensor, src: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(T, k) float32: ``<dy[t], src[slot_rows[t, j]]>`` for kept slots, 0 for dropped ones (the
    gradient of the combine's weights)."""
    picked = _math(src)[routing.slot_rows.long()]
    dots = (picked * _math(dy).unsqueeze(1)).sum(-1)
    return torch.where(routing.kept_slots(), dots, 0)


def rows_to_slots(row_values: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """(M,) per-row values, or (P, M) float32 partial sums of them -> (T, k) per-slot values in
    ``dtype`` (dropped slots: 0). A backend's kernel takes them where it applies (one launch), else
    `rows_to_slots_torch`."""
    parts = row_values if row_values.dim() == 2 else row_values.unsqueeze(0)
    made = helper_kernel("rows_to_slots", parts, routing, dtype)
    return rows_to_slots_torch(parts, routing, dtype) if made is None else made


def rows_to_slots_torch(row_parts: torch.Tensor, routing: Routing, dtype: torch.dtype) -> torch.Tensor:
    """`rows_to_slots` of (P, M) partial sums in torch ops on any device."""
    return torch.where(routing.kept_slots(), row_parts.sum(0)[routing.slot_rows], 0).to(dtype)


def slots_to_rows(slot_values: torch.Tensor, routing: Routing) -> torch.Tensor:
    """(T, k) per-slot values -> (M,) per-row values in float32 (float64 stays) (padding rows: 0,
    the dropped slots' rows). A backend's kernel takes them where it applies (one launch), else
    `slots_to_rows_torch`."""
    made = helper_kernel("slots_to_rows", slot_values, routing)
    return slots_to_rows_torch(slot_values, routing) if made is None else made


def slots_to_rows_torch(slot_values: torch.Tensor, routing: Routing) -> torch.Tensor:
    """`slots_to_rows` in torch ops on any device."""
    return _math(torch.where(routing.kept_slots(), slot_values, 0).reshape(-1)[routing.row_slots])


@dataclass(frozen=True)
class ExpertParallelRouting(Routing):
    """The routing of a `Permute` with ``group=`` (experts split evenly over the group's W ranks).
    The `Routing` fields describe the rows this rank received (one slot each, grouped by local
    expert; unused rows are dropped slots); the others map this rank's T tokens to its send rows,
    N of them: W blocks of C rows with a static capacity (rows d * C .. d * C + C - 1 go to rank d),
    or exactly the rows each rank gets when dropless (``splits``).

    send_slots:  (N,) int64, the slot t * k + j each send row carries; T * k for an unused row
    send_slot_rows: (T, k) int32, the send row of each slot; N for a slot not sent
    send_kept:   (1,) int32 holding N (send rows below it are kept: the row kernels' num_kept)
    dropped:     () int64, this rank's slots past their destination's capacity
    group:       the process group
    splits:      None (W equal blocks each way), or (rows sent to each rank, rows received from
                 each rank) as host lists (dropless: read once when the routing was made)
    """

    send_slots: torch.Tensor
    send_slot_rows: torch.Tensor
    send_kept: torch.Tensor
    dropped: torch.Tensor
    group: object
    splits: tuple = None

    @property
    def tokens(self) -> int:
        """T, from ``send_slot_rows``' shape (a shape, not a saved int: under torch.compile one
        packed routing serves every token count)."""
        return self.send_slot_rows.shape[0]

    @property
    def slots_per_token(self) -> int:
        """k."""
        return self.send_slot_rows.shape[1]

    def send_tokens(self) -> torch.Tensor:
        """(N,) int64: the token of each send row (T for an unused row)."""
        return self.send_slots // self.slots_per_token

    def send_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """Per-token rows (T, H) -> the send rows (N, H), zeros in the unused ones."""
        padded = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])
        return padded.index_select(0, self.send_tokens())

    def sum_send_rows(self, sent: torch.Tensor) -> torch.Tensor:
        """Send rows (N, H) -> per-token sums (T, H) (the reverse of `send_rows`)."""
        out = sent.new_zeros(self.tokens + 1, sent.shape[1]).index_add_(0, self.send_tokens(), sent)
        return out[:-1]

    def exchange(self, sent: torch.Tensor) -> torch.Tensor:
        """Send rows (N, ...) -> the rows this rank receives (one all-to-all)."""
        sizes = (None, None) if self.splits is None else (self.splits[1], self.splits[0])
        return all_to_all(sent, self.group, *sizes)

    def exchange_back(self, received: torch.Tensor) -> torch.Tensor:
        """Received rows -> this rank's send rows (N, ...) (the reverse all-to-all)."""
        sizes = (None, None) if self.splits is None else self.splits
        return all_to_all(received, self.group, *sizes)


def all_to_all(t: torch.Tensor, group, out_sizes=None, in_sizes=None) -> torch.Tensor:
    """Rows to every rank: block d of ``t`` goes to rank d, block s of the result came from rank
    s; W equal blocks, or blocks of ``in_sizes`` / ``out_sizes`` rows (host lists)."""
    import torch.distributed as dist

    out = t.new_empty((t.shape[0] if out_sizes is None else sum(out_sizes), *t.shape[1:]))
    dist.all_to_all_single(out, t.contiguous(), out_sizes, in_sizes, group=group)
    return out


def route_expert_parallel(indices: torch.Tensor, num_experts: int, group, capacity, chunks: int = 1):
    """The `ExpertParallelRouting` of this rank's ids ``indices`` (T, k) (checked by the caller):
    a destination rank fills its ``capacity`` rows in the order (expert, token, slot); the counts
    go to every rank (one small all-to-all), which groups what it receives. No host sync, unless
    ``capacity`` is None (dropless): then every slot is sent and the exchanged counts are read on
    the host once to size the buffers exactly.

    ``chunks`` > 1: the list of the routings of the chunks of each rank's experts (chunk c: local
    experts c L / chunks ..), ``capacity`` rows per rank pair and chunk, found together (one sort,
    one exchange of counts); chunk c's send rows are its own (its ``send_slot_rows`` name them; a
    slot of another chunk is not sent by it), its received rows grouped by the chunk's experts.
    The first chunk's ``dropped`` counts the slots dropped in every chunk (the others: 0).
    """
    import torch.distributed as dist

    device, world = indices.device, dist.get_world_size(group)
    local_experts = num_experts // world
    per_chunk = local_experts // chunks
    flat = indices.reshape(-1).to(torch.int64)
    num_slots = flat.shape[0]
    valid = (flat >= 0) & (flat < num_experts)
    # a slot's block: (chunk, destination rank), chunk-major; num_blocks for a dropped slot
    num_blocks = chunks * world
    block = torch.where(valid, flat % local_experts // per_chunk * world + flat // local_experts, num_blocks)
    order = torch.sort(torch.where(valid, block * num_experts + flat, num_blocks * num_experts), stable=True).indices
    sorted_block = block[order]
    sent = sorted_block < num_blocks
    if capacity is None:  # dropless: every valid slot, in block order
        kept, row = sent, torch.where(sent, torch.arange(num_slots, device=device), num_slots)
    else:
        per_block = torch.zeros(num_blocks + 1, dtype=torch.int64, device=device).scatter_add_(
            0, block, torch.ones_like(block))[:num_blocks]
        block_start = torch.cat([torch.cumsum(per_block, 0) - per_block, per_block.new_zeros(1)])
        position = torch.arange(num_slots, device=device) - block_start[sorted_block]
        kept = sent & (position < capacity)
        row = torch.where(kept, sorted_block * capacity + position, num_blocks * capacity)  # the last: a spill row
    send_counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    send_counts = send_counts.scatter_add_(0, torch.where(kept, flat[order], num_experts), kept.long())
    send_counts = send_counts[:num_experts].view(world, local_experts)
    recv_counts = all_to_all(send_counts, group)  # row s: what rank s sends here, per local expert
    dropped = (sent & ~kept).sum()
    slot_row = torch.empty(num_slots, dtype=torch.int64, device=device).scatter_(0, order, row)
    if capacity is None:  # the block sizes, read on the host once: (chunk, rank) sent, (chunk, rank) received
        if capturing():
            raise RuntimeError("Permute: a dropless expert-parallel dispatch (capacity_factor=None) reads its block "
                               "sizes on the host, which a CUDA graph capture cannot: give a capacity_factor")
        sizes = torch.stack([send_counts.view(world, chunks, per_chunk).sum(2).t(),
                             recv_counts.view(world, chunks, per_chunk).sum(2).t()]).tolist()
        send_sizes, recv_sizes = sizes
        send_slots = order[:sum(map(sum, send_sizes))]
    else:
        send_sizes = [[capacity] * world] * chunks
        recv_sizes = send_sizes
        send_slots = torch.full((num_blocks * capacity + 1,), num_slots, dtype=torch.int64, device=device)
        send_slots = send_slots.scatter_(0, row, order)[:-1]
    routings, first = [], 0
    for chunk in range(chunks):
        counts = recv_counts[:, chunk * per_chunk:(chunk + 1) * per_chunk]
        sending, receiving = sum(send_sizes[chunk]), sum(recv_sizes[chunk])
        if capacity is None:
            local_ids = torch.arange(per_chunk, device=device).repeat(world).repeat_interleave(
                counts.reshape(-1), output_size=receiving)
        else:
            column = torch.arange(capacity, device=device).expand(world, capacity).contiguous()
            received = torch.searchsorted(torch.cumsum(counts, 1), column, right=True)
            local_ids = torch.where(received < per_chunk, received, -1)
        local = route(local_ids.reshape(-1, 1), per_chunk)
        in_chunk = (slot_row >= first) & (slot_row < first + sending)
        send_slot_rows = torch.where(in_chunk, slot_row - first, sending).to(torch.int32).view(indices.shape)
        routings.append(ExpertParallelRouting(
            local.slot_rows, local.row_slots, local.row_tokens, local.offsets, local.counts, send_slots[first:first + sending],
            send_slot_rows, torch.full((1,), sending, dtype=torch.int32, device=device),
            dropped if chunk == 0 else torch.zeros_like(dropped), group,
            None if capacity is not None else (send_sizes[chunk], recv_sizes[chunk])))
        first += sending
    return routings[0] if chunks == 1 else routings
