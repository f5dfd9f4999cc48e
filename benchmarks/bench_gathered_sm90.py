"""FC1 reading x's rows by index inside the GEMM against the permute pass and FC1 on its output.

Per layer shape (`bench_moe_layer.SHAPES`: T tokens, top-k over E experts, H, I; skewed top-k
routing, seed 0), bf16. Part ``fc1``, FC1 + SwiGLU (W1 (E, 2I, H)):
  permute + kernel       the library's permute (`moe_rows.scatter_rows`, x -> expert order) and
                         `grouped_gemm_sm90` on its output, the heuristic's configuration
                         (ping-pong where it pays): what the fused layer runs
  permute + kernel coop  the same with the gathered kernel's cooperative tile and cluster
  gathered               `grouped_gemm_gathered_sm90(x, token of each row, W1, offsets)`
  gathered heuristic     the same with the heuristic's configuration of "permute + kernel"
                         (ping-pong where it pays: the gathered kernel's ping-pong schedule)
  kernel alone           `grouped_gemm_sm90` on rows permuted beforehand (what the permute costs)
Part ``wgrad``, FC1's weight gradient dW1 = d_pre^T @ x[rows] (d_pre (M, 2I) random): "permute +
kernel" (the permute, then `grouped_wgrad_sm90`), "gathered transposed"
(`grouped_wgrad_gathered_sm90`: the product dW^T with x's rows as A, tile 256 along 2I, CTA pairs
sharing d_pre's tile; what the layer runs where FC1 is at most `linear.GATHER_WGRAD_MAX_WIDTH`
wide), "transposed on the copy" (the same kernel class and product with x's rows read by TMA from
the permuted copy instead of gathered: what the gather itself costs), "kernel alone".
Each gathered kernel is checked bit for bit against the kernel on the permuted rows ("gathered"
against "permute + kernel coop", the same configuration; "gathered heuristic", "gathered
transposed" and "transposed on the copy" against "permute + kernel") on NaN-filled buffers before
anything is timed. Times: `common.sustained_ms` medians (L2 flushed before each call), variants in
rotated order.

    python benchmarks/bench_gathered_sm90.py [--shapes qwen3-30b-a3b,...] [--parts fc1,wgrad] [--out DIR]
"""

import argparse
import functools

from common import require_sm90

if __name__ == "__main__":
    require_sm90(__file__)

import torch
from bench_moe_layer import SHAPES, skewed_topk
from common import device_tag, rotated_medians, sustained_ms, write_results

from te_fused_ops.backends.sm90.kernels import grouped_gemm as gg
from te_fused_ops.backends.sm90.kernels import grouped_wgrad as gw
from te_fused_ops.backends.sm90.kernels import moe_rows
from te_fused_ops.backends.sm90.kernels.launch import num_sms
from te_fused_ops.routing import route

VARIANTS = ("permute + kernel", "permute + kernel coop", "gathered", "gathered heuristic", "gathered transposed",
            "transposed on the copy", "kernel alone")
CHECKED = {"gathered": "permute + kernel coop", "gathered heuristic": "permute + kernel",  # same configurations
           "gathered transposed": "permute + kernel", "transposed on the copy": "permute + kernel"}


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


def fc1_variants(x, routing, tokens, w1, offsets) -> tuple:
    """label -> FC1 + SwiGLU call, and the gathered kernel's (tile_n, cluster_m)."""
    m, n = tokens.shape[0], w1.shape[1]
    tile_n, cluster_m = gg.choose_config(m, n, w1.shape[0], num_sms(x.get_device()),
                                         **gg.forward_tiles("grouped_gemm_sm90", "nk", "swiglu"))
    coop = dict(tile_n=tile_n, cluster_m=cluster_m, pingpong=False)
    permuted = moe_rows.scatter_rows(x, routing.slot_rows, routing.num_kept)

    def permuted_fc1(**cfg):
        rows = moe_rows.scatter_rows(x, routing.slot_rows, routing.num_kept)
        return gg.grouped_gemm_sm90(rows, w1, offsets, activation="swiglu", **cfg)

    return {
        "permute + kernel": lambda: permuted_fc1(),
        "permute + kernel coop": lambda: permuted_fc1(**coop),
        "gathered": lambda: gg.grouped_gemm_gathered_sm90(x, tokens, w1, offsets, activation="swiglu",
                                                          tile_n=tile_n, cluster_m=cluster_m),
        "gathered heuristic": lambda: gg.grouped_gemm_gathered_sm90(x, tokens, w1, offsets, activation="swiglu",
                                                                    pingpong=None),
        "kernel alone": lambda: gg.grouped_gemm_sm90(permuted, w1, offsets, activation="swiglu"),
    }, (tile_n, cluster_m)


