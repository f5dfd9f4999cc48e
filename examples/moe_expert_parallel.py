"""An expert-parallel MoE layer over torch.distributed, with te_fused_ops running the local experts.

    python examples/moe_expert_parallel.py --device cpu              # 2 gloo processes, spawned here
    torchrun --nproc-per-node 2 examples/moe_expert_parallel.py     # NCCL on 2 GPUs (CPU: gloo)

It checks the layer (output; gradients of the input, the router and every rank's experts) against
the same layer in one process, prints a short report and exits non-zero on a mismatch. On CUDA it
also captures a whole training step in a CUDA graph and replays it with new tokens.

Layout. W ranks, E experts, rank r owns experts r*E_l .. (r+1)*E_l - 1 (E_l = E / W). Each rank
routes its T tokens (width H) to k experts each: A = T * k assignments, flattened token-major
(assignment a is token a // k). Every (source, destination) pair of ranks has a fixed number of
slots, C = ceil(capacity_factor * T * k / W), so every buffer has a static shape and the host reads
no routing values:

    send buffer     (W * C, H)    rows d*C .. d*C + C - 1 go to rank d: the assignments kept for
                                  rank d, sorted by expert (then token), then zero rows. A
                                  destination's assignments past its C slots are dropped.
    send counts     (W, E_l)      kept assignments per destination rank and its local expert
    receive buffer  (W * C, H)    rows s*C .. s*C + C - 1 came from rank s, laid out as above;
                                  receive counts (W, E_l): row s = what rank s sent here

The local experts are one te_fused_ops layer run on the receive buffer: each receive row has one
local expert (k = 1; the unused slots' id is -1, dropped), so `Permute(E_l)` groups the rows by
expert on the device and produces the split sizes, `GroupedLinear`/`ScaledSwiGLU`/`GroupedLinear`
compute, and `Unpermute()` puts the results back in the receive layout.

The router probabilities travel the same way ((W * C,) buffers). Combine: the expert output, already
scaled by the probabilities in ScaledSwiGLU and back in the receive layout, is returned with the
reverse all_to_all and added to the tokens of its send slots. The data exchanges use the
differentiable torch.distributed.nn.functional.all_to_all_single, so gradients flow back to the
input, the router and the experts.
"""

import argparse
import math
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.multiprocessing as mp
from torch import nn

from te_fused_ops import CudaGraphStep, GroupedLinear, Permute, ScaledSwiGLU, Sequential, Unpermute

# torch suggests its functional collectives instead; this autograd version also runs in eager
# mode on gloo and inside CUDA graph captures, so it is the one used here
warnings.filterwarnings("ignore", message=r".*all_to_all_single is deprecated", category=FutureWarning)


def capacity(tokens: int, top_k: int, world: int, capacity_factor: float) -> int:
    """C: slots per (source, destination) rank pair, ceil(capacity_factor * tokens * top_k / world)."""
    return math.ceil(capacity_factor * tokens * top_k / world)


