"""A/B of two builds of te_fused_ops: run once per build, alternating, each with the build first on
PYTHONPATH; compare each build's ratio against the plain-torch contender timed in the same rotation.

Per shape (qwen3-30b-a3b, gptoss-120b-ep4): the bf16 grouped-MLP training step (`bench_train_step`'s
fused Sequential and plain-torch reference, gradients checked against each other) and the MoE layer
step (`bench_moe_layer`'s a, c and c-fp8-4mb, checked against a). Prints one ``RESULT {json}`` line.

    PYTHONPATH=/path/to/build_a python benchmarks/bench_tree_ab.py a
    PYTHONPATH=/path/to/build_b python benchmarks/bench_tree_ab.py b     # then a, b again
    python benchmarks/bench_tree_ab.py a --warm   # compile and check only (fills the kernel caches)
    python benchmarks/bench_tree_ab.py a --parts layer   # the MoE layer only
    python benchmarks/bench_tree_ab.py a --shapes dsv3-ep8   # other shapes (default: qwen3, gpt-oss)
    python benchmarks/bench_tree_ab.py a --parts layer --contenders c   # a and c only
"""

import argparse
import functools
import json

from common import require_sm90

if __name__ == "__main__":
    require_sm90(__file__)

import bench_moe_layer
import bench_train_step
import torch
from common import rotated_medians, sustained_ms

import te_fused_ops

SHAPES = ("qwen3-30b-a3b", "gptoss-120b-ep4")
LAYER_CONTENDERS = ("c", "c-fp8-4mb")


def mlp_steps(name):
    """label -> step fn of the fused MLP and the plain-torch reference, gradients checked (1e-2)."""
    mlp, splits, offsets, x, dy = bench_train_step.problem(name)
    runs = bench_train_step.variants(mlp, splits, offsets, x)
    steps, grads = {}, {}
    for label in ("fused", "reference"):
        forward, leaves = runs[label]

        def step(forward=forward, leaves=leaves):
            for t in leaves:
                t.grad = None
            forward().backward(dy)

        step()
        grads[label] = [t.grad.clone() for t in leaves]
        steps[label] = step
    errors = [bench_train_step.rel_err(a, b) for a, b in zip(grads["fused"], grads["reference"])]
    if max(errors) > 1e-2:
        raise SystemExit(f"{name}: fused MLP gradients differ from the reference: {errors}")
    return steps


def layer_steps(name, contenders=LAYER_CONTENDERS):
    """label -> step fn of the MoE layer's ``contenders`` (a among them), checked against a."""
    problem = bench_moe_layer.make_problem(name, bench_moe_layer.SHAPES[name])
    runs = bench_moe_layer.build_contenders(problem, compiled=True, recipe="fp8_blockwise")
    runs = {label: runs[label] for label in ("a", *contenders)}
    checks = bench_moe_layer.check_contenders(runs, problem.dy, "a")
    if any(check["status"] != "ok" for check in checks.values()):
        raise SystemExit(f"{name}: a layer contender does not match a: {checks}")
    steps = {label: bench_moe_layer.step_fn(run, problem.dy) for label, run in runs.items()}
    for step in steps.values():
        step()
    return steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tag", help="name of this build in the output")
    ap.add_argument("--warm", action="store_true", help="compile and check only, no timing")
    ap.add_argument("--parts", default="mlp,layer", help="comma-separated: mlp, layer")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of bench_moe_layer.SHAPES")
    ap.add_argument("--contenders", default=",".join(LAYER_CONTENDERS),
                    help="comma-separated layer contenders besides a (default: c, c-fp8-4mb)")
    args = ap.parse_args()
    layer = functools.partial(layer_steps, contenders=tuple(args.contenders.split(",")))
    result = {"tag": args.tag, "package": te_fused_ops.__file__}
    for name in args.shapes.split(","):
        for kind, build, base in (("mlp", mlp_steps, "reference"), ("layer", layer, "a")):
            if kind not in args.parts.split(","):
                continue
            steps = build(name)
            if not args.warm:
                ms = rotated_medians(steps, sustained_ms)
                result[f"{kind} {name}"] = {**ms, **{f"{label} vs {base}": ms[base] / ms[label]
                                                     for label in ms if label != base}}
                print(args.tag, kind, name, result[f"{kind} {name}"], flush=True)
            del steps
            torch.cuda.empty_cache()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
