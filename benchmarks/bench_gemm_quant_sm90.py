"""GroupGemm + Quantize without an activation (rule 'grouped_linear+quantize', fp8_blockwise) on sm90.

For each model shape, FC1 without its activation (x (M, H) @ W (E, 2I, H)) and FC2 (act (M, I) @
W (E, H, I)), bf16, uneven seeded routing; the output cast to E4M3 in 1 x 128 blocks:
  gmm                  torch._grouped_mm alone (no cast; the GEMM's own time)
  gmm + compiled cast  torch._grouped_mm, then a torch.compile'd 1 x 128 cast (what a user writes)
  sm90                 grouped_gemm_sm90 alone (no cast)
  sm90, then cast      grouped_gemm_sm90, then block_quantize_sm90 (the plan without the rule)
  sm90 + cast          grouped_gemm_act_quant_sm90(activation=None): the cast in the epilogue, the
                       bf16 output never written (default tile; "t128": tile_n 128)
Checked first: the sm90 GEMM against float64 (NaN-poisoned output), the fused cast byte for byte
against the cast of the plain kernel's output, the compiled cast within E4M3 rounding of it.
Times: do_bench medians (L2 flushed), median over rounds in rotated order (`common.rotated_medians`).

    python benchmarks/bench_gemm_quant_sm90.py [--shapes qwen3-30b-a3b,...] [--out DIR]
"""

import argparse

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import MODEL_SHAPES, compile_per_shape, device_tag, rotated_medians, skewed_splits, write_results

from te_fused_ops.backends.sm90.kernels.block_quantize import block_quantize_sm90
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_gemm_act_quant_sm90, grouped_gemm_sm90
from te_fused_ops.splits import split_offsets


def bench_us(fn):
    import triton.testing  # here, not at the top: --help reads without triton
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3


@compile_per_shape
def compiled_block_cast(y):
    """A user's 1 x 128 E4M3 cast of y (M, N): (data, scale_inv (M, ceil(N/128)))."""
    n = y.shape[-1]
    blocks = torch.nn.functional.pad(y.float(), (0, -n % 128)).unflatten(-1, (-1, 128))
    scale_inv = blocks.abs().amax(-1, keepdim=True) / 448.0
    scale_inv = torch.where(scale_inv == 0, torch.ones_like(scale_inv), scale_inv)
    data = (blocks / scale_inv).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return data.flatten(-2)[..., :n], scale_inv.squeeze(-1)


def dequantized(data, scale_inv):
    n = data.shape[-1]
    padded = torch.nn.functional.pad(data.float(), (0, -n % 128)).unflatten(-1, (-1, 128))
    return padded.mul(scale_inv[..., None]).flatten(-2)[..., :n]


def rel_err(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def run_gemm(label, m, k, n, e):
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda").bfloat16()
    w = (torch.randn(e, n, k, device="cuda") / k**0.5).bfloat16()
    offsets = split_offsets(skewed_splits(m, e, 0, align=8).cuda(), m)
    ends = offsets[1:]
    poisoned = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    plain = grouped_gemm_sm90(x, w, offsets, out=poisoned)[0]
    want = torch.zeros(m, n, dtype=torch.float64, device="cuda")
    bounds = offsets.tolist()
    for g in range(e):
        want[bounds[g]:bounds[g + 1]] = x[bounds[g]:bounds[g + 1]].double() @ w[g].double().T
    assert rel_err(plain, want) <= 1e-2, f"{label}: sm90 GEMM error"
    cast = block_quantize_sm90(plain, 1)
    for tile_n in (None, 128):
        _, data, scale_inv = grouped_gemm_act_quant_sm90(x, w, offsets, activation=None, tile_n=tile_n)
        assert torch.equal(data.view(torch.uint8), cast[0].view(torch.uint8)), f"{label}: fused cast data"
        assert torch.equal(scale_inv, cast[1]), f"{label}: fused cast scales"
    user = compiled_block_cast(torch._grouped_mm(x, w.transpose(-2, -1), offs=ends))
    assert rel_err(dequantized(*user)[: bounds[-1]], plain[: bounds[-1]]) <= 5e-2, f"{label}: compiled cast"
    variants = {
        "gmm": lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends),
        "gmm + compiled cast": lambda: compiled_block_cast(torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)),
        "sm90": lambda: grouped_gemm_sm90(x, w, offsets),
        "sm90, then cast": lambda: block_quantize_sm90(grouped_gemm_sm90(x, w, offsets)[0], 1),
        "sm90 + cast": lambda: grouped_gemm_act_quant_sm90(x, w, offsets, activation=None),
        "sm90 + cast t128": lambda: grouped_gemm_act_quant_sm90(x, w, offsets, activation=None, tile_n=128),
    }
    times = rotated_medians(variants, bench_us)
    return {"gemm": label, "M": m, "N": n, "K": k, "G": e, "us": times,
            "tflops": {v: 2 * bounds[-1] * n * k / t / 1e6 for v, t in times.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(MODEL_SHAPES))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    rows = []
    for name in args.shapes.split(","):
        m, h, i, e = MODEL_SHAPES[name]
        for label, k, n in ((f"{name} fc1", h, 2 * i), (f"{name} fc2", i, h)):
            rows.append(run_gemm(label, m, k, n, e))
            print(label, {v: f"{t:.0f}" for v, t in rows[-1]["us"].items()}, flush=True)
    labels = list(rows[0]["us"])
    lines = [
        f"GroupGemm + Quantize (fp8_blockwise, 1x128), {device}; median us",
        "",
        "| gemm | " + " | ".join(labels) + " | fused vs sm90, then cast | fused vs gmm + compiled cast "
        "| fused over sm90 alone |",
        "|---|" + "---|" * (len(labels) + 3),
    ]
    for r in rows:
        t = r["us"]
        cells = [f"{t[v]:.0f}" for v in labels]
        lines.append(f"| {r['gemm']} | " + " | ".join(cells) + f" | {t['sm90, then cast'] / t['sm90 + cast']:.2f}x | "
                     f"{t['gmm + compiled cast'] / t['sm90 + cast']:.2f}x | {t['sm90 + cast'] / t['sm90'] - 1:+.1%} |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        write_results(args.out, f"gemm_quant_sm90_{device_tag(device)}", {"device": device, "results": rows}, table)


if __name__ == "__main__":
    main()
