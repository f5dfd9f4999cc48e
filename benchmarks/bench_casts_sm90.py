"""The E4M3 cast kernels alone on sm90, against a plain copy of the same bytes (fp8_blockwise).

  weight cast   block_quantize_sm90(w, 128, transposed=True, out=kept): 128 x 128 blocks, the
                row-wise and transposed copies written into kept storage (the once-per-step recast)
  rows          block_quantize_sm90(x, 1): 1 x 128 blocks (the act and d_pre row casts)
  scatter cast  scatter_cast_rows: each token's row cast once and written to its k slots' rows
                (the combine backward's cast of dy)

TB/s counts each byte read and written once; a bf16 ``copy_`` moves 4 bytes per element, the
weight cast's count (2 read, 1 + 1 written). Times: `common.sustained_ms`. The casts are checked
bit for bit against the torch quantizer by tests/test_block_quantize_sm90_gpu.py and
tests/test_moe_rows_sm90_gpu.py (run them first on the same machine). For an A/B, run once per
build with the build first on PYTHONPATH and a tag:

    python benchmarks/bench_casts_sm90.py [tag]
"""

import sys

from common import require_sm90

if __name__ == "__main__":
    require_sm90(__file__)

import torch
from common import sustained_ms

from te_fused_ops.backends.sm90.kernels.block_quantize import block_quantize_sm90
from te_fused_ops.backends.sm90.kernels.moe_rows import scatter_cast_rows

WEIGHTS = [(128, 1536, 2048), (128, 2048, 768), (32, 5760, 2880), (32, 4096, 7168)]  # (E, N, K)
ROWS = [(65536, 1536), (65536, 768), (32768, 2880)]
SCATTERS = [(8192, 2048, 8), (8192, 2880, 4)]  # (tokens, hidden, k)


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
    for name, (ms, nbytes) in times.items():
        print(f"{tag} {name} {ms * 1e3:.1f} us {nbytes / ms / 1e9:.2f} TB/s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "run")
