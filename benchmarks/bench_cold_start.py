"""The first training step of a fresh process, with and without the on-disk kernel cache.

Each case runs in its own process (`python -m te_fused_ops.precompile`'s layer and step): cache
off; cache on, empty directory (compile and write); cache on, filled (a later process loads); cache on,
empty, the step's kernels compiled in forked workers first (`precompile.compile_step_kernels`);
then eight processes starting at once on an empty directory (one compiles each kernel, the others
wait for it and load); and the plain torch step of the same MLP (`bench_train_step.ReferenceMLP`,
SwiGLU through torch.compile) with an empty and a filled inductor cache. Outputs and gradients of
every process must equal the cache-off process's bit for bit. Reports import, first and second step
seconds and kernels compiled / loaded. Usage: ``python benchmarks/bench_cold_start.py [--out DIR]``
(GPU).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import require_sm90

if __name__ == "__main__":  # one line, exit 2, on other machines
    require_sm90(__file__)

CASES = {  # name: precompile arguments (one rank's layer)
    "qwen3 mlp bf16": "--experts 128 --hidden 2048 --ffn 768 --tokens 65536",
    "qwen3 mlp fp8": "--experts 128 --hidden 2048 --ffn 768 --tokens 65536 --recipe fp8_blockwise",
    "qwen3 moe bf16": "--experts 128 --hidden 2048 --ffn 768 --tokens 8192 --moe --topk 8 --activation scaled_swiglu",
}


def child(layer_args: str, save: str) -> None:
    started = time.perf_counter()
    import torch

    from te_fused_ops import kernel_cache, precompile

    args = precompile.parse_args(layer_args.split())
    device = torch.device("cuda")
    torch.manual_seed(0)
    layer = precompile.build_layer(args, args.recipe[0], device)
    imported = time.perf_counter()
    parallel = {}
    if os.environ.get("BENCH_PARALLEL_COMPILE"):  # the step's kernels compiled in forked workers first
        throwaway = precompile.build_layer(args, args.recipe[0], device)
        parallel = precompile.compile_step_kernels(lambda: precompile.run_step(throwaway, args, args.tokens[0], device))
        del throwaway
    torch.manual_seed(1)
    tensors = precompile.run_step(layer, args, args.tokens[0], device)
    first = time.perf_counter()
    torch.manual_seed(1)
    precompile.run_step(layer, args, args.tokens[0], device)
    second = time.perf_counter()
    torch.save({k: v.cpu() for k, v in tensors.items() if v is not None}, save)
    report = {"import s": imported - started, "first step s": first - imported, "second step s": second - first,
              "to first step s": time.time() - float(os.environ["BENCH_SPAWNED_AT"]) - (second - first),
              **kernel_cache.stats(), **{f"parallel {k}": v for k, v in parallel.items()}}
    print("REPORT " + json.dumps(report), flush=True)


def torch_child(layer_args: str) -> None:
    """The plain torch step of the same MLP (bench_train_step's reference: six grouped GEMMs,
    SwiGLU and its backward through torch.compile, one kernel per shape)."""
    started = time.perf_counter()
    import torch
    from bench_train_step import ReferenceMLP

    from te_fused_ops import precompile

    args = precompile.parse_args(layer_args.split())
    e, h, i, m = args.experts, args.hidden, args.ffn, args.tokens[0]
    torch.manual_seed(0)
    w1 = (torch.randn(e, 2 * i, h, device="cuda", dtype=args.dtype) / h**0.5).requires_grad_()
    w2 = (torch.randn(e, h, i, device="cuda", dtype=args.dtype) / i**0.5).requires_grad_()
    ends = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (m // e)
    imported = time.perf_counter()
    times = []
    for _ in range(2):
        x = torch.randn(m, h, device="cuda", dtype=args.dtype, requires_grad=True)
        ReferenceMLP.apply(x, w1, w2, ends).float().square().mean().backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter())
    report = {"import s": imported - started, "first step s": times[0] - imported, "second step s": times[1] - times[0],
              "to first step s": time.time() - float(os.environ["BENCH_SPAWNED_AT"]) - (times[1] - times[0]),
              "compiled": "inductor", "loaded": "-"}
    print("REPORT " + json.dumps(report), flush=True)


def spawn(layer_args, save, cache_dir, cache_on, plain_torch=False, parallel=False):
    env = dict(os.environ, TE_FUSED_OPS_KERNEL_CACHE="1" if cache_on else "0", TE_FUSED_OPS_KERNEL_CACHE_DIR=cache_dir,
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache_dir, "inductor"), BENCH_SPAWNED_AT=repr(time.time()),
               BENCH_PARALLEL_COMPILE="1" if parallel else "")
    mode = ["--torch-child"] if plain_torch else ["--child"]
    return subprocess.Popen([sys.executable, __file__, *mode, layer_args, "--save", save], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def report_of(proc):
    out, _ = proc.communicate()
    lines = [line for line in out.splitlines() if line.startswith("REPORT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"child failed ({proc.returncode}):\n{out[-4000:]}")
    return json.loads(lines[-1][len("REPORT "):]), out


def same(a_path, b_path) -> bool:
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--child")
    parser.add_argument("--torch-child")
    parser.add_argument("--save")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--processes", type=int, default=8)
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated names of CASES")
    args = parser.parse_args()
    if args.child:
        return child(args.child, args.save)
    if args.torch_child:
        return torch_child(args.torch_child)
    rows, lines = [], []
    work = tempfile.mkdtemp()
    for name in args.cases.split(","):
        layer_args = CASES[name]
        cache_dir = os.path.join(work, name.replace(" ", "_"))
        runs = {}
        for label, cache_on in (("cache off", False), ("empty cache", True), ("filled cache", True)):
            save = os.path.join(work, f"{name}-{label}.pt".replace(" ", "_"))
            report, _ = report_of(spawn(layer_args, save, cache_dir, cache_on))
            runs[label] = save
            rows.append({"case": name, "run": label, **report, "equal": same(runs["cache off"], save)})
            print(rows[-1], flush=True)
        save = os.path.join(work, f"{name}-parallel.pt".replace(" ", "_"))
        report, _ = report_of(spawn(layer_args, save, cache_dir + "-parallel", True, parallel=True))
        rows.append({"case": name, "run": "empty cache, compiled in forked workers", **report,
                     "equal": same(runs["cache off"], save)})
        print(rows[-1], flush=True)
        if name == "qwen3 mlp bf16":
            torch_dir = cache_dir + "-torch"
            for label in ("plain torch + inductor, empty cache", "plain torch + inductor, filled cache"):
                report, _ = report_of(spawn(layer_args, "-", torch_dir, True, plain_torch=True))
                rows.append({"case": name, "run": label, **report, "equal": "-"})
                print(rows[-1], flush=True)
            crowd_dir = cache_dir + "-crowd"
            saves = [os.path.join(work, f"crowd{i}.pt") for i in range(args.processes)]
            t = time.perf_counter()
            procs = [spawn(layer_args, s, crowd_dir, True) for s in saves]
            reports = [report_of(p)[0] for p in procs]
            wall = time.perf_counter() - t
            rows.append({"case": name, "run": f"{args.processes} at once, empty cache", "wall s": wall,
                         "first step s": max(r["first step s"] for r in reports),
                         "to first step s": max(r["to first step s"] for r in reports),
                         "compiled": sum(r["compiled"] for r in reports), "loaded": sum(r["loaded"] for r in reports),
                         "equal": all(same(runs["cache off"], s) for s in saves)})
            print(rows[-1], flush=True)
    lines.append("| case | run | start to first step done s | import s | first step s | second step s | compiled | loaded "
                 "| compile / write / load s | equal |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(f"| {r['case']} | {r['run']} | {r['to first step s']:.1f} | {r.get('import s', float('nan')):.1f} | "
                     f"{r['first step s']:.1f} | "
                     f"{r.get('second step s', float('nan')):.2f} | {r['compiled']} | {r['loaded']} | "
                     f"{r.get('compile s', float('nan')):.1f} / {r.get('write s', float('nan')):.2f} / "
                     f"{r.get('load s', float('nan')):.2f} | {r['equal']} |")
    table = "\n".join(lines)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cold_start.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print(table)


if __name__ == "__main__":
    main()
