"""Block-scaled FP8 grouped GEMM (FC1 forward) vs the bf16 kernel and torch._grouped_mm, sm90.

Per shape (uneven seeded routing; FC1: x (M, H) @ W (E, 2I, H) with SwiGLU and without):
  gmm bf16     torch._grouped_mm on bf16 operands (no activation)
  gmm fp8 rowwise  torch._scaled_grouped_mm, the FP8 grouped GEMM torch runs on sm90: E4M3 with one
               multiplier per row of x and per output column of W[g] (its recipe, not 1x128 blocks;
               checked against float64 of its own operands; "did not run" with the reason where
               this torch build does not take it)
  sm90 bf16    grouped_gemm_sm90, bf16 operands
  sm90 fp8     grouped_gemm_fp8_sm90, E4M3 operands with 1x128 / 128x128 multipliers (t128 / t192:
               that tile width instead of the default `fp8_tile_n`; "overlap": two block products in
               flight, one promoted under the next one's WGMMAs (the default promotes each block
               before the next one's WGMMAs))
  casts        block_quantize_sm90 / block_dequantize_sm90 vs the torch quantizer (bit for bit);
               "current": one scale per tensor (fp8_current, tensor_quantize_sm90: amax launch + cast,
               x's amax over its grouped rows)
  + cast       the act cast to E4M3 1x128 blocks: after the kernel (block_quantize_sm90) or in its
               epilogue (grouped_gemm_act_quant_sm90; checked byte for byte against the former);
               FP8 ("sm90 fp8 ..."): rows and the column-wise copy, after the FP8 kernel at its
               default tile (block_columns_sm90) or in the epilogue of the 256-wide FP8 kernel
               (grouped_gemm_act_quant_fp8_sm90; checked byte for byte first);
               "p2": power-of-two scales (Float8BlockScaling(power_2_scales=True), TE's default);
               "current": the per-tensor cast after the kernel, its amax from a separate pass or
               ("+ amax") from the kernel's epilogue (act_amax, what the fp8_current MLP runs)
Each kernel is first checked against a float64 reference of its own operands (fresh random
inputs, NaN-poisoned outputs); times are do_bench medians with L2 flushed, the median over rounds
that rotate the variants' order (`common.rotated_medians`); TFLOPS count 2*M*N*K.

Then the training step of the MLP (forward, and forward + backward with gradients set to None
first); "fc2 fp8 sm90" is checked against its emulation first (output and gradients, rel.
Frobenius <= 5e-2: the quantized activation differs by whole E4M3 steps where the two round
apart), and each FP8 step's distance from bf16 is recorded:
  bf16 fused        Sequential(GroupedLinear, SwiGLU, GroupedLinear), sm90 kernels
  fc2 fp8 sm90      Sequential(GroupedLinear, SwiGLU, Quantize, Transpose, GroupedLinear)
                    "fp8_blockwise" (the recipe's MLP: FC1 bf16, FC2 on E4M3 activations): casts
                    on the quantization kernel, FC2's forward and data-gradient GEMMs on the FP8
                    kernel, FC2's weight gradient on the FP8 kernel too (bf16 with fp8_current)
  all fp8 sm90      the same after a Quantize of x (FC1 in FP8 too)
  ... p2            the same with power-of-two scales (Float8BlockScaling(power_2_scales=True))
  ... current       the same with one scale per tensor ("fp8_current")
  ... reuse         "fc2 fp8 sm90" / "all fp8 sm90" as gradient-accumulation micro-batches: inside
                    `reuse_quantized_weights()`, after a first micro-batch made the weights' casts
                    and transposed copies (checked bit for bit against the fresh step first);
                    timed in a group of their own with "bf16 fused", and compared with that
  fc2 fp8 emulated  "fc2 fp8 sm90" with TE_FUSED_OPS_BACKEND=torch (quantize, dequantize, bf16)
  plain torch bf16  the strongest bf16 step a user writes without the library (six
                    torch._grouped_mm + compiled SwiGLU / dSwiGLU: bench_train_step.ReferenceMLP)
All but the emulation are timed in rotated order (`common.rotated_medians`), each at the clock a
long run settles at (`common.sustained_ms`: the H100's power cap drops its clock within ~0.1 s).

    python benchmarks/bench_fp8_sm90.py [--shapes dsv3-ep8,mixtral-8x7b] [--out DIR] [--part kernels|steps]
    python benchmarks/bench_fp8_sm90.py --part steps --profile --shapes qwen3-30b-a3b   # GPU time per kernel
"""

