"""Run the GPU test files of this directory in parallel pytest processes, one file each.

    python tests/gpu_suite.py [--jobs 9] [--timeout 560] [--logs DIR] [FILE ...]

Every file ``test_*_gpu.py`` (or the FILEs given) runs as ``python -m pytest -m gpu -q FILE`` in a
process of its own, ``--jobs`` at a time, each stopped after ``--timeout`` seconds; the output
of each goes to ``DIR/<file>.log`` (default: a temporary directory, printed), and one line per
file is printed as it ends, then a summary. The exit status is 0 only if every file passed.
Multi-GPU files (``test_expert_parallel_gpu.py``, ``test_multigpu.py``) and the Transformer
Engine file are left out unless named. On a machine without a Hopper GPU every test skips.
"""

import argparse
import concurrent.futures
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
NOT_BY_DEFAULT = ("test_expert_parallel_gpu.py", "test_multigpu.py", "test_te_integration_gpu.py")


def run_file(path: str, logs: str, timeout: float) -> tuple[str, int, float, str]:
    """(file name, pytest's exit status or 124 on timeout, seconds, pytest's last line)."""
    name = os.path.basename(path)
    started = time.perf_counter()
    with open(os.path.join(logs, name.removesuffix(".py") + ".log"), "w") as log:
        try:
            command = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", path]
            code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=os.path.dirname(HERE)).returncode
        except subprocess.TimeoutExpired:
            code = 124
    with open(log.name) as log:
        lines = [line.strip() for line in log if line.strip()]
    last = lines[-1] if lines else ""
    return name, code, time.perf_counter() - started, "timed out" if code == 124 else last


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*",
                        help="test files (default: every test_*_gpu.py but the multi-GPU and TE ones)")
    parser.add_argument("--jobs", type=int, default=9)
    parser.add_argument("--timeout", type=float, default=560.0, help="seconds per file")
    parser.add_argument("--logs", default=None, help="directory for the logs (default: a new temporary one)")
    args = parser.parse_args(argv)
    files = args.files or sorted(os.path.join(HERE, f) for f in os.listdir(HERE)
                                 if f.startswith("test_") and f.endswith("_gpu.py") and f not in NOT_BY_DEFAULT)
    logs = args.logs or tempfile.mkdtemp(prefix="gpu_suite_")
    os.makedirs(logs, exist_ok=True)
    print(f"{len(files)} files, {args.jobs} at a time, logs in {logs}", flush=True)
    results = []
    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        running = [pool.submit(run_file, f, logs, args.timeout) for f in files]
        for done in concurrent.futures.as_completed(running):
            name, code, seconds, last = done.result()
            results.append((name, code))
            passed = code in (0, 5)  # 5: nothing selected by -m gpu
            print(f"{'ok  ' if passed else 'FAIL'} {name:48s} {seconds:6.0f} s  {last}", flush=True)
    failed = sorted(name for name, code in results if code not in (0, 5))
    print(f"{len(results) - len(failed)} of {len(results)} files passed"
          + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
