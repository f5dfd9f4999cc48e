"""Each sm90 kernel of the bf16 training step under every (tile_n, cluster_m), on shapes chosen to
cover the problem classes (fine-grained: many experts, I 512-1536; coarse: few experts, I 8k-16k;
sizes not multiples of 128), against the configuration the wrappers choose by themselves.

Per shape and kernel: every configuration's output must equal the default's bit for bit (a
configuration changes the tiling, never the order of the K sum); then each is timed
(`common.sustained_ms`, short windows, forward then reversed order after a warm-up pass) and the
table reports the default's time over the best one's. Data: ``$OUT/sweep_configs_<gpu>.json``.

    python benchmarks/sweep_configs.py [--shapes name,...] [--out DIR] [--pingpong]
        [--kernels part,...] [--configs 256x2,192x2p,...] [--precompile]
"""

import argparse
import json
import os
import sys

from common import require_sm90

if __name__ == "__main__":
    require_sm90(__file__)

import torch
from bench_train_step import config_kwargs, config_label, configs, step_kernels
from common import device_tag, skewed_splits, sustained_ms

from te_fused_ops import GroupedLinear, Sequential, SwiGLU

SWEEP_SHAPES = {  # name: (M routed rows, H, I, E); classes: fine / coarse / unaligned
    "fine qwen3 E128 I768": (65536, 2048, 768, 128),
    "fine E256 I512": (32768, 2048, 512, 256),
    "fine E64 I1408": (32768, 2048, 1408, 64),
    "fine E128 I1536 small": (16384, 4096, 1536, 128),
    "mid dsv3 E32 I2048": (32768, 7168, 2048, 32),
    "unaligned gptoss E32 H2880": (32768, 2880, 2880, 32),
    "unaligned E16 H2880 I1408": (16384, 2880, 1408, 16),
    "unaligned E16 H2880 I8192": (16384, 2880, 8192, 16),
    "unaligned E16 H5120 I2880": (16384, 5120, 2880, 16),
    "coarse mixtral E8 I14336": (32768, 4096, 14336, 8),
    "coarse E16 I8192": (16384, 6144, 8192, 16),
    "coarse E16 H6144 I10752": (32768, 6144, 10752, 16),
}


def auto_config(name, m, h, i, e):
    """The `tuning.LaunchConfig` the wrappers choose for kernel ``name`` of this shape."""
    from te_fused_ops.backends.sm90.kernels import grouped_gemm, grouped_wgrad, tuning
    from te_fused_ops.backends.sm90.kernels.launch import num_sms

    sms = num_sms(torch.cuda.current_device())
    if "wgrad" in name:
        n, k = (h, i) if name.startswith("FC2") else (2 * i, h)
        return tuning.LaunchConfig(*grouped_wgrad.choose_config(n, k, sms))
    n, k = {"FC1 fwd + SwiGLU": (2 * i, h), "FC2 fwd": (h, i), "FC2 dgrad + dSwiGLU": (i, h), "FC1 dgrad": (h, 2 * i)}[name]
    tiles = {}
    if "fwd" in name:
        tiles = grouped_gemm.forward_tiles(grouped_gemm._FWD, "nk", "swiglu" if "SwiGLU" in name else None)
    return grouped_gemm.heuristic_config(m, n, k, e, sms, tiles, act_epilogue="SwiGLU" in name)


def time_configs(fns: dict) -> dict:
    times = {label: [] for label in fns}
    for fn in fns.values():
        sustained_ms(fn, 0.1, 0.05)
    for order in (list(fns), list(fns)[::-1]):
        for label in order:
            times[label].append(sustained_ms(fns[label], 0.05, 0.1) * 1e3)
    return {label: min(v) for label, v in times.items()}


