"""Torch-facing wrapper of the routing kernel (`route_sm90`): top-k expert ids -> the expert order
of `te_fused_ops.routing.Routing`, in three launches instead of the torch path's two dozen (a
radix sort of int32 keys, a scatter, a search and their set-up), with each row's token id as well.

Used by `routing.route` for plain CUDA ids when the sm90 kernels and TVM-FFI are available and
E + 1 <= `route_sm90.MAX_BUCKETS`. Compiled once per id dtype, every extent symbolic.
"""

from __future__ import annotations

import torch

from .launch import cached_kernel, compile_launcher, fake_tensor, ffi_kernels_available

MAX_BUCKETS = 1024  # = route_sm90.MAX_BUCKETS
SLOTS_PER_CTA = 2048  # = route_sm90.SLOTS_PER_CTA


@cached_kernel
def compile_route(id_dtype, tvm_ffi=True):
    """Compile (once per id dtype) and return fn(ids, cta_counts, offsets, counts, slot_rows,
    row_slots, row_tokens, num_experts, k)."""
    import cutlass
    import cutlass.cute as cute

    from .route_sm90 import RouteSm90

    element = {torch.int32: cutlass.Int32, torch.int64: cutlass.Int64}[id_dtype]
    m, c, b, e = (cute.sym_int() for _ in range(4))
    args = (
        fake_tensor(element, (m,), element.width // 8), fake_tensor(cutlass.Int32, (c, b), 4),
        fake_tensor(cutlass.Int32, (b,), 4), fake_tensor(cutlass.Int32, (e,), 4),
        fake_tensor(cutlass.Int32, (m,), 4), fake_tensor(cutlass.Int64, (m,), 8),
        fake_tensor(cutlass.Int32, (m,), 4), cutlass.Int32(1), cutlass.Int32(1),
    )
    return compile_launcher(RouteSm90(), args, tvm_ffi)


def route_supported(indices: torch.Tensor, num_experts: int) -> bool:
    """Whether `route_sm90` takes these ids: a plain CUDA (T, k) int32/int64 tensor, 0 < T * k <
    2**31, and at most MAX_BUCKETS - 1 experts."""
    return (type(indices) is torch.Tensor and indices.is_cuda and indices.dim() == 2
            and indices.dtype in (torch.int32, torch.int64) and 0 < indices.numel() < 2**31
            and 0 < num_experts < MAX_BUCKETS and ffi_kernels_available())


def route_sm90(indices: torch.Tensor, num_experts: int) -> tuple:
    """(slot_rows (T, k) int32, row_slots (M,) int64, row_tokens (M,) int32, offsets (E+1,) int32,
    counts (E,) int32) of ids ``indices`` (T, k) (`route_supported`; values are not checked: an id
    outside [0, E) is a dropped slot), as `routing.route` defines them. No host sync."""
    t, k = indices.shape
    num_slots = t * k
    device = indices.device
    ids = indices.reshape(-1).contiguous()
    cta_counts = torch.empty(-(-num_slots // SLOTS_PER_CTA), num_experts + 1, dtype=torch.int32, device=device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int32, device=device)
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    slot_rows = torch.empty(num_slots, dtype=torch.int32, device=device)
    row_slots = torch.empty(num_slots, dtype=torch.int64, device=device)
    row_tokens = torch.empty(num_slots, dtype=torch.int32, device=device)
    compile_route(ids.dtype)(ids, cta_counts, offsets, counts, slot_rows, row_slots, row_tokens, num_experts, k)
    return slot_rows.view(t, k), row_slots, row_tokens, offsets, counts
