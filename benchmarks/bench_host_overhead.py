"""Host (CPU) overhead of a grouped-MLP training step on CUDA: te_fused_ops vs plain torch, eager and
replayed as one CUDA graph.

Per shape (bf16, SwiGLU, routing counts multiples of 8, gradients set to None first):
  reference   plain torch: 2 x torch._grouped_mm + compiled SwiGLU, autograd's own backward
  fused       te_fused_ops Sequential(GroupedLinear, SwiGLU, GroupedLinear)
  fused graph the fused step captured once (te_fused_ops.CudaGraphStep) and replayed, with new
              routing copied into the static split_sizes tensor before each replay
Columns: host time to issue one step (median over steps, synchronized between steps so the
launch queue never fills), wall time per step (N steps back to back, synchronized at the end).

    python benchmarks/bench_host_overhead.py [--shapes small,qwen3-30b-a3b] [--steps 200] [--out DIR]
    python benchmarks/bench_host_overhead.py --pyprofile      # cProfile of the fused small step
"""

import argparse
import cProfile
import pstats
import statistics
import time

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import MODEL_SHAPES, compile_per_shape, device_tag, host_us_per_call, skewed_splits, write_results

import te_fused_ops as tfo
from te_fused_ops import GroupedLinear, Sequential, SwiGLU

SHAPES = {"small": (2048, 1024, 512, 8), "qwen3-30b-a3b": MODEL_SHAPES["qwen3-30b-a3b"]}  # (M, H, I, E)


def routing(m, e, seed):
    return skewed_splits(m, e, seed, align=8).cuda()


@compile_per_shape
def swiglu(pre):
    gate, up = pre.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def setup(name):
    m, h, i, e = SHAPES[name]
    torch.manual_seed(0)
    mlp = Sequential(
        GroupedLinear(e, h, 2 * i, dtype=torch.bfloat16, device="cuda"),
        SwiGLU(),
        GroupedLinear(e, i, h, dtype=torch.bfloat16, device="cuda"),
    )
    x = torch.randn(m, h, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    return mlp, x, dy, routing(m, e, 0)


def steps(mlp, x, dy, splits):
    """name -> (step callable, callable run before each step)."""
    w1, w2 = mlp[0].weight, mlp[2].weight
    leaves = [x, w1, w2]
    offsets = torch.zeros(splits.shape[0] + 1, dtype=torch.int32, device="cuda")
    routings = [routing(x.shape[0], splits.shape[0], seed) for seed in range(4)]

    def clear():
        for t in leaves:
            t.grad = None

    def reference():
        clear()
        torch.cumsum(splits, 0, out=offsets[1:])
        ends = offsets[1:]
        y = torch._grouped_mm(swiglu(torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends)), w2.transpose(-2, -1), offs=ends)
        y.backward(dy)

    def fused():
        clear()
        mlp(x, split_sizes=splits).backward(dy)

    graphed = tfo.CudaGraphStep(fused)
    counter = [0]

    def new_routing():  # what a training loop does before replaying: fresh routing, same tensor
        counter[0] += 1
        splits.copy_(routings[counter[0] % len(routings)])

    return {"reference": (reference, new_routing), "fused": (fused, new_routing), "fused graph": (graphed, new_routing)}


def measure(step, before, n):
    for _ in range(5):
        before()
        step()
    torch.cuda.synchronize()
    host = []
    for _ in range(n):
        before()
        t = time.perf_counter()
        step()
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        before()
        step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t) / n
    return {"host_us": statistics.median(host) * 1e6, "wall_us": wall * 1e6}


