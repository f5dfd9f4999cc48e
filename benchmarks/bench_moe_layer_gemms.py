"""Each GEMM of the MoE layer's step: the fused layer's sm90 kernel against torch._grouped_mm.

On `bench_moe_layer`'s shapes and routing (skewed top-k, seed 0), rows in expert order as
`Permute` makes them: per shape the six GEMMs of the step (FC1 + SwiGLU, FC2, FC2's data
gradient + dSwiGLU, FC2's weight gradient, FC1's data gradient, FC1's weight gradient), ours
on the permuted copy and, where the layer reads x's rows by index instead
(`rules.GATHER_MAX_WIDTH`, `linear.GATHER_WGRAD_MAX_WIDTH`), the gathered kernel; torch's with its
activation compiled per shape where ours fuses one; and FC1 without the activation (the
epilogue's cost). Each of ours is first compared with torch's result (relative Frobenius error,
bf16 both; FC2 also against float64 on one group). Times: `common.sustained_ms` (L2 flushed, at
the clock a long run settles at), medians of `common.rotated_medians`. A "layer" row per shape
sums the kernels the layer runs against torch's six. Writes
benchmarks/results/moe_layer_gemms_<device>.json/.md (--out DIR: there) and prints the table.

    python benchmarks/bench_moe_layer_gemms.py [--shapes dsv3-ep8,...] [--out DIR]
"""

import argparse
import os
from types import SimpleNamespace
from typing import Callable, NamedTuple

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from bench_moe_layer import RESULTS, ROUTING, SHAPES, dswiglu_math, layer_math, layer_shape, make_problem, swiglu_math
from common import device_tag, rotated_medians, sustained_ms, write_results

from te_fused_ops import kernel_cache, precompile
from te_fused_ops.backends.sm90.kernels.grouped_gemm import (
    grouped_dgrad_dact_sm90, grouped_gemm_gathered_sm90, grouped_gemm_sm90,
)
from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_gathered_sm90, grouped_wgrad_sm90
from te_fused_ops.backends.sm90.linear import GATHER_WGRAD_MAX_WIDTH
from te_fused_ops.backends.sm90.rules import GATHER_MAX_WIDTH
from te_fused_ops.routing import route

TOL = 2e-2
TORCH_STEP = ("FC1 + SwiGLU", "FC2", "FC2 dgrad + dSwiGLU", "FC2 wgrad", "FC1 dgrad", "FC1 wgrad")


def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


class Gemm(NamedTuple):
    ours: Callable
    torch: Callable | None  # None: no torch counterpart (a gathered kernel)
    flops: str              # whose FLOPs: "fc1" or "fc2"


