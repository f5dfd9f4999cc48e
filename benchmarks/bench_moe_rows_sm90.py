"""The MoE row movers of the sm90 backend (`moe_rows`) against torch, in effective GB/s.

Kernels, bf16, dropless top-k routing over 128 experts (T tokens, k slots, M = T * k rows):
  scatter                scatter_rows(x, rows, num_kept, out): the permute's forward
  scatter scaled + dot   the same times the router probs, with dot_out = <x[t], y[row]>: the
                         combine's backward (dy -> expert order, d_probs)
  torch index_select     x.index_select(0, token of each row): torch's permute
  gather                 gather_sum(src, rows, num_kept, out): the permute's backward
  gather weighted        the same weighted by the probs: the combine's forward
  torch.compile gather   (src[rows].float() * probs).sum(1) compiled per shape (weighted)
  copy                   out.copy_(src) of (M, H): what the memory does
Effective bytes count each tensor once: scatter T*H read + M*H written (+ M*H of y with the dot),
gather M*H read + T*H written, copy 2*M*H; the torch contenders are credited with the same bytes
as the kernel they stand for. Outputs are checked against torch first. Times:
`common.sustained_ms` medians (L2 flushed before each call), variants in rotated order.

    python benchmarks/bench_moe_rows_sm90.py [--shapes 8192x8x2048,...] [--out DIR]
"""

import argparse
import os

from common import require_sm90

if __name__ == "__main__":  # before torch and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import (
    compile_per_shape,
    device_tag,
    rotated_medians,
    slot_terms_sum,
    sustained_ms,
    write_results,
)

from te_fused_ops.backends.sm90.kernels.moe_rows import gather_sum, scatter_rows

SHAPES = "8192x8x2048,4096x8x7168,16384x2x4096"  # T x k x H
EXPERTS = 128


def time_us(fn):
    return sustained_ms(fn, 0.2, 0.2) * 1e3


def routing(tokens, k):
    """(rows (T, k) int32, num_kept (1,) int32, row_tokens (M,) int64: the token of each row)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    indices = torch.randint(0, EXPERTS, (tokens, k), device="cuda", generator=gen)
    order = torch.argsort(indices.flatten(), stable=True)
    rows = torch.empty(tokens * k, dtype=torch.int32, device="cuda")
    rows[order] = torch.arange(tokens * k, dtype=torch.int32, device="cuda")
    num_kept = torch.full((1,), tokens * k, dtype=torch.int32, device="cuda")
    return rows.view(tokens, k), num_kept, order // k


@compile_per_shape
def torch_gather_sum(src, slot_rows, weights):
    w = weights.float()
    return slot_terms_sum(src[slot_rows[:, j]].float() * w[:, j, None] for j in range(slot_rows.shape[1])).to(src.dtype)


def measure(tokens, k, hidden):
    rows, num_kept, row_tokens = routing(tokens, k)
    m = tokens * k
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    src = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    probs = torch.rand(tokens, k, device="cuda", generator=gen)
    out_rows, out_tokens, dots = torch.empty_like(src), torch.empty_like(x), probs.new_empty(tokens, k)
    slot_rows = rows.long()

    assert torch.equal(scatter_rows(x, rows, num_kept, out_rows), x.index_select(0, row_tokens))
    want = torch_gather_sum(src, slot_rows, probs)
    got = gather_sum(src, rows, num_kept, out_tokens, weights=probs)
    assert (got.float() - want.float()).abs().max() <= 2**-6 * want.float().abs().max(), "gather_sum differs"

    size = 2  # bytes per bf16
    scatter_bytes = (tokens + m) * hidden * size
    gather_bytes = (m + tokens) * hidden * size
    variants = {  # label: (fn, effective bytes)
        "scatter": (lambda: scatter_rows(x, rows, num_kept, out_rows), scatter_bytes),
        "scatter scaled + dot": (lambda: scatter_rows(x, rows, num_kept, out_rows, scale=probs, y=src, dot_out=dots),
                                 scatter_bytes + m * hidden * size),
        "torch index_select": (lambda: torch.index_select(x, 0, row_tokens, out=out_rows), scatter_bytes),
        "gather": (lambda: gather_sum(src, rows, num_kept, out_tokens), gather_bytes),
        "gather weighted": (lambda: gather_sum(src, rows, num_kept, out_tokens, weights=probs), gather_bytes),
        "torch.compile gather": (lambda: torch_gather_sum(src, slot_rows, probs), gather_bytes),
        "copy": (lambda: out_rows.copy_(src), 2 * m * hidden * size),
    }
    us = rotated_medians({label: fn for label, (fn, _) in variants.items()}, time_us)
    gbps = {label: variants[label][1] / (us[label] * 1e3) for label in variants}
    return {"shape": f"T={tokens} k={k} H={hidden}", "us": us, "GB/s": gbps}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=SHAPES, help="T x k x H, comma-separated")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    results = []
    for shape in args.shapes.split(","):
        results.append(measure(*(int(v) for v in shape.split("x"))))
        print(results[-1], flush=True)
    labels = list(results[0]["us"])
    lines = [f"MoE row movement, bf16, {device}: effective GB/s (median us)", "",
             "| shape | " + " | ".join(labels) + " |", "|---" * (len(labels) + 1) + "|"]
    for r in results:
        lines.append(f"| {r['shape']} | " + " | ".join(f"{r['GB/s'][label]:.0f} ({r['us'][label]:.0f})"
                                                      for label in labels) + " |")
    text = "\n".join(lines)
    print(text)
    write_results(args.out, f"moe_rows_sm90_{device_tag(device)}", {"device": device, "results": results}, text)


if __name__ == "__main__":
    main()
