"""Compiled kernels kept on disk: one file per kernel binary, loaded by later processes.

Importable without cutlass or a GPU. A kernel-compiling function decorated with `disk_cached`
first looks for its entry under `cache_dir()`; on a miss it compiles, exports the object file and
writes the entry atomically (temporary file + rename, so eight processes starting at once never
read a torn file; a per-entry lock lets one of them compile while the others wait for it).

Loading a binary runs its code, so an entry is read only when
- the directory is a real directory (not a symlink) owned by this user and not writable by group
  or others, unless ``TE_FUSED_OPS_KERNEL_CACHE_TRUST=1`` says a shared directory is trusted;
- the entry is a regular file (opened without following symlinks) with the same owner rules;
- its header names exactly the key asked for and the SHA-256 recorded there matches the payload.
Anything else is ignored with a warning and recompiled (and replaced where the directory is ours).

File layout: ``MAGIC``, a 4-byte little-endian header length, a JSON header {"key", "sha256",
"tvm_ffi", "symbol"}, then the object file (``payload``).

Compiling in parallel: inside `recording()` a compile that misses memory and disk is put off (the
launcher returned stands for it and launches nothing until the recording ends) and listed as a
`CompileRequest`; `compile_in_workers` then compiles the requests in forked processes, each
writing its entries here, and the first launch after loads them. A kernel with a stand-in (a
configuration that computes the same bits and compiles faster, ``stand_in_of``: the cooperative
twin of a ping-pong kernel) is not waited for: its stand-in is compiled with the rest, launched
in its place while a background process compiles it, and replaced at the first launch after that
process ends.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import fcntl
import functools
import hashlib
import inspect
import json
import os
import pathlib
import platform
import signal
import stat
import struct
import sys
import tempfile
import threading
import time
import traceback
import warnings
from importlib import metadata

from . import env

MAGIC = b"TFOKC1\n"
_HEADER_LEN = struct.Struct("<I")
_SOURCE_ROOT = pathlib.Path(__file__).parent


def cache_dir() -> pathlib.Path:
    """``TE_FUSED_OPS_KERNEL_CACHE_DIR``, else ``$XDG_CACHE_HOME/te_fused_ops/kernels``, else
    ``~/.cache/te_fused_ops/kernels``."""
    configured = env.read("TE_FUSED_OPS_KERNEL_CACHE_DIR")
    if configured:
        return pathlib.Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG specification: a relative value is ignored
        base = os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "te_fused_ops" / "kernels"


def _trusted_shared() -> bool:
    return bool(env.read("TE_FUSED_OPS_KERNEL_CACHE_TRUST"))


def new_file_mode() -> int:
    """Mode of the entries, tables and locks this process creates: the owner's alone, or
    readable by everyone in a trusted shared directory (others load what precompile wrote)."""
    return 0o644 if _trusted_shared() else 0o600


def file_unsafe_reason(st: os.stat_result, what: str) -> str | None:
    """Why a file or directory with stat ``st`` may not be trusted (None: it may)."""
    if _trusted_shared():
        return None
    if st.st_uid != os.getuid():
        return f"{what} is owned by uid {st.st_uid}, not this user ({os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"{what} is writable by group or others (mode {stat.filemode(st.st_mode)})"
    return None


def _make_directories(path: pathlib.Path) -> None:
    """Create ``path`` and its missing parents, each made here set to mode 0700 (0755 in a trusted
    shared cache: others load from it) whatever the umask."""
    missing = []
    while not os.path.lexists(path) and path != path.parent:
        missing.append(path)
        path = path.parent
    mode = 0o755 if _trusted_shared() else 0o700
    for directory in reversed(missing):
        try:
            directory.mkdir(mode=mode)
        except FileExistsError:  # made by a process beside this one
            continue
        os.chmod(directory, mode)


def directory_unsafe_reason(path: pathlib.Path) -> str | None:
    """Why the cache directory ``path`` may not be used (None: it may). A missing one is created
    (mode 0700; 0755 in a trusted shared cache)."""
    try:
        _make_directories(path)
    except OSError as e:
        return f"cannot create {path}: {e}"
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot read {path}: {e}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory (symlinks are not followed)"
    return file_unsafe_reason(st, str(path))


def _warn(message: str) -> None:
    warnings.warn(f"te_fused_ops kernel cache: {message}; compiling instead", stacklevel=4)


def read_trusted(path: pathlib.Path, untrusted) -> bytes | None:
    """The bytes of ``path`` if it is a regular file (not followed through a symlink) passing the
    owner rules above; None when it is absent, else ``untrusted(reason)`` and None."""
    try:  # O_NONBLOCK: a FIFO planted at the path must not block the open
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        symlink = " (a symlink: symlinks are not followed)" if e.errno == errno.ELOOP else ""
        untrusted(f"{path} not opened: {e.strerror}{symlink}")
        return None
    try:
        st = os.fstat(fd)
        reason = f"{path} is not a regular file" if not stat.S_ISREG(st.st_mode) else file_unsafe_reason(st, str(path))
        if reason:
            untrusted(reason)
            return None
        os.set_blocking(fd, True)
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def read_entry(path: pathlib.Path, key: str) -> tuple[dict, bytes] | None:
    """(header, payload) of the entry at ``path`` if it exists and passes every check above for
    ``key``; None (with a warning unless the file is simply absent) otherwise."""
    data = read_trusted(path, _warn)
    if data is None:
        return None
    try:
        if not data.startswith(MAGIC):
            raise ValueError("not a kernel cache entry")
        (length,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
        start = len(MAGIC) + _HEADER_LEN.size
        header = json.loads(data[start : start + length])
        payload = data[start + length :]
        if not isinstance(header, dict) or not isinstance(header.get("symbol"), str):
            raise ValueError("its header is not one of this library's")
        if header.get("key") != key:
            raise ValueError("its key differs from the one asked for")
        if hashlib.sha256(payload).hexdigest() != header.get("sha256"):
            raise ValueError("its content does not match its recorded digest")
    except (ValueError, struct.error, RecursionError) as e:  # RecursionError: a header nested too deep
        _warn(f"{path} ignored: {e}")
        return None
    return header, payload


def write_entry(path: pathlib.Path, key: str, payload: bytes, **fields) -> None:
    """Write the entry for ``key`` atomically (a complete file appears under ``path`` or none)."""
    header = json.dumps({"key": key, "sha256": hashlib.sha256(payload).hexdigest(), **fields}).encode()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, new_file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(MAGIC + _HEADER_LEN.pack(len(header)) + header + payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


LOCK_WARN_S, LOCK_GIVE_UP_S = 60.0, 600.0
"""Seconds waited for another process's entry lock before a warning, and before compiling without
it (safe: entries are written atomically; the lock only spares duplicate compiles)."""


def _take_lock(fd: int, lock_path: str) -> None:
    """Take the exclusive lock on ``fd``, or go on without it where the filesystem has no working
    flock or its holder keeps it past `LOCK_GIVE_UP_S`."""
    started, warned, pause = time.monotonic(), False, 0.005
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError:  # no flock here (e.g. a Lustre or NFS mount without it)
            return
        waited = time.monotonic() - started
        if waited > LOCK_GIVE_UP_S:
            warnings.warn(f"te_fused_ops kernel cache: {lock_path} still held after {waited:.0f} s; compiling "
                          "without it", stacklevel=4)
            return
        if waited > LOCK_WARN_S and not warned:
            warnings.warn(f"te_fused_ops kernel cache: waiting for {lock_path}, held by another process (compiling "
                          "this kernel, or stopped)", stacklevel=4)
            warned = True
        time.sleep(pause)
        pause = min(2 * pause, 0.5)


@contextlib.contextmanager
def entry_lock(path: pathlib.Path):
    """An exclusive lock beside entry ``path`` (released when the holder exits or dies); none
    where it cannot be made (a read-only shared directory, a filesystem without flock) or is held
    past `LOCK_GIVE_UP_S`."""
    lock_path, fd = str(path) + ".lock", None
    for access in (os.O_RDWR, os.O_RDONLY):  # read-only: another user's lock in a shared cache
        with contextlib.suppress(OSError):
            fd = os.open(lock_path, access | os.O_CREAT | os.O_NOFOLLOW, new_file_mode())
            break
    if fd is None:
        yield
        return
    try:
        if _trusted_shared() and os.fstat(fd).st_uid == os.getuid():
            with contextlib.suppress(OSError):  # readable by the others whatever the umask
                os.fchmod(fd, new_file_mode())
        _take_lock(fd, lock_path)
        yield
    finally:
        os.close(fd)


_COMPILER_DISTRIBUTIONS = (  # what builds and loads the binaries besides this library
    "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12", "nvidia-cutlass-dsl-libs-cu13", "apache-tvm-ffi",
)


@functools.cache
def build_identity() -> str:
    """Everything outside a kernel's own arguments that changes its binary: this library's kernel
    sources, the CuTe DSL and TVM-FFI versions, the Python and host."""
    digest = hashlib.sha256()
    for source in sorted((_SOURCE_ROOT / "backends" / "sm90" / "kernels").glob("*.py")):
        digest.update(source.name.encode() + source.read_bytes())
    digest.update((_SOURCE_ROOT / "activations.py").read_bytes())
    versions = []
    for name in _COMPILER_DISTRIBUTIONS:
        try:
            versions.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            continue
    return "|".join([digest.hexdigest(), *versions, f"py{sys.version_info[0]}.{sys.version_info[1]}",
                     platform.machine()])


def _target_arch() -> str:
    arch = os.environ.get("CUTE_DSL_ARCH", "")
    if arch:
        return arch
    import torch

    if torch.cuda.is_available():  # what the DSL targets here: Hopper's arch-specific "a" variant
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}" + ("a" if major >= 9 else "")
    return "none"


def _canonical(value) -> str:
    """A stable text of a compile argument (torch dtypes, strings, numbers, bools, None, tuples, dicts)."""
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_canonical(v) for v in value) + ")"
    if isinstance(value, dict):  # **kernel_opts
        return "{" + ",".join(f"{k}:{_canonical(v)}" for k, v in sorted(value.items())) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    import torch

    if isinstance(value, torch.dtype):
        return str(value)
    raise TypeError(f"kernel cache: no stable key for a compile argument of type {type(value).__name__}")


def entry_key(fn, bound: inspect.BoundArguments) -> str:
    """The key of ``fn``'s binary for arguments ``bound`` (defaults applied)."""
    args = ",".join(f"{name}={_canonical(value)}" for name, value in sorted(bound.arguments.items()))
    return f"{fn.__module__}.{fn.__qualname__}({args})|{_target_arch()}|{build_identity()}"


