"""Quantization recipes and ``QuantizedTensor`` (pure torch: CPU, CUDA, and the meta device).

Every recipe stores FP8 E4M3 data (``torch.float8_e4m3fn``, max 448) and float32 dequantization
multipliers ``scale_inv``, one per block: ``x ~= data.float() * scale_inv`` (expanded over the block).

Recipes (the block size ``B`` runs along the scaled dim):

- ``Float8BlockScaling`` ("fp8_blockwise"): 1x128 blocks for activations and gradients, 128x128
  blocks per group for weights (DeepSeek-V3 / TE's Hopper recipe). ``scale_inv = amax / 448``;
  with ``power_2_scales=True`` it is rounded up to a power of two.
- ``Float8CurrentScaling`` ("fp8_current"): one ``scale_inv = amax / 448`` for the whole tensor.
- ``MXFP8BlockScaling`` ("mxfp8"): 1x32 blocks (weights too), shared E8M0 exponent per OCP MX
  v1.0: ``scale_inv = 2**(floor(log2(amax)) - 8)`` (8 = emax of E4M3), clamped to
  ``[2**-127, 2**127]``. Since ``amax / scale_inv`` lies in ``[256, 512)``, a block's largest
  values can exceed 448 and saturate (the spec's behaviour; TE instead rounds ``amax / 448`` up to
  a power of two, which is ``Float8BlockScaling(power_2_scales=True)`` with 32-element blocks).
  Scales are exact powers of two kept as float32 (``scale_inv.to(torch.float8_e8m0fnu)`` is exact).

Numerics: in float32, ``data = saturating_cast(x / scale_inv)``: values beyond +-448 clamp to
+-448, then round-to-nearest-even (torch's cast). Divisions are IEEE float32 divisions, so CPU
and CUDA give identical bits (a kernel that multiplies by reciprocals may differ by one E4M3 step
on rare ties). A block with amax 0 (or whose ``amax / 448`` underflows to 0) gets
``scale_inv = 1`` and data 0.

Dequantization saturates to the output dtype's finite range: rounding to E4M3 may round a
block's largest value up, which near the dtype's max (power-of-two or MX scales) would otherwise
give Inf.

Non-finite inputs: ``amax`` is taken over the finite values of the block only, so the block's
finite values are quantized as if the non-finite ones were absent; +-Inf saturates to +-448 (it
dequantizes to ``+-448 * scale_inv``); NaN stays NaN in the data and dequantizes to NaN. So an
output gradient holding Inf (an fp16 loss-scale overflow) leaves an FP8 layer's gradients finite,
where ``torch.amp.GradScaler`` would look for it: scale fp16 losses before the FP8 layers see them,
or train in bf16.

Ragged blocks: no size needs to be a multiple of the block size; the last block along a dim is
shorter and is scaled by its own amax.

Layouts, for activations/gradients ``x`` of shape ``(..., K)``, viewed as ``(M, K)`` for the
columnwise copy:

- ``rowwise_data``: ``x.shape``; ``rowwise_scale_inv``: ``(..., ceil(K / B))``, or ``()``
  per-tensor.
- ``columnwise_data``: ``(K, M)``, ``x^T`` quantized with blocks of ``B`` along ``M`` (the token
  dim) that never straddle a group boundary. Rows are grouped by ``offsets`` ``(G+1,)``: group g
  holds rows ``[offsets[g], offsets[g+1])``; rows ``>= offsets[G]`` are padding and form their own
  trailing group. ``columnwise_scale_inv``: ``(K, ceil(M / B) + G)`` (a static bound; unused
  blocks have scale_inv 1), ``(K, ceil(M / B))`` without offsets, ``()`` per-tensor (the rowwise
  scale, so the copy is exactly ``rowwise_data`` transposed). ``group_block_index`` gives each
  row's block.

Weights ``(G, N, K)`` or ``(N, K)`` (``role="weight"``): ``Float8BlockScaling`` uses 128x128
blocks per group, ``rowwise_scale_inv`` ``(G, ceil(N/128), ceil(K/128))``; the columnwise copy is
the per-group transpose ``(G, K, N)`` with the transposed scales (exact). ``MXFP8BlockScaling``
uses 1x32 blocks along K, and along N for the columnwise copy. Current scaling: one scale.

Sync-free: quantization and dequantization do no device-to-host transfer and their output
shapes depend only on input shapes. Offsets are sanitized on the device: ``offsets[0]`` is taken
as 0, the others are clamped to ``[0, M]`` and made nondecreasing (running max).

``quantize`` is not differentiable (it quantizes ``x.detach()``); wrap it in an
``autograd.Function`` with a straight-through backward (see ``fake_quantize``).
"""

from __future__ import annotations

import dataclasses
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils._pytree import tree_map_only

from .cuda_graphs import capturing
from .errors import OpTypeError, OpValueError, bool_argument

__all__ = [
    "Recipe",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "MXFP8BlockScaling",
    "get_recipe",
    "QuantizedTensor",
    "quantize",
    "quantize_weight",
    "add_columnwise",
    "fake_quantize",
    "group_block_index",
    "high_precision_wgrad",
    "wgrad_source",
]

FP8_DTYPE = torch.float8_e4m3fn
E4M3_MAX = 448.0
E4M3_EMAX = 8  # exponent of E4M3's largest power of two (256)
ROLES = ("activation", "gradient", "weight")
_SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _exp2(exponent: torch.Tensor) -> torch.Tensor:
    """Exact float32 ``2**exponent`` for integer exponents in [-149, 127], built from the bits."""
    exponent = exponent.to(torch.int32)
    normal_bits = (exponent + 127).clamp(min=1) << 23
    subnormal_bits = 1 << (exponent + 149).clamp(0, 22)
    return torch.where(exponent >= -126, normal_bits, subnormal_bits).view(torch.float32)


