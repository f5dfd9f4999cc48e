"""The benchmarks on a CPU: bench_grouped_mlp.py runs (small shapes by default, progress, outputs
outside tracked files, columns that say what they measure); every other benchmark needs an sm_90
GPU and says so in one line instead of a traceback; bench_moe_layer.py's routing and contenders
run here on a tiny shape (eager math)."""

import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_grouped_mlp.py"
CPU_BENCHMARKS = {"bench_grouped_mlp.py"}  # every other benchmarks/bench_*.py needs a Hopper GPU
GPU_ONLY = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py") if p.name not in CPU_BENCHMARKS)


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_grouped_mlp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    return common


def test_cpu_default_is_small_and_writes_the_documented_file(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--iters", "2", "--warmup", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert "small shapes" in out and "step = gradients set to None, forward, backward" in out
    assert "[1/2] small-a (M=512, H=256, I=128, E=8): fused step" in out and "[2/2] small-b" in out
    assert "GFLOP/s" in out and "TFLOP/s" not in out
    header = next(line for line in out.splitlines() if line.startswith("shape"))
    assert "step ms" in header and "step min..max ms" in header and "f+b" not in header
    # benchmarks/results/runs/grouped_mlp_<device>_<date>.json (bench_grouped_mlp.py's docstring)
    written = sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".json")
    assert len(written) == 1 and re.fullmatch(r"grouped_mlp_cpu_\d{8}-\d{6}\.json", written[0]), written
    data = json.loads((tmp_path / written[0]).read_text())
    assert data["throughput_unit"] == "GFLOP/s" and data["step"] == "gradients set to None, forward, backward"
    for row in data["results"]:
        for what in ("fwd", "bwd", "step"):
            assert row[f"{what}_ms_min"] <= row[f"{what}_ms"] <= row[f"{what}_ms_max"]
            assert f"{what}_GFLOPS" in row and f"{what}_TFLOPS" not in row
        # the step holds its forward and backward (each iteration's parts add up to at most its step)
        assert row["step_ms_max"] >= row["fwd_ms_min"] + row["bwd_ms_min"]
        assert {"saved_MiB", "peak_MiB"} <= set(row)


def test_default_output_folder_is_ignored_by_git():
    bench = load_bench()
    runs = pathlib.Path(bench.RUNS).relative_to(ROOT)
    assert runs.parts[:2] == ("benchmarks", "results")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(runs / "x.json")], cwd=ROOT)
    assert ignored.returncode == 0, f"{runs} is not git-ignored"


def test_table_columns_stay_apart_for_slow_runs():
    bench = load_bench()
    row = dict(shape="mixtral-8x7b", mode="unfused", fwd_ms=8311.336, bwd_ms=16461.26, step_ms=24772.595,
               step_ms_min=24000.5, step_ms_max=25999.25, fwd_GFLOPS=1.2, bwd_GFLOPS=1.3, step_GFLOPS=1.25,
               saved_MiB=3584.0, peak_MiB=None)
    lines = bench.table([row, dict(row, mode="fused", fwd_ms=1.5)], "GFLOP/s").splitlines()
    assert len({len(line) for line in lines}) == 1  # fixed width
    assert lines[2].split()[2:7] == ["8311.336", "16461.260", "24772.595", "24000.500..25999.250", "1.2"]
    assert "fwd GFLOP/s" in lines[0] and "step GFLOP/s" in lines[0] and "TFLOP/s" not in lines[0]


def test_table_reads_the_cuda_unit_from_its_own_keys():
    bench = load_bench()
    row = dict(shape="dsv3-ep8", mode="fused", fwd_ms=4.0, bwd_ms=9.0, step_ms=13.0, step_ms_min=12.9,
               step_ms_max=13.2, fwd_TFLOPS=600.0, bwd_TFLOPS=610.0, step_TFLOPS=605.0, saved_MiB=10.0, peak_MiB=4096.0)
    header, _, line = bench.table([row], "TFLOP/s").splitlines()
    assert "step TFLOP/s" in header and line.split()[6:9] == ["600.0", "610.0", "605.0"]


