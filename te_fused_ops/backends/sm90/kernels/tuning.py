"""Per-shape launch configurations: tuned winners kept on disk, and the opt-in autotuner.

Importable without cutlass. A wrapper asks `tuned_config(family, problem, run, default,
candidates)` once per argument signature (on a launch-memo miss, never per call). It returns a
stored `LaunchConfig` for the problem class, or None (the wrapper's heuristic then decides). With
``TE_FUSED_OPS_AUTOTUNE=1`` an unknown class is tuned on the spot: ``run(config)`` launches
every candidate on the caller's operands into fresh outputs; a candidate
whose outputs differ from the heuristic's by a single bit is discarded; the fastest remaining one
is stored (a host sync, once per class; skipped while a CUDA graph is being captured). Inside
`kernel_cache.recording()` (``precompile --jobs``) the candidates' kernels are only recorded, so
the workers compile them all and the first real run tunes without compiling.

The table lives beside the compiled kernels (`kernel_cache.cache_dir()`, the same trust checks)
in ``tuned_configs.json``: {problem key: [tile_n, cluster_m, pingpong, deep_operands]}. Keys
name the GPU and a digest of the kernel sources, so a new build or another GPU tunes again. A
value that is not a candidate is ignored.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import tempfile
import warnings
from typing import NamedTuple

import torch

from .... import env, kernel_cache
from ....cuda_graphs import capturing

TILE_NS = (128, 192, 256)  # tile widths of the bf16 GEMM kernels
PINGPONG_TILE_NS = (128, 192)  # with ping-pong each warpgroup holds a whole tile's accumulator


class LaunchConfig(NamedTuple):
    """A bf16 kernel's launch configuration: n-tile width, CTAs per cluster, whether the MMA
    warpgroups run the ping-pong schedule (each on tiles of its own) rather than sharing tiles,
    and (kernels that load C tiles in the epilogue) whether one C stage and one store slot leave
    the rest of shared memory to operand stages (`deep_operands`; False: the kernel's own split)."""

    tile_n: int
    cluster_m: int
    pingpong: bool = False
    deep_operands: bool = False


def check_pingpong(fn_name: str, pingpong) -> None:
    """TypeError naming ``fn_name`` unless ``pingpong`` is a bool or None (1 is not True here)."""
    if pingpong is not None and not isinstance(pingpong, bool):
        raise TypeError(f"{fn_name}: pingpong must be a bool or None, got {type(pingpong).__name__}")


def pingpong_tile_n(cooperative_tile_n: int) -> int:
    """The ping-pong tile width in place of a cooperative one: 192 for the wide tiles, else 128."""
    return 192 if cooperative_tile_n > 128 else 128


CANDIDATES = tuple(LaunchConfig(t, c) for t in TILE_NS for c in (1, 2))  # the cooperative ones
PINGPONG_CANDIDATES = tuple(LaunchConfig(t, c, True) for t in PINGPONG_TILE_NS for c in (1, 2))
# the ping-pong ones with deep operand stages, for the kernels loading C tiles (the dActivation):
# measured either way by kernel and shape (docs/notes/backward-kernels.md)
DEEP_OPERAND_CANDIDATES = tuple(config._replace(deep_operands=True) for config in PINGPONG_CANDIDATES)
WASTE_MARGIN = 0.01  # 192-wide tiles win where they pad N by at least this share less than 256-wide ones
FP8_GLU_PAD_LIMIT = 0.05  # FP8 GLU: 256-wide tiles win up to this share of each half padded (gpt-oss: 2.2%)


def padded_share(n: int, tile_n: int, halves: int = 1) -> float:
    """The share of the n-tiles' columns past N when each of ``halves`` halves of N (a GLU's gate
    and up) is tiled by tile_n / halves columns."""
    part, box = n // halves, tile_n // halves
    return (-(-part // box) * box - part) / part


def pads_no_more(n: int, tile_n: int, other: int, halves: int = 1, margin: float = 0.0) -> bool:
    """Whether ``tile_n``-wide tiles pad N (`padded_share`) by at least ``margin`` less than
    ``other``-wide ones, or no more when ``margin`` is 0."""
    return padded_share(n, tile_n, halves) + margin <= padded_share(n, other, halves)


def fp8_tile_n(n: int, glu: bool) -> int:
    """The FP8 GEMMs' n-tile (the forward's over N, the weight gradient's over K). GLU: 256 where
    it pads each half by at most `FP8_GLU_PAD_LIMIT` (halves that are not whole W blocks take two
    blocks' multipliers in the up half, ``up_box_split``); else, and without a GLU: 256 where N is
    whole 128-column blocks and 256 pads it no more than 128 does, else 192 where that pads no more
    than 128, else 128. Measured, FC1 + SwiGLU forward: H100 (`bench_fp8_sm90.py --part kernels`)
    qwen3 532 us at t256 against 590 at t192 and 575 at t128, dsv3 1963 at t256 against 2159 at
    t128 (promotion overlapped) and 2405 at t192; H200 gpt-oss (halves of 2880, 2.2% padding at
    t256) 1296 at t256 against 1418 at t192 and 1374 at t128. Weight gradient (H100,
    `bench_wgrad_fp8_sm90.py`): qwen3 FC1 (K 2048) 658 us at t256 against 722 at t128, FC2 (K 768)
    334 against 361, dsv3 FC1 (K 7168) 2550 against 2733 (t192 2519)."""
    halves = 2 if glu else 1
    if glu and padded_share(n, 256, halves) <= FP8_GLU_PAD_LIMIT:
        return 256
    if not glu and n % 128 == 0 and pads_no_more(n, 256, 128):
        return 256
    return 192 if pads_no_more(n, 192, 128, halves) else 128


def fp8_dact_tile_n(i: int) -> int:
    """FC2's FP8 data gradient + dActivation n-tile (over I; 128 or 256): 256 where `fp8_tile_n`
    takes it, else 128. Measured on H100 (`bench_dact_quant_sm90.py`): dsv3 (I 2048) 1111 us
    against 1207 at t128, qwen3 (I 768) 344 against 350."""
    return 256 if fp8_tile_n(i, glu=False) == 256 else 128


def fp8_candidates(tile_ns=TILE_NS) -> tuple:
    """The FP8 autotuner's candidates (cooperative; the FP8 kernels have no ping-pong): each of
    ``tile_ns`` (every one takes any N the FP8 kernels take), alone and in CTA pairs."""
    return tuple(LaunchConfig(t, c) for t in tile_ns for c in (1, 2))


def wide_tile(n: int, halves: int = 1, tile_ns=TILE_NS) -> int:
    """The wide tile for N: 192 where 256-wide tiles pad N by WASTE_MARGIN more (N = 2880: 12
    tiles of 256 hold 6.7% padding, 15 of 192 none), else 256."""
    return 192 if 192 in tile_ns and pads_no_more(n, 192, 256, halves, WASTE_MARGIN) else 256


TABLE_NAME = "tuned_configs.json"
_REPEATS = 10
_table: dict | None = None  # loaded on first use
_table_path: pathlib.Path | None = None


def rows_bucket(m: int) -> int:
    """The problem class's row count: M rounded up to a power of two."""
    return 1 << max(0, (m - 1).bit_length())


def problem_key(family: str, *dims) -> str:
    """The table key of ``family`` on ``dims`` (dtype, group count, N, K, rows bucket, epilogue)
    for this GPU and these kernel sources."""
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    build = hashlib.sha256(kernel_cache.build_identity().encode()).hexdigest()[:12]
    return f"{family}|{'|'.join(map(str, dims))}|{device}|{build}"


def _path() -> pathlib.Path:
    return kernel_cache.cache_dir() / TABLE_NAME


def _read_table() -> dict:
    """The stored table, or {} when there is none or it fails the trust checks (with a warning)."""
    path = _path()
    if not kernel_cache.enabled() or kernel_cache.directory_unsafe_reason(path.parent):
        return {}
    untrusted = lambda reason: warnings.warn(f"te_fused_ops tuned configs: {path} not trusted ({reason}), "  # noqa: E731
                                             "ignored", stacklevel=5)
    data = kernel_cache.read_trusted(path, untrusted)
    if data is None:
        return {}
    try:
        table = json.loads(data)
    except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
        warnings.warn(f"te_fused_ops tuned configs: {path} is not JSON, ignored", stacklevel=4)
        return {}
    known = CANDIDATES + PINGPONG_CANDIDATES + DEEP_OPERAND_CANDIDATES
    return {k: LaunchConfig(*v) for k, v in table.items() if isinstance(v, list) and tuple(v) in known} \
        if isinstance(table, dict) else {}


def table() -> dict:
    """key -> `LaunchConfig`, read from disk on first use (again after the cache directory
    changes)."""
    global _table, _table_path
    if _table is None or _table_path != _path():
        _table, _table_path = _read_table(), _path()
    return _table


def _store(key: str, config: tuple) -> None:
    """Add ``key`` to the table in memory and on disk (merged with what other processes wrote)."""
    table()[key] = config
    path = _path()
    if not kernel_cache.enabled() or kernel_cache.directory_unsafe_reason(path.parent):
        return
    with kernel_cache.entry_lock(path):  # read, merge and replace as one step among processes
        merged = {**_read_table(), key: config}
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=TABLE_NAME + ".", suffix=".tmp")
            os.fchmod(fd, kernel_cache.new_file_mode())
            with os.fdopen(fd, "w") as f:
                json.dump({k: list(v) for k, v in sorted(merged.items())}, f, indent=0)
            os.replace(tmp, path)
        except OSError as e:  # a read-only directory among them; the choice still holds in this process
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            warnings.warn(f"te_fused_ops tuned configs: {path} not written ({e})", stacklevel=4)


def _median_ms(fn) -> float:
    for _ in range(3):
        fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(_REPEATS)]
    for begin, end in events:
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(b.elapsed_time(e) for b, e in events)[_REPEATS // 2]


def _outputs(result) -> list:
    items = result if isinstance(result, tuple) else (result,)
    return [t for t in items if isinstance(t, torch.Tensor)]


def tune(run, default: LaunchConfig, candidates=CANDIDATES) -> LaunchConfig:
    """The fastest of ``candidates`` whose outputs equal ``default``'s bit for bit; ``run(config)``
    launches the kernel under a `LaunchConfig`."""
    reference = _outputs(run(default))
    times = {}
    for config in candidates:
        outputs = _outputs(run(config))
        if len(outputs) == len(reference) and all(torch.equal(a, b) for a, b in zip(outputs, reference)):
            times[config] = _median_ms(lambda config=config: run(config))
    return min(times, key=times.get) if times else default


def tuned_config(family: str, dims: tuple, run, default: LaunchConfig, candidates=CANDIDATES):
    """The `LaunchConfig` stored for this problem class, else tuned now among ``candidates`` under
    ``TE_FUSED_OPS_AUTOTUNE=1`` (``default``: the heuristic's choice, the reference outputs;
    ``run(config)`` launches one), else None."""
    key = problem_key(family, *dims)
    config = table().get(key)
    if config is not None or not env.read("TE_FUSED_OPS_AUTOTUNE", family):
        return config
    if capturing():
        return None
    if kernel_cache.is_recording():  # nothing runs: record every candidate's kernel, tune on a real run
        for candidate in candidates:
            run(candidate)
        return None
    config = tune(run, LaunchConfig(*default), candidates)
    _store(key, config)
    return config
