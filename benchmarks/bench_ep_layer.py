"""The expert-parallel MoE layer's training step on W GPUs: dispatch, experts, combine, forward + backward.

    torchrun --nproc-per-node 2 benchmarks/bench_ep_layer.py [--shapes qwen3-30b-a3b,dsv3] [--out DIR]
        [--precompile-jobs 8]     # kernels compiled in forked processes first (a cold cache: minutes less)
    python benchmarks/bench_ep_layer.py --device cpu --smoke      # 2 gloo processes, tiny shape

Per rank: T tokens (H wide) routed top-k over E experts (`bench_moe_layer.skewed_topk`, seed =
rank), E / W experts per rank, bf16; x and the probs are leaves that require grad, dy random; each
step sets every gradient to None, runs the forward and the backward. Contenders, one process per
rank, rotated order, the same weights (each rank its own experts):
  torch       a plain torch EP layer written well: stable argsort of the expert ids, the rows
              gathered (`GatherPermute`: gather backward, no atomics), per-rank row counts
              exchanged and read on the host (one sync), `all_to_all_single` with those sizes
              (autograd: torch.distributed.nn), the received rows grouped by local expert (a
              permutation gather each way), six torch._grouped_mm with SwiGLU/dSwiGLU compiled
              per shape (`bench_moe_layer.ExpertMLP`), the rows back, the gather combine with the
              probs compiled per shape (`GatherCombine`)
  lib         Sequential(Permute(E, group, capacity_factor=None), GroupedLinear, SwiGLU,
              GroupedLinear, Unpermute(group)) (dropless: exact sizes, one host read)
  lib static  the same with a static capacity (sync-free): the smallest capacity factor (step 0.05)
              that drops nothing at this routing
  lib xN      static, chunks=N: N chunks of each rank's experts, one chunk's exchanges beside
              another's experts (overlap)
  fp8 / fp8 xN  static, a Quantize("fp8_blockwise") after the Permute (E4M3 rows + 1x128 scales
              travel), SwiGLU, Quantize + Transpose, GroupedLinear (the all-FP8 expert step)
  fp8 4mb     fp8 on its own copy of the experts under `cast_weights_once_per_step`, timed as an
              optimizer step of 4 micro-batches (the first casts the weights, the optimizer step's
              drop ends it; `common.accumulation_step`) per micro-batch: the average micro-batch of
              the gradient-accumulation regime (fp8 casts every step)
  ... graph   the sync-free contenders (static capacity) captured as one CUDA graph per step
              (`CudaGraphStep`) and replayed: no host time (the plain torch layer reads its
              all-to-all sizes on the host, so it cannot be captured)
Every contender's output and gradients (x, probs, both experts' weights) are compared with torch's
before timing (relative Frobenius error, max over ranks; bf16 tolerance 2e-2, FP8 1e-1). Times:
CUDA events around each step (fixed counts, so every rank runs the same collectives), median per
round, median over rounds, max over the ranks. Also per contender: the bytes this rank's
all-to-alls send to other ranks per step (all four exchanges, and the forward dispatch alone: the
one that travels in FP8 under the FP8 recipe), peak memory of a step above what was allocated before
it; and per shape the time of the library's four exchanges alone (``comm``), from which the share
hidden by the overlap: (lib static - lib xN) / comm. Writes benchmarks/results/ep_layer_<device>x<W>.json/.md.
"""

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
import time

from common import require_sm90

if __name__ == "__main__" and "--smoke" not in sys.argv:  # one line, exit 2, where no Hopper GPU is
    require_sm90(__file__)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_moe_layer import ExpertMLP, GatherCombine, GatherPermute, layer_math, skewed_topk  # noqa: E402
from common import accumulation_step, device_tag, per_micro_batch, write_results  # noqa: E402

from te_fused_ops import (  # noqa: E402
    GroupedLinear,
    Permute,
    Quantize,
    Sequential,
    SwiGLU,
    Transpose,
    Unpermute,
    cast_weights_once_per_step,
)

SHAPES = {  # tokens per rank, k, experts (all ranks), hidden, intermediate
    "qwen3-30b-a3b": (8192, 8, 128, 2048, 768),
    "dsv3": (4096, 8, 256, 7168, 2048),
}
SMOKE = {"smoke": (64, 4, 8, 128, 64)}