class LayerGemms:
    """The operands of one shape's step (rows in expert order) and each GEMM's two contenders."""

    def __init__(self, name: str, shape):
        t, k, e, h, i = shape
        p = make_problem(name, shape)
        routing = route(p.indices, e)
        self.name, self.max_rows = name, int(routing.counts.max())
        self.gather_fc1, self.gather_wgrad = 2 * i <= GATHER_MAX_WIDTH, 2 * i <= GATHER_WGRAD_MAX_WIDTH
        self.flops = {"fc1": 2 * t * k * h * 2 * i, "fc2": 2 * t * k * i * h}
        tokens = (routing.row_slots // k).to(torch.int32)
        offsets, ends = routing.offsets, routing.offsets[1:]
        x = p.x.detach()
        x_rows = x[tokens.long()]
        w1, w2 = p.fc1.weight.detach(), p.fc2.weight.detach()
        pre = torch._grouped_mm(x_rows, w1.transpose(-2, -1), offs=ends)
        act = swiglu_math(pre)
        dy_rows = torch.randn(x_rows.shape[0], h, device=x.device, dtype=x.dtype)
        d_pre = dswiglu_math(pre, torch._grouped_mm(dy_rows, w2, offs=ends))
        math = layer_math(True)
        gemms = {  # name: (ours, torch's, whose FLOPs)
            "FC1 + SwiGLU": (lambda: grouped_gemm_sm90(x_rows, w1, offsets, activation="swiglu"),
                             lambda: math.swiglu(torch._grouped_mm(x_rows, w1.transpose(-2, -1), offs=ends)), "fc1"),
            "FC1 + SwiGLU gathered": (
                lambda: grouped_gemm_gathered_sm90(x, tokens, w1, offsets, activation="swiglu", pingpong=None),
                None, "fc1"),
            "FC1 (no activation)": (lambda: grouped_gemm_sm90(x_rows, w1, offsets),
                                    lambda: torch._grouped_mm(x_rows, w1.transpose(-2, -1), offs=ends), "fc1"),
            "FC2": (lambda: grouped_gemm_sm90(act, w2, offsets),
                    lambda: torch._grouped_mm(act, w2.transpose(-2, -1), offs=ends), "fc2"),
            "FC2 dgrad + dSwiGLU": (lambda: grouped_dgrad_dact_sm90(dy_rows, w2, offsets, pre, activation="swiglu"),
                                    lambda: math.dswiglu(pre, torch._grouped_mm(dy_rows, w2, offs=ends)), "fc2"),
            "FC2 wgrad": (lambda: grouped_wgrad_sm90(dy_rows, act, offsets),
                          lambda: torch._grouped_mm(dy_rows.t(), act, offs=ends), "fc2"),
            "FC1 dgrad": (lambda: grouped_gemm_sm90(d_pre, w1, offsets, weight_layout="kn"),
                          lambda: torch._grouped_mm(d_pre, w1, offs=ends), "fc1"),
            "FC1 wgrad": (lambda: grouped_wgrad_sm90(d_pre, x_rows, offsets),
                          lambda: torch._grouped_mm(d_pre.t(), x_rows, offs=ends), "fc1"),
            "FC1 wgrad gathered": (lambda: grouped_wgrad_gathered_sm90(d_pre, x, tokens, offsets), None, "fc1"),
        }
        self.gemms = {name: Gemm(*parts) for name, parts in gemms.items()}
        self.layer_runs = ["FC1 + SwiGLU gathered" if self.gather_fc1 else "FC1 + SwiGLU", "FC2", "FC2 dgrad + dSwiGLU",
                           "FC2 wgrad", "FC1 dgrad", "FC1 wgrad gathered" if self.gather_wgrad else "FC1 wgrad"]
        self.operands = SimpleNamespace(x=x, tokens=tokens, x_rows=x_rows, w1=w1, w2=w2, offsets=offsets, ends=ends,
                                        act=act, pre=pre, dy_rows=dy_rows, d_pre=d_pre)

    def check(self) -> dict:
        """Relative error of each of ours against torch's result (and FC2 against float64)."""
        o = self.operands
        x, tokens, x_rows, w1, w2, offsets, ends = o.x, o.tokens, o.x_rows, o.w1, o.w2, o.offsets, o.ends
        act, pre, dy_rows, d_pre = o.act, o.pre, o.dy_rows, o.d_pre
        err = {}
        fc1 = grouped_gemm_sm90(x_rows, w1, offsets, activation="swiglu")
        err["FC1 pre"], err["FC1 act"] = rel_err(fc1[0], pre), rel_err(fc1[1], act)
        err["FC1 gathered pre"] = rel_err(grouped_gemm_gathered_sm90(x, tokens, w1, offsets, activation="swiglu",
                                                                           pingpong=None)[0], pre)
        y = grouped_gemm_sm90(act, w2, offsets)[0]
        err["FC2"] = rel_err(y, torch._grouped_mm(act, w2.transpose(-2, -1), offs=ends))
        g = int(torch.argmax(offsets[1:] - offsets[:-1]))
        start, stop = int(offsets[g]), int(offsets[g + 1])
        err["FC2 float64, largest group"] = rel_err(y[start:stop], act[start:stop].double() @ w2[g].double().t())
        err["FC2 dgrad + dSwiGLU"] = rel_err(grouped_dgrad_dact_sm90(dy_rows, w2, offsets, pre, activation="swiglu")[0],
                                             d_pre)
        err["FC2 wgrad"] = rel_err(grouped_wgrad_sm90(dy_rows, act, offsets),
                                   torch._grouped_mm(dy_rows.t(), act, offs=ends))
        err["FC1 dgrad"] = rel_err(grouped_gemm_sm90(d_pre, w1, offsets, weight_layout="kn")[0],
                                   torch._grouped_mm(d_pre, w1, offs=ends))
        dw1 = torch._grouped_mm(d_pre.t(), x_rows, offs=ends)
        err["FC1 wgrad"] = rel_err(grouped_wgrad_sm90(d_pre, x_rows, offsets), dw1)
        err["FC1 wgrad gathered"] = rel_err(grouped_wgrad_gathered_sm90(d_pre, x, tokens, offsets), dw1)
        return err

    def time(self) -> dict:
        """name -> {"ours": us, "torch": us}."""
        rows = {}
        for name, gemm in self.gemms.items():
            fns = {"ours": gemm.ours} if gemm.torch is None else {"ours": gemm.ours, "torch": gemm.torch}
            rows[name] = rotated_medians(fns, lambda fn: sustained_ms(fn, 0.25, 0.25) * 1e3)
            times = "  ".join(f"{k} {v:8.0f} us" for k, v in rows[name].items())
            print(f"  {self.name:16s} {name:24s} {times}", flush=True)
        return rows


def table(device: str, results: list) -> str:
    lines = [f"MoE layer GEMMs, bf16, {device}: the fused layer's sm90 kernels against torch._grouped_mm on the "
             "layer benchmark's routing; median us (TFLOPS)", "",
             "| shape | GEMM | ours | torch | torch / ours |", "|---|---|---|---|---|"]
    for r in results:
        for name, t in r["us"].items():
            flops = r["flops"][r["flop_key"][name]]
            torch_us = t.get("torch")
            lines.append(f"| {r['shape']} | {name}{' *' if name in r['layer_runs'] else ''} | {t['ours']:.0f} "
                         f"({flops / t['ours'] / 1e6:.0f}) | "
                         + (f"{torch_us:.0f} ({flops / torch_us / 1e6:.0f}) | {torch_us / t['ours']:.3f} |"
                            if torch_us else "- | - |"))
        lines.append(f"| {r['shape']} | layer (the * kernels; torch's six) | {r['layer_ours_us']:.0f} | "
                     f"{r['layer_torch_us']:.0f} | {r['layer_torch_us'] / r['layer_ours_us']:.3f} |")
    lines += ["", "* the kernels the fused layer runs (gathered where it reads x's rows by index); torch's rows "
              "include its activation, compiled per shape"]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {','.join(SHAPES)} or TxkxExHxI")
    ap.add_argument("--out", default=None, help="folder for the .json/.md (default: benchmarks/results)")
    args = ap.parse_args()
    names = args.shapes.split(",") if args.shapes else list(SHAPES)
    layers = [LayerGemms(name, SHAPES[name] if name in SHAPES else layer_shape(name, ap)) for name in names]
    report = precompile.compile_step_kernels(lambda: [g.ours() for layer in layers for g in layer.gemms.values()])
    kernel_cache.wait_for_background()
    print("kernels compiled:", {k: v for k, v in report.items() if not isinstance(v, (list, dict))}, flush=True)
    results = []
    for layer in layers:
        err = layer.check()
        print(f"  {layer.name}: max rows per expert {layer.max_rows}; rel. errors "
              + ", ".join(f"{k} {v:.1e}" for k, v in err.items()), flush=True)
        if max(err.values()) > TOL:
            raise SystemExit(f"{layer.name}: a kernel disagrees with torch ({err}); nothing timed")
        us = layer.time()
        results.append({"shape": layer.name, "max_rows_per_expert": layer.max_rows, "rel_err": err, "us": us,
                        "flops": layer.flops, "flop_key": {n: g.flops for n, g in layer.gemms.items()},
                        "layer_runs": layer.layer_runs,
                        "layer_ours_us": sum(us[n]["ours"] for n in layer.layer_runs),
                        "layer_torch_us": sum(us[n]["torch"] for n in TORCH_STEP)})
    device = torch.cuda.get_device_name()
    text = table(device, results)
    write_results(args.out or RESULTS, f"moe_layer_gemms_{device_tag(device)}",
                  {"device": device, "routing": ROUTING, "tolerance": TOL, "results": results}, text)
    print(text)


if __name__ == "__main__":
    main()
