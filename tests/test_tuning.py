"""Per-shape launch configurations: the autotuner keeps only candidates whose outputs equal the
default's bit for bit, stores the winner beside the cached kernels, and later lookups (and
processes) use it; a table that fails the trust checks or names a non-candidate is ignored."""

import json
import os

import pytest
import torch

from te_fused_ops.backends.sm90.kernels import tuning


@pytest.fixture
def cache(kernel_cache_dir, monkeypatch):
    monkeypatch.setattr(tuning, "_table", None)
    return kernel_cache_dir


def fake_run(wrong=(), calls=None):
    """A kernel whose output is the same for every config except those in ``wrong``."""
    def run(config):
        config = tuning.LaunchConfig(*config)
        if calls is not None:
            calls.append(config)
        value = 1.0 if config in wrong else 0.0
        return torch.full((4,), value), None
    return run


def cfg(tile_n, cluster_m, pingpong=False, deep_operands=False):
    return tuning.LaunchConfig(tile_n, cluster_m, pingpong, deep_operands)


def test_tune_keeps_the_fastest_equal_candidate(monkeypatch):
    times = {cfg(128, 1): 3.0, cfg(128, 2): 1.0, cfg(192, 1): 5.0, cfg(192, 2): 6.0, cfg(256, 1): 2.0,
             cfg(256, 2): 4.0, cfg(128, 1, True): 7.0, cfg(128, 2, True): 8.0, cfg(192, 1, True): 9.0,
             cfg(192, 2, True): 0.5}
    monkeypatch.setattr(tuning, "_median_ms", lambda fn: times[fn.__defaults__[0]])
    assert tuning.tune(fake_run(), cfg(256, 2)) == cfg(128, 2)
    assert tuning.tune(fake_run(wrong={cfg(128, 2)}), cfg(256, 2)) == cfg(256, 1)  # the fastest differs by a bit
    assert tuning.tune(fake_run(wrong={cfg(128, 1), cfg(128, 2), cfg(256, 1)}), cfg(256, 2)) == cfg(256, 2)
    # the ping-pong candidates where the kernel has them
    everything = tuning.CANDIDATES + tuning.PINGPONG_CANDIDATES
    assert tuning.tune(fake_run(), cfg(192, 2, True), everything) == cfg(192, 2, True)
    assert tuning.tune(fake_run(wrong={cfg(192, 2, True)}), cfg(256, 2), everything) == cfg(128, 2)
    # and, for the kernels loading C tiles, deep operand stages
    times.update({cfg(128, 1, True, True): 7.5, cfg(128, 2, True, True): 8.5, cfg(192, 1, True, True): 9.5,
                  cfg(192, 2, True, True): 0.25})
    deep = everything + tuning.DEEP_OPERAND_CANDIDATES
    assert tuning.tune(fake_run(), cfg(256, 2), deep) == cfg(192, 2, True, True)
    assert tuning.tune(fake_run(wrong={cfg(192, 2, True, True)}), cfg(256, 2), deep) == cfg(192, 2, True)


def test_deep_operand_candidates_are_the_ping_pong_ones():
    assert tuning.DEEP_OPERAND_CANDIDATES == tuple(
        tuning.LaunchConfig(t, c, True, True) for t in tuning.PINGPONG_TILE_NS for c in (1, 2))


def test_stored_choice_is_used_and_survives_the_process(cache, monkeypatch):
    monkeypatch.setattr(tuning, "_median_ms", lambda fn: {cfg(128, 1): 1.0}.get(fn.__defaults__[0], 2.0))
    dims = (torch.bfloat16, 8, 512, 256, 4096, "swiglu")
    calls = []
    assert tuning.tuned_config("fwd", dims, fake_run(calls=calls), (256, 2)) is None  # not autotuning: heuristic
    assert not calls
    monkeypatch.setenv("TE_FUSED_OPS_AUTOTUNE", "1")
    assert tuning.tuned_config("fwd", dims, fake_run(calls=calls), (256, 2)) == cfg(128, 1)
    assert calls  # tuned on the spot
    stored = json.loads((cache / tuning.TABLE_NAME).read_text())
    assert list(stored.values()) == [[128, 1, False, False]]
    monkeypatch.setenv("TE_FUSED_OPS_AUTOTUNE", "0")
    monkeypatch.setattr(tuning, "_table", None)  # as a new process
    calls.clear()
    assert tuning.tuned_config("fwd", dims, fake_run(calls=calls), (256, 2)) == cfg(128, 1)
    assert not calls
    other = (torch.bfloat16, 8, 512, 256, 8192, "swiglu")  # another row bucket: another class
    assert tuning.tuned_config("fwd", other, fake_run(), (256, 2)) is None


