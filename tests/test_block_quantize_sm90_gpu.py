"""GPU tests of the E4M3 block-quantization kernel: bit for bit the torch quantizer of the
"fp8_blockwise" recipe (data bytes and scales), edge blocks, non-finite values, no host sync."""

import pytest
import torch

from te_fused_ops.kernels import sm90_unavailable_reason
from te_fused_ops.kernels.block_quantize import block_quantize_sm90
from te_fused_ops.quantization import quantize, quantize_weight

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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 128), (300, 200), (1000, 2048), (33, 80)])
def test_rowwise_matches_torch_bit_for_bit(shape, dtype):
    x = sample(shape, dtype, seed=shape[0])
    data, scale_inv = block_quantize_sm90(x, 1)
    want = quantize(x, "fp8_blockwise")
    assert scale_inv.shape == want.rowwise_scale_inv.shape
    assert torch.equal(scale_inv, want.rowwise_scale_inv)
    assert_same_bytes(data, want.rowwise_data)


@pytest.mark.parametrize("shape", [(2, 128, 128), (3, 300, 200), (8, 384, 1024), (1, 1, 16)])
def test_weight_blocks_match_torch_bit_for_bit(shape):
    w = sample(shape, torch.bfloat16, seed=sum(shape))
    data, scale_inv = block_quantize_sm90(w, 128)
    want = quantize_weight(w, "fp8_blockwise")
    assert torch.equal(scale_inv, want.rowwise_scale_inv)
    assert_same_bytes(data, want.rowwise_data)


def test_empty_and_no_host_sync():
    data, scale_inv = block_quantize_sm90(torch.zeros(0, 256, dtype=torch.bfloat16, device="cuda"), 1)
    assert data.shape == (0, 256) and scale_inv.shape == (0, 2)
    x = sample((512, 512), torch.bfloat16, seed=3)
    block_quantize_sm90(x, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        block_quantize_sm90(x, 1)
        block_quantize_sm90(x.view(4, 128, 512), 128)
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