@pytest.mark.skipif(load_common()._sm90_usable(), reason="an sm_90 GPU is here: the GPU benchmarks would run")
@pytest.mark.parametrize("script", GPU_ONLY)
def test_gpu_only_benchmark_says_so_in_one_line(script):
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script)], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    lines = (result.stdout + result.stderr).splitlines()
    assert lines == [f"{script}: needs a CUDA GPU with sm_90"], lines
    assert result.returncode == 2



@pytest.mark.parametrize("script", ["bench_moe_layer.py", "bench_fc1_sm90.py", "bench_casts_sm90.py",
                                    "bench_quack_step.py", "bench_te_ops.py"])
def test_gpu_benchmark_help_reads_without_a_gpu(script):
    """The options of the commands the docs quote are readable on a machine without the GPU (or
    triton); the others exit as above only when they would run."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--help"], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0 and "needs a CUDA GPU" not in result.stderr, result.stderr[-500:]
    assert result.stdout.strip()


@pytest.mark.parametrize("kernels", [True, False])
def test_gpu_benchmarks_exit_where_the_sm90_backend_cannot_run(kernels, monkeypatch, capsys):
    """An sm_90 GPU without the CuTe DSL importable (a PYTHONPATH that lost it): the benchmarks of
    this library's kernels exit with the reason instead of timing its torch backend; quack's
    (``kernels=False``) go on."""
    import te_fused_ops.backends.sm90.kernels as sm90_kernels

    common = load_common()
    monkeypatch.setattr(common, "_sm90_usable", lambda: True)
    monkeypatch.setattr(sm90_kernels, "sm90_unavailable_reason", lambda: "sm90 backend: nvidia-cutlass-dsl not importable")
    if not kernels:
        common.require_sm90("bench_quack_step.py", kernels=False)
        return
    with pytest.raises(SystemExit) as stop:
        common.require_sm90("bench_moe_layer.py")
    assert stop.value.code == 2
    assert capsys.readouterr().err.splitlines() == ["bench_moe_layer.py: sm90 backend: nvidia-cutlass-dsl not importable"]


def test_the_gpu_only_list_is_not_empty():
    assert len(GPU_ONLY) >= 10 and "bench_train_step.py" in GPU_ONLY


def test_rotated_medians_cancel_a_first_position_bonus():
    common = load_common()
    cost = {"a": 10.0, "b": 10.0, "c": 12.0}
    last = []

    def time_us(label):  # a run after nothing or after itself (a rested GPU) gets a 3 us bonus
        fresh = not last or last[-1] == label
        last.append(label)
        return cost[label] - (3.0 if fresh else 0.0)

    times = common.rotated_medians({k: k for k in cost}, time_us)
    assert set(times) == set(cost)
    assert times["a"] == times["b"] and times["c"] > times["a"]  # no variant keeps the bonus
    assert sum(label == "a" for label in last) == 1 + 2 * 3  # warm-up pass, then 2N rounds


def load_moe_layer(monkeypatch):
    """benchmarks/bench_moe_layer.py as a module (its `from common import ...` needs benchmarks/)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_moe_layer", ROOT / "benchmarks" / "bench_moe_layer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_moe_layer_routing_is_skewed_top_k_and_deterministic(monkeypatch):
    bench = load_moe_layer(monkeypatch)
    indices, probs = bench.skewed_topk(4096, 4, 16)
    again, _ = bench.skewed_topk(4096, 4, 16)
    assert torch.equal(indices, again) and indices.dtype == torch.int64 and probs.dtype == torch.float32
    assert ((indices >= 0) & (indices < 16)).all()
    assert (indices.sort(-1).values.diff(dim=-1) > 0).all()  # k distinct experts per token
    assert torch.allclose(probs.sum(-1), torch.ones(4096)) and (probs.diff(dim=-1) <= 0).all()  # top first
    counts = torch.bincount(indices.flatten(), minlength=16)
    assert counts.max() > 3 * counts.min()  # skewed, not uniform