class Router(nn.Module):
    """Linear gate (float32) + softmax over E experts, top-k, probabilities renormalized over the k."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, device=None):
        super().__init__()
        self.gate = nn.Linear(hidden, num_experts, bias=False, device=device)
        self.top_k = top_k

    def forward(self, x: torch.Tensor):
        """x (T, H) -> probs (T, k) float32, experts (T, k) int64."""
        scores = torch.softmax(self.gate(x.float()), dim=-1)
        probs, experts = torch.topk(scores, self.top_k, dim=-1)
        return probs / probs.sum(-1, keepdim=True), experts


def plan_dispatch(experts: torch.Tensor, num_experts: int, world: int, slots: int):
    """Send-side bookkeeping, on the device.

    experts (T, k) int64 -> slot_assignment (W * C,) int64: the flat assignment index each send slot
    carries (A = T * k for an empty slot); send_counts (W, E_l) int64; dropped () int64.
    """
    flat = experts.reshape(-1)
    num_assignments, local_experts = flat.numel(), num_experts // world
    order = torch.argsort(flat, stable=True)  # assignments grouped by expert, then token
    sorted_experts = flat[order]
    per_expert = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat)
    )
    per_rank = per_expert.view(world, local_experts).sum(1)
    destination = sorted_experts // local_experts
    rank_start = torch.cumsum(per_rank, 0) - per_rank  # first sorted position of each destination
    position = torch.arange(num_assignments, device=flat.device) - rank_start[destination]
    kept = position < slots
    slot = torch.where(kept, destination * slots + position, world * slots)  # dropped: a spill slot
    slot_assignment = torch.full((world * slots + 1,), num_assignments, device=flat.device)
    slot_assignment = slot_assignment.scatter_(0, slot, order)[:-1]
    send_counts = torch.zeros_like(per_expert).scatter_add_(0, sorted_experts, kept.long())
    return slot_assignment, send_counts.view(world, local_experts), (~kept).sum()


def receive_experts(recv_counts: torch.Tensor, slots: int) -> torch.Tensor:
    """The local expert of each receive row, on the device: recv_counts (W, E_l) int64 (row s: rows
    from rank s per local expert) -> (W * C, 1) int64, -1 for the unused slots."""
    world, local_experts = recv_counts.shape
    column = torch.arange(slots, device=recv_counts.device).expand(world, slots).contiguous()  # (W, C)
    expert = torch.searchsorted(torch.cumsum(recv_counts, 1), column, right=True)  # E_l: unused slot
    return torch.where(expert < local_experts, expert, -1).reshape(-1, 1)


def all_to_all(t: torch.Tensor, group=None) -> torch.Tensor:
    """(W * C, ...) -> (W * C, ...): chunk d goes to rank d, chunk s of the result came from rank s;
    differentiable (the backward is the reverse all_to_all)."""
    group = dist.group.WORLD if group is None else group
    return dist_nn.all_to_all_single(torch.empty_like(t), t.contiguous(), group=group)


def with_zero_row(t: torch.Tensor) -> torch.Tensor:
    """(N, ...) -> (N + 1, ...): a zero row appended, read by the empty slots."""
    return torch.cat([t, t.new_zeros(1, *t.shape[1:])])


class ExpertParallelMoE(nn.Module):
    """Top-k MoE layer whose E experts are split evenly over the ranks of ``group``."""

    def __init__(self, hidden, ffn, num_experts, top_k=2, capacity_factor=1.25, group=None, dtype=None, device=None):
        super().__init__()
        self.group = dist.group.WORLD if group is None else group
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if num_experts % self.world:
            raise ValueError(f"ExpertParallelMoE: {num_experts} experts do not split evenly over {self.world} ranks")
        self.num_experts, self.local_experts = num_experts, num_experts // self.world
        self.top_k, self.capacity_factor = top_k, capacity_factor
        self.router = Router(hidden, num_experts, top_k, device=device)
        self.experts = Sequential(
            Permute(self.local_experts),
            GroupedLinear(self.local_experts, hidden, 2 * ffn, dtype=dtype, device=device),
            ScaledSwiGLU(),
            GroupedLinear(self.local_experts, ffn, hidden, dtype=dtype, device=device),
            Unpermute(),
        )

    def forward(self, x: torch.Tensor):
        """x (T, H) -> y (T, H), dropped () int64 (this rank's assignments past their capacity)."""
        tokens = x.shape[0]
        slots = capacity(tokens, self.top_k, self.world, self.capacity_factor)
        probs, experts = self.router(x)
        slot_assignment, send_counts, dropped = plan_dispatch(experts, self.num_experts, self.world, slots)
        slot_token = slot_assignment // self.top_k  # T (the zero row) for empty slots

        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)  # (W, E_l): static shape
        x_recv = all_to_all(with_zero_row(x).index_select(0, slot_token), self.group)
        probs_recv = all_to_all(with_zero_row(probs.reshape(-1)).index_select(0, slot_assignment), self.group)

        y_recv = self.experts(x_recv, indices=receive_experts(recv_counts, slots), probs=probs_recv.unsqueeze(1))
        y_back = all_to_all(y_recv, self.group)  # in this rank's send slots
        y = x.new_zeros(tokens + 1, x.shape[1]).index_add(0, slot_token, y_back)
        return y[:tokens], dropped

    @torch.no_grad()
    def load_shard(self, router: Router, experts: Sequential) -> None:
        """Copy the router and this rank's slice of an all-experts ``Sequential`` (the reference)."""
        self.router.load_state_dict(router.state_dict())
        local = slice(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)
        for mine, full in ((self.experts[1], experts[0]), (self.experts[3], experts[2])):
            mine.weight.copy_(full.weight[local])


# ---- the single-process reference and the check ------------------------------------------------


