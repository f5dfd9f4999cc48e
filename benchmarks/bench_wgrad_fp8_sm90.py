"""FP8 weight gradient on Hopper: the block-scaled path (what an fp8_blockwise step runs) against
the bf16 one (what it ran before, and what fp8_current runs).

Per shape and linear (uneven seeded routing; FC1: dy = d_pre (M, 2I), x (M, H); FC2: dy (M, H),
x = act (M, I)), the weight gradient of an FP8 MLP step, with the casts each path needs beyond
the row-wise cast of dy that the FP8 data gradient makes anyway:
  wgrad bf16      grouped_wgrad_sm90(dy, x dequantized)
  dy row cast     block_quantize_sm90(dy, 1)  (the data gradient's operand, both paths)
  x dequant       block_dequantize_sm90 of x's row-wise E4M3 copy (bf16 path)
  wgrad fp8       grouped_wgrad_fp8_sm90 on block-padded column-wise copies (c1: cluster_m 1;
                  overlap: two block products in flight, each promoted under the next one's WGMMAs;
                  t192 / t256: 192- / 256-wide tiles (256: each block's product in two halves);
                  each checked bit-equal to "wgrad fp8" first)
  dy cols+rows    block_columns_sm90(dy, rows=True): the column-wise copy and the row-wise one
                  from one read (replaces the row cast)
  x cols          block_columns_sm90 from x's row-wise E4M3 copy (replaces the dequantize)
  wgrad torch fp8 rowwise  torch._scaled_grouped_mm (2d x 2d, groups along the tokens): dy^T and
                  x^T in E4M3 with one multiplier per (group, feature), torch's own FP8 recipe on
                  sm90 (checked on a corner of each group against float64 of its operands; "did
                  not run" with the reason where this torch build does not take it)
  bf16 path = wgrad bf16 + row cast + dequant; fp8 path = wgrad fp8 + dy cols+rows + x cols.
Each FP8 weight gradient is first checked against a float64 reference of its own operands on a
256 x 256 corner of every group (NaN-poisoned output); "rel diff" is its distance from the bf16
weight gradient (the quantization of dy along tokens). Times: do_bench medians, L2 flushed, the
variants in rotated order (`common.rotated_medians`).

    python benchmarks/bench_wgrad_fp8_sm90.py [--shapes qwen3-30b-a3b,...] [--out DIR]
"""

import argparse
import os

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import MODEL_SHAPES, device_tag, model_shape, rotated_medians, skewed_splits, write_results

from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90, block_dequantize_sm90, block_quantize_sm90
from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_fp8_sm90, grouped_wgrad_sm90
from te_fused_ops.quantization import group_block_index

COLUMNS = ("wgrad bf16", "dy row cast", "x dequant", "wgrad fp8", "wgrad fp8 c1", "wgrad fp8 overlap",
           "wgrad fp8 t192", "wgrad fp8 t256", "dy cols+rows", "x cols")


def bench_us(fn):
    import triton.testing  # here, not at the top: --help reads without triton
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


def check_corner(dw, dy_cols, x_cols, offsets, m):
    """dW[g][:256, :256] against float64 from the padded copies' values (every group)."""
    block, _ = group_block_index(offsets, m, 128)
    ends = offsets[1:].long().cummax(0).values
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    for g in range(len(ends)):
        s, e = int(starts[g]), int(ends[g])
        if e == s:
            continue
        rows = torch.arange(s, e, device=dw.device)
        cols = 128 * block[s:e] + (rows - s) % 128
        a = dy_cols.data[:256, cols].double() * dy_cols.scale_inv[block[s:e], :256].T.double()
        b = x_cols.data[:256, cols].double() * x_cols.scale_inv[block[s:e], :256].T.double()
        ref = a @ b.T
        err = ((dw[g, :256, :256].double() - ref).norm() / ref.norm()).item()
        assert err <= 5e-3, f"group {g}: rel error {err:.2e}"


def rowwise_wgrad(dy, x, offsets):
    """torch._scaled_grouped_mm's FP8 weight gradient on sm90 (2d x 2d, groups along the tokens): dy^T
    (N, M) and x^T (K, M) in E4M3 with one multiplier per (group, feature), torch's recipe for it.
    Returns (a callable, the float64 dW of its quantized operands on a 256 x 256 corner of each
    group), or (None, the error) where this torch build does not run it."""
    bounds = offsets.tolist()
    sizes = torch.tensor([b - a for a, b in zip(bounds, bounds[1:])], device=dy.device)
    group_of = torch.repeat_interleave(torch.arange(len(sizes), device=dy.device), sizes)

    def cast(t):  # t (C, M) -> E4M3 (C, M), multipliers (G, C)
        amax = torch.stack([t[:, a:b].abs().amax(1) if b > a else t.new_ones(t.shape[0])
                            for a, b in zip(bounds, bounds[1:])])
        scale = amax.clamp(min=1e-12) / 448.0
        q = (t / scale[group_of].t()).to(torch.float8_e4m3fn).contiguous()
        return q, scale.contiguous(), q.double() * scale[group_of].t().double()

    aq, a_scale, a64 = cast(dy.t().float())
    bq, b_scale, b64 = cast(x.t().float())
    ref = torch.stack([a64[:256, a:b] @ b64[:256, a:b].t() for a, b in zip(bounds, bounds[1:])])

    def run():
        return torch._scaled_grouped_mm(aq, bq.t(), a_scale.reshape(-1), b_scale.reshape(-1), offs=offsets[1:],
                                        out_dtype=torch.bfloat16)

    try:
        run()
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        return None, str(err).splitlines()[0]
    return run, ref


