"""GPU tests of ``grouped_dgrad_dact_fp8_sm90``: FC2's data gradient on block-scaled FP8 operands
(dy 1x128, W^T 128x128) with the activation's backward in the epilogue, against a float64
reference of the same quantized operands; NaN-poisoned outputs; sync-free; argument errors."""

import math

import pytest
import torch

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.activations import ACTIVATIONS
from te_fused_ops.backends.sm90.kernels.block_quantize import block_quantize_sm90
from te_fused_ops.backends.sm90.kernels.grouped_gemm import grouped_dgrad_dact_fp8_sm90, grouped_dgrad_dact_sm90
from te_fused_ops.backends.sm90.kernels.tuning import fp8_dact_tile_n
from test_grouped_dgrad_sm90_gpu import (
    ALPHA, LIMIT, TOL, UNEVEN, dact_reference, offsets_from_splits, poison_allocator, rel_err,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]


def operands(splits, m, h, i, activation, dtype, seed):
    """dy and W (G, H, I) cast as the FP8 backward casts them, their dequantized values, pre, probs."""
    torch.manual_seed(seed)
    g, spec = len(splits), ACTIVATIONS[activation]
    dy = torch.randn(m, h, device="cuda").to(dtype)
    dy[::5] *= 64  # rows of different ranges: the 1x128 multipliers matter
    w = (torch.randn(g, h, i, device="cuda") / math.sqrt(h)).to(dtype)
    w[:, :128] *= 16  # and 128x128 blocks of different ranges
    dy_data, dy_scale = block_quantize_sm90(dy, 1)
    w_data, w_scale, w_t, w_t_scale = block_quantize_sm90(w, 128, transposed=True)
    dy_values = dy_data.float() * dy_scale.repeat_interleave(128, 1)[:, :h]
    w_values = w_data.float() * w_scale.repeat_interleave(128, 1)[:, :h].repeat_interleave(128, 2)[:, :, :i]
    pre = (2 * torch.randn(m, 2 * i if spec.glu else i, device="cuda")).to(dtype)
    probs = torch.rand(m, device="cuda") if spec.takes_probs else None
    return (dy_data, dy_scale, w_t, w_t_scale), dy_values, w_values, pre, probs