def test_moe_layer_torch_permute_is_a_permutation(monkeypatch):
    bench = load_moe_layer(monkeypatch)
    t, k, e = 50, 3, 6
    indices, _ = bench.skewed_topk(t, k, e)
    x = torch.randn(t, 8)
    routing, x_perm = bench.torch_permute(x, indices, e)
    flat = indices.flatten()
    assert torch.equal(routing.counts, torch.bincount(flat, minlength=e))
    assert routing.ends.dtype == torch.int32 and routing.ends[-1] == t * k
    assert (flat[routing.order].diff() >= 0).all()  # expert order
    assert torch.equal(routing.order[routing.rows.flatten()], torch.arange(t * k))  # rows: the inverse
    assert torch.equal(x_perm, x[routing.order // k])


def test_moe_layer_contenders_a_and_b_match_on_cpu(monkeypatch):
    """(a) plain torch and (b) the library's experts with torch permute/combine, with and without
    the router, on the CPU (eager math): each matches (a), and the saved-activation count holds
    (a)'s x_perm, pre, act and y_perm. (c) is left to the GPU run and the test below."""
    bench = load_moe_layer(monkeypatch)
    p = bench.make_problem("smoke", bench.SMOKE_SHAPES["smoke"], device="cpu")
    t, k, _, h, i = bench.SMOKE_SHAPES["smoke"]
    assert p.layer_flops() == 6 * t * k * h * i
    for runs, reference in ((bench.build_contenders(p, compiled=False, fused=False), "a"),
                            (bench.build_router_contenders(p, compiled=False, fused=False), "a+router")):
        assert len(runs) == 2
        checks = bench.check_contenders(runs, p.dy, reference)
        assert all(c["status"] == "ok" and c["max_rel_err"] < 1e-2 for c in checks.values()), checks
        assert checks[reference]["max_rel_err"] == 0
        assert set(checks[reference]["rel_err"]) == {"out", "dx", "dw1", "dw2", "dprobs" if reference == "a" else
                                                     "drouter"}
    runs = bench.build_contenders(p, compiled=False, fused=False)
    params = [p.fc1.weight, p.fc2.weight]
    saved, out = bench.saved_activation_bytes(runs["a"].forward, exclude=params + [p.x, p.probs])
    assert out.shape == (t, h)
    assert saved >= 2 * t * k * (h + 2 * i + i + h)  # x_perm, pre, act, y_perm in bf16
    with_inputs, _ = bench.saved_activation_bytes(runs["a"].forward, exclude=params)
    assert with_inputs == saved + p.probs.untyped_storage().nbytes()  # GatherCombine keeps the probs


def test_moe_layer_fused_contenders_match_on_cpu(monkeypatch):
    bench = load_moe_layer(monkeypatch)
    if bench.fused_ops() is None:
        pytest.skip("te_fused_ops has no Permute / Unpermute / TopKRouter yet")
    p = bench.make_problem("smoke", bench.SMOKE_SHAPES["smoke"], device="cpu")
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "0")
    layer_runs = bench.build_contenders(p, compiled=False, gather_rows=("wgrad", "1"))
    assert {"c", "c-rows-wgrad", "c-rows-1"} <= set(layer_runs)
    for runs, reference in ((layer_runs, "a"), (bench.build_router_contenders(p, compiled=False), "a+router")):
        checks = bench.check_contenders(runs, p.dy, reference)
        assert all(c["status"] == "ok" for c in checks.values()), checks
    seen = []
    layer_runs["c-rows-wgrad"].forward = bench.under_gather_rows("wgrad", lambda: seen.append(os.environ[
        "TE_FUSED_OPS_GATHER_ROWS"]))
    layer_runs["c-rows-wgrad"].forward()
    assert seen == ["wgrad"] and os.environ["TE_FUSED_OPS_GATHER_ROWS"] == "0"  # set for the forward alone


def test_moe_layer_fp8_contenders_match_and_cast_weights_once_per_four_steps(monkeypatch):
    """--recipe fp8_blockwise: the FP8 layer (weights cast every step) and its micro-batch form
    match (a) within TOL_FP8 on the CPU, and the micro-batch form is timed as an optimizer step of
    four micro-batches that casts the weights once."""
    bench = load_moe_layer(monkeypatch)
    if bench.fused_ops() is None:
        pytest.skip("te_fused_ops has no Permute / Unpermute / TopKRouter yet")
    from te_fused_ops import quantization

    p = bench.make_problem("smoke", (64, 2, 4, 128, 128), device="cpu")
    runs = bench.build_contenders(p, compiled=False, recipe="fp8_blockwise")
    assert {"c-fp8", "c-fp8-4mb"} <= set(runs)
    checks = bench.check_contenders({label: runs[label] for label in ("a", "c", "c-fp8", "c-fp8-4mb")}, p.dy, "a")
    assert all(c["status"] == "ok" for c in checks.values()), checks
    assert checks["c-fp8"]["max_rel_err"] > checks["c"]["max_rel_err"]  # E4M3 operands: not the bf16 layer
    casts = []
    real = quantization._quantize
    monkeypatch.setattr(quantization, "_quantize", lambda x, recipe, rowwise, columnwise, offsets, role, *rest: (
        casts.append(role) or real(x, recipe, rowwise, columnwise, offsets, role, *rest)))
    bench.timed_step(runs["c-fp8"], p.dy)()
    every_step = casts.count("weight")
    step = bench.timed_step(runs["c-fp8-4mb"], p.dy)
    assert step.micro_batches == bench.MICRO_BATCHES == 4
    per_step = []
    for _ in range(3):  # the first finds the copies the check made
        casts.clear()
        step()
        per_step.append(casts.count("weight"))
    # once per optimizer step: no more casts than one every-step micro-batch makes (its backward
    # casts again what its forward cast)
    assert per_step[0] == 0 and per_step[1] == per_step[2] and 0 < per_step[1] <= every_step, (every_step, per_step)


def test_step_profile_groups_launches_by_kernel_class(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_moe_layer_profile",
                                                  ROOT / "benchmarks" / "bench_moe_layer_profile.py")
    profile = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(profile)
    mangled = ("kernel_cutlass_kernel_te_fused_opsbackendssm90kernelsgrouped_dact_sm90GroupedGemmDActFp8Sm90"
               "_object_at__CopyAtom_ThrID")
    assert profile.kernel_class(mangled) == "GroupedGemmDActFp8Sm90"
    route = "kernel_cutlass_place_kernel_te_fused_opsbackendssm90kernelsroute_sm90RouteSm90_object_at__tensorptri64"
    assert profile.kernel_class(route) == "RouteSm90"
    assert profile.kernel_class("void at::native::indexFuncLargeIndex<c10::BFloat16>") == (
        "void at::native::indexFuncLargeIndex<c10::BFloat16>")
    results = [{"shape": "s", "contenders": {
        "c": {"kernel_ms": 1.5, "clocks": {"sm_mhz": 1500.0, "power_w": 699.0},
              "classes_us": {"GroupedGemmActSm90": 1400.0, "RouteSm90": 5.0}},
        "c-fp8": {"status": "mismatch"}}}]
    rows = profile.table("GPU", results).splitlines()
    assert rows[-2] == "| s | c | 1.500 | 1500 / 699 | GroupedGemmActSm90 1400 |"  # launches under 20 us left out
    assert rows[-1] == "| s | c-fp8 | mismatch | | |"


def test_timeline_counts_only_time_no_kernel_covers_as_idle():
    common = load_common()
    work = [(0.0, 10.0, "a"), (2.0, 14.0, "b"), (5.0, 8.0, "c"), (20.0, 25.0, "d"), (26.0, 30.0, "e")]
    t = common.timeline_of(work, gaps_listed=1)
    assert (t["span_us"], t["busy_us"], t["idle_us"], t["kernels"]) == (30.0, 23.0, 7.0, 5)
    assert t["gaps"] == [{"us": 6.0, "after": "b", "before": "d"}]
    assert [(launch["name"], launch["us"]) for launch in t["launches"]] == [
        ("a", 10.0), ("b", 12.0), ("c", 3.0), ("d", 5.0), ("e", 4.0)]
    assert common.timeline_of([])["kernels"] == 0 and common.timeline_of([])["launches"] == []
    assert common._short_kernel_name(
        "void at::native::vectorized_elementwise_kernel<4, at::native::F<long>(x)::{lambda(long)#1}>(int, y)"
    ) == "void at::native::vectorized_elementwise_kernel"
    assert common._short_kernel_name(
        "kernel_cutlass_kernel_te_fused_opsbackendssm90kernelsgrouped_act_sm90GroupedGemmActSm90_object"
    ) == "grouped_act_sm90GroupedGemmActSm90_object"


def test_clock_and_power_takes_medians_of_nvidia_smi_samples(tmp_path, monkeypatch):
    common = load_common()
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\nprintf '1500, 690.5, 700.00\\n1400, 692.0, 700.00\\nN/A, N/A, N/A\\n"
                    "1440, 691.0, 700.00\\n'\nexec sleep 5\n")
    fake.chmod(0o755)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    calls = []
    monkeypatch.setenv("PATH", str(tmp_path))
    clocks = common.clock_and_power(lambda: calls.append(1), seconds=0.3)
    assert clocks == {"sm_mhz": 1440.0, "power_w": 691.0, "power_limit_w": 700.0, "samples": 3} and calls
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert common.clock_and_power(lambda: None, seconds=0.01) == {}