def _entry_path(directory: pathlib.Path, key: str) -> pathlib.Path:
    return directory / (hashlib.sha256(key.encode()).hexdigest()[:40] + ".tfok")


def _file_identity(path: pathlib.Path):
    """(inode, size, mtime) of ``path`` itself (a symlink is not followed), None where absent:
    which version of an entry a read saw."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


def enabled() -> bool:
    return env.read("TE_FUSED_OPS_KERNEL_CACHE")


COMPILERS: list = []
"""Every `DiskCachedCompile` of the process, for `stats`."""


def stats() -> dict:
    """Kernels this process compiled, wrote to the cache and loaded from it, and the seconds each
    took."""
    totals = {"compiled": 0, "written": 0, "loaded": 0, "compile s": 0.0, "write s": 0.0, "load s": 0.0}
    for c in COMPILERS:
        for name, value in (("compiled", c.compiled_here), ("written", c.written_here),
                            ("loaded", c.loaded_from_disk), *c.seconds.items()):
            totals[name] += value
    return totals


class DiskCachedCompile:
    """A kernel-compiling function memoized in memory and on disk. ``export(compiled, path,
    symbol, tvm_ffi)`` writes the object file of a compiled function, ``load(path, symbol, tvm_ffi)`` loads
    one; ``tvm_ffi_of(bound)`` says which launcher form the arguments ask for; ``stand_in_of(bound)``
    (optional) gives the argument overrides of a kernel with the same launcher and the same output
    bits that compiles faster, or None."""

    def __init__(self, fn, export, load, tvm_ffi_of, stand_in_of=None):
        functools.update_wrapper(self, fn)
        self.fn, self.export, self.load, self.tvm_ffi_of = fn, export, load, tvm_ffi_of
        self.stand_in_of = stand_in_of
        self.signature = inspect.signature(fn)
        self.memo: dict = {}
        self.loaded_from_disk = 0  # entries this process loaded instead of compiling
        self.compiled_here = 0
        self.written_here = 0  # entries this process wrote
        self.seconds = {"compile s": 0.0, "write s": 0.0, "load s": 0.0}
        COMPILERS.append(self)

    def cache_clear(self) -> None:
        self.memo.clear()

    def __call__(self, *args, **kwargs):
        memo_key = (args, tuple(sorted(kwargs.items())))
        compiled = self.memo.get(memo_key)
        if compiled is None:
            deferred = self._defer(args, kwargs) if _RECORDING is not None else None
            if deferred is not None:
                return deferred
            compiled = self.memo[memo_key] = self._compile_or_load(args, kwargs)
        return compiled

    def _defer(self, args, kwargs):
        """Inside `recording()`: a `DeferredLauncher` for a kernel neither in memory nor on disk
        (None where the cache is off or the entry exists: then it is compiled or loaded now)."""
        directory = cache_dir()
        if not enabled() or directory_unsafe_reason(directory) is not None:
            return None
        key, _ = self._entry_key(args, kwargs)
        if _entry_path(directory, key).exists():
            return None
        request = _RECORDING.get(key)
        if request is None:
            request = _RECORDING[key] = CompileRequest(self, args, kwargs, self._stand_in(args, kwargs, directory))
        return DeferredLauncher(request)

    def _stand_in(self, args, kwargs, directory):
        """The `CompileRequest` of this call's stand-in (`stand_in_of`), listed for compiling
        unless its entry is on disk; None where it has none."""
        if self.stand_in_of is None:
            return None
        bound = self.signature.bind(*args, **kwargs)
        overrides = self.stand_in_of(bound)
        if not overrides:
            return None
        bound.arguments.update(overrides)
        request = CompileRequest(self, bound.args, bound.kwargs)
        key, _ = self._entry_key(bound.args, bound.kwargs)
        return request if _entry_path(directory, key).exists() else _RECORDING.setdefault(key, request)

    def _entry_key(self, args, kwargs) -> tuple[str, bool]:
        """(the cache entry's key of this call, whether it asks for the TVM-FFI launcher)."""
        bound = self.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        tvm_ffi = self.tvm_ffi_of(bound)
        return entry_key(self.fn, bound) + f"|tvm_ffi={tvm_ffi}", tvm_ffi

    def _compile(self, args, kwargs):
        self.compiled_here += 1
        started = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds["compile s"] += time.perf_counter() - started

    def _compile_or_load(self, args, kwargs):
        if not enabled():
            return self._compile(args, kwargs)
        directory = cache_dir()
        reason = directory_unsafe_reason(directory)
        if reason:
            _warn(f"directory not used: {reason}")
            return self._compile(args, kwargs)
        key, tvm_ffi = self._entry_key(args, kwargs)
        path = _entry_path(directory, key)
        symbol = "tfo_" + path.stem[:24]
        # a complete entry loads without the lock (ranks starting on a warm cache do not queue);
        # the lock is for a miss, so that one process compiles while the others wait
        seen = _file_identity(path)
        if seen is not None:
            loaded = self._load(path, key, tvm_ffi)
            if loaded is not None:
                return loaded
        with entry_lock(path):
            if _file_identity(path) not in (None, seen):  # written while this process waited
                loaded = self._load(path, key, tvm_ffi)
                if loaded is not None:
                    return loaded
            compiled = self._compile(args, kwargs)
            started = time.perf_counter()
            try:
                with tempfile.TemporaryDirectory() as scratch:
                    obj = pathlib.Path(scratch) / "kernel.o"
                    self.export(compiled, obj, symbol, tvm_ffi)
                    write_entry(path, key, obj.read_bytes(), tvm_ffi=tvm_ffi, symbol=symbol)
                self.written_here += 1
                self.seconds["write s"] += time.perf_counter() - started
            except Exception as e:  # a kernel that cannot be kept still runs
                warnings.warn(f"te_fused_ops kernel cache: {path} not written ({type(e).__name__}: {e})", stacklevel=3)
            return compiled

    def _load(self, path, key, tvm_ffi):
        started = time.perf_counter()
        try:
            return self._load_verified(path, key, tvm_ffi)
        finally:
            self.seconds["load s"] += time.perf_counter() - started

    def _load_verified(self, path, key, tvm_ffi):
        entry = read_entry(path, key)
        if entry is None:
            return None
        header, payload = entry
        # The verified bytes, not the path again: what was checked is what is loaded.
        with tempfile.TemporaryDirectory() as scratch:  # private (0700)
            obj = pathlib.Path(scratch) / "kernel.o"
            obj.write_bytes(payload)
            try:
                loaded = self.load(obj, header["symbol"], tvm_ffi)
            except Exception as e:  # a binary this runtime rejects: recompile
                _warn(f"{path} not loadable ({type(e).__name__}: {e})")
                return None
        self.loaded_from_disk += 1
        return loaded


@dataclasses.dataclass(eq=False)
class CompileRequest:
    """A compile `recording()` put off: ``compiler(*args, **kwargs)``; ``stand_in``: the request
    of its stand-in kernel, or None; ``compiling_elsewhere``: a background process of
    `compile_in_workers` is compiling it now."""

    compiler: DiskCachedCompile
    args: tuple
    kwargs: dict
    stand_in: CompileRequest | None = None
    compiling_elsewhere: bool = False

    def compile(self):
        """The launcher: from memory or disk, or compiled (and written) here."""
        return self.compiler(*self.args, **self.kwargs)


class DeferredLauncher:
    """Stands for the launcher of a `CompileRequest`: launching it inside `recording()` does
    nothing; after, the first launch gets the launcher (`CompileRequest.compile`: from disk once
    `compile_in_workers` wrote it) and every launch goes to it. While the request compiles in a
    background process its stand-in's launcher runs instead; the first launch after that process
    ended (not during a CUDA graph capture) takes the request's own."""

    def __init__(self, request: CompileRequest):
        self.request = request
        self.launcher = None
        self.on_stand_in = False

    def __call__(self, *args, **kwargs):
        if self.launcher is None or (self.on_stand_in and not self.request.compiling_elsewhere):
            if _RECORDING is not None:
                return None
            self._resolve()
        return self.launcher(*args, **kwargs)

    def _resolve(self) -> None:
        from .cuda_graphs import capturing  # torch is imported on first use only

        request = self.request
        if self.launcher is not None and capturing():  # a graph keeps the stand-in it captured
            return
        self.on_stand_in = request.stand_in is not None and request.compiling_elsewhere
        self.launcher = (request.stand_in if self.on_stand_in else request).compile()


_RECORDING: dict | None = None  # entry key -> CompileRequest while `recording()` is active


@contextlib.contextmanager
def recording():
    """Inside, every compile that misses memory and disk is put off and the kernel it stands for
    is not launched (its outputs are left unwritten; kernels found on disk load and run as
    usual); yields the list the `CompileRequest`s are added to, each once, when the block ends.
    Needs the cache (`enabled`, a usable `cache_dir`): where it is off, compiles happen as usual."""
    global _RECORDING
    if _RECORDING is not None:
        raise RuntimeError("te_fused_ops kernel cache: recording() is already active")
    _RECORDING, requests = {}, []
    try:
        yield requests
    finally:
        requests.extend(_RECORDING.values())
        _RECORDING = None


def is_recording() -> bool:
    """Whether a `recording()` block is active (kernels missing from the cache are not launched)."""
    return _RECORDING is not None


def _dsl_arch() -> str:
    """The architecture CuTe DSL compiles for here (detected once, from the GPU, in this process)."""
    from cutlass.cutlass_dsl import CuTeDSL

    return CuTeDSL._get_dsl().envar.arch


def compile_in_workers(requests: list, workers: int, timeout_s: float = 600.0) -> dict:
    """Compile ``requests`` (`CompileRequest`) into the cache in ``workers`` forked processes
    (shares taken round-robin) and wait for them; a request with a stand-in compiles in a
    background process of its own instead, not waited for (its stand-in runs until it ends). The
    architecture is read here first and fixed in the children, which compile and write entries
    only (no CUDA call: a forked child may not make one). A share whose process fails or runs past
    ``timeout_s`` (killed) is left to the first launch here. Returns {"workers", "requests",
    "background", "failed workers", "seconds"}."""
    started = time.perf_counter()
    workers = max(1, workers)
    now = [request for request in requests if request.stand_in is None]
    shares = [share for share in (now[i::workers] for i in range(workers)) if share]
    background = [[request] for request in requests if request.stand_in is not None]
    arch = _dsl_arch() if shares or background else None
    target = _target_arch() if shares or background else None
    for share in background:
        share[0].compiling_elsewhere = True
    # the background processes start at once where the CPUs hold every process, else after the rest
    at_once = len(shares) + len(background) <= (os.cpu_count() or 1)
    pids = [_fork_compiler(share, arch, target) for share in shares]
    deadline = time.monotonic() + timeout_s
    if at_once:
        _compile_in_background(background, arch, target, deadline)
    failed = 0
    for pid in pids:
        failed += not _reap(pid, (), deadline)
    if not at_once:
        _compile_in_background(background, arch, target, time.monotonic() + timeout_s)
    if failed:
        warnings.warn(f"te_fused_ops kernel cache: {failed} of {len(pids)} compile workers failed; their kernels "
                      "compile here when first launched", stacklevel=2)
    return {"workers": len(pids), "requests": len(requests), "background": len(background), "failed workers": failed,
            "seconds": time.perf_counter() - started}


def _fork_compiler(share: list, arch: str, target: str) -> int:
    """A forked process that compiles ``share`` into the cache for ``arch``; its pid."""
    pid = os.fork()
    if pid == 0:  # the child: compile, write, leave without running the parent's exit handlers
        code = 1
        try:
            from cutlass.cutlass_dsl import CuTeDSL

            CuTeDSL._get_dsl().envar.arch = arch
            os.environ["CUTE_DSL_ARCH"] = target
            for request in share:
                request.compile()
            code = 0
        except BaseException:  # noqa: BLE001  (reported; the parent compiles what is missing)
            traceback.print_exc()
        finally:
            sys.stderr.flush()
            os._exit(code)
    return pid


_BACKGROUND_PIDS: set = set()  # background compile processes still running


def _compile_in_background(shares: list, arch: str, target: str, deadline: float) -> None:
    """Fork a compile process per share, each reaped by a thread that marks its share done;
    those still running when this process exits are killed (their kernels are not written)."""
    if shares and not _BACKGROUND_PIDS:
        atexit.register(_kill_background)
    pids = [_fork_compiler(share, arch, target) for share in shares]  # all forked before a thread starts
    _BACKGROUND_PIDS.update(pids)
    for pid, share in zip(pids, shares):
        threading.Thread(target=_reap, args=(pid, share, deadline), daemon=True, name="te_fused_ops compile").start()


def wait_for_background(timeout_s: float = 600.0) -> bool:
    """Wait until the background compiles of `compile_in_workers` have ended (written their
    kernels or failed), at most ``timeout_s``; whether none is left running."""
    deadline = time.monotonic() + timeout_s
    while _BACKGROUND_PIDS and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _BACKGROUND_PIDS


def _kill_background() -> None:
    for pid in list(_BACKGROUND_PIDS):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    atexit.unregister(_kill_background)


def _reap(pid: int, share: list, deadline: float) -> bool:
    """Wait for compile process ``pid`` (killed past ``deadline``), then mark its ``share`` as
    compiled elsewhere no more; whether it succeeded."""
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            ok = status == 0
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            ok = False
            break
        time.sleep(0.01)
    _BACKGROUND_PIDS.discard(pid)
    if share and not ok:
        warnings.warn("te_fused_ops kernel cache: a background compile failed; its kernel compiles here when next "
                      "launched", stacklevel=1)
    for request in share:
        request.compiling_elsewhere = False
    return ok


def disk_cached(export, load, tvm_ffi_of, stand_in_of=None):
    """Decorator form of `DiskCachedCompile`."""
    return lambda fn: DiskCachedCompile(fn, export, load, tvm_ffi_of, stand_in_of)
