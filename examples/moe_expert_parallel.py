"""An expert-parallel MoE layer over torch.distributed, with te_fused_ops running the local experts.

    python examples/moe_expert_parallel.py --device cpu              # 2 gloo processes, spawned here
    torchrun --nproc-per-node 2 examples/moe_expert_parallel.py     # NCCL on 2 GPUs (CPU: gloo)

On CUDA the default size is a realistic one (4096 tokens per rank, H 2048, I 768, 32 experts,
top-8); on the CPU a small one.

It checks the layer (output; gradients of the input, the router and every rank's experts) against
the same layer in one process, prints a short report and exits non-zero on a mismatch. On CUDA it
also captures a whole training step in a CUDA graph and replays it with new tokens.

Layout. W ranks, E experts, rank r owns experts r*E_l .. (r+1)*E_l - 1 (E_l = E / W). Each rank
routes its T tokens (width H) to k experts each. The layer is the router and one te_fused_ops
`Sequential`: `Permute(E, group=..., capacity_factor=...)` sends each token's slots to the ranks
owning their experts (one all_to_all; every (source, destination) pair of ranks has C =
ceil(capacity_factor * T * k / W) rows, so every buffer has a static shape and the host reads no
routing values; a destination's slots past its C rows are dropped, in the order expert, token,
slot) and groups the rows a rank received by its local experts; `GroupedLinear`, `SwiGLU`,
`GroupedLinear` run the rank's experts; `Unpermute(group=...)` sends the rows back and sums them
into their tokens, weighted by the router probabilities. Gradients flow back to the input, the
router (through the probabilities) and every rank's experts. With ``--chunks n`` the layer runs as
n chunks of each rank's experts, one chunk's exchanges beside another chunk's experts (the capacity
then holds per chunk: C = ceil(capacity_factor * T * k / (W * n))); on 2 H100s over NVLink this was
measured slower than one chunk (docs/notes/expert-parallel.md).
"""

import argparse
import math
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from te_fused_ops import CudaGraphStep, GroupedLinear, Permute, ScaledSwiGLU, Sequential, SwiGLU, Unpermute


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


class ExpertParallelMoE(nn.Module):
    """Top-k MoE layer whose E experts are split evenly over the ranks of ``group``."""

    def __init__(self, hidden, ffn, num_experts, top_k=2, capacity_factor=1.25, chunks=1, group=None, dtype=None,
                 device=None):
        super().__init__()
        self.group = dist.group.WORLD if group is None else group
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        self.num_experts, self.local_experts = num_experts, num_experts // self.world
        self.top_k, self.capacity_factor, self.chunks = top_k, capacity_factor, chunks
        self.router = Router(hidden, num_experts, top_k, device=device)
        self.experts = Sequential(
            Permute(num_experts, group=self.group, capacity_factor=capacity_factor, chunks=chunks),
            GroupedLinear(self.local_experts, hidden, 2 * ffn, dtype=dtype, device=device),
            SwiGLU(),
            GroupedLinear(self.local_experts, ffn, hidden, dtype=dtype, device=device),
            Unpermute(group=self.group),
        )

    def forward(self, x: torch.Tensor):
        """x (T, H) -> y (T, H), dropped () int64 (this rank's assignments past their capacity)."""
        probs, experts = self.router(x)
        y = self.experts(x, indices=experts, probs=probs)
        return y, self.experts[0].dropped.clone()

    @torch.no_grad()
    def load_shard(self, router: Router, experts: Sequential) -> None:
        """Copy the router and this rank's slice of an all-experts ``Sequential`` (the reference)."""
        self.router.load_state_dict(router.state_dict())
        local = slice(self.rank * self.local_experts, (self.rank + 1) * self.local_experts)
        for mine, full in ((self.experts[1], experts[0]), (self.experts[3], experts[2])):
            mine.weight.copy_(full.weight[local])


# ---- the single-process reference and the check ------------------------------------------------


