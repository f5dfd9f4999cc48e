"""Every sm90 kernel configuration compiles for sm_90a without a GPU (CUTE_DSL_ARCH=sm_90a)."""

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)


@pytest.fixture(autouse=True)
def _sm90a(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


def test_package_imports_without_cutlass_use():
    import te_fused_ops.kernels as k

    assert k.sm90_unavailable_reason() is None  # with CUTE_DSL_ARCH=sm_90a


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("has_bias", [False, True])
@pytest.mark.parametrize(
    "activation", [None, "swiglu", "geglu", "srelu", "clamped_swiglu", "scaled_swiglu"]
)
def test_grouped_gemm_compiles(activation, has_bias, tile_n, dtype):
    from te_fused_ops.kernels.grouped_gemm import compile_grouped_gemm

    assert os.environ["CUTE_DSL_ARCH"] == "sm_90a"
    fn = compile_grouped_gemm(dtype, tile_n, activation, has_bias, 132, tvm_ffi=False)
    assert fn is not None


@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize(
    "activation", [None, "swiglu", "geglu", "srelu", "clamped_swiglu", "scaled_swiglu"]
)
def test_grouped_gemm_compiles_without_cluster(activation, tile_n):
    from te_fused_ops.kernels.grouped_gemm import compile_grouped_gemm

    fn = compile_grouped_gemm(torch.bfloat16, tile_n, activation, True, 132, False, 1)
    assert fn is not None


def test_one_activation_list():
    from te_fused_ops.kernels import grouped_gemm, grouped_gemm_sm90

    assert grouped_gemm_sm90.ACTIVATIONS is grouped_gemm.ACTIVATIONS
    assert grouped_gemm_sm90.GLU_ACTIVATIONS is grouped_gemm.GLU_ACTIVATIONS


def test_unsupported_reasons():
    from te_fused_ops.kernels.grouped_gemm import sm90_grouped_gemm_unsupported_reason as why

    assert why(torch.bfloat16, 4096, 2048, "swiglu", True) is None
    assert why(torch.float16, 8, 8, None, False) is None
    assert "dtype float32" in why(torch.float32, 64, 64, None, False)
    assert "K=100" in why(torch.bfloat16, 64, 100, None, False)
    assert "N=100" in why(torch.bfloat16, 100, 64, None, False)
    assert "N=96" in why(torch.bfloat16, 96, 64, "swiglu", False)
    assert why(torch.bfloat16, 96, 64, "srelu", False) is None
