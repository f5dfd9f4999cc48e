"""Where the MoE layer's step goes, without timing it: `bench_moe_layer.py --profile` for chosen
contenders only.

Per shape, the contenders (`bench_moe_layer.py`'s labels, its docstring) are built, checked against
(a) and each broken down by `bench_moe_layer.profile_contender`: GPU time per kernel of one step
(torch.profiler, per micro-batch for a -4mb contender, its weight casts included), the host time to
issue a step, the SM clock and board power while steps run back to back, and the step's launches in
order. The contenders are not timed against each other here: their ratios come from
`bench_moe_layer.py` or `bench_tree_ab.py`, run in rotation.

    python benchmarks/bench_moe_layer_profile.py [--shapes mixtral-8x7b,dsv3-ep8]
        [--contenders c,c-fp8,c-fp8-4mb] [--recipe fp8_blockwise|none] [--out DIR]
"""

import argparse
import re

from common import require_sm90

if __name__ == "__main__":  # before torch and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import device_tag, write_results

import bench_moe_layer as layer


def kernel_class(name: str) -> str:
    """A library kernel's class (``GroupedGemmActFp8Sm90``) from its mangled name, else the name."""
    match = re.search(r"kernels\w+?_sm90(\w+?Sm90)_object", name)
    return match.group(1) if match else name[:60]


def run_shape(name: str, labels: list, recipe: str | None) -> dict:
    p = layer.make_problem(name, layer.SHAPES[name])
    runs = layer.build_contenders(p, recipe=recipe)
    runs = {label: runs[label] for label in ("a", *labels)}
    checks = layer.check_contenders(runs, p.dy, "a")
    rows = {}
    for label in labels:
        if checks[label]["status"] != "ok":
            rows[label] = {"status": checks[label]["status"]}
            continue
        profile = layer.profile_contender(label, runs[label], p.dy, float("nan"))
        classes = {}
        for kernel, us in profile["kernels_us"].items():
            classes[kernel_class(kernel)] = classes.get(kernel_class(kernel), 0.0) + us
        rows[label] = {"kernel_ms": profile["kernel_ms"], "host_ms": profile["host_ms"], "clocks": profile["clocks"],
                       "classes_us": classes, "in_order": profile["timeline"]["launches"]}
    del p, runs
    torch.cuda.empty_cache()
    return {"shape": name, "contenders": rows}


def table(device: str, results: list) -> str:
    lines = [f"MoE layer step by kernel class ({device}; GPU us of one step, per micro-batch for -4mb; "
             "the SM clock and power with steps back to back)", "",
             "| shape | contender | kernel ms | SM MHz / W | kernel classes, us |", "|---|---|---|---|---|"]
    for r in results:
        for label, c in r["contenders"].items():
            if "kernel_ms" not in c:
                lines.append(f"| {r['shape']} | {label} | {c['status']} | | |")
                continue
            clocks = c["clocks"]
            clock = f"{clocks['sm_mhz']:.0f} / {clocks['power_w']:.0f}" if clocks else "-"
            classes = ", ".join(f"{name} {us:.0f}" for name, us in
                                sorted(c["classes_us"].items(), key=lambda item: -item[1]) if us >= 20)
            lines.append(f"| {r['shape']} | {label} | {c['kernel_ms']:.3f} | {clock} | {classes} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="mixtral-8x7b,dsv3-ep8", help=f"comma-separated, of {','.join(layer.SHAPES)}")
    ap.add_argument("--contenders", default="c,c-fp8,c-fp8-4mb", help="bench_moe_layer labels to profile")
    ap.add_argument("--recipe", default="fp8_blockwise",
                    help="the FP8 contenders' recipe ('none': the bf16 contenders only)")
    ap.add_argument("--out", default=None, help="folder for the .json/.md (default: benchmarks/results)")
    args = ap.parse_args()
    labels = [label for label in args.contenders.split(",") if label and label != "a"]
    device = torch.cuda.get_device_name()
    recipe = None if args.recipe == "none" else args.recipe
    results = [run_shape(name, labels, recipe) for name in args.shapes.split(",")]
    text = table(device, results)
    write_results(args.out or layer.RESULTS, f"moe_layer_step_profile_{device_tag(device)}",
                  {"device": device, "recipe": recipe, "results": results}, text)
    print(text)


if __name__ == "__main__":
    main()
