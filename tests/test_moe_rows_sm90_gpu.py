"""GPU tests of the MoE row-movement kernels (`moe_rows`): scatter_rows and gather_sum in every
configuration against a float64 torch reference, routing built as the MoE layer builds it; outputs
poisoned with NaN (every row a permutation reaches is written), NaN guard rows around the
tensors (nothing read or written out of bounds), padding rows and the scale / weight of dropped
slots NaN (never read); T = 0, k = 1..16, all slots dropped, garbage rows and num_kept; no host
sync; errors that name the argument."""

import pytest
import torch
from test_route_sm90_gpu import NEEDS_FFI_KERNELS

from te_fused_ops.backends.sm90.kernels.block_quantize import block_quantize_sm90
from te_fused_ops.backends.sm90.kernels.moe_rows import (
    gather_sum,
    scatter_cast_rows,
    scatter_rows,
)

pytestmark = [pytest.mark.gpu, NEEDS_FFI_KERNELS]

GUARD = 8  # NaN rows before and after each row-indexed tensor
NAN = float("nan")
ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # half an ulp, relative
SHAPES = [(64, 8, 2048), (33, 2, 7168), (50, 4, 2880), (300, 1, 8), (17, 16, 256)]  # T, k, H


def routing(tokens, k, num_experts, drop, seed):
    """(rows (T, k) int32, num_kept (1,) int32) as the MoE layer routes: expert ids (-1 for a
    dropped slot, with probability ``drop``), rows ordered by expert, stably, dropped slots last."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    indices = torch.randint(0, num_experts, (tokens, k), device="cuda", generator=gen)
    indices[torch.rand(tokens, k, device="cuda", generator=gen) < drop] = -1
    valid = indices >= 0
    key = torch.where(valid, indices, num_experts)
    order = torch.argsort(key.flatten(), stable=True)
    rows = torch.empty(tokens * k, dtype=torch.int32, device="cuda")
    rows[order] = torch.arange(tokens * k, dtype=torch.int32, device="cuda")
    return rows.view(tokens, k), valid.sum().to(torch.int32).reshape(1)


def guarded(rows, hidden, dtype, fill=NAN):
    """(a (rows, H) view with GUARD NaN rows on each side, the whole buffer)."""
    buffer = torch.full((rows + 2 * GUARD, hidden), fill, dtype=dtype, device="cuda")
    return buffer[GUARD:GUARD + rows], buffer


def assert_guards_intact(buffer):
    assert torch.isnan(buffer[:GUARD]).all() and torch.isnan(buffer[-GUARD:]).all(), "written out of bounds"


def randn(shape, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", generator=gen).to(dtype)


def kept_slots(rows, num_kept, num_rows):
    limit = min(int(num_kept[0]), num_rows)
    return (rows >= 0) & (rows < limit)


def slot_floats(rows, num_kept, num_rows, seed, low=0.0):
    """(T, k) float32 in [low, 1), NaN at dropped slots (the kernels must not read them)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    values = low + (1 - low) * torch.rand(rows.shape, device="cuda", generator=gen)
    return torch.where(kept_slots(rows, num_kept, num_rows), values, NAN)


def scatter_reference(x, rows, num_kept, num_rows, scale=None, y=None):
    """float64 (out (M, H) with NaN at rows no slot reaches, dots (T, k) or None)."""
    kept = kept_slots(rows, num_kept, num_rows)
    values = x.double().unsqueeze(1).expand(-1, rows.shape[1], -1)
    if scale is not None:
        values = values * torch.where(kept, scale, 0).double().unsqueeze(2)
    values = torch.where(kept.unsqueeze(2), values, 0)
    out = torch.full((num_rows, x.shape[1]), NAN, dtype=torch.float64, device="cuda")
    in_range = (rows >= 0) & (rows < num_rows)
    out[rows[in_range].long()] = values[in_range]
    dots = None
    if y is not None:
        picked = y.double()[rows.long().clamp(0, max(num_rows - 1, 0))]
        dots = torch.where(kept, (picked * x.double().unsqueeze(1)).sum(2), 0)
    return out, dots


