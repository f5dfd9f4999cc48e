"""The dActivation kernel (FC2's data gradient + dScaledSwiGLU) under other splits of its shared
memory between operand stages, store slots and C-tile (pre) stages.

Per layer shape (`bench_moe_layer.SHAPES` or TxkxExHxI; operands as `bench_probs_epilogue_sm90`
makes them) and kernel ("copy": dy's rows copied into expert order, "gath": dy (T, H) read by
each row's token, the layer's kernel where FC2 is at most `rules.GATHER_DY_MAX_WIDTH` wide), the
launch configuration the wrapper's heuristic chooses, compiled once per split:
  default     the kernel's own split (ping-pong 192 gathered: 5 operand stages, 1 slot, 1 C stage;
              else the core's: C stages 2, then as many operand stages and slots as fit)
  core        the core's split (ping-pong 192: 4 operand stages, 2 store slots, 2 C stages)
  ab5 s1 c1   one store slot and one C stage, which leaves room for a fifth operand stage
  ab3 s4      three operand stages, four store slots
  c4          four C stages
Every split's outputs (d_pre, act, d_probs partials) are first checked bit for bit against the
default's; times: `common.sustained_ms` (0.3 s warm, 0.4 s timed, L2 flushed) medians of
`common.rotated_medians`, us.

    python benchmarks/bench_dact_smem_split_sm90.py [--shapes qwen3-30b-a3b,...] [--kinds copy,gath]
        [--splits default,core,...]
"""

import argparse

from common import require_sm90

if __name__ == "__main__":  # before torch and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from bench_gathered_sm90 import SHAPES, problem
from bench_moe_layer import layer_shape
from common import time_and_print_variants

from te_fused_ops.activations import activation_constants
from te_fused_ops.backends.sm90.kernels import grouped_gemm as gg
from te_fused_ops.backends.sm90.kernels.grouped_dact_sm90 import DEEP_OPERAND_SPLIT

SPLITS = {
    "default": {},
    "core": dict(ab_stages=None, epi_slots=None, c_stages=2),
    "ab5 s1 c1": DEEP_OPERAND_SPLIT,
    "ab3 s4": dict(ab_stages=3, epi_slots=4, c_stages=2),
    "c4": dict(c_stages=4, epi_slots=None),
}


def variants(name: str, kinds, splits) -> dict:
    """label -> call of the dActivation kernel of kind in ``kinds`` under split in ``splits``."""
    x, _, tokens, w1, offsets = problem(name)
    t, h, i = x.shape[0], x.shape[1], w1.shape[1] // 2
    m = tokens.shape[0]
    gen = torch.Generator(device="cuda").manual_seed(1)
    dy = torch.randn(t, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy_rows = dy[tokens.long().clamp(0, t - 1)]
    w2 = (torch.randn(w1.shape[0], h, i, device="cuda", generator=gen) / h**0.5).bfloat16()
    pre = torch.randn(m, 2 * i, device="cuda", dtype=torch.bfloat16, generator=gen)
    probs = torch.rand(m, device="cuda", generator=gen)
    tvm_ffi = gg.tvm_ffi_available()
    tile_n, cluster_m, clusters, pingpong = gg._launch_config(
        gg._DACT, m, i, w1.shape[0], x.get_device(), None, None, None, pingpong=None, k=h, act_epilogue=True)
    print(f"  {name}: tile_n {tile_n}, cluster_m {cluster_m}, {'ping-pong' if pingpong else 'cooperative'}")
    fns = {}
    for kind in kinds:
        gathered = kind == "gath"
        operands = (dy, tokens) if gathered else (dy_rows,)
        for split in splits:
            fn = gg.compile_grouped_dgrad_dact(torch.bfloat16, tile_n, "scaled_swiglu", tvm_ffi, cluster_m, False,
                                               pingpong, gathered, **SPLITS[split])

            def run(fn=fn, operands=operands):
                d_pre, act = torch.empty_like(pre), dy.new_empty((m, i))
                parts = dy.new_empty((-(-i // tile_n), m), dtype=torch.float32)
                gg._run(fn, tvm_ffi, None, (), (*operands, w2, offsets, pre, d_pre, act, probs, parts),
                        activation_constants(gg._DACT, {}), clusters)
                return d_pre, act, parts

            fns[f"{kind} {split}"] = run
    return fns


def check(fns: dict) -> None:
    """Each kind's splits give its first split's outputs bit for bit (allocations NaN-filled first)."""
    want = {}
    for label, fn in fns.items():
        for t in fn():
            t.fill_(float("nan"))  # freed at once: the next allocation of its size reads NaN
        got = fn()
        kind = label.split()[0]
        if kind not in want:
            want[kind] = [t.clone() for t in got]
        elif not all(torch.equal(a, b) for a, b in zip(got, want[kind], strict=True)):
            raise SystemExit(f"{label} differs from {kind}'s first split")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="qwen3-30b-a3b,gptoss-120b-ep4")
    ap.add_argument("--kinds", default="copy,gath")
    ap.add_argument("--splits", default="default,core,ab5 s1 c1")
    args = ap.parse_args()
    kinds, splits = args.kinds.split(","), args.splits.split(",")

    def shape_variants(name):
        if name not in SHAPES:
            SHAPES[name] = layer_shape(name, ap)
        return variants(name, kinds, splits)

    time_and_print_variants(args.shapes, shape_variants, check, 0.3, 0.4)


if __name__ == "__main__":
    main()