import argparse
import functools
import os

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from bench_train_step import ReferenceMLP
from common import (
    MODEL_SHAPES, device_tag, gpu_us_per_kernel, mlp_problem, model_shape, rotated_medians, skewed_splits, sustained_ms,
    write_results,
)

from te_fused_ops import Quantize, Sequential, SwiGLU, Transpose
from te_fused_ops.backends.sm90.kernels.block_quantize import (
    block_columns_sm90,
    block_dequantize_sm90,
    block_quantize_sm90,
    tensor_quantize_sm90,
)
from te_fused_ops.backends.sm90.kernels.grouped_gemm import (
    grouped_gemm_act_quant_fp8_sm90,
    grouped_gemm_act_quant_sm90,
    grouped_gemm_fp8_sm90,
    grouped_gemm_sm90,
)
from te_fused_ops.quantization import Float8BlockScaling, quantize, quantize_weight, reuse_quantized_weights
from te_fused_ops.splits import split_offsets


def bench_us(fn):
    import triton.testing  # here, not at the top: --help reads without triton
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


def step_us(fn):
    """A step's time at the clock a long run settles at (`common.sustained_ms`)."""
    return sustained_ms(fn, 0.25, 0.25) * 1e3


def rowwise_grouped_mm(x, w, offsets):
    """torch._scaled_grouped_mm on sm90 (its FP8 recipe: one multiplier per row of x and per output
    column of each W[g]): (a callable, float64 x and W of its quantized operands), or (None, the
    error) where this torch build does not run it."""
    ends = offsets[1:]
    x_scale = x.abs().amax(1).clamp(min=1e-12) / 448.0
    w_scale = w.abs().amax(2).clamp(min=1e-12) / 448.0
    xq = (x / x_scale[:, None]).to(torch.float8_e4m3fn)
    wq = (w / w_scale[:, :, None]).to(torch.float8_e4m3fn)
    x64 = xq.double() * x_scale.double()[:, None]
    w64 = wq.double() * w_scale.double()[:, :, None]

    def run():
        return torch._scaled_grouped_mm(xq, wq.transpose(-2, -1), x_scale, w_scale, offs=ends,
                                        out_dtype=torch.bfloat16)

    try:
        run()
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        return None, str(err).splitlines()[0]
    return run, (x64, w64)


def check(out, x64, w64, offsets, what):
    """Relative error of ``out`` (no activation) against float64, group by group."""
    ref = torch.zeros(out.shape, dtype=torch.float64, device=out.device)
    bounds = offsets.tolist()
    for g in range(w64.shape[0]):
        s, e = bounds[g], bounds[g + 1]
        if e > s:
            ref[s:e] = x64[s:e] @ w64[g].T
    assert not torch.isnan(out).any(), f"{what}: NaN left in the output"
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err <= 1e-2, f"{what}: relative error {err:.2e}"
    return err


def current_cast_from_epilogue(x, w, offsets):
    """FC1 + SwiGLU with the act's amax from the epilogue, then the per-tensor cast (no amax pass)."""
    _, act, parts = grouped_gemm_sm90(x, w, offsets, activation="swiglu", tile_n=256, act_amax=True)
    return tensor_quantize_sm90(act, 1, amax_parts=parts)


