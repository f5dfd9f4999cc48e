"""Block-scaled FP8 grouped GEMM (FC1 forward) vs the bf16 kernel and torch._grouped_mm, sm90.

Per shape (uneven seeded routing; FC1: x (M, H) @ W (E, 2I, H) with SwiGLU and without):
  gmm bf16     torch._grouped_mm on bf16 operands (no activation)
  sm90 bf16    grouped_gemm_sm90, bf16 operands
  sm90 fp8     grouped_gemm_fp8_sm90, E4M3 operands with 1x128 / 128x128 multipliers
Each kernel is first checked against a float64 reference of its own operands (fresh random
inputs, NaN-poisoned outputs); times are do_bench medians with L2 flushed; TFLOPS count 2*M*N*K.

    python benchmarks/bench_fp8_sm90.py [--shapes dsv3-ep8,mixtral-8x7b] [--out DIR]
"""

import argparse

import torch
import triton.testing
from common import MODEL_SHAPES, device_tag, skewed_splits, write_results

from te_fused_ops.kernels.grouped_gemm import grouped_gemm_fp8_sm90, grouped_gemm_sm90
from te_fused_ops.quantization import quantize, quantize_weight
from te_fused_ops.splits import split_offsets


def bench_us(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def check(out, x64, w64, offsets, what):
    """Relative error of ``out`` (no activation) against float64, group by group."""
    ref = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    bounds = offsets.tolist()
    for g in range(w64.shape[0]):
        s, e = bounds[g], bounds[g + 1]
        if e > s:
            ref[s:e] = x64[s:e] @ w64[g].T
    assert not torch.isnan(out).any(), f"{what}: NaN left in the output"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-2, f"{what}: relative error {err:.2e}"
    return err


def run_shape(name):
    m, h, i, e = MODEL_SHAPES[name]
    n = 2 * i
    torch.manual_seed(0)
    x = torch.randn(m, h, device="cuda")
    w = torch.randn(e, n, h, device="cuda") / h**0.5
    offsets = split_offsets(skewed_splits(m, e, 0, align=8).cuda(), m)
    xb, wb = x.bfloat16(), w.bfloat16()
    qx, qw = quantize(x, "fp8_blockwise"), quantize_weight(w, "fp8_blockwise")
    xq, xs, wq, ws = qx.rowwise_data, qx.rowwise_scale_inv, qw.rowwise_data, qw.rowwise_scale_inv
    x8 = qx.dequantize(torch.float32).double()
    w8 = qw.dequantize(torch.float32).double()
    poisoned = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    errors = {
        "sm90 bf16": check(grouped_gemm_sm90(xb, wb, offsets, out=poisoned.clone())[0], xb.double(), wb.double(), offsets, "bf16"),
        "sm90 fp8": check(grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, out=poisoned.clone())[0], x8, w8, offsets, "fp8"),
    }
    ends = offsets[1:]
    variants = {
        "gmm bf16": lambda: torch._grouped_mm(xb, wb.transpose(-2, -1), offs=ends),
        "sm90 bf16": lambda: grouped_gemm_sm90(xb, wb, offsets),
        "sm90 bf16 + swiglu": lambda: grouped_gemm_sm90(xb, wb, offsets, activation="swiglu"),
        "sm90 fp8": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets),
        "sm90 fp8 + swiglu": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu"),
    }
    flops = 2 * int(offsets[-1]) * n * h
    times = {label: bench_us(fn) for label, fn in variants.items()}
    return {"shape": name, "us": times, "tflops": {k: flops / t / 1e6 for k, t in times.items()}, "rel_err": errors}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(MODEL_SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    rows = []
    for name in args.shapes.split(","):
        rows.append(run_shape(name))
        print(name, {k: f"{v:.0f} us" for k, v in rows[-1]["us"].items()}, flush=True)
    labels = list(rows[0]["us"])
    lines = [
        f"FC1 forward, block-scaled FP8 vs bf16, {device}; median us (TFLOPS)",
        "",
        "| shape | " + " | ".join(labels) + " | fp8 vs sm90 bf16 |",
        "|---|" + "---|" * (len(labels) + 1),
    ]
    for r in rows:
        cells = [f"{r['us'][k]:.0f} ({r['tflops'][k]:.0f})" for k in labels]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {r['us']['sm90 bf16'] / r['us']['sm90 fp8']:.2f}x |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_results(args.out, f"fp8_sm90_{device_tag(device)}", {"device": device, "results": rows}, table)


if __name__ == "__main__":
    main()