def test_recording_records_every_candidate_and_stores_nothing(cache, monkeypatch):
    """Inside `kernel_cache.recording()` (precompile --jobs) nothing launches: every candidate runs
    once so its kernel is recorded for the workers, nothing is tuned or stored, and no launch is
    memoized, so the first real call tunes."""
    from te_fused_ops import kernel_cache
    from te_fused_ops.backends.sm90.kernels.launch import LaunchMemo

    monkeypatch.setenv("TE_FUSED_OPS_AUTOTUNE", "1")
    monkeypatch.setattr(tuning, "tune", lambda *a: pytest.fail("tuned while recording"))
    calls, memo = [], LaunchMemo()
    with kernel_cache.recording():
        config = tuning.tuned_config("fwd", (torch.bfloat16, 8, 512, 256, 4096), fake_run(calls=calls), (256, 2))
        memo.put(("signature",), "launch")
    assert config is None and calls == list(tuning.CANDIDATES)
    assert not (cache / tuning.TABLE_NAME).exists() and tuning.table() == {} and not memo
    memo.put(("signature",), "launch")
    assert memo == {("signature",): "launch"}


def test_untrusted_or_bad_table_is_ignored(cache, monkeypatch):
    dims = (torch.bfloat16, 8, 512, 256, 4096, None)
    key = tuning.problem_key("fwd", *dims)
    path = cache / tuning.TABLE_NAME
    path.write_text(json.dumps({key: [192, 2, True, False]}))
    os.chmod(path, 0o600)
    assert tuning.table() == {key: (192, 2, True, False)}
    for bad in ([256, 2, True, False],  # not a candidate: no ping-pong at 256
                [256, 2, False, True],  # deep operand stages are ping-pong ones
                [192, 2, True]):  # a table of the kernels before deep operand stages
        path.write_text(json.dumps({key: bad}))
        monkeypatch.setattr(tuning, "_table", None)
        assert tuning.table() == {}, bad
    path.write_text(json.dumps({key: [128, 1, False, False]}))
    os.chmod(path, 0o666)
    monkeypatch.setattr(tuning, "_table", None)
    with pytest.warns(UserWarning, match="not trusted"):
        assert tuning.table() == {}
    os.chmod(path, 0o600)
    path.write_text("{not json")
    monkeypatch.setattr(tuning, "_table", None)
    with pytest.warns(UserWarning, match="not JSON"):
        assert tuning.table() == {}
    path.write_text("[" * 100_000)
    monkeypatch.setattr(tuning, "_table", None)
    with pytest.warns(UserWarning, match="not JSON"):
        assert tuning.table() == {}


def test_a_table_that_cannot_be_written_keeps_the_choice_in_memory(cache, monkeypatch):
    """A cache directory that refuses new files (read-only, or a shared one): a warning, and the
    tuned choice still holds in this process."""
    monkeypatch.setattr(tuning, "_median_ms", lambda fn: {cfg(128, 1): 1.0}.get(fn.__defaults__[0], 2.0))
    monkeypatch.setenv("TE_FUSED_OPS_AUTOTUNE", "1")

    def refuse(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tuning.tempfile, "mkstemp", refuse)
    dims = (torch.bfloat16, 8, 512, 256, 4096, "swiglu")
    with pytest.warns(UserWarning, match="not written .*Operation not permitted"):
        assert tuning.tuned_config("fwd", dims, fake_run(), (256, 2)) == cfg(128, 1)
    assert tuning.tuned_config("fwd", dims, fake_run(), (256, 2)) == cfg(128, 1)
    assert not (cache / tuning.TABLE_NAME).exists()


def test_rows_bucket():
    assert [tuning.rows_bucket(m) for m in (1, 2, 3, 1000, 1024, 1025)] == [1, 2, 4, 1024, 1024, 2048]