def run_shape(name):
    m, h, i, e = model_shape(name)
    n = 2 * i
    torch.manual_seed(0)
    x = torch.randn(m, h, device="cuda")
    w = torch.randn(e, n, h, device="cuda") / h**0.5
    offsets = split_offsets(skewed_splits(m, e, 0, align=8).cuda(), m)
    xb, wb = x.bfloat16(), w.bfloat16()
    qx, qw = quantize(x, "fp8_blockwise"), quantize_weight(w, "fp8_blockwise")
    xq, xs, wq, ws = qx.rowwise_data, qx.rowwise_scale_inv, qw.rowwise_data, qw.rowwise_scale_inv
    x8 = qx.dequantize(torch.float32).double()
    w8 = qw.dequantize(torch.float32).double()
    poisoned = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    errors = {
        "sm90 bf16": check(grouped_gemm_sm90(xb, wb, offsets, out=poisoned.clone())[0], xb.double(), wb.double(), offsets, "bf16"),
        "sm90 fp8": check(grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, out=poisoned.clone())[0], x8, w8, offsets, "fp8"),
        "sm90 fp8 t192": check(grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, out=poisoned.clone(), tile_n=192)[0],
                               x8, w8, offsets, "fp8 t192"),
        "sm90 fp8 t128 overlap": check(grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, out=poisoned.clone(), tile_n=128,
                                                             overlap_promotion=True)[0], x8, w8, offsets, "fp8 overlap"),
        "sm90 fp8 t256": check(grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, out=poisoned.clone(), tile_n=256)[0],
                               x8, w8, offsets, "fp8 t256"),
    }
    # FC1 + SwiGLU + E4M3 cast, fused: the same bytes as the plain kernel's act cast afterwards
    _, act = grouped_gemm_sm90(xb, wb, offsets, activation="swiglu", tile_n=256)
    current = tensor_quantize_sm90(act, 1, offsets)
    fused = current_cast_from_epilogue(xb, wb, offsets)
    assert torch.equal(fused[1], current[1]) and torch.equal(fused[0].view(torch.uint8), current[0].view(torch.uint8)), (
        f"{name}: the current cast from the epilogue's amax differs from the one with an amax pass")
    for p2 in (False, True):
        cast = block_quantize_sm90(act, 1, p2)
        fused = grouped_gemm_act_quant_sm90(xb, wb, offsets, activation="swiglu", power_2_scales=p2)[1:]
        assert torch.equal(fused[1], cast[1]) and torch.equal(fused[0].view(torch.uint8), cast[0].view(torch.uint8)), (
            f"{name}: fused act cast differs from the cast of the bf16 act (power_2_scales={p2})")
    qxb = quantize(xb, "fp8_blockwise")
    assert torch.equal(block_dequantize_sm90(qxb.rowwise_data, qxb.rowwise_scale_inv, torch.bfloat16),
                       qxb.dequantize()), f"{name}: dequantize kernel differs from torch"
    for got, want in ((tensor_quantize_sm90(xb, 1, offsets), quantize(xb, "fp8_current", offsets=offsets)),
                      (tensor_quantize_sm90(wb, 128), quantize_weight(wb, "fp8_current"))):
        assert torch.equal(got[0].view(torch.uint8), want.rowwise_data.view(torch.uint8)), f"{name}: current cast data"
        assert torch.equal(got[1], want.rowwise_scale_inv.expand(got[1].shape)), f"{name}: current cast scale"
    ends = offsets[1:]
    # groups of multiples of 16 rows for torch's kernel (the same skew, M, N and K)
    offsets16 = split_offsets(skewed_splits(m, e, 0, align=16).cuda(), m)
    rowwise, rowwise_operands = rowwise_grouped_mm(x, w, offsets16)
    if rowwise is not None:
        out = rowwise()
        errors["gmm fp8 rowwise"] = check(out, *rowwise_operands, offsets16, "gmm fp8 rowwise")
    else:
        errors["gmm fp8 rowwise"] = f"did not run: {rowwise_operands}"
    variants = {
        "gmm bf16": lambda: torch._grouped_mm(xb, wb.transpose(-2, -1), offs=ends),
        "sm90 bf16": lambda: grouped_gemm_sm90(xb, wb, offsets),
        "sm90 bf16 + swiglu": lambda: grouped_gemm_sm90(xb, wb, offsets, activation="swiglu"),
        "sm90 fp8": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets),
        "sm90 fp8 + swiglu": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu"),
        "sm90 fp8 t192": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, tile_n=192),
        "sm90 fp8 t128 overlap": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, tile_n=128,
                                                               overlap_promotion=True),
        "sm90 fp8 t192 + swiglu": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu", tile_n=192),
        "sm90 fp8 t256": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, tile_n=256),
        "sm90 fp8 t128 + swiglu": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu", tile_n=128,
                                                                overlap_promotion=False),
        "sm90 fp8 t128 overlap + swiglu": lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu",
                                                                        tile_n=128, overlap_promotion=True),
        "sm90 bf16 + swiglu, then cast": lambda: block_quantize_sm90(
            grouped_gemm_sm90(xb, wb, offsets, activation="swiglu", tile_n=256)[1], 1),
        "sm90 bf16 + swiglu + cast": lambda: grouped_gemm_act_quant_sm90(xb, wb, offsets, activation="swiglu"),
        "sm90 bf16 + swiglu, then cast p2": lambda: block_quantize_sm90(
            grouped_gemm_sm90(xb, wb, offsets, activation="swiglu", tile_n=256)[1], 1, True),
        "sm90 bf16 + swiglu + cast p2": lambda: grouped_gemm_act_quant_sm90(
            xb, wb, offsets, activation="swiglu", power_2_scales=True),
        "sm90 bf16 + swiglu, then current cast": lambda: tensor_quantize_sm90(
            grouped_gemm_sm90(xb, wb, offsets, activation="swiglu", tile_n=256)[1], 1, offsets),
        "sm90 bf16 + swiglu + amax, then current cast": lambda: current_cast_from_epilogue(xb, wb, offsets),
    }
    if rowwise is not None:
        variants["gmm fp8 rowwise"] = rowwise
    # tile 256 with a GLU (halves that are not whole W blocks: the up half in two 64-column parts)
    variants["sm90 fp8 t256 + swiglu"] = lambda: grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu",
                                                                       tile_n=256)
    if (n // 2) % 128 == 0:  # the 256-wide act cast: a tile's 128 act columns one cast block
        # the FP8 FC1's act cast (rows and columns, what the all-FP8 layer's FC2 reads): in the
        # epilogue at tile 256, or after the kernel at the default tile; the same bytes checked first
        cast_after = block_columns_sm90(grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu",
                                                              tile_n=256)[1], offsets, rows=True)
        fused = grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu", columns=True)
        used = int(((offsets[1:] - offsets[:-1] + 127) // 128).sum())  # column blocks the groups fill
        assert (torch.equal(fused[1].view(torch.uint8), cast_after[1].view(torch.uint8))
                and torch.equal(fused[2], cast_after[2])
                and torch.equal(fused[3].data[:, :128 * used].view(torch.uint8),
                                cast_after[0].data[:, :128 * used].view(torch.uint8))
                and torch.equal(fused[3].scale_inv[:used], cast_after[0].scale_inv[:used])), (
            f"{name}: the FP8 act cast in the epilogue differs from the cast of the FP8 kernel's act")
        variants["sm90 fp8 + swiglu, then cast"] = lambda: block_columns_sm90(
            grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu")[1], offsets, rows=True)
        variants["sm90 fp8 t256 + swiglu + cast"] = lambda: grouped_gemm_act_quant_fp8_sm90(
            xq, xs, wq, ws, offsets, activation="swiglu", columns=True)
    flops = 2 * int(offsets[-1]) * n * h
    times = rotated_medians(variants, bench_us)
    quantize_us = {  # the forward's casts: x in 1 x 128 blocks, W in 128 x 128 (bf16 inputs)
        "x sm90": bench_us(lambda: block_quantize_sm90(xb, 1)),
        "x torch": bench_us(lambda: quantize(xb, "fp8_blockwise")),
        "x sm90 p2": bench_us(lambda: block_quantize_sm90(xb, 1, True)),
        "W sm90": bench_us(lambda: block_quantize_sm90(wb, 128)),
        "W sm90 p2": bench_us(lambda: block_quantize_sm90(wb, 128, True)),
        "W torch": bench_us(lambda: quantize_weight(wb, "fp8_blockwise")),
        "x current sm90": bench_us(lambda: tensor_quantize_sm90(xb, 1, offsets)),
        "x current torch": bench_us(lambda: quantize(xb, "fp8_current", offsets=offsets)),
        "W current sm90": bench_us(lambda: tensor_quantize_sm90(wb, 128)),
        "W current torch": bench_us(lambda: quantize_weight(wb, "fp8_current")),
        "x dequant sm90": bench_us(lambda: block_dequantize_sm90(qxb.rowwise_data, qxb.rowwise_scale_inv, xb.dtype)),
        "x dequant torch": bench_us(lambda: qxb.dequantize()),
    }
    return {"shape": name, "us": times, "tflops": {k: flops / t / 1e6 for k, t in times.items()}, "rel_err": errors,
            "quantize_us": quantize_us, "quantize_bytes": {"x": 3 * xb.numel(), "W": 3 * wb.numel()}}


def kernel_breakdown(fn, top=12):
    """GPU microseconds per kernel (name cut to 90 characters) in one call of ``fn``, largest first."""
    kernels = sorted(gpu_us_per_kernel(fn).items(), key=lambda kv: -kv[1])[:top]
    return {name[:90]: us for name, us in kernels}


def run_step(name, profile=False):
    """Forward and step times of the bf16 fused, FP8 sm90 and FP8 emulated MLPs (one shape)."""
    splits, fc1, fc2, x, dy = mlp_problem(name)
    fp8 = Sequential(fc1, SwiGLU(), Quantize("fp8_blockwise"), Transpose(), fc2)
    pow2 = Float8BlockScaling(power_2_scales=True)
    fp8_pow2 = Sequential(fc1, SwiGLU(), Quantize(pow2), Transpose(), fc2)
    fp8_current = Sequential(fc1, SwiGLU(), Quantize("fp8_current"), Transpose(), fc2)
    models = {
        "bf16 fused": Sequential(fc1, SwiGLU(), fc2),
        "fc2 fp8 sm90": fp8,
        "all fp8 sm90": Sequential(Quantize("fp8_blockwise"), *fp8),
        "fc2 fp8 sm90 p2": fp8_pow2,
        "all fp8 sm90 p2": Sequential(Quantize(pow2), *fp8_pow2),
        "fc2 fp8 sm90 current": fp8_current,
        "all fp8 sm90 current": Sequential(Quantize("fp8_current"), *fp8_current),
    }
    ends = torch.cumsum(splits, 0).to(torch.int32)
    models["plain torch bf16"] = lambda x, split_sizes: ReferenceMLP.apply(x, fc1.weight, fc2.weight, ends)
    leaves = [x, fc1.weight, fc2.weight]

    def step(model):
        for t in leaves:
            t.grad = None
        y = model(x, split_sizes=splits)
        y.backward(dy)
        return [y.detach(), *[t.grad for t in leaves]]

    outputs = {label: step(model) for label, model in models.items()}
    if profile:
        for label in ("bf16 fused", "fc2 fp8 sm90", "all fp8 sm90"):
            breakdown = kernel_breakdown(lambda: step(models[label]))
            print(f"{name} / {label}: {sum(breakdown.values()):.0f} us in the top kernels", flush=True)
            for kernel, us in breakdown.items():
                print(f"  {us:9.0f}  {kernel}", flush=True)
    forward = rotated_medians({k: functools.partial(m, x, split_sizes=splits) for k, m in models.items()}, step_us)
    steps = rotated_medians({k: functools.partial(step, m) for k, m in models.items()}, step_us)
    times = {k: {"forward": forward[k], "step": steps[k]} for k in models}
    reuse_group = {label: models[label] for label in ("bf16 fused", "fc2 fp8 sm90", "all fp8 sm90")}
    with reuse_quantized_weights():  # micro-batches after the first: the weight copies exist
        for label, model in reuse_group.items():
            again = step(model)
            assert all(torch.equal(a, b) for a, b in zip(again, outputs[label])), f"{name}: {label} in the reuse scope"
        forward = rotated_medians({k: functools.partial(m, x, split_sizes=splits) for k, m in reuse_group.items()},
                                  step_us)
        steps = rotated_medians({k: functools.partial(step, m) for k, m in reuse_group.items()}, step_us)
    reuse_bf16 = {"forward": forward.pop("bf16 fused"), "step": steps.pop("bf16 fused")}
    times.update({f"{k} reuse": {"forward": forward[k], "step": steps[k]} for k in forward})
    os.environ["TE_FUSED_OPS_BACKEND"] = "torch"  # the emulation: timed apart (far slower), same bytes in
    try:
        outputs["fc2 fp8 emulated"] = step(fp8)
        times["fc2 fp8 emulated"] = {"forward": step_us(lambda: fp8(x, split_sizes=splits)),
                                     "step": step_us(lambda: step(fp8))}
    finally:
        os.environ.pop("TE_FUSED_OPS_BACKEND", None)

    def errors(label, against):
        return [((a.float() - b.float()).norm() / b.float().norm()).item()
                for a, b in zip(outputs[label], outputs[against])]

    plain = errors("plain torch bf16", "bf16 fused")  # the same bf16 MLP: bf16 tolerance
    assert max(plain) <= 1e-2, f"{name}: plain torch vs bf16 fused, relative errors {plain}"
    same_recipe = errors("fc2 fp8 sm90", "fc2 fp8 emulated")  # output, dx, dW1, dW2
    # the quantization turns last-bit differences of the activation into whole E4M3 steps
    assert max(same_recipe) <= 5e-2, f"{name}: fp8 sm90 vs fp8 emulated, relative errors {same_recipe}"
    return {"shape": name, "us": times, "reuse_group_bf16_fused_us": reuse_bf16, "rel_err_vs_emulated": same_recipe,
            "rel_err_fp8_vs_bf16": {label: errors(label, "bf16 fused") for label in outputs if "fp8 sm90" in label}}


def kernel_tables(rows, device):
    labels = list(dict.fromkeys(label for r in rows for label in r["us"]))  # a shape may lack some
    lines = [
        f"FC1 forward, block-scaled FP8 vs bf16, {device}; median us (TFLOPS)",
        "",
        "| shape | " + " | ".join(labels) + " | fp8 vs sm90 bf16 |",
        "|---|" + "---|" * (len(labels) + 1),
    ]
    for r in rows:
        cells = [f"{r['us'][k]:.0f} ({r['tflops'][k]:.0f})" if k in r["us"] else "-" for k in labels]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + f" | {r['us']['sm90 bf16'] / r['us']['sm90 fp8']:.2f}x |")
    lines += [
        "",
        "Casts of the FC1 operands (bf16 <-> E4M3 + float32 scales); median us (GB/s, 3 bytes per element)",
        "",
        "| shape | x 1x128 sm90 | x 1x128 sm90 p2 | x 1x128 torch | W 128x128 sm90 | W 128x128 sm90 p2 | W 128x128 torch "
        "| x current sm90 | x current torch | W current sm90 | W current torch | x dequant sm90 | x dequant torch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    casts = ("x sm90", "x sm90 p2", "x torch", "W sm90", "W sm90 p2", "W torch", "x current sm90", "x current torch",
             "W current sm90", "W current torch", "x dequant sm90", "x dequant torch")
    for r in rows:
        q, b = r["quantize_us"], r["quantize_bytes"]
        cells = [f"{q[k]:.0f} ({b[k.split()[0]] / q[k] / 1e3:.0f})" for k in casts]
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " |")
    return lines


def step_table(steps, device):
    labels = list(steps[0]["us"])
    lines = [
        f"Training step, SwiGLU MLP, {device}; median us, forward / forward + backward",
        "",
        "| shape | " + " | ".join(labels) + " | fc2 fp8 sm90 step vs bf16 fused / vs plain torch | the same, p2 "
        "| the same, current | fc2 / all fp8 reuse step vs bf16 fused (same group) |",
        "|---|" + "---|" * (len(labels) + 4),
    ]
    for r in steps:
        cells = [f"{r['us'][k]['forward']:.0f} / {r['us'][k]['step']:.0f}" for k in labels]
        ratios = []
        for label in ("fc2 fp8 sm90", "fc2 fp8 sm90 p2", "fc2 fp8 sm90 current"):
            fp8 = r["us"][label]["step"]
            ratios.append(f"{r['us']['bf16 fused']['step'] / fp8:.2f}x / {r['us']['plain torch bf16']['step'] / fp8:.2f}x")
        bf16 = r["reuse_group_bf16_fused_us"]["step"]
        ratios.append(" / ".join(f"{bf16 / r['us'][f'{k} fp8 sm90 reuse']['step']:.2f}x" for k in ("fc2", "all")))
        lines.append(f"| {r['shape']} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return lines


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(MODEL_SHAPES), help="comma-separated names or MxHxIxE sizes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--part", choices=("all", "kernels", "steps"), default="all")
    ap.add_argument("--profile", action="store_true", help="print each step's GPU time per kernel first")
    args = ap.parse_args()
    device = torch.cuda.get_device_name()
    shapes = args.shapes.split(",")
    rows, steps, lines = [], [], []
    if args.part != "steps":
        for name in shapes:
            rows.append(run_shape(name))
            print(name, {k: f"{v:.0f} us" for k, v in rows[-1]["us"].items()}, flush=True)
        lines += kernel_tables(rows, device) + [""]
    if args.part != "kernels":
        for name in shapes:
            steps.append(run_step(name, args.profile))
            print(name, steps[-1]["us"], flush=True)
        lines += step_table(steps, device)
    table = "\n".join(lines).strip()
    print(table)
    if args.out:
        stem = "fp8_sm90" if args.part == "all" else f"fp8_{args.part}_sm90"
        write_results(args.out, f"{stem}_{device_tag(device)}", {"device": device, "results": rows, "steps": steps}, table)


if __name__ == "__main__":
    main()
