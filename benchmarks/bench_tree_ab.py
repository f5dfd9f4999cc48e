"""A/B of two builds of te_fused_ops: run once per build, alternating, each with the build first on
PYTHONPATH; compare each build's ratio against the plain-torch contender timed in the same rotation.

Per shape (qwen3-30b-a3b, gptoss-120b-ep4): the bf16 grouped-MLP training step (`bench_train_step`'s
fused Sequential and plain-torch reference, gradients checked against each other) and the MoE layer
step (`bench_moe_layer`'s a, c and c-fp8-4mb, checked against a); part ``kernels``: the layer's four
varlen-M GEMMs alone at their cooperative configuration, part ``fp8-kernels`` its block-scaled FP8
forward GEMMs (no plain-torch contender: compare the two builds' times, run alternately on one
machine). With ``--memory`` also each layer contender's peak
MiB above a step's start over four consecutive steps (min: a micro-batch reusing the weight copies;
max: the one casting them). Prints one ``RESULT {json}`` line.

    PYTHONPATH=/path/to/build_a:$PYTHONPATH python benchmarks/bench_tree_ab.py a
    PYTHONPATH=/path/to/build_b:$PYTHONPATH python benchmarks/bench_tree_ab.py b     # then a, b again

(Prepend the build: a PYTHONPATH that replaces the one naming the CuTe DSL leaves the library on its
torch backend, and `common.require_sm90` then exits.)
    python benchmarks/bench_tree_ab.py a --warm   # compile and check only (fills the kernel caches)
    python benchmarks/bench_tree_ab.py a --parts layer   # the MoE layer only
    python benchmarks/bench_tree_ab.py a --shapes dsv3-ep8   # other shapes (default: qwen3, gpt-oss)
    python benchmarks/bench_tree_ab.py a --parts layer --contenders c   # a and c only
    python benchmarks/bench_tree_ab.py a --parts kernels --shapes qwen3-30b-a3b,dsv3-ep8
    python benchmarks/bench_tree_ab.py a --parts fp8-kernels --shapes dsv3-ep8,mixtral-8x7b
    python benchmarks/bench_tree_ab.py a --parts layer --contenders c,c-fp8-4mb,c-fp8w16-4mb --memory
    python benchmarks/bench_tree_ab.py a --parts layer --contenders c,c-rows-wgrad,c-rows-1 --memory
    python benchmarks/bench_tree_ab.py a --parts layer --contenders c --shapes 8192x8x64x4096x1024
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
from common import live_at_peak, rotated_medians, sustained_ms

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


def micro_batch_peaks(step) -> list:
    """Peak MiB above the start of each of 4 consecutive micro-batches of ``step``; of a
    `common.accumulation_step`, the 4 after its optimizer step (the first casts the weights)."""
    if hasattr(step, "optimizer_step"):
        step.optimizer_step()
    micro_batch = getattr(step, "micro_batch", step)
    return [live_at_peak(micro_batch)[0] for _ in range(4)]


def layer_steps(name, contenders=LAYER_CONTENDERS):
    """label -> step fn of the MoE layer's ``contenders`` (a among them), checked against a."""
    problem = bench_moe_layer.make_problem(name, bench_moe_layer.SHAPES[name])
    gather_rows = tuple(label.removeprefix("c-rows-") for label in contenders if label.startswith("c-rows-"))
    runs = bench_moe_layer.build_contenders(problem, compiled=True, recipe="fp8_blockwise", gather_rows=gather_rows)
    runs = {label: runs[label] for label in ("a", *contenders)}
    checks = bench_moe_layer.check_contenders(runs, problem.dy, "a")
    if any(check["status"] != "ok" for check in checks.values()):
        raise SystemExit(f"{name}: a layer contender does not match a: {checks}")
    steps = {label: bench_moe_layer.timed_step(run, problem.dy) for label, run in runs.items()}
    for step in steps.values():
        step()
    return steps


