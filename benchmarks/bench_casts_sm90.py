"""The E4M3 cast kernels alone on sm90, against a plain copy of the same bytes (fp8_blockwise).

  weight cast   block_quantize_sm90(w, 128, transposed=True, out=kept): 128 x 128 blocks, the
                row-wise and transposed copies written into kept storage (the once-per-step recast)
  rows          block_quantize_sm90(x, 1): 1 x 128 blocks (the act and d_pre row casts)
  scatter cast  scatter_cast_rows: each token's row cast once and written to its k slots' rows
                (the combine backward's cast of dy)
  columns       block_columns_sm90: the per-group column-wise copy for the FP8 weight gradient, from
                E4M3 rows (x, dy in the layer), from bf16, and with the row-wise copy from one read
                (the act after a bf16 FC1)

TB/s counts each byte read and written once; a bf16 ``copy_`` moves 4 bytes per element, the
weight cast's count (2 read, 1 + 1 written). Times: `common.sustained_ms`. The casts are checked
bit for bit against the torch quantizer by tests/test_block_quantize_sm90_gpu.py,
tests/test_block_columns_sm90_gpu.py and tests/test_moe_rows_sm90_gpu.py (run them first on the
same machine). For an A/B, run once per
build with the build first on PYTHONPATH and a tag:

    python benchmarks/bench_casts_sm90.py [tag]
"""

import sys

from common import require_sm90

if __name__ == "__main__":
    require_sm90(__file__)

import torch
from common import sustained_ms

from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90, block_quantize_sm90
from te_fused_ops.backends.sm90.kernels.moe_rows import scatter_cast_rows
from te_fused_ops.quantization import quantize

WEIGHTS = [(128, 1536, 2048), (128, 2048, 768), (32, 5760, 2880), (32, 4096, 7168)]  # (E, N, K)
ROWS = [(65536, 1536), (65536, 768), (32768, 2880)]
SCATTERS = [(8192, 2048, 8), (8192, 2880, 4)]  # (tokens, hidden, k)
COLUMNS = [  # (rows M, width C, groups G, source): the layer's x, dy and act copies
    (32768, 4096, 8, "e4m3"), (32768, 7168, 32, "e4m3"), (65536, 2048, 128, "e4m3"), (32768, 2880, 32, "e4m3"),
    (65536, 2048, 128, "bf16"), (32768, 14336, 8, "bf16 + rows"), (65536, 768, 128, "bf16 + rows"),
]


def main(tag: str) -> None:
    times = {}  # name -> (ms, bytes)
    for shape in WEIGHTS:
        w = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        kept = block_quantize_sm90(w, 128, transposed=True)
        times[f"weight cast {shape}"] = (
            sustained_ms(lambda: block_quantize_sm90(w, 128, transposed=True, out=kept), 0.3, 0.3), w.numel() * 4)
        copy = torch.empty_like(w)
        times[f"copy_ {shape}"] = (sustained_ms(lambda: copy.copy_(w), 0.3, 0.3), w.numel() * 4)
    for shape in ROWS:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        times[f"rows {shape}"] = (sustained_ms(lambda: block_quantize_sm90(x, 1), 0.3, 0.3), x.numel() * 3)
    for tokens, hidden, k in SCATTERS:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        rows = torch.randperm(tokens * k, device="cuda").to(torch.int32).view(tokens, k)
        num_kept = torch.tensor([tokens * k], device="cuda", dtype=torch.int32)
        times[f"scatter cast {(tokens, hidden, k)}"] = (
            sustained_ms(lambda: scatter_cast_rows(x, rows, num_kept), 0.3, 0.3), x.numel() * 2 + tokens * k * hidden)
    for m, c, g, source in COLUMNS:
        splits = torch.distributions.Dirichlet(torch.ones(g)).sample() * m
        splits = splits.floor().long()
        splits[-1] += m - splits.sum()
        offsets = torch.cat([splits.new_zeros(1), splits.cumsum(0)]).to(torch.int32).cuda()
        x = torch.randn(m, c, device="cuda", dtype=torch.bfloat16)
        rows = source == "bf16 + rows"
        kwargs = {"rows": rows}
        if source == "e4m3":
            q = quantize(x, "fp8_blockwise")
            x, kwargs = q.rowwise_data, {"x_scale_inv": q.rowwise_scale_inv}
        blocks = int(((splits + 127) // 128).sum())
        nbytes = x.numel() * x.element_size() + c * 128 * blocks + (m * c if rows else 0)
        times[f"columns from {source} {(m, c, g)}"] = (
            sustained_ms(lambda: block_columns_sm90(x, offsets, **kwargs), 0.3, 0.3), nbytes)
    for name, (ms, nbytes) in times.items():
        print(f"{tag} {name} {ms * 1e3:.1f} us {nbytes / ms / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