def run(splits, m, h, i, activation, dtype=torch.bfloat16, seed=0, **cfg):
    fp8, dy_values, w_values, pre, probs = operands(splits, m, h, i, activation, dtype, seed)
    offsets = offsets_from_splits(splits)
    tile_n = cfg.get("tile_n") or fp8_dact_tile_n(i)
    poison_allocator((tuple(pre.shape), dtype), ((-(-i // tile_n), m), torch.float32))
    d_pre, d_probs = grouped_dgrad_dact_fp8_sm90(
        *fp8, offsets, pre, activation=activation, probs=probs, limit=LIMIT, alpha=ALPHA, **cfg
    )
    assert d_pre.shape == pre.shape and d_pre.dtype == dtype
    exp_d_pre, _, exp_d_probs = dact_reference(dy_values, w_values, offsets, pre, activation, probs)
    end = int(offsets[-1])
    assert rel_err(d_pre, exp_d_pre) <= TOL
    assert torch.all(d_pre[end:] == 0)
    if ACTIVATIONS[activation].takes_probs:
        assert d_probs.shape == (m,) and rel_err(d_probs, exp_d_probs) <= TOL
    else:
        assert d_probs is None
    return d_pre, d_probs


@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu", "srelu"])
@pytest.mark.parametrize("i", [320, 512])  # a partial last tile (its second half partly past I); two whole tiles
def test_tile_256_halves(activation, i):
    """Tile 256 over I: each block's product in two 128-column halves, each with its own W block's
    multipliers; d_pre bit for bit the 128-wide tile's (the same block sums in the same order),
    d_probs within the float64 tolerance (its per-tile partials are summed over fewer, wider tiles)."""
    wide = run(UNEVEN, 500, 400, i, activation, tile_n=256)
    narrow = run(UNEVEN, 500, 400, i, activation, tile_n=128)
    assert torch.equal(wide[0].view(torch.int16), narrow[0].view(torch.int16))


@pytest.mark.parametrize("activation,cluster_m,i", [("swiglu", 2, 320), ("scaled_swiglu", 1, 320), ("srelu", 2, 320),
                                                  ("clamped_swiglu", 1, 320), ("scaled_swiglu", 2, 512)])
def test_d_pre_amax_from_the_epilogue(activation, cluster_m, i):
    """fp8_current's amax of d_pre from the epilogue (gate and up halves, grouped rows only, as
    stored): the same d_pre and d_probs bits, parts whose max is torch's amax, all written; at
    I = 512 on the default 256-wide tiles."""
    from test_grouped_gemm_sm90_gpu import act_amax_reference

    from te_fused_ops.backends.sm90.kernels.grouped_gemm import max_clusters
    from te_fused_ops.backends.sm90.kernels.launch import num_sms

    splits, m, h = UNEVEN, 500, 400
    fp8, _, _, pre, probs = operands(splits, m, h, i, activation, torch.bfloat16, seed=3)
    pre[sum(splits):] = 1e4  # padding rows: d_pre is zero there whatever pre holds
    offsets = offsets_from_splits(splits)

    def run_amax(d_pre_amax):
        return grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, activation=activation, probs=probs, limit=LIMIT,
                                           alpha=ALPHA, cluster_m=cluster_m, d_pre_amax=d_pre_amax)

    d_pre, d_probs = run_amax(False)
    poison_allocator(((max_clusters(num_sms(0), 0, cluster_m) * cluster_m * 8,), torch.float32))
    d_pre2, d_probs2, parts = run_amax(True)
    assert torch.equal(d_pre2.view(torch.int16), d_pre.view(torch.int16))
    assert d_probs is None or torch.equal(d_probs2, d_probs)
    assert not torch.isnan(parts).any() and torch.all(parts >= 0)
    want = act_amax_reference(d_pre, sum(splits))
    assert torch.equal(parts.max(), want), (parts.max().item(), want.item())


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
def test_activations_uneven_splits(activation):
    # H=400: a partial 128-deep K block; I=320: a partial n-tile and scale block; 50 padding rows
    run(UNEVEN, 500, 400, 320, activation)


@pytest.mark.parametrize("dtype,cluster_m", [(torch.float16, 1), (torch.bfloat16, 2)])
def test_dtypes_and_clusters(dtype, cluster_m):
    run([0, 700, 0, 1, 255], 1000, 256, 256, "swiglu", dtype, seed=1, cluster_m=cluster_m)


def test_no_rows_and_no_host_sync():
    run([0, 0, 0], 40, 128, 128, "srelu", seed=2)
    fp8, _, _, pre, _ = operands([64, 64], 128, 256, 128, "swiglu", torch.bfloat16, 3)
    offsets = offsets_from_splits([64, 64])
    grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, activation="swiglu")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, activation="swiglu")
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_argument_errors():
    name = "grouped_dgrad_dact_fp8_sm90"
    (dy, dy_scale, w_t, w_t_scale), _, _, pre, _ = operands([64, 64], 128, 256, 128, "swiglu", torch.bfloat16, 4)
    offsets = offsets_from_splits([64, 64])
    with pytest.raises(TypeError, match=f"{name}: dy has dtype"):
        grouped_dgrad_dact_fp8_sm90(dy.float(), dy_scale, w_t, w_t_scale, offsets, pre, activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: weight_t_scale_inv must have shape"):
        grouped_dgrad_dact_fp8_sm90(dy, dy_scale, w_t, w_t_scale[:, :, :1].contiguous(), offsets, pre,
                                    activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: pre must have shape"):
        grouped_dgrad_dact_fp8_sm90(dy, dy_scale, w_t, w_t_scale, offsets, pre[:, :128].contiguous(),
                                    activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: activation is required"):
        grouped_dgrad_dact_fp8_sm90(dy, dy_scale, w_t, w_t_scale, offsets, pre, activation=None)
    with pytest.raises(TypeError, match=f"{name}: emit_act must be a bool"):
        grouped_dgrad_dact_fp8_sm90(dy, dy_scale, w_t, w_t_scale, offsets, pre, activation="swiglu", emit_act=1)
    with pytest.raises(ValueError, match=f"{name}: tile_n must be 128 or 256, got 192"):
        grouped_dgrad_dact_fp8_sm90(dy, dy_scale, w_t, w_t_scale, offsets, pre, activation="swiglu", tile_n=192)
    with pytest.raises(ValueError, match=f"{name}: weight_t has K=256"):
        grouped_dgrad_dact_fp8_sm90(dy[:, :128].contiguous(), dy_scale[:, :1].contiguous(), w_t, w_t_scale,
                                    offsets, pre, activation="swiglu")


@pytest.mark.parametrize("activation,tile_n,cluster_m", [("scaled_swiglu", 128, 2), ("scaled_swiglu", 256, 1),
                                                        ("srelu", 256, 2)])
def test_d_pre_written_over_pre(activation, tile_n, cluster_m):
    """``out=pre`` (the FP8 layer's backward writes d_pre over the saved pre-activation): each tile
    reads its pre before storing its d_pre there, groups ending inside tiles included, so d_pre and
    d_probs are bit for bit those into a buffer of their own."""
    splits = [130, 0, 67, 301, 2]
    fp8, _, _, pre, probs = operands(splits, 500, 256, 320, activation, torch.bfloat16, 9)
    offsets = offsets_from_splits(splits)
    kw = dict(activation=activation, probs=probs, limit=LIMIT, alpha=ALPHA, tile_n=tile_n, cluster_m=cluster_m)
    separate = grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, **kw)
    in_place = grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, out=pre, **kw)
    assert in_place[0].data_ptr() == pre.data_ptr()
    for a, b in zip(separate, in_place):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize("activation,tile_n,in_place", [("scaled_swiglu", 256, True), ("swiglu", 128, False),
                                                       ("srelu", 256, False)])
def test_emitted_act(activation, tile_n, in_place):
    """``emit_act``: the act FC2's 16-bit weight gradient reads (activation of pre, times probs),
    poisoned first: within the float64 tolerance, bit for bit the act the bf16 kernel writes from
    the same pre, zero past the groups; d_pre and d_probs bit for bit those without it (d_pre over
    pre too: each tile reads pre before storing d_pre and act)."""
    splits = [130, 0, 67, 301, 2]
    m, h, i = 520, 256, 320
    fp8, dy_values, w_values, pre, probs = operands(splits, m, h, i, activation, torch.bfloat16, 11)
    offsets = offsets_from_splits(splits)
    kw = dict(activation=activation, probs=probs, limit=LIMIT, alpha=ALPHA, tile_n=tile_n)
    without = grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre.clone(), **kw)
    _, bf16_act, _ = grouped_dgrad_dact_sm90(dy_values.bfloat16(), w_values.bfloat16(), offsets, pre, **kw)
    poison_allocator(((m, i), torch.bfloat16))
    source = pre.clone()
    d_pre, act, d_probs = grouped_dgrad_dact_fp8_sm90(*fp8, offsets, source, out=source if in_place else None,
                                                      emit_act=True, **kw)
    _, exp_act, _ = dact_reference(dy_values, w_values, offsets, pre, activation, probs)
    end = int(offsets[-1])
    assert act.shape == (m, i) and act.dtype == pre.dtype
    assert rel_err(act, exp_act) <= TOL and torch.all(act[end:] == 0)
    assert torch.equal(act.view(torch.int16), bf16_act.view(torch.int16))
    assert torch.equal(d_pre, without[0]) and (d_probs is None) == (without[1] is None)
    assert d_probs is None or torch.equal(d_probs, without[1])


def test_out_argument_errors():
    name = "grouped_dgrad_dact_fp8_sm90"
    fp8, _, _, pre, _ = operands([64, 64], 128, 256, 128, "swiglu", torch.bfloat16, 4)
    offsets = offsets_from_splits([64, 64])
    with pytest.raises(ValueError, match=f"{name}: out must have shape"):
        grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, activation="swiglu", out=pre[:, :128].contiguous())
    with pytest.raises(TypeError, match=f"{name}: out has dtype"):
        grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre, activation="swiglu", out=pre.half())


def test_output_dtype_follows_pre_between_calls():
    """The memoized launch is keyed by pre's dtype (the output's): an fp16 call, then a bf16 call of
    the same shapes, each gets its own kernel (the bf16 one was once handed the fp16 kernel)."""
    fp8, _, _, pre, _ = operands([100, 28], 128, 256, 128, "swiglu", torch.bfloat16, 6)
    offsets = offsets_from_splits([100, 28])
    for dtype in (torch.float16, torch.bfloat16):
        d_pre, _ = grouped_dgrad_dact_fp8_sm90(*fp8, offsets, pre.to(dtype), activation="swiglu")
        assert d_pre.dtype == dtype
