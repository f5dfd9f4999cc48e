"""Block-scaled FP8 grouped GEMM on Hopper: this library's sm90 kernel against DeepGEMM's, same operands.

Per shape, linear and routing: x (M, K) E4M3 with 1x128 multipliers and W (E, N, K) E4M3 with 128x128
multipliers (`quantization.quantize` / `quantize_weight` "fp8_blockwise", which is DeepGEMM's sm90
recipe), group sizes multiples of 128 (DeepGEMM's contiguous layout needs that; ours does not):
  ours          grouped_gemm_fp8_sm90 at its default tile (`tuning.fp8_tile_n`)
  ours tN       the other tile widths (128, 192, 256), with ``--tiles``
  deepgemm      deep_gemm.m_grouped_fp8_gemm_nt_contiguous (its own heuristics; the multipliers of x
                handed over in its TMA-aligned MN-major layout beforehand, so a call is its GEMM alone)
  bf16 torch    torch._grouped_mm on the bf16 operands, for scale
FC1: N = 2I, K = H; FC2: N = H, K = I. Routing "skewed" (`common.skewed_splits`) or "even".

The weight gradient (``--part wgrad``), dW[g] += dy_g^T x_g into float32 (main_grad), dy (M, N) and
x (M, K) both 1x128-scaled along the tokens (`block_columns_sm90`, the column-wise copies an FP8
step makes):
  ours          grouped_wgrad_fp8_sm90(..., main_grad=) at its default tile
  deepgemm      deep_gemm.k_grouped_fp8_gemm_nt_contiguous (sm90 1D1D, c = d: the same accumulation),
                its operands the same bytes laid out group after group (copied beforehand)
Every output is first checked against float64 of its own operands (NaN-poisoned output, or a
random float32 main_grad that an unwritten element would leave in place; relative Frobenius error
<= 1e-2); times are medians at the clock a long run settles at
(`common.sustained_ms`, L2 flushed), the variants in rotated order (`common.rotated_medians`);
TFLOPS count 2*M*N*K. ``--clock``: also each variant's SM clock and board power while it runs back to
back (`common.clock_and_power`), and its "burst" time: the median of 10 calls timed right after
1 s of an idle GPU, at the boost clock the power cap has not pulled down yet (how kernel times are
often published).

DeepGEMM is built on the GPU machine from the sources `benchmarks/deepgemm_env/prepare.sh` packs into
.dgcarry/ (carry it beside .devcarry/; the two and the project's files come within a few MiB of a 64 MiB
carry limit, so leave out what the run does not read, e.g. benchmarks/results/):

    source .devcarry/bootstrap.sh && source .dgcarry/bootstrap.sh && \\
        python benchmarks/bench_fp8_deepgemm.py [--part gemm,wgrad] [--shapes dsv3-ep8,...] [--routing skewed,even] [--out DIR]
"""

import argparse
import time

from common import require_sm90

if __name__ == "__main__":  # before torch and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import (
    MODEL_SHAPES, _l2_flush_buffer, clock_and_power, device_tag, median_event_ms, model_shape, rotated_medians, skewed_splits,
    sustained_ms, write_results,
)

from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_gemm_fp8_sm90
from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_fp8_sm90
from te_fused_ops.backends.sm90.kernels.tuning import fp8_tile_n
from te_fused_ops.quantization import quantize, quantize_weight
from te_fused_ops.splits import split_offsets


