"""FC1 reading x's rows by index inside the GEMM against the permute pass and FC1 on its output.

Per layer shape (`bench_moe_layer.SHAPES`: T tokens, top-k over E experts, H, I; skewed top-k
routing, seed 0), bf16, FC1 + SwiGLU (W1 (E, 2I, H)):
  permute + FC1          the library's permute (`moe_rows.scatter_rows`, x -> expert order) and
                         `grouped_gemm_sm90` on its output, the heuristic's configuration
                         (ping-pong where it pays): what the fused layer runs today
  permute + FC1 coop     the same with the gathered kernel's cooperative tile and cluster
  gathered FC1           `grouped_gemm_gathered_sm90(x, token of each row, W1, offsets)`
  FC1 alone              `grouped_gemm_sm90` on rows permuted beforehand (what the permute costs)
The gathered kernel's output is checked bit for bit against "permute + FC1 coop" (same tile) on
NaN-filled buffers before anything is timed. Times: `common.sustained_ms` medians (L2 flushed
before each call), variants in rotated order.

    python benchmarks/bench_gathered_sm90.py [--shapes qwen3-30b-a3b,...] [--out DIR]
"""

import argparse

from common import require_sm90

if __name__ == "__main__":
    require_sm90(__file__)

import torch
from bench_moe_layer import SHAPES, skewed_topk
from common import device_tag, rotated_medians, sustained_ms, write_results

from te_fused_ops.backends.sm90.kernels import grouped_gemm as gg
from te_fused_ops.backends.sm90.kernels import moe_rows
from te_fused_ops.backends.sm90.kernels.launch import num_sms
from te_fused_ops.routing import route

VARIANTS = ("permute + FC1", "permute + FC1 coop", "gathered FC1", "FC1 alone")


def problem(name: str):
    """x (T, H), the routing's slot rows and kept count, each row's token (M,) int32, W1, offsets."""
    t, k, e, h, i = SHAPES[name]
    indices, _ = skewed_topk(t, k, e)
    routing = route(indices.cuda(), e)
    torch.manual_seed(0)
    x = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    w1 = (torch.randn(e, 2 * i, h, device="cuda") / h**0.5).bfloat16()
    tokens = (routing.row_slots // k).int()
    return x, routing, tokens, w1, routing.offsets


def variants(x, routing, tokens, w1, offsets) -> dict:
    m, n = tokens.shape[0], w1.shape[1]
    tile_n, cluster_m = gg.choose_config(m, n, w1.shape[0], num_sms(x.get_device()),
                                         **gg.forward_tiles("grouped_gemm_sm90", "nk", "swiglu"))
    coop = dict(tile_n=tile_n, cluster_m=cluster_m, pingpong=False)
    permuted = moe_rows.scatter_rows(x, routing.slot_rows, routing.num_kept)

    def permute_fc1(**cfg):
        rows = moe_rows.scatter_rows(x, routing.slot_rows, routing.num_kept)
        return gg.grouped_gemm_sm90(rows, w1, offsets, activation="swiglu", **cfg)

    return {
        "permute + FC1": lambda: permute_fc1(),
        "permute + FC1 coop": lambda: permute_fc1(**coop),
        "gathered FC1": lambda: gg.grouped_gemm_gathered_sm90(x, tokens, w1, offsets, activation="swiglu",
                                                              tile_n=tile_n, cluster_m=cluster_m),
        "FC1 alone": lambda: gg.grouped_gemm_sm90(permuted, w1, offsets, activation="swiglu"),
    }, (tile_n, cluster_m)


def check(fns: dict, m: int, n: int) -> None:
    """The gathered kernel equals FC1 on the permuted copy with the same tile, bit for bit."""
    for shape in ((m, n), (m, n // 2)):
        torch.full(shape, float("nan"), dtype=torch.bfloat16, device="cuda")  # left in the allocator
    got = fns["gathered FC1"]()
    want = fns["permute + FC1 coop"]()
    if not all(torch.equal(a, b) for a, b in zip(got, want)):
        raise SystemExit("gathered FC1 differs from FC1 on the permuted rows")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    rows, results = [], {}
    for name in args.shapes.split(","):
        x, routing, tokens, w1, offsets = problem(name)
        fns, config = variants(x, routing, tokens, w1, offsets)
        check(fns, tokens.shape[0], w1.shape[1])
        us = {label: 1e3 * ms for label, ms in rotated_medians(fns, sustained_ms).items()}
        results[name] = {"us": us, "tile_n, cluster_m": config}
        rows.append(f"| {name} | {config[0]}x{config[1]} | " + " | ".join(f"{us[v]:.0f}" for v in VARIANTS)
                    + f" | {us['permute + FC1'] / us['gathered FC1']:.3f} |")
        print(name, config, {v: round(us[v], 1) for v in VARIANTS}, flush=True)
    table = "\n".join([f"FC1 + SwiGLU with its rows gathered in the GEMM, bf16, {device}; us (sustained medians)", "",
                       "| shape | gathered tile | " + " | ".join(VARIANTS) + " | permute + FC1 / gathered |",
                       "|---|---|" + "---|" * len(VARIANTS) + "---|", *rows])
    print(table)
    if args.out:
        write_results(args.out, f"gathered_fc1_{device_tag(device)}", {"device": device, "results": results}, table)


if __name__ == "__main__":
    main()
