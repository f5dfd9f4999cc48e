"""The MoE layer's training step eager and captured as one CUDA graph (`te_fused_ops.CudaGraphStep`).

Contenders are `bench_moe_layer.py`'s (its docstring), each timed twice: eager, and its step
(gradients None, forward, backward) captured once and replayed. The graphed ones are built a second
time (their own weights and step casts): a -4mb contender's graph reads the weight copies its
warm-up made, and after every MICRO_BATCHES replays the optimizer step's action casts them again
in place (`cast_weights_once_per_step`), as a graphed gradient-accumulation loop runs; eager or
graphed, a -4mb contender is timed as that optimizer step and reported per micro-batch
(`bench_moe_layer.timed_step`). Rotated sustained medians (`common.sustained_ms`), ratios against
(a) eager and eager / graph per contender.

    python benchmarks/bench_layer_graphs.py [--shapes qwen3-30b-a3b,gptoss-120b-ep4]
        [--contenders a,c,c-fp8w16-4mb] [--recipe fp8_blockwise] [--out DIR]
"""

import argparse
import os

from common import require_sm90

if __name__ == "__main__":  # before torch and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import accumulation_step, device_tag, rotated_medians, sustained_ms, write_results

import bench_moe_layer as layer
import te_fused_ops


def graphed(run, dy):
    """The contender's micro-batch as one CUDA graph; with ``run.optimizer_step``, the
    `common.accumulation_step` of MICRO_BATCHES replays and that optimizer step."""
    replay = te_fused_ops.CudaGraphStep(layer.step_fn(run, dy))
    if run.optimizer_step is None:
        return replay
    return accumulation_step(replay, run.optimizer_step, layer.MICRO_BATCHES)


def run_shape(name: str, labels: list, recipe: str) -> dict:
    p = layer.make_problem(name, layer.SHAPES[name])
    eager, graphs = layer.build_contenders(p, recipe=recipe), layer.build_contenders(p, recipe=recipe)
    fns = {}
    for label in labels:
        fns[label] = layer.timed_step(eager[label], p.dy)
        fns[f"{label} graph"] = graphed(graphs[label], p.dy)
    ms = rotated_medians(fns, sustained_ms)
    rows = {label: {"eager_ms": ms[label], "graph_ms": ms[f"{label} graph"],
                    "eager_vs_a": ms["a"] / ms[label], "graph_vs_a": ms["a"] / ms[f"{label} graph"],
                    "eager_over_graph": ms[label] / ms[f"{label} graph"]} for label in labels}
    del p, eager, graphs, fns
    torch.cuda.empty_cache()
    return {"shape": name, "contenders": rows}


def table(device: str, results: list) -> str:
    lines = [f"MoE layer step, eager and as one CUDA graph ({device}; ms, ratios against a eager)", "",
             "| shape | contender | eager ms | graph ms | eager vs a | graph vs a | eager / graph |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        for label, c in r["contenders"].items():
            lines.append(f"| {r['shape']} | {label} | {c['eager_ms']:.3f} | {c['graph_ms']:.3f} | "
                         f"{c['eager_vs_a']:.3f} | {c['graph_vs_a']:.3f} | {c['eager_over_graph']:.3f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gptoss-120b-ep4",
                    help=f"comma-separated, of {','.join(layer.SHAPES)}")
    ap.add_argument("--contenders", default="a,c,c-fp8w16-4mb", help="bench_moe_layer labels; a always runs")
    ap.add_argument("--recipe", default="fp8_blockwise", help="the FP8 contenders' recipe")
    ap.add_argument("--out", default=None, help="folder for the .json/.md (default: benchmarks/results)")
    args = ap.parse_args()
    labels = ["a", *(label for label in args.contenders.split(",") if label and label != "a")]
    device = torch.cuda.get_device_name()
    results = [run_shape(name, labels, args.recipe) for name in args.shapes.split(",")]
    text = table(device, results)
    write_results(args.out or layer.RESULTS, f"moe_layer_graphs_{device_tag(device)}",
                  {"device": device, "results": results}, text)
    print(text)


if __name__ == "__main__":
    main()