def group_sizes(m, e, routing):
    """(E,) int64 row counts, multiples of 128, summing to m."""
    if routing == "even":
        sizes = torch.full((e,), m // e // 128 * 128, dtype=torch.int64)
        sizes[0] += m - int(sizes.sum())
        return sizes
    return skewed_splits(m, e, 0, align=128)


def relative_error(out, x64, w64, bounds):
    ref = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    for g in range(w64.shape[0]):
        s, e = bounds[g], bounds[g + 1]
        if e > s:
            ref[s:e] = x64[s:e] @ w64[g].T
    assert not torch.isnan(out).any(), "NaN left in the output"
    return ((out.double() - ref).norm() / ref.norm()).item()


def routed_problem(name, linear, routing):
    """(M, N, K, E, group sizes, offsets on the GPU, offsets as a list) of one linear; seeds torch."""
    m, h, i, e = model_shape(name)
    n, k = (2 * i, h) if linear == "fc1" else (h, i)
    torch.manual_seed(0)
    sizes = group_sizes(m, e, routing)
    offsets = split_offsets(sizes.cuda(), m)
    return m, n, k, e, sizes, offsets, offsets.tolist()


def problem(name, linear, routing, other_tiles):
    """(label -> call, label -> relative error, FLOPs, our default tile) of one GEMM."""
    import deep_gemm

    m, n, k, e, sizes, offsets, bounds = routed_problem(name, linear, routing)
    x = torch.randn(m, k, device="cuda")
    w = torch.randn(e, n, k, device="cuda") / k**0.5
    qx, qw = quantize(x, "fp8_blockwise"), quantize_weight(w, "fp8_blockwise")
    xq, xs, wq, ws = qx.rowwise_data, qx.rowwise_scale_inv, qw.rowwise_data, qw.rowwise_scale_inv
    x64, w64 = qx.dequantize(torch.float32).double(), qw.dequantize(torch.float32).double()
    xb, wb = x.bfloat16(), w.bfloat16()

    m_indices = torch.repeat_interleave(torch.arange(e, dtype=torch.int32), sizes).cuda()
    xs_dg = deep_gemm.get_mn_major_tma_aligned_tensor(xs)
    d = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

    default = fp8_tile_n(n, False)
    tiles = {"ours": None} | {f"ours t{tile}": tile for tile in (128, 192, 256) if other_tiles and tile != default}
    fns = {label: (lambda tile=tile: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, tile_n=tile))
           for label, tile in tiles.items()}
    fns["deepgemm"] = lambda: deep_gemm.m_grouped_fp8_gemm_nt_contiguous((xq, xs_dg), (wq, ws), d, m_indices)
    fns["bf16 torch"] = lambda: torch._grouped_mm(xb, wb.transpose(-2, -1), offs=offsets[1:])

    errors = {}
    for label, fn in fns.items():
        poisoned = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        if label in tiles:
            out = grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, out=poisoned, tile_n=tiles[label])[0]
        elif label == "deepgemm":
            d.copy_(poisoned)
            fn()
            out = d
        else:
            out = fn()
        reference = (xb.double(), wb.double()) if label.startswith("bf16") else (x64, w64)
        errors[label] = relative_error(out, *reference, bounds)
        assert errors[label] <= 1e-2, f"{name} {linear} {routing} {label}: relative error {errors[label]:.2e}"
    return fns, errors, 2 * m * n * k, default