def gather_reference(src, rows, num_kept, weights=None):
    """float64 (out (T, H), sum of the terms' magnitudes (T, H))."""
    kept = kept_slots(rows, num_kept, src.shape[0])
    factor = kept.double() if weights is None else torch.where(kept, weights, 0).double()
    picked = src.double()[rows.long().clamp(0, src.shape[0] - 1)]
    picked = torch.where(kept.unsqueeze(2), picked, 0)  # NaN padding rows are never read
    terms = picked * factor.unsqueeze(2)
    return terms.sum(1), terms.abs().sum(1)


def assert_rounded(out, want, magnitude, dtype):
    """out (dtype) within an ulp of the float64 ``want`` (a subnormal step near 0), plus float32
    rounding of the terms."""
    err = (out.double() - want).abs()
    subnormal_step = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    bound = 2 * ULP[dtype] * want.abs() + subnormal_step + 1e-5 * magnitude
    assert torch.isfinite(out).all()
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst excess {(err - bound).max().item():.3g}"


def assert_dots(dots, want, x, y, rows):
    magnitude = (y.double()[rows.long().clamp(0, max(y.shape[0] - 1, 0))].abs() * x.double().abs().unsqueeze(1)).sum(2)
    err = (dots.double() - want).abs()
    assert (err <= 4e-5 * magnitude + 1e-30).all(), f"dot error {err.max().item():.3g}"


def run_scatter(x, rows, num_kept, scaled, dot, seed=0):
    """scatter_rows into a poisoned, guarded out; checked against the reference."""
    tokens, k = rows.shape
    num_rows, hidden, dtype = tokens * k, x.shape[1], x.dtype
    out, out_buffer = guarded(num_rows, hidden, dtype)
    scale = slot_floats(rows, num_kept, num_rows, seed + 1, low=0.25) if scaled else None
    y = dot_out = y_buffer = None
    if dot:
        y, y_buffer = guarded(num_rows, hidden, dtype)
        y.copy_(randn((num_rows, hidden), dtype, seed + 2))
        y[min(max(int(num_kept[0]), 0), num_rows):] = NAN  # padding rows: never read
        dot_out = torch.full((tokens, k), NAN, dtype=torch.float32, device="cuda")
    got = scatter_rows(x, rows, num_kept, out, scale=scale, y=y, dot_out=dot_out)
    assert got is out
    want, want_dots = scatter_reference(x, rows, num_kept, num_rows, scale, y)
    assert_guards_intact(out_buffer)
    if scaled:
        reached = ~torch.isnan(want)
        assert torch.isnan(out[~reached]).all()
        assert_rounded(out[reached], want[reached], want[reached].abs(), dtype)
    else:
        assert torch.equal(out.double().nan_to_num(7.0), want.nan_to_num(7.0))  # bit copies and zeros
    if dot:
        assert_guards_intact(y_buffer)
        assert_dots(dot_out, want_dots, x, y.nan_to_num(0.0), rows)
    return out


def run_gather(src, rows, num_kept, weighted, seed=0):
    tokens, hidden, dtype = rows.shape[0], src.shape[1], src.dtype
    out, out_buffer = guarded(tokens, hidden, dtype)
    weights = slot_floats(rows, num_kept, src.shape[0], seed + 3) if weighted else None
    got = gather_sum(src, rows, num_kept, out, weights=weights)
    assert got is out
    want, magnitude = gather_reference(src, rows, num_kept, weights)
    assert_guards_intact(out_buffer)
    assert_rounded(out, want, magnitude, dtype)
    return out


def expert_rows(num_rows, hidden, dtype, num_kept, seed):
    """src (M, H) with NaN guard rows and NaN padding rows (>= num_kept), and its buffer."""
    src, buffer = guarded(num_rows, hidden, dtype)
    src.copy_(randn((num_rows, hidden), dtype, seed))
    src[min(max(int(num_kept[0]), 0), num_rows):] = NAN
    return src, buffer