def wrapper_calls(rounds):
    """Host us per call of each sm90 kernel wrapper (checks + launch) on a tiny problem, allocating
    its outputs and into preallocated ones, next to one torch launch (this machine's unit) and
    the FC1 kernel's compiled entry alone; median over ``rounds`` interleaved rounds."""
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import _forward_launch, grouped_dgrad_dact_sm90, grouped_gemm_sm90
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_sm90

    x = torch.randn(128, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(2, 128, 64, dtype=torch.bfloat16, device="cuda")
    w2 = torch.randn(2, 64, 64, dtype=torch.bfloat16, device="cuda")
    off = torch.tensor([0, 64, 128], dtype=torch.int32, device="cuda")
    pre, act = grouped_gemm_sm90(x, w, off, activation="swiglu")
    dx = torch.empty_like(x)
    dw = torch.empty(2, 64, 64, dtype=torch.bfloat16, device="cuda")
    d_pre, act_x, _ = grouped_dgrad_dact_sm90(x, w2, off, pre, activation="swiglu")
    sum_out = torch.empty_like(x)
    # the FC1 kernel's compiled entry alone (TVM-FFI: argument conversion and checks in C, launch)
    fc1 = _forward_launch(x, w, off, None, "swiglu", None, pre, act, "nk", None, None, None)
    calls = {
        "torch.add(out=), one launch": lambda: torch.add(x, x, out=sum_out),
        "FC1 kernel entry alone (no wrapper)": lambda: fc1[0](x, w, off, pre, act, None, None, None, 7.0, 1.702, fc1[3]),
        "FC1 fwd + SwiGLU": lambda: grouped_gemm_sm90(x, w, off, activation="swiglu"),
        "FC1 fwd + SwiGLU, preallocated": lambda: grouped_gemm_sm90(x, w, off, activation="swiglu", out=pre, act_out=act),
        "dgrad (W in place), preallocated": lambda: grouped_gemm_sm90(x, w2, off, weight_layout="kn", out=dx),
        "dgrad + dSwiGLU": lambda: grouped_dgrad_dact_sm90(x, w2, off, pre, activation="swiglu"),
        "dgrad + dSwiGLU, preallocated": lambda: grouped_dgrad_dact_sm90(
            x, w2, off, pre, activation="swiglu", out=d_pre, act_out=act_x
        ),
        "wgrad, preallocated": lambda: grouped_wgrad_sm90(x, x, off, out=dw),
    }
    runs = {name: [] for name in calls}
    for _ in range(rounds):  # interleaved: a slow moment of the host hits every row
        for name, fn in calls.items():
            runs[name].append(host_us_per_call(fn))
    return {name: statistics.median(us) for name, us in runs.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved repeats; medians reported")
    ap.add_argument("--out", default=None)
    ap.add_argument("--pyprofile", action="store_true")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    if args.pyprofile:
        mlp, x, dy, splits = setup("small")
        fused, before = steps(mlp, x, dy, splits)["fused"]
        measure(fused, before, 5)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(100):
            fused()
        prof.disable()
        torch.cuda.synchronize()
        pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        return
    calls = wrapper_calls(args.rounds)
    for name, us in calls.items():
        print(f"  wrapper {name:20s} {us:6.1f} us per call (checks + launch)", flush=True)
    rows = []
    for name in args.shapes.split(","):
        print(f"[{name}] M, H, I, E = {SHAPES[name]} ...", flush=True)
        mlp, x, dy, splits = setup(name)
        row = {"shape": name}
        steps_of = steps(mlp, x, dy, splits)
        runs = {}
        for _ in range(args.rounds):  # interleaved, so drift of the machine hits every variant
            for label, (step, before) in steps_of.items():
                runs.setdefault(label, []).append(measure(step, before, args.steps))
        for label, results in runs.items():
            row[label] = {key: statistics.median(r[key] for r in results) for key in results[0]}
            print(f"  {label:12s} host {row[label]['host_us']:8.0f} us   wall {row[label]['wall_us']:8.0f} us", flush=True)
        row["host_ratio_per_round"] = [
            f["host_us"] / r["host_us"] for f, r in zip(runs["fused"], runs["reference"])
        ]
        rows.append(row)
        del mlp, x, dy
        torch.cuda.empty_cache()
    lines = [
        f"Host overhead of a training step, bf16 SwiGLU grouped MLP, {device}; us per step",
        "",
        "| shape | host: reference / fused / graph | wall: reference / fused / graph | fused host vs reference (median; per round) |",
        "|---|---|---|---|",
    ]
    for r in rows:
        ref, fused, graph = r["reference"], r["fused"], r["fused graph"]
        per_round = ", ".join(f"{v:.2f}" for v in r["host_ratio_per_round"])
        lines.append(
            f"| {r['shape']} | {ref['host_us']:.0f} / {fused['host_us']:.0f} / {graph['host_us']:.0f} | "
            f"{ref['wall_us']:.0f} / {fused['wall_us']:.0f} / {graph['wall_us']:.0f} | "
            f"{statistics.median(r['host_ratio_per_round']):.2f}x ({per_round}) |"
        )
    unit = calls["torch.add(out=), one launch"]
    lines += ["", "| call | host us per call | vs one torch launch |", "|---|---|---|"]
    lines += [f"| {name} | {us:.1f} | {us / unit:.2f}x |" for name, us in calls.items()]
    table = "\n".join(lines)
    print(table)
    if args.out:
        payload = {"device": device, "results": rows, "wrapper_us": calls}
        write_results(args.out, f"host_overhead_{device_tag(device)}", payload, table)

if __name__ == "__main__":
    main()
