"""Whole training step of a grouped MLP on Hopper: te_fused_ops vs the plain-torch reference.

Per shape (rows M, hidden H, expert width I, local experts E; bf16, SwiGLU, routing counts
multiples of 8 so that torch._grouped_mm accepts them, the same splits for every variant):
  fused      te_fused_ops Sequential(GroupedLinear, SwiGLU, GroupedLinear), fusion on
  unfused    the same with fuse=False (torch path: _grouped_mm + compiled activation per op)
  reference  plain torch a user could write: one autograd.Function, six torch._grouped_mm calls,
             a torch.compile'd SwiGLU and dSwiGLU (saves x, pre and the activation output)
Rows: forward, backward (retained graph, gradients set to None first), step (forward + backward,
gradients set to None first), step TFLOPS (3 x forward FLOPs / step time), peak memory of the
step above the inputs and weights; then per-kernel rows of the fused backward against their
torch counterparts. Every time is `common.sustained_ms` (per-call median at the clock a long run
settles at under the power cap, L2 flushed before every call), the median over the variants
timed in rotated order (`common.rotated_medians`).
Gradients of fused and reference are checked against each other (rel. Frobenius <= 1e-2) first.

    python benchmarks/bench_train_step.py [--shapes qwen3-30b-a3b,...] [--out DIR] [--profile]
    python benchmarks/bench_train_step.py --sweep          # each kernel per tile config
    ncu --profile-from-start off --clock-control none python benchmarks/bench_train_step.py \
        --ncu --shapes qwen3-30b-a3b                      # each kernel once, for ncu
"""

import argparse

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import (
    MODEL_SHAPES, compile_per_shape, device_tag, gpu_us_per_kernel, kernel_timeline, model_shape, print_timeline,
    rotated_medians, skewed_splits, sustained_ms, write_results,
)

from te_fused_ops import GroupedLinear, Sequential, SwiGLU

SHAPES = MODEL_SHAPES


@compile_per_shape
def swiglu(pre):
    gate, up = pre.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(pre.dtype)


@compile_per_shape
def dswiglu(pre, d_act):
    gate, up = pre.float().chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    d = d_act.float()
    return torch.cat([d * up * s * (1 + gate * (1 - s)), d * gate * s], dim=-1).to(pre.dtype)


