"""FC2's FP8 data gradient + dSwiGLU and d_pre's cast to FC1's E4M3 copies (GroupGemm +
dActivation, then Quantize + Transpose), per kernel and per step.

Kernels (uneven seeded routing; dy (M, H) and W^T (E, I, H) cast as the FP8 step casts them):
  dact            grouped_dgrad_dact_fp8_sm90: d_pre (M, 2I) in bf16
  dact t256       the same at tile_n 256 (each block's product in two halves; d_pre checked bit-equal)
  dact + cast     the same, then block_columns_sm90(d_pre, rows=True): the row-wise and per-group
                  column-wise 1x128 copies FC1's data and weight gradients read (as the step runs)
The copies are checked bit for bit against the torch quantizer first. Step: the all-fp8_blockwise
MLP step (Quantize, GroupedLinear, SwiGLU, Quantize, Transpose, GroupedLinear; gradients set to
None first; rule 'grouped_linear+dactivation+grouped_linear') and the bf16 fused step, extra peak
memory of one step. Times: `common.sustained_ms` medians, variants in rotated order.

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

from te_fused_ops import Quantize, Sequential, SwiGLU, Transpose
from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90, block_quantize_sm90
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_dgrad_dact_fp8_sm90
from te_fused_ops.quantization import Float8BlockScaling, quantize

SHAPES = ("qwen3-30b-a3b", "dsv3-ep8", "mixtral-8x7b")  # I a multiple of 128 (`bench_quant_transpose_sm90.py`)


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

    def dact_wide():
        return grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, activation="swiglu", tile_n=256)[0]

    d_pre = dact()
    assert torch.equal(dact_wide().view(torch.int16), d_pre.view(torch.int16)), f"{name}: dact t256 differs"
    _, rows, row_scale = dact_cast()
    q = quantize(d_pre, Float8BlockScaling(), rowwise=True, columnwise=False)
    assert torch.equal(q.rowwise_data.view(torch.uint8), rows.view(torch.uint8)), f"{name}: d_pre's rows differ"
    assert torch.equal(q.rowwise_scale_inv, row_scale), f"{name}: d_pre's row multipliers differ"
    del d_pre, q, rows, row_scale
    us = rotated_medians({"dact": dact, "dact t256": dact_wide, "dact + cast": dact_cast}, time_us)
    return {"shape": name, "us": us, "dact_tflops": 2 * m * h * i / us["dact"] / 1e6,
            "dact_t256_tflops": 2 * m * h * i / us["dact t256"] / 1e6}


def step(name):
    splits, fc1, fc2, x, dy = mlp_problem(name)
    fp8 = Sequential(Quantize("fp8_blockwise"), fc1, SwiGLU(), Quantize("fp8_blockwise"), Transpose(), fc2)
    assert "grouped_linear+dactivation+grouped_linear" in fp8.explain(x, split_sizes=splits)
    leaves = [x, fc1.weight, fc2.weight]

    def run(model):
        for t in leaves:
            t.grad = None
        model(x, split_sizes=splits).backward(dy)

    variants = {"fp8": fp8, "bf16 fused": Sequential(fc1, SwiGLU(), fc2)}
    peak_mib = {label: extra_peak_mib(lambda v=v: run(v)) for label, v in variants.items()}
    us = rotated_medians({label: (lambda v=v: run(v)) for label, v in variants.items()}, time_us)
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
    lines = [f"FC2 FP8 dgrad + dSwiGLU, then d_pre's cast to its row- and column-wise E4M3 copies, {device}; median us",
             "", "| shape | dact (TFLOPS) | dact t256 (TFLOPS) | dact + cast | cast share |", "|---|---|---|---|---|"]
    for r in kernel_rows:
        us = r["us"]
        lines.append(f"| {r['shape']} | {us['dact']:.0f} ({r['dact_tflops']:.0f}) | "
                     f"{us['dact t256']:.0f} ({r['dact_t256_tflops']:.0f}) | {us['dact + cast']:.0f} | "
                     f"{1 - us['dact'] / us['dact + cast']:.0%} |")
    if step_rows:
        lines += ["", "All-fp8_blockwise step and the bf16 fused step; median us, extra peak MiB of one step", "",
                  "| shape | fp8 | bf16 fused | fp8 vs bf16 | peak MiB fp8 / bf16 |", "|---|---|---|---|---|"]
        for r in step_rows:
            us, mib = r["us"], r["peak_mib"]
            lines.append(f"| {r['shape']} | {us['fp8']:.0f} | {us['bf16 fused']:.0f} | "
                         f"{us['bf16 fused'] / us['fp8']:.3f}x | {mib['fp8']:.0f} / {mib['bf16 fused']:.0f} |")
    text = "\n".join(lines)
    print(text)
    stem = "dact_quant_sm90" if len(parts) == 2 else f"dact_quant_sm90_{parts[0]}"
    write_results(args.out, f"{stem}_{device_tag(device)}", {"device": device, "kernels": kernel_rows,
                                                                     "steps": step_rows}, text)


if __name__ == "__main__":
    main()