@functools.cache
def transposed_on_the_copy():
    """fn(d_pre (M, N), x_perm (M, K), offsets, dW (G, N, K), max_ctas): the gathered weight
    gradient's kernel class and product (dW^T = x_g^T d_pre_g, tile 256 along N, CTA pairs sharing
    d_pre's tile, each tile stored transposed) with x's rows read by TMA from the permuted copy."""
    import cutlass
    import cutlass.cute as cute

    from te_fused_ops.backends.sm90.kernels.grouped_wgrad_sm90 import GroupedWgradSm90, transposed_output_by_group
    from te_fused_ops.backends.sm90.kernels.launch import compile_launcher, fake_tensor
    from te_fused_ops.backends.sm90.kernels.varlen_sm90 import ragged_tokens

    class TransposedOnTheCopy(GroupedWgradSm90):
        def __init__(self):
            super().__init__(cutlass.BFloat16, 256, False, cluster_m=2, d_major="m")

        @cute.jit
        def __call__(self, mDy: cute.Tensor, mX: cute.Tensor, mOffsets: cute.Tensor, mOut: cute.Tensor,
                     max_ctas: cutlass.Int32, stream):
            self.launch(ragged_tokens(mX), ragged_tokens(mDy), mOffsets, (transposed_output_by_group(mOut),), (),
                        (), max_ctas // self.cluster_m, stream, None, cute.size(mDy, mode=[0]))

    dt = cutlass.BFloat16
    m, g, g1 = (cute.sym_int() for _ in range(3))
    n, k = cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)
    fake = (fake_tensor(dt, (m, n)), fake_tensor(dt, (m, k)), fake_tensor(cutlass.Int32, (g1,), 4),
            fake_tensor(dt, (g, n, k)), cutlass.Int32(1))
    tvm_ffi = gw.tvm_ffi_available()
    fn = compile_launcher(TransposedOnTheCopy(), fake, tvm_ffi)
    return fn if tvm_ffi else lambda *tensors_and_ctas: gw._call_classic(fn, tensors_and_ctas[:-1],
                                                                          tensors_and_ctas[-1])


def wgrad_variants(x, routing, tokens, w1, offsets) -> tuple:
    """label -> FC1 weight-gradient call, and the gathered kernel's (tile_n, cluster_m)."""
    d_pre = torch.randn(tokens.shape[0], w1.shape[1], device="cuda", dtype=torch.bfloat16)
    tile_n = 128 if w1.shape[1] <= 128 else 256
    permuted = moe_rows.scatter_rows(x, routing.slot_rows, routing.num_kept)

    def permuted_wgrad(**cfg):
        rows = moe_rows.scatter_rows(x, routing.slot_rows, routing.num_kept)
        return gw.grouped_wgrad_sm90(d_pre, rows, offsets, **cfg)

    on_the_copy = transposed_on_the_copy()

    def transposed_wgrad():
        dw = torch.empty(w1.shape, device="cuda", dtype=torch.bfloat16)
        on_the_copy(d_pre, permuted, offsets, dw, num_sms(x.get_device()))
        return dw

    return {
        "permute + kernel": lambda: permuted_wgrad(),
        "gathered transposed": lambda: gw.grouped_wgrad_gathered_sm90(d_pre, x, tokens, offsets),
        "transposed on the copy": transposed_wgrad,
        "kernel alone": lambda: gw.grouped_wgrad_sm90(d_pre, permuted, offsets),
    }, (tile_n, 2)


PARTS = {"fc1": fc1_variants, "wgrad": wgrad_variants}


def check(fns: dict) -> None:
    """Each gathered variant equals the kernel on the permuted copy with the same configuration
    (`CHECKED`), bit for bit (its outputs first left NaN in the allocator)."""
    for gathered, permuted in CHECKED.items():
        if gathered not in fns:
            continue
        want = fns[permuted]()
        want = want if isinstance(want, tuple) else (want,)
        for t in want:
            if t is not None:
                torch.full_like(t, float("nan"))  # freed at once: the next allocation of its size reads NaN
        got = fns[gathered]()
        got = got if isinstance(got, tuple) else (got,)
        if not all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want)):
            raise SystemExit(f"{gathered} differs from {permuted} (the kernel on the permuted rows)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--parts", default="fc1,wgrad", help="comma-separated: fc1, wgrad")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    rows, results = [], {}
    for name in args.shapes.split(","):
        x, routing, tokens, w1, offsets = problem(name)
        for part in args.parts.split(","):
            fns, config = PARTS[part](x, routing, tokens, w1, offsets)
            check(fns)
            us = {label: 1e3 * ms for label, ms in rotated_medians(fns, sustained_ms).items()}
            results[f"{part} {name}"] = {"us": us, "tile_n, cluster_m": config}
            best_gathered = min(us[v] for v in CHECKED if v in us and v.startswith("gathered"))
            rows.append(f"| {name} | {part} | {config[0]}x{config[1]} | "
                        + " | ".join(f"{us[v]:.0f}" if v in us else "-" for v in VARIANTS)
                        + f" | {us['permute + kernel'] / best_gathered:.3f} |")
            print(name, part, config, {v: round(t, 1) for v, t in us.items()}, flush=True)
    table = "\n".join([f"FC1's forward (+ SwiGLU) and weight gradient with x's rows gathered in the GEMM, bf16, {device}; "
                       "us (sustained medians)", "",
                       "| shape | part | gathered tile | " + " | ".join(VARIANTS) + " | permute + kernel / best gathered |",
                       "|---|---|---|" + "---|" * len(VARIANTS) + "---|", *rows])
    print(table)
    if args.out:
        write_results(args.out, f"gathered_sm90_{device_tag(device)}", {"device": device, "results": results}, table)


if __name__ == "__main__":
    main()