class ReferenceMLP(torch.autograd.Function):
    """Plain torch: y = (swiglu(x @ W1[g].T)) @ W2[g].T per group; ends = group ends (int32)."""

    @staticmethod
    def forward(ctx, x, w1, w2, ends):
        pre = torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends)
        act = swiglu(pre)
        ctx.save_for_backward(x, w1, w2, ends, pre, act)
        return torch._grouped_mm(act, w2.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, ends, pre, act = ctx.saved_tensors
        dy = dy.contiguous()
        d_act = torch._grouped_mm(dy, w2, offs=ends)
        dw2 = torch._grouped_mm(dy.t(), act, offs=ends)
        d_pre = dswiglu(pre, d_act)
        dx = torch._grouped_mm(d_pre, w1, offs=ends)
        dw1 = torch._grouped_mm(d_pre.t(), x, offs=ends)
        return dx, dw1, dw2, None


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def problem(name):
    m, h, i, e = model_shape(name)
    torch.manual_seed(0)
    splits = skewed_splits(m, e, align=8).cuda()
    offsets = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(splits, 0)
    mlp = Sequential(
        GroupedLinear(e, h, 2 * i, dtype=torch.bfloat16, device="cuda"),
        SwiGLU(),
        GroupedLinear(e, i, h, dtype=torch.bfloat16, device="cuda"),
    )
    x = torch.randn(m, h, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    return mlp, splits, offsets, x, dy


def variants(mlp, splits, offsets, x):
    unfused = Sequential(*mlp, fuse=False)
    w1, w2 = mlp[0].weight, mlp[2].weight
    return {
        "fused": (lambda: mlp(x, split_sizes=splits), [x, w1, w2]),
        "unfused": (lambda: unfused(x, split_sizes=splits), [x, w1, w2]),
        "reference": (lambda: ReferenceMLP.apply(x, w1, w2, offsets[1:]), [x, w1, w2]),
    }


def time_variants(runs, dy):
    """label -> {fwd_ms, bwd_ms, step_ms, peak_mib} for each (forward, leaves) of ``runs``. Forward,
    backward (one retained graph per variant, replayed) and step are each timed over all variants
    in rotated order (`common.rotated_medians`), so no variant gains from its place in the run."""
    def clear(leaves):
        for t in leaves:
            t.grad = None

    steps, backwards, graphs = {}, {}, {}
    for label, (forward, leaves) in runs.items():
        def step(forward=forward, leaves=leaves):
            clear(leaves)
            forward().backward(dy)

        def backward(label=label, leaves=leaves):
            clear(leaves)
            graphs[label].backward(dy, retain_graph=True)

        step()
        steps[label], backwards[label] = step, backward
        graphs[label] = forward()
    fwd = rotated_medians({label: forward for label, (forward, _) in runs.items()}, sustained_ms)
    bwd = rotated_medians(backwards, sustained_ms)
    graphs.clear()
    peaks = {}
    for label, (_, leaves) in runs.items():
        clear(leaves)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        steps[label]()
        peaks[label] = (torch.cuda.max_memory_allocated() - base) / 2**20
        clear(leaves)
    step_ms = rotated_medians(steps, sustained_ms)
    return {
        label: {"fwd_ms": fwd[label], "bwd_ms": bwd[label], "step_ms": step_ms[label], "peak_mib": peaks[label]}
        for label in runs
    }


def step_rows(runs, dy, m, h, i, width=9) -> dict:
    """label -> `time_variants`' row plus step TFLOPS (3 x the forward's), each printed."""
    flops = 2 * m * h * 2 * i + 2 * m * i * h  # forward
    rows = time_variants(runs, dy)
    for label, r in rows.items():
        r["step_tflops"] = 3 * flops / (r["step_ms"] * 1e-3) / 1e12
        print(f"  {label:{width}s} fwd {r['fwd_ms']:8.3f} ms  bwd {r['bwd_ms']:8.3f} ms  step {r['step_ms']:8.3f} ms"
              f"  {r['step_tflops']:6.0f} TFLOPS  peak {r['peak_mib']:8.0f} MiB", flush=True)
    return rows


def kernel_rows(mlp, offsets, x, dy):
    """Per-kernel times of the fused backward vs the torch kernels doing the same work."""
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_dgrad_dact_sm90, grouped_gemm_sm90
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_sm90

    ends = offsets[1:]
    w1, w2 = mlp[0].weight.detach(), mlp[2].weight.detach()
    pre = torch._grouped_mm(x.detach(), w1.transpose(-2, -1), offs=ends)
    act = swiglu(pre)
    d_pre = dswiglu(pre, torch._grouped_mm(dy, w2, offs=ends))
    rows = {
        "FC2 dgrad + dSwiGLU (+ act)": (
            lambda: grouped_dgrad_dact_sm90(dy, w2, offsets, pre, activation="swiglu"),
            lambda: dswiglu(pre, torch._grouped_mm(dy, w2, offs=ends)),
        ),
        "FC2 wgrad": (
            lambda: grouped_wgrad_sm90(dy, act, offsets),
            lambda: torch._grouped_mm(dy.t(), act, offs=ends),
        ),
        "FC1 dgrad": (
            lambda: grouped_gemm_sm90(d_pre, w1, offsets, weight_layout="kn"),
            lambda: torch._grouped_mm(d_pre, w1, offs=ends),
        ),
        "FC1 wgrad": (
            lambda: grouped_wgrad_sm90(d_pre, x.detach(), offsets),
            lambda: torch._grouped_mm(d_pre.t(), x.detach(), offs=ends),
        ),
    }
    return {
        name: rotated_medians({"ours_us": ours, "torch_us": theirs}, lambda fn: sustained_ms(fn) * 1e3)
        for name, (ours, theirs) in rows.items()
    }


def configs(pingpong: bool = False):
    """The `tuning.LaunchConfig`s tried by --sweep and `sweep_configs.py`: the autotuner's
    cooperative candidates, and with ``pingpong`` its ping-pong ones."""
    from te_fused_ops.backends.sm90.kernels.tuning import CANDIDATES, PINGPONG_CANDIDATES

    return CANDIDATES + (PINGPONG_CANDIDATES if pingpong else ())


def config_label(config) -> str:
    """128x2, or 192x2p for ping-pong."""
    return f"{config.tile_n}x{config.cluster_m}{'p' if config.pingpong else ''}"


def config_kwargs(config) -> dict:
    """The keyword arguments every bf16 kernel wrapper takes for ``config`` (its tile, cluster
    and schedule; `deep_operands` is the dActivation's alone)."""
    return dict(tile_n=config.tile_n, cluster_m=config.cluster_m, pingpong=config.pingpong)


def step_kernels(mlp, offsets, x, dy):
    """name -> callable(**config) for each sm90 kernel of the fused step, on realistic operands."""
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_dgrad_dact_sm90, grouped_gemm_sm90
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_sm90

    w1, w2, xd = mlp[0].weight.detach(), mlp[2].weight.detach(), x.detach()
    pre, act = grouped_gemm_sm90(xd, w1, offsets, activation="swiglu")
    d_pre = grouped_dgrad_dact_sm90(dy, w2, offsets, pre, activation="swiglu")[0]
    return {
        "FC1 fwd + SwiGLU": lambda **c: grouped_gemm_sm90(xd, w1, offsets, activation="swiglu", **c),
        "FC2 fwd": lambda **c: grouped_gemm_sm90(act, w2, offsets, **c),
        "FC2 dgrad + dSwiGLU": lambda **c: grouped_dgrad_dact_sm90(dy, w2, offsets, pre, activation="swiglu", **c),
        "FC2 wgrad": lambda **c: grouped_wgrad_sm90(dy, act, offsets, **c),
        "FC1 dgrad": lambda **c: grouped_gemm_sm90(d_pre, w1, offsets, weight_layout="kn", **c),
        "FC1 wgrad": lambda **c: grouped_wgrad_sm90(d_pre, xd, offsets, **c),
    }


def sweep_configs(mlp, offsets, x, dy):
    """Median us of each sm90 kernel of the step per (tile_n, cluster_m), and with the wrapper's choice."""
    table = {}
    for name, fn in step_kernels(mlp, offsets, x, dy).items():
        times = {"auto": sustained_ms(fn) * 1e3}
        for config in configs():
            times[config_label(config)] = sustained_ms(lambda: fn(**config_kwargs(config))) * 1e3
        table[name] = times
        print(f"  {name:22s} " + "  ".join(f"{k} {v:7.0f}" for k, v in times.items()), flush=True)
    return table


def ncu_range(mlp, offsets, x, dy):
    """Each sm90 kernel of the step once inside a profiler range (``ncu --profile-from-start off``)."""
    kernels = step_kernels(mlp, offsets, x, dy)
    for fn in kernels.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for fn in kernels.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def profile_step(mlp, splits, x, dy):
    """GPU time per kernel of one fused step (torch.profiler)."""

    def step():
        x.grad = None
        for p in mlp.parameters():
            p.grad = None
        mlp(x, split_sizes=splits).backward(dy)

    return gpu_us_per_kernel(step)


def step_timelines(runs, dy, labels) -> dict:
    """label -> `common.kernel_timeline` of one step (gradients None first) of each of ``labels``."""
    def step(forward, leaves):
        for t in leaves:
            t.grad = None
        forward().backward(dy)

    return {label: kernel_timeline(lambda r=runs[label]: step(*r)) for label in labels}


def is_gemm_kernel(name: str) -> bool:
    lowered = name.lower()
    return any(key in lowered for key in ("grouped", "gemm", "wgrad", "cutlass", "sm90_xmma", "kernel_cutlass"))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names or MxHxIxE sizes")
    ap.add_argument("--out", default=None, help="folder for the JSON/markdown result (default: print only)")
    ap.add_argument("--profile", action="store_true", help="also print the kernel breakdown of one fused step and the "
                    "GPU timeline (busy, idle, largest gaps) of a fused and a reference step")
    ap.add_argument("--sweep", action="store_true", help="only time each sm90 kernel per tile config")
    ap.add_argument("--ncu", action="store_true", help="only run each sm90 kernel once in a profiler range")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    results = []
    for name in args.shapes.split(","):
        m, h, i, e = model_shape(name)
        print(f"[{name}] M={m} H={h} I={i} E={e} ...", flush=True)
        mlp, splits, offsets, x, dy = problem(name)
        if args.ncu:
            ncu_range(mlp, offsets, x, dy)
            continue
        if args.sweep:
            results.append({"shape": name, "sweep_us": sweep_configs(mlp, offsets, x, dy)})
            continue
        runs = variants(mlp, splits, offsets, x)
        grads = {}
        for label in ("fused", "reference"):
            forward, leaves = runs[label]
            for t in leaves:
                t.grad = None
            y = forward()
            y.backward(dy)
            grads[label] = [y.detach()] + [t.grad.clone() for t in leaves]
        errs = [rel_err(a, b) for a, b in zip(grads["fused"], grads["reference"])]
        assert max(errs) <= 1e-2, f"{name}: fused vs reference errors {errs}"
        del grads
        row = {"shape": name, "M": m, "H": h, "I": i, "E": e, "max_rel_err": max(errs)}
        row.update(step_rows(runs, dy, m, h, i))
        row["kernels"] = kernel_rows(mlp, offsets, x, dy)
        for kname, k in row["kernels"].items():
            print(f"  {kname:28s} ours {k['ours_us']:8.0f} us  torch {k['torch_us']:8.0f} us", flush=True)
        if args.profile:
            kernels = profile_step(mlp, splits, x, dy)
            total = sum(kernels.values())
            other = {k: v for k, v in kernels.items() if not is_gemm_kernel(k)}
            row["non_gemm_share"] = sum(other.values()) / total
            print(f"  non-GEMM kernel time {100 * row['non_gemm_share']:.2f}% of {total / 1e3:.2f} ms:", flush=True)
            for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:8]:
                print(f"    {v:9.1f} us  {k[:100]}")
            row["timelines"] = step_timelines(runs, dy, ("fused", "reference"))
            for label, timeline in row["timelines"].items():
                print_timeline(label, timeline)
        results.append(row)
        del mlp, runs, x, dy
        torch.cuda.empty_cache()

    if args.sweep or args.ncu:
        return
    lines = [
        f"Training step (fwd + bwd, grads None first), bf16 SwiGLU MLP, {device}; median ms; "
        "TFLOPS = 3 x forward FLOPs / step",
        "",
        "| shape | fused step | unfused step | reference step | fused TFLOPS | fused vs reference | "
        "bwd fused / reference | fwd fused / reference | peak MiB fused / reference |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f, u, ref = r["fused"], r["unfused"], r["reference"]
        lines.append(
            f"| {r['shape']} | {f['step_ms']:.2f} | {u['step_ms']:.2f} | {ref['step_ms']:.2f} | "
            f"{f['step_tflops']:.0f} | {ref['step_ms'] / f['step_ms']:.2f}x | "
            f"{f['bwd_ms']:.2f} / {ref['bwd_ms']:.2f} ({ref['bwd_ms'] / f['bwd_ms']:.2f}x) | "
            f"{f['fwd_ms']:.2f} / {ref['fwd_ms']:.2f} | {f['peak_mib']:.0f} / {ref['peak_mib']:.0f} |"
        )
    lines += ["", "| shape | kernel | ours us | torch us | speedup |", "|---|---|---|---|---|"]
    for r in results:
        for kname, k in r["kernels"].items():
            lines.append(f"| {r['shape']} | {kname} | {k['ours_us']:.0f} | {k['torch_us']:.0f} | "
                         f"{k['torch_us'] / k['ours_us']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_results(args.out, f"train_step_{device_tag(device)}", {"device": device, "results": results}, table)

if __name__ == "__main__":
    main()
