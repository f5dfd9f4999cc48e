"""GPU tests of the E4M3 quantization kernels: bit for bit the torch quantizer of the
"fp8_blockwise" and "fp8_current" recipes (data bytes and scales) and `QuantizedTensor.dequantize`,
edge blocks, non-finite values, padding rows, no host sync."""

import pytest
import torch

from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.backends.sm90.kernels.block_quantize import (
    block_dequantize_sm90,
    block_quantize_sm90,
    tensor_quantize_sm90,
)
from te_fused_ops.quantization import Float8BlockScaling, quantize, quantize_weight
from test_grouped_dgrad_sm90_gpu import poison_allocator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        torch.cuda.is_available() and sm90_unavailable_reason() is not None,
        reason=str(sm90_unavailable_reason()) if torch.cuda.is_available() else "",
    ),
]


def sample(shape, dtype, seed):
    """Values over many binades (rows / groups of different ranges), exact zeros, subnormal-sized
    values, and NaN / +-Inf in a few places."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=gen)
    x = x * torch.exp2(torch.randint(-20, 12, shape[:-1] + (1,), device="cuda", generator=gen).float())
    flat = x.view(-1)
    flat[:7] = 0.0
    flat[7:12] = torch.tensor([1e-30, -3e-41, 2.0**-140, float("nan"), float("inf")])
    flat[-3:] = torch.tensor([float("-inf"), -0.0, 448.0 * 2.0**-20])
    return x.to(dtype)


def assert_same_bytes(data, expected):
    a, b = data.view(torch.uint8), expected.view(torch.uint8)
    both_nan = torch.isnan(data.float()) & torch.isnan(expected.float())
    mismatches = ((a != b) & ~both_nan).sum().item()
    assert mismatches == 0, f"{mismatches} E4M3 bytes differ from the torch quantizer"


def tiny_rows(x):
    """x with rows 1-3 scaled into the smallest binades (amax ~1e-36, ~1e-39 and ~1e-44 for
    bf16: power-of-two scales below 2**-100 and subnormal; fp16 flushes them to zero)."""
    if x.shape[-2] >= 4:
        for row, scale in ((1, 1e-36), (2, 1e-39), (3, 1e-44)):
            x[..., row, :] = (x[..., row, :].float().clamp(-4, 4) * scale).to(x.dtype)
    return x


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 128), (300, 200), (1000, 2048), (33, 80)])
def test_rowwise_matches_torch_bit_for_bit(shape, dtype, power_2_scales):
    x = tiny_rows(sample(shape, dtype, seed=shape[0]))
    data, scale_inv = block_quantize_sm90(x, 1, power_2_scales)
    want = quantize(x, Float8BlockScaling(power_2_scales=power_2_scales))
    assert scale_inv.shape == want.rowwise_scale_inv.shape
    assert torch.equal(scale_inv, want.rowwise_scale_inv)
    assert_same_bytes(data, want.rowwise_data)


def every_amax_value_pair(dtype, part, parts):
    """Part ``part`` of ``parts`` of the 1 x 128 blocks that hold every (block amax, value) pair of
    ``dtype``: column 0 a finite magnitude a (every one, 0 included), the other 127 every magnitude
    <= a in chunks of 127 (the last chunk repeats a); rows with every sign flipped follow."""
    top = {torch.bfloat16: 0x7F7F, torch.float16: 0x7BFF}[dtype]  # largest finite magnitude's bits
    amax = torch.arange(top + 1, device="cuda", dtype=torch.int32)
    amax = amax[part::parts]
    chunks = amax // 127 + 1
    row_amax = torch.repeat_interleave(amax, chunks)
    ends = torch.cumsum(chunks, 0)
    chunk = torch.arange(len(row_amax), device="cuda", dtype=torch.int32) - torch.repeat_interleave(ends - chunks, chunks)
    mags = torch.minimum(chunk[:, None] * 127 + torch.arange(127, device="cuda", dtype=torch.int32), row_amax[:, None])
    bits = torch.cat([row_amax[:, None], mags], 1).to(torch.int16)
    bits = torch.cat([bits, bits | -0x8000])  # the sign bit
    return bits.view(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_amax_value_pair_matches_torch_bit_for_bit(dtype):
    """The float32-scale cast divides by a reciprocal and an exact-residual correction, not an IEEE
    division: equal to the torch quantizer's division for every value a block can hold with every
    amax it can have (the scale is amax / 448 of a bf16 / fp16 amax). A per-tensor scale is one of
    these scales, so this covers its values up to the amax too; the ones above it (padding rows)
    saturate, `test_tensor_scale_rows_match_torch_bit_for_bit`."""
    parts = 4
    for part in range(parts):
        x = every_amax_value_pair(dtype, part, parts)
        data, scale_inv = block_quantize_sm90(x, 1)
        want = quantize(x, "fp8_blockwise")
        assert torch.equal(scale_inv, want.rowwise_scale_inv)
        assert_same_bytes(data, want.rowwise_data)
        del data, want, x


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("shape", [(2, 128, 128), (3, 300, 200), (8, 384, 1024), (1, 1, 16), (5, 1552, 2056)])
def test_weight_blocks_match_torch_bit_for_bit(shape, power_2_scales):
    w = sample(shape, torch.bfloat16, seed=sum(shape))
    if shape[1] >= 256:  # a whole 128 x 128 block of tiny values
        w[:, 128:256] = (w[:, 128:256].float().clamp(-4, 4) * 1e-39).to(w.dtype)
    data, scale_inv = block_quantize_sm90(w, 128, power_2_scales)
    want = quantize_weight(w, Float8BlockScaling(power_2_scales=power_2_scales))
    assert torch.equal(scale_inv, want.rowwise_scale_inv)
    assert_same_bytes(data, want.rowwise_data)


@pytest.mark.parametrize("power_2_scales", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(2, 128, 128), (3, 304, 208), (8, 384, 1024), (1, 16, 16), (2, 1536, 2048),
                                   (5, 1552, 2064)])
def test_weight_blocks_with_transposed_copy(shape, dtype, power_2_scales):
    """transposed=True: the same data and scales as the plain cast (the torch quantizer's), and
    each group of both transposed; edge blocks of 16-multiple extents; outputs poisoned. The last
    shape has more blocks than the persistent grid has CTAs: each CTA casts several, reusing its
    shared-memory tile of the transposed copy."""
    w = tiny_rows(sample(shape, dtype, seed=sum(shape) + 1))
    g, n, k = shape
    poison_allocator((shape, torch.float8_e4m3fn), ((g, k, n), torch.float8_e4m3fn))
    data, scale_inv, data_t, scale_inv_t = block_quantize_sm90(w, 128, power_2_scales, transposed=True)
    want = quantize_weight(w, Float8BlockScaling(power_2_scales=power_2_scales))
    assert torch.equal(scale_inv, want.rowwise_scale_inv)
    assert_same_bytes(data, want.rowwise_data)
    assert_transposed_copy(data, scale_inv, data_t, scale_inv_t)


@pytest.mark.parametrize("cast", [block_quantize_sm90, tensor_quantize_sm90])
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("shape", [(3, 304, 208), (2, 1536, 2048)])
def test_weight_blocks_into_kept_outputs(shape, transposed, cast):
    """``out=``: a second weight cast into an earlier call's NaN-filled outputs writes every byte
    of them, bit for bit a fresh cast of the second weight, and returns those tensors."""
    first, second = (tiny_rows(sample(shape, torch.bfloat16, seed=sum(shape) + s)) for s in (2, 3))
    kept = cast(first, 128, transposed=transposed)
    for t in kept:
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x7F)  # E4M3 NaN
        else:
            t.fill_(float("nan"))
    got = cast(second, 128, transposed=transposed, out=kept)
    assert len(got) == len(kept) and all(a is b for a, b in zip(got, kept))
    for a, b in zip(got, cast(second, 128, transposed=transposed)):
        if a.dtype == torch.float8_e4m3fn:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        else:
            assert torch.equal(a, b)


def test_weight_blocks_into_wrong_outputs_are_refused():
    w = torch.zeros(2, 256, 384, dtype=torch.bfloat16, device="cuda")
    data, scale_inv, data_t, scale_inv_t = block_quantize_sm90(w, 128, transposed=True)
    with pytest.raises(TypeError, match="block_quantize_sm90: out must be a tuple of 4 tensors"):
        block_quantize_sm90(w, 128, transposed=True, out=(data, scale_inv))
    with pytest.raises(ValueError, match=r"block_quantize_sm90: out\[2\] must be .* shape \(2, 384, 256\)"):
        block_quantize_sm90(w, 128, transposed=True, out=(data, scale_inv, data, scale_inv_t))
    with pytest.raises(ValueError, match=r"block_quantize_sm90: out\[1\] must be a contiguous"):
        block_quantize_sm90(w, 128, out=(data, scale_inv_t.transpose(1, 2)))
    with pytest.raises(ValueError, match=r"block_quantize_sm90: out\[0\] must be .*torch.float8_e4m3fn"):
        block_quantize_sm90(w, 128, out=(w, scale_inv))


def assert_transposed_copy(data, scale_inv, data_t, scale_inv_t):
    g, n, k = data.shape
    assert data_t.shape == (g, k, n) and data_t.is_contiguous() and scale_inv_t.is_contiguous()
    assert torch.equal(data_t.view(torch.uint8), data.view(torch.uint8).transpose(1, 2))
    assert torch.equal(scale_inv_t, scale_inv.transpose(1, 2))


def tensor_case(shape, dtype, seed, scale):
    """``sample`` scaled by ``scale`` (1e-39: a subnormal per-tensor scale_inv; 0: all zeros)."""
    x = sample(shape, dtype, seed).float()
    return (x * scale if scale else torch.zeros_like(x)).to(dtype)


def assert_tensor_scale(multipliers, want_scale_inv, grid):
    """Every block of the multiplier grid holds the torch quantizer's one scale_inv."""
    assert multipliers.shape == grid and multipliers.dtype == torch.float32
    assert torch.equal(multipliers, want_scale_inv.expand(grid)), (multipliers.unique(), want_scale_inv)


@pytest.mark.parametrize("scale", [1.0, 1e-39, 0.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 128), (300, 200), (1000, 2048), (33, 80), (40000, 256)])
def test_tensor_scale_rows_match_torch_bit_for_bit(shape, dtype, scale):
    """Per-tensor (fp8_current) cast: without offsets, and with offsets whose padding rows hold
    values far above the grouped rows' (and NaN / Inf), which must not change the scale."""
    x = tensor_case(shape, dtype, shape[0] + 7, scale)
    grid = (shape[0], -(-shape[1] // 128))
    poison_allocator((shape, torch.float8_e4m3fn), (grid, torch.float32))
    data, multipliers = tensor_quantize_sm90(x, 1)
    want = quantize(x, "fp8_current")
    assert_tensor_scale(multipliers, want.rowwise_scale_inv, grid)
    assert_same_bytes(data, want.rowwise_data)
    m = shape[0]
    valid = m - m // 3
    x[valid:] = 3e4
    if m - valid >= 2:
        x[valid, 0], x[valid + 1, -1] = float("nan"), float("-inf")
    for offsets in ([0, valid // 2, valid], [0, 0, 0], [0, m + 50, valid], [5, valid, valid // 3]):
        offsets = torch.tensor(offsets, dtype=torch.int32, device="cuda")
        data, multipliers = tensor_quantize_sm90(x, 1, offsets)
        want = quantize(x, "fp8_current", offsets=offsets)
        assert_tensor_scale(multipliers, want.rowwise_scale_inv, grid)
        assert_same_bytes(data, want.rowwise_data)


@pytest.mark.parametrize("scale", [1.0, 1e-39])
@pytest.mark.parametrize("shape", [(2, 128, 128), (3, 300, 200), (8, 384, 1024), (1, 1, 16)])
def test_tensor_scale_weights_match_torch_bit_for_bit(shape, scale):
    w = tensor_case(shape, torch.bfloat16, sum(shape), scale)
    grid = (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
    poison_allocator((shape, torch.float8_e4m3fn), (grid, torch.float32))
    data, multipliers = tensor_quantize_sm90(w, 128)
    want = quantize_weight(w, "fp8_current")
    assert_tensor_scale(multipliers, want.rowwise_scale_inv, grid)
    assert_same_bytes(data, want.rowwise_data)


@pytest.mark.parametrize("scale", [1.0, 1e-39, 0.0])
@pytest.mark.parametrize("shape", [(2, 128, 128), (3, 304, 208), (8, 384, 1024), (1, 16, 16), (5, 1552, 2064)])
def test_tensor_scale_weights_with_transposed_copy(shape, scale):
    """fp8_current's weight cast with ``transposed``: the plain cast's bytes and multipliers, and
    each group of both transposed; outputs poisoned."""
    w = tensor_case(shape, torch.bfloat16, sum(shape) + 3, scale)
    g, n, k = shape
    poison_allocator((shape, torch.float8_e4m3fn), ((g, k, n), torch.float8_e4m3fn))
    data, multipliers, data_t, multipliers_t = tensor_quantize_sm90(w, 128, transposed=True)
    want = quantize_weight(w, "fp8_current")
    assert_tensor_scale(multipliers, want.rowwise_scale_inv, (g, -(-n // 128), -(-k // 128)))
    assert_same_bytes(data, want.rowwise_data)
    assert_transposed_copy(data, multipliers, data_t, multipliers_t)


def assert_same_values(out, expected):
    both_nan = torch.isnan(out) & torch.isnan(expected)
    bits = out.view(torch.int16) != expected.view(torch.int16)
    assert ((bits & ~both_nan).sum().item()) == 0, "dequantized values differ from QuantizedTensor.dequantize"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_blockwise_pow2", "fp8_current"])
@pytest.mark.parametrize("shape", [(1, 128), (301, 200), (1000, 2048), (33, 8)])
def test_dequantize_matches_torch_bit_for_bit(shape, recipe, dtype):
    """Poisoned output; per-tensor (fp8_current) scales go in broadcast to the 1 x 128 grid. fp16
    output saturates where the values pass 65504 (the sample spans 2**-20 .. 2**12 per row)."""
    from te_fused_ops.backends.sm90.linear import block_multipliers
    from te_fused_ops.quantization import Float8BlockScaling

    name = {"fp8_blockwise_pow2": Float8BlockScaling(power_2_scales=True)}.get(recipe, recipe)
    x = sample(shape, torch.float32, seed=shape[0] + len(recipe)) * 32.0
    q = quantize(x, name)
    expected = q.dequantize(dtype)
    out = block_dequantize_sm90(q.rowwise_data, block_multipliers(q.rowwise_scale_inv, q.shape), dtype)
    assert out.dtype == dtype and out.shape == shape
    assert_same_values(out, expected)


def test_empty_and_no_host_sync():
    data, scale_inv = block_quantize_sm90(torch.zeros(0, 256, dtype=torch.bfloat16, device="cuda"), 1)
    assert data.shape == (0, 256) and scale_inv.shape == (0, 2)
    data, scale_inv = tensor_quantize_sm90(torch.zeros(0, 256, dtype=torch.bfloat16, device="cuda"), 1)
    assert data.shape == (0, 256) and scale_inv.shape == (0, 2)
    assert block_dequantize_sm90(data, scale_inv, torch.bfloat16).shape == (0, 256)
    for cast in (block_quantize_sm90, tensor_quantize_sm90):
        made = cast(torch.zeros(2, 0, 128, dtype=torch.bfloat16, device="cuda"), 128, transposed=True)
        assert [tuple(t.shape) for t in made] == [(2, 0, 128), (2, 0, 1), (2, 128, 0), (2, 1, 0)]
    x = sample((512, 512), torch.bfloat16, seed=3)
    offsets = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
    block_quantize_sm90(x, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block_quantize_sm90(x, 1)
        block_quantize_sm90(x.view(4, 128, 512), 128)
        block_dequantize_sm90(*block_quantize_sm90(x, 1), torch.bfloat16)
        block_quantize_sm90(x.view(4, 128, 512), 128, transposed=True)
        tensor_quantize_sm90(x.view(4, 128, 512), 128, transposed=True)
        tensor_quantize_sm90(x, 1, offsets)
        tensor_quantize_sm90(x.view(4, 128, 512), 128)
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_argument_errors():
    x = torch.zeros(64, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="block_quantize_sm90: block_rows must be 1 or 128"):
        block_quantize_sm90(x, 64)
    with pytest.raises(TypeError, match="block_quantize_sm90: x has dtype torch.float32"):
        block_quantize_sm90(x.float(), 1)
    with pytest.raises(ValueError, match="block_quantize_sm90: x must be 3-D"):
        block_quantize_sm90(x, 128)
    with pytest.raises(ValueError, match="block_quantize_sm90: x must be contiguous"):
        block_quantize_sm90(x.t(), 1)
    with pytest.raises(ValueError, match="block_quantize_sm90: x must be on a CUDA device"):
        block_quantize_sm90(x.cpu(), 1)
    with pytest.raises(ValueError, match="block_quantize_sm90: x needs a last dim that is a multiple of 8"):
        block_quantize_sm90(torch.zeros(64, 100, dtype=torch.bfloat16, device="cuda"), 1)
    with pytest.raises(ValueError, match="tensor_quantize_sm90: x must be contiguous"):
        tensor_quantize_sm90(x.t(), 1)
    with pytest.raises(TypeError, match="tensor_quantize_sm90: offsets must be an int32 tensor"):
        tensor_quantize_sm90(x, 1, torch.tensor([0, 64], device="cuda"))
    with pytest.raises(ValueError, match="tensor_quantize_sm90: offsets must be a contiguous 1-D tensor on x's device"):
        tensor_quantize_sm90(x, 1, torch.tensor([0, 64], dtype=torch.int32))
    with pytest.raises(ValueError, match="tensor_quantize_sm90: offsets group the rows of a 2-D x"):
        tensor_quantize_sm90(x.view(1, 64, 256), 128, torch.tensor([0, 64], dtype=torch.int32, device="cuda"))
    data, scale_inv = block_quantize_sm90(x, 1)
    with pytest.raises(TypeError, match="block_dequantize_sm90: dtype must be bfloat16 or float16"):
        block_dequantize_sm90(data, scale_inv, torch.float32)
    with pytest.raises(TypeError, match="block_dequantize_sm90: data has dtype torch.uint8"):
        block_dequantize_sm90(data.view(torch.uint8), scale_inv, torch.bfloat16)
    with pytest.raises(ValueError, match=r"block_dequantize_sm90: scale_inv must have shape \(64, 2\)"):
        block_dequantize_sm90(data, scale_inv[:, :1].contiguous(), torch.bfloat16)
    with pytest.raises(ValueError, match="block_dequantize_sm90: scale_inv must be on data's CUDA device"):
        block_dequantize_sm90(data, scale_inv.cpu(), torch.bfloat16)
    with pytest.raises(ValueError, match="block_quantize_sm90: transposed=True needs a .G, N, K. weight"):
        block_quantize_sm90(x, 1, transposed=True)
    with pytest.raises(ValueError, match=r"N and K multiples of 16, got block_rows=128, shape \(2, 64, 120\)"):
        block_quantize_sm90(torch.zeros(2, 64, 120, dtype=torch.bfloat16, device="cuda"), 128, transposed=True)
    with pytest.raises(ValueError, match=r"tensor_quantize_sm90: transposed=True needs a .G, N, K. weight .* shape \(2, 72, 128\)"):
        tensor_quantize_sm90(torch.zeros(2, 72, 128, dtype=torch.bfloat16, device="cuda"), 128, transposed=True)
