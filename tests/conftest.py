import os

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    needs = {"gpu": (1, "needs a CUDA GPU"), "multigpu": (2, "needs 2 CUDA GPUs")}
    for item in items:
        for marker, (count, reason) in needs.items():
            if marker in item.keywords and gpus < count:
                item.add_marker(pytest.mark.skip(reason=reason))
                break


# Tests compile what they test: no compiled kernel is read from (or written to) the user's cache;
# tests/test_kernel_cache.py turns it on in a temporary directory.
os.environ["TE_FUSED_OPS_KERNEL_CACHE"] = "0"


@pytest.fixture
def kernel_cache_dir(tmp_path, monkeypatch):
    """An empty kernel cache directory (mode 0700), in use for the test; autotuning off."""
    directory = tmp_path / "kernels"
    directory.mkdir(mode=0o700)
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE", "1")
    monkeypatch.setenv("TE_FUSED_OPS_KERNEL_CACHE_DIR", str(directory))
    monkeypatch.delenv("TE_FUSED_OPS_KERNEL_CACHE_TRUST", raising=False)
    monkeypatch.delenv("TE_FUSED_OPS_AUTOTUNE", raising=False)
    return directory
