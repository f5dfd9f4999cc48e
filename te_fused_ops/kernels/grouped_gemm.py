"""Torch-facing wrapper of the sm90 grouped GEMM (+ activation) kernel: checks, config, compile cache.

Tensors cross into the kernel through TVM-FFI (``apache-tvm-ffi``) when it is installed, which keeps
the per-call host overhead to a few microseconds; without it the classic CuTe DSL call path is used.
Kernels are compiled once per (dtype, tile_n, activation, bias, SM count, TVM-FFI, cluster_m), with
M, N, K and G symbolic, and kept in-process. GLU weights (G, N, K) and biases (G, N) are read in
their natural [gate; up] layout (gate = rows [0, N/2)); nothing is repacked.
"""

from __future__ import annotations

import functools

import torch

from . import sm90_unavailable_reason

# also the kernel's epilogue list (grouped_gemm_sm90 imports them from here)
ACTIVATIONS = (None, "swiglu", "geglu", "srelu", "clamped_swiglu", "scaled_swiglu")
GLU_ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu", "scaled_swiglu")
GLU_N_MULTIPLE = 64  # GLU: N/2 must be whole 32-column store chunks
_DTYPES = (torch.bfloat16, torch.float16)
_NAME = "grouped_gemm_sm90"


def sm90_grouped_gemm_unsupported_reason(dtype, n, k, activation, has_bias) -> str | None:
    """None if the sm90 kernel can run this configuration, else the first failing condition."""
    reason = sm90_unavailable_reason()
    if reason is not None:
        return reason
    if dtype not in _DTYPES:
        return f"sm90 backend: dtype {str(dtype).replace('torch.', '')} not supported (bf16, fp16)"
    if activation not in ACTIVATIONS:
        return f"sm90 backend: activation {activation!r} not supported ({ACTIVATIONS})"
    if k % 8 != 0:
        return f"sm90 backend: K={k} not a multiple of 8"
    if n % 8 != 0:
        return f"sm90 backend: N={n} not a multiple of 8"
    if activation in GLU_ACTIVATIONS and n % GLU_N_MULTIPLE != 0:
        return f"sm90 backend: N={n} not a multiple of {GLU_N_MULTIPLE} for a GLU activation"
    return None


