"""Every ```python block of README.md runs on its own, in a fresh interpreter, as a reader would
paste it: nothing is shared between blocks. Blocks whose first line is ``# gpu-only`` run only where
CUDA is available; those that import transformer_engine only where it imports too."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GPU_ONLY = "# gpu-only"
HAS_TE = importlib.util.find_spec("transformer_engine") is not None


def python_blocks(text: str):
    """(first line number, code) of each ```python block."""
    for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.M | re.S):
        yield text.count("\n", 0, match.start(1)) + 1, match.group(1)


def skip_reason(code: str):
    """None where the block runs here, else why not."""
    if not code.startswith(GPU_ONLY):
        return None
    if not torch.cuda.is_available():
        return "gpu-only block, no CUDA device"
    if "transformer_engine" in code and not HAS_TE:
        return "needs transformer_engine"
    return None


BLOCKS = list(python_blocks(README.read_text()))


def test_readme_has_cpu_and_gpu_blocks():
    assert any(not code.startswith(GPU_ONLY) for _, code in BLOCKS)
    assert any(code.startswith(GPU_ONLY) for _, code in BLOCKS)


@pytest.mark.parametrize("line,code", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_block_runs_alone(line, code):
    reason = skip_reason(code)
    if reason:
        pytest.skip(reason)
    # compiled with the README line as its name, so a traceback points into README.md
    script = f"exec(compile({code!r}, 'README.md:{line}', 'exec'), {{'__name__': '__main__'}})"
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, f"README.md:{line}\n{result.stderr[-4000:]}"
