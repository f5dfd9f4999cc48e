"""The on-disk kernel cache: entries are loaded only from a trusted directory, only when their
digest matches, never through a symlink; writes are atomic under concurrent writers; a compiled
kernel is loaded back instead of recompiled (CPU: compiled for sm_90a, loaded, not launched)."""

import importlib.util
import json
import multiprocessing
import os
import pathlib
import time
import warnings

import pytest

from te_fused_ops import kernel_cache

KEY = "test.kernel(dtype=torch.bfloat16)|sm_90a|build"


@pytest.fixture
def cache(kernel_cache_dir):
    return kernel_cache_dir


def test_missing_directory_is_created_private(tmp_path):
    directory = tmp_path / "a" / "kernels"
    assert kernel_cache.directory_unsafe_reason(directory) is None
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"


def _entry(directory, payload=b"\x7fELF object bytes" * 100, key=KEY):
    path = directory / "entry.tfok"
    kernel_cache.write_entry(path, key, payload, tvm_ffi=False, symbol="tfo_x")
    return path, payload


def test_entry_round_trip(cache):
    path, payload = _entry(cache)
    header, read = kernel_cache.read_entry(path, KEY)
    assert read == payload and header["symbol"] == "tfo_x" and header["tvm_ffi"] is False
    assert kernel_cache.read_entry(cache / "absent.tfok", KEY) is None


def test_changed_byte_is_not_loaded(cache):
    path, payload = _entry(cache)
    data = bytearray(path.read_bytes())
    data[-7] ^= 1
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="does not match its recorded digest"):
        assert kernel_cache.read_entry(path, KEY) is None


def test_truncated_or_foreign_file_is_not_loaded(cache):
    path, _ = _entry(cache)
    path.write_bytes(path.read_bytes()[:20])
    with pytest.warns(UserWarning, match="ignored"):
        assert kernel_cache.read_entry(path, KEY) is None
    path.write_bytes(b"#!/bin/sh\nrm -rf ~\n")
    with pytest.warns(UserWarning, match="not a kernel cache entry"):
        assert kernel_cache.read_entry(path, KEY) is None
    header = b"[1, 2]"
    path.write_bytes(kernel_cache.MAGIC + kernel_cache._HEADER_LEN.pack(len(header)) + header + b"payload")
    with pytest.warns(UserWarning, match="header is not one of this library's"):
        assert kernel_cache.read_entry(path, KEY) is None
    header = b"[" * 100_000  # deeper than the JSON parser's stack
    path.write_bytes(kernel_cache.MAGIC + kernel_cache._HEADER_LEN.pack(len(header)) + header)
    with pytest.warns(UserWarning, match="ignored: maximum recursion depth"):
        assert kernel_cache.read_entry(path, KEY) is None


def test_entry_for_another_key_is_not_loaded(cache):
    path, _ = _entry(cache)
    with pytest.warns(UserWarning, match="key differs"):
        assert kernel_cache.read_entry(path, KEY + "|other") is None


def test_symlinked_entry_is_not_followed(cache, tmp_path):
    target, _ = _entry(tmp_path)  # a valid entry elsewhere
    link = cache / "linked.tfok"
    link.symlink_to(target)
    with pytest.warns(UserWarning, match="symlinks are not followed"):
        assert kernel_cache.read_entry(link, KEY) is None


def test_world_writable_directory_or_entry_is_refused(cache, monkeypatch):
    path, payload = _entry(cache)
    os.chmod(path, 0o666)
    with pytest.warns(UserWarning, match="writable by group or others"):
        assert kernel_cache.read_entry(path, KEY) is None
    os.chmod(path, 0o600)
    os.chmod(cache, 0o777)
    assert "writable by group or others" in kernel_cache.directory_unsafe_reason(cache)
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE_TRUST", "1")  # a shared directory, trusted explicitly
    assert kernel_cache.directory_unsafe_reason(cache) is None
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="digest"):  # the digest is checked either way
        assert kernel_cache.read_entry(path, KEY) is None


