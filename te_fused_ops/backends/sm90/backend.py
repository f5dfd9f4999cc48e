"""The sm90 `Backend` object: availability and the split-offsets kernel (its rule
implementations register on it from `rules`), and the settings its kernels receive."""

import os

import torch

from ... import env
from ...overlap import reserved_sms
from .. import Backend, register_backend
from .kernels import sm90_unavailable_reason
from .kernels.split_offsets import kernel_available, split_offsets_sm90


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
    """One launch for plain CUDA sizes where the kernel runs, else None."""
    if type(split_sizes) is torch.Tensor and split_sizes.is_cuda and num_rows < 2**31 and kernel_available():
        return split_offsets_sm90(split_sizes.contiguous(), num_rows)
    return None


def _kernel_input(value):
    """A step's input as the kernels read it: a tensor that is not contiguous or not 16-byte
    aligned (a slice of a wider tensor, an odd offset into a buffer) becomes a contiguous copy;
    anything else as it is."""
    if type(value) is torch.Tensor and (not value.is_contiguous() or value.data_ptr() % 16):
        return value.clone(memory_format=torch.contiguous_format)
    return value


SM90 = register_backend(Backend("sm90", _unavailable_reason, preference=10, split_offsets=_split_offsets,
                                prepare_input=_kernel_input))


# CPython keeps os.environ's encoded entries in `_data`: one lookup there costs ~30 ns against
# ~600 ns for os.environ.get, and sees every change made through os.environ.
_ENVIRON_STORE = getattr(os.environ, "_data", None)
_SM_MARGIN = "TE_FUSED_OPS_SM_MARGIN"
_SM_MARGIN_KEY = os.environ.encodekey(_SM_MARGIN) if _ENVIRON_STORE is not None else None
_sm_margin_read = [None, 0]  # [raw value, parsed setting] of the latest read


def sm_margin() -> int:
    """SMs the sm90 GEMMs leave free for kernels beside them: env TE_FUSED_OPS_SM_MARGIN (read at
    every call; parsed again only when the raw value changed), or more while a chunked segment's
    exchanges run beside them (`overlap.reserved_sms`)."""
    raw = _ENVIRON_STORE.get(_SM_MARGIN_KEY) if _ENVIRON_STORE is not None else os.environ.get(_SM_MARGIN)
    if raw != _sm_margin_read[0]:
        _sm_margin_read[:] = [raw, env.read(_SM_MARGIN, "sm90 backend")]
    return max(_sm_margin_read[1], reserved_sms())