def _mlp_operands(seed: int, i: int):
    """x, dy (3000, 512), W1 (8, 2i, 512), W2 (8, 512, i) bf16 and uneven offsets (an empty group)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g, h, m = 8, 512, 3000
    x = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    dy = torch.randn(m, h, device="cuda", dtype=torch.bfloat16, generator=gen)
    w1 = torch.randn(g, 2 * i, h, device="cuda", dtype=torch.bfloat16, generator=gen) / h**0.5
    w2 = torch.randn(g, h, i, device="cuda", dtype=torch.bfloat16, generator=gen) / i**0.5
    offsets = torch.tensor([0, 100, 100, 900, 1300, 2000, 2100, 2900, 2950], device="cuda", dtype=torch.int32)
    return x, dy, w1, w2, offsets


def _check_tuned_on_the_spot(step, families, cache, monkeypatch):
    """``step()``'s outputs with every class tuned on the spot equal the heuristic's bit for bit,
    the table holds one entry per kernel family of ``families``, and a new process's lookup uses
    it without tuning again."""
    from te_fused_ops.backends.sm90.kernels import grouped_gemm, grouped_wgrad

    def fresh_memos():
        monkeypatch.setattr(grouped_gemm, "_MEMO", grouped_gemm.LaunchMemo())
        monkeypatch.setattr(grouped_wgrad, "_MEMO", grouped_wgrad.LaunchMemo())

    default = step()
    monkeypatch.setenv("TE_FUSED_OPS_AUTOTUNE", "1")
    fresh_memos()
    assert all(torch.equal(a, b) for a, b in zip(default, step()))
    stored = json.loads((cache / tuning.TABLE_NAME).read_text())
    assert len(stored) == len(families) and {k.split("|")[0] for k in stored} == set(families)
    monkeypatch.setattr(tuning, "tune", lambda *a: pytest.fail("tuned twice"))
    monkeypatch.setattr(tuning, "_table", None)
    fresh_memos()
    assert all(torch.equal(a, b) for a, b in zip(default, step()))


@pytest.mark.gpu
def test_autotuned_kernels_equal_the_default(cache, monkeypatch):
    """Forward, dgrad + dAct and wgrad tuned on the spot: results bit-equal to the heuristic's, one
    table entry per class, and a later lookup launches the stored choice without tuning."""
    from te_fused_ops.backends.sm90.kernels import grouped_gemm, grouped_wgrad

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 kernels need a Hopper GPU")
    x, dy, w1, w2, offsets = _mlp_operands(5, 384)

    def step():
        pre, act = grouped_gemm.grouped_gemm_sm90(x, w1, offsets, activation="swiglu")
        d_pre, act2, _ = grouped_gemm.grouped_dgrad_dact_sm90(dy, w2, offsets, pre, activation="swiglu")
        return [pre, act, d_pre, act2, grouped_wgrad.grouped_wgrad_sm90(dy, act2, offsets)]

    _check_tuned_on_the_spot(step, ("grouped_gemm_sm90", "grouped_dgrad_dact_sm90", "grouped_wgrad_sm90"), cache,
                             monkeypatch)


@pytest.mark.gpu
def test_autotuned_fp8_kernels_equal_the_default(cache, monkeypatch):
    """The FP8 forward, dgrad + dAct and weight gradient tuned on the spot: results (the act amax
    too) bit-equal to the heuristic's, one table entry per class, no second tuning."""
    from te_fused_ops.backends.sm90.kernels import grouped_gemm, grouped_wgrad
    from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90, block_quantize_sm90

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm90 kernels need a Hopper GPU")
    x, dy, w1, w2, offsets = _mlp_operands(6, 256)
    x_fp8, dy_fp8 = block_quantize_sm90(x, 1), block_quantize_sm90(dy, 1)
    w1_fp8 = block_quantize_sm90(w1, 128)
    w2_t_fp8 = block_quantize_sm90(w2, 128, transposed=True)[2:]

    def step():
        pre, act, parts = grouped_gemm.grouped_gemm_fp8_sm90(*x_fp8, *w1_fp8, offsets, activation="swiglu",
                                                             act_amax=True)
        d_pre, _ = grouped_gemm.grouped_dgrad_dact_fp8_sm90(*dy_fp8, *w2_t_fp8, offsets, pre, activation="swiglu")
        dw = grouped_wgrad.grouped_wgrad_fp8_sm90(block_columns_sm90(dy, offsets), block_columns_sm90(act, offsets),
                                                  offsets)
        return [pre, act, parts.amax(), d_pre, dw]

    _check_tuned_on_the_spot(step, ("grouped_gemm_fp8_sm90", "grouped_dgrad_dact_fp8_sm90", "grouped_wgrad_fp8_sm90"),
                             cache, monkeypatch)


def test_fp8_candidates():
    assert tuning.fp8_candidates() == tuple(  # every tile takes any N (a GLU's halves need not be whole W blocks)
        tuning.LaunchConfig(t, c) for t in (128, 192, 256) for c in (1, 2))
    assert tuning.fp8_candidates(tile_ns=(128, 256)) == tuple(
        tuning.LaunchConfig(t, c) for t in (128, 256) for c in (1, 2))
