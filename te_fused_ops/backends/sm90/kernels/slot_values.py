"""Torch-facing wrappers of the slot-value kernels (`slot_values_sm90`): the router probabilities
(T, k) to the expert rows' (M,) float32 in one launch, and the rows' gradient partials (P, M)
back to the slots in one, where torch ops take four and seven (mask, gather, cast, sum).

Used by `routing.slots_to_rows` and `routing.rows_to_slots` for plain CUDA tensors when the sm90
kernels and TVM-FFI are available. Compiled once per slot dtype, every extent symbolic. The callers
pass contiguous tensors of the documented dtypes (not checked again here).
"""

from __future__ import annotations

import torch

from .launch import cached_kernel, compile_launcher, fake_tensor, ffi_kernels_available

SLOT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _element(dtype):
    import cutlass

    return {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16, torch.float32: cutlass.Float32}[dtype]


@cached_kernel
def compile_slots_to_rows(slot_dtype, tvm_ffi=True):
    """Compile (once per slot dtype) and return fn(slot_values, row_slots, num_kept, row_values)."""
    import cutlass
    import cutlass.cute as cute

    from .slot_values_sm90 import SlotValuesSm90

    s, m = cute.sym_int(), cute.sym_int()
    element = _element(slot_dtype)
    args = (fake_tensor(element, (s,), element.width // 8), fake_tensor(cutlass.Int64, (m,), 8),
            fake_tensor(cutlass.Int32, (1,), 4), fake_tensor(cutlass.Float32, (m,), 4))
    return compile_launcher(SlotValuesSm90(to_rows=True), args, tvm_ffi)


@cached_kernel
def compile_rows_to_slots(slot_dtype, tvm_ffi=True):
    """Compile (once per slot dtype) and return fn(row_parts, slot_rows, num_kept, slot_values)."""
    import cutlass
    import cutlass.cute as cute

    from .slot_values_sm90 import SlotValuesSm90

    p, m, s = cute.sym_int(), cute.sym_int(), cute.sym_int()
    element = _element(slot_dtype)
    args = (fake_tensor(cutlass.Float32, (p, m), 4), fake_tensor(cutlass.Int32, (s,), 4),
            fake_tensor(cutlass.Int32, (1,), 4), fake_tensor(element, (s,), element.width // 8))
    return compile_launcher(SlotValuesSm90(to_rows=False), args, tvm_ffi)


def slot_values_supported(values: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether the kernels take ``values`` (a plain CUDA tensor, 0 < numel < 2**31) with slots of
    ``dtype``."""
    return (type(values) is torch.Tensor and values.is_cuda and 0 < values.numel() < 2**31
            and dtype in SLOT_DTYPES and ffi_kernels_available())


def slots_to_rows_sm90(slot_values: torch.Tensor, row_slots: torch.Tensor, num_kept: torch.Tensor) -> torch.Tensor:
    """(T, k) slot values, (M,) int64 row_slots, (1,) int32 num_kept -> (M,) float32: row r holds
    its slot's value, rows from num_kept on 0. No host sync."""
    rows = torch.empty(row_slots.shape[0], dtype=torch.float32, device=row_slots.device)
    compile_slots_to_rows(slot_values.dtype)(slot_values.reshape(-1), row_slots, num_kept, rows)
    return rows


def rows_to_slots_sm90(row_parts: torch.Tensor, slot_rows: torch.Tensor, num_kept: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """(P, M) float32 partial sums per row (P >= 1), (T, k) int32 slot_rows, (1,) int32 num_kept ->
    (T, k) ``dtype``: slot (t, j) holds the sum of its row's parts (in order, in float32), a
    dropped slot 0. No host sync."""
    slots = torch.empty(slot_rows.shape, dtype=dtype, device=slot_rows.device)
    compile_rows_to_slots(dtype)(row_parts, slot_rows.reshape(-1), num_kept, slots.view(-1))
    return slots
