"""Every ```python block of README.md runs, in order and in one namespace (like notebook cells),
in a fresh interpreter. Blocks whose first line is ``# gpu-only`` run only where CUDA is available;
those that import transformer_engine only where it imports too."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GPU_ONLY = "# gpu-only"
HAS_TE = importlib.util.find_spec("transformer_engine") is not None


def runs_here(code: str) -> bool:
    if not code.startswith(GPU_ONLY):
        return True
    return torch.cuda.is_available() and (HAS_TE or "import transformer_engine" not in code)


def python_blocks(text: str):
    """(first line number, code) of each ```python block."""
    for match in re.finditer(r"^```python\n(.*?)^```$", text, flags=re.M | re.S):
        yield text.count("\n", 0, match.start(1)) + 1, match.group(1)


def test_readme_has_cpu_and_gpu_blocks():
    blocks = [code for _, code in python_blocks(README.read_text())]
    assert any(not code.startswith(GPU_ONLY) for code in blocks)
    assert any(code.startswith(GPU_ONLY) for code in blocks)


def test_readme_python_blocks_run():
    # each block is compiled with the README line as its name, so a traceback points into README.md
    script = "\n".join(
        f"exec(compile({code!r}, 'README.md:{line}', 'exec'), namespace)"
        for line, code in python_blocks(README.read_text())
        if runs_here(code)
    )
    result = subprocess.run(
        [sys.executable, "-c", "namespace = {'__name__': '__main__'}\n" + script],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
