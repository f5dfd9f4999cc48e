"""Grouped weight gradient over tokens on Hopper: sm90 kernel vs torch._grouped_mm.

Per shape (tokens M, N, K, G): dW[g] = dy_g^T @ x_g, dy (M, N), x (M, K), dW (G, N, K), bf16.
Routings: "uneven" (expert shares ~ U(0,1)^2, sizes rounded to 16 rows, which _grouped_mm needs)
and "equal" (M / G rows each). Columns:
  gmm        torch._grouped_mm(dy.t(), x, offs=offsets[1:])
  ours       grouped_wgrad_sm90 with its default config
  c1-nosort, c1, c2   kernel variants (--variants): cluster_m 1 without / with largest-group-first
             order, cluster_m 2 (CTA pairs multicast the x tile)
  ours-ua    default config, uneven sizes with every inner boundary moved by 1..7 rows (unaligned
             starts; _grouped_mm can't)
  ours-mg    main_grad (fp32) += dW in the epilogue;  gmm+add: _grouped_mm, then main_grad.add_
Outputs are checked against _grouped_mm before timing. Median of triton's do_bench (L2 flushed).

    python benchmarks/bench_wgrad_sm90.py [--shapes qwen3-fc2,...] [--variants]
"""

import argparse

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import skewed_splits

from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad, grouped_wgrad_sm90
from te_fused_ops.backends.sm90.kernels.launch import num_sms, tvm_ffi_available

SHAPES = {  # name: (M tokens, N, K, G)
    "qwen3-fc2": (65536, 2048, 768, 128),
    "qwen3-fc1": (65536, 1536, 2048, 128),
    "dsv3-fc1": (32768, 4096, 7168, 32),
    "mixtral-fc2": (32768, 4096, 14336, 8),
    "gptoss": (32768, 5760, 2880, 32),
}
VARIANTS = {"c1-nosort": (1, False), "c1": (1, True), "c2": (2, True)}  # (cluster_m, sort_groups)


def offsets_of(splits):
    off = torch.zeros(len(splits) + 1, dtype=torch.int32)
    off[1:] = torch.cumsum(splits, 0)
    return off.cuda()


def bench(fn):
    import triton.testing  # here, not at the top: --help reads without triton
    return triton.testing.do_bench(fn, warmup=25, rep=150, return_mode="median") * 1e3  # us


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def variant_launcher(cluster_m, sort_groups):
    """Direct launcher of one kernel variant (tile_n 256, bf16, TVM-FFI)."""
    assert tvm_ffi_available()
    fn = compile_grouped_wgrad(torch.bfloat16, 256, False, cluster_m, True, sort_groups=sort_groups)
    sms = num_sms(torch.cuda.current_device())
    return lambda dy, x, off, out: fn(dy, x, off, out, None, None, None, sms)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--variants", action="store_true")
    args = ap.parse_args()
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    variants = {k: variant_launcher(*v) for k, v in VARIANTS.items()} if args.variants else {}
    cols = ["gmm", "ours"] + list(variants)
    rows = []
    for name in args.shapes.split(","):
        m, n, k, g = SHAPES[name]
        torch.manual_seed(0)
        dy = torch.randn(m, n, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(g, n, k, dtype=torch.bfloat16, device="cuda")
        main_grad = torch.zeros(g, n, k, dtype=torch.float32, device="cuda")
        off = offsets_of(skewed_splits(m, g, align=16))
        routings = {"uneven": off, "equal": offsets_of(torch.full((g,), m // g))}
        for routing, offs in routings.items():
            gmm = torch._grouped_mm(dy.t(), x, offs=offs[1:])
            fns = {"gmm": lambda: torch._grouped_mm(dy.t(), x, offs=offs[1:]),  # noqa: B023
                   "ours": lambda: grouped_wgrad_sm90(dy, x, offs, out=out)}  # noqa: B023
            for vname, launch in variants.items():
                fns[vname] = lambda launch=launch: launch(dy, x, offs, out)  # noqa: B023
            t, errs = {}, []
            for col, fn in fns.items():
                if col != "gmm":
                    out.fill_(float("nan"))
                    fn()
                    errs.append(rel(out, gmm))
                t[col] = bench(fn)
            extra = {}
            if routing == "uneven":
                off_ua = off.clone()
                off_ua[1:-1] += torch.randint(1, 8, (g - 1,), device="cuda", dtype=torch.int32)
                off_ua = torch.cummax(off_ua, 0).values
                off_ua[-1] = m
                grouped_wgrad_sm90(dy, x, off, main_grad=main_grad.zero_())
                errs.append(rel(main_grad, gmm))
                extra = {
                    "ours-ua": bench(lambda: grouped_wgrad_sm90(dy, x, off_ua, out=out)),  # noqa: B023
                    "ours-mg": bench(lambda: grouped_wgrad_sm90(dy, x, off, main_grad=main_grad)),  # noqa: B023
                    "gmm+add": bench(lambda: main_grad.add_(torch._grouped_mm(dy.t(), x, offs=off[1:]))),  # noqa: B023,E501
                }
            err = max(errs)
            rows.append((name, routing, err, t, extra, 2.0 * m * n * k))
            print(f"{name} {routing}: max err {err:.1e} " + " ".join(
                f"{c} {v:.0f}us" for c, v in {**t, **extra}.items()), flush=True)
        del dy, x, out, main_grad, gmm
        torch.cuda.empty_cache()

    print(f"\n| shape | routing | ok | {' | '.join(c + ' us' for c in cols)} | gmm/ours "
          "| ours-ua us | ours-mg us | gmm+add us |")
    print("|---|---|---|" + "---|" * (len(cols) + 4))
    for name, routing, err, t, extra, flop in rows:
        cells = " | ".join(f"{t[c]:.0f} ({flop / t[c] / 1e6:.0f} TF/s)" for c in cols)
        ex = " | ".join(f"{extra[c]:.0f}" if c in extra else "" for c in ("ours-ua", "ours-mg", "gmm+add"))
        print(f"| {name} | {routing} | {'yes' if err < 1e-2 else 'NO'} | {cells} "
              f"| {t['gmm'] / t['ours']:.2f}x | {ex} |")


if __name__ == "__main__":
    main()