class PermuteRows(torch.autograd.Function):
    """rows[perm] with the inverse permutation's gather as the backward (no atomics)."""

    @staticmethod
    def forward(ctx, rows, perm, inverse):
        ctx.save_for_backward(inverse)
        return rows.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def torch_ep_layer(x, indices, probs, w1, w2, experts: int, group, math_fns):
    """The plain torch EP layer (see the module docstring); dropless, one host read."""
    from torch.distributed.nn.functional import all_to_all_single

    world = dist.get_world_size(group)
    local = experts // world
    t, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=x.device)).view(t, k)
    send = torch.zeros(experts, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # (W, L): what each rank sends here, per local expert
    sizes = torch.stack([send.view(world, local).sum(1), recv.view(world, local).sum(1)]).tolist()  # host read
    x_perm = GatherPermute.apply(x, order, rows, math_fns)
    received = all_to_all_single(x_perm.new_empty(sum(sizes[1]), x.shape[1]), x_perm, sizes[1], sizes[0], group=group)
    local_ids = torch.arange(local, device=x.device).repeat(world).repeat_interleave(recv, output_size=sum(sizes[1]))
    by_expert = torch.argsort(local_ids, stable=True)
    inverse = torch.empty_like(by_expert).scatter_(0, by_expert, torch.arange(by_expert.numel(), device=x.device))
    ends = torch.cumsum(recv.view(world, local).sum(0), 0, dtype=torch.int32)
    y = ExpertMLP.apply(PermuteRows.apply(received, by_expert, inverse), w1, w2, ends, math_fns)
    back = all_to_all_single(y.new_empty(t * k, y.shape[1]), PermuteRows.apply(y, inverse, by_expert), sizes[0],
                             sizes[1], group=group)
    return GatherCombine.apply(back, probs, rows, order, math_fns)


def no_drop_capacity_factor(indices, experts: int, group, chunks: int = 1) -> float:
    """The smallest capacity factor (step 0.05) that drops nothing at this routing on any rank,
    with ``chunks`` chunks of each rank's experts (the capacity holds per chunk)."""
    world = dist.get_world_size(group)
    local = experts // world
    flat = indices.reshape(-1)
    where = flat // local * chunks + flat % local // (local // chunks)  # (destination, chunk)
    largest = torch.bincount(where, minlength=world * chunks).max().reshape(1).float()
    dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
    return math.ceil(largest.item() / (indices.numel() / (world * chunks)) / 0.05) * 0.05 + 1e-9


def library_layer(fc1, fc2, experts: int, group, capacity_factor, chunks: int = 1, fp8: bool = False):
    dispatch = Permute(experts, group=group, capacity_factor=capacity_factor, chunks=chunks)
    if not fp8:
        return Sequential(dispatch, fc1, SwiGLU(), fc2, Unpermute(group=group))
    return Sequential(dispatch, Quantize("fp8_blockwise"), fc1, SwiGLU(), Quantize("fp8_blockwise"), Transpose(), fc2,
                      Unpermute(group=group))


def micro_batch_layer(fc1, fc2, experts: int, group, capacity_factor, x, indices, probs):
    """The static FP8 layer on copies of fc1 and fc2 whose weights are cast once per optimizer step
    (the copies are not shared: `cast_weights_once_per_step` holds a model's modules), as a
    contender; its ``weights`` attribute names the copies' weights for the gradient check, its
    ``optimizer_step`` what the optimizer step does to their casts. Not for recording runs
    (`compile_step_kernels` would leave unwritten casts behind): its kernels are fp8's."""
    own1, own2 = copy.deepcopy(fc1), copy.deepcopy(fc2)
    layer = library_layer(own1, own2, experts, group, capacity_factor, fp8=True)
    casts = cast_weights_once_per_step(torch.optim.SGD(layer.parameters(), lr=0.0), layer)

    def micro_batch():
        return layer(x, indices=indices, probs=probs)

    micro_batch.weights, micro_batch.optimizer_step = (own1.weight, own2.weight), casts.drop
    return micro_batch


def exchange_bytes(label: str, indices, experts: int, group, rows_per_rank: int, hidden: int) -> tuple:
    """(forward dispatch, all four exchanges): bytes this rank's all-to-alls send to other ranks in
    one step (forward + backward); ``rows_per_rank``: the library's rows per rank pair (all
    chunks). The FP8 dispatch sends E4M3 rows and their 1x128 float32 scales."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if label in ("torch", "lib"):  # exact sizes (the library's dropless layer too)
        to_rank = torch.bincount(indices.reshape(-1) // (experts // world), minlength=world)
        received = torch.empty_like(to_rank)
        dist.all_to_all_single(received, to_rank, group=group)
        sent, returned = int(to_rank.sum() - to_rank[rank]), int(received.sum() - received[rank])
        return 2 * hidden * sent, 2 * 2 * hidden * (sent + returned)
    rows = (world - 1) * rows_per_rank
    dispatch = rows * (hidden + hidden // 128 * 4) if label.startswith("fp8") else rows * 2 * hidden
    return dispatch, dispatch + 3 * rows * 2 * hidden


def step_time(fn, device, warm: int, iters: int) -> float:
    """Median ms of ``iters`` calls after ``warm`` (fixed counts: every rank runs the same
    collectives), per micro-batch of an `common.accumulation_step`."""
    for _ in range(warm):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - start))
        return per_micro_batch(fn, statistics.median(times))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return per_micro_batch(fn, statistics.median(b.elapsed_time(e) for b, e in events))


def profile(label: str, fn, rank: int) -> None:
    """torch.profiler over 3 steps of ``fn`` (every rank runs them; rank 0 prints): host ms per
    step and the kernels by GPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as run_profile

    def host_and_wall():  # ms per step: to the last launch, and to the GPU's end
        start = time.perf_counter()
        for _ in range(3):
            fn()
        host = (time.perf_counter() - start) * 1e3 / 3
        torch.cuda.synchronize()
        return host, (time.perf_counter() - start) * 1e3 / 3

    fn()
    torch.cuda.synchronize()
    plain_host, plain_wall = host_and_wall()
    if rank == 0:
        print(f"  {label} without the profiler: host {plain_host:.2f} ms/step, wall {plain_wall:.2f} ms/step", flush=True)
    with run_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        host_ms, wall_ms = host_and_wall()
    if rank == 0:
        print(f"  profile {label}: host {host_ms:.2f} ms/step (to the last launch), wall {wall_ms:.2f} ms/step",
              flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60), flush=True)