def kept_assignments(experts: torch.Tensor, local_experts: int, world: int, slots: int) -> torch.Tensor:
    """(T, k) bool: whether each assignment of one source rank fits in its destination's slots.

    The capacity rule of ``plan_dispatch``, written independently as a host loop: a destination
    rank fills its C slots in the order (expert, token, choice).
    """
    used = [0] * world
    kept = torch.zeros(experts.shape, dtype=torch.bool)
    rows = experts.tolist()
    for expert, token, choice in sorted((e, t, c) for t, row in enumerate(rows) for c, e in enumerate(row)):
        if used[expert // local_experts] < slots:
            used[expert // local_experts] += 1
            kept[token, choice] = True
    return kept.to(experts.device)


def reference_forward(router: Router, experts: Sequential, xs, world: int, slots: int):
    """The layer in one process: xs, every rank's (T, H) tokens -> (W * T, H) output, dropped count.

    Routing runs per rank (the shapes, so the bits, the ranks route with); all experts in one call.
    """
    local_experts = experts[0].num_groups // world
    tokens, chosen, probs = [], [], []
    for rank, x in enumerate(xs):
        p, e = router(x)
        kept = kept_assignments(e, local_experts, world, slots)
        token = torch.arange(x.shape[0], device=x.device).unsqueeze(1).expand_as(e) + rank * x.shape[0]
        tokens.append(token[kept])
        chosen.append(e[kept])
        probs.append(p[kept])
    tokens, chosen, probs = torch.cat(tokens), torch.cat(chosen), torch.cat(probs)
    order = torch.argsort(chosen, stable=True)
    split_sizes = torch.bincount(chosen, minlength=experts[0].num_groups)
    x = torch.cat(xs)
    h = experts(x[tokens[order]], split_sizes=split_sizes, probs=probs[order])
    dropped = x.shape[0] * router.top_k - tokens.numel()
    return torch.zeros_like(x).index_add(0, tokens[order], h), dropped


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| in float64 (host read: checking only)."""
    got, want = got.detach().double(), want.detach().double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def make_batch(args, rank: int, step: int, device, dtype):
    """Rank ``rank``'s tokens x (T, H) and loss weights dy (T, H) of ``step``, the same in every process."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(args.tokens, args.hidden, generator=gen)
    dy = torch.randn(args.tokens, args.hidden, generator=gen)
    return x.to(device, dtype), dy.to(device)


def check_against_reference(args, layer: ExpertParallelMoE, router: Router, experts: Sequential, device, dtype):
    """One forward + backward of ``layer`` (loss sum(y * dy) over all ranks) and of the reference.

    Returns (relative errors, max over ranks, by name; dropped assignments, all ranks; the same
    counted by the reference).
    """
    world, rank, tokens = layer.world, layer.rank, args.tokens
    batches = [make_batch(args, r, 0, device, dtype) for r in range(world)]
    x = batches[rank][0].clone().requires_grad_()
    y, dropped = layer(x)
    (y.float() * batches[rank][1]).sum().backward()
    router_grad = layer.router.gate.weight.grad.clone()
    dist.all_reduce(router_grad, group=layer.group)  # the router is replicated: its gradient sums over ranks
    dist.all_reduce(dropped, group=layer.group)

    xs = [xr.clone().requires_grad_() for xr, _ in batches]
    slots = capacity(tokens, layer.top_k, world, layer.capacity_factor)
    y_ref, dropped_ref = reference_forward(router, experts, xs, world, slots)
    (y_ref.float() * torch.cat([dy for _, dy in batches])).sum().backward()

    local = slice(rank * layer.local_experts, (rank + 1) * layer.local_experts)
    errors = {
        "output": rel_err(y, y_ref[rank * tokens : (rank + 1) * tokens]),
        "input grad": rel_err(x.grad, xs[rank].grad),
        "router grad": rel_err(router_grad, router.gate.weight.grad),
        "fc1 weight grad": rel_err(layer.experts[1].weight.grad, experts[0].weight.grad[local]),
        "fc2 weight grad": rel_err(layer.experts[3].weight.grad, experts[2].weight.grad[local]),
    }
    worst = torch.tensor(list(errors.values()), dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=layer.group)
    return dict(zip(errors, worst.tolist())), int(dropped), dropped_ref


def check_cuda_graph(args, layer: ExpertParallelMoE, device, dtype, replays: int = 3):
    """Capture one training step (forward, backward, every all_to_all) as a CUDA graph; replay it
    with new tokens (so new routing) written into the static input and compare with eager steps.

    Returns (max relative error over outputs and gradients, all ranks; dropped assignments per replay).
    """
    x0, dy = make_batch(args, layer.rank, 1, device, dtype)
    static_x = x0.clone().requires_grad_()
    params = list(layer.parameters())

    def step():
        for t in (static_x, *params):
            t.grad = None
        y, dropped = layer(static_x)
        (y.float() * dy).sum().backward()
        return y.detach(), dropped

    graphed = CudaGraphStep(step)
    worst, drops = 0.0, []
    for replay in range(2, 2 + replays):
        x, _ = make_batch(args, layer.rank, replay, device, dtype)
        with torch.no_grad():
            static_x.copy_(x)
        y, dropped = graphed()
        x_eager = x.clone().requires_grad_()
        y_eager, dropped_eager = layer(x_eager)
        grads = torch.autograd.grad((y_eager.float() * dy).sum(), [x_eager, *params])
        pairs = [(y, y_eager), (static_x.grad, grads[0])] + [(p.grad, g) for p, g in zip(params, grads[1:])]
        worst = max(worst, *(rel_err(a, b) for a, b in pairs))
        if int(dropped) != int(dropped_eager):
            worst = math.inf
        drops.append(dropped.clone())
    drops = torch.stack(drops)
    totals = torch.tensor([worst], dtype=torch.float64, device=device)
    dist.all_reduce(totals, op=dist.ReduceOp.MAX, group=layer.group)
    dist.all_reduce(drops, group=layer.group)
    return totals.item(), drops.tolist()


def run(args, device) -> bool:
    """Build the layer and its reference (same weights), check them; rank 0 prints the report."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    torch.manual_seed(args.seed)  # every rank builds the same reference weights
    router = Router(args.hidden, args.experts, args.top_k, device=device)
    experts = Sequential(
        GroupedLinear(args.experts, args.hidden, 2 * args.ffn, dtype=dtype, device=device),
        ScaledSwiGLU(),
        GroupedLinear(args.experts, args.ffn, args.hidden, dtype=dtype, device=device),
    )
    layer = ExpertParallelMoE(
        args.hidden, args.ffn, args.experts, args.top_k, args.capacity_factor, dtype=dtype, device=device
    )
    layer.load_shard(router, experts)

    errors, dropped, dropped_ref = check_against_reference(args, layer, router, experts, device, dtype)
    ok = dropped == dropped_ref and all(err <= tol for err in errors.values())
    lines = [
        f"expert-parallel MoE: {layer.world} ranks ({dist.get_backend(layer.group)}, {device.type}, "
        f"{str(dtype).removeprefix('torch.')}), {args.experts} experts ({layer.local_experts} per rank), "
        f"{args.tokens} tokens per rank, top-{args.top_k}, "
        f"{capacity(args.tokens, args.top_k, layer.world, args.capacity_factor)} slots per rank pair",
        f"dropped assignments: {dropped} of {layer.world * args.tokens * args.top_k} (reference: {dropped_ref})",
        f"max relative error vs the single-process reference (tolerance {tol:g}):",
        *(f"  {name:16s} {err:.2e}" for name, err in errors.items()),
    ]
    if device.type == "cuda":
        graph_err, graph_drops = check_cuda_graph(args, layer, device, dtype)
        ok = ok and graph_err <= tol
        lines.append(
            f"CUDA graph: {len(graph_drops)} replays with new routing (dropped {graph_drops}), "
            f"max relative error vs eager {graph_err:.2e}"
        )
    if layer.rank == 0:
        print("\n".join(lines + ["PASS" if ok else "FAIL"]), flush=True)
    return ok


def worker(rank: int, local_rank: int, world: int, args, init_method: str) -> bool:
    """One process: join the group (NCCL on CUDA, gloo on the CPU), run the check, leave."""
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    try:
        ok = run(args, device)
        dist.barrier()  # no rank tears the group down while a peer still runs a collective
    finally:
        dist.destroy_process_group()
    return ok


def spawned(rank: int, args, init_method: str) -> None:
    """mp.spawn entry point: exits non-zero on a mismatch."""
    if not worker(rank, rank, args.nproc, args, init_method):
        sys.exit(1)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per rank")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=64, help="expert intermediate size")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """Under torchrun: this process is one rank. Otherwise: spawn ``--nproc`` ranks. 0 on success."""
    args = parse_args(argv)
    if "RANK" in os.environ:
        env = {name: int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
        return 0 if worker(env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], args, "env://") else 1
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(spawned, args=(args, f"file://{tmp}/init"), nprocs=args.nproc, join=True)
        except mp.ProcessExitedException:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