@pytest.mark.parametrize("dot", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,k,hidden", SHAPES)
def test_scatter_rows(tokens, k, hidden, dtype, scaled, dot):
    rows, num_kept = routing(tokens, k, 8, 0.2, seed=tokens + k)
    x = randn((tokens, hidden), dtype, seed=hidden)
    out = run_scatter(x, rows, num_kept, scaled, dot, seed=k)
    assert not torch.isnan(out).any()  # a permutation reaches every row


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,k,hidden", SHAPES)
def test_gather_sum(tokens, k, hidden, dtype, weighted):
    rows, num_kept = routing(tokens, k, 8, 0.2, seed=tokens + k)
    src, src_buffer = expert_rows(tokens * k, hidden, dtype, num_kept, seed=hidden)
    run_gather(src, rows, num_kept, weighted, seed=k)
    assert_guards_intact(src_buffer)


def test_large_shapes_bf16():
    """The benchmark's shapes (T * k = 65536 rows, H 2048; H 7168), every configuration."""
    for tokens, k, hidden in ((8192, 8, 2048), (4096, 8, 7168)):
        rows, num_kept = routing(tokens, k, 128, 0.05, seed=1)
        x = randn((tokens, hidden), torch.bfloat16, seed=2)
        for scaled, dot in ((False, False), (True, True)):
            run_scatter(x, rows, num_kept, scaled, dot)
        src, _ = expert_rows(tokens * k, hidden, torch.bfloat16, num_kept, seed=3)
        for weighted in (False, True):
            run_gather(src, rows, num_kept, weighted)


def test_unweighted_single_slot_gather_is_a_copy():
    rows, num_kept = routing(100, 1, 4, 0.0, seed=5)
    src = randn((100, 512), torch.bfloat16, seed=6)
    out = gather_sum(src, rows, num_kept)
    assert torch.equal(out, src[rows[:, 0].long()])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_all_slots_dropped(dtype):
    tokens, k, hidden = 40, 4, 264
    rows, _ = routing(tokens, k, 8, 0.0, seed=7)
    num_kept = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = randn((tokens, hidden), dtype, seed=8)
    for scaled, dot in ((False, False), (True, True)):
        out = run_scatter(x, rows, num_kept, scaled, dot)
        assert torch.equal(out, torch.zeros_like(out))  # every row is a dropped slot's: zeros
    src, _ = expert_rows(tokens * k, hidden, dtype, num_kept, seed=9)  # all NaN padding
    for weighted in (False, True):
        assert torch.equal(run_gather(src, rows, num_kept, weighted), torch.zeros(tokens, hidden, dtype=dtype,
                                                                                  device="cuda"))


@pytest.mark.parametrize("num_kept_value", ["routed", "negative", "past M"])
def test_rows_out_of_range_are_dropped(num_kept_value):
    """Row values -5, M + 3, -2**31 and 2**31 - 1 and a garbage num_kept: no access out of
    bounds (NaN guards stay), those slots are dropped and write nothing; rows no slot reaches
    stay NaN."""
    tokens, k, hidden = 64, 4, 1024
    num_rows = tokens * k
    rows, num_kept = routing(tokens, k, 8, 0.1, seed=11)
    num_kept = {"routed": num_kept, "negative": torch.tensor([-3], dtype=torch.int32, device="cuda"),
                "past M": torch.tensor([num_rows + 100], dtype=torch.int32, device="cuda")}[num_kept_value]
    bad = torch.tensor([-5, num_rows + 3, -2**31, 2**31 - 1], dtype=torch.int32, device="cuda")
    for i, value in enumerate(bad):
        rows[3 * i + 1, i % k] = value
    x = randn((tokens, hidden), torch.bfloat16, seed=12)
    for scaled, dot in ((False, False), (True, False), (False, True), (True, True)):
        out = run_scatter(x, rows, num_kept, scaled, dot)
        assert torch.isnan(out).any(0).all()  # the bad slots' rows were left alone
    src, src_buffer = expert_rows(num_rows, hidden, torch.bfloat16, num_kept, seed=13)
    for weighted in (False, True):
        run_gather(src, rows, num_kept, weighted)
    assert_guards_intact(src_buffer)


def test_zero_tokens():
    x = torch.empty(0, 64, dtype=torch.bfloat16, device="cuda")
    rows = torch.empty(0, 8, dtype=torch.int32, device="cuda")
    num_kept = torch.zeros(1, dtype=torch.int32, device="cuda")
    out = scatter_rows(x, rows, num_kept)
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16
    dot_out = torch.empty(0, 8, dtype=torch.float32, device="cuda")
    scale = torch.empty(0, 8, dtype=torch.float32, device="cuda")
    assert scatter_rows(x, rows, num_kept, out, scale=scale, y=out, dot_out=dot_out) is out
    assert gather_sum(out, rows, num_kept).shape == (0, 64)


def test_allocates_out_when_none():
    rows, num_kept = routing(32, 2, 4, 0.25, seed=14)
    x = randn((32, 128), torch.float16, seed=15)
    out = scatter_rows(x, rows, num_kept)
    assert out.shape == (64, 128) and out.dtype == torch.float16
    want, _ = scatter_reference(x, rows, num_kept, 64)
    assert torch.equal(out.double(), want)
    back = gather_sum(out, rows, num_kept)
    kept = kept_slots(rows, num_kept, 64)
    assert torch.equal(back.double(), x.double() * kept.sum(1, keepdim=True))  # a token's kept copies summed


def test_no_host_sync_and_cuda_graph():
    rows, num_kept = routing(256, 8, 16, 0.1, seed=16)
    x = randn((256, 2048), torch.bfloat16, seed=17)
    scale = slot_floats(rows, num_kept, 2048, seed=18)
    y = randn((2048, 2048), torch.bfloat16, seed=19)
    dot_out = torch.empty(256, 8, dtype=torch.float32, device="cuda")
    out = scatter_rows(x, rows, num_kept, scale=scale, y=y, dot_out=dot_out)  # compile, memo
    gather_sum(out, rows, num_kept, weights=scale)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = scatter_rows(x, rows, num_kept, scale=scale, y=y, dot_out=dot_out)
        back = gather_sum(out, rows, num_kept, weights=scale)
        scatter_rows(x, rows, num_kept, out)
        gather_sum(out, rows, num_kept, back)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    want = gather_sum(scatter_rows(x, rows, num_kept, scale=scale), rows, num_kept, weights=scale)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = scatter_rows(x, rows, num_kept, scale=scale)
        back = gather_sum(out, rows, num_kept, weights=scale)
    back.fill_(NAN)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(back, want)


def test_argument_errors_name_the_argument():
    rows, num_kept = routing(16, 2, 4, 0.0, seed=20)
    x = randn((16, 64), torch.bfloat16, seed=21)
    out = torch.empty(32, 64, dtype=torch.bfloat16, device="cuda")
    floats = torch.ones(16, 2, device="cuda")
    scatter_rows(x, rows, num_kept, out)  # a valid call first: the checks are memoized per signature
    gather_sum(out, rows, num_kept, x)
    cases = [
        (TypeError, "scatter_rows: x", lambda: scatter_rows(x.float(), rows, num_kept)),
        (ValueError, "scatter_rows: x must be contiguous", lambda: scatter_rows(x.t(), rows.t().contiguous(), num_kept)),
        (ValueError, "H=12", lambda: scatter_rows(randn((16, 12), torch.bfloat16, 0), rows, num_kept)),
        (TypeError, "scatter_rows: rows", lambda: scatter_rows(x, rows.long(), num_kept, out)),
        (ValueError, "scatter_rows: rows", lambda: scatter_rows(x, rows.cpu(), num_kept, out)),
        (ValueError, "scatter_rows: rows", lambda: scatter_rows(x, rows[:8], num_kept)),
        (ValueError, "k=17", lambda: scatter_rows(x, rows.repeat(1, 9)[:, :17].contiguous(), num_kept)),
        (ValueError, "scatter_rows: num_kept", lambda: scatter_rows(x, rows, num_kept.repeat(2))),
        (TypeError, "scatter_rows: num_kept", lambda: scatter_rows(x, rows, num_kept.long(), out)),
        (ValueError, "scatter_rows: out", lambda: scatter_rows(x, rows, num_kept, out[:16])),
        (TypeError, "scatter_rows: out", lambda: scatter_rows(x, rows, num_kept, out.half())),
        (ValueError, "scatter_rows: out data pointer", lambda: scatter_rows(
            x, rows, num_kept, torch.empty(32 * 64 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(32, 64))),
        (TypeError, "scatter_rows: scale", lambda: scatter_rows(x, rows, num_kept, out, scale=floats.double())),
        (ValueError, "scatter_rows: y and dot_out", lambda: scatter_rows(x, rows, num_kept, out, y=out)),
        (ValueError, "scatter_rows: y", lambda: scatter_rows(x, rows, num_kept, out, y=out[:8], dot_out=floats)),
        (TypeError, "scatter_rows: dot_out", lambda: scatter_rows(x, rows, num_kept, out, y=out, dot_out=floats.half())),
        (TypeError, "gather_sum: src", lambda: gather_sum(out.float(), rows, num_kept)),
        (ValueError, "gather_sum: out", lambda: gather_sum(out, rows, num_kept, out)),
        (TypeError, "gather_sum: rows", lambda: gather_sum(out, rows.float(), num_kept, x)),
        (TypeError, "gather_sum: weights", lambda: gather_sum(out, rows, num_kept, x, weights=floats.half())),
        (ValueError, "gather_sum: weights", lambda: gather_sum(out, rows, num_kept, x, weights=floats[:, :1])),
    ]
    missed = []
    for error, message, call in cases:
        try:
            with pytest.raises(error, match=message):
                call()
        except pytest.fail.Exception as failure:
            missed.append(f"{message!r}: {failure}")
    assert not missed, "\n".join(missed)


@pytest.mark.parametrize("tokens,k,hidden", SHAPES + [(40, 3, 64), (24, 8, 4096)])
@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scatter_cast_rows_equals_the_cast_of_the_scattered_rows(tokens, k, hidden, power_2_scales, dtype):
    """Each kept row's E4M3 data and 1x128 multipliers bit for bit the row cast of the bf16/fp16
    scatter (partial last blocks, rows of varied range, an all-zero token, a token with Inf and
    NaN); dropped slots' rows zero."""
    rows, num_kept = routing(tokens, k, 8, 0.2, seed=tokens + k)
    x = randn((tokens, hidden), dtype, seed=hidden) * torch.logspace(-6, 6, tokens, device="cuda").to(dtype)[:, None]
    x[0] = 0
    if tokens > 2:
        x[1, :3] = torch.tensor([float("inf"), float("nan"), -float("inf")], dtype=dtype)
    data, scale_inv = scatter_cast_rows(x, rows, num_kept, power_2_scales)
    m, blocks = tokens * k, -(-hidden // 128)
    assert data.shape == (m, hidden) and scale_inv.shape == (m, blocks) and data.dtype == torch.float8_e4m3fn
    want_data, want_scale = block_quantize_sm90(scatter_rows(x, rows, num_kept), 1, power_2_scales)
    kept = int(num_kept[0])
    assert torch.equal(data[:kept].view(torch.uint8), want_data[:kept].view(torch.uint8))
    assert torch.equal(scale_inv[:kept], want_scale[:kept])
    assert not data[kept:].view(torch.uint8).any() and not scale_inv[kept:].any()


def test_scatter_cast_rows_argument_errors():
    rows, num_kept = routing(16, 2, 4, 0.0, seed=3)
    x = randn((16, 64), torch.bfloat16, seed=4)
    scatter_cast_rows(x, rows, num_kept)  # a valid call first: the checks are memoized per signature
    for error, message, call in [
        (TypeError, "scatter_cast_rows: x", lambda: scatter_cast_rows(x.float(), rows, num_kept)),
        (ValueError, "H=12", lambda: scatter_cast_rows(randn((16, 12), torch.bfloat16, 0), rows, num_kept)),
        (TypeError, "scatter_cast_rows: rows", lambda: scatter_cast_rows(x, rows.long(), num_kept)),
        (TypeError, "power_2_scales must be a bool", lambda: scatter_cast_rows(x, rows, num_kept, 1)),
    ]:
        with pytest.raises(error, match=message):
            call()