def kernel_steps(name):
    """label -> one call of the layer's varlen-M GEMMs on skewed top-k routing, bf16, each at the
    heuristic's tile and cluster with the cooperative schedule: FC1 + SwiGLU, FC2, FC2's dgrad +
    dSwiGLU, FC1's dgrad (W1 read "kn")."""
    from te_fused_ops.backends.sm90.kernels import grouped_gemm as gg
    from te_fused_ops.routing import route

    t, k, e, h, i = bench_moe_layer.SHAPES[name]
    indices, _ = bench_moe_layer.skewed_topk(t, k, e)
    offsets = route(indices.cuda(), e).offsets
    torch.manual_seed(0)

    def rows(width):
        return torch.randn(t * k, width, device="cuda", dtype=torch.bfloat16)

    x, act, dy, pre, d_pre = rows(h), rows(i), rows(h), rows(2 * i), rows(2 * i)
    w1 = (torch.randn(e, 2 * i, h, device="cuda") / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda") / i**0.5).bfloat16()
    return {
        "fc1 + swiglu": lambda: gg.grouped_gemm_sm90(x, w1, offsets, activation="swiglu", pingpong=False),
        "fc2": lambda: gg.grouped_gemm_sm90(act, w2, offsets, pingpong=False),
        "fc2 dgrad + dswiglu": lambda: gg.grouped_dgrad_dact_sm90(dy, w2, offsets, pre, activation="swiglu",
                                                                  pingpong=False),
        "fc1 dgrad": lambda: gg.grouped_gemm_sm90(d_pre, w1, offsets, weight_layout="kn", pingpong=False),
    }


def fp8_kernel_steps(name):
    """label -> one call of the layer's block-scaled FP8 forward GEMMs on skewed top-k routing:
    FC1 + SwiGLU and FC2 at the heuristic's tile, and FC1 without the activation at tiles 192 and
    256 (the mainloop's two promotion forms: one product per block, or two halves). Each output is
    first checked against float64 of its E4M3 operands (NaN-poisoned, relative error <= 1e-2)."""
    from bench_fp8_deepgemm import relative_error

    from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_gemm_fp8_sm90
    from te_fused_ops.quantization import quantize, quantize_weight
    from te_fused_ops.routing import route

    t, k, e, h, i = bench_moe_layer.SHAPES[name]
    indices, _ = bench_moe_layer.skewed_topk(t, k, e)
    offsets = route(indices.cuda(), e).offsets
    bounds = offsets.tolist()
    torch.manual_seed(0)

    def operands(n, depth):
        x = quantize(torch.randn(t * k, depth, device="cuda"), "fp8_blockwise")
        w = quantize_weight(torch.randn(e, n, depth, device="cuda") / depth**0.5, "fp8_blockwise")
        return (x.rowwise_data, x.rowwise_scale_inv, w.rowwise_data, w.rowwise_scale_inv,
                x.dequantize(torch.float32).double(), w.dequantize(torch.float32).double())

    fc1, fc2 = operands(2 * i, h), operands(h, i)
    calls = {"fp8 fc1 + swiglu": (fc1, {"activation": "swiglu"}), "fp8 fc2": (fc2, {}),
             "fp8 fc1 t192": (fc1, {"tile_n": 192}), "fp8 fc1 t256": (fc1, {"tile_n": 256})}
    steps = {}
    for label, ((xq, xs, wq, ws, x64, w64), options) in calls.items():
        poisoned = torch.full((t * k, wq.shape[1]), float("nan"), dtype=torch.bfloat16, device="cuda")
        pre = grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, out=poisoned, **options)[0]
        error = relative_error(pre, x64, w64, bounds)
        if not error <= 1e-2:
            raise SystemExit(f"{name} {label}: relative error {error:.2e} against float64")
        steps[label] = functools.partial(grouped_gemm_fp8_sm90, xq, xs, wq, ws, offsets, **options)
    return steps


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tag", help="name of this build in the output")
    ap.add_argument("--warm", action="store_true", help="compile and check only, no timing")
    ap.add_argument("--parts", default="mlp,layer", help="comma-separated: mlp, layer, kernels, fp8-kernels")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of bench_moe_layer.SHAPES, "
                    "or TxkxExHxI for the layer and kernel parts")
    ap.add_argument("--contenders", default=",".join(LAYER_CONTENDERS),
                    help="comma-separated layer contenders besides a (default: c, c-fp8-4mb)")
    ap.add_argument("--memory", action="store_true", help="also the layer contenders' peak MiB (min, max of 4 steps)")
    args = ap.parse_args()
    layer = functools.partial(layer_steps, contenders=tuple(args.contenders.split(",")))
    result = {"tag": args.tag, "package": te_fused_ops.__file__}
    for name in args.shapes.split(","):
        if name not in bench_moe_layer.SHAPES:
            bench_moe_layer.SHAPES[name] = bench_moe_layer.layer_shape(name, ap)
        for kind, build, base in (("mlp", mlp_steps, "reference"), ("layer", layer, "a"),
                                  ("kernels", kernel_steps, None), ("fp8-kernels", fp8_kernel_steps, None)):
            if kind not in args.parts.split(","):
                continue
            steps = build(name)
            if not args.warm:
                ms = rotated_medians(steps, sustained_ms)
                result[f"{kind} {name}"] = {**ms, **{f"{label} vs {base}": ms[base] / ms[label]
                                                     for label in ms if base is not None and label != base}}
                print(args.tag, kind, name, result[f"{kind} {name}"], flush=True)
            if args.memory and kind == "layer":
                peaks = {label: micro_batch_peaks(step) for label, step in steps.items()}
                result[f"peak MiB {name}"] = {label: (min(p), max(p)) for label, p in peaks.items()}
                print(args.tag, "peak MiB", name, result[f"peak MiB {name}"], flush=True)
            del steps
            torch.cuda.empty_cache()
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