def run(name, part, m, n, k, e):
    splits = skewed_splits(m, e).cuda()
    offsets = torch.cat([splits.new_zeros(1), splits.cumsum(0)]).int()
    dy = torch.randn(m, n, device="cuda").bfloat16()
    x_data, x_scale = block_quantize_sm90(torch.randn(m, k, device="cuda").bfloat16(), 1)
    x_deq = block_dequantize_sm90(x_data, x_scale, torch.bfloat16)
    dy_cols, _, _ = block_columns_sm90(dy, offsets, rows=True)
    x_cols = block_columns_sm90(x_data, offsets, x_scale_inv=x_scale)
    out = torch.full((e, n, k), float("nan"), dtype=torch.bfloat16, device="cuda")
    dw = grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, out=out)
    check_corner(dw, dy_cols, x_cols, offsets, m)
    for label, options in (("overlap", dict(overlap_promotion=True)), ("t192", dict(tile_n=192)),
                           ("t256", dict(tile_n=256))):
        variant = grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, out=torch.full_like(out, float("nan")), **options)
        if not torch.equal(variant, dw):
            raise SystemExit(f"{name} {part}: wgrad fp8 {label} differs from the default mainloop")
    ref = grouped_wgrad_sm90(dy, x_deq, offsets).float()
    diff = ((dw.float() - ref).norm() / ref.norm()).item()
    # torch's FP8 weight gradient, on groups of multiples of 16 tokens (the same skew)
    offsets16 = torch.cat([splits.new_zeros(1), skewed_splits(m, e, align=16).cuda().cumsum(0)]).int()
    rowwise, rowwise_ref = rowwise_wgrad(dy, x_deq, offsets16)
    rowwise_err = f"did not run: {rowwise_ref}"
    if rowwise is not None:
        got = rowwise()[:, :256, :256].double()
        rowwise_err = ((got - rowwise_ref).norm() / rowwise_ref.norm()).item()
        if not rowwise_err <= 5e-3:
            raise SystemExit(f"{name} {part}: torch._scaled_grouped_mm rel error {rowwise_err:.2e}")
    variants = {
        "wgrad bf16": lambda: grouped_wgrad_sm90(dy, x_deq, offsets),
        "dy row cast": lambda: block_quantize_sm90(dy, 1),
        "x dequant": lambda: block_dequantize_sm90(x_data, x_scale, torch.bfloat16),
        "wgrad fp8": lambda: grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets),
        "wgrad fp8 c1": lambda: grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, cluster_m=1),
        "wgrad fp8 overlap": lambda: grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, overlap_promotion=True),
        "wgrad fp8 t192": lambda: grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, tile_n=192),
        "wgrad fp8 t256": lambda: grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets, tile_n=256),
        "dy cols+rows": lambda: block_columns_sm90(dy, offsets, rows=True),
        "x cols": lambda: block_columns_sm90(x_data, offsets, x_scale_inv=x_scale),
    }
    if rowwise is not None:
        variants["wgrad torch fp8 rowwise"] = rowwise
    us = rotated_medians(variants, bench_us)
    flops = 2 * m * n * k
    return {
        "shape": name, "linear": part, "m": m, "n": n, "k": k, "groups": e, "us": us, "rel_diff_vs_bf16": diff,
        "torch_fp8_rowwise_rel_err": rowwise_err,
        "tflops_torch_fp8_rowwise": flops / us["wgrad torch fp8 rowwise"] / 1e6 if rowwise is not None else None,
        "tflops_bf16": flops / us["wgrad bf16"] / 1e6, "tflops_fp8": flops / us["wgrad fp8"] / 1e6,
        "bf16_path_us": us["wgrad bf16"] + us["dy row cast"] + us["x dequant"],
        "fp8_path_us": us["wgrad fp8"] + us["dy cols+rows"] + us["x cols"],
    }


def table(rows, device):
    head = ["shape", "linear", *COLUMNS, "wgrad torch fp8 rowwise", "TFLOPS bf16 / fp8", "bf16 path", "fp8 path",
            "fp8 / bf16 path", "rel diff"]
    lines = [f"Weight gradient of an FP8 MLP step, {device}; median us", "", "| " + " | ".join(head) + " |",
             "|" + "---|" * len(head)]
    for r in rows:
        torch_us = r["us"].get("wgrad torch fp8 rowwise")
        cells = [r["shape"], r["linear"], *(f"{r['us'][c]:.0f}" for c in COLUMNS),
                 "-" if torch_us is None else f"{torch_us:.0f} ({r['tflops_torch_fp8_rowwise']:.0f})",
                 f"{r['tflops_bf16']:.0f} / {r['tflops_fp8']:.0f}", f"{r['bf16_path_us']:.0f}",
                 f"{r['fp8_path_us']:.0f}", f"{r['fp8_path_us'] / r['bf16_path_us']:.2f}x", f"{r['rel_diff_vs_bf16']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(MODEL_SHAPES), help="comma-separated names or MxHxIxE sizes")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    rows = []
    for name in args.shapes.split(","):
        m, h, i, e = model_shape(name)
        for part, (n, k) in (("fc1", (2 * i, h)), ("fc2", (h, i))):
            rows.append(run(name, part, m, n, k, e))
            print(rows[-1], flush=True)
    device = torch.cuda.get_device_name()
    text = table(rows, device)
    print(text)
    write_results(args.out, f"wgrad_fp8_sm90_{device_tag(device)}", {"device": device, "results": rows}, text)


if __name__ == "__main__":
    main()
