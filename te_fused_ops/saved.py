"""Values kept for the backward travel through autograd's saved tensors, never around them.

`pack` turns what the ops left in their contexts (tensors, views of the call's inputs,
QuantizedTensors, tensors carrying a column-wise copy, `Recompute`s, `Saved` fields, `Routing`s, dicts, lists, plain values) into a skeleton without tensors plus
the list of tensors, which the Sequential's autograd.Function hands to ``save_for_backward``.
So ``saved_tensors_hooks`` see every saved tensor, activation checkpointing can drop them,
in-place changes after the forward raise torch's usual error, and a retained graph can run its
backward again. `unpack` rebuilds the values from the skeleton and ``ctx.saved_tensors``.
"""

import dataclasses
import functools
from dataclasses import dataclass

import torch

from .context import Recompute, Saved
from .quantization import QuantizedTensor
from .routing import Routing

_QUANTIZED_FIELDS = ("rowwise_data", "rowwise_scale_inv", "columnwise_data", "columnwise_scale_inv", "offsets",
                     "block_columns_data", "block_columns_scale_inv")


@dataclass(frozen=True)
class _Slot:
    index: int


@dataclass(frozen=True)
class _WithColumnwise:
    """A plain tensor and its ``te_columnwise`` attribute (made by `Transpose`)."""

    tensor: _Slot
    columnwise: _Slot


@dataclass(frozen=True)
class _View:
    """A view of a tensor already kept (e.g. an expert slice of an input weight): rebuilt from it,
    so the custom op under torch.compile does not copy it out as an output of its own."""

    base: _Slot
    shape: tuple
    stride: tuple
    offset: int


@dataclass(frozen=True)
class _Quantized:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device
    recipe: object
    role: str
    fields: tuple  # skeletons of _QUANTIZED_FIELDS, in order


@dataclass(frozen=True)
class _Recomputed:
    # not part of a skeleton's identity: under torch.compile the fake run recomputes with a rule's
    # reference and the real run with the backend's kernels, from the same saved tensors
    fn: object = dataclasses.field(compare=False)
    args: tuple


# values kept as they are (checked first: most of a skeleton's leaves)
_PLAIN = frozenset((bool, int, float, str, torch.dtype, torch.device, torch.Size))


@functools.cache
def _field_names(cls) -> tuple:
    return tuple(f.name for f in dataclasses.fields(cls))


def _rebuilt(routing: Routing, convert) -> Routing:
    """``routing`` with ``convert`` applied to every field (a frozen dataclass: built anew)."""
    return type(routing)(*(convert(getattr(routing, name)) for name in _field_names(type(routing))))


def _slot(t: torch.Tensor, tensors: list, index: dict) -> _Slot:
    if id(t) not in index:
        index[id(t)] = len(tensors)
        tensors.append(t)
    return _Slot(index[id(t)])


def _storage_key(t: torch.Tensor) -> int:
    """Names ``t``'s storage (the same for every view of it, on the meta device too; ``_base`` is
    not set below autograd, where a custom op runs)."""
    return t.untyped_storage()._cdata


def storage_bases(tensors: list) -> dict:
    """`pack`'s ``bases`` for ``tensors`` (the first tensor on each storage)."""
    bases: dict = {}
    for slot, t in enumerate(tensors):
        if isinstance(t, torch.Tensor):
            bases.setdefault(_storage_key(t), slot)
    return bases


