"""FC1 forward of MoE grouped MLPs on Hopper: fused sm90 grouped GEMM + SwiGLU vs unfused.

Variants per shape (rows M, hidden H = K, expert width I, local experts E = G; N = 2I):
  fused      grouped_gemm_sm90(activation="swiglu") -> pre (M, 2I) and act (M, I)
  unfused    torch._grouped_mm + torch.compile'd SwiGLU
  gmm        torch._grouped_mm alone (pre only)
  plain      grouped_gemm_sm90(activation=None) (the lone GroupedLinear backend)
  old        with --compare-module PATH: that module's grouped_gemm_sm90(activation="swiglu") on
             its glu_interleave'd weight (an earlier kernel taking interleaved GLU weights)
Median of do_bench (L2 flushed before every run), uneven routing (seeded), bf16.

    python benchmarks/bench_fc1_sm90.py [--out benchmarks/results] [--shapes dsv3-ep8,...]
    python benchmarks/bench_fc1_sm90.py --compare-module old_pkg/grouped_gemm.py
    python benchmarks/bench_fc1_sm90.py --sweep                  # kernel options, same run
    ncu --profile-from-start off python benchmarks/bench_fc1_sm90.py --shapes dsv3-ep8 \
        --profile 256x2,swiglu:256x2                              # one launch per variant
"""

import argparse
import functools
import importlib
import json
import math
import os
import sys

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import MODEL_SHAPES, compile_per_shape, host_us_per_call, skewed_splits

from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm, grouped_gemm_sm90, max_clusters
from te_fused_ops.backends.sm90.kernels.launch import num_sms

SHAPES = MODEL_SHAPES


def problem(name):
    """FC1 of shape ``name``: (m, n, k, e, offsets (e+1,) int32, x (m, k), w (e, n, k)) on CUDA, bf16."""
    m, h, i, e = SHAPES[name]
    n, k = 2 * i, h
    offsets = torch.zeros(e + 1, dtype=torch.int32, device="cuda")
    offsets[1:] = torch.cumsum(skewed_splits(m, e), 0).to(torch.int32).cuda()
    x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16) / math.sqrt(k)
    return m, n, k, e, offsets, x, w


@compile_per_shape
def swiglu(pre):
    gate, up = pre.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def bench(fn):
    import triton.testing  # here, not at the top: --help reads without triton
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3  # us


