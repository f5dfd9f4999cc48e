"""The sm90 `Backend` object: availability, its helper kernels (split offsets, routing, slot
values; its rule implementations register on it from `rules`), and the settings its kernels
receive."""

import torch

from ... import env, kernel_cache
from ...overlap import reserved_sms
from .. import Backend, register_backend
from .kernels import sm90_unavailable_reason
from .kernels.route import compile_route, route_sm90, route_supported
from .kernels.slot_values import (
    compile_rows_to_slots,
    compile_slots_to_rows,
    rows_to_slots_sm90,
    slot_values_supported,
    slots_to_rows_sm90,
)
from .kernels.launch import ffi_kernels_available
from .kernels.split_offsets import compile_split_offsets, split_offsets_sm90


def kernel_reason(reason):
    """A kernel's unsupported reason as explain() shows it (without the kernels' own prefix)."""
    return reason.removeprefix("sm90 backend: ") if reason else None


def _unavailable_reason(info):
    if info.device_type != "cuda":
        return "no CUDA device"
    if info.capability != (9, 0):
        return f"compute capability {info.capability[0]}.{info.capability[1]}, needs 9.0"
    return kernel_reason(sm90_unavailable_reason())


def _split_offsets(split_sizes, num_rows: int):
    """One launch for plain CUDA sizes where the kernel runs, else None (also inside
    `kernel_cache.recording()`, as for the routing: torch ops may read the offsets there)."""
    if type(split_sizes) is torch.Tensor and split_sizes.is_cuda and num_rows < 2**31 and ffi_kernels_available():
        if kernel_cache.is_recording():
            compile_split_offsets(split_sizes.dtype)
            return None
        return split_offsets_sm90(split_sizes.contiguous(), num_rows)
    return None


def _route(indices, num_experts: int):
    """Three launches for plain CUDA ids where the kernel runs, else None. Inside
    `kernel_cache.recording()` the kernel is only recorded (torch ops read the routing, so it must
    hold real rows) and the torch routing runs."""
    if not route_supported(indices, num_experts):
        return None
    if kernel_cache.is_recording():
        compile_route(indices.dtype)
        return None
    return route_sm90(indices, num_experts)


def _slots_to_rows(slot_values, routing):
    """One launch for a plain CUDA routing's slot values where the kernel runs, else None (also
    inside `kernel_cache.recording()`, as for the routing: the kernel is only recorded)."""
    if not (slot_values_supported(routing.row_slots, slot_values.dtype) and type(slot_values) is torch.Tensor
            and slot_values.device == routing.row_slots.device
            and slot_values.numel() == routing.row_slots.shape[0]):
        return None
    if kernel_cache.is_recording():
        compile_slots_to_rows(slot_values.dtype)
        return None
    return slots_to_rows_sm90(slot_values.contiguous(), routing.row_slots, routing.num_kept)


def _rows_to_slots(row_parts, routing, dtype):
    """One launch for float32 row partials of a plain CUDA routing where the kernel runs, else
    None (recorded only, as above)."""
    if not (slot_values_supported(routing.slot_rows, dtype) and type(row_parts) is torch.Tensor
            and row_parts.dtype == torch.float32 and row_parts.device == routing.slot_rows.device
            and row_parts.shape[0] >= 1 and row_parts.shape[1] == routing.row_slots.shape[0]):
        return None
    if kernel_cache.is_recording():
        compile_rows_to_slots(dtype)
        return None
    return rows_to_slots_sm90(row_parts.contiguous(), routing.slot_rows, routing.num_kept, dtype)


def _kernel_input(value):
    """A step's input as the kernels read it: a tensor that is not contiguous or not 16-byte
    aligned (a slice of a wider tensor, an odd offset into a buffer) becomes a contiguous copy;
    anything else as it is."""
    if type(value) is torch.Tensor and (not value.is_contiguous() or value.data_ptr() % 16):
        return value.clone(memory_format=torch.contiguous_format)
    return value


SM90 = register_backend(Backend(
    "sm90", _unavailable_reason, preference=10, prepare_input=_kernel_input,
    helpers={"split_offsets": _split_offsets, "route": _route, "slots_to_rows": _slots_to_rows,
             "rows_to_slots": _rows_to_slots}))


_SM_MARGIN = env.hot_switch("TE_FUSED_OPS_SM_MARGIN", "sm90 backend")


def sm_margin() -> int:
    """SMs the sm90 GEMMs leave free for kernels beside them: env TE_FUSED_OPS_SM_MARGIN (read at
    every call; parsed again only when the raw value changed), or more while a chunked segment's
    exchanges run beside them (`overlap.reserved_sms`)."""
    return max(_SM_MARGIN(), reserved_sms())
