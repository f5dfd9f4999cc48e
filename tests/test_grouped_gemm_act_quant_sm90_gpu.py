"""GPU tests of the forward GroupGemm (+ GLU activation) + E4M3 cast epilogue: the E4M3 activation
(or, without an activation, GEMM output) and its 1x128 scales equal, bit for bit, the torch
quantizer applied to the bf16/fp16 tensor that the plain kernel writes; pre equals the plain
kernel's. With ``columns`` (+ Transpose) the per-group column-wise copy too, bit for bit
``block_columns_sm90`` of that tensor (NaN-poisoned outputs)."""

import pytest
import torch
from test_block_columns_sm90_gpu import check_columns, poison, used_blocks
from test_block_quantize_sm90_gpu import assert_same_bytes
from test_grouped_gemm_sm90_gpu import ALPHA, LIMIT, offsets_from_splits

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_gemm_act_quant_sm90, grouped_gemm_sm90
from te_fused_ops.quantization import Float8BlockScaling, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]


def run_case(splits, m, k, n, activation, dtype=torch.bfloat16, has_bias=False, weight_layout="nk", cluster_m=None,
             seed=0, power_2_scales=False, row_scale=None, tile_n=None, columns=False):
    """``row_scale`` (M,) multiplies the rows of x (tiny rows: subnormal-sized scales)."""
    torch.manual_seed(seed)
    g = len(splits)
    x = torch.randn(m, k, device="cuda") * torch.rand(m, 1, device="cuda") * 4
    x = (x if row_scale is None else x * row_scale[:, None]).to(dtype)
    w = (torch.randn(g, n, k, device="cuda") / k**0.5).to(dtype)
    if weight_layout == "kn":
        w = w.transpose(1, 2).contiguous()
    bias = torch.randn(g, n, device="cuda").to(dtype) if has_bias else None
    probs = torch.rand(m, device="cuda") if activation == "scaled_swiglu" else None
    offsets = offsets_from_splits(splits)
    kwargs = dict(bias=bias, activation=activation, probs=probs, limit=LIMIT, alpha=ALPHA, weight_layout=weight_layout,
                  cluster_m=cluster_m)
    pre_out = None if activation is None else torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
    if columns:
        poison(m, n // 2 if activation else n, g)
    outputs = grouped_gemm_act_quant_sm90(x, w, offsets, out=pre_out, power_2_scales=power_2_scales, tile_n=tile_n,
                                          columns=columns, **kwargs)
    pre = outputs[0]
    assert len(outputs) == 3 + columns
    want_pre, want_act = grouped_gemm_sm90(x, w, offsets, tile_n=256, **kwargs)
    if activation is None:  # the cast output is the GEMM output; no pre written
        assert pre is None
        want_act = want_pre
    else:
        assert torch.equal(pre, want_pre)
    check_cast(outputs, want_act, offsets, power_2_scales)


def check_cast(outputs, want_act, offsets, power_2_scales):
    """A cast epilogue's (..., data, scale_inv[, `BlockColumns`]) bit for bit the torch quantizer's
    rows and `block_columns_sm90`'s columns of ``want_act``; rows past offsets[G] zero, scales 1."""
    data, scale_inv = outputs[1:3]
    want = quantize(want_act, Float8BlockScaling(power_2_scales=power_2_scales))
    if len(outputs) == 4:
        want_columns = block_columns_sm90(want_act, offsets, power_2_scales=power_2_scales)
        check_columns(outputs[3], want_columns, used_blocks(offsets, want_act.shape[0]))
    end = int(offsets[-1])
    assert torch.equal(scale_inv, want.rowwise_scale_inv)
    assert_same_bytes(data, want.rowwise_data)
    assert torch.all(data[end:].float() == 0) and torch.all(scale_inv[end:] == 1)


UNEVEN = [130, 0, 257, 1, 300, 312]


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu", "clamped_swiglu", "geglu"])
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_epilogues(activation, cluster_m, power_2_scales):
    run_case(UNEVEN, 1000, 256, 512, activation, has_bias=activation == "swiglu", cluster_m=cluster_m,
             power_2_scales=power_2_scales)


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("n", [192, 320])  # I = 96: one partial block; I = 160: a full and a partial one
def test_partial_blocks(n, power_2_scales):
    run_case([200, 0, 300], 600, 128, n, "swiglu", power_2_scales=power_2_scales)


@pytest.mark.parametrize("power_2_scales", [False, True])
def test_rows_over_many_binades(power_2_scales):
    """Rows scaled 2**-60 .. 2**20 (act ~ x**2: 2**-120 .. 2**40), so power-of-two scales run from
    below 2**-100 (the two-multiplier path) to far above 1."""
    row_scale = torch.exp2(torch.linspace(-60, 20, 700, device="cuda"))
    run_case([300, 0, 400], 700, 128, 256, "swiglu", power_2_scales=power_2_scales, row_scale=row_scale)


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("tile_n,cluster_m", [(128, 1), (128, 2), (256, 1), (256, 2)])
def test_without_activation(tile_n, cluster_m, power_2_scales):
    """The GEMM output itself cast (GroupGemm + Quantize); at tile_n 256 each tile row holds two
    scale blocks. N = 320: the last n-tile's second block (tile 256) lies past N, and N = 200 ends
    in a partial block."""
    run_case(UNEVEN, 1000, 256, 320, None, has_bias=True, tile_n=tile_n, cluster_m=cluster_m,
             power_2_scales=power_2_scales)
    run_case([7, 0, 13, 1, 600], 700, 64, 200, None, tile_n=tile_n, cluster_m=cluster_m, power_2_scales=power_2_scales)


@pytest.mark.parametrize("power_2_scales", [False, True])
def test_without_activation_over_many_binades(power_2_scales):
    row_scale = torch.exp2(torch.linspace(-120, 40, 700, device="cuda"))
    run_case([300, 0, 400], 700, 128, 512, None, power_2_scales=power_2_scales, row_scale=row_scale)


def test_without_activation_fp16_in_place_layout_and_padding_rows():
    run_case([400, 0, 500], 1000, 128, 256, None, dtype=torch.float16, weight_layout="kn", seed=4)


def test_fp16_and_weight_in_place_layout():
    run_case(UNEVEN, 1000, 128, 256, "swiglu", dtype=torch.float16, weight_layout="kn")


def test_large_values_and_padding_rows():
    # activations far above E4M3's 448 before scaling, and 100 padding rows
    run_case([400, 500], 1000, 64, 256, "swiglu", seed=3)


COLUMN_SPLITS = [0, 1, 127, 0, 129, 300, 13, 256]  # groups ending inside and on 128-row blocks


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu", "clamped_swiglu", "geglu"])
@pytest.mark.parametrize("cluster_m", [1, 2])
def test_columns(activation, cluster_m, power_2_scales):
    """+ Transpose: rows and the per-group column-wise copy; I = 256 (two n-tiles), 40 padding rows."""
    run_case(COLUMN_SPLITS, sum(COLUMN_SPLITS) + 40, 256, 512, activation, has_bias=activation == "swiglu",
             cluster_m=cluster_m, power_2_scales=power_2_scales, columns=True)


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("tile_n,cluster_m", [(128, 1), (128, 2), (256, 1), (256, 2)])
def test_columns_without_activation(tile_n, cluster_m, power_2_scales):
    """GroupGemm + Quantize + Transpose: one or two blocks per tile (N = 384: the last 256-wide
    tile's second block lies past N), fp16 and the in-place weight layout too."""
    run_case(COLUMN_SPLITS, sum(COLUMN_SPLITS) + 3, 128, 384, None, has_bias=True, cluster_m=cluster_m,
             power_2_scales=power_2_scales, columns=True, tile_n=tile_n)
    run_case([400, 0, 500], 1000, 128, 256, None, dtype=torch.float16, weight_layout="kn", seed=4, columns=True,
             power_2_scales=power_2_scales, tile_n=tile_n)


def test_columns_over_many_binades_and_large_values():
    row_scale = torch.exp2(torch.linspace(-60, 20, 700, device="cuda"))
    run_case([300, 0, 400], 700, 128, 256, "swiglu", row_scale=row_scale, columns=True)
    run_case([400, 500], 1000, 64, 256, "swiglu", seed=3, columns=True, dtype=torch.float16)


@pytest.mark.parametrize("columns", [False, True])
def test_no_host_sync_and_cuda_graph(columns):
    torch.manual_seed(1)
    m, k, n = 512, 128, 256
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, n, k, device="cuda", dtype=torch.bfloat16) / 8
    offsets = offsets_from_splits([100, 200, 0, 150])
    grouped_gemm_act_quant_sm90(x, w, offsets, activation="swiglu", columns=columns)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_gemm_act_quant_sm90(x, w, offsets, activation="swiglu", columns=columns)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = grouped_gemm_act_quant_sm90(x, w, offsets, activation="swiglu", columns=columns)
    for splits in ([100, 200, 0, 150], [0, 0, 512, 0], [10, 20, 30, 40]):
        offsets.copy_(offsets_from_splits(splits))
        graph.replay()
        eager = grouped_gemm_act_quant_sm90(x, w, offsets, activation="swiglu", columns=columns)
        torch.cuda.synchronize()
        for a, b in zip(outputs[:3], eager[:3]):
            assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                               b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
        if columns:  # the blocks the groups use (the others are not written)
            check_columns(outputs[3], eager[3], used_blocks(offsets, m))


