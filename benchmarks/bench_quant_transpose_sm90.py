"""GroupGemm (+ SwiGLU) + Quantize + Transpose on sm90: the forward cast epilogue writing the
column-wise copy too, against the plans without it, per kernel and per step (fp8_blockwise).

Kernels (bf16 operands, uneven seeded routing):
  FC1 + SwiGLU (x (M, H) @ W (E, 2I, H)), the act cast:
    plain                  grouped_gemm_sm90: pre and act in bf16, no cast (the GEMM's own time)
    act quant              grouped_gemm_act_quant_sm90: the act's row-wise E4M3 copy (no columns)
    act quant, then cols   the same, then block_columns_sm90 from those E4M3 rows: the copy a plan
                           without the epilogue's makes in FC2's backward
    act, then cast         grouped_gemm_sm90 (bf16 act), then block_columns_sm90(rows=True): both
                           copies from one read of the bf16 act (the unfused kernels)
    act quant + cols       grouped_gemm_act_quant_sm90(columns=True): both copies from the epilogue
  FC2 (act (M, I) @ W (E, H, I)) without an activation, the output cast (GroupGemm + Quantize +
  Transpose): the same four with the plain GEMM.
The fused copies are checked bit for bit against block_columns_sm90 of the bf16 output first.
Steps (gradients set to None first), each with a column copy made in the forward and with that
copy taken out of the sm90 backend's choices (then made in the backward from the E4M3 rows):
  fc2 fp8   Sequential(GroupedLinear, SwiGLU, Quantize, Transpose, GroupedLinear): the act's copy
            from FC1's epilogue (its output format)
  all fp8   the same after a Quantize of x: x's copy from its cast (FC1's input format,
            `block_columns_sm90(rows=True)`)
The other gradients are checked bit-equal; the one the copy feeds (dW2, dW1) differs, the copy
being cast once from bf16 instead of again from the E4M3 rows: its relative error against the
bf16 fused step's is reported for both and checked not larger with the forward copy; extra peak
memory of one step. Times: `common.sustained_ms` medians, variants in rotated order.
gptoss-120b-ep4 (I = H = 2880) is not a multiple of 128: not run.

    python benchmarks/bench_quant_transpose_sm90.py [--shapes qwen3-30b-a3b,...] [--out DIR]
"""

import argparse
import math
import os

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from bench_dact_quant_sm90 import SHAPES, time_us  # the shapes whose I is a multiple of 128
from common import MODEL_SHAPES, device_tag, extra_peak_mib, mlp_problem, rotated_medians, skewed_splits, write_results

import te_fused_ops.backends.sm90.rules as sm90_rules
from te_fused_ops import Quantize, Sequential, SwiGLU, Transpose
from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_gemm_act_quant_sm90, grouped_gemm_sm90



