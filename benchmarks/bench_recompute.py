"""Selective recompute against checkpointing the MLP, H100: `GroupedLinear(recompute_output=True)`.

Per shape (`bench_train_step.problem`: bf16 SwiGLU MLP, skewed routing), a training step
(forward + backward, gradients None first) of:
  fused          the fused Sequential (keeps x and FC1's pre-activation for the backward)
  recompute fc1  FC1 with recompute_output=True (keeps x; the backward reruns FC1's GEMM)
  checkpoint     torch.utils.checkpoint of the fused Sequential, non-reentrant (keeps x; the
                 backward reruns the whole forward)
  reference      plain torch (six torch._grouped_mm + compiled SwiGLU, `bench_train_step`)
"saved MiB": what autograd saved in the forward (saved_tensors_hooks); "peak MiB" as in
bench_train_step. The recompute and checkpoint gradients are checked bit for bit against the
fused step's first.

    python benchmarks/bench_recompute.py [--shapes qwen3-30b-a3b,...] [--out DIR]
"""

import argparse

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
import torch.utils.checkpoint
from bench_train_step import SHAPES, ReferenceMLP, problem, time_variants
from common import device_tag, write_results

from te_fused_ops import GroupedLinear, Sequential, SwiGLU


def saved_mib(forward) -> float:
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(saved) / 2**20


def grads_of(forward, leaves, dy):
    for t in leaves:
        t.grad = None
    forward().backward(dy)
    return [t.grad.clone() for t in leaves]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    results = []
    for name in args.shapes.split(","):
        mlp, splits, offsets, x, dy = problem(name)
        fc1, fc2 = mlp[0], mlp[2]
        recompute = Sequential(
            GroupedLinear(fc1.num_groups, fc1.in_features, fc1.out_features, dtype=torch.bfloat16, device="cuda",
                          recompute_output=True),
            SwiGLU(), fc2,
        )
        recompute[0].weight = fc1.weight  # the same parameters
        leaves = [x, fc1.weight, fc2.weight]
        runs = {
            "fused": lambda: mlp(x, split_sizes=splits),
            "recompute fc1": lambda: recompute(x, split_sizes=splits),
            "checkpoint": lambda: torch.utils.checkpoint.checkpoint(mlp, x, use_reentrant=False, split_sizes=splits),
            "reference": lambda: ReferenceMLP.apply(x, fc1.weight, fc2.weight, offsets[1:]),
        }
        want = grads_of(runs["fused"], leaves, dy)
        for label in ("recompute fc1", "checkpoint"):
            got = grads_of(runs[label], leaves, dy)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"{name}: {label} gradients differ"
        row = {"shape": name}
        timed = time_variants({label: (forward, leaves) for label, forward in runs.items()}, dy)
        for label, forward in runs.items():
            r = timed[label]
            r["saved_mib"] = saved_mib(forward)
            row[label] = r
            print(f"{name:16s} {label:14s} step {r['step_ms']:8.3f} ms  bwd {r['bwd_ms']:8.3f} ms  "
                  f"saved {r['saved_mib']:8.0f} MiB  peak {r['peak_mib']:8.0f} MiB", flush=True)
        results.append(row)
        del mlp, recompute, runs, x, dy
        torch.cuda.empty_cache()
    lines = [
        f"Training step, bf16 SwiGLU MLP, {device}; median ms, MiB saved for the backward / peak",
        "",
        "| shape | fused | recompute fc1 | checkpoint | reference | recompute / checkpoint cost over fused | "
        "saved MiB fused / recompute / checkpoint | peak MiB fused / recompute / checkpoint |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        f, rc, ck, ref = (r[k] for k in ("fused", "recompute fc1", "checkpoint", "reference"))
        lines.append(
            f"| {r['shape']} | {f['step_ms']:.2f} | {rc['step_ms']:.2f} | {ck['step_ms']:.2f} | {ref['step_ms']:.2f} | "
            f"+{100 * (rc['step_ms'] / f['step_ms'] - 1):.0f}% / +{100 * (ck['step_ms'] / f['step_ms'] - 1):.0f}% | "
            f"{f['saved_mib']:.0f} / {rc['saved_mib']:.0f} / {ck['saved_mib']:.0f} | "
            f"{f['peak_mib']:.0f} / {rc['peak_mib']:.0f} / {ck['peak_mib']:.0f} |"
        )
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_results(args.out, f"recompute_{device_tag(device)}", {"device": device, "results": results}, table)


if __name__ == "__main__":
    main()
