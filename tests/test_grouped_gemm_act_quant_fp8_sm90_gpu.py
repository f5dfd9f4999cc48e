"""GPU tests of the FP8 forward GroupGemm + GLU activation + E4M3 cast epilogue
(`grouped_gemm_act_quant_fp8_sm90`): pre equals the FP8 kernel's at tile 256, and the E4M3 act and
its 1x128 scales equal, bit for bit, the torch quantizer applied to the act that kernel writes;
with ``columns`` the per-group column-wise copy too, bit for bit ``block_columns_sm90`` of that act
(NaN-poisoned outputs). The FP8 kernel itself is checked against float64 in
test_grouped_gemm_fp8_sm90_gpu.py."""

import math

import pytest
import torch
from test_block_columns_sm90_gpu import check_columns, poison, used_blocks
from test_block_quantize_sm90_gpu import assert_same_bytes
from test_grouped_gemm_act_quant_sm90_gpu import check_cast
from test_grouped_gemm_fp8_sm90_gpu import quantized_operands
from test_grouped_gemm_sm90_gpu import ALPHA, LIMIT, offsets_from_splits

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_gemm_act_quant_fp8_sm90, grouped_gemm_fp8_sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]


def run_case(splits, m, k, n, activation, dtype=torch.bfloat16, has_bias=False, cluster_m=None, seed=0,
             power_2_scales=False, columns=False, row_scale=None):
    """``row_scale`` (M,) multiplies the rows of x before its cast (acts over many binades)."""
    torch.manual_seed(seed)
    g = len(splits)
    x = torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 4
    if row_scale is not None:
        x = x * row_scale[:, None]
    contrast = 4.0 ** (torch.arange(n, device="cuda") // 128 % 3)  # W blocks 1x / 4x / 16x apart
    w = torch.randn(g, n, k, device="cuda") / math.sqrt(k) * contrast[:, None]
    bias = torch.randn(g, n, device="cuda").to(dtype) if has_bias else None
    probs = torch.rand(m, device="cuda") if activation == "scaled_swiglu" else None
    offsets = offsets_from_splits(splits)
    xq, xs, wq, ws, _, _ = quantized_operands(x, w)
    kwargs = dict(bias=bias, activation=activation, probs=probs, limit=LIMIT, alpha=ALPHA, out_dtype=dtype,
                  cluster_m=cluster_m)
    pre_out = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    poison(m, n // 2, g)
    outputs = grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, offsets, out=pre_out, power_2_scales=power_2_scales,
                                              columns=columns, **kwargs)
    assert len(outputs) == 3 + columns
    assert outputs[0].data_ptr() == pre_out.data_ptr()
    want_pre, want_act = grouped_gemm_fp8_sm90(xq, xs, wq, ws, offsets, tile_n=256, **kwargs)
    assert torch.equal(outputs[0], want_pre)
    check_cast(outputs, want_act, offsets, power_2_scales)


UNEVEN = [130, 0, 257, 1, 300, 312]
COLUMN_SPLITS = [0, 1, 127, 0, 129, 300, 13, 256]  # groups ending inside and on 128-row blocks


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu", "clamped_swiglu", "geglu"])
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_epilogues(activation, cluster_m, power_2_scales):
    """I = 256 (two n-tiles), K of three scale blocks (the last partial), 0 and 1-row groups."""
    run_case(UNEVEN, 1000, 320, 512, activation, has_bias=activation == "swiglu", cluster_m=cluster_m,
             power_2_scales=power_2_scales)


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu"])
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_columns(activation, cluster_m, power_2_scales):
    """+ Transpose: rows and the per-group column-wise copy; I = 384 (three n-tiles), 40 padding rows."""
    run_case(COLUMN_SPLITS, sum(COLUMN_SPLITS) + 40, 256, 768, activation, cluster_m=cluster_m,
             power_2_scales=power_2_scales, columns=True)


@pytest.mark.parametrize("power_2_scales", [False, True])
def test_rows_over_many_binades_fp16(power_2_scales):
    """Rows of x scaled 2**-30 .. 2**10 (acts over twice as many binades): small power-of-two
    scales; fp16 outputs."""
    row_scale = torch.exp2(torch.linspace(-30, 10, 700, device="cuda"))
    run_case([300, 0, 400], 700, 128, 256, "swiglu", dtype=torch.float16, power_2_scales=power_2_scales,
             row_scale=row_scale, columns=True)


def test_no_host_sync_and_cuda_graph():
    torch.manual_seed(1)
    m, k, n, g = 512, 256, 256, 4
    xq, xs, wq, ws, _, _ = quantized_operands(torch.randn(m, k, device="cuda"),
                                              torch.randn(g, n, k, device="cuda") / 16)
    offsets = offsets_from_splits([100, 200, 0, 150])
    grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu", columns=True)  # compile first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu", columns=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    pre_buf = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu", out=pre_buf,
                                                   columns=True)
    for splits in ([100, 200, 0, 150], [0, 0, 512, 0], [10, 20, 30, 40]):
        offsets.copy_(offsets_from_splits(splits))
        graph.replay()
        eager = grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, offsets, activation="swiglu", columns=True)
        torch.cuda.synchronize()
        assert torch.equal(pre_buf, eager[0])
        assert_same_bytes(captured[1], eager[1])
        assert torch.equal(captured[2], eager[2])
        check_columns(captured[3], eager[3], used_blocks(offsets, m))


def test_argument_errors():
    xq = torch.zeros(64, 128, device="cuda").to(torch.float8_e4m3fn)
    wq = torch.zeros(2, 256, 128, device="cuda").to(torch.float8_e4m3fn)
    xs, ws = torch.ones(64, 1, device="cuda"), torch.ones(2, 2, 1, device="cuda")
    off = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    name = "grouped_gemm_act_quant_fp8_sm90"
    grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, off, activation="swiglu")  # a valid call first
    with pytest.raises(ValueError, match=f"{name}: activation must be a GLU activation"):
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, off, activation="srelu")
    with pytest.raises(ValueError, match=f"{name}: activation must be a GLU activation"):
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, off, activation=None)
    with pytest.raises(ValueError, match=f"{name}: N=384 .* multiple of 256"):
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq.new_zeros(2, 384, 128), ws.new_ones(2, 3, 1), off,
                                        activation="swiglu")
    with pytest.raises(TypeError, match=f"{name}: x has dtype"):
        grouped_gemm_act_quant_fp8_sm90(xq.bfloat16(), xs, wq, ws, off, activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: weight_scale_inv must have shape"):
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws[:, :1].contiguous(), off, activation="swiglu")
    with pytest.raises(TypeError, match=f"{name}: out_dtype"):
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, off, activation="swiglu", out_dtype=torch.float32)
    with pytest.raises(TypeError, match=f"{name}: power_2_scales must be a bool"):
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, off, activation="swiglu", power_2_scales=1)
    with pytest.raises(TypeError, match=f"{name}: columns must be a bool"):
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, off, activation="swiglu", columns="yes")
    with pytest.raises(ValueError, match=f"{name}: probs"):
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, off, activation="scaled_swiglu")
    with pytest.raises(ValueError, match=f"{name}: out must have shape"):
        grouped_gemm_act_quant_fp8_sm90(xq, xs, wq, ws, off, activation="swiglu",
                                        out=torch.empty(64, 128, dtype=torch.bfloat16, device="cuda"))