def test_accumulation_step_runs_its_micro_batches_then_the_optimizer_step():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from common import accumulation_step, per_micro_batch
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    calls = []
    step = accumulation_step(lambda: calls.append("micro-batch"), lambda: calls.append("optimizer step"), 3)
    step()
    assert calls == ["micro-batch"] * 3 + ["optimizer step"]
    assert per_micro_batch(step, 6.0) == 2.0 and per_micro_batch(lambda: None, 6.0) == 6.0


def test_ep_layer_benchmark_smoke_on_two_gloo_processes(tmp_path):
    """bench_ep_layer.py --smoke: every contender (plain torch EP layer, the library dropless,
    static, chunked, FP8 with weights cast every step and once per 4 micro-batches) checked against
    plain torch on 2 gloo processes, the table written."""
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_ep_layer.py"), "--device", "cpu",
                             "--smoke", "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    payload = json.loads((tmp_path / "runs" / "ep_layer_cpux2_smoke.json").read_text())
    rows = payload["results"][0]["contenders"]
    assert {"torch", "lib", "lib static", "lib x2", "lib x4", "fp8", "fp8 4mb", "fp8 x2"} <= set(rows), sorted(rows)
    assert all(row["status"] == "ok" and "ms" in row for row in rows.values()), rows



def test_sass_loop_counts_split_each_batch_at_its_wait():
    """`sass_fp8_mainloop.py` counts the innermost loop holding the WGMMAs (not the tile loop
    around it), from each WARPGROUP.ARRIVE to its wait (issue) and from the wait on (promotion)."""
    spec = importlib.util.spec_from_file_location("sass_fp8_mainloop", ROOT / "benchmarks" / "sass_fp8_mainloop.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    body = ["WARPGROUP.ARRIVE ;", "QGMMA.64x128x32.F32.E4M3.E4M3 R24, gdesc[UR20], RZ ;", "IMAD R1, R2, R3, RZ ;",
            "WARPGROUP.DEPBAR.LE gsb0, 0x0 ;", "FFMA R4, R5, R6, R4 ;", "FFMA R7, R5, R6, R7 ;",
            "@!P0 SYNCS.ARRIVE.TRANS64.RED.A1T0 RZ, [R8+URZ], R9 ;"]
    sass = "\n".join([".L_x_1:", *(f"        /*{i:04x}*/                   {line}" for i, line in enumerate(body)),
                      ".L_x_2:", *(f"        /*{16 + i:04x}*/                   {line}" for i, line in enumerate(body)),
                      "        /*0040*/              @P1 BRA `(.L_x_2) ;",
                      "        /*0050*/                   BRA `(.L_x_1) ;"])
    ops = tool.innermost_gmma_loop(sass)
    assert len(ops) == len(body) + 1 and ops[0] == "WARPGROUP.ARRIVE" and ops[-1] == "BRA"
    assert tool.phases(ops) == [[3, 5, 2]]  # ARRIVE, QGMMA, IMAD | DEPBAR, 2 FFMA, SYNCS, BRA
