"""Every op, forward and backward, against a float64 reference."""

import pytest
import torch

import reference as ref
from te_fused_ops import ClampedSwiGLU, GeGLU, GroupedLinear, ScaledSwiGLU, SReLU, SwiGLU
from te_fused_ops.errors import OpValueError

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SPLITS = {
    "uneven_with_padding": ([0, 9, 0, 20, 0], 37),  # zero-size first/middle/last groups, 8 padding rows
    "one_group_all_rows": ([0, 0, 32, 0, 0], 32),
    "exact": ([7, 1, 3, 12, 9], 32),
}


def leaf(t, dtype):
    return t.to(dtype).detach().requires_grad_(True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(SPLITS))
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_linear(dtype, case, bias):
    torch.manual_seed(hash((case, bias)) % 1000)
    splits, rows = SPLITS[case]
    op = GroupedLinear(5, 24, 16, bias=bias, dtype=dtype)
    x = leaf(torch.randn(rows, 24), dtype)
    y = op(x, split_sizes=torch.tensor(splits))
    dy = torch.randn_like(y)
    y.backward(dy)

    x64 = leaf(x, torch.float64)
    w64 = leaf(op.weight, torch.float64)
    b64 = leaf(op.bias, torch.float64) if bias else None
    y64 = ref.grouped_linear(x64, w64, b64, splits)
    y64.backward(dy.double())

    tol = ref.TOL[dtype]
    assert y.dtype == dtype and y.shape == (rows, 16)
    assert ref.rel_err(y, y64) <= tol
    assert ref.rel_err(x.grad, x64.grad) <= tol
    assert ref.rel_err(op.weight.grad, w64.grad) <= tol
    if bias:
        assert ref.rel_err(op.bias.grad, b64.grad) <= tol
    padding = slice(sum(splits), rows)
    assert torch.all(y[padding] == 0) and torch.all(x.grad[padding] == 0)


def test_grouped_linear_int64_and_int32_splits_agree():
    op = GroupedLinear(3, 8, 8)
    x = torch.randn(10, 8)
    a = op(x, split_sizes=torch.tensor([3, 0, 7], dtype=torch.int64))
    b = op(x, split_sizes=torch.tensor([3, 0, 7], dtype=torch.int32))
    assert torch.equal(a, b)


def test_grouped_linear_many_groups():
    torch.manual_seed(1)
    splits = [int(v) for v in torch.randint(0, 4, (64,))]
    op = GroupedLinear(64, 16, 8, dtype=torch.float64)
    x = torch.randn(sum(splits) + 3, 16, dtype=torch.float64)
    y = op(x, split_sizes=torch.tensor(splits))
    assert ref.rel_err(y, ref.grouped_linear(x, op.weight.detach(), None, splits)) <= 1e-12


def test_grouped_linear_init_like_nn_linear():
    torch.manual_seed(0)
    op = GroupedLinear(4, 256, 64, bias=True)
    bound = 1 / 256**0.5
    assert op.weight.abs().max() <= bound and op.bias.abs().max() <= bound
    assert op.weight[0].std() > 0.4 * bound and not torch.equal(op.weight[0], op.weight[1])