def test_argument_errors():
    x = torch.zeros(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.zeros(2, 256, 128, device="cuda", dtype=torch.bfloat16)
    off = torch.tensor([0, 32, 64], dtype=torch.int32, device="cuda")
    name = "grouped_gemm_act_quant_sm90"
    with pytest.raises(ValueError, match=f"{name}: activation must be None or a GLU activation"):
        grouped_gemm_act_quant_sm90(x, w, off, activation="srelu")
    with pytest.raises(ValueError, match=f"{name}: tile_n must be 256 with activation 'swiglu'"):
        grouped_gemm_act_quant_sm90(x, w, off, activation="swiglu", tile_n=128)
    with pytest.raises(ValueError, match=f"{name}: out .* needs an activation"):
        grouped_gemm_act_quant_sm90(x, w, off, activation=None, out=x.new_zeros(64, 256))
    with pytest.raises(TypeError, match=f"{name}: weight has dtype"):
        grouped_gemm_act_quant_sm90(x, w.half(), off, activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: out must have shape"):
        grouped_gemm_act_quant_sm90(x, w, off, activation="swiglu", out=x.new_zeros(64, 128))
    with pytest.raises(ValueError, match=f"{name}: 96 cast columns, not a multiple of 128"):
        grouped_gemm_act_quant_sm90(x, w[:, :192].contiguous(), off, activation="swiglu", columns=True)
    with pytest.raises(TypeError, match=f"{name}: columns must be a bool"):
        grouped_gemm_act_quant_sm90(x, w, off, activation="swiglu", columns=1)
    many = torch.zeros(514, dtype=torch.int32, device="cuda")
    with pytest.raises(ValueError, match=f"{name}: 513 groups, more than 512"):
        grouped_gemm_act_quant_sm90(x, torch.zeros(513, 256, 128, device="cuda", dtype=torch.bfloat16), many,
                                    activation="swiglu", columns=True)