def same_bytes(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def kernels(label, x, w, offsets, activation):
    """The four variants of one GEMM (+ activation) with its output cast, checked, then timed."""
    used = int(((offsets.diff() + 127) // 128).sum())

    def quant(columns=False):
        return grouped_gemm_act_quant_sm90(x, w, offsets, activation=activation, columns=columns)

    def quant_then_columns():
        _, data, scale_inv = quant()
        return block_columns_sm90(data, offsets, x_scale_inv=scale_inv)

    def plain_then_cast():
        pre, act = grouped_gemm_sm90(x, w, offsets, activation=activation)
        return block_columns_sm90(pre if activation is None else act, offsets, rows=True)

    want_columns, want_rows, want_scale = plain_then_cast()
    _, rows, scale, columns = quant(True)
    grouped = int(offsets[-1])
    assert same_bytes(rows[:grouped], want_rows[:grouped]) and torch.equal(scale[:grouped], want_scale[:grouped]), label
    assert same_bytes(columns.data[:, : 128 * used], want_columns.data[:, : 128 * used]), f"{label}: column data"
    assert torch.equal(columns.scale_inv[:used], want_columns.scale_inv[:used]), f"{label}: column scales"
    us = rotated_medians({"plain": lambda: grouped_gemm_sm90(x, w, offsets, activation=activation),
                          "quant": quant, "quant, then cols": quant_then_columns, "plain, then cast": plain_then_cast,
                          "quant + cols": lambda: quant(True)}, time_us)
    return {"kernel": label, "us": us}


def step(name, all_fp8):
    """The FP8 step with a column copy made in the forward, and with it made in the backward from
    the E4M3 rows: FC2 in FP8 (the act's copy from FC1's epilogue, dW2 differs), or all FP8 (x's
    copy with its rows, FC1's input format; dW1 differs)."""
    splits, fc1, fc2, x, dy = mlp_problem(name)
    ops = [fc1, SwiGLU(), Quantize("fp8_blockwise"), Transpose(), fc2]
    ops = [Quantize("fp8_blockwise"), *ops] if all_fp8 else ops
    models = {fused: Sequential(*ops) for fused in (True, False)}  # the same ops, a plan cache each
    # the sm90 decision to take out (x's copy: FC1's only), and the gradient the copy feeds
    if all_fp8:
        real = sm90_rules.input_columns_wanted
        name_out, stand_in, differs = "input_columns_wanted", lambda lin, *a: lin is not fc1 and real(lin, *a), 2
    else:
        real = sm90_rules.columns_unsupported_reason
        name_out, stand_in, differs = "columns_unsupported_reason", lambda *a: "taken out for the comparison", 3
    leaves = [x, fc1.weight, fc2.weight]

    def run(fused):
        setattr(sm90_rules, name_out, real if fused else stand_in)
        try:
            for t in leaves:
                t.grad = None
            y = models[fused](x, split_sizes=splits)
            y.backward(dy)
        finally:
            setattr(sm90_rules, name_out, real)
        return [y.detach(), *[t.grad for t in leaves]]

    variants = {"copy in forward": True, "copy from rows": False}
    outputs = {label: run(fused) for label, fused in variants.items()}
    peak_mib = {label: extra_peak_mib(lambda f=fused: run(f)) for label, fused in variants.items()}
    got, want = outputs["copy in forward"], outputs["copy from rows"]
    unequal = [j for j in range(4) if j != differs and not torch.equal(got[j], want[j])]
    assert not unequal, f"{name}: outputs {unequal} differ: " + str(
        [((got[j].float() - want[j].float()).norm() / want[j].float().norm()).item() for j in unequal])
    bf16 = Sequential(fc1, SwiGLU(), fc2)(x, split_sizes=splits)
    reference = torch.autograd.grad(bf16, leaves[differs - 1], dy)[0].float()
    err = {label: ((out[differs].float() - reference).norm() / reference.norm()).item()
           for label, out in outputs.items()}
    assert err["copy in forward"] <= err["copy from rows"], f"{name}: errors {err}"
    us = rotated_medians({label: (lambda f=f: run(f)) for label, f in variants.items()}, time_us)
    return {"shape": name, "chain": "all fp8" if all_fp8 else "fc2 fp8", "us": us, "peak_mib": peak_mib,
            "grad": ("dx", "dW1", "dW2")[differs - 1], "rel_err_vs_bf16": err}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    kernel_rows, step_rows = [], []
    for name in args.shapes.split(","):
        m, h, i, e = MODEL_SHAPES[name]
        torch.manual_seed(0)
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), skewed_splits(m, e, 0, align=8).cumsum(0)])
        offsets = offsets.to(torch.int32).cuda()
        x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16)
        act = torch.randn(m, i, device="cuda", dtype=torch.bfloat16)
        w1 = (torch.randn(e, 2 * i, h, device="cuda") / math.sqrt(h)).to(torch.bfloat16)
        w2 = (torch.randn(e, h, i, device="cuda") / math.sqrt(i)).to(torch.bfloat16)
        kernel_rows.append(kernels(f"{name} fc1 + swiglu", x, w1, offsets, "swiglu"))
        kernel_rows.append(kernels(f"{name} fc2", act, w2, offsets, None))
        del x, act, w1, w2
        step_rows += [step(name, False), step(name, True)]
        print(kernel_rows[-2:], step_rows[-2:], flush=True)
    labels = list(kernel_rows[0]["us"])
    lines = [f"GroupGemm (+ SwiGLU) + Quantize + Transpose (fp8_blockwise), {device}; median us", "",
             "| kernel | " + " | ".join(labels) + " | fused vs quant, then cols | fused vs plain, then cast "
             "| columns over quant | fused over plain |", "|---|" + "---|" * (len(labels) + 4)]
    for r in kernel_rows:
        us = r["us"]
        lines.append(f"| {r['kernel']} | " + " | ".join(f"{us[k]:.0f}" for k in labels) +
                     f" | {us['quant, then cols'] / us['quant + cols']:.2f}x | "
                     f"{us['plain, then cast'] / us['quant + cols']:.2f}x | "
                     f"{us['quant + cols'] / us['quant'] - 1:+.0%} | {us['quant + cols'] / us['plain'] - 1:+.0%} |")
    lines += ["", "Step (the other gradients bit-equal); median us, extra peak MiB of one step", "",
              "| shape, chain | copy in forward | copy from rows | forward vs rows | peak MiB forward / rows "
              "| the copy's gradient: rel. error vs bf16, forward / rows |", "|---|---|---|---|---|---|"]
    for r in step_rows:
        us, mib, err = r["us"], r["peak_mib"], r["rel_err_vs_bf16"]
        lines.append(f"| {r['shape']}, {r['chain']} | {us['copy in forward']:.0f} | {us['copy from rows']:.0f} | "
                     f"{us['copy from rows'] / us['copy in forward']:.3f}x | "
                     f"{mib['copy in forward']:.0f} / {mib['copy from rows']:.0f} | "
                     f"{r['grad']}: {err['copy in forward']:.4f} / {err['copy from rows']:.4f} |")
    text = "\n".join(lines)
    print(text)
    write_results(args.out, f"quant_transpose_sm90_{device_tag(device)}", {"device": device, "kernels": kernel_rows,
                                                                          "steps": step_rows}, text)


if __name__ == "__main__":
    main()