def problem(m, h, i, e):
    """(mlp, offsets, x, dy) of one swept shape: the bf16 SwiGLU MLP on skewed routing."""
    torch.manual_seed(0)
    splits = skewed_splits(m, e, 0, align=8).cuda()
    offsets = torch.nn.functional.pad(splits.cumsum(0), (1, 0)).to(torch.int32)
    mlp = Sequential(GroupedLinear(e, h, 2 * i, dtype=torch.bfloat16, device="cuda"), SwiGLU(),
                     GroupedLinear(e, i, h, dtype=torch.bfloat16, device="cuda"))
    x = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    dy = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    return mlp, offsets, x, dy


def selected(p, parts: str):
    """(name, callable(**config)) of the step's kernels whose name holds one of ``parts`` (all if empty)."""
    return [(kernel, fn) for kernel, fn in step_kernels(*p).items()
            if not parts or any(part in kernel for part in parts.split(","))]


def first(out):
    return out[0] if isinstance(out, tuple) else out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=",".join(SWEEP_SHAPES))
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--pingpong", action="store_true",
                        help="also the ping-pong schedule (labels TxCp) at tile_n 128 and 192")
    parser.add_argument("--kernels", default="",
                        help="comma-separated substrings: sweep only the kernels whose name holds one")
    parser.add_argument("--configs", default="",
                        help="comma-separated labels (256x2, 192x2p, ...): only these configurations")
    parser.add_argument("--precompile", action="store_true",
                        help="first compile every swept kernel in parallel processes (`precompile`)")
    args = parser.parse_args()
    swept = list(configs(args.pingpong or bool(args.configs)))
    if args.configs:
        labels = args.configs.split(",")
        unknown = set(labels) - {config_label(c) for c in swept}
        if unknown:
            parser.error(f"--configs: unknown {sorted(unknown)}")
        swept = [c for c in swept if config_label(c) in labels]
    problems = {shape: problem(*SWEEP_SHAPES[shape]) for shape in args.shapes.split(",")}
    if args.precompile:
        from te_fused_ops import kernel_cache
        from te_fused_ops.precompile import compile_step_kernels

        def every_launch():
            for shape, p in problems.items():
                for kernel, fn in selected(p, args.kernels):
                    for config in dict.fromkeys([*swept, auto_config(kernel, *SWEEP_SHAPES[shape])]):
                        fn(**config_kwargs(config))

        print("precompile:", compile_step_kernels(every_launch), flush=True)
        kernel_cache.wait_for_background()
    results = {}
    for shape in list(problems):
        p, (m, h, i, e) = problems[shape], SWEEP_SHAPES[shape]
        results[shape] = {}
        for kernel, fn in selected(p, args.kernels):
            auto = auto_config(kernel, m, h, i, e)
            reference = first(fn()).clone()
            fns, equal = {}, {}
            for config in dict.fromkeys([*swept, auto]):
                label = config_label(config)
                run = (lambda fn=fn, config=config: fn(**config_kwargs(config)))
                equal[label] = bool(torch.equal(first(run()), reference))
                fns[label] = run
            times = time_configs(fns)
            best = min(times, key=times.get)
            auto_label = config_label(auto)
            results[shape][kernel] = {"us": times, "auto": auto_label, "best": best, "equal": equal,
                                      "auto_over_best": times[auto_label] / times[best]}
            print(f"{shape:28s} {kernel:20s} " + " ".join(f"{k} {v:7.0f}" for k, v in times.items())
                  + f"  auto {auto_label} best {best} {times[auto_label] / times[best]:.3f}"
                  + ("" if all(equal.values()) else f"  NOT EQUAL {equal}"), flush=True)
        del problems[shape], p
        torch.cuda.empty_cache()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"sweep_configs_{device_tag(torch.cuda.get_device_name())}.json")
    with open(path, "w") as f:
        json.dump({"configs": [config_label(c) for c in swept], "shapes": SWEEP_SHAPES,
                   "results": results}, f, indent=1)
    worst = max((r["auto_over_best"], s, k) for s, rs in results.items() for k, r in rs.items())
    print(f"worst default/best: {worst[0]:.3f} ({worst[1]}, {worst[2]})")
    sys.exit(0)


if __name__ == "__main__":
    main()
