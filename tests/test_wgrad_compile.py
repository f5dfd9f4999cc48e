"""The sm90 grouped wgrad kernel compiles for sm_90a without a GPU; host-side checks of its wrapper."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from te_fused_ops.backends.sm90.kernels.grouped_wgrad import choose_config, grouped_wgrad_sm90, sm90_wgrad_unsupported_reason

needs_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)


@pytest.fixture(autouse=True)
def _sm90a(monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")


@needs_cutlass
@pytest.mark.parametrize("dtype,tile_n,main_grad,cluster_m", [  # with test_wgmma_batching's two: each pair once
    (torch.bfloat16, 128, False, 1), (torch.float16, 256, True, 1), (torch.float16, 128, False, 2),
])
def test_wgrad_compiles(dtype, tile_n, main_grad, cluster_m):
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad

    assert compile_grouped_wgrad(dtype, tile_n, main_grad, cluster_m, tvm_ffi=False) is not None


@needs_cutlass
def test_wgrad_compiles_unsorted():
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad

    fn = compile_grouped_wgrad(torch.bfloat16, 256, False, 2, tvm_ffi=False, sort_groups=False)
    assert fn is not None


@needs_cutlass
@pytest.mark.parametrize("main_grad", [False, True])
def test_wgrad_kernel_configs_fit(main_grad):
    import cutlass

    from te_fused_ops.backends.sm90.kernels.grouped_wgrad_sm90 import GroupedWgradSm90

    for tile_n in (128, 192, 256):
        kern = GroupedWgradSm90(cutlass.BFloat16, tile_n, main_grad)
        assert kern.ab_stages >= 3 and kern.epi_slots >= 2
        assert kern.varlen_k and kern.defer_stores != main_grad  # dW: deferred stores; main_grad: a C-tile load
        if main_grad:
            assert kern.c_stages >= 2
    with pytest.raises(ValueError, match="tile_n"):
        GroupedWgradSm90(cutlass.BFloat16, 320, main_grad)
    with pytest.raises(ValueError, match="cluster_m"):
        GroupedWgradSm90(cutlass.BFloat16, 256, main_grad, cluster_m=4)
    with pytest.raises(ValueError, match="shared memory"):
        GroupedWgradSm90(cutlass.BFloat16, 256, main_grad, ab_stages=8)


def test_wrapper_imports_without_cutlass():
    code = (
        "import sys, te_fused_ops.backends.sm90.kernels.grouped_wgrad as w; "
        "assert 'cutlass' not in sys.modules, 'cutlass imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@needs_cutlass
def test_unsupported_reasons():
    why = sm90_wgrad_unsupported_reason
    assert why(torch.bfloat16, 4096, 7168) is None
    assert why(torch.float16, 8, 8) is None
    assert "dtype float32" in why(torch.float32, 64, 64)
    assert "N=100" in why(torch.bfloat16, 100, 64)
    assert "K=36" in why(torch.bfloat16, 64, 36)


def test_choose_config():
    assert choose_config(4096, 7168, 132) == (256, 2)
    assert choose_config(128, 128, 132) == (128, 1)
    assert choose_config(2048, 768, 1) == (256, 1)
    assert choose_config(5760, 2880, 132) == (192, 2)  # K = 2880: 15 tiles of 192, no padding
    assert choose_config(2880, 1408, 132) == (256, 2)  # K = 1408 pads both widths alike


def test_cpu_inputs_rejected():
    dy = torch.zeros(16, 8, dtype=torch.bfloat16)
    off = torch.tensor([0, 16], dtype=torch.int32)
    with pytest.raises(ValueError, match="grouped_wgrad_sm90: dy must be on a CUDA device"):
        grouped_wgrad_sm90(dy, dy, off)
    with pytest.raises(TypeError, match="grouped_wgrad_sm90: dy"):
        grouped_wgrad_sm90(dy.float(), dy, off)
    with pytest.raises(TypeError, match="grouped_wgrad_sm90: dy must be a torch.Tensor"):
        grouped_wgrad_sm90([1.0], dy, off)


@needs_cutlass
@pytest.mark.parametrize("main_grad,cluster_m", [(True, 1)])  # test_wgmma_batching compiles (False, 2)
def test_fp8_wgrad_compiles(main_grad, cluster_m):
    import cutlass

    from te_fused_ops.backends.sm90.kernels.grouped_wgrad import FP8_MAX_GROUPS, compile_grouped_wgrad
    from te_fused_ops.backends.sm90.kernels.group_tile_scheduler import SORT_MAX_G
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad_sm90 import GroupedWgradSm90

    assert compile_grouped_wgrad(torch.bfloat16, 128, main_grad, cluster_m, tvm_ffi=False, fp8=True) is not None
    assert FP8_MAX_GROUPS == SORT_MAX_G
    assert GroupedWgradSm90(cutlass.BFloat16, 128, main_grad, ab_dtype=cutlass.Float8E4M3FN).ab_stages >= 4
    with pytest.raises(ValueError, match="FP8 operands need tile_n 128, 192 or 256"):
        GroupedWgradSm90(cutlass.BFloat16, 64, main_grad, ab_dtype=cutlass.Float8E4M3FN)


@needs_cutlass
@pytest.mark.parametrize("from_rows, rows, power_2_scales", [(False, True, True), (True, False, False),
                                                          (False, False, True)])
def test_block_columns_compile(from_rows, rows, power_2_scales):
    from te_fused_ops.backends.sm90.kernels.block_quantize import COLUMN_MAX_GROUPS, compile_block_columns
    from te_fused_ops.backends.sm90.kernels.block_quantize_sm90 import COLUMN_SCAN_GROUPS

    assert compile_block_columns(torch.bfloat16, from_rows, rows, power_2_scales, tvm_ffi=False) is not None
    assert COLUMN_MAX_GROUPS == COLUMN_SCAN_GROUPS


def test_fp8_wrappers_reject_cpu_inputs():
    from te_fused_ops.backends.sm90.kernels.block_quantize import BlockColumns, block_columns_sm90
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_fp8_sm90

    off = torch.tensor([0, 16], dtype=torch.int32)
    cols = BlockColumns(torch.zeros(16, 256, dtype=torch.float8_e4m3fn), torch.ones(2, 16), 16)
    with pytest.raises(ValueError, match="grouped_wgrad_fp8_sm90: dy_columns.data must be on a CUDA device"):
        grouped_wgrad_fp8_sm90(cols, cols, off)
    with pytest.raises(ValueError, match="block_columns_sm90: x must be a contiguous 2-D CUDA tensor"):
        block_columns_sm90(torch.zeros(16, 16, dtype=torch.bfloat16), off)


@needs_cutlass
def test_wgrad_pingpong_compiles():
    from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad

    assert compile_grouped_wgrad(torch.bfloat16, 192, False, 2, tvm_ffi=False, pingpong=True) is not None