def _amax_over_e4m3_max(amax: torch.Tensor) -> torch.Tensor:
    """IEEE float32 ``amax / 448`` on every device (CUDA turns a division by a Python scalar into
    a multiplication by its reciprocal, which differs in the last bit)."""
    return amax / torch.full((), E4M3_MAX, device=amax.device)


def _finite_abs(x: torch.Tensor) -> torch.Tensor:
    """|x| with NaN and +-Inf replaced by 0 (amax is taken over finite values)."""
    return x.abs().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _saturating_cast(x: torch.Tensor) -> torch.Tensor:
    """float32 -> E4M3, clamping to +-448 first (NaN stays NaN), round-to-nearest-even."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8_DTYPE)


def _saturate_to(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 dequantized values -> dtype, clamped to its finite range (NaN stays NaN; float64
    takes every float32 value)."""
    finite_max = min(torch.finfo(dtype).max, torch.finfo(torch.float32).max)
    return values.clamp(-finite_max, finite_max).to(dtype)


@dataclass(frozen=True)
class Recipe:
    """Base of the quantization recipes. Frozen and hashable (usable as a cache key).

    ``block_size``: elements per scale along the scaled dim, None for one scale per tensor.
    ``weight_blocks_2d``: weights use ``block_size x block_size`` blocks per group.
    """

    name: ClassVar[str] = "recipe"
    block_size: ClassVar[int | None] = None
    weight_blocks_2d: ClassVar[bool] = False

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type in (bool, "bool"):
                object.__setattr__(self, field.name, bool_argument(type(self).__name__, field.name, value))

    def scale_inv_from_amax(self, amax: torch.Tensor) -> torch.Tensor:
        """float32 amax (any shape) -> float32 dequantization multipliers of the same shape."""
        raise NotImplementedError(f"{type(self).__name__} does not define scale_inv_from_amax")


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 E4M3, 1x128 blocks (activations, gradients), 128x128 blocks (weights).

    ``power_2_scales``: round each ``scale_inv`` up to a power of two (exact rescaling).
    ``high_precision_wgrad``: the weight gradients run in the 16-bit dtype on the unquantized
    input and output gradient (TE's ``override_linear_precision`` for wgrad); the forward and
    data-gradient GEMMs stay FP8. No column-wise copies are made then: cheaper where the FP8
    weight gradient saves less than its operands' column casts cost (fine-grained experts).
    """

    name: ClassVar[str] = "fp8_blockwise"
    block_size: ClassVar[int] = 128
    weight_blocks_2d: ClassVar[bool] = True
    power_2_scales: bool = False
    high_precision_wgrad: bool = False

    def scale_inv_from_amax(self, amax):
        scale_inv = _amax_over_e4m3_max(amax)
        if self.power_2_scales:
            mantissa, exponent = torch.frexp(scale_inv)  # scale_inv = mantissa * 2**exponent
            exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
            scale_inv = _exp2(exponent.clamp(-149, 127))
        return torch.where(scale_inv > 0, scale_inv, 1.0)


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """FP8 E4M3, one scale per tensor from the tensor's current amax."""

    name: ClassVar[str] = "fp8_current"

    def scale_inv_from_amax(self, amax):
        scale_inv = _amax_over_e4m3_max(amax)
        return torch.where(scale_inv > 0, scale_inv, 1.0)


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 (OCP MX v1.0): 32-element blocks, E8M0 power-of-two scales, E4M3 data."""

    name: ClassVar[str] = "mxfp8"
    block_size: ClassVar[int] = 32

    def scale_inv_from_amax(self, amax):
        _, exponent = torch.frexp(amax)  # amax = m * 2**exponent, m in [0.5, 1)
        shared_exponent = (exponent - 1 - E4M3_EMAX).clamp(-127, 127)
        return torch.where(amax > 0, _exp2(shared_exponent), 1.0)


_RECIPES = {cls.name: cls for cls in (Float8BlockScaling, Float8CurrentScaling, MXFP8BlockScaling)}


def _get_recipe(recipe, op: str) -> Recipe:
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, str):
        if recipe not in _RECIPES:
            known = ", ".join(repr(name) for name in _RECIPES)
            raise OpValueError(f"{op}: unknown recipe {recipe!r} (argument 'recipe'); known: {known}")
        return _RECIPES[recipe]()
    raise OpTypeError(
        f"{op}: argument 'recipe' must be a Recipe or a recipe name (str), got {type(recipe).__name__}"
    )


def get_recipe(recipe) -> Recipe:
    """A Recipe, or one built with defaults from its name: "fp8_blockwise", "fp8_current", "mxfp8"."""
    return _get_recipe(recipe, "Quantize")


def high_precision_wgrad(recipe) -> bool:
    """Whether ``recipe`` (or None) runs the weight gradients in 16 bits (`Float8BlockScaling`)."""
    return bool(getattr(recipe, "high_precision_wgrad", False))


def wgrad_source(x):
    """What a 16-bit weight gradient reads for the quantized input ``x``: its ``source`` (a tensor
    or a `Recompute`), else its dequantized values."""
    return x.source if x.source is not None else x.dequantize()


def group_block_index(offsets, num_rows: int, block_size: int, *, device=None):
    """Block of each row for the columnwise copy; sync-free.

    offsets: (G+1,) int group row offsets, or None (all rows form one group).
    Returns ``(block_index, num_blocks)``: block_index (num_rows,) int64 on ``offsets``' device (or
    ``device``), with ``block_index[r] = block_start[g] + (r - offsets[g]) // block_size`` for row r
    of group g, ``block_start[g] = sum(ceil(m_h / block_size) for h < g)``; the padding rows
    (``>= offsets[G]``) are group G. ``num_blocks`` is the static bound ``ceil(num_rows / block_size)
    + G`` (``ceil(num_rows / block_size)`` without offsets).
    """
    if offsets is None:
        rows = torch.arange(num_rows, device=device)
        return rows // block_size, -(-num_rows // block_size)
    num_groups = offsets.numel() - 1
    rows = torch.arange(num_rows, device=offsets.device)
    inner = offsets[1:].to(torch.int64).clamp(0, num_rows).cummax(0).values
    zero = torch.zeros(1, dtype=torch.int64, device=offsets.device)
    edges = torch.cat([zero, inner, zero + num_rows])  # (G+2,): group G is the padding rows
    blocks_per_group = (edges.diff() + block_size - 1) // block_size
    block_start = blocks_per_group.cumsum(0) - blocks_per_group
    group = torch.searchsorted(edges[1:].contiguous(), rows, right=True)
    block_index = block_start[group] + (rows - edges[group]) // block_size
    return block_index, -(-num_rows // block_size) + num_groups


def _expand_last(scale_inv: torch.Tensor, size: int, block_size: int) -> torch.Tensor:
    """(..., ceil(size / block_size)) per-block scales -> (..., size) per-element scales."""
    expanded = scale_inv.unsqueeze(-1).expand(*scale_inv.shape, block_size)
    return expanded.flatten(-2)[..., :size]


def _expand_2d(scale_inv: torch.Tensor, rows: int, cols: int, block_size: int) -> torch.Tensor:
    """(..., ceil(rows / b), ceil(cols / b)) block scales -> (..., rows, cols) per-element scales."""
    per_col = _expand_last(scale_inv, cols, block_size)
    return _expand_last(per_col.transpose(-1, -2), rows, block_size).transpose(-1, -2)


def _quantize_per_tensor(x32, recipe, offsets=None):
    """x32 float32, any shape -> (data x32.shape, scale_inv ()).

    With ``offsets`` (G+1,) the amax covers the grouped rows of x32 viewed as (M, K) only, so
    padding rows (>= the last offset, clamped to [0, M]) cannot change the scale."""
    values = _finite_abs(x32)
    if offsets is not None and x32.numel():
        rows = values.reshape(-1, x32.shape[-1])
        # the last offset as sanitized (offsets[0] taken as 0: no groups, no grouped rows)
        valid_end = offsets[1:].amax().clamp(0, rows.shape[0]) if offsets.numel() > 1 else 0
        row_ids = torch.arange(rows.shape[0], device=x32.device)
        values = rows.masked_fill((row_ids >= valid_end).unsqueeze(1), 0)
    amax = values.amax() if x32.numel() else x32.new_zeros(())
    scale_inv = recipe.scale_inv_from_amax(amax)
    return _saturating_cast(x32 / scale_inv), scale_inv


def _quantize_last_dim(x32, recipe):
    """x32 (..., K) float32 -> (data (..., K), scale_inv (..., ceil(K / B))), blocks along K."""
    block = recipe.block_size
    size = x32.shape[-1]
    num_blocks = -(-size // block)
    blocks = F.pad(x32, (0, num_blocks * block - size)).unflatten(-1, (num_blocks, block))
    scale_inv = recipe.scale_inv_from_amax(_finite_abs(blocks).amax(-1))
    data = _saturating_cast(blocks / scale_inv.unsqueeze(-1)).flatten(-2)[..., :size]
    return data.contiguous(), scale_inv


def _quantize_blocks_2d(w32, recipe):
    """w32 (G, N, K) float32 -> (data (G, N, K), scale_inv (G, ceil(N/B), ceil(K/B))), BxB blocks."""
    block = recipe.block_size
    groups, rows, cols = w32.shape
    row_blocks, col_blocks = -(-rows // block), -(-cols // block)
    padded = F.pad(w32, (0, col_blocks * block - cols, 0, row_blocks * block - rows))
    blocks = padded.view(groups, row_blocks, block, col_blocks, block)
    scale_inv = recipe.scale_inv_from_amax(_finite_abs(blocks).amax(dim=(2, 4)))
    data = _saturating_cast(blocks / scale_inv[:, :, None, :, None])
    data = data.view(groups, row_blocks * block, col_blocks * block)[:, :rows, :cols]
    return data.contiguous(), scale_inv


def _quantize_columnwise(x2d, recipe, offsets):
    """x2d (M, K) float32 -> (data (K, M), scale_inv (K, num_blocks)), group-aligned blocks along M."""
    rows, cols = x2d.shape
    block_index, num_blocks = group_block_index(offsets, rows, recipe.block_size, device=x2d.device)
    amax = x2d.new_zeros(num_blocks, cols).scatter_reduce_(
        0, block_index[:, None].expand(rows, cols), _finite_abs(x2d), "amax"
    )
    scale_inv = recipe.scale_inv_from_amax(amax)  # (num_blocks, K)
    data = _saturating_cast(x2d / scale_inv.index_select(0, block_index))
    return data.t().contiguous(), scale_inv.t().contiguous()


def _quantize_weight_copies(w32, recipe, rowwise, columnwise):
    """w32 (G, N, K) float32 -> (rowwise data, scale) and (columnwise data (G, K, N), scale) or Nones."""
    if recipe.block_size is None:
        data, scale_inv = _quantize_per_tensor(w32, recipe)
        column = (data.transpose(-1, -2).contiguous(), scale_inv) if columnwise else (None, None)
    elif recipe.weight_blocks_2d:
        data, scale_inv = _quantize_blocks_2d(w32, recipe)
        column = (
            (data.transpose(-1, -2).contiguous(), scale_inv.transpose(-1, -2).contiguous())
            if columnwise
            else (None, None)
        )
    else:
        data, scale_inv = _quantize_last_dim(w32, recipe) if rowwise else (None, None)
        column = _quantize_last_dim(w32.transpose(-1, -2), recipe) if columnwise else (None, None)
    return ((data, scale_inv) if rowwise else (None, None)), column


_ALIAS_OPS = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


class QuantizedTensor(torch.Tensor):
    """A quantized tensor that looks like the original one (shape, dtype, device).

    A wrapper subclass: it can be an ``autograd.Function`` output and require grad. Holds
    ``recipe``, ``role`` ("activation", "gradient" or "weight"), ``rowwise_data`` (the original
    shape, E4M3) + ``rowwise_scale_inv``, optionally ``columnwise_data`` + ``columnwise_scale_inv``
    (layouts in the module docstring), and ``offsets`` (the (G+1,) group offsets of the columnwise
    copy, or None). An fp8_blockwise activation cast in an sm90 GEMM epilogue with a ``Transpose``
    after it carries, instead of the columnwise copy, ``block_columns_data`` (K, 128 * blocks) +
    ``block_columns_scale_inv`` (blocks, K): the same blocks, each group's padded to whole
    128-token blocks (``kernels.block_quantize.BlockColumns``), read by the sm90 FP8 weight
    gradient only. ``source``: the unquantized tensor (or a `Recompute` giving it) that a 16-bit
    weight gradient reads (`high_precision_wgrad`), else None. Any torch op other than
    detach/alias (which keep the quantized data, shared) runs on the dequantized values; in-place
    ops on a QuantizedTensor raise.
    """

    @staticmethod
    def __new__(
        cls,
        shape,
        dtype,
        device,
        *,
        recipe,
        role,
        rowwise_data=None,
        rowwise_scale_inv=None,
        columnwise_data=None,
        columnwise_scale_inv=None,
        offsets=None,
        block_columns_data=None,
        block_columns_scale_inv=None,
        source=None,
        requires_grad=False,
    ):
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad
        )
        self.recipe = recipe
        self.role = role
        self.rowwise_data = rowwise_data
        self.rowwise_scale_inv = rowwise_scale_inv
        self.columnwise_data = columnwise_data
        self.columnwise_scale_inv = columnwise_scale_inv
        self.offsets = offsets
        self.block_columns_data = block_columns_data
        self.block_columns_scale_inv = block_columns_scale_inv
        self.source = source
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def has_rowwise(self) -> bool:
        return self.rowwise_data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.columnwise_data is not None

    def _shallow_copy(self) -> QuantizedTensor:
        return QuantizedTensor(
            self.shape,
            self.dtype,
            self.device,
            recipe=self.recipe,
            role=self.role,
            rowwise_data=self.rowwise_data,
            rowwise_scale_inv=self.rowwise_scale_inv,
            columnwise_data=self.columnwise_data,
            columnwise_scale_inv=self.columnwise_scale_inv,
            offsets=self.offsets,
            block_columns_data=self.block_columns_data,
            block_columns_scale_inv=self.block_columns_scale_inv,
            source=self.source,
        )

    def _out_dtype(self, dtype, op):
        dtype = self.dtype if dtype is None else dtype
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise OpTypeError(f"{op}: argument 'dtype' must be a floating torch.dtype, got {dtype}")
        return dtype

    def dequantize(self, dtype=None) -> torch.Tensor:
        """The values, ``self.shape``, from the rowwise copy (else the columnwise, else the block-padded one)."""
        dtype = self._out_dtype(dtype, "QuantizedTensor.dequantize")
        if not self.has_rowwise and not self.has_columnwise and self.block_columns_data is not None:
            return self._dequantize_block_columns(dtype)
        if not self.has_rowwise:
            values = self.dequantize_columnwise(dtype).transpose(-1, -2)
            return values.reshape(self.shape)
        data, scale_inv, recipe = self.rowwise_data.float(), self.rowwise_scale_inv, self.recipe
        if recipe.block_size is None:
            values = data * scale_inv
        elif self.role == "weight" and recipe.weight_blocks_2d:
            values = data * _expand_2d(scale_inv, *data.shape[-2:], recipe.block_size)
        else:
            values = data * _expand_last(scale_inv, data.shape[-1], recipe.block_size)
        return _saturate_to(values, dtype)

    def _dequantize_block_columns(self, dtype) -> torch.Tensor:
        """The (M, K) values of the block-padded column-wise copy (padding rows 0); sync-free."""
        data, scale_inv, m = self.block_columns_data, self.block_columns_scale_inv, self.shape[0]
        block, _ = group_block_index(self.offsets, m, 128)
        rows = torch.arange(m, device=data.device)
        ends = self.offsets[1:].to(torch.int64).clamp(0, m).cummax(0).values
        group = torch.searchsorted(ends, rows, right=True)  # G: the padding rows
        starts = torch.cat([ends.new_zeros(1), ends])[group]
        position = 128 * block + (rows - starts) % 128  # the row's token column in its group's blocks
        values = data[:, position].float().t() * scale_inv[block]
        values = torch.where((group < ends.numel())[:, None], values, 0.0)
        return _saturate_to(values, dtype)

    def dequantize_columnwise(self, dtype=None) -> torch.Tensor:
        """The columnwise copy's values: (K, M) for activations/gradients, (..., K, N) for weights."""
        dtype = self._out_dtype(dtype, "QuantizedTensor.dequantize_columnwise")
        if not self.has_columnwise:
            raise OpValueError(
                "QuantizedTensor.dequantize_columnwise: no columnwise copy; use "
                "quantize(..., columnwise=True) or add_columnwise(qt, offsets)"
            )
        data, scale_inv, recipe = self.columnwise_data.float(), self.columnwise_scale_inv, self.recipe
        if recipe.block_size is None:
            values = data * scale_inv
        elif self.role == "weight":
            if recipe.weight_blocks_2d:
                values = data * _expand_2d(scale_inv, *data.shape[-2:], recipe.block_size)
            else:
                values = data * _expand_last(scale_inv, data.shape[-1], recipe.block_size)
        else:
            block_index, _ = group_block_index(
                self.offsets, data.shape[1], recipe.block_size, device=data.device
            )
            values = data * scale_inv.index_select(1, block_index)
        return _saturate_to(values, dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _ALIAS_OPS:
            return args[0]._shallow_copy()
        for position, argument in enumerate(func._schema.arguments):
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            written = argument.alias_info is not None and argument.alias_info.is_write
            if written and isinstance(value, QuantizedTensor):
                raise RuntimeError(
                    f"QuantizedTensor is read-only: {func} would write to it; dequantize() first"
                )
        args, kwargs = tree_map_only(QuantizedTensor, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)

    def __repr__(self):
        copies = [name for name in ("rowwise", "columnwise") if getattr(self, f"has_{name}")]
        if self.block_columns_data is not None:
            copies.append("block_columns")
        return (
            f"QuantizedTensor(recipe={self.recipe}, role={self.role!r}, copies={copies}, "
            f"values={self.dequantize()})"
        )


def _check_input(x, name: str, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise OpTypeError(f"{op}: argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(x, QuantizedTensor):
        raise OpTypeError(f"{op}: argument '{name}' is already a QuantizedTensor; dequantize() it first")
    if x.dtype not in _SUPPORTED_DTYPES:
        raise OpTypeError(
            f"{op}: argument '{name}' has dtype {x.dtype}; supported: float32, bfloat16, float16"
        )


def _check_offsets(offsets, device, op: str) -> None:
    if not isinstance(offsets, torch.Tensor):
        raise OpTypeError(f"{op}: argument 'offsets' must be a torch.Tensor, got {type(offsets).__name__}")
    if offsets.dtype not in (torch.int32, torch.int64):
        raise OpTypeError(f"{op}: argument 'offsets' has dtype {offsets.dtype}; supported: int32, int64")
    if offsets.dim() != 1 or offsets.numel() < 1:
        raise OpValueError(
            f"{op}: argument 'offsets' must have shape (G+1,) with G >= 0, got {tuple(offsets.shape)}"
        )
    if offsets.device != device:
        raise OpValueError(f"{op}: argument 'offsets' is on {offsets.device}, expected {device}")


def _quantize(x, recipe, rowwise, columnwise, offsets, role, op, name):
    recipe = _get_recipe(recipe, op)
    _check_input(x, name, op)
    if role not in ROLES:
        raise OpValueError(f"{op}: argument 'role' must be one of {ROLES}, got {role!r}")
    if not (rowwise or columnwise):
        raise OpValueError(f"{op}: arguments 'rowwise' and 'columnwise' are both False; request a copy")
    if role == "weight":
        if x.dim() not in (2, 3):
            raise OpValueError(
                f"{op}: argument '{name}' must have shape (G, N, K) or (N, K), got {tuple(x.shape)}"
            )
        if offsets is not None:
            raise OpValueError(f"{op}: argument 'offsets' must be None for role='weight'")
    elif x.dim() == 0:
        raise OpValueError(f"{op}: argument '{name}' must have at least 1 dimension, got a 0-d tensor")
    if offsets is not None:
        _check_offsets(offsets, x.device, op)
    with torch.no_grad():
        x32 = x.detach().float()
        if role == "weight":
            w32 = x32 if x.dim() == 3 else x32.unsqueeze(0)
            row, column = _quantize_weight_copies(w32, recipe, rowwise, columnwise)
            if x.dim() == 2:
                row, column = ([t if t is None else t.squeeze(0) for t in copy] for copy in (row, column))
        else:
            row = column = (None, None)
            if recipe.block_size is None:
                data, scale_inv = _quantize_per_tensor(x32, recipe, offsets)
                row = (data, scale_inv) if rowwise else row
                if columnwise:
                    column = (data.reshape(x.shape[:-1].numel(), x.shape[-1]).t().contiguous(), scale_inv)
            else:
                if rowwise:
                    row = _quantize_last_dim(x32, recipe)
                if columnwise:
                    column = _quantize_columnwise(x32.reshape(x.shape[:-1].numel(), x.shape[-1]), recipe, offsets)
    return QuantizedTensor(
        x.shape,
        x.dtype,
        x.device,
        recipe=recipe,
        role=role,
        rowwise_data=row[0],
        rowwise_scale_inv=row[1],
        columnwise_data=column[0],
        columnwise_scale_inv=column[1],
        offsets=offsets,
    )


def quantize(x, recipe, *, rowwise=True, columnwise=False, offsets=None, role="activation"):
    """Quantize ``x`` (..., K) with ``recipe`` (a Recipe or its name) into a QuantizedTensor.

    rowwise: blocks along K; columnwise: the per-group transposed copy (K, M), rows grouped by
    ``offsets`` (G+1,) int32/int64 on x's device (None: one group). Rows past the last offset
    are padding: they never affect the scales of grouped rows (per-tensor amax included). ``role="weight"`` quantizes
    a weight (G, N, K) or (N, K) as ``quantize_weight`` does (its columnwise copy is the per-group
    transpose; offsets must be None).
    """
    return _quantize(x, recipe, rowwise, columnwise, offsets, role, "Quantize", "x")


def quantize_weight(weight, recipe, *, columnwise=False) -> QuantizedTensor:
    """Quantize a weight (G, N, K) or (N, K): 128x128 blocks per group for Float8BlockScaling,
    1x32 along K for MXFP8, one scale for current scaling. ``columnwise=True`` adds the per-group
    transpose (G, K, N) used by the data-gradient GEMM."""
    return _quantize(weight, recipe, True, columnwise, None, "weight", "quantize_weight", "weight")


def add_columnwise(qt: QuantizedTensor, offsets=None) -> QuantizedTensor:
    """Add (or replace) ``qt``'s columnwise copy in place and return ``qt``.

    The copy is quantized from ``qt``'s dequantized rowwise values (the original is not kept),
    so it carries the rowwise rounding on top of its own. Where the copy's blocks are the rowwise
    ones transposed (per-tensor current scaling; 128x128 weight blocks) it is exactly
    ``rowwise_data`` transposed, with the same scales. offsets: (G+1,) or None (one group);
    must be None for weights.
    """
    op = "add_columnwise"
    if not isinstance(qt, QuantizedTensor):
        raise OpTypeError(f"{op}: argument 'qt' must be a QuantizedTensor, got {type(qt).__name__}")
    if offsets is not None:
        if qt.role == "weight":
            raise OpValueError(f"{op}: argument 'offsets' must be None for a weight")
        _check_offsets(offsets, qt.device, op)
    transposes_blocks = qt.recipe.block_size is None or qt.recipe.weight_blocks_2d
    if qt.has_rowwise and qt.role == "weight" and transposes_blocks:
        scale_inv = qt.rowwise_scale_inv
        qt.columnwise_data = qt.rowwise_data.transpose(-1, -2).contiguous()
        qt.columnwise_scale_inv = (
            scale_inv if scale_inv.dim() == 0 else scale_inv.transpose(-1, -2).contiguous()
        )
    elif qt.has_rowwise and qt.recipe.block_size is None:
        qt.columnwise_data = qt.rowwise_data.reshape(qt.shape[:-1].numel(), qt.shape[-1]).t().contiguous()
        qt.columnwise_scale_inv = qt.rowwise_scale_inv
    else:
        source = qt.dequantize(torch.float32)
        fresh = _quantize(source, qt.recipe, False, True, offsets, qt.role, op, "qt")
        qt.columnwise_data, qt.columnwise_scale_inv = fresh.columnwise_data, fresh.columnwise_scale_inv
    qt.offsets = offsets
    return qt


def fake_quantize(x, recipe, role="activation", offsets=None) -> torch.Tensor:
    """``quantize(x, recipe, role=role, offsets=offsets).dequantize()`` in x's dtype (rowwise; no grad)."""
    return quantize(x, recipe, role=role, offsets=offsets).dequantize(x.dtype)


_reuse = threading.local()

AUTOCAST_SOURCE = "_te_fused_ops_autocast_source"
"""Attribute of a parameter's autocast copy (`call._autocast_cast`) naming the parameter."""


class WeightCopy:
    """A copy kept in a `ReuseScope`: ``value``, made from the parameter ``weight``.

    ``weight_id``: the parameter's ``id``, no reference to it: a kept copy must not keep a
    per-call tensor alive (a parametrization's weight, an autocast copy's 16-bit duplicate), and
    a Python weak reference would make `torch.utils.swap_tensors` refuse the parameter (what
    ``module.to`` and ``load_state_dict`` use under
    ``torch.__future__.set_swap_module_params_on_conversion``). ``source``: a weak
    reference to the storage it was made from (expired once that storage is freed: ``p.data = t``,
    a parametrization's tensor of an earlier call, or a freed all-gather, whose address a later
    tensor may take). ``captured``: a CUDA graph read it during its capture, so its storage must
    stay where it is and be recast (`StepCasts`), never dropped; `capture` then holds the weight
    (``held``) and the capturing call's ``make`` / ``make_into`` (``make`` writing into the kept
    value; None: a fresh ``make()`` is copied in)."""

    def __init__(self, weight: torch.Tensor, value, recipe, kind: str):
        self.weight_id = id(weight)
        self.value, self.recipe, self.kind = value, recipe, kind
        self.captured = False
        self.held = self.make = self.make_into = None
        self.source = StorageWeakRef(weight.untyped_storage())

    def stale(self) -> bool:
        """Whether the storage the copy was made from is gone (another tensor may hold its address)."""
        return self.source.expired()

    def made_from(self, tensor: torch.Tensor) -> bool:
        """Whether the copy was made from ``tensor``'s storage object, not another's that took its
        address: FSDP2 frees an all-gathered weight by resizing its storage to 0, which keeps the
        object (so `stale` stays False) while the next layer's weight may land at its address
        with the same shape and version."""
        return not self.stale() and self.source.cdata == StorageWeakRef(tensor.untyped_storage()).cdata

    def capture(self, weight: torch.Tensor, make, make_into) -> None:
        """Mark the copy read by a graph's capture: hold ``weight`` and the makers that recast it."""
        self.captured = True
        self.held, self.make, self.make_into = weight, make, make_into

    def recast(self) -> None:
        """``value`` made again from the weight as it is now, in its own storage (``source`` follows)."""
        if self.make_into is not None:
            self.make_into(self.value)
        else:
            refill(self.value, self.make())
        self.source = StorageWeakRef(self.held.untyped_storage())


class ReuseScope:
    """The copies of one outermost `reuse_quantized_weights` scope (``copies`` None once closed),
    or of one `cast_weights_once_per_step` (``serves_graphs``: its copies outlive any capture).

    Each op context takes the scope open in the forward's thread (`current_reuse_scope`), so the
    backward, which autograd runs on another thread for CUDA tensors, reuses the same copies."""

    def __init__(self, serves_graphs: bool = False):
        self.copies: dict = {}  # key -> WeightCopy
        self.captured: list = []  # every copy a CUDA graph read, kept (and recast) while the scope lives
        self.serves_graphs = serves_graphs


def current_reuse_scope():
    """The `ReuseScope` open in this thread, or None."""
    return getattr(_reuse, "scope", None)


_step_casts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> the StepCasts it belongs to


def step_scope_of(op):
    """The `ReuseScope` of the `cast_weights_once_per_step` that ``op`` belongs to, or None."""
    casts = _step_casts.get(op)
    return None if casts is None else casts.scope


def _recast_after_load(module, incompatible_keys) -> None:
    """A module's ``load_state_dict`` post-hook (module level, so that the module pickles, and a
    no-op on its copies): the graph-read copies of its weights cast again."""
    casts = _step_casts.get(module)
    if casts is not None:
        casts._recast_loaded(module)


class StepCasts:
    """What `cast_weights_once_per_step` returns: ``remove()`` (or leaving its ``with`` block)
    detaches it (hooks removed, copies dropped, the modules cast on every call again)."""

    def __init__(self, optimizer, model):
        self.scope = ReuseScope(serves_graphs=True)
        modules = list(model.modules())
        taken = [m for m in modules if m in _step_casts]
        if taken:
            raise ValueError(f"cast_weights_once_per_step: {type(taken[0]).__name__} already belongs to another "
                             f"cast_weights_once_per_step (remove() it first)")
        # the modules hold this object (`_step_casts`) and it holds them weakly: it lives as long
        # as the model, whatever becomes of the optimizer (an optimizer made again after a
        # checkpoint load still reaches it, `after_other_optimizer`), with no reference cycle
        self._modules = [weakref.ref(m) for m in modules]
        for module in modules:
            _step_casts[module] = self
        self._optimizer = weakref.ref(optimizer)
        self._hooks = [optimizer.register_step_pre_hook(lambda *args: self._drop_uncaptured()),
                       optimizer.register_step_post_hook(lambda *args: self.drop())]
        self._hooks += [module.register_load_state_dict_post_hook(_recast_after_load)
                        for module in modules if next(module.parameters(recurse=False), None) is not None]
        _watch_other_optimizers(self)

    def drop(self) -> None:
        """Drop the copies kept (the next forward casts again), except those a CUDA graph read
        during its capture: each of those is cast again from its weight now, into its own storage,
        so the graph's next replay, and eager calls, read the current weights."""
        self.scope.copies.clear()
        self._recast(self.scope.captured)

    def _recast(self, captured) -> None:
        """Cast the graph-read copies ``captured`` again in place and key them by their weights'
        versions now (every one kept: two graphs may have read two copies of one weight whose keys
        now coincide)."""
        copies, failed = self.scope.copies, []
        with torch.no_grad():
            for copy in list(captured):
                try:
                    copy.recast()
                except ValueError as error:  # another dtype or shape: no graph can read it any more
                    copy.captured = False
                    self.scope.captured.remove(copy)
                    failed.append(str(error))
                    continue
                copies[copy_key(copy.held, copy.recipe, copy.kind)] = copy  # the weight's version moved
        if failed:
            raise ValueError(failed[0])

    def _recast_loaded(self, module) -> None:
        """After ``module.load_state_dict``: its weights' graph-read copies cast again (the loaded
        values copied into the parameters bump no step hook)."""
        own = {id(p) for p in module.parameters(recurse=False)}
        self._recast([copy for copy in self.scope.captured if copy.weight_id in own])

    def _drop_uncaptured(self) -> None:
        copies = self.scope.copies
        for key in [key for key, copy in copies.items() if not copy.captured]:
            del copies[key]

    def after_other_optimizer(self, optimizer) -> None:
        """``optimizer`` (not ours) stepped: drop the copies if it holds any weight they came
        from (a fused step bumps no version counter)."""
        if optimizer is self._optimizer():
            return
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if any(copy.weight_id in stepped for copy in self.scope.copies.values()):
            self.drop()

    def remove(self) -> None:
        _live_step_casts.discard(self)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        for module in (ref() for ref in self._modules):
            if module is not None and _step_casts.get(module) is self:
                del _step_casts[module]
        self.scope.copies.clear()
        self.scope.captured = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


_live_step_casts: weakref.WeakSet = weakref.WeakSet()  # the StepCasts not removed
_other_optimizers_hook = []  # the handle of the one global optimizer post-step hook, once made


def _watch_other_optimizers(casts: StepCasts) -> None:
    """Let every optimizer's step reach ``casts`` (`StepCasts.after_other_optimizer`): a second
    optimizer over the same weights, or one made again after a checkpoint load."""
    _live_step_casts.add(casts)
    if not _other_optimizers_hook:
        _other_optimizers_hook.append(register_optimizer_step_post_hook(
            lambda optimizer, args, kwargs: [c.after_other_optimizer(optimizer) for c in list(_live_step_casts)]))


def cast_weights_once_per_step(optimizer, model) -> StepCasts:
    """Quantize each weight of ``model`` once per optimizer step: its forwards reuse the copies
    made since ``optimizer``'s last step (in the backward too), and ``optimizer.step()`` drops them
    (before and after it runs). The gradient-accumulation loop needs no other change:

        casts = te_fused_ops.cast_weights_once_per_step(optimizer, model)   # once
        for step in range(steps):
            for micro_batch in micro_batches:
                model(micro_batch, split_sizes=s).sum().backward()
            optimizer.step()
            optimizer.zero_grad()

    A copy is keyed on the weight tensor (address, shape, dtype), its version counter and the
    recipe: a write through the parameter (``load_state_dict``, ``p.copy_(...)``, any in-place op)
    or a new tensor (``p.data = t``, FSDP2's all-gathered weights, a parametrization) gets a fresh
    copy; so does any other optimizer's step over the model's weights (a fused step bumps no
    version counter). Not seen: in-place writes through ``p.data`` outside an optimizer's step
    (``p.data.mul_(...)`` bumps no version counter): call ``casts.drop()`` after such a write.
    Other models (a copy of ``model`` too) are not affected. The copies of one step stay alive until
    the next: an FP8 copy of each weight, plus its transposed copy where the data gradient reads one.

    CUDA graphs: a micro-batch captured after an eager call (`CudaGraphStep`'s warm-up) reads the
    copies that call made; each optimizer step (and ``drop()``) then casts those copies again in
    place, so every replay reads the current weights and casts nothing itself. Weights a capture
    did not find cast are cast in the graph, on every replay. Do not replay such a graph after
    ``remove()``: its copies are freed.
    """
    if not all(hasattr(optimizer, hook) for hook in ("register_step_pre_hook", "register_step_post_hook")):
        raise TypeError(f"cast_weights_once_per_step: argument 'optimizer' must be a torch optimizer (its step "
                        f"hooks drop the copies; arguments: optimizer, model), got {type(optimizer).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"cast_weights_once_per_step: argument 'model' must be a torch.nn.Module, got "
                        f"{type(model).__name__}")
    return StepCasts(optimizer, model)


@contextmanager
def reuse_quantized_weights():
    """Opt-in scope in which each weight is quantized once and the copy reused until it closes.

    By default every forward quantizes its weights afresh: fused optimizers, ``.data`` writes,
    FSDP2 all-gathers and parametrizations change weights without a version bump, so a copy kept
    across calls could silently train the wrong model. Inside this scope you promise the weights
    do not change (gradient-accumulation micro-batches between two optimizer steps, inference):

        with te_fused_ops.reuse_quantized_weights():
            for micro_batch in micro_batches:
                model(micro_batch, split_sizes=s).sum().backward()
        optimizer.step()

    Copies are keyed on the weight tensor (address, shape, dtype) and recipe, and dropped when the
    outermost scope exits. A forward run inside the scope makes and reuses them in its backward
    too (on autograd's thread); a backward run after the scope closed makes fresh ones. Opened per
    thread; nested scopes share the outer one's copies.
    """
    if current_reuse_scope() is not None:
        yield
        return
    scope = _reuse.scope = ReuseScope()
    try:
        yield
    finally:
        scope.copies = None
        _reuse.scope = None


def reuse_or_make(weight: torch.Tensor, recipe, kind: str, make, scope, make_into=None):
    """``make()`` (a copy derived from ``weight``), or while ``scope`` (a `ReuseScope` or None) is
    open the one made earlier in it for the same weight, recipe and ``kind`` of copy. While a CUDA
    graph is being captured, only a `cast_weights_once_per_step` copy made before the capture is
    read (and marked captured: the optimizer step recasts it in place, by ``make_into(kept)``
    where given, so each replay reads the current weights); anything else is cast in the graph, on
    every replay, and not kept."""
    copies = None if scope is None else scope.copies
    if copies is None:
        return make()
    # an autocast copy of a parameter, new at every call, is kept by its parameter and dtype
    source = getattr(weight, AUTOCAST_SOURCE, None)
    param = weight if source is None else source
    try:
        key = copy_key(param, recipe, kind, weight.dtype)
    except RuntimeError:  # an inference tensor: no version counter to key on
        return make()
    kept = copies.get(key)
    if kept is not None and not kept.made_from(param):
        kept = None
    if capturing():
        # an autocast copy is cast in the graph: a recast would read the copy of an old call
        if source is not None or not scope.serves_graphs or kept is None:
            return make()
        if not kept.captured:
            kept.capture(param, make, make_into)
            scope.captured.append(kept)
    elif kept is None:
        _forget_outdated(copies, param, key)
        kept = copies[key] = WeightCopy(param, make(), recipe, kind)
    return kept.value


def _forget_outdated(copies: dict, param: torch.Tensor, key: CopyKey) -> None:
    """Drop the copies no later call can read: those whose storage is gone, and those ``param``
    made at another address, shape, strides or version for what ``key`` asks (FSDP2 all-gathers
    a weight at a new address each time; a scope kept every one until it closed)."""
    def outdated(other, copy):
        return copy.stale() or (copy.weight_id == id(param) and other._replace(
            address=key.address, shape=key.shape, strides=key.strides, version=key.version) == key)

    for other in [other for other, copy in copies.items() if not copy.captured and outdated(other, copy)]:
        del copies[other]


class CopyKey(NamedTuple):
    """What a kept copy of a weight is found by (`copy_key`)."""

    address: int
    shape: tuple
    strides: tuple  # a ``.data`` set to a transposed view of the same storage is another weight
    dtype: torch.dtype
    device: torch.device
    version: int
    recipe: object
    kind: str


def copy_key(weight: torch.Tensor, recipe, kind: str, dtype=None) -> CopyKey:
    """What a kept copy of ``weight`` is found by: the tensor (address, shape, strides, dtype,
    device), its version counter (RuntimeError for an inference tensor), the recipe and the kind
    of copy. ``dtype``: the dtype the copy is made from where not the weight's (an autocast copy's)."""
    return CopyKey(weight.data_ptr(), tuple(weight.shape), weight.stride(), dtype or weight.dtype, weight.device,
                   weight._version, recipe, kind)


def refill(kept, fresh) -> None:
    """Copy ``fresh`` into ``kept``: tensors, or tuples / lists of them (or None), of one structure
    (ValueError where a tensor's shape or dtype differs: the weight changed shape since)."""
    if isinstance(kept, torch.Tensor):
        if kept.shape != fresh.shape or kept.dtype != fresh.dtype:
            raise ValueError(f"cast_weights_once_per_step: a weight copy a CUDA graph captured was {kept.dtype} "
                             f"{tuple(kept.shape)}, its weight now casts to {fresh.dtype} {tuple(fresh.shape)}: the "
                             f"graph cannot read it any more; capture it again (the copy is no longer recast)")
        kept.copy_(fresh)
    elif isinstance(kept, (tuple, list)):
        for k, f in zip(kept, fresh, strict=True):
            refill(k, f)
    elif kept is not None:
        raise TypeError(f"refill: cannot refill a {type(kept).__name__} in place")


def quantized_weight_values(weight: torch.Tensor, recipe, scope, dgrad: bool = False) -> torch.Tensor:
    """``weight`` (G, N, K) quantized with ``recipe`` and dequantized (the values an FP8 GEMM
    computes with); fresh on every call unless ``scope`` (the op context's `ReuseScope`) is open.
    ``dgrad``: the values of the data gradient's GEMM, which contracts over N: from the column-wise
    copy where its blocks are not the row-wise ones transposed (MXFP8's 1x32 along N)."""
    if dgrad and recipe.block_size is not None and not recipe.weight_blocks_2d:
        return reuse_or_make(weight, recipe, "dgrad values", lambda: quantize_weight(
            weight.detach(), recipe, columnwise=True).dequantize_columnwise().transpose(-1, -2), scope)
    return reuse_or_make(
        weight, recipe, "values", lambda: quantize_weight(weight.detach(), recipe).dequantize(), scope
    )


def is_quantized(x) -> bool:
    """Whether ``x`` is a `QuantizedTensor`."""
    return isinstance(x, QuantizedTensor)
