"""Grouped MoE MLP: Sequential(GroupedLinear, SwiGLU, GroupedLinear), fused vs unfused.

For each shape (rows M, hidden H, expert width I, local experts E) with uneven routing it times
each iteration's training step: gradients set to None, forward, backward (CUDA events on the GPU,
perf_counter on the CPU). Columns (JSON keys in brackets):
  fwd ms, bwd ms     median forward / backward time over the iterations [fwd_ms, bwd_ms]
  step ms            median of the whole step: gradients set to None, forward, backward [step_ms]
  step min..max ms   the spread of the step over the iterations [step_ms_min, step_ms_max]
                     (the JSON has fwd_ms_min/max and bwd_ms_min/max too)
  fwd/bwd/step <unit>  throughput from the medians; forward FLOPs 6*M*H*I, backward 2x, step 3x;
                     <unit> GFLOP/s on the CPU [fwd_GFLOPS, ...], TFLOP/s on CUDA [fwd_TFLOPS, ...]
  saved MiB          bytes autograd keeps for the backward [saved_MiB]
  peak MiB           peak memory of one step above what was allocated before it, CUDA only [peak_MiB]
Prints a progress line per shape, then the table; writes
benchmarks/results/runs/grouped_mlp_<device>_<date>.json (<device> cpu, h100, h200 or cuda; <date>
YYYYMMDD-HHMMSS) and a bar chart .png beside it (if matplotlib). The committed reference results
in benchmarks/results/ are never overwritten.

    python benchmarks/bench_grouped_mlp.py          # CUDA if present (full shapes), else CPU (small shapes)
    python benchmarks/bench_grouped_mlp.py --full   # the full shapes on a CPU too (many minutes, ~9 GB)
    python benchmarks/bench_grouped_mlp.py --small  # the small shapes on a GPU
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time
from datetime import datetime

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from te_fused_ops import GroupedLinear, Sequential, SwiGLU  # noqa: E402
from te_fused_ops.runner import saved_tensor_bytes  # noqa: E402

SHAPES = {
    "qwen3-30b-a3b": (65536, 2048, 768, 128),
    "dsv3-ep8": (32768, 7168, 2048, 32),
    "mixtral-8x7b": (32768, 4096, 14336, 8),
    "gptoss-120b-ep4": (32768, 2880, 2880, 32),
}
SMALL_SHAPES = {
    "small-a": (512, 256, 128, 8),
    "small-b": (1024, 512, 256, 4),
}
RUNS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "runs")  # git-ignored
PROGRESS_AFTER_S = 3.0  # a shape running longer than this prints a dot per iteration


def uneven_splits(rows: int, groups: int, seed: int = 0) -> torch.Tensor:
    """Skewed routing (log-normal expert popularity, some experts empty when E is large), sum = rows."""
    gen = torch.Generator().manual_seed(seed)
    popularity = torch.exp(torch.randn(groups, generator=gen) * 1.0)
    sizes = (popularity / popularity.sum() * rows).floor().to(torch.int64)
    sizes[torch.argmax(popularity)] += rows - sizes.sum()
    return sizes


class Timer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def ms(self, start, stop) -> float:
        if self.cuda:
            stop.synchronize()
            return start.elapsed_time(stop)
        return (stop - start) * 1e3


def spread(prefix: str, samples: list) -> dict:
    """{prefix: median, prefix_min: min, prefix_max: max} of ``samples``."""
    return {prefix: statistics.median(samples), f"{prefix}_min": min(samples), f"{prefix}_max": max(samples)}


def bench_one(seq, inputs, dy, split_sizes, iters: int, warmup: int, device, started: float):
    """Times ``iters`` training steps after ``warmup``: each step sets the gradients to None, then
    runs forward and backward; the step is timed whole and in its forward and backward parts."""
    timer = Timer(device)
    fwd, bwd, step = [], [], []
    for it in range(warmup + iters):
        if time.perf_counter() - started > PROGRESS_AFTER_S:
            print(".", end="", flush=True)
        x = inputs[it % len(inputs)]
        t0 = timer.mark()
        for p in seq.parameters():
            p.grad = None
        x.grad = None
        t1 = timer.mark()
        y = seq(x, split_sizes=split_sizes)
        t2 = timer.mark()
        y.backward(dy)
        t3 = timer.mark()
        if it >= warmup:
            fwd.append(timer.ms(t1, t2))
            bwd.append(timer.ms(t2, t3))
            step.append(timer.ms(t0, t3))
    saved = saved_tensor_bytes(seq(inputs[0], split_sizes=split_sizes))
    peak = None
    if device.type == "cuda":
        for p in seq.parameters():
            p.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        seq(inputs[0], split_sizes=split_sizes).backward(dy)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    return {
        **spread("fwd_ms", fwd),
        **spread("bwd_ms", bwd),
        **spread("step_ms", step),
        "saved_MiB": saved / 2**20,
        "peak_MiB": None if peak is None else peak / 2**20,
    }


def throughput_unit(device: torch.device):
    """(console unit, JSON key suffix, FLOP per ms in one unit): GFLOP/s on the CPU, TFLOP/s on CUDA."""
    return ("TFLOP/s", "TFLOPS", 1e9) if device.type == "cuda" else ("GFLOP/s", "GFLOPS", 1e6)


def run(shapes: dict, device: torch.device, dtype: torch.dtype, iters: int, warmup: int):
    _, key, flop_per_ms = throughput_unit(device)
    rows_out = []
    for n, (name, (rows, hidden, width, experts)) in enumerate(shapes.items(), 1):
        started = time.perf_counter()
        print(f"[{n}/{len(shapes)}] {name} (M={rows}, H={hidden}, I={width}, E={experts}):", end="", flush=True)
        torch.manual_seed(0)
        fused = Sequential(
            GroupedLinear(experts, hidden, 2 * width, dtype=dtype, device=device),
            SwiGLU(),
            GroupedLinear(experts, width, hidden, dtype=dtype, device=device),
        )
        unfused = Sequential(*list(fused), fuse=False)
        split_sizes = uneven_splits(rows, experts).to(device)
        # rotate inputs so that repeated calls do not run out of L2 (>= 64 MB of inputs in all)
        copies = max(1, min(4, (64 << 20) // (rows * hidden * dtype.itemsize) + 1))
        inputs = [torch.randn(rows, hidden, device=device, dtype=dtype, requires_grad=True) for _ in range(copies)]
        dy = torch.randn(rows, hidden, device=device, dtype=dtype)
        flops_fwd = 6.0 * rows * hidden * width  # FC1 (N = 2I) + FC2
        plan = fused.explain(inputs[0], split_sizes=split_sizes)
        for mode, seq in (("fused", fused), ("unfused", unfused)):
            result = bench_one(seq, inputs, dy, split_sizes, iters, warmup, device, started)
            print(f" {mode} step {result['step_ms']:.3f} ms", end="", flush=True)
            result.update(
                shape=name,
                mode=mode,
                M=rows,
                H=hidden,
                I=width,
                E=experts,
                **{f"fwd_{key}": flops_fwd / result["fwd_ms"] / flop_per_ms,
                   f"bwd_{key}": 2 * flops_fwd / result["bwd_ms"] / flop_per_ms,
                   f"step_{key}": 3 * flops_fwd / result["step_ms"] / flop_per_ms},
            )
            rows_out.append(result)
        rows_out[-2]["plan"] = plan
        print(f" ({time.perf_counter() - started:.1f} s)", flush=True)
        del fused, unfused, inputs, dy
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows_out


def table(results, unit: str) -> str:
    """Fixed-width columns, two spaces apart; throughput in ``unit``, "GFLOP/s" (CPU) or "TFLOP/s"
    (CUDA), read from the JSON keys of that unit (fwd_GFLOPS, ...)."""
    key = unit.replace("/s", "S")
    columns = [
        ("shape", 17, lambda r: r["shape"]),
        ("mode", 7, lambda r: r["mode"]),
        ("fwd ms", 10, lambda r: f"{r['fwd_ms']:.3f}"),
        ("bwd ms", 10, lambda r: f"{r['bwd_ms']:.3f}"),
        ("step ms", 10, lambda r: f"{r['step_ms']:.3f}"),
        ("step min..max ms", 21, lambda r: f"{r['step_ms_min']:.3f}..{r['step_ms_max']:.3f}"),
        (f"fwd {unit}", 12, lambda r: f"{r[f'fwd_{key}']:.1f}"),
        (f"bwd {unit}", 12, lambda r: f"{r[f'bwd_{key}']:.1f}"),
        (f"step {unit}", 13, lambda r: f"{r[f'step_{key}']:.1f}"),
        ("saved MiB", 10, lambda r: f"{r['saved_MiB']:.1f}"),
        ("peak MiB", 9, lambda r: "-" if r["peak_MiB"] is None else f"{r['peak_MiB']:.0f}"),
    ]

    def line(cells):
        return "  ".join(f"{c:<{w}}" if i < 2 else f"{c:>{w}}" for i, (c, (_, w, _)) in enumerate(zip(cells, columns)))

    header = line([title for title, _, _ in columns])
    return "\n".join([header, "-" * len(header)] + [line([fmt(r) for _, _, fmt in columns]) for r in results])


def chart(results, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    titles = ("forward", "backward", "step: grads None, fwd, bwd")
    for ax, key, title in zip(axes, ("fwd_ms", "bwd_ms", "step_ms"), titles):
        for k, mode in enumerate(("unfused", "fused")):
            rows = [next(r for r in results if r["shape"] == s and r["mode"] == mode) for s in shapes]
            values = [r[key] for r in rows]
            error = [[r[key] - r[f"{key}_min"] for r in rows], [r[f"{key}_max"] - r[key] for r in rows]]
            ax.bar([i + 0.4 * k for i in range(len(shapes))], values, width=0.4, yerr=error, capsize=2, label=mode)
        ax.set_xticks([i + 0.2 for i in range(len(shapes))], shapes, rotation=20, fontsize=7)
        ax.set_title(f"{title} (median ms, bars min..max)", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help="small shapes (the default on a CPU: seconds)")
    size.add_argument("--full", action="store_true", help="the model shapes (the default on CUDA)")
    parser.add_argument("--shapes", nargs="*", help="subset of shape names")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=RUNS, help="folder for the JSON and PNG (default: %(default)s)")
    args = parser.parse_args()

    device = torch.device(args.device)
    small = args.small or (device.type == "cpu" and not args.full)
    shapes = SMALL_SHAPES if small else SHAPES
    if args.shapes:
        unknown = sorted(set(args.shapes) - set(shapes))
        if unknown:
            parser.error(f"unknown shape(s) {', '.join(unknown)}; choose from {', '.join(shapes)}")
        shapes = {name: shapes[name] for name in args.shapes}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters = args.iters or (20 if device.type == "cuda" else 5)
    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device: {label}, dtype {dtype}, {'small' if small else 'full'} shapes, "
          f"median (and min..max) of {iters} iterations after {args.warmup} warm-up; "
          f"step = gradients set to None, forward, backward")
    results = run(shapes, device, dtype, iters, args.warmup)

    tag = next((w.lower() for w in label.split() if w[:1] == "H" and w[1:].isdigit()), "cuda") if device.type == "cuda" else "cpu"
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"grouped_mlp_{tag}_{datetime.now():%Y%m%d-%H%M%S}")
    unit = throughput_unit(device)[0]
    with open(stem + ".json", "w") as f:
        json.dump({"device": label, "dtype": str(dtype), "torch": torch.__version__,
                   "shapes": "small" if small else "full", "iterations": iters, "warmup": args.warmup,
                   "step": "gradients set to None, forward, backward", "throughput_unit": unit,
                   "results": results}, f, indent=1)
    drew = chart(results, stem + ".png")
    print()
    print(next(r["plan"] for r in results if "plan" in r))
    print()
    print(table(results, unit))
    print(f"\nwrote {stem}.json" + (f" and {stem}.png" if drew else " (matplotlib missing: no chart)"))


if __name__ == "__main__":
    main()
