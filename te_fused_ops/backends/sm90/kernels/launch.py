"""Host-side pieces every sm90 kernel wrapper shares: argument checks, SM count and margin, TVM-FFI.

Importable without cutlass or a GPU. The wrappers read no environment: their caller (the sm90
backend) passes ``sm_margin``.
"""

from __future__ import annotations

import functools

import torch

from ....kernel_cache import disk_cached, is_recording
from . import sm90_unavailable_reason

DTYPES = (torch.bfloat16, torch.float16)


@functools.cache
def tvm_ffi_available() -> bool:
    """Whether tensors can cross into the kernels through TVM-FFI (a few us per call)."""
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def ffi_kernels_available() -> bool:
    """Whether the kernels that take tensors only through TVM-FFI (row movers, routing, split
    offsets, slot values) can run here: the sm90 kernels and TVM-FFI importable."""
    return sm90_unavailable_reason() is None and tvm_ffi_available()


def fake_tensor(dtype, shape, align=16):
    """A compact row-major symbolic tensor for `cute.compile`: ``dtype`` a cutlass type, ``shape``
    of ints and `cute.sym_int`s, the data pointer ``align``-byte aligned."""
    import cutlass.cute as cute

    order = tuple(reversed(range(len(shape))))
    return cute.runtime.make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=align)


def compile_launcher(kernel, args, tvm_ffi=None):
    """`cute.compile` of ``kernel(*args, stream)``. Through TVM-FFI (``tvm_ffi``; None: when it
    imports) the launcher takes torch tensors and launches on the current stream; else it takes
    CuTe tensors and an explicit CUstream last."""
    import cutlass.cute as cute

    if tvm_ffi is None:
        tvm_ffi = tvm_ffi_available()
    stream = cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi)
    return cute.compile(kernel, *args, stream, options="--enable-tvm-ffi" if tvm_ffi else "")


def _export(compiled, path, symbol, tvm_ffi) -> None:
    """Write the object file of launcher ``compiled`` (host launch code and the embedded cubin)."""
    if tvm_ffi:
        compiled.export_to_c(str(path), function_name=symbol)
    else:
        path.write_bytes(compiled.dump_to_object(symbol))


def _load(path, symbol, tvm_ffi):
    """The launcher in object file ``path`` under ``symbol``, as `compile_launcher` returns it."""
    import cutlass.cute as cute

    return getattr(cute.runtime.load_module(str(path), enable_tvm_ffi=tvm_ffi), symbol)


def _tvm_ffi_of(bound) -> bool:
    tvm_ffi = bound.arguments.get("tvm_ffi")
    return tvm_ffi_available() if tvm_ffi is None else bool(tvm_ffi)


def cooperative_twin(bound) -> dict | None:
    """A ping-pong kernel's stand-in while it compiles (`kernel_cache.compile_in_workers`): the
    cooperative kernel of the same tile and cluster, the same launcher and the same output bits
    (the GPU tests compare them bit for bit), compiled in about half the time (its epilogue runs
    in 32-column chunks, not 16)."""
    return {"pingpong": False} if bound.arguments.get("pingpong") else None


def cached_kernel(compile_fn, stand_in_of=cooperative_twin):
    """Memoize a kernel-compiling function (arguments -> launcher) in memory and on disk
    (`te_fused_ops.kernel_cache`): a later process loads the binary instead of compiling it.
    ``stand_in_of``: the overrides of a faster-compiling kernel with the same bits
    (`kernel_cache.DiskCachedCompile`)."""
    return disk_cached(_export, _load, _tvm_ffi_of, stand_in_of)(compile_fn)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def resolve_sm_margin(sm_margin, fn_name: str) -> int:
    """``sm_margin``, the SMs the persistent grid leaves free (None: 0), checked."""
    if sm_margin is None:
        return 0
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, int):
        raise TypeError(f"{fn_name}: sm_margin must be an int or None, got {type(sm_margin).__name__}")
    if sm_margin < 0:
        raise ValueError(f"{fn_name}: sm_margin must be >= 0, got {sm_margin}")
    return sm_margin