def kept_assignments(experts: torch.Tensor, local_experts: int, slots: int, chunks: int) -> torch.Tensor:
    """(T, k) bool: whether each assignment of one source rank fits in its destination's slots.

    The capacity rule of ``Permute(group=..., chunks=...)``, written independently as a host loop:
    a destination rank fills the C slots of each chunk of its experts in the order (expert, token,
    choice).
    """
    used = {}
    kept = torch.zeros(experts.shape, dtype=torch.bool)
    rows = experts.tolist()
    for expert, token, choice in sorted((e, t, c) for t, row in enumerate(rows) for c, e in enumerate(row)):
        where = (expert // local_experts, expert % local_experts // (local_experts // chunks))
        if used.get(where, 0) < slots:
            used[where] = used.get(where, 0) + 1
            kept[token, choice] = True
    return kept.to(experts.device)


def reference_forward(router: Router, experts: Sequential, xs, world: int, slots: int, chunks: int):
    """The layer in one process: xs, every rank's (T, H) tokens -> (W * T, H) output, dropped count.

    Routing runs per rank (the shapes, so the bits, the ranks route with); all experts in one call.
    """
    local_experts = experts[0].num_groups // world
    tokens, chosen, probs = [], [], []
    for rank, x in enumerate(xs):
        p, e = router(x)
        kept = kept_assignments(e, local_experts, slots, chunks)
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
    counted by the reference). With top-k 1 the renormalized probabilities are all 1, so the
    router's true gradient is zero and both sides hold rounding noise: not compared.
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
    slots = capacity(tokens, layer.top_k, world * layer.chunks, layer.capacity_factor)
    y_ref, dropped_ref = reference_forward(router, experts, xs, world, slots, layer.chunks)
    (y_ref.float() * torch.cat([dy for _, dy in batches])).sum().backward()

    local = slice(rank * layer.local_experts, (rank + 1) * layer.local_experts)
    errors = {
        "output": rel_err(y, y_ref[rank * tokens : (rank + 1) * tokens]),
        "input grad": rel_err(x.grad, xs[rank].grad),
        "router grad": rel_err(router_grad, router.gate.weight.grad),
        "fc1 weight grad": rel_err(layer.experts[1].weight.grad, experts[0].weight.grad[local]),
        "fc2 weight grad": rel_err(layer.experts[3].weight.grad, experts[2].weight.grad[local]),
    }
    if layer.top_k == 1:
        del errors["router grad"]
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
        args.hidden, args.ffn, args.experts, args.top_k, args.capacity_factor, args.chunks, dtype=dtype, device=device
    )
    layer.load_shard(router, experts)

    errors, dropped, dropped_ref = check_against_reference(args, layer, router, experts, device, dtype)
    ok = dropped == dropped_ref and all(err <= tol for err in errors.values())
    lines = [
        f"expert-parallel MoE: {layer.world} ranks ({dist.get_backend(layer.group)}, {device.type}, "
        f"{str(dtype).removeprefix('torch.')}), {args.experts} experts ({layer.local_experts} per rank), "
        f"{args.tokens} tokens per rank, top-{args.top_k}, "
        f"{args.chunks} chunks, {capacity(args.tokens, args.top_k, layer.world * args.chunks, args.capacity_factor)} "
        "slots per rank pair and chunk",
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
    """mp.spawn entry point: exits non-zero on a mismatch. A finished rank leaves through
    ``os._exit``: the interpreter's C++ teardown after gloo can abort a finished process
    ("terminate called without an active exception")."""
    ok = worker(rank, rank, args.nproc, args, init_method)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--tokens", type=int, help="tokens per rank (default: CUDA 4096, CPU 128)")
    parser.add_argument("--hidden", type=int, help="default: CUDA 2048, CPU 64")
    parser.add_argument("--ffn", type=int, help="expert intermediate size (default: CUDA 768, CPU 64)")
    parser.add_argument("--experts", type=int, help="default: CUDA 32, CPU 8")
    parser.add_argument("--top-k", type=int, help="default: CUDA 8, CPU 2")
    parser.add_argument("--capacity-factor", type=float, default=1.0)
    parser.add_argument("--chunks", type=int, default=1,
                        help="chunks of each rank's experts, one chunk's exchanges beside another's experts")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    sizes = dict(tokens=4096, hidden=2048, ffn=768, experts=32, top_k=8) if args.device == "cuda" else dict(
        tokens=128, hidden=64, ffn=64, experts=8, top_k=2)
    for name, value in sizes.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


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
