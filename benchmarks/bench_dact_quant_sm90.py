"""FC2's FP8 data gradient + dSwiGLU with d_pre cast in the epilogue (GroupGemm + dActivation +
Quantize + Transpose) against the kernel followed by the cast kernel, per kernel and per step.

Kernels (uneven seeded routing; dy (M, H) and W^T (E, I, H) cast as the FP8 step casts them):
  dact            grouped_dgrad_dact_fp8_sm90: d_pre (M, 2I) in bf16
  dact t256       the same at tile_n 256 (each block's product in two halves; d_pre checked bit-equal)
  dact + cast     the same, then block_columns_sm90(d_pre, rows=True): the row-wise and per-group
                  column-wise 1x128 copies FC1's data and weight gradients read (the unfused step)
  dact quant      grouped_dgrad_dact_quant_fp8_sm90: both copies from the epilogue, no bf16 d_pre
Both paths' copies are checked bit for bit first. Step: the all-fp8_blockwise MLP step
(Quantize, GroupedLinear, SwiGLU, Quantize, Transpose, GroupedLinear; gradients set to None
first) with rule 'grouped_linear+dactivation+quantize+transpose+grouped_linear' casting d_pre in
the epilogue, and the same plan with FC1's casts unfused (its FP8 weight-gradient check patched
off, which takes the rule's unfused order), plus the bf16 fused step; outputs and gradients
checked bit-equal between the two FP8 paths; extra peak memory of one step. Times:
`common.sustained_ms` medians, variants in rotated order. gptoss-120b-ep4 (I = 2880) is not a
multiple of 128: not run.

    python benchmarks/bench_dact_quant_sm90.py [--shapes qwen3-30b-a3b,...] [--parts kernels,step] [--out DIR]
"""

import argparse
import math
import os

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import (
    device_tag,
    extra_peak_mib,
    mlp_problem,
    model_shape,
    rotated_medians,
    skewed_splits,
    sustained_ms,
    write_results,
)

import te_fused_ops.backends.sm90.rules as dact_rule
from te_fused_ops import Quantize, Sequential, SwiGLU, Transpose
from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90, block_quantize_sm90
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_dgrad_dact_fp8_sm90, grouped_dgrad_dact_quant_fp8_sm90

SHAPES = ("qwen3-30b-a3b", "dsv3-ep8", "mixtral-8x7b")


def time_us(fn):
    return sustained_ms(fn, 0.3, 0.3) * 1e3