def pack(value, tensors: list, index: dict, bases: dict = None):
    """Skeleton of ``value``; its tensors are appended to ``tensors`` once each (``index``: id -> slot).

    ``bases``: `_storage_key` -> slot, for tensors that reach the backward unchanged (a call's
    inputs under torch.compile): a view of one of them (an expert slice of a weight) is kept as
    that slot plus the view's geometry, not as a tensor of its own."""
    if value is None or type(value) in _PLAIN:
        return value
    if isinstance(value, QuantizedTensor):
        fields = tuple(pack(getattr(value, name), tensors, index, bases) for name in _QUANTIZED_FIELDS)
        return _Quantized(value.shape, value.dtype, value.device, value.recipe, value.role, fields)
    if isinstance(value, torch.Tensor):
        columnwise = getattr(value, "te_columnwise", None)
        if columnwise is not None:
            return _WithColumnwise(_slot(value, tensors, index), _slot(columnwise, tensors, index))
        base = bases.get(_storage_key(value)) if bases and id(value) not in index else None
        if base is not None and tensors[base].dtype == value.dtype:
            return _View(_Slot(base), tuple(value.shape), tuple(value.stride()), value.storage_offset())
        return _slot(value, tensors, index)
    if isinstance(value, Recompute):
        return _Recomputed(value.fn, pack(value.args, tensors, index, bases))
    if isinstance(value, Saved):
        return Saved(**pack(vars(value), tensors, index, bases))
    if isinstance(value, Routing):  # one skeleton for the contexts that share a routing
        key = (Routing, id(value))
        if key not in index:
            index[key] = _rebuilt(value, lambda item: pack(item, tensors, index, bases))
        return index[key]
    if isinstance(value, dict):
        return {key: pack(item, tensors, index, bases) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(pack(item, tensors, index, bases) for item in value)
    return value


def unpack(skeleton, tensors, memo: dict = None):
    """The value `pack` took apart, rebuilt on ``tensors`` (``ctx.saved_tensors``). ``memo``
    (optional, shared by the calls of one backward): the `Routing`s already rebuilt."""
    if skeleton is None or type(skeleton) in _PLAIN:
        return skeleton
    memo = {} if memo is None else memo
    if type(skeleton) is _Slot:
        return tensors[skeleton.index]
    if isinstance(skeleton, _View):
        return tensors[skeleton.base.index].as_strided(skeleton.shape, skeleton.stride, skeleton.offset)
    if isinstance(skeleton, _WithColumnwise):
        value = tensors[skeleton.tensor.index].view_as(tensors[skeleton.tensor.index])
        value.te_columnwise = tensors[skeleton.columnwise.index]
        return value
    if isinstance(skeleton, _Quantized):
        fields = {name: unpack(field, tensors, memo) for name, field in zip(_QUANTIZED_FIELDS, skeleton.fields)}
        return QuantizedTensor(
            skeleton.shape, skeleton.dtype, skeleton.device, recipe=skeleton.recipe, role=skeleton.role, **fields
        )
    if isinstance(skeleton, _Recomputed):
        return Recompute(skeleton.fn, *unpack(skeleton.args, tensors, memo))
    if isinstance(skeleton, Saved):
        return Saved(**unpack(vars(skeleton), tensors, memo))
    if isinstance(skeleton, Routing):
        if id(skeleton) not in memo:
            memo[id(skeleton)] = _rebuilt(skeleton, lambda item: unpack(item, tensors, memo))
        return memo[id(skeleton)]
    if isinstance(skeleton, dict):
        return {key: unpack(item, tensors, memo) for key, item in skeleton.items()}
    if isinstance(skeleton, (list, tuple)):
        return type(skeleton)(unpack(item, tensors, memo) for item in skeleton)
    return skeleton


def slot_indices(skeleton) -> set:
    """Indices of the tensors a skeleton refers to."""
    if isinstance(skeleton, _Slot):
        return {skeleton.index}
    if isinstance(skeleton, _View):
        return {skeleton.base.index}
    if isinstance(skeleton, _WithColumnwise):
        return {skeleton.tensor.index, skeleton.columnwise.index}
    if isinstance(skeleton, _Quantized):
        return slot_indices(skeleton.fields)
    if isinstance(skeleton, _Recomputed):
        return slot_indices(skeleton.args)
    if isinstance(skeleton, Saved):
        skeleton = vars(skeleton)
    if isinstance(skeleton, Routing):
        skeleton = [getattr(skeleton, f.name) for f in dataclasses.fields(skeleton)]
    items = skeleton.values() if isinstance(skeleton, dict) else skeleton if isinstance(skeleton, (list, tuple)) else ()
    return set().union(*(slot_indices(item) for item in items))

