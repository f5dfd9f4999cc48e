"""GPU tests of ``grouped_dgrad_dact_quant_fp8_sm90``: FC2's FP8 data gradient + dActivation whose
d_pre leaves only as its row-wise and per-group column-wise 1x128 E4M3 copies. Bit for bit what the
unfused sm90 path makes (``grouped_dgrad_dact_fp8_sm90``'s bf16 d_pre, then ``block_columns_sm90``
with its rows) and the torch quantizer; NaN-poisoned outputs; sync-free; argument errors."""

import pytest
import torch
from test_block_columns_sm90_gpu import check_columns, used_blocks
from test_grouped_dgrad_dact_fp8_sm90_gpu import operands
from test_grouped_dgrad_sm90_gpu import ALPHA, LIMIT, offsets_from_splits
from test_grouped_wgrad_fp8_sm90_gpu import block_padded

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.activations import ACTIVATIONS
from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_dgrad_dact_fp8_sm90, grouped_dgrad_dact_quant_fp8_sm90
from te_fused_ops.quantization import Float8BlockScaling, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]

SPLITS = [0, 1, 127, 0, 129, 300, 13, 256]  # sum 826: groups ending inside and on 128-row blocks


def poison(m, c, g):
    """NaN bytes and multipliers where the wrapper's outputs will be allocated."""
    blocks = -(-m // 128) + g
    held = [torch.full((m * c,), 0xFF, dtype=torch.uint8, device="cuda"),
            torch.full((m, c // 128), float("nan"), device="cuda"),
            torch.full((c * 128 * blocks,), 0xFF, dtype=torch.uint8, device="cuda"),
            torch.full((blocks, c), float("nan"), device="cuda")]
    del held


def check(splits, m, h, i, activation, dtype=torch.bfloat16, power_2_scales=False, seed=0, **cfg):
    fp8, _, _, pre, probs = operands(splits, m, h, i, activation, dtype, seed)
    pre[m // 3] = float("nan")  # a NaN row of d_pre (and of its column blocks: they count as 0 in the amax)
    pre[m // 2, :7] = float("inf")
    offsets = offsets_from_splits(splits)
    kwargs = dict(activation=activation, probs=probs, limit=LIMIT, alpha=ALPHA, **cfg)
    d_pre, d_probs = grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, **kwargs)
    columns_want, rows_want, row_scale_want = block_columns_sm90(d_pre, offsets, rows=True,
                                                                 power_2_scales=power_2_scales)
    poison(m, pre.shape[1], len(splits))
    (rows, row_scale), columns, d_probs_q = grouped_dgrad_dact_quant_fp8_sm90(
        *fp8, offsets, pre, power_2_scales=power_2_scales, **kwargs)
    grouped, used = sum(splits), used_blocks(offsets, m)
    assert rows.shape == pre.shape and rows.dtype == torch.float8_e4m3fn
    assert torch.equal(rows.view(torch.uint8)[:grouped], rows_want.view(torch.uint8)[:grouped])
    assert torch.equal(row_scale[:grouped], row_scale_want[:grouped])
    check_columns(columns, columns_want, used)
    if ACTIVATIONS[activation].takes_probs:  # fp32 sums: ptxas may contract them differently per kernel
        scale = float(d_probs[d_probs.isfinite()].abs().max())
        torch.testing.assert_close(d_probs_q, d_probs, rtol=1e-5, atol=1e-5 * scale, equal_nan=True)
    else:
        assert d_probs_q is None
    return d_pre, offsets, (rows, row_scale), columns


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_activations_bit_equal_to_the_unfused_casts(activation):
    # H=400: a partial 128-deep K block; 40 padding rows past the last group
    check(SPLITS, sum(SPLITS) + 40, 400, 256, activation)


@pytest.mark.parametrize("dtype,cluster_m,power_2_scales", [(torch.float16, 1, False), (torch.bfloat16, 2, True),
                                                            (torch.bfloat16, 1, True)])
def test_dtypes_clusters_scales(dtype, cluster_m, power_2_scales):
    check([700, 0, 1, 255, 0], 1000, 256, 384, "swiglu", dtype, power_2_scales, seed=1, cluster_m=cluster_m)


def test_against_the_torch_quantizer():
    """The copies equal the torch backend's (`quantize` rows and columns, block-padded)."""
    m = sum(SPLITS) + 40
    d_pre, offsets, (rows, row_scale), columns = check(SPLITS, m, 256, 128, "swiglu", seed=2)
    q = quantize(d_pre, Float8BlockScaling(), rowwise=True, columnwise=True, offsets=offsets)
    grouped = sum(SPLITS)
    assert torch.equal(rows.view(torch.uint8)[:grouped], q.rowwise_data.view(torch.uint8)[:grouped])
    assert torch.equal(row_scale[:grouped], q.rowwise_scale_inv[:grouped])
    check_columns(columns, block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets), used_blocks(offsets, m))


def test_no_rows_decreasing_offsets_and_no_host_sync():
    fp8, _, _, pre, _ = operands([0, 0], 40, 128, 128, "srelu", torch.bfloat16, 3)
    grouped_dgrad_dact_quant_fp8_sm90(*fp8, offsets_from_splits([0, 0]), pre, activation="srelu")
    fp8, _, _, pre, _ = operands([300, 200], 500, 256, 128, "swiglu", torch.bfloat16, 3)
    bad = torch.tensor([0, 300, 100], dtype=torch.int32, device="cuda")  # decreasing: no fault, no overrun
    grouped_dgrad_dact_quant_fp8_sm90(*fp8, bad, pre, activation="swiglu")
    offsets = offsets_from_splits([300, 200])
    grouped_dgrad_dact_quant_fp8_sm90(*fp8, offsets, pre, activation="swiglu")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_dgrad_dact_quant_fp8_sm90(*fp8, offsets, pre, activation="swiglu")
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


def test_argument_errors():
    name = "grouped_dgrad_dact_quant_fp8_sm90"
    fp8, _, _, pre, _ = operands([64, 64], 128, 256, 160, "swiglu", torch.bfloat16, 4)
    offsets = offsets_from_splits([64, 64])
    with pytest.raises(ValueError, match=f"{name}: I=160 .* must be a multiple of 128"):
        grouped_dgrad_dact_quant_fp8_sm90(*fp8, offsets, pre, activation="swiglu")
    (dy, dy_scale, w_t, w_t_scale), _, _, pre, _ = operands([1] * 513, 600, 128, 128, "srelu", torch.bfloat16, 5)
    with pytest.raises(ValueError, match=f"{name}: weight_t holds 513 groups"):
        grouped_dgrad_dact_quant_fp8_sm90(dy, dy_scale, w_t, w_t_scale, offsets_from_splits([1] * 513), pre,
                                          activation="srelu")
    fp8, _, _, pre, _ = operands([64, 64], 128, 256, 128, "swiglu", torch.bfloat16, 4)
    with pytest.raises(TypeError, match=f"{name}: power_2_scales must be a bool"):
        grouped_dgrad_dact_quant_fp8_sm90(*fp8, offsets, pre, activation="swiglu", power_2_scales=1)
