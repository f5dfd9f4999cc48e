"""GPU tests of the kernels reading rows by index inside the GEMM: `grouped_gemm_gathered_sm90`
(FC1's forward), `grouped_wgrad_gathered_sm90` (FC1's weight gradient on x's rows, FC2's on dy's)
and `grouped_dgrad_dact_sm90` with ``dy_index`` (FC2's data gradient + dActivation on dy's rows).
Each bit for bit the kernel on the gathered copy with the same tile, a float64 reference,
NaN-poisoned outputs, clamped ids, rows past the groups zero or ignored, no host sync, argument
errors."""

import pytest
import torch
from test_grouped_dgrad_sm90_gpu import dact_reference
from test_grouped_gemm_sm90_gpu import offsets_from_splits, poisoned_empty, reference, rel_err

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.backends.sm90.kernels.grouped_gemm import (
    grouped_dgrad_dact_sm90,
    grouped_gemm_gathered_sm90,
    grouped_gemm_sm90,
)
from te_fused_ops.backends.sm90.kernels.grouped_wgrad import grouped_wgrad_gathered_sm90, grouped_wgrad_sm90

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]

UNEVEN = [0, 300, 1, 0, 517, 129, 0]  # empty first and last groups, partial tiles; 947 rows


def operands(splits, tokens, k, n, activation, has_bias, seed, extra_rows=5):
    """x (T, K), the index (M,) of each grouped row (M = sum(splits) + extra rows past the groups),
    W (G, N, K), offsets, bias, probs."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g, m = len(splits), sum(splits) + extra_rows
    x = torch.randn(tokens, k, device="cuda", generator=gen).bfloat16()
    index = torch.randint(0, tokens, (m,), device="cuda", generator=gen, dtype=torch.int32)
    w = (torch.randn(g, n, k, device="cuda", generator=gen) / k**0.5).bfloat16()
    bias = torch.randn(g, n, device="cuda", generator=gen).bfloat16() if has_bias else None
    probs = torch.rand(m, device="cuda", generator=gen) if activation == "scaled_swiglu" else None
    return x, index, w, offsets_from_splits(splits), bias, probs


@pytest.mark.parametrize("activation,has_bias", [("swiglu", False), (None, True), ("scaled_swiglu", False)])
@pytest.mark.parametrize("tile_n,cluster_m,pingpong", [(128, 1, False), (128, 2, False), (192, 2, False),
                                                      (256, 1, False), (256, 2, False), (128, 2, True),
                                                      (192, 2, True), (192, 1, True)])
def test_equals_the_kernel_on_the_gathered_copy(activation, has_bias, tile_n, cluster_m, pingpong):
    x, index, w, offsets, bias, probs = operands(UNEVEN, 700, 256, 512, activation, has_bias, seed=tile_n + cluster_m)
    kw = dict(bias=bias, activation=activation, probs=probs, tile_n=tile_n, cluster_m=cluster_m, pingpong=pingpong)
    m, end = index.shape[0], int(offsets[-1])
    poisoned_empty((m, 512), torch.bfloat16)
    pre, act = grouped_gemm_gathered_sm90(x, index, w, offsets, **kw)
    exp_pre, exp_act = grouped_gemm_sm90(x[index.long()], w, offsets, **kw)
    assert torch.equal(pre, exp_pre)
    assert (act is None) == (exp_act is None) and (act is None or torch.equal(act, exp_act))
    ref_pre, ref_act = reference(x[index.long()], w, offsets, bias, activation, probs)
    assert rel_err(pre, ref_pre) < 1e-2 and torch.all(pre[end:] == 0)
    if act is not None:
        assert rel_err(act, ref_act) < 1e-2


def test_larger_k_and_many_groups():
    splits = [(37 * i) % 300 for i in range(40)]
    x, index, w, offsets, _, _ = operands(splits, 3000, 1024, 768, "swiglu", False, seed=3)
    pre, act = grouped_gemm_gathered_sm90(x, index, w, offsets, activation="swiglu")
    exp = grouped_gemm_sm90(x[index.long()], w, offsets, activation="swiglu", pingpong=False)
    assert torch.equal(pre, exp[0]) and torch.equal(act, exp[1])


def test_ids_out_of_range_are_clamped():
    x, index, w, offsets, _, _ = operands([40, 90], 64, 128, 256, None, False, seed=4)
    index[::7] = -3
    index[3::7] = 64 + 5
    pre, _ = grouped_gemm_gathered_sm90(x, index, w, offsets)
    exp, _ = grouped_gemm_sm90(x[index.long().clamp(0, 63)], w, offsets, pingpong=False)
    assert torch.equal(pre, exp)


def test_no_rows_and_no_host_sync():
    x, index, w, offsets, _, _ = operands([0, 0], 16, 64, 128, "swiglu", False, seed=5, extra_rows=0)
    pre, act = grouped_gemm_gathered_sm90(x, index, w, offsets, activation="swiglu")
    assert pre.shape == (0, 128) and act.shape == (0, 64)
    x, index, w, offsets, _, _ = operands(UNEVEN, 500, 128, 256, "swiglu", False, seed=6)
    grouped_gemm_gathered_sm90(x, index, w, offsets, activation="swiglu")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_gemm_gathered_sm90(x, index, w, offsets, activation="swiglu")
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_argument_errors():
    x, index, w, offsets, _, _ = operands([10, 20], 32, 128, 256, None, False, seed=7)
    name = "grouped_gemm_gathered_sm90"
    with pytest.raises(ValueError, match=f"{name}: K=96 .* multiple of 64"):
        grouped_gemm_gathered_sm90(x[:, :96].contiguous(), index, w[:, :, :96].contiguous(), offsets)
    with pytest.raises(TypeError, match=f"{name}: x_index has dtype torch.int64"):
        grouped_gemm_gathered_sm90(x, index.long(), w, offsets)
    with pytest.raises(ValueError, match=f"{name}: weight has K=64"):
        grouped_gemm_gathered_sm90(x, index, w[:, :, :64].contiguous(), offsets)
    with pytest.raises(ValueError, match=f"{name}: x has no rows to gather, x_index has 30"):
        grouped_gemm_gathered_sm90(x[:0], index[:30], w, offsets)
    with pytest.raises(ValueError, match=f"{name}: x_index must be 1-D"):
        grouped_gemm_gathered_sm90(x, index[:, None], w, offsets)
    with pytest.raises(ValueError, match=f"{name}: pingpong needs tile_n in"):
        grouped_gemm_gathered_sm90(x, index, w, offsets, tile_n=256, pingpong=True)


def wgrad_reference(dy, rows, offsets):
    """float64 dW[g] = dy_g^T @ rows_g."""
    off = offsets.tolist()
    out = torch.zeros(len(off) - 1, dy.shape[1], rows.shape[1], dtype=torch.float64, device=dy.device)
    for g in range(len(off) - 1):
        out[g] = dy[off[g]:off[g + 1]].double().T @ rows[off[g]:off[g + 1]].double()
    return out


@pytest.mark.parametrize("tile_n,cluster_m", [(128, 1), (128, 2), (192, 2), (256, 2)])
@pytest.mark.parametrize("n,k", [(384, 256), (256, 200), (128, 520), (1536, 2048)])
def test_wgrad_against_float64(tile_n, cluster_m, n, k):
    """x's gathered rows as A of dW^T = x_g^T dy_g, stored transposed: against float64 and within
    rounding of the kernel on the gathered copy, NaN-poisoned output, empty groups zero, reruns
    bit-equal; K = 520 leaves a pair's second m-tile wholly past K (its loads clamped, its stores
    clipped)."""
    x, index, _, offsets, _, _ = operands(UNEVEN, 600, k, 8, None, False, seed=tile_n + k + cluster_m)
    dy = torch.randn(index.shape[0], n, device="cuda").bfloat16()
    poisoned_empty((len(UNEVEN), n, k), torch.bfloat16)
    dw = grouped_wgrad_gathered_sm90(dy, x, index, offsets, tile_n=tile_n, cluster_m=cluster_m)
    rows = x[index.long()]
    assert rel_err(dw, wgrad_reference(dy, rows, offsets)) < 1e-2
    assert rel_err(dw, grouped_wgrad_sm90(dy, rows, offsets).double()) < 1e-2
    assert torch.all(dw[0] == 0) and torch.all(dw[3] == 0)  # empty groups
    again = grouped_wgrad_gathered_sm90(dy, x, index, offsets, tile_n=tile_n, cluster_m=cluster_m)
    assert torch.equal(dw, again)


def test_wgrad_clamps_ids_and_runs_without_host_sync():
    x, index, _, offsets, _, _ = operands([70, 0, 190], 50, 256, 8, None, False, seed=9)
    index[::5] = -1
    index[2::5] = 50
    dy = torch.randn(index.shape[0], 256, device="cuda").bfloat16()
    dw = grouped_wgrad_gathered_sm90(dy, x, index, offsets)
    assert rel_err(dw, wgrad_reference(dy, x[index.long().clamp(0, 49)], offsets)) < 1e-2
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_wgrad_gathered_sm90(dy, x, index, offsets)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_wgrad_argument_errors():
    x, index, _, offsets, _, _ = operands([10, 20], 32, 128, 8, None, False, seed=10)
    dy = torch.randn(index.shape[0], 64, device="cuda").bfloat16()
    name = "grouped_wgrad_gathered_sm90"
    with pytest.raises(ValueError, match=f"{name}: dy has 35 rows, index has 30"):
        grouped_wgrad_gathered_sm90(dy, x, index[:30], offsets)
    with pytest.raises(ValueError, match=f"{name}: tile_n must be 128, 192 or 256"):
        grouped_wgrad_gathered_sm90(dy, x, index, offsets, tile_n=64)
    with pytest.raises(ValueError, match=f"{name}: cluster_m must be 1 or 2"):
        grouped_wgrad_gathered_sm90(dy, x, index, offsets, cluster_m=4)
    with pytest.raises(TypeError, match=f"{name}: x has dtype torch.float16"):
        grouped_wgrad_gathered_sm90(dy, x.half(), index, offsets)
    with pytest.raises(ValueError, match=f"{name}: x has no rows to gather, index has 35"):
        grouped_wgrad_gathered_sm90(dy, x[:0], index, offsets)

    with pytest.raises(ValueError, match=f"{name}: gathered must be 'x' or 'dy'"):
        grouped_wgrad_gathered_sm90(dy, x, index, offsets, gathered="w")
    with pytest.raises(ValueError, match=f"{name}: x has 32 rows, index has 35"):
        grouped_wgrad_gathered_sm90(dy, x, index, offsets, gathered="dy")


@pytest.mark.parametrize("tile_n,cluster_m", [(128, 1), (128, 2), (192, 2), (256, 2)])
@pytest.mark.parametrize("n,k", [(384, 256), (256, 200), (2048, 768)])
def test_wgrad_of_gathered_dy(tile_n, cluster_m, n, k):
    """FC2's weight gradient with dy's token rows read by index (gathered "dy": dy's rows as A, x
    as B, stored as computed): bit for bit the kernel on the copy dy[index] with the same tile,
    against float64, NaN-poisoned output, empty groups zero, ids clamped."""
    dy, index, _, offsets, _, _ = operands(UNEVEN, 600, n, 8, None, False, seed=tile_n + n + cluster_m)
    index[::9] = -2
    index[4::9] = 600
    x = torch.randn(index.shape[0], k, device="cuda").bfloat16()
    poisoned_empty((len(UNEVEN), n, k), torch.bfloat16)
    dw = grouped_wgrad_gathered_sm90(dy, x, index, offsets, gathered="dy", tile_n=tile_n, cluster_m=cluster_m)
    rows = dy[index.long().clamp(0, 599)]
    assert rel_err(dw, wgrad_reference(rows, x, offsets)) < 1e-2
    assert torch.equal(dw, grouped_wgrad_sm90(rows, x, offsets, tile_n=tile_n, cluster_m=cluster_m))
    assert torch.all(dw[0] == 0) and torch.all(dw[3] == 0)


@pytest.mark.parametrize("activation", ["swiglu", "scaled_swiglu", "srelu"])
@pytest.mark.parametrize("tile_n,cluster_m,pingpong", [(128, 1, False), (192, 2, False), (256, 2, False),
                                                      (192, 2, True), (128, 1, True)])
def test_dact_of_gathered_dy(activation, tile_n, cluster_m, pingpong):
    """FC2's data gradient + dActivation with dy's token rows read by index (``dy_index``): bit for
    bit the kernel on the copy dy[index] with the same tile, against float64, NaN-poisoned
    outputs, padding rows zero, ids clamped; d_pre written over pre too."""
    h, i = 256, 160 if activation != "srelu" else 168
    dy, index, _, offsets, _, _ = operands(UNEVEN, 500, h, 8, None, False,
                                           seed=tile_n + cluster_m + len(activation) + pingpong)
    index[::11] = -1
    index[5::11] = 10**6
    g, m = len(UNEVEN), index.shape[0]
    w = (torch.randn(g, h, i, device="cuda") / h**0.5).bfloat16()
    pre = (2 * torch.randn(m, i if activation == "srelu" else 2 * i, device="cuda")).bfloat16()
    probs = torch.rand(m, device="cuda") if activation == "scaled_swiglu" else None
    kw = dict(activation=activation, probs=probs, tile_n=tile_n, cluster_m=cluster_m, pingpong=pingpong)
    poisoned_empty(tuple(pre.shape), torch.bfloat16)
    act_out = torch.full((m, i), float("nan"), dtype=torch.bfloat16, device="cuda")
    d_pre, act, d_probs = grouped_dgrad_dact_sm90(dy, w, offsets, pre, dy_index=index, act_out=act_out, **kw)
    rows = dy[index.long().clamp(0, 499)]
    exp = grouped_dgrad_dact_sm90(rows, w, offsets, pre, **kw)
    assert torch.equal(d_pre, exp[0]) and torch.equal(act, exp[1])
    assert (d_probs is None) == (exp[2] is None) and (d_probs is None or torch.equal(d_probs, exp[2]))
    ref_d_pre, ref_act, ref_d_probs = dact_reference(rows, w, offsets, pre, activation, probs)
    end = int(offsets[-1])
    assert rel_err(d_pre, ref_d_pre) < 1e-2 and rel_err(act, ref_act) < 1e-2
    assert torch.all(d_pre[end:] == 0) and torch.all(act[end:] == 0)
    if probs is not None:
        assert rel_err(d_probs, ref_d_probs) < 1e-2
    over_pre = pre.clone()
    in_place = grouped_dgrad_dact_sm90(dy, w, offsets, over_pre, dy_index=index, out=over_pre, **kw)
    assert in_place[0].data_ptr() == over_pre.data_ptr() and torch.equal(over_pre, d_pre)


def test_dact_of_gathered_dy_without_host_sync_and_errors():
    dy, index, _, offsets, _, _ = operands([70, 0, 190], 50, 128, 8, None, False, seed=12)
    w = (torch.randn(3, 128, 64, device="cuda") / 128**0.5).bfloat16()
    pre = torch.randn(index.shape[0], 128, device="cuda").bfloat16()
    grouped_dgrad_dact_sm90(dy, w, offsets, pre, dy_index=index, activation="swiglu")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        grouped_dgrad_dact_sm90(dy, w, offsets, pre, dy_index=index, activation="swiglu")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    name = "grouped_dgrad_dact_sm90"
    with pytest.raises(TypeError, match=f"{name}: dy_index has dtype torch.int64"):
        grouped_dgrad_dact_sm90(dy, w, offsets, pre, dy_index=index.long(), activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: H=96 .* multiple of 64 with dy_index"):
        grouped_dgrad_dact_sm90(dy[:, :96].contiguous(), w[:, :96].contiguous(), offsets, pre, dy_index=index,
                                activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: dy_index runs on the MMA warpgroups' epilogue"):
        grouped_dgrad_dact_sm90(dy, w, offsets, pre, dy_index=index, activation="swiglu", epilogue_warps=True)
    with pytest.raises(ValueError, match=f"{name}: pre must have shape"):
        grouped_dgrad_dact_sm90(dy, w, offsets, pre[:10].contiguous(), dy_index=index, activation="swiglu")
    with pytest.raises(ValueError, match=f"{name}: dy has no rows to gather"):
        grouped_dgrad_dact_sm90(dy[:0], w, offsets, pre, dy_index=index, activation="swiglu")