def test_symlinked_directory_is_refused(cache, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(cache, target_is_directory=True)
    assert "not a directory" in kernel_cache.directory_unsafe_reason(link)


def test_entry_path_holding_a_directory_or_a_fifo_is_refused_without_blocking(cache):
    """Something other than a regular file planted at an entry's path: a warning, never an
    uncaught error, never a process blocked opening a FIFO."""
    (cache / "dir.tfok").mkdir()
    os.mkfifo(cache / "fifo.tfok")
    for name in ("dir.tfok", "fifo.tfok"):
        with pytest.warns(UserWarning, match="is not a regular file"):
            assert kernel_cache.read_entry(cache / name, KEY) is None


def test_cache_path_holding_a_file_is_named_as_not_a_directory(tmp_path):
    (tmp_path / "kernels").write_text("")
    assert "is not a directory" in kernel_cache.directory_unsafe_reason(tmp_path / "kernels")


def test_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    monkeypatch.delenv("TE_FUSED_OPS_KERNEL_CACHE_DIR", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "~/.cache")  # relative (not expanded): the specification ignores it
    assert kernel_cache.cache_dir() == tmp_path / ".cache" / "te_fused_ops" / "kernels"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert kernel_cache.cache_dir() == tmp_path / "xdg" / "te_fused_ops" / "kernels"


def test_trusted_shared_cache_writes_what_others_can_read(cache, monkeypatch, tmp_path):
    """Under TE_FUSED_OPS_KERNEL_CACHE_TRUST=1 the entries, locks and new directories are readable
    by the other users who load them (writable by the owner only), whatever the umask (a cluster's
    077 too); private otherwise."""
    path, _ = _entry(cache)
    with kernel_cache.entry_lock(path):
        pass
    assert os.stat(path).st_mode & 0o777 == 0o600 and os.stat(str(path) + ".lock").st_mode & 0o777 == 0o600
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE_TRUST", "1")
    shared = tmp_path / "team" / "shared" / "kernels"
    mask = os.umask(0o077)
    try:
        assert kernel_cache.directory_unsafe_reason(shared) is None
        path, payload = _entry(shared)
        with kernel_cache.entry_lock(path):
            pass
    finally:
        os.umask(mask)
    for directory in (tmp_path / "team", shared.parent, shared):
        assert os.stat(directory).st_mode & 0o777 == 0o755
    assert os.stat(path).st_mode & 0o777 == 0o644 and os.stat(str(path) + ".lock").st_mode & 0o777 == 0o644
    assert kernel_cache.read_entry(path, KEY)[1] == payload


def test_a_filesystem_without_flock_compiles_without_the_lock(cache, monkeypatch):
    import errno

    def no_flock(fd, operation):
        raise OSError(errno.ENOSYS, "Function not implemented")

    monkeypatch.setattr(kernel_cache.fcntl, "flock", no_flock)
    stand_in = _StandIn()
    assert _cached(stand_in)(3) == ("launcher", 3) and len(list(cache.glob("*.tfok"))) == 1


def test_a_complete_entry_loads_while_another_process_holds_its_lock(cache, monkeypatch):
    """Ranks starting on a warm cache do not queue behind one another's locks; on a miss a lock
    held past `LOCK_GIVE_UP_S` (a stopped holder) is given up with a warning, not waited on forever."""
    import fcntl

    _cached(_StandIn())(8)  # writes the entry
    (path,) = cache.glob("*.tfok")
    held = os.open(str(path) + ".lock", os.O_RDWR)
    try:
        fcntl.flock(held, fcntl.LOCK_EX)  # another open file: conflicts as another process's would
        stand_in = _StandIn()
        assert _cached(stand_in)(8) == ("launcher", 8) and (stand_in.compiles, stand_in.loads) == (0, 1)
        monkeypatch.setattr(kernel_cache, "LOCK_WARN_S", 0.05)
        monkeypatch.setattr(kernel_cache, "LOCK_GIVE_UP_S", 0.3)
        path.unlink()
        stand_in = _StandIn()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _cached(stand_in)(8) == ("launcher", 8)
        messages = " | ".join(str(w.message) for w in caught)
        assert "waiting for" in messages and "still held after" in messages
        assert stand_in.compiles == 1 and path.exists()
    finally:
        os.close(held)


def test_an_entry_written_while_waiting_for_the_lock_is_loaded_not_compiled(cache, monkeypatch):
    """Another process compiles and writes the entry while this one waits for the lock: this one
    loads it instead of compiling it again."""
    writer, waiter = _StandIn(), _StandIn()
    _cached(writer)(9)
    (path,) = cache.glob("*.tfok")
    written = path.read_bytes()
    path.unlink()
    take = kernel_cache._take_lock

    def take_after_the_other_wrote(fd, lock_path):
        entry = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(entry, written)
        os.close(entry)
        return take(fd, lock_path)

    monkeypatch.setattr(kernel_cache, "_take_lock", take_after_the_other_wrote)
    assert _cached(waiter)(9) == ("launcher", 9) and (waiter.compiles, waiter.loads) == (0, 1)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _hammer(path, payload_byte, rounds):
    for _ in range(rounds):
        kernel_cache.write_entry(pathlib.Path(path), KEY, bytes([payload_byte]) * 300_000, tvm_ffi=False, symbol="s")


def test_concurrent_writers_never_leave_a_torn_entry(cache):
    """Eight processes replace one entry over and over while this one reads it: every read is
    absent or whole (one writer's payload), never a mix."""
    path = cache / "shared.tfok"
    context = multiprocessing.get_context("fork")
    writers = [context.Process(target=_hammer, args=(str(path), b, 15)) for b in range(8)]
    for w in writers:
        w.start()
    seen = set()
    while any(w.is_alive() for w in writers):
        entry = kernel_cache.read_entry(path, KEY)
        if entry is not None:
            payload = entry[1]
            assert len(payload) == 300_000 and payload == payload[:1] * len(payload)
            seen.add(payload[0])
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert kernel_cache.read_entry(path, KEY) is not None
    assert not [p for p in os.listdir(cache) if p.endswith(".tmp")]


def test_compile_arguments_need_a_stable_key():
    with pytest.raises(TypeError, match="no stable key"):
        kernel_cache._canonical(object())
    import torch

    assert kernel_cache._canonical((torch.bfloat16, 2, "nk", None, True)) == "(torch.bfloat16,2,'nk',None,True)"


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
def test_compiled_kernel_is_loaded_back_not_recompiled(cache, monkeypatch):
    """Compile for sm_90a, write the entry, load it back as a new process would; a corrupted entry
    is recompiled and replaced; the key changes with the target architecture."""
    import torch

    from te_fused_ops.backends.sm90.kernels.split_offsets import compile_split_offsets

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    compile_split_offsets.cache_clear()
    start = compile_split_offsets.loaded_from_disk
    compiled = compile_split_offsets(torch.int64, tvm_ffi=False)
    assert compile_split_offsets(torch.int64, tvm_ffi=False) is compiled  # in memory
    (entry,) = cache.glob("*.tfok")
    compile_split_offsets.cache_clear()  # as a fresh process
    loaded = compile_split_offsets(torch.int64, tvm_ffi=False)
    assert loaded is not compiled and callable(loaded)
    assert compile_split_offsets.loaded_from_disk == start + 1

    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    compile_split_offsets.cache_clear()
    with pytest.warns(UserWarning, match="digest"):
        compile_split_offsets(torch.int64, tvm_ffi=False)
    assert compile_split_offsets.loaded_from_disk == start + 1  # recompiled
    compile_split_offsets.cache_clear()
    compile_split_offsets(torch.int64, tvm_ffi=False)  # the rewritten entry loads
    assert compile_split_offsets.loaded_from_disk == start + 2

    # another library or DSL version: another key, so the entry is not read and a new one written
    monkeypatch.setattr(kernel_cache, "build_identity", lambda: "another build")
    compile_split_offsets.cache_clear()
    compile_split_offsets(torch.int64, tvm_ffi=False)
    assert compile_split_offsets.loaded_from_disk == start + 2 and len(list(cache.glob("*.tfok"))) == 2
    monkeypatch.undo()
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE", "1")
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE_DIR", str(cache))

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    bound = compile_split_offsets.signature.bind(torch.int64, tvm_ffi=False)
    other = kernel_cache.entry_key(compile_split_offsets.fn, bound)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert kernel_cache.entry_key(compile_split_offsets.fn, bound) != other
    compile_split_offsets.cache_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("classic", [False, True], ids=["tvm_ffi", "classic"])
def test_loaded_kernel_launches_and_matches(cache, monkeypatch, classic):
    """A kernel loaded from its entry launches and computes what the compiled one did (both
    launcher forms), and the float64 reference."""
    import torch

    from te_fused_ops.backends.sm90.kernels import grouped_wgrad, launch

    if classic:
        monkeypatch.setattr(grouped_wgrad, "tvm_ffi_available", lambda: False)
    elif not launch.tvm_ffi_available():
        pytest.skip("TVM-FFI not installed")
    gen = torch.Generator(device="cuda").manual_seed(3)
    splits = [200, 0, 777, 64, 300]
    dy = torch.randn(sum(splits), 384, device="cuda", dtype=torch.bfloat16, generator=gen)
    x = torch.randn(sum(splits), 264, device="cuda", dtype=torch.bfloat16, generator=gen)
    offsets = torch.tensor([0, *torch.tensor(splits).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    start = grouped_wgrad.compile_grouped_wgrad.loaded_from_disk
    results = []
    warnings.simplefilter("error", UserWarning)  # a kernel not written or not loadable fails here
    for _ in range(2):  # compile and write, then load as a fresh process would
        monkeypatch.setattr(grouped_wgrad, "_LAUNCHERS", {})
        monkeypatch.setattr(grouped_wgrad, "_MEMO", launch.LaunchMemo())
        grouped_wgrad.compile_grouped_wgrad.cache_clear()
        out = torch.full((len(splits), 384, 264), float("nan"), device="cuda", dtype=torch.bfloat16)
        results.append(grouped_wgrad.grouped_wgrad_sm90(dy, x, offsets, out=out))
    assert grouped_wgrad.compile_grouped_wgrad.loaded_from_disk == start + 1
    assert torch.equal(results[0], results[1])
    for g, (lo, hi) in enumerate(zip(offsets[:-1].tolist(), offsets[1:].tolist())):
        ref = dy[lo:hi].double().T @ x[lo:hi].double()
        torch.testing.assert_close(results[1][g].double(), ref, rtol=2e-2, atol=2e-1)
    grouped_wgrad.compile_grouped_wgrad.cache_clear()


def test_precompile_needs_a_gpu_and_builds_the_layers(monkeypatch):
    import torch

    from te_fused_ops import GroupedLinear, Permute, Quantize, SwiGLU, Transpose, Unpermute, precompile

    args = precompile.parse_args("--experts 4 --hidden 64 --ffn 32 --moe --topk 2 --recipe fp8_blockwise".split())
    layer = precompile.build_layer(args, args.recipe[0], torch.device("cpu"))
    assert [type(op) for op in layer] == [Permute, Quantize, GroupedLinear, SwiGLU, Quantize, Transpose, GroupedLinear,
                                          Unpermute]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="needs the GPU the job runs on"):
        precompile.main("--experts 4 --hidden 64 --ffn 32".split())


def test_precompile_arguments(capsys):
    from te_fused_ops import precompile

    args = precompile.parse_args("--experts 4 --hidden 64 --ffn 32 --tokens 4096 --tokens 8192 1024".split())
    assert args.tokens == [4096, 8192, 1024] and args.jobs == 1
    assert precompile.parse_args("--experts 4 --hidden 64 --ffn 32".split()).tokens == [8192]
    for bad in ("--tokens -5", "--experts 0", "--ffn -1", "--moe --topk 0", "--jobs 0", "--hidden x"):
        argv = f"--experts 4 --hidden 64 --ffn 32 {bad}".split()
        with pytest.raises(SystemExit) as exit_info:
            precompile.parse_args(argv)
        assert exit_info.value.code == 2
        assert f"argument {bad.split()[-2] if bad.startswith('--moe') else bad.split()[0]}: must be a positive int" in \
            capsys.readouterr().err


def test_precompile_refuses_in_one_line_where_it_would_compile_nothing(cache, monkeypatch):
    """A GPU the sm90 kernels do not run on, a forced torch backend, a bad switch value, the cache
    off: one line each, no traceback, and no cache directory made when the cache is off."""
    import torch

    from te_fused_ops import precompile

    argv = "--experts 4 --hidden 64 --ffn 32".split()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    with pytest.raises(SystemExit, match=r"precompile: the sm90 kernels cannot run here \(.*8\.0, needs 9\.0\)"):
        precompile.main(argv)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    cases = [("TE_FUSED_OPS_BACKEND", "torch", "TE_FUSED_OPS_BACKEND=torch runs no sm90 kernel"),
             ("TE_FUSED_OPS_KERNEL_CACHE", "maybe", "TE_FUSED_OPS_KERNEL_CACHE"),
             ("TE_FUSED_OPS_KERNEL_CACHE_TRUST", "yes", "TE_FUSED_OPS_KERNEL_CACHE_TRUST")]
    for name, value, match in cases:
        with monkeypatch.context() as patch:
            patch.setenv(name, value)
            with pytest.raises(SystemExit, match="^te_fused_ops.precompile: .*" + match):
                precompile.main(argv)
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE", "0")
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE_DIR", str(cache / "not-made"))
    with pytest.raises(SystemExit, match="turns the cache off"):
        precompile.main(argv)
    assert not (cache / "not-made").exists()


def test_precompile_fails_where_compiled_kernels_were_not_written(cache, monkeypatch, capsys):
    import torch

    from te_fused_ops import precompile

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    monkeypatch.setattr(precompile, "build_layer", lambda *a: None)
    monkeypatch.setattr(precompile, "run_step", lambda *a: {})
    totals = {"compiled": 3, "written": 3, "loaded": 0, "compile s": 1.0, "write s": 0.1, "load s": 0.0}
    monkeypatch.setattr(kernel_cache, "stats", lambda: totals)
    assert precompile.main("--experts 4 --hidden 64 --ffn 32".split()) == 0
    assert "3 compiled, 3 written, 0 already there" in capsys.readouterr().out
    totals["written"] = 1
    assert precompile.main("--experts 4 --hidden 64 --ffn 32".split()) == 1
    assert "2 compiled kernels could not be written" in capsys.readouterr().out


@pytest.mark.gpu
def test_precompile_fills_the_cache_for_the_next_process(cache):
    """The second run of the command finds every kernel of the layer on disk."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "te_fused_ops.precompile", "--experts", "4", "--hidden", "256", "--ffn", "128",
               "--tokens", "512", "--moe", "--topk", "2", "--activation", "scaled_swiglu"]
    first = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600).stdout
    second = subprocess.run(command, check=True, capture_output=True, text=True, timeout=600).stdout
    assert " 0 already there" in first and ": 0 compiled" not in first
    assert ": 0 compiled, 0 written" in second and " 0 already there" not in second


class _StandIn:
    """A compile-only stand-in for a kernel-compiling function: ``compile(n, scale=1)`` returns a
    launcher object; ``export`` writes its bytes, ``load`` rebuilds it from them."""

    def __init__(self, fail_export=False, fail_load=False):
        self.compiles, self.loads = 0, 0
        self.fail_export, self.fail_load = fail_export, fail_load

    def compile(self, n, scale=1, tvm_ffi=None):
        self.compiles += 1
        return ("launcher", n * scale)

    def export(self, compiled, path, symbol, tvm_ffi):
        if self.fail_export:
            raise RuntimeError("exporter broke")
        path.write_bytes(json.dumps([symbol, compiled[1]]).encode())

    def load(self, path, symbol, tvm_ffi):
        if self.fail_load:
            raise RuntimeError("loader broke")
        self.loads += 1
        stored_symbol, value = json.loads(path.read_bytes())
        assert stored_symbol == symbol
        return ("launcher", value)


def _cached(stand_in):
    compile_fn = stand_in.compile

    def stand_in_compile(n, scale=1, tvm_ffi=None):
        return compile_fn(n, scale, tvm_ffi)

    return kernel_cache.DiskCachedCompile(stand_in_compile, stand_in.export, stand_in.load, lambda bound: False)


def test_stand_in_compile_is_written_once_and_loaded_after(cache):
    stand_in = _StandIn()
    cached = _cached(stand_in)
    assert cached(3, scale=2) == ("launcher", 6) and stand_in.compiles == 1
    assert cached(3, scale=2) == ("launcher", 6) and stand_in.compiles == 1  # memory
    cached.cache_clear()
    assert cached(3, 2) == ("launcher", 6)  # positional or keyword: one entry
    assert (stand_in.compiles, stand_in.loads) == (1, 1) and len(list(cache.glob("*.tfok"))) == 1
    assert cached(4) == ("launcher", 4) and stand_in.compiles == 2  # other arguments: another entry
    assert kernel_cache.stats()["loaded"] >= 1


def test_a_kernel_that_cannot_be_kept_or_loaded_still_runs(cache, monkeypatch):
    broken = _StandIn(fail_export=True)
    cached = _cached(broken)
    with pytest.warns(UserWarning, match="not written .*exporter broke"):
        assert cached(5) == ("launcher", 5)
    assert not list(cache.glob("*.tfok"))
    _cached(_StandIn())(6)  # writes the entry (every `_cached` function has the same key)
    unloadable = _StandIn(fail_load=True)
    cached = _cached(unloadable)
    with pytest.warns(UserWarning, match="not loadable .*loader broke"):
        assert cached(6) == ("launcher", 6)
    assert unloadable.compiles == 1


def test_cache_off_compiles_in_every_process(cache, monkeypatch):
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE", "0")
    stand_in = _StandIn()
    cached = _cached(stand_in)
    cached(7)
    cached.cache_clear()
    cached(7)
    assert stand_in.compiles == 2 and not list(cache.glob("*.tfok"))


class _Launcher:
    def __init__(self, value):
        self.value = value

    def __call__(self, offset=0):
        return self.value + offset


class _LaunchingStandIn(_StandIn):
    """`_StandIn` whose launchers are callables; ``fail_in_child``: compiling fails in any other
    process than the one that made it."""

    def __init__(self, fail_in_child=False):
        super().__init__()
        self.parent, self.fail_in_child = os.getpid(), fail_in_child

    def compile(self, n, scale=1, tvm_ffi=None):
        if self.fail_in_child and os.getpid() != self.parent:
            raise RuntimeError("compiler broke in the worker")
        self.compiles += 1
        return _Launcher(n * scale)

    def export(self, compiled, path, symbol, tvm_ffi):
        path.write_bytes(json.dumps([symbol, compiled.value]).encode())

    def load(self, path, symbol, tvm_ffi):
        self.loads += 1
        return _Launcher(json.loads(path.read_bytes())[1])


def test_recording_defers_missing_kernels_and_workers_write_them(cache):
    stand_in = _LaunchingStandIn()
    cached = _cached(stand_in)
    cached(4)  # already on disk: loaded and launched as usual while recording
    cached.cache_clear()
    with kernel_cache.recording() as requests:
        deferred = cached(3, scale=2)
        assert isinstance(deferred, kernel_cache.DeferredLauncher)
        assert deferred() is None  # not launched
        assert cached(3, 2) is not deferred  # another stand-in for the same request ...
        assert cached(4)() == 4
    assert len(requests) == 1 and stand_in.compiles == 1  # ... listed once; nothing compiled here
    report = kernel_cache.compile_in_workers(requests, workers=4)
    assert report["workers"] == 1 and report["failed workers"] == 0 and report["requests"] == 1
    assert len(list(cache.glob("*.tfok"))) == 2  # the worker wrote the entry
    loads = stand_in.loads
    assert deferred(offset=1) == 7 and deferred() == 6  # the first launch loads it, later ones reuse it
    assert stand_in.compiles == 1 and stand_in.loads == loads + 1


def test_a_failed_worker_leaves_the_kernel_to_the_first_launch(cache):
    stand_in = _LaunchingStandIn(fail_in_child=True)
    cached = _cached(stand_in)
    with kernel_cache.recording() as requests:
        deferred = cached(5)
    with pytest.warns(UserWarning, match="1 of 1 compile workers failed"):
        report = kernel_cache.compile_in_workers(requests, workers=2)
    assert report["failed workers"] == 1 and not list(cache.glob("*.tfok"))
    assert deferred() == 5 and stand_in.compiles == 1  # compiled here, at the first launch


class _VariantLauncher(_Launcher):
    def __call__(self):
        return self.value


class _VariantStandIn(_LaunchingStandIn):
    """Compiles (n, scale, pingpong): launchers that return (n * scale, which variant ran); in a
    worker the ping-pong compile waits for the file ``gate``, then fails with ``fail_pingpong``."""

    def __init__(self, gate, fail_pingpong=False):
        super().__init__()
        self.gate, self.fail_pingpong = gate, fail_pingpong

    def compile(self, n, scale=1, tvm_ffi=None, pingpong=False):
        if pingpong and os.getpid() != self.parent:
            while not self.gate.exists():
                time.sleep(0.01)
            if self.fail_pingpong:
                raise RuntimeError("ping-pong compile broke in the worker")
        self.compiles += 1
        return _VariantLauncher((n * scale, "pingpong" if pingpong else "cooperative"))

    def export(self, compiled, path, symbol, tvm_ffi):
        path.write_bytes(json.dumps([symbol, list(compiled.value)]).encode())

    def load(self, path, symbol, tvm_ffi):
        self.loads += 1
        return _VariantLauncher(tuple(json.loads(path.read_bytes())[1]))


def _with_stand_in(stand_in):
    compile_fn = stand_in.compile

    def variant_compile(n, scale=1, tvm_ffi=None, pingpong=False):
        return compile_fn(n, scale, tvm_ffi, pingpong)

    return kernel_cache.DiskCachedCompile(variant_compile, stand_in.export, stand_in.load, lambda bound: False,
                                          lambda bound: {"pingpong": False} if bound.arguments.get("pingpong") else None)


def _wait_until_compiled(request):
    deadline = time.monotonic() + 60
    while request.compiling_elsewhere and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not request.compiling_elsewhere


def test_a_kernel_with_a_stand_in_runs_the_stand_in_while_it_compiles_in_the_background(cache, tmp_path):
    """The ping-pong kernel and its cooperative stand-in are both listed; the stand-in is
    compiled and waited for, the ping-pong kernel is not (its worker is held at a gate): the
    launches run the stand-in, then the kernel once its worker has written it, loaded from disk."""
    gate = tmp_path / "gate"
    stand_in = _VariantStandIn(gate)
    cached = _with_stand_in(stand_in)
    with kernel_cache.recording() as requests:
        deferred = cached(3, pingpong=True)
        assert deferred() is None
    assert len(requests) == 2 and stand_in.compiles == 0
    try:
        report = kernel_cache.compile_in_workers(requests, workers=2)
        assert report["workers"] == 1 and report["background"] == 1 and report["failed workers"] == 0
        (kernel,) = [request for request in requests if request.stand_in is not None]
        assert kernel.compiling_elsewhere and len(list(cache.glob("*.tfok"))) == 1  # the stand-in only
        assert deferred() == (3, "cooperative") and deferred() == (3, "cooperative")
        assert not kernel_cache.wait_for_background(timeout_s=0.05)  # held at the gate
    finally:
        gate.touch()  # the worker goes on
    assert kernel_cache.wait_for_background(timeout_s=60)
    _wait_until_compiled(kernel)
    assert deferred() == (3, "pingpong") and deferred() == (3, "pingpong")
    assert stand_in.compiles == 0 and len(list(cache.glob("*.tfok"))) == 2  # both from the workers


@pytest.mark.filterwarnings("ignore:te_fused_ops kernel cache. a background compile failed")
def test_a_failed_background_compile_leaves_the_kernel_to_the_next_launch(cache, tmp_path):
    gate = tmp_path / "gate"
    gate.touch()
    stand_in = _VariantStandIn(gate, fail_pingpong=True)
    cached = _with_stand_in(stand_in)
    with kernel_cache.recording() as requests:
        deferred = cached(5, pingpong=True)
    kernel_cache.compile_in_workers(requests, workers=2)
    (kernel,) = [request for request in requests if request.stand_in is not None]
    _wait_until_compiled(kernel)
    assert deferred() == (5, "pingpong") and stand_in.compiles == 1  # compiled here


@pytest.mark.filterwarnings("ignore:te_fused_ops kernel cache. a background compile failed")
def test_background_compiles_do_not_outlive_the_process(cache, tmp_path):
    """At exit (`atexit`) a background compile still running is killed: its kernel is not
    written, its launcher compiles it when next launched."""
    stand_in = _VariantStandIn(tmp_path / "gate")  # the gate stays shut: the worker would wait forever
    cached = _with_stand_in(stand_in)
    with kernel_cache.recording() as requests:
        deferred = cached(9, pingpong=True)
    kernel_cache.compile_in_workers(requests, workers=1)
    (kernel,) = [request for request in requests if request.stand_in is not None]
    assert kernel.compiling_elsewhere and kernel_cache._BACKGROUND_PIDS
    kernel_cache._kill_background()
    _wait_until_compiled(kernel)
    assert not kernel_cache._BACKGROUND_PIDS and len(list(cache.glob("*.tfok"))) == 1
    assert deferred() == (9, "pingpong") and stand_in.compiles == 1


def test_a_stand_in_already_on_disk_is_loaded_not_listed(cache, tmp_path):
    stand_in = _VariantStandIn(tmp_path / "gate")
    cached = _with_stand_in(stand_in)
    cached(7)  # the cooperative kernel, written
    cached.cache_clear()
    with kernel_cache.recording() as requests:
        cached(7, pingpong=True)
    assert len(requests) == 1 and requests[0].stand_in is not None


def test_recording_with_the_cache_off_compiles_as_usual(cache, monkeypatch):
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE", "0")
    stand_in = _LaunchingStandIn()
    cached = _cached(stand_in)
    with kernel_cache.recording() as requests:
        assert cached(6)() == 6
    assert requests == [] and stand_in.compiles == 1
    with pytest.raises(RuntimeError, match="already active"), kernel_cache.recording(), kernel_cache.recording():
        pass


def test_compile_step_kernels_skips_without_a_cache(monkeypatch):
    from te_fused_ops import precompile

    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE", "0")
    ran = []
    assert "turns the cache off" in precompile.compile_step_kernels(lambda: ran.append(1))["skipped"] and not ran


@pytest.mark.skipif(importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed")
def test_compile_step_kernels_compiles_in_a_forked_worker(cache, monkeypatch):
    """A real kernel (sm_90a, cross-compiled): the step's compile is put off, a forked worker
    compiles and writes it, this process loads it at the next call instead of compiling."""
    import torch

    from te_fused_ops import precompile
    from te_fused_ops.backends.sm90.kernels.split_offsets import compile_split_offsets

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    compile_split_offsets.cache_clear()
    compiled, loaded = compile_split_offsets.compiled_here, compile_split_offsets.loaded_from_disk
    report = precompile.compile_step_kernels(lambda: compile_split_offsets(torch.int32, tvm_ffi=False), workers=2)
    assert report["requests"] == 1 and report["workers"] == 1 and report["failed workers"] == 0
    assert len(list(cache.glob("*.tfok"))) == 1 and compile_split_offsets.compiled_here == compiled
    assert callable(compile_split_offsets(torch.int32, tvm_ffi=False))
    assert compile_split_offsets.loaded_from_disk == loaded + 1 and compile_split_offsets.compiled_here == compiled
    compile_split_offsets.cache_clear()


def test_sm90_stand_ins_are_the_cooperative_and_narrow_twins():
    """A ping-pong kernel's stand-in is the cooperative one; a 16-bit weight gradient's is the
    cooperative 128-wide tile (FP8: only the ping-pong twin); a kernel already cooperative and
    narrow has none."""
    import torch

    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_dgrad_dact, compile_grouped_gemm
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad

    def twin(compiler, *args, **kwargs):
        return compiler.stand_in_of(compiler.signature.bind(*args, **kwargs))

    bf16 = torch.bfloat16
    assert twin(compile_grouped_gemm, bf16, 192, "swiglu", False, cluster_m=2, pingpong=True) == {"pingpong": False}
    assert twin(compile_grouped_gemm, bf16, 256, "swiglu", False, cluster_m=2) is None
    assert twin(compile_grouped_dgrad_dact, bf16, 192, "swiglu", pingpong=True) == {"pingpong": False}
    assert twin(compile_grouped_wgrad, bf16, 256, False, 2) == {"tile_n": 128}
    assert twin(compile_grouped_wgrad, bf16, 192, True, 2, pingpong=True) == {"pingpong": False, "tile_n": 128}
    assert twin(compile_grouped_wgrad, bf16, 128, False, 2) is None
    assert twin(compile_grouped_wgrad, bf16, 256, False, 2, fp8=True) is None
