"""Grouped MoE MLP: Sequential(GroupedLinear, SwiGLU, GroupedLinear), fused vs unfused.

For each shape (rows M, hidden H, expert width I, local experts E) with uneven routing it times
forward, backward and forward+backward (median over iterations, after warm-up; CUDA events on
the GPU), and reports TFLOPS, peak memory (CUDA) and the bytes kept for backward. Prints a
table, writes benchmarks/results/grouped_mlp_<device>.json and a bar chart PNG (if matplotlib).

    python benchmarks/bench_grouped_mlp.py            # default device: CUDA if present, else CPU
    python benchmarks/bench_grouped_mlp.py --small    # seconds on a CPU
"""

import argparse
import gc
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from te_fused_ops import GroupedLinear, Sequential, SwiGLU  # noqa: E402
from te_fused_ops.sequential import saved_tensor_bytes  # noqa: E402

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
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


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


def bench_one(seq, inputs, dy, split_sizes, iters: int, warmup: int, device):
    timer = Timer(device)
    fwd, bwd, total = [], [], []
    for it in range(warmup + iters):
        x = inputs[it % len(inputs)]
        for p in seq.parameters():
            p.grad = None
        x.grad = None
        t0 = timer.mark()
        y = seq(x, split_sizes=split_sizes)
        t1 = timer.mark()
        y.backward(dy)
        t2 = timer.mark()
        if it >= warmup:
            fwd.append(timer.ms(t0, t1))
            bwd.append(timer.ms(t1, t2))
            total.append(timer.ms(t0, t2))
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
        "forward_ms": statistics.median(fwd),
        "backward_ms": statistics.median(bwd),
        "fwd_bwd_ms": statistics.median(total),
        "saved_for_backward_MiB": saved / 2**20,
        "peak_fwd_bwd_MiB": None if peak is None else peak / 2**20,
    }


def run(shapes: dict, device: torch.device, dtype: torch.dtype, iters: int, warmup: int):
    rows_out = []
    for name, (rows, hidden, width, experts) in shapes.items():
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
            result = bench_one(seq, inputs, dy, split_sizes, iters, warmup, device)
            result.update(
                shape=name,
                mode=mode,
                M=rows,
                H=hidden,
                I=width,
                E=experts,
                fwd_TFLOPS=flops_fwd / result["forward_ms"] / 1e9,
                bwd_TFLOPS=2 * flops_fwd / result["backward_ms"] / 1e9,
                fwd_bwd_TFLOPS=3 * flops_fwd / result["fwd_bwd_ms"] / 1e9,
            )
            rows_out.append(result)
        rows_out[-2]["plan"] = plan
        del fused, unfused, inputs, dy
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows_out


def table(results) -> str:
    header = (
        f"{'shape':<17}{'mode':<9}{'fwd ms':>9}{'bwd ms':>9}{'f+b ms':>9}"
        f"{'fwd TF':>8}{'bwd TF':>8}{'f+b TF':>8}{'saved MiB':>11}{'peak MiB':>10}"
    )
    lines = [header, "-" * len(header)]
    for r in results:
        peak = "-" if r["peak_fwd_bwd_MiB"] is None else f"{r['peak_fwd_bwd_MiB']:.0f}"
        lines.append(
            f"{r['shape']:<17}{r['mode']:<9}{r['forward_ms']:>9.3f}{r['backward_ms']:>9.3f}{r['fwd_bwd_ms']:>9.3f}"
            f"{r['fwd_TFLOPS']:>8.2f}{r['bwd_TFLOPS']:>8.2f}{r['fwd_bwd_TFLOPS']:>8.2f}"
            f"{r['saved_for_backward_MiB']:>11.1f}{peak:>10}"
        )
    return "\n".join(lines)


def chart(results, path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    shapes = list(dict.fromkeys(r["shape"] for r in results))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for ax, key, title in zip(axes, ("forward_ms", "backward_ms", "fwd_bwd_ms"), ("forward", "backward", "fwd+bwd")):
        for k, mode in enumerate(("unfused", "fused")):
            values = [next(r[key] for r in results if r["shape"] == s and r["mode"] == mode) for s in shapes]
            ax.bar([i + 0.4 * k for i in range(len(shapes))], values, width=0.4, label=mode)
        ax.set_xticks([i + 0.2 for i in range(len(shapes))], shapes, rotation=20, fontsize=7)
        ax.set_title(f"{title} (ms, lower is better)", fontsize=9)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="small shapes that run in seconds on a CPU")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--shapes", nargs="*", help="subset of shape names")
    parser.add_argument("--iters", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--out", default=RESULTS, help="folder for the JSON and PNG")
    args = parser.parse_args()

    device = torch.device(args.device)
    shapes = SMALL_SHAPES if args.small else SHAPES
    if args.shapes:
        shapes = {name: shapes[name] for name in args.shapes}
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters = args.iters or (20 if device.type == "cuda" else 5)
    results = run(shapes, device, dtype, iters, args.warmup)

    label = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    tag = next((w.lower() for w in label.split() if w[:1] == "H" and w[1:].isdigit()), "cuda") if device.type == "cuda" else "cpu"
    tag += "_small" if args.small else ""
    os.makedirs(args.out, exist_ok=True)
    json_path = os.path.join(args.out, f"grouped_mlp_{tag}.json")
    with open(json_path, "w") as f:
        json.dump({"device": label, "dtype": str(dtype), "torch": torch.__version__, "results": results}, f, indent=1)
    png_path = os.path.join(args.out, f"grouped_mlp_{tag}.png")
    drew = chart(results, png_path)
    print(next(r["plan"] for r in results if "plan" in r))
    print(f"\ndevice: {label}, dtype {dtype}, median of {iters} iterations after {args.warmup} warm-up")
    print(table(results))
    print(f"\nwrote {json_path}" + (f" and {png_path}" if drew else " (matplotlib missing: no chart)"))


if __name__ == "__main__":
    main()