def kernels(name):
    m, h, i, e = model_shape(name)
    torch.manual_seed(0)
    splits = skewed_splits(m, e, 0, align=8)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), splits.cumsum(0)]).to(torch.int32).cuda()
    dy = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(e, h, i, device="cuda") / math.sqrt(h)).to(torch.bfloat16)
    fp8 = (*block_quantize_sm90(dy, 1), *block_quantize_sm90(w, 128, transposed=True)[2:])
    pre = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16)

    def dact():
        return grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, activation="swiglu")[0]

    def dact_cast():
        return block_columns_sm90(dact(), offsets, rows=True)

    def dact_quant():
        return grouped_dgrad_dact_quant_fp8_sm90(*fp8, offsets, pre, activation="swiglu")

    def dact_wide():
        return grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, activation="swiglu", tile_n=256)[0]

    assert torch.equal(dact_wide().view(torch.int16), dact().view(torch.int16)), f"{name}: dact t256 differs"
    columns, rows, row_scale = dact_cast()
    (q_rows, q_row_scale), q_columns, _ = dact_quant()
    used = int(((splits + 127) // 128).sum())
    assert torch.equal(q_rows.view(torch.uint8), rows.view(torch.uint8)) and torch.equal(q_row_scale, row_scale)
    assert torch.equal(q_columns.data.view(torch.uint8)[:, : 128 * used], columns.data.view(torch.uint8)[:, : 128 * used])
    assert torch.equal(q_columns.scale_inv[:used], columns.scale_inv[:used])
    us = rotated_medians({"dact": dact, "dact t256": dact_wide, "dact + cast": dact_cast, "dact quant": dact_quant},
                         time_us)
    return {"shape": name, "us": us, "dact_tflops": 2 * m * h * i / us["dact"] / 1e6,
            "dact_t256_tflops": 2 * m * h * i / us["dact t256"] / 1e6}


def step(name):
    splits, fc1, fc2, x, dy = mlp_problem(name)
    fp8 = Sequential(Quantize("fp8_blockwise"), fc1, SwiGLU(), Quantize("fp8_blockwise"), Transpose(), fc2)
    assert "grouped_linear+dactivation+grouped_linear" in fp8.explain(x, split_sizes=splits)
    leaves = [x, fc1.weight, fc2.weight]
    applies = dact_rule.fp8_wgrad_applies

    def run(model, fused):
        dact_rule.fp8_wgrad_applies = applies if fused else (lambda *args: False)
        try:
            for t in leaves:
                t.grad = None
            y = model(x, split_sizes=splits)
            y.backward(dy)
        finally:
            dact_rule.fp8_wgrad_applies = applies
        return [y.detach(), *[t.grad for t in leaves]]

    variants = {"fp8 cast in epilogue": (fp8, True), "fp8 cast after": (fp8, False),
                "bf16 fused": (Sequential(fc1, SwiGLU(), fc2), True)}
    outputs = {label: run(*v) for label, v in variants.items()}
    peak_mib = {label: extra_peak_mib(lambda v=v: run(*v)) for label, v in variants.items()}
    pairs = zip(outputs["fp8 cast in epilogue"], outputs["fp8 cast after"])
    assert all(torch.equal(a, b) for a, b in pairs), f"{name}: the two FP8 steps differ"
    us = rotated_medians({label: (lambda v=v: run(*v)) for label, v in variants.items()}, time_us)
    return {"shape": name, "us": us, "peak_mib": peak_mib}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--parts", default="kernels,step", help="kernels, step or both")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    parts = args.parts.split(",")
    device = torch.cuda.get_device_name()
    kernel_rows, step_rows = [], []
    for name in args.shapes.split(","):
        if "kernels" in parts:
            kernel_rows.append(kernels(name))
            print(kernel_rows[-1], flush=True)
        if "step" in parts:
            step_rows.append(step(name))
            print(step_rows[-1], flush=True)
    lines = [f"FC2 FP8 dgrad + dSwiGLU, d_pre cast to its row- and column-wise E4M3 copies, {device}; median us",
             "", "| shape | dact (TFLOPS) | dact t256 (TFLOPS) | dact + cast | dact quant | quant vs dact + cast | "
             "quant over dact |", "|---|---|---|---|---|---|---|"]
    for r in kernel_rows:
        us = r["us"]
        lines.append(f"| {r['shape']} | {us['dact']:.0f} ({r['dact_tflops']:.0f}) | "
                     f"{us['dact t256']:.0f} ({r['dact_t256_tflops']:.0f}) | {us['dact + cast']:.0f} | "
                     f"{us['dact quant']:.0f} | {us['dact + cast'] / us['dact quant']:.2f}x | "
                     f"{us['dact quant'] / us['dact'] - 1:+.0%} |")
    if step_rows:
        lines += ["", "All-fp8_blockwise step (outputs and gradients bit-equal); median us, extra peak MiB of one step",
                  "", "| shape | cast in epilogue | cast after | bf16 fused | epilogue vs after | "
                  "peak MiB epilogue / after |", "|---|---|---|---|---|---|"]
        for r in step_rows:
            us, mib = r["us"], r["peak_mib"]
            lines.append(f"| {r['shape']} | {us['fp8 cast in epilogue']:.0f} | {us['fp8 cast after']:.0f} | "
                         f"{us['bf16 fused']:.0f} | {us['fp8 cast after'] / us['fp8 cast in epilogue']:.3f}x | "
                         f"{mib['fp8 cast in epilogue']:.0f} / {mib['fp8 cast after']:.0f} |")
    text = "\n".join(lines)
    print(text)
    stem = "dact_quant_sm90" if len(parts) == 2 else f"dact_quant_sm90_{parts[0]}"
    write_results(args.out, f"{stem}_{device_tag(device)}", {"device": device, "kernels": kernel_rows,
                                                                     "steps": step_rows}, text)


if __name__ == "__main__":
    main()
