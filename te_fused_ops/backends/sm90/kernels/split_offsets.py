"""Torch-facing wrapper of the one-launch split-offsets kernel (`split_offsets_sm90`).

Used by `te_fused_ops.splits.split_offsets` for plain CUDA tensors when the sm90 kernels and
TVM-FFI are available: one launch instead of six small torch ops, which is most of a small MoE
layer's per-call bookkeeping on the host. Compiled once per size dtype, G symbolic.
"""

from __future__ import annotations

import torch

from .launch import cached_kernel, compile_launcher, fake_tensor


@cached_kernel
def compile_split_offsets(size_dtype, tvm_ffi=True):
    """Compile (once per size dtype) and return the launcher fn(sizes, offsets, num_rows)."""
    import cutlass
    import cutlass.cute as cute

    from .split_offsets_sm90 import SplitOffsetsSm90

    element = {torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}[size_dtype]
    g, g1 = cute.sym_int(), cute.sym_int()
    sizes = fake_tensor(element, (g,), element.width // 8)
    offsets = fake_tensor(cutlass.Int32, (g1,), 4)
    return compile_launcher(SplitOffsetsSm90(), (sizes, offsets, cutlass.Int32(1)), tvm_ffi)


def split_offsets_sm90(split_sizes: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(G,) int32/int64 contiguous CUDA sizes -> (G+1,) int32 offsets, as `splits.split_offsets`
    (the caller has checked dtype, shape and device; ``num_rows`` < 2**31)."""
    offsets = torch.empty(split_sizes.shape[0] + 1, dtype=torch.int32, device=split_sizes.device)
    compile_split_offsets(split_sizes.dtype)(split_sizes, offsets, num_rows)
    return offsets