def host_overhead_us():
    """Per-call host time of the wrapper and of the compiled launcher alone (tiny problem)."""
    x = torch.randn(128, 64, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(1, 128, 64, dtype=torch.bfloat16, device="cuda")
    off = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
    pre, act = grouped_gemm_sm90(x, w, off, activation="swiglu")
    fn = compile_grouped_gemm(torch.bfloat16, 128, "swiglu", False, True, 1)
    grid = max_clusters(num_sms(0), 0, 1)
    host = host_us_per_call(lambda: grouped_gemm_sm90(x, w, off, activation="swiglu"))
    raw = host_us_per_call(lambda: fn(x, w, off, pre, act, None, None, None, 7.0, 1.702, grid))
    return host, raw


SWEEP = {  # kernel options tried by --sweep on top of the wrapper's choice
    "default": {},
    "stages3_slots2": {"ab_stages": 3, "epi_slots": 2},
}


def sweep(shapes, rounds):
    """Time kernel options (not exposed by the wrapper) through the compiled launchers."""
    from te_fused_ops.backends.sm90.kernels.grouped_gemm import choose_config

    lines = ["| shape | kernel | " + " | ".join(SWEEP) + " |", "|---|---|" + "---|" * len(SWEEP)]
    for name in shapes:
        m, n, k, e, offsets, x, w = problem(name)
        pre = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
        act = torch.empty(m, n // 2, dtype=torch.bfloat16, device="cuda")
        tile_n, cluster_m = choose_config(m, n, e, num_sms(0))
        for label, activation, a in (("fused", "swiglu", act), ("plain", None, None)):
            fns, errs = {}, {}
            for opt, kw in SWEEP.items():
                fn = compile_grouped_gemm(torch.bfloat16, tile_n, activation, False, True, cluster_m, **kw)
                grid = max_clusters(num_sms(0), 0, cluster_m)
                fns[opt] = functools.partial(fn, x, w, offsets, pre, a, None, None, None, 7.0, 1.702, grid)
                fns[opt]()
                if activation is None:  # the scheduler options must not change the result
                    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets[1:])
                    assert torch.equal(pre, ref), f"{name} {opt}: plain result differs"
                else:  # activation error given the kernel's own pre (fp32 SwiGLU)
                    ref = swiglu(pre.float())
                    errs[opt] = ((a.float() - ref).norm() / ref.norm()).item()
                del ref
            best = {opt: float("inf") for opt in fns}
            for _ in range(rounds):
                for opt, f in fns.items():
                    best[opt] = min(best[opt], bench(f))
            lines.append(
                f"| {name} | {label} {tile_n}x{cluster_m} | "
                + " | ".join(f"{best[o]:.0f}" for o in SWEEP) + " |"
                + "".join(f" act err {o}: {e:.2e};" for o, e in errs.items())
            )
            print(lines[-1], flush=True)
        del x, w, pre, act
        torch.cuda.empty_cache()
    print("\n".join(lines))


def profile(name, variants):
    """One launch per [activation:]variant inside a profiler range, for
    ``ncu --profile-from-start off``."""
    m, n, k, e, offsets, x, w = problem(name)
    calls = []
    for v in variants:
        act, _, cfg = v.rpartition(":")
        tn, cl = map(int, cfg.split("x"))
        calls.append(functools.partial(
            grouped_gemm_sm90, x, w, offsets, activation=act or None, tile_n=tn, cluster_m=cl
        ))
    for f in calls:
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for f in calls:
        f()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def import_from_path(path):
    """Import a module from a file; a file in a package (folder with __init__.py) is imported as
    package.module, so that its relative imports work."""
    folder, file = os.path.split(os.path.abspath(path))
    name = os.path.splitext(file)[0]
    if os.path.exists(os.path.join(folder, "__init__.py")):
        folder, pkg = os.path.split(folder)
        name = f"{pkg}.{name}"
    sys.path.insert(0, folder)
    return importlib.import_module(name)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", default="128x1,256x1,256x2", help="tile_n x cluster_m list")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sweep", action="store_true", help="time kernel options instead")
    ap.add_argument("--profile", default=None,
                    help="[activation:]variant list: one launch each on the first shape, for ncu")
    ap.add_argument("--compare-module", default=None,
                    help="file of a wrapper module with grouped_gemm_sm90 and glu_interleave (an "
                    "interleaved-weight kernel): adds its fused time as column 'old'")
    args = ap.parse_args()
    old = import_from_path(args.compare_module) if args.compare_module else None
    if args.profile:
        return profile(args.shapes.split(",")[0], args.profile.split(","))
    if args.sweep:
        return sweep(args.shapes.split(","), args.rounds)
    dev = torch.cuda.get_device_name()
    rows = []
    variants = [v for v in args.variants.split(",") if v]
    for name in args.shapes.split(","):
        m, n, k, e, offsets, x, w = problem(name)
        w_t = w.transpose(-2, -1)
        offs = offsets[1:]
        flops = 2.0 * m * n * k
        r = {"shape": name, "M": m, "K": k, "N": n, "G": e, "max_split": int((offsets[1:] - offsets[:-1]).max())}
        # correctness spot check against _grouped_mm (same bf16 inputs)
        ref = torch._grouped_mm(x, w_t, offs=offs)
        pre, act = grouped_gemm_sm90(x, w, offsets, activation="swiglu")
        err_pre = ((pre.float() - ref.float()).norm() / ref.float().norm()).item()
        err_act = ((act.float() - swiglu(ref).float()).norm() / swiglu(ref).float().norm()).item()
        r["err_pre"], r["err_act"] = err_pre, err_act
        del pre, act, ref
        fns = {
            "gmm_us": lambda: torch._grouped_mm(x, w_t, offs=offs),
            "unfused_us": lambda: swiglu(torch._grouped_mm(x, w_t, offs=offs)),
            "fused_us": lambda: grouped_gemm_sm90(x, w, offsets, activation="swiglu"),
            "plain_us": lambda: grouped_gemm_sm90(x, w, offsets),
        }
        if old is not None:
            fns["old_us"] = functools.partial(
                old.grouped_gemm_sm90, x, old.glu_interleave(w), offsets, activation="swiglu"
            )
        for v in variants:
            tn, cl = map(int, v.split("x"))
            fns[f"fused_{v}_us"] = functools.partial(
                grouped_gemm_sm90, x, w, offsets, activation="swiglu", tile_n=tn, cluster_m=cl
            )
            fns[f"plain_{v}_us"] = functools.partial(
                grouped_gemm_sm90, x, w, offsets, tile_n=tn, cluster_m=cl
            )
        for f in fns.values():  # compile / warm up everything first
            f()
        # round-robin, min over rounds of the medians: clocks drift as the card heats up
        for key in fns:
            r[key] = float("inf")
        for _ in range(args.rounds):
            for key, f in fns.items():
                r[key] = min(r[key], bench(f))
        r["fused_tflops"] = flops / r["fused_us"] / 1e6
        r["gmm_tflops"] = flops / r["gmm_us"] / 1e6
        r["plain_tflops"] = flops / r["plain_us"] / 1e6
        r["speedup_vs_unfused"] = r["unfused_us"] / r["fused_us"]
        r["speedup_vs_gmm"] = r["gmm_us"] / r["fused_us"]
        rows.append(r)
        print(json.dumps(r), flush=True)
        del x, w, w_t, fns
        torch.cuda.empty_cache()

    geo = math.exp(sum(math.log(r["speedup_vs_unfused"]) for r in rows) / len(rows))
    host, raw = host_overhead_us()
    tn_cols = variants
    lines = [
        f"FC1 forward (grouped GEMM N=2I + SwiGLU), bf16, {dev}; median us (TFLOPS = 2MNK/t)",
        "",
        "| shape | M,K,N,G | gmm | unfused | "
        + " | ".join(f"fused {c}" for c in tn_cols)
        + " | fused (auto) | plain (auto) | fused TFLOPS | vs unfused | vs gmm | plain vs gmm |"
        + (" old (auto) | old / fused |" if old else ""),
        "|---|---|---|---|" + "---|" * len(tn_cols) + "---|---|---|---|---|---|"
        + ("---|---|" if old else ""),
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['M']},{r['K']},{r['N']},{r['G']} | {r['gmm_us']:.0f} "
            f"({r['gmm_tflops']:.0f}) | {r['unfused_us']:.0f} | "
            + " | ".join(f"{r[f'fused_{c}_us']:.0f}" for c in tn_cols)
            + f" | {r['fused_us']:.0f} | {r['plain_us']:.0f} ({r['plain_tflops']:.0f}) | {r['fused_tflops']:.0f} | "
            f"{r['speedup_vs_unfused']:.2f}x | {r['speedup_vs_gmm']:.2f}x | "
            f"{r['gmm_us'] / r['plain_us']:.2f}x |"
            + (f" {r['old_us']:.0f} | {r['old_us'] / r['fused_us']:.2f}x |" if old else "")
        )
    lines += ["", f"geomean fused vs unfused: {geo:.2f}x; host time per call: {host:.1f} us "
              f"(compiled launcher alone {raw:.1f} us)",
              "variants: tile_n x cluster_m; plain = activation None (vs _grouped_mm)"]
    table = "\n".join(lines)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "fc1_sm90_h100.json"), "w") as f:
            json.dump({"device": dev, "rows": rows, "geomean_vs_unfused": geo,
                       "host_us_per_call": host, "launcher_us_per_call": raw}, f, indent=1)
        with open(os.path.join(args.out, "fc1_sm90_h100.md"), "w") as f:
            f.write(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