def check_tensor(fn_name: str, t, arg: str, dtype, ndim: int, device_index: int) -> None:
    """TypeError/ValueError naming ``fn_name`` and ``arg`` unless ``t`` is a contiguous, 16-byte
    aligned ``ndim``-D tensor of ``dtype`` on cuda:``device_index``."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn_name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{fn_name}: {arg} has dtype {t.dtype}, expected {dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{fn_name}: {arg} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.get_device() != device_index:
        raise ValueError(f"{fn_name}: {arg} is on {t.device}, expected cuda:{device_index}")
    if not t.is_contiguous():
        raise ValueError(f"{fn_name}: {arg} must be contiguous")
    if t.numel() and t.data_ptr() & 15:
        raise ValueError(f"{fn_name}: {arg} data pointer must be 16-byte aligned")


def check_input(fn_name: str, t, arg: str) -> int:
    """The first (activation) input of a wrapper: a contiguous, aligned 2-D bf16/fp16 tensor on a
    CUDA device; returns the device index."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{fn_name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise TypeError(f"{fn_name}: {arg} has dtype {t.dtype}, supported: bfloat16, float16")
    dev = t.get_device()
    if dev < 0:
        raise ValueError(f"{fn_name}: {arg} must be on a CUDA device, got {t.device}")
    check_tensor(fn_name, t, arg, t.dtype, 2, dev)
    return dev


def tensor_signature(*tensors):
    """What the wrappers' checks look at, per tensor (None stays None): shape, dtype, device,
    contiguity, 16-byte alignment; None when an argument is not a tensor (the full checks then
    raise)."""
    signature = []
    for t in tensors:
        if t is None:
            signature.append(None)
        elif isinstance(t, torch.Tensor):
            signature.append((t.shape, t.dtype, t.device, t.is_contiguous(), not t.data_ptr() & 15))
        else:
            return None
    return tuple(signature)


def call_signature(tvm_ffi: bool, t0, t1, t2, t3=None, t4=None, t5=None, t6=None, t7=None, t8=None):
    """The per-tensor part of a wrapper's launch memo key (up to nine tensors, None for absent
    ones); a validated launch is memoized under it (plus the non-tensor arguments), so repeated
    calls skip the checks.

    Through TVM-FFI the compiled function checks every tensor on every call (dtype, rank, device,
    contiguity, alignment, the extents its shape symbols tie together) before it launches, so the
    key holds only the first tensor's dtype and device and every tensor's shape: the checks that
    depend on nothing else ran when the entry was made, and a call the compiled function rejects
    reruns the wrapper's checks for an error naming the argument. The classic path checks nothing
    itself: its key is the full `tensor_signature`. None when an argument is not a tensor (the
    full checks then raise). Fixed arity, no loop: this runs on every launch (~0.9 us of Python
    against ~1.6 us for a loop over ``*tensors``).
    """
    if not tvm_ffi:
        return tensor_signature(t0, t1, t2, t3, t4, t5, t6, t7, t8)
    try:
        return (
            t0.dtype, t0.device, t0.shape, t1.shape, t2.shape,
            t3 if t3 is None else t3.shape, t4 if t4 is None else t4.shape, t5 if t5 is None else t5.shape,
            t6 if t6 is None else t6.shape, t7 if t7 is None else t7.shape, t8 if t8 is None else t8.shape,
        )
    except AttributeError:
        return None


class LaunchMemo(dict):
    """key -> validated launch; bounded (cleared when it grows past ``limit`` entries). Nothing is
    kept inside `kernel_cache.recording()`: a launch chosen there (e.g. without the autotuner, which
    only records its candidates there) is chosen again by the first call after it."""

    def __init__(self, limit: int = 1024):
        super().__init__()
        self.limit = limit

    def put(self, key, launch):
        if len(self) >= self.limit:
            self.clear()
        if key is not None and key[0] is not None and not is_recording():
            self[key] = launch
        return launch