def wgrad_problem(name, linear, routing, other_tiles):
    """`problem` for the weight gradient: dW (E, N, K) += dy^T x per group, float32."""
    import deep_gemm

    m, n, k, e, sizes, offsets, bounds = routed_problem(name, linear, routing)
    dy_cols = block_columns_sm90(torch.randn(m, n, device="cuda").bfloat16(), offsets)
    x_cols = block_columns_sm90(torch.randn(m, k, device="cuda").bfloat16(), offsets)
    # groups of multiples of 128 rows: group g's tokens are columns bounds[g]:bounds[g+1] of the
    # copies and their multipliers rows bounds[g]/128 on; DeepGEMM wants each group's (C, K_g) whole
    a = torch.cat([dy_cols.data[:, s:t].contiguous().flatten() for s, t in zip(bounds, bounds[1:])])
    b = torch.cat([x_cols.data[:, s:t].contiguous().flatten() for s, t in zip(bounds, bounds[1:])])
    sfa, sfb = (deep_gemm.get_mn_major_tma_aligned_tensor(cols.scale_inv[: m // 128].T) for cols in (dy_cols, x_cols))
    ks = sizes.tolist()
    ks_tensor = sizes.int().cuda()

    def values(cols):  # (C, M) float64 of a copy's first M token columns
        return cols.data[:, :m].double() * cols.scale_inv[: m // 128].double().T.repeat_interleave(128, 1)

    dy64, x64 = values(dy_cols), values(x_cols)
    start = torch.randn(e, n, k, device="cuda")
    default = fp8_tile_n(k, False)
    tiles = {"ours": None} | {f"ours t{tile}": tile for tile in (128, 192, 256) if other_tiles and tile != default}
    grads = {label: start.clone() for label in [*tiles, "deepgemm"]}
    fns = {label: (lambda label=label, tile=tile: grouped_wgrad_fp8_sm90(dy_cols, x_cols, offsets,
                                                                         main_grad=grads[label], tile_n=tile))
           for label, tile in tiles.items()}
    fns["deepgemm"] = lambda: deep_gemm.k_grouped_fp8_gemm_nt_contiguous(
        (a, sfa), (b, sfb), grads["deepgemm"], ks, ks_tensor, grads["deepgemm"])
    errors = {}
    for label, fn in fns.items():
        fn()
        num = den = 0.0
        for g in range(e):
            s, t = bounds[g], bounds[g + 1]
            ref = dy64[:, s:t] @ x64[:, s:t].T
            num += ((grads[label][g].double() - start[g].double()) - ref).norm().item() ** 2
            den += ref.norm().item() ** 2
        errors[label] = (num / den) ** 0.5
        assert errors[label] <= 1e-2, f"{name} {linear} {routing} wgrad {label}: relative error {errors[label]:.2e}"
    return fns, errors, 2 * m * n * k, default


def burst_us(fn, calls=10):
    """Median us of ``calls`` calls (L2 flushed before each) right after 1 s of an idle GPU."""
    flush = _l2_flush_buffer()
    torch.cuda.synchronize()
    time.sleep(1.0)
    return 1e3 * median_event_ms(fn, calls, flush)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", default="gemm,wgrad", help="gemm (the forward), wgrad, or both")
    parser.add_argument("--shapes", default=",".join(MODEL_SHAPES))
    parser.add_argument("--linears", default="fc1,fc2")
    parser.add_argument("--routing", default="skewed,even")
    parser.add_argument("--tiles", action="store_true", help="also time our other FP8 tile widths")
    parser.add_argument("--clock", action="store_true", help="also the clock, power and burst time of ours and deepgemm")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import deep_gemm

    payload = {"device": torch.cuda.get_device_name(), "deep_gemm": deep_gemm.__version__, "results": []}
    cases = [(part, name, linear, routing) for part in args.part.split(",") for name in args.shapes.split(",")
             for linear in args.linears.split(",") for routing in args.routing.split(",")]
    failed = []
    for part, name, linear, routing in cases:
        try:  # one failing case (a DeepGEMM limit, a check) is reported; the others still run
            fns, errors, flops, tile = (problem if part == "gemm" else wgrad_problem)(name, linear, routing, args.tiles)
        except (AssertionError, RuntimeError) as err:
            failed.append(f"{part} {name} {linear} {routing}: {type(err).__name__}: {str(err).splitlines()[0]}")
            print(failed[-1], flush=True)
            continue
        us = {label: 1e3 * ms for label, ms in rotated_medians(fns, lambda fn: sustained_ms(fn, 0.15, 0.15)).items()}
        result = {"part": part, "shape": name, "linear": linear, "routing": routing, "tile": tile, "us": us,
                  "rel_err": errors, "tflops": {label: flops / t / 1e6 for label, t in us.items()}}
        if args.clock:
            result["clock"] = {label: clock_and_power(fns[label], 1.0) for label in ("ours", "deepgemm")}
            result["burst_us"] = {label: burst_us(fns[label]) for label in ("ours", "deepgemm")}
        payload["results"].append(result)
        line = "  ".join(f"{label} {t:.0f} us ({result['tflops'][label]:.0f})" for label, t in us.items())
        print(f"{part} {name} {linear} {routing}: {line}", flush=True)
    labels = ["ours", "deepgemm", "bf16 torch"]
    table = (f"Block-scaled FP8 grouped GEMMs, {payload['device']}, DeepGEMM {payload['deep_gemm']}; us (TFLOPS); "
             "deepgemm / ours = their time ratio (above 1: ours faster); tile: ours by default\n\n"
             "| part | shape | linear | routing | tile | " + " | ".join(labels) + " | other tiles | deepgemm / ours |\n"
             "|---|---|---|---|---|" + "---|" * (len(labels) + 2) + "\n")
    for r in payload["results"]:
        cells = [f"{r['us'][label]:.0f} ({r['tflops'][label]:.0f})" if label in r["us"] else "-" for label in labels]
        other = [f"{label[5:]} {t:.0f} ({r['tflops'][label]:.0f})" for label, t in r["us"].items() if label.startswith("ours t")]
        table += (f"| {r['part']} | {r['shape']} | {r['linear']} | {r['routing']} | {r['tile']} | "
                  + " | ".join(cells) + f" | {', '.join(other) or '-'} | {r['us']['deepgemm'] / r['us']['ours']:.3f} |\n")
    clocked = [r for r in payload["results"] if "clock" in r]
    if clocked:
        table += ("\nUnder load (back to back) and in a burst after 1 s idle: SM MHz / W, burst us (TFLOPS)\n\n"
                  "| part | shape | linear | routing | ours MHz / W | deepgemm MHz / W | ours burst | deepgemm burst |\n"
                  "|---|---|---|---|---|---|---|---|\n")
        for r in clocked:
            flops = r["tflops"]["ours"] * r["us"]["ours"] * 1e6
            cells = [f"{r['clock'][label].get('sm_mhz', 0):.0f} / {r['clock'][label].get('power_w', 0):.0f}"
                     for label in ("ours", "deepgemm")]
            cells += [f"{r['burst_us'][label]:.0f} ({flops / r['burst_us'][label] / 1e6:.0f})" for label in ("ours", "deepgemm")]
            table += f"| {r['part']} | {r['shape']} | {r['linear']} | {r['routing']} | " + " | ".join(cells) + " |\n"
    if failed:
        table += "\nNot timed:\n" + "".join(f"- {line}\n" for line in failed)
        payload["failed"] = failed
    print("\n" + table)
    if args.out:
        write_results(args.out, f"fp8_deepgemm_{device_tag(payload['device'])}", payload, table)

if __name__ == "__main__":
    main()