ACTIVATIONS = {
    "swiglu": (SwiGLU, ref.swiglu),
    "geglu": (GeGLU, ref.geglu),
    "srelu": (SReLU, ref.srelu),
    "clamped_swiglu": (ClampedSwiGLU, ref.clamped_swiglu),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_activation(dtype, name):
    torch.manual_seed(3)
    cls, fn = ACTIVATIONS[name]
    x = leaf(torch.randn(33, 64) * 4, dtype)  # x4: reaches the GPT-OSS clamp limit
    y = cls()(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = leaf(x, torch.float64)
    y64 = fn(x64)
    y64.backward(dy.double())
    assert y.shape == y64.shape and y.dtype == dtype
    assert ref.rel_err(y, y64) <= ref.TOL[dtype]
    assert ref.rel_err(x.grad, x64.grad) <= ref.TOL[dtype]


def test_clamped_swiglu_options():
    x = torch.randn(8, 16, dtype=torch.float64) * 3
    y = ClampedSwiGLU(limit=2.0, alpha=1.0)(x)
    assert torch.allclose(y, ref.clamped_swiglu(x, limit=2.0, alpha=1.0))
    with pytest.raises(OpValueError, match=r"ClampedSwiGLU: argument 'alpha' must be finite, got nan"):
        ClampedSwiGLU(alpha=float("nan"))
    with pytest.raises(OpValueError, match=r"ClampedSwiGLU: argument 'limit' must be positive, got 0"):
        ClampedSwiGLU(limit=0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_swiglu(dtype):
    torch.manual_seed(4)
    x = leaf(torch.randn(21, 32), dtype)
    probs = leaf(torch.rand(21), torch.float32)
    y = ScaledSwiGLU()(x, probs=probs)
    dy = torch.randn_like(y)
    y.backward(dy)
    x64, p64 = leaf(x, torch.float64), leaf(probs, torch.float64)
    y64 = ref.scaled_swiglu(x64, p64)
    y64.backward(dy.double())
    tol = ref.TOL[dtype]
    assert ref.rel_err(y, y64) <= tol
    assert ref.rel_err(x.grad, x64.grad) <= tol
    assert ref.rel_err(probs.grad, p64.grad) <= tol
    assert probs.grad.dtype == torch.float32


def test_scaled_swiglu_takes_rows():
    """A probability per row of a 2-D x; another rank is refused by name, not left to a broadcast
    inside the op."""
    x, probs = torch.randn(3, 5, 16), torch.rand(3)
    with pytest.raises(OpValueError, match=r"ScaledSwiGLU: argument 'x' must be 2-D \(rows, 2 I\), got shape \(3, 5, 16\)"):
        ScaledSwiGLU()(x, probs=probs)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_current", "mxfp8"])
@pytest.mark.parametrize("transpose", [False, True])
def test_grouped_linear_on_quantized_input(recipe, transpose):
    """Quantize -> [Transpose ->] GroupedLinear computes in the recipe: equal to a float64 GEMM
    on the dequantized operands, and within FP8 tolerance of the unquantized layer (fwd and bwd)."""
    from te_fused_ops import Quantize, Sequential, Transpose
    from te_fused_ops.quantization import quantize, quantize_weight

    torch.manual_seed(5)
    splits, rows = [0, 150, 0, 90], 256
    op = GroupedLinear(4, 256, 128, bias=True)
    seq = Sequential(Quantize(recipe), *([Transpose()] if transpose else []), op)
    x = torch.randn(rows, 256, requires_grad=True)
    y = seq(x, split_sizes=torch.tensor(splits))
    dy = torch.randn_like(y)
    y.backward(dy)

    x_deq = quantize(x.detach(), recipe).dequantize().double()
    w_deq = quantize_weight(op.weight.detach(), recipe).dequantize().double()
    emulated = ref.grouped_linear(x_deq, w_deq, op.bias.detach().double(), splits)
    assert ref.rel_err(y, emulated) <= 1e-5

    x64, w64 = leaf(x, torch.float64), leaf(op.weight, torch.float64)
    y64 = ref.grouped_linear(x64, w64, op.bias.detach().double(), splits)
    y64.backward(dy.double())
    assert 0 < ref.rel_err(y, y64) <= 0.08
    assert ref.rel_err(x.grad, x64.grad) <= 0.08
    assert ref.rel_err(op.weight.grad, w64.grad) <= 0.08
    assert torch.all(y[240:] == 0) and torch.all(x.grad[240:] == 0)


def test_quantize_op_straight_through_and_grad_quantization():
    from te_fused_ops import Quantize
    from te_fused_ops.quantization import QuantizedTensor, fake_quantize

    x = torch.randn(8, 128, requires_grad=True)
    dy = torch.randn(8, 128)
    y = Quantize("fp8_blockwise")(x)
    assert isinstance(y, QuantizedTensor) and ref.rel_err(y.dequantize(), x) <= 0.05
    y.backward(dy)
    assert torch.equal(x.grad, dy)
    x.grad = None
    Quantize("fp8_blockwise", quantize_grad=True)(x).backward(dy)
    assert torch.equal(x.grad, fake_quantize(dy, "fp8_blockwise")) and not torch.equal(x.grad, dy)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_high_precision_wgrad_reads_the_unquantized_operands(dtype):
    """Quantize(Float8BlockScaling(high_precision_wgrad=True)), Transpose, GroupedLinear: the
    output and dx are the FP8 chain's bit for bit; dW is the 16-bit weight gradient of the
    unquantized x and dy exactly; the Transpose makes no column-wise copy."""
    from te_fused_ops import Quantize, Sequential, Transpose
    from te_fused_ops.grouped_mm import grouped_wgrad
    from te_fused_ops.quantization import Float8BlockScaling

    torch.manual_seed(0)
    splits = torch.tensor([40, 0, 88])
    x = torch.randn(136, 256, dtype=dtype, requires_grad=True)
    dy = torch.randn(136, 128, dtype=dtype)
    results = []
    for recipe in (Float8BlockScaling(high_precision_wgrad=True), Float8BlockScaling()):
        torch.manual_seed(1)
        seq = Sequential(Quantize(recipe), Transpose(), GroupedLinear(3, 256, 128, dtype=dtype))
        x.grad = None
        y = seq(x, split_sizes=splits)
        y.backward(dy)
        results.append((y.detach(), x.grad.clone(), seq[2].weight.grad))
    (y, dx, dw), (y8, dx8, dw8) = results
    assert torch.equal(y, y8) and torch.equal(dx, dx8) and not torch.equal(dw, dw8)
    offsets = torch.tensor([0, 40, 40, 128], dtype=torch.int32)
    assert torch.equal(dw, grouped_wgrad(dy, x.detach(), offsets))
    quantize = Quantize(Float8BlockScaling(high_precision_wgrad=True))
    made = Transpose()(quantize(x.detach()), split_sizes=splits)
    assert made.columnwise_data is None and torch.equal(made.source, x.detach())
    assert repr(quantize) == "Quantize(recipe=fp8_blockwise(high_precision_wgrad=True), quantize_grad=False)"
    assert repr(Quantize("fp8_blockwise")) == "Quantize(recipe=fp8_blockwise, quantize_grad=False)"