@functools.cache
def _tvm_ffi_available() -> bool:
    try:
        import tvm_ffi  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def choose_config(m: int, n: int, g: int, num_sms: int) -> tuple[int, int]:
    """(tile_n, cluster_m) from shapes only. 256-wide tiles unless they would leave part of the
    persistent grid idle; CTA pairs sharing W (cluster_m=2) when groups average >= 1024 rows,
    since a pair rounds each group up to 256 rows."""
    tiles_256 = -(-m // 128) * -(-n // 256)
    tile_n = 256 if tiles_256 >= num_sms else 128
    return tile_n, 2 if m >= 1024 * g else 1


_LAUNCHERS = {}


@functools.cache
def compile_grouped_gemm(
    dtype, tile_n, activation, has_bias, num_sms, tvm_ffi=None, cluster_m=2, **kernel_opts
):
    """Compile (once per configuration) and return the launcher. Shapes are symbolic."""
    import cutlass
    import cutlass.cute as cute

    from .grouped_gemm_sm90 import GroupedGemmSm90

    if tvm_ffi is None:
        tvm_ffi = _tvm_ffi_available()
    dt = {torch.bfloat16: cutlass.BFloat16, torch.float16: cutlass.Float16}[dtype]
    glu = activation in GLU_ACTIVATIONS
    m, g, g1 = cute.sym_int(), cute.sym_int(), cute.sym_int()
    k, n = cute.sym_int(divisibility=8), cute.sym_int(divisibility=GLU_N_MULTIPLE if glu else 8)
    n_act = cute.sym_int(divisibility=8)

    def fake(dtype_, shape, align=16):
        order = tuple(reversed(range(len(shape))))
        return cute.runtime.make_fake_compact_tensor(
            dtype_, shape, stride_order=order, assumed_align=align
        )

    args = (
        fake(dt, (m, k)),
        fake(dt, (g, n, k)),
        fake(cutlass.Int32, (g1,), 4),
        fake(dt, (m, n)),
        fake(dt, (m, n_act if glu else n)) if activation is not None else None,
        fake(dt, (g, n)) if has_bias else None,
        fake(cutlass.Float32, (m,), 4) if activation == "scaled_swiglu" else None,
        cutlass.Float32(7.0),
        cutlass.Float32(1.702),
        cute.runtime.make_fake_stream(use_tvm_ffi_env_stream=tvm_ffi),
    )
    kernel = GroupedGemmSm90(dt, tile_n, activation, has_bias, num_sms, cluster_m, **kernel_opts)
    options = "--enable-tvm-ffi" if tvm_ffi else ""
    return cute.compile(kernel, *args, options=options)


def _check_tensor(t, arg, dtype, ndim, device_index):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{_NAME}: {arg} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{_NAME}: {arg} has dtype {t.dtype}, expected {dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{_NAME}: {arg} must be {ndim}-D, got shape {tuple(t.shape)}")
    if t.get_device() != device_index:
        raise ValueError(f"{_NAME}: {arg} is on {t.device}, expected cuda:{device_index}")
    if not t.is_contiguous():
        raise ValueError(f"{_NAME}: {arg} must be contiguous")
    if t.data_ptr() & 15:
        raise ValueError(f"{_NAME}: {arg} data pointer must be 16-byte aligned")


def grouped_gemm_sm90(
    x, weight, offsets, *, bias=None, activation=None, probs=None, limit=7.0, alpha=1.702, out=None,
    tile_n=None, cluster_m=None,
):
    """pre = x_g @ W[g].T (+ b[g]) per row group, act = activation(pre); see the module docstring.

    x (M, K) bf16/fp16; weight (G, N, K) (GLU: natural [gate; up], gate = rows [0, N/2));
    offsets (G+1,) int32 cumulative row starts on x's device; bias (G, N) or None (GLU: [gate; up]);
    probs (M,) float32 for scaled_swiglu.
    Returns (pre (M, N) = [gate, up] for GLU, act (M, N/2) GLU / (M, N) srelu / None).
    Rows >= offsets[G] are zero. No host sync; the launch depends on shapes only.
    tile_n (128 or 256) and cluster_m (1: no W multicast, 2) override the heuristic.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{_NAME}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{_NAME}: x has dtype {x.dtype}, supported: bfloat16, float16")
    dev = x.get_device()
    if dev < 0:
        raise ValueError(f"{_NAME}: x must be on a CUDA device, got {x.device}")
    _check_tensor(x, "x", x.dtype, 2, dev)
    _check_tensor(weight, "weight", x.dtype, 3, dev)
    _check_tensor(offsets, "offsets", torch.int32, 1, dev)
    if activation not in ACTIVATIONS:
        raise ValueError(f"{_NAME}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    m, k = x.shape
    g, n, kw = weight.shape
    if kw != k:
        raise ValueError(f"{_NAME}: weight has K={kw}, x has K={k}")
    if offsets.shape[0] != g + 1:
        raise ValueError(f"{_NAME}: offsets must have G+1={g + 1} entries, got {offsets.shape[0]}")
    if g < 1:
        raise ValueError(f"{_NAME}: weight must hold at least one group")
    glu = activation in GLU_ACTIVATIONS
    if k % 8:
        raise ValueError(f"{_NAME}: K={k} (x.shape[1]) must be a multiple of 8")
    if n % (GLU_N_MULTIPLE if glu else 8):
        raise ValueError(
            f"{_NAME}: N={n} (weight.shape[1]) must be a multiple of {GLU_N_MULTIPLE if glu else 8}"
            + (f" for activation {activation!r}" if glu else "")
        )
    if bias is not None:
        _check_tensor(bias, "bias", x.dtype, 2, dev)
        if tuple(bias.shape) != (g, n):
            raise ValueError(f"{_NAME}: bias must have shape {(g, n)}, got {tuple(bias.shape)}")
    if activation == "scaled_swiglu":
        if probs is None:
            raise ValueError(f"{_NAME}: probs is required for activation 'scaled_swiglu'")
        _check_tensor(probs, "probs", torch.float32, 1, dev)
        if probs.shape[0] != m:
            raise ValueError(f"{_NAME}: probs must have shape ({m},), got {tuple(probs.shape)}")
    elif probs is not None:
        raise ValueError(f"{_NAME}: probs is only used by activation 'scaled_swiglu'")
    if out is not None:
        _check_tensor(out, "out", x.dtype, 2, dev)
        if tuple(out.shape) != (m, n):
            raise ValueError(f"{_NAME}: out must have shape {(m, n)}, got {tuple(out.shape)}")
    pre = out if out is not None else x.new_empty((m, n))
    act = None
    if activation is not None:
        act = x.new_empty((m, n // 2 if glu else n))
    if m == 0:
        return pre, act

    num_sms = _num_sms(dev)
    if tile_n is None:
        tile_n, cluster_m = choose_config(m, n, g, num_sms)
    elif tile_n not in (128, 256) or cluster_m not in (1, 2):
        raise ValueError(f"{_NAME}: tile_n must be 128 or 256 and cluster_m 1 or 2")
    tvm_ffi = _tvm_ffi_available()
    key = (x.dtype, tile_n, activation, bias is not None, num_sms, tvm_ffi, cluster_m)
    fn = _LAUNCHERS.get(key)
    if fn is None:
        fn = _LAUNCHERS[key] = compile_grouped_gemm(*key)
    if tvm_ffi:
        fn(x, weight, offsets, pre, act, bias, probs, float(limit), float(alpha))
    else:
        _call_classic(fn, x, weight, offsets, pre, act, bias, probs, limit, alpha)
    return pre, act


def _call_classic(fn, x, weight, offsets, pre, act, bias, probs, limit, alpha):
    import cuda.bindings.driver as cuda
    import cutlass
    from cutlass.cute.runtime import from_dlpack

    def cv(t, align=16):
        if t is None:
            return None
        return from_dlpack(t, assumed_align=align).mark_layout_dynamic(leading_dim=t.dim() - 1)

    stream = cuda.CUstream(torch.cuda.current_stream(x.device).cuda_stream)
    fn(cv(x), cv(weight), cv(offsets, 4), cv(pre), cv(act), cv(bias), cv(probs, 4),
       cutlass.Float32(limit), cutlass.Float32(alpha), stream)
