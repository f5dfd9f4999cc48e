"""Training-step ratios against plain torch for one source tree: to compare two revisions of the
library on one machine, each in its own process, against the same yardstick.

Per shape (`common.MODEL_SHAPES`, `common.mlp_problem`): the step (gradients set to None, forward,
backward) of the bf16 `Sequential(GroupedLinear, SwiGLU, GroupedLinear)`, the FC2-FP8 and the
all-FP8 (`fp8_blockwise`) chains, the all-FP8 chain with its weights cast once per optimizer step of
4 micro-batches (`cast_weights_once_per_step`; timed as that optimizer step, `common.accumulation_step`,
per micro-batch: the average one), and plain torch
(`bench_train_step.ReferenceMLP`); each output
and gradient checked against plain torch first (max relative Frobenius error printed); times are
`common.sustained_ms` medians in rotated order. Prints per shape the step us and plain torch / step.

    git archive <rev> --prefix=/tmp/before/ | tar -x -C /
    python benchmarks/bench_step_ratios.py /tmp/before /tmp/before.json [--shapes a,b]
    python benchmarks/bench_step_ratios.py . /tmp/after.json [--shapes a,b]
"""

import argparse
import copy
import json
import sys

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tree", help="root of the source tree whose te_fused_ops (and benchmarks) to time")
    ap.add_argument("out", help="JSON file for the results")
    ap.add_argument("--shapes", default=None, help="comma-separated MODEL_SHAPES names (default: all)")
    args = ap.parse_args()
    sys.path[:0] = [args.tree, args.tree + "/benchmarks"]  # that tree's library and helpers first

    import torch
    import te_fused_ops
    from bench_train_step import ReferenceMLP
    from common import MODEL_SHAPES, accumulation_step, mlp_problem, rotated_medians, sustained_ms
    import te_fused_ops as tfo
    from te_fused_ops import Quantize, Sequential, SwiGLU, Transpose

    print("te_fused_ops from", te_fused_ops.__file__, flush=True)
    results = {}
    for name in args.shapes.split(",") if args.shapes else list(MODEL_SHAPES):
        splits, fc1, fc2, x, dy = mlp_problem(name)
        ends = torch.cumsum(splits, 0).to(torch.int32)
        fc2_fp8 = [Quantize("fp8_blockwise"), Transpose(), fc2]
        models = {
            "bf16": Sequential(fc1, SwiGLU(), fc2),
            "fc2 fp8": Sequential(fc1, SwiGLU(), *fc2_fp8),
            "all fp8": Sequential(Quantize("fp8_blockwise"), fc1, SwiGLU(), *fc2_fp8),
            "plain torch": lambda x, split_sizes: ReferenceMLP.apply(x, fc1.weight, fc2.weight, ends),
        }
        leaves = {label: [x, fc1.weight, fc2.weight] for label in models}
        # all FP8 with its weights cast once per optimizer step of 4 micro-batches: its own copies of
        # the two linears (the step casts would otherwise reach the other variants' modules too)
        fc1_own, fc2_own = copy.deepcopy(fc1), copy.deepcopy(fc2)
        own = Sequential(Quantize("fp8_blockwise"), fc1_own, SwiGLU(), Quantize("fp8_blockwise"), Transpose(), fc2_own)
        casts = tfo.cast_weights_once_per_step(torch.optim.SGD(own.parameters(), lr=0.0), own)
        models["all fp8, 4 micro-batches a step"] = own
        leaves["all fp8, 4 micro-batches a step"] = [x, fc1_own.weight, fc2_own.weight]

        def step(label):
            for t in leaves[label]:
                t.grad = None
            models[label](x, split_sizes=splits).backward(dy)
            return [t.grad.float() for t in leaves[label]]

        want = step("plain torch")
        errors = {label: max(((a - b).norm() / b.norm()).item() for a, b in zip(step(label), want))
                  for label in models}
        timed = {label: (lambda label=label: step(label)) for label in models}
        timed["all fp8, 4 micro-batches a step"] = accumulation_step(  # casts.drop: the optimizer step's
            timed["all fp8, 4 micro-batches a step"], casts.drop, 4)
        us = rotated_medians(timed, lambda fn: sustained_ms(fn, 0.25, 0.25) * 1e3)
        ratios = {label: us["plain torch"] / t for label, t in us.items()}
        results[name] = {"us": us, "plain_torch_over_step": ratios, "max_rel_err_vs_plain": errors}
        print(name, {k: round(v, 1) for k, v in us.items()}, {k: round(v, 3) for k, v in ratios.items()},
              {k: f"{e:.1e}" for k, e in errors.items()}, flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
