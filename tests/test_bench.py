"""benchmarks/bench_grouped_mlp.py on the CPU: small shapes by default, progress, outputs outside tracked files."""

import importlib.util
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_grouped_mlp.py"


def load_bench():
    spec = importlib.util.spec_from_file_location("bench_grouped_mlp", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_default_is_small_and_writes_a_new_file(tmp_path):
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout
    assert "small shapes" in out
    assert "[1/2] small-a (M=512, H=256, I=128, E=8): fused" in out and "[2/2] small-b" in out
    assert "GFLOP/s" in out and "TFLOP/s" not in out
    written = sorted(p.name for p in tmp_path.iterdir())
    assert len(written) >= 1 and written[0].startswith("grouped_mlp_cpu_small_") and written[0].endswith(".json")


def test_default_output_folder_is_ignored_by_git():
    bench = load_bench()
    runs = pathlib.Path(bench.RUNS).relative_to(ROOT)
    assert runs.parts[:2] == ("benchmarks", "results")
    ignored = subprocess.run(["git", "check-ignore", "-q", str(runs / "x.json")], cwd=ROOT)
    assert ignored.returncode == 0, f"{runs} is not git-ignored"


def test_table_columns_stay_apart_for_slow_runs():
    bench = load_bench()
    row = dict(shape="mixtral-8x7b", mode="unfused", forward_ms=8311.336, backward_ms=16461.26, fwd_bwd_ms=24772.595,
               fwd_TFLOPS=0.0012, bwd_TFLOPS=0.0013, fwd_bwd_TFLOPS=0.00125, saved_for_backward_MiB=3584.0,
               peak_fwd_bwd_MiB=None)
    lines = bench.table([row, dict(row, mode="fused", forward_ms=1.5)], gflops=True).splitlines()
    assert len({len(line) for line in lines}) == 1  # fixed width
    assert lines[2].split()[2:6] == ["8311.336", "16461.260", "24772.595", "1.2"]
    assert "fwd GFLOP/s" in lines[0]


def test_rotated_medians_cancel_a_first_position_bonus():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
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
