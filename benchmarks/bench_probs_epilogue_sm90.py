"""What the router probabilities cost the fused epilogues: SwiGLU against ScaledSwiGLU kernels.

Per layer shape (`bench_moe_layer.SHAPES`: T tokens, top-k over E experts, H, I; x, the routing
and W1 as `bench_gathered_sm90.problem` makes them), bf16, M = the routed rows; probs (M,) float32
random, pre (M, 2I) random:
  fwd gath swiglu / scaled   FC1 reading x's rows by index (`grouped_gemm_gathered_sm90`) + SwiGLU /
                             + ScaledSwiGLU (the layer's FC1), heuristic configuration
  dgrad only                 FC2's data gradient without the activation (`grouped_gemm_sm90`, "kn")
  copy swiglu / scaled       FC2's data gradient + dSwiGLU / dScaledSwiGLU (d_probs as column-tile
                             partials) on dy's rows copied into expert order
  gath swiglu / scaled       the same reading dy (T, H) by each row's token (``dy_index``): "gath
                             scaled" is the kernel the layer runs where FC2 is at most
                             `rules.GATHER_DY_MAX_WIDTH` wide
"gath scaled" is first checked bit for bit against "copy scaled" (the same configuration; outputs
NaN-poisoned by the allocator). Times: `common.sustained_ms` (0.15 s warm, 0.2 s timed, L2 flushed)
medians of `common.rotated_medians`. Compare two builds by running once per build with the build
first on PYTHONPATH.

    python benchmarks/bench_probs_epilogue_sm90.py [--shapes qwen3-30b-a3b,...]
"""

import argparse

from common import require_sm90

if __name__ == "__main__":  # before torch and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from bench_gathered_sm90 import problem
from common import time_and_print_variants

from te_fused_ops.backends.sm90.kernels import grouped_gemm as gg


def variants(name: str) -> dict:
    """label -> call of one kernel on ``name``'s operands."""
    x, _, tokens, w1, offsets = problem(name)
    t, h, i = x.shape[0], x.shape[1], w1.shape[1] // 2
    m = tokens.shape[0]
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16)
    dy_rows = dy[tokens.long().clamp(0, t - 1)]
    w2 = (torch.randn(w1.shape[0], h, i, device="cuda") / h**0.5).bfloat16()
    pre = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(m, device="cuda")
    fc1, dact = gg.grouped_gemm_gathered_sm90, gg.grouped_dgrad_dact_sm90
    scaled = dict(activation="scaled_swiglu", probs=probs, d_probs_parts=True)
    return {
        "fwd gath swiglu": lambda: fc1(x, tokens, w1, offsets, activation="swiglu", pingpong=None),
        "fwd gath scaled": lambda: fc1(x, tokens, w1, offsets, activation="scaled_swiglu", probs=probs, pingpong=None),
        "dgrad only": lambda: gg.grouped_gemm_sm90(dy_rows, w2, offsets, weight_layout="kn"),
        "copy swiglu": lambda: dact(dy_rows, w2, offsets, pre, activation="swiglu"),
        "copy scaled": lambda: dact(dy_rows, w2, offsets, pre, **scaled),
        "gath swiglu": lambda: dact(dy, w2, offsets, pre, activation="swiglu", dy_index=tokens),
        "gath scaled": lambda: dact(dy, w2, offsets, pre, dy_index=tokens, **scaled),
    }


def check(fns: dict) -> None:
    """"gath scaled" equals "copy scaled" bit for bit (its outputs first left NaN in the allocator)."""
    want = [t.clone() for t in fns["copy scaled"]() if t is not None]
    for t in want:
        torch.full_like(t, float("nan"))  # freed at once: the next allocation of its size reads NaN
    got = [t for t in fns["gath scaled"]() if t is not None]
    if not all(torch.equal(a, b) for a, b in zip(got, want, strict=True)):
        raise SystemExit("gath scaled differs from copy scaled (the kernel on the copied rows)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b")
    args = ap.parse_args()
    time_and_print_variants(args.shapes, variants, check, 0.15, 0.2)


if __name__ == "__main__":
    main()
