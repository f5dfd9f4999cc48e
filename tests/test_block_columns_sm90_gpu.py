"""GPU tests of the block-padded column-wise cast (`block_columns_sm90`: the columns alone from 16-bit or
E4M3 rows, or rows and columns from one read): bit for bit the torch quantizer's per-group
column-wise copy (and row-wise copy), laid out as the FP8 weight gradient reads it."""

import pytest
import torch
from test_block_quantize_sm90_gpu import every_amax_value_pair
from test_grouped_wgrad_fp8_sm90_gpu import block_padded
from test_grouped_wgrad_sm90_gpu import offsets_from_splits

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.backends.sm90.kernels.block_quantize import block_columns_sm90
from te_fused_ops.quantization import Float8BlockScaling, add_columnwise, quantize

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]


def make_x(m, c, dtype, seed, specials=True):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, c, device="cuda", generator=gen) * 4.0 ** torch.randint(-8, 8, (m, 1), device="cuda", generator=gen)
    if specials and m > 40 and c > 3:
        x[3, 1], x[40, 2], x[17, 0] = float("nan"), float("inf"), 0.0
        x[20:30, 3] = 0.0  # an all-zero column block piece
    return x.to(dtype)


def used_blocks(offsets, m):
    ends = offsets[1:].long().clamp(0, m).cummax(0).values
    starts = torch.cat([ends.new_zeros(1), ends[:-1]])
    return int(((ends - starts + 127) // 128).sum())


def check_columns(columns, expected, used):
    """Data bytes and multipliers of the first ``used`` blocks equal."""
    assert columns.num_tokens == expected.num_tokens
    assert torch.equal(columns.data.view(torch.uint8)[:, : 128 * used], expected.data.view(torch.uint8)[:, : 128 * used])
    assert torch.equal(columns.scale_inv[:used], expected.scale_inv[:used])


def poison(m, c, g):
    """NaN bytes and multipliers where a wrapper's row-wise (M, C) and per-group column-wise copies
    (and their multipliers) will be allocated, so that its torch.empty outputs start poisoned."""
    blocks = -(-m // 128) + g
    held = [torch.full((m * c,), 0xFF, dtype=torch.uint8, device="cuda"),
            torch.full((m, -(-c // 128)), float("nan"), device="cuda"),
            torch.full((c * 128 * blocks,), 0xFF, dtype=torch.uint8, device="cuda"),
            torch.full((blocks, c), float("nan"), device="cuda")]
    del held


SPLITS = [0, 1, 127, 128, 129, 300, 0, 513, 17, 256]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("c", [8, 200, 384])
def test_from_16bit_with_rows(dtype, power_2_scales, c):
    m = sum(SPLITS) + 29  # padding rows past the last group
    x = make_x(m, c, dtype, seed=c)
    offsets = offsets_from_splits(SPLITS)
    recipe = Float8BlockScaling(power_2_scales)
    poison(m, c, len(SPLITS))
    columns, row_data, row_scale_inv = block_columns_sm90(x, offsets, rows=True, power_2_scales=power_2_scales)
    q = quantize(x, recipe, rowwise=True, columnwise=True, offsets=offsets)
    check_columns(columns, block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets), used_blocks(offsets, m))
    grouped = sum(SPLITS)
    assert torch.equal(row_data.view(torch.uint8)[:grouped], q.rowwise_data.view(torch.uint8)[:grouped])
    assert torch.equal(row_scale_inv[:grouped], q.rowwise_scale_inv[:grouped])
    alone = block_columns_sm90(x, offsets, power_2_scales=power_2_scales)
    check_columns(alone, columns, used_blocks(offsets, m))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("power_2_scales", [False, True])
def test_tiny_and_large_blocks(dtype, power_2_scales):
    """Blocks whose multipliers fall below 2**-60 (the scaled division) or sit near the format's
    largest values, subnormal inputs, and columns whose 128 tokens mix both."""
    m, c = 700, 264
    x = make_x(m, c, torch.float32, seed=11, specials=False)
    if dtype == torch.bfloat16:
        x[:, :64] *= 2.0**-120
        x[:, 64:128] *= 2.0**100
    else:
        x[:, :64] *= 2.0**-20  # fp16 subnormals
        x[:, 64:128] = x[:, 64:128].clamp(-1, 1) * 60000.0
    x[::7, 200:] *= 2.0**-30
    x = x.to(dtype)
    offsets = offsets_from_splits([300, 0, 129, 271])
    columns, row_data, row_scale_inv = block_columns_sm90(x, offsets, rows=True, power_2_scales=power_2_scales)
    q = quantize(x, Float8BlockScaling(power_2_scales), rowwise=True, columnwise=True, offsets=offsets)
    check_columns(columns, block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets), used_blocks(offsets, m))
    assert torch.equal(row_data.view(torch.uint8), q.rowwise_data.view(torch.uint8))
    assert torch.equal(row_scale_inv, q.rowwise_scale_inv)
    alone = block_columns_sm90(x, offsets, power_2_scales=power_2_scales)
    check_columns(alone, columns, used_blocks(offsets, m))


@pytest.mark.parametrize("power_2_scales", [False, True])
def test_from_rowwise_e4m3(power_2_scales):
    """The copy `add_columnwise` makes from the dequantized row-wise values (Quantize, Transpose),
    with NaN, a saturated Inf and signed zeros among the E4M3 bytes (converted two at a time)."""
    m, c = sum(SPLITS) + 3, 256
    x = make_x(m, c, torch.bfloat16, seed=7)
    x[5, 9], x[6, 130] = -0.0, -1e-30
    offsets = offsets_from_splits(SPLITS)
    q = quantize(x, Float8BlockScaling(power_2_scales))
    columns = block_columns_sm90(q.rowwise_data, offsets, x_scale_inv=q.rowwise_scale_inv, power_2_scales=power_2_scales)
    add_columnwise(q, offsets)
    check_columns(columns, block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets), used_blocks(offsets, m))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_amax_value_pair_in_rows_and_columns(dtype):
    """Both passes divide in the plain form wherever a warp's multipliers and values allow it and in
    the general form elsewhere: every (block amax, value) pair of ``dtype`` (with both signs) as 1 x
    128 row blocks (the rows pass) and the same blocks transposed into 128-token columns (the columns
    pass), each bit for bit the torch quantizer."""
    parts = 8
    for part in range(parts):
        blocks = every_amax_value_pair(dtype, part, parts)  # (R, 128): row r one block
        m = blocks.shape[0]
        offsets = torch.tensor([0, m], dtype=torch.int32, device="cuda")
        columns, row_data, row_scale_inv = block_columns_sm90(blocks, offsets, rows=True)
        q = quantize(blocks, "fp8_blockwise", rowwise=True, columnwise=True, offsets=offsets)
        assert torch.equal(row_data.view(torch.uint8), q.rowwise_data.view(torch.uint8))
        assert torch.equal(row_scale_inv, q.rowwise_scale_inv)
        check_columns(columns, block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets), used_blocks(offsets, m))
        del columns, row_data, row_scale_inv, q
        width = -(-m // 8) * 8  # the blocks as columns, zero columns up to a multiple of 8
        tokens = torch.zeros(128, width, dtype=dtype, device="cuda")
        tokens[:, :m] = blocks.t()
        one_block = torch.tensor([0, 128], dtype=torch.int32, device="cuda")
        columns = block_columns_sm90(tokens, one_block)
        q = quantize(tokens, "fp8_blockwise", rowwise=False, columnwise=True, offsets=one_block)
        check_columns(columns, block_padded(q.columnwise_data, q.columnwise_scale_inv, one_block), 1)
        del blocks, tokens, columns, q


@pytest.mark.parametrize("source", ["16bit", "16bit_rows", "e4m3_rows"])
def test_many_non_finite_values(source):
    """NaN and +-Inf in many rows and columns: the kernel's amax (one instruction a value, NaN and
    Inf recomputed out where a warp's columns or rows hold any) still ignores them as the torch
    quantizer does, and finite neighbours keep their own multipliers."""
    m, c = 3000, 392
    x = make_x(m, c, torch.float32, seed=13, specials=False)
    gen = torch.Generator(device="cuda").manual_seed(14)
    draw = torch.rand(m, c, device="cuda", generator=gen)
    x[draw < 0.003] = float("nan")
    x[(draw >= 0.003) & (draw < 0.006)] = float("inf")
    x[(draw >= 0.006) & (draw < 0.008)] = -float("inf")
    x = x.bfloat16()
    splits = [700, 0, 1, 1200, 99, 900]
    offsets = offsets_from_splits(splits)
    used = used_blocks(offsets, m)
    if source == "e4m3_rows":
        q = quantize(x, "fp8_blockwise")
        columns = block_columns_sm90(q.rowwise_data, offsets, x_scale_inv=q.rowwise_scale_inv)
        add_columnwise(q, offsets)
    else:
        q = quantize(x, "fp8_blockwise", rowwise=True, columnwise=True, offsets=offsets)
        made = block_columns_sm90(x, offsets, rows=source == "16bit_rows")
        columns = made[0] if source == "16bit_rows" else made
        if source == "16bit_rows":
            grouped = sum(splits)
            assert torch.equal(made[1].view(torch.uint8)[:grouped], q.rowwise_data.view(torch.uint8)[:grouped])
            assert torch.equal(made[2][:grouped], q.rowwise_scale_inv[:grouped])
    check_columns(columns, block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets), used)


def test_pads_are_zero_and_offsets_clamped():
    """Tokens past a group's end read as zeros; offsets past M or decreasing are clamped as the
    torch quantizer clamps them."""
    m, c = 300, 128
    x = make_x(m, c, torch.bfloat16, seed=3, specials=False)
    offsets = torch.tensor([0, 100, 90, 250, 1000], dtype=torch.int32, device="cuda")
    columns = block_columns_sm90(x, offsets)
    q = quantize(x, "fp8_blockwise", rowwise=False, columnwise=True, offsets=offsets)
    used = used_blocks(offsets, m)
    check_columns(columns, block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets), used)
    assert torch.all(columns.data.view(torch.uint8)[:, 100:128] == 0)


@pytest.mark.parametrize("rows", [False, True])
def test_many_groups_no_sync_cuda_graph(rows):
    """500 groups (empty ones among them), no host sync, and a CUDA graph's replay into NaN-filled
    outputs; with ``rows`` the row-wise copy too, on the graph's 200-column width (a partial
    column block)."""
    splits = [(g * 53) % 300 for g in range(500)]
    m, c = sum(splits), 200 if rows else 64
    x = make_x(m, c, torch.bfloat16, seed=5)
    offsets = offsets_from_splits(splits)
    q = quantize(x, "fp8_blockwise", rowwise=rows, columnwise=True, offsets=offsets)
    expected = block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets)
    block_columns_sm90(x, offsets, rows=rows)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block_columns_sm90(x, offsets, rows=rows)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        made = block_columns_sm90(x, offsets, rows=rows)
    columns = made[0] if rows else made
    for t in (made[1:] if rows else ()) + (columns.data, columns.scale_inv):
        t.view(torch.uint8).fill_(0xFF)
    graph.replay()
    check_columns(columns, expected, used_blocks(offsets, m))
    if rows:
        assert torch.equal(made[1].view(torch.uint8), q.rowwise_data.view(torch.uint8))
        assert torch.equal(made[2], q.rowwise_scale_inv)


def test_argument_errors():
    x = torch.zeros(32, 16, dtype=torch.bfloat16, device="cuda")
    offsets = offsets_from_splits([16, 16])
    with pytest.raises(TypeError, match="x has dtype torch.float32"):
        block_columns_sm90(x.float(), offsets)
    with pytest.raises(ValueError, match="x_scale_inv must be a contiguous float32"):
        block_columns_sm90(x.to(torch.float8_e4m3fn), offsets, x_scale_inv=torch.ones(32, 2, device="cuda"))
    with pytest.raises(ValueError, match="rows=True needs a bf16/fp16 x"):
        block_columns_sm90(x.to(torch.float8_e4m3fn), offsets, x_scale_inv=torch.ones(32, 1, device="cuda"), rows=True)
    with pytest.raises(ValueError, match="G <= 512"):
        block_columns_sm90(x, offsets_from_splits([0] * 513))
    with pytest.raises(TypeError, match="offsets must be an int32"):
        block_columns_sm90(x, offsets.long())
