"""Per-group row bookkeeping: split sizes -> clamped device offsets, checks, validation mode.

Rows of a grouped tensor ``x`` of shape ``(M, K)`` are grouped contiguously: group ``g`` owns
rows ``offsets[g]:offsets[g+1]``; rows ``offsets[G]:M`` are padding. Offsets are computed on the
device of ``split_sizes`` and clamped, so no split value can make a kernel index out of bounds.
"""

import threading
from contextlib import contextmanager

import torch

from . import env
from .backends import helper_kernel
from .cuda_graphs import capturing
from .errors import OpTypeError, OpValueError

_SPLIT_DTYPES = (torch.int32, torch.int64)
_local = threading.local()  # .validation: the innermost `validation()` setting of this thread


def validation_enabled(device: torch.device = None) -> bool:
    """Whether split values are checked: inside `validation()` its setting; else on the CPU
    always (reading them costs nothing there), elsewhere only with env TE_FUSED_OPS_VALIDATE=1
    (a host sync)."""
    override = getattr(_local, "validation", None)
    enabled = override if override is not None else (
        (device is not None and device.type == "cpu") or env.read("TE_FUSED_OPS_VALIDATE"))
    if enabled and (device is None or device.type == "cuda") and capturing():
        raise RuntimeError("te_fused_ops: value checks (TE_FUSED_OPS_VALIDATE=1 or validation()) read values on the "
                           "host, which a CUDA graph capture cannot: turn them off while capturing")
    return enabled


@contextmanager
def validation(enabled: bool = True):
    """Context manager turning split-value validation on (or off) inside its block, in this thread."""
    previous = getattr(_local, "validation", None)
    _local.validation = enabled
    try:
        yield
    finally:
        _local.validation = previous


def check_split_sizes(op_name: str, split_sizes, num_groups: int, device: torch.device) -> None:
    """Type/shape/device checks (no sync): raises TypeError/ValueError naming op and argument."""
    if not isinstance(split_sizes, torch.Tensor):
        raise OpTypeError(f"{op_name}: argument 'split_sizes' must be a torch.Tensor, got {type(split_sizes).__name__}")
    if split_sizes.dtype not in _SPLIT_DTYPES:
        raise OpTypeError(f"{op_name}: argument 'split_sizes' must have dtype int32 or int64, got {split_sizes.dtype}")
    if split_sizes.dim() != 1 or split_sizes.shape[0] != num_groups:
        raise OpValueError(
            f"{op_name}: argument 'split_sizes' must have shape ({num_groups},), got {tuple(split_sizes.shape)}"
        )
    if split_sizes.device != device:
        raise OpValueError(
            f"{op_name}: argument 'split_sizes' is on {split_sizes.device} but the input is on {device}"
        )


def validate_split_values(op_name: str, split_sizes: torch.Tensor, num_rows: int) -> None:
    """Value checks for validation mode (host sync): negative sizes, sum larger than the rows."""
    values = split_sizes.detach().cpu().tolist()
    if any(v < 0 for v in values):
        raise OpValueError(f"{op_name}: argument 'split_sizes' has negative entries: {values}")
    total = sum(values)  # Python ints: no overflow
    if total > num_rows:
        raise OpValueError(f"{op_name}: argument 'split_sizes' sums to {total} but the input has {num_rows} rows")


def split_offsets(split_sizes: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(G,) sizes -> (G+1,) int32 offsets on the same device: 0, then clamped inclusive prefix sums.

    Each size is clamped to ``[0, num_rows]`` before the int64 prefix sum (which then cannot
    overflow for any int32/int64 values: G * num_rows < 2**63), and every offset to
    ``num_rows``, so offsets are nondecreasing and within ``[0, num_rows]`` whatever the values.
    A backend's offsets kernel takes them where it applies (one launch), else six torch ops.
    """
    offsets = helper_kernel("split_offsets", split_sizes, num_rows)
    if offsets is not None:
        return offsets
    sizes = split_sizes.clamp(0, num_rows).to(torch.int64)
    ends = torch.cumsum(sizes, 0).clamp(max=num_rows).to(torch.int32)
    return torch.cat([ends.new_zeros(1), ends])


def row_group_ids(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(M,) int64 group index of each row; padding rows get index G."""
    rows = torch.arange(num_rows, device=offsets.device, dtype=torch.int32)
    return torch.searchsorted(offsets[1:].contiguous(), rows, right=True)


def valid_rows_mask(offsets: torch.Tensor, num_rows: int) -> torch.Tensor:
    """(M, 1) bool: True for rows that belong to a group (row < offsets[G])."""
    rows = torch.arange(num_rows, device=offsets.device, dtype=torch.int32)
    return (rows < offsets[-1]).unsqueeze(1)


def remember_offsets(memo: dict, split_sizes: torch.Tensor, num_rows: int, offsets: torch.Tensor) -> None:
    """Tell `bind_offsets` of the same call that ``split_sizes`` over ``num_rows`` rows has
    ``offsets`` (e.g. a permute's, computed with its routing): no second computation."""
    memo[_offsets_key(split_sizes, num_rows)] = offsets


def _offsets_key(split_sizes: torch.Tensor, num_rows) -> tuple:
    """The memo key of ``split_sizes`` over ``num_rows`` rows. A symbolic row count (the fake run
    of a dynamic-shape torch.compile trace) keys as any other: one call's ops read one routing's
    rows, and dynamo may name that count by two symbols that it cannot prove equal (x's token
    count and the probabilities' after a broadcast), so keying by the expression computed the
    offsets twice and the traced call saved other values than its first run."""
    return ("offsets", id(split_sizes), num_rows if isinstance(num_rows, int) else "symbolic")


def bind_offsets(op_name: str, side: dict, x: torch.Tensor, memo: dict, num_groups=None) -> torch.Tensor:
    """Checked ``split_sizes`` -> offsets for the rows of ``x``, computed once per call (``memo``)."""
    if x.dim() != 2:
        raise OpValueError(f"{op_name}: argument 'x' must be 2-D (tokens, features), got shape {tuple(x.shape)}")
    split_sizes = side["split_sizes"]
    if num_groups is None and isinstance(split_sizes, torch.Tensor):
        num_groups = split_sizes.shape[0] if split_sizes.dim() == 1 else -1
    check_split_sizes(op_name, split_sizes, num_groups, x.device)
    key = _offsets_key(split_sizes, x.shape[0])
    if key not in memo:
        if validation_enabled(split_sizes.device):
            validate_split_values(op_name, split_sizes, x.shape[0])
        memo[key] = split_offsets(split_sizes, x.shape[0])
    return memo[key]