def rel_err(a, b, rows: int = 1 << 24) -> float:
    """Relative Frobenius error in float64, a chunk of ``rows`` elements at a time (a dsv3 expert
    weight's gradient is 7.5 GB in bf16, 30 GB in float64)."""
    a, b = a.reshape(-1), b.reshape(-1)
    diff = ref = 0.0
    for start in range(0, b.numel(), rows):
        x, y = a[start:start + rows].double(), b[start:start + rows].double()
        diff, ref = diff + (x - y).square().sum(), ref + y.square().sum()
    return (torch.as_tensor(diff).sqrt() / torch.as_tensor(ref).sqrt().clamp_min(1e-30)).item()


def run_shape(name, shape, device, group, args) -> dict:
    tokens, k, experts, hidden, ffn = shape
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local = experts // world
    dtype = torch.bfloat16
    indices, probs = skewed_topk(tokens, k, experts, seed=rank)
    indices = indices.to(device)
    torch.manual_seed(1 + rank)
    x = torch.randn(tokens, hidden, dtype=dtype, device=device).requires_grad_()
    probs = probs.to(device, dtype).requires_grad_()
    dy = torch.randn(tokens, hidden, dtype=dtype, device=device)
    fc1 = GroupedLinear(local, hidden, 2 * ffn, dtype=dtype, device=device)
    fc2 = GroupedLinear(local, ffn, hidden, dtype=dtype, device=device)
    math_fns = layer_math(device.type == "cuda")
    cf = no_drop_capacity_factor(indices, experts, group)
    capacity = math.ceil(cf * tokens * k / world)
    pair_rows = {"torch": 0, "lib": 0}  # the library's rows per rank pair and step (all chunks); exact: unused

    layers = {"torch": lambda: torch_ep_layer(x, indices, probs, fc1.weight, fc2.weight, experts, group, math_fns)}
    dropless = library_layer(fc1, fc2, experts, group, None)
    layers["lib"] = lambda: dropless(x, indices=indices, probs=probs)
    for label, chunks, fp8 in [("lib static", 1, False), *((f"lib x{n}", n, False) for n in args.chunks),
                               ("fp8", 1, True), *((f"fp8 x{n}", n, True) for n in args.chunks)]:
        if local % chunks:
            continue
        chunk_cf = no_drop_capacity_factor(indices, experts, group, chunks)
        pair_rows[label] = chunks * math.ceil(chunk_cf * tokens * k / (world * chunks))
        layer = library_layer(fc1, fc2, experts, group, chunk_cf, chunks, fp8)
        layers[label] = lambda layer=layer: layer(x, indices=indices, probs=probs)
        if label == "fp8":
            layers["fp8 4mb"], pair_rows["fp8 4mb"] = micro_batch_layer(fc1, fc2, experts, group, chunk_cf, x, indices,
                                                                        probs), pair_rows[label]
    if args.contenders:
        layers = {label: f for label, f in layers.items() if label == "torch" or label in args.contenders}
    def leaves(forward):  # a contender on its own expert copies names their weights
        return [x, probs, *getattr(forward, "weights", (fc1.weight, fc2.weight))]

    def step(forward):
        """What is timed: a graph's replay, the micro-batch, or for a contender with an
        ``optimizer_step`` the optimizer step of 4 micro-batches (timed per micro-batch)."""
        if getattr(forward, "graphed", False):
            return forward
        def run():
            for t in leaves(forward):
                t.grad = None
            forward().backward(dy)
        if hasattr(forward, "optimizer_step"):
            return accumulation_step(run, forward.optimizer_step, 4)
        return run

    def results(forward):
        if getattr(forward, "graphed", False):  # a replay leaves the output and gradients in static tensors
            return [t.clone() for t in forward()]
        step(forward)()
        got = [forward().detach()] + [t.grad.clone() for t in leaves(forward)]
        for t in leaves(forward):  # one set of gradients alive at a time (dsv3's are 10.5 GiB per rank)
            t.grad = None
        return got

    # the static-capacity contenders on the layer's own weights: precompiled, and graphed
    sync_free = [label for label in layers if label.startswith(("lib static", "lib x", "fp8")) and label != "fp8 4mb"]
    if args.precompile_jobs:  # the sync-free contenders' kernels compiled in forked workers first (before
        # a CUDA graph's warm-up runs would compile them one by one)
        from te_fused_ops import precompile

        for label in sync_free:
            report = precompile.compile_step_kernels(step(layers[label]), workers=args.precompile_jobs)
            if rank == 0:
                print(f"  {label:11s} precompiled: {report}", flush=True)
    if device.type == "cuda" and args.graphs:  # the sync-free contenders as one CUDA graph per step
        from te_fused_ops import CudaGraphStep

        def graph_step(forward):
            def run():
                for t in leaves(forward):
                    t.grad = None
                out = forward()
                out.backward(dy)
                return [out.detach()] + [t.grad for t in leaves(forward)]  # this graph's static output and gradients
            return run

        for label in sync_free:
            graphed = CudaGraphStep(graph_step(layers[label]))
            layers[f"{label} graph"] = graphed
            graphed.graphed = True
            pair_rows[f"{label} graph"] = pair_rows[label]
    want = results(layers["torch"])
    rows = {}
    for label, forward in layers.items():
        got = results(forward)
        errs = torch.tensor([rel_err(g, w) for g, w in zip(got, want)], dtype=torch.float64, device=device)
        dist.all_reduce(errs, op=dist.ReduceOp.MAX, group=group)
        tol = 1e-1 if label.startswith("fp8") else 2e-2
        ok = bool((errs <= tol).all())
        rows[label] = {"max_rel_err": errs.max().item(), "status": "ok" if ok else "mismatch",
                       **dict(zip(("dispatch_bytes", "bytes"),
                                  exchange_bytes(label, indices, experts, group, pair_rows[label], hidden)))}
        del got
        if rank == 0:
            print(f"  {label:11s} max rel err {errs.max().item():.2e} ({'ok' if ok else 'MISMATCH'})", flush=True)

    del want
    comm_rows = torch.randn(world * capacity, hidden, dtype=dtype, device=device)
    comm_out = torch.empty_like(comm_rows)

    def comm():
        for _ in range(4):
            dist.all_to_all_single(comm_out, comm_rows, group=group)

    for label in args.profile:
        if label in layers:
            profile(label, step(layers[label]), rank)
    timed = {label: step(f) for label, f in layers.items() if rows[label]["status"] == "ok"}
    timed["comm"] = comm
    samples = {label: [] for label in timed}
    labels = list(timed)
    for r in range(args.rounds):
        order = labels[r % len(labels):] + labels[:r % len(labels)]
        for label in order if r % 2 == 0 else order[::-1]:
            samples[label].append(step_time(timed[label], device, args.warm, args.iters))
    ms = torch.tensor([statistics.median(samples[label]) for label in labels], dtype=torch.float64, device=device)
    dist.all_reduce(ms, op=dist.ReduceOp.MAX, group=group)
    ms = dict(zip(labels, ms.tolist()))
    for label in rows:
        if label in ms:
            rows[label]["ms"] = ms[label]
            rows[label]["vs_torch"] = ms["torch"] / ms[label]
            if device.type == "cuda" and not label.endswith("graph"):  # a replay allocates nothing
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step(layers[label])()
                torch.cuda.synchronize()
                rows[label]["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    for label in rows:
        if label.startswith(("lib x", "fp8 x")) and label in ms:
            serial = ms[("lib static" if label.startswith("lib") else "fp8") + (" graph" if label.endswith("graph") else "")]
            rows[label]["hidden_share"] = (serial - ms[label]) / ms["comm"]
    return {"shape": name, "tokens": tokens, "k": k, "experts": experts, "hidden": hidden, "ffn": ffn,
            "world": world, "capacity_factor": cf, "comm_ms": ms["comm"], "contenders": rows}


def table(device_name: str, world: int, results: list) -> str:
    lines = [f"{world} x {device_name}, bf16 (fp8: fp8_blockwise), per rank; ms per step (max over ranks)", "",
             "| shape | contender | step ms | vs torch | exchange MB sent | dispatch MB sent | hidden share | peak MiB | "
             "max rel err |",
             "|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for label, row in res["contenders"].items():
            def cell(key, spec):
                return format(row[key], spec) if key in row else "-"
            lines.append(f"| {res['shape']} | {label} | {cell('ms', '.2f')} | {cell('vs_torch', '.2f')} | "
                         f"{row['bytes'] / 1e6:.0f} | {row['dispatch_bytes'] / 1e6:.0f} | {cell('hidden_share', '.0%')} | "
                         f"{cell('peak_mib', '.0f')} | "
                         f"{row['max_rel_err']:.1e} |")
        lines.append(f"| {res['shape']} | four exchanges alone (comm) | {res['comm_ms']:.2f} | | | | | | |")
    return "\n".join(lines)


def worker(rank: int, local_rank: int, world: int, args, init_method: str) -> None:
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world)
    try:
        group = dist.group.WORLD
        shapes = SMOKE if args.smoke else {name: SHAPES[name] for name in args.shapes.split(",")}
        results = []
        for name, shape in shapes.items():
            if rank == 0:
                print(f"{name}: tokens {shape[0]} per rank, k {shape[1]}, experts {shape[2]}, H {shape[3]}, "
                      f"I {shape[4]}", flush=True)
            results.append(run_shape(name, shape, device, group, args))
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        text = table(name, world, results)
        if rank == 0:
            out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
            tag = device_tag(name) if device.type == "cuda" else "cpu"
            if args.smoke:
                out = os.path.join(out, "runs")
            write_results(out, f"ep_layer_{tag}x{world}{'_smoke' if args.smoke else ''}",
                          {"device": name, "world": world, "results": results}, text)
            print(text, flush=True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--chunks", default="2,4", help="chunk counts of the overlapped contenders")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warm", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="a tiny shape (2 gloo processes on the CPU)")
    parser.add_argument("--nproc", type=int, default=2, help="processes to spawn (ignored under torchrun)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-graphs", dest="graphs", action="store_false",
                        help="leave out the CUDA-graph contenders (the sync-free ones captured as one graph per step)")
    parser.add_argument("--profile", default="", help="contenders to profile (comma-separated labels)")
    parser.add_argument("--contenders", default="", help="only these (comma-separated labels; torch always runs)")
    parser.add_argument("--precompile-jobs", type=int, default=0,
                        help="compile the static-capacity contenders' kernels in this many forked processes per rank "
                             "before the first step (`precompile.compile_step_kernels`; 0: each kernel compiles at "
                             "its first launch)")
    args = parser.parse_args(argv)
    args.chunks = [int(n) for n in args.chunks.split(",") if n]
    args.profile = [label for label in args.profile.split(",") if label]
    args.contenders = [label for label in args.contenders.split(",") if label]
    if args.smoke:
        args.rounds, args.warm, args.iters = 2, 1, 2
    return args


def spawned(rank: int, args, init_method: str) -> None:
    """One spawned rank; a rank that finished leaves through ``os._exit(0)``: the interpreter's C++
    teardown after gloo can abort a finished process ("terminate called without an active
    exception"), failing a run whose results are written (as `tests/spawn.py` does for the tests)."""
    worker(rank, rank, args.nproc, args, init_method)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main(argv=None) -> None:
    args = parse_args(argv)
    if "RANK" in os.environ:
        worker(int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
        return
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(spawned, args=(args, f"file://{tmp}/init"), nprocs=args.nproc, join=True)


if __name__ == "__main__":
    main()
