"""examples/moe_expert_parallel.py: the expert-parallel MoE layer matches its single-process
reference over 2 gloo processes, and reads nothing back to the host outside the library's CPU
group offsets (the routing's own check is in test_expert_parallel_ops.py)."""

import contextlib
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from spawn import spawn

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "moe_expert_parallel.py"
HOST_READS = ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__float__", "__index__")

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")


def load_example():
    spec = importlib.util.spec_from_file_location("moe_expert_parallel", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def no_host_reads(allowed=()):
    """Tensor methods that read values back to the host raise inside the block (on the CPU, a cheap
    stand-in for torch.cuda.set_sync_debug_mode("error")), unless called from a file under one of
    the ``allowed`` folders."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def guarded(name):
        def read(*args, **kwargs):
            if os.path.realpath(sys._getframe(1).f_code.co_filename).startswith(allowed):
                return saved[name](*args, **kwargs)
            raise AssertionError(f"host read: Tensor.{name}")

        return read

    for name in HOST_READS:
        setattr(torch.Tensor, name, guarded(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def test_example_passes_on_two_gloo_processes():
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--device", "cpu"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout, result.stdout
    dropped = re.search(r"dropped assignments: (\d+) of", result.stdout)
    assert dropped and int(dropped.group(1)) > 0, f"the default run should exercise the capacity:\n{result.stdout}"


def test_example_passes_with_one_expert_a_token():
    """Top-1: the router's renormalized probabilities are all 1, so its gradient is not compared."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--device", "cpu", "--top-k", "1"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout and "router grad" not in result.stdout, result.stdout


def _worker(rank, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ex = load_example()
        torch.manual_seed(0)
        layer = ex.ExpertParallelMoE(hidden=16, ffn=8, num_experts=4, top_k=2, capacity_factor=1.0)
        x = torch.randn(24, 16, requires_grad=True)
        # te_fused_ops reads the group offsets of CPU tensors (no device to sync with); its sync-free
        # GPU path is tested in its GPU tests, its expert-parallel routing in
        # test_expert_parallel_ops.py. Everything else here (the router and its backward) may read
        # nothing.
        with no_host_reads(allowed=tuple(str(ROOT / pkg) + "/" for pkg in ("te_fused_ops", "fusion_rules"))):
            y, dropped = layer(x)
            y.square().sum().backward()
        assert x.grad is not None and layer.router.gate.weight.grad is not None
        assert all(p.grad is not None for p in layer.experts.parameters())
        dist.barrier()  # no rank tears gloo down while its peer still runs a collective
    finally:
        dist.destroy_process_group()


def test_layer_forward_and_backward_read_nothing_on_the_host(tmp_path):
    spawn(_worker, (str(tmp_path / "init"),), 2)
