"""The sm90 rules' glue on the CPU: plans of a grouped MLP with every kernel wrapper stood in for
by a torch function of the same contract (the GPU tests check the kernels against those
contracts), against the torch backend. bf16: every activation, bias, router probabilities. FP8:
weights get 128 x 128 blocks of very different magnitudes, so a scale handed over in the wrong
layout (the data gradient's transposed weight, the casts' row-wise scales) shows as an O(1)
error."""

import copy

import pytest
import torch

import reference as ref
from test_grouped_wgrad_fp8_sm90_gpu import block_padded
from te_fused_ops import (
    ClampedSwiGLU,
    GeGLU,
    GroupedLinear,
    Quantize,
    ScaledSwiGLU,
    Sequential,
    SReLU,
    SwiGLU,
    Transpose,
    cast_weights_once_per_step,
)
from te_fused_ops.grouped_mm import grouped_row_sum, grouped_wgrad
from te_fused_ops.quantization import Float8BlockScaling, QuantizedTensor, quantize, quantize_weight

G, H, I, ROWS = 4, 256, 128, 300
SPLITS = torch.tensor([70, 0, 130, 60])  # 40 padding rows
ACTIVATIONS = {"swiglu": ref.swiglu, "geglu": ref.geglu, "srelu": ref.srelu}


def activation_math(name, pre, probs, limit, alpha):
    """The kernels' activation epilogue in float32 (scaled_swiglu: times probs)."""
    if name == "clamped_swiglu":
        return ref.clamped_swiglu(pre, limit, alpha)
    if name == "scaled_swiglu":
        return ref.swiglu(pre) * probs[:, None]
    return ACTIVATIONS[name](pre)


def grouped_rows(offsets):
    bounds = offsets.tolist()
    return [slice(bounds[g], bounds[g + 1]) for g in range(len(bounds) - 1)]


AMAX_PARTS = []  # the amax-parts outputs handed out by the stood-in kernels


def amax_parts(t, offsets):
    """The kernels' amax-parts contract for output ``t``: partial maxima of its finite |values|
    over the grouped rows (the amax in one of several parts)."""
    rows = t.float()[: int(offsets.max())]
    amax = rows.abs().nan_to_num(0.0, 0.0, 0.0).amax() if rows.numel() else rows.new_zeros(())
    parts = torch.stack([amax / 2, amax, torch.zeros_like(amax)])
    AMAX_PARTS.append(parts)
    return parts


def with_act_amax(outputs, offsets, act_amax):
    """``outputs`` (pre, act), and with ``act_amax`` the act's amax parts."""
    return (*outputs, amax_parts(outputs[1], offsets)) if act_amax else outputs


GEMM_CALLS = []  # activation of each stood-in grouped_gemm_sm90 call


def gemm(x, weight, offsets, *, bias=None, activation=None, probs=None, limit=7.0, alpha=1.702, out=None,
         act_out=None, weight_layout="nk", act_amax=False, **_):
    """`grouped_gemm_sm90`'s contract in float32 (rows past offsets[G] zero)."""
    GEMM_CALLS.append(activation)
    w = weight if weight_layout == "nk" else weight.transpose(1, 2)
    pre = x.new_zeros(x.shape[0], w.shape[1], dtype=torch.float32)
    for g, rows in enumerate(grouped_rows(offsets)):
        pre[rows] = x[rows].float() @ w[g].float().t() + (0 if bias is None else bias[g].float())
    act = None if activation is None else activation_math(activation, pre, probs, limit, alpha)
    results = []
    for value, buffer in ((pre, out), (act, act_out)):
        value = None if value is None else value.to(x.dtype)
        results.append(value if buffer is None or value is None else buffer.copy_(value))
    return with_act_amax(tuple(results), offsets, act_amax)


DY_GATHERS = []  # dy's shape of each stood-in dActivation reading dy's rows by index


def dgrad_dact(dy, weight, offsets, pre, *, activation, probs=None, limit=7.0, alpha=1.702, out=None, dy_index=None,
               d_probs_parts=False, emit_act=True, **_):
    """`grouped_dgrad_dact_sm90`'s contract: (d_pre (into ``out``, which may be pre itself), act(pre)
    (times probs; None without ``emit_act``), d_probs or None, with ``d_probs_parts`` as (2, M)
    partial sums over two column halves); with ``dy_index`` on the rows dy[dy_index]."""
    if dy_index is not None:
        DY_GATHERS.append(tuple(dy.shape))
        dy = dy[dy_index.long().clamp(0, dy.shape[0] - 1)]
    h = dy.new_zeros(dy.shape[0], weight.shape[2], dtype=torch.float32)
    for g, rows in enumerate(grouped_rows(offsets)):
        h[rows] = dy[rows].float() @ weight[g].float()
    scaled = activation == "scaled_swiglu"
    unscaled, vjp = torch.func.vjp(  # not autograd: a compiled backward runs below the autograd key
        lambda p: activation_math("swiglu" if scaled else activation, p, None, limit, alpha), pre.float())
    (d_pre,) = vjp(h * probs[:, None] if scaled else h)
    act = unscaled * probs[:, None] if scaled else unscaled
    d_probs = (h * unscaled).sum(1) if scaled else None
    if scaled and d_probs_parts:
        half = h.shape[1] // 2
        d_probs = torch.stack([(h * unscaled)[:, :half].sum(1), (h * unscaled)[:, half:].sum(1)])
    d_pre = d_pre.to(dy.dtype) if out is None else out.copy_(d_pre)
    return d_pre, act.to(dy.dtype) if emit_act else None, d_probs


def _expand(scale_inv, sizes):
    """Block multipliers repeated over their 128-wide blocks along the last len(sizes) dims."""
    for i, size in enumerate(sizes):
        dim = scale_inv.dim() - len(sizes) + i
        scale_inv = scale_inv.repeat_interleave(128, dim=dim).narrow(dim, 0, size)
    return scale_inv


def fp8_gemm(x, x_scale_inv, weight, weight_scale_inv, offsets, *, bias=None, activation=None, probs=None,
             limit=7.0, alpha=1.702, out_dtype=torch.bfloat16, act_amax=False, **_):
    """`grouped_gemm_fp8_sm90`'s contract in float32: dequantized operands, act from fp32 pre."""
    x32 = x.float() * _expand(x_scale_inv, x.shape[-1:])
    w32 = weight.float() * _expand(weight_scale_inv, weight.shape[-2:])
    pre = x32.new_zeros(x.shape[0], weight.shape[1])
    bounds = offsets.tolist()
    for g in range(weight.shape[0]):
        rows = slice(bounds[g], bounds[g + 1])
        pre[rows] = x32[rows] @ w32[g].t() + (0 if bias is None else bias[g].float())
    act = None if activation is None else activation_math(activation, pre, probs, limit, alpha).to(out_dtype)
    return with_act_amax((pre.to(out_dtype), act), offsets, act_amax)


CASTS = []  # block_rows of each stood-in cast
CAST_POWER_2 = []  # power_2_scales of each
TRANSPOSED_CASTS = []  # shapes of the weights cast with their transposed copy


def with_transposed(x, data, scale_inv, transposed):
    """A cast's outputs, with ``transposed`` (recorded) followed by both transposed per group."""
    if not transposed:
        return data, scale_inv
    TRANSPOSED_CASTS.append(tuple(x.shape))
    return data, scale_inv, *(t.transpose(1, 2).contiguous() for t in (data, scale_inv))


CASTS_INTO = []  # the out= tuples of the stood-in casts given one


def block_cast(x, block_rows, power_2_scales=False, transposed=False, out=None):
    """`block_quantize_sm90`'s contract: the torch quantizer's data and scales, with ``transposed``
    followed by both transposed per group; with ``out`` written there (of the same structure)."""
    CASTS.append(block_rows)
    CAST_POWER_2.append(power_2_scales)
    recipe = Float8BlockScaling(power_2_scales=power_2_scales)
    q = quantize(x, recipe) if block_rows == 1 else quantize_weight(x, recipe)
    return written_into(out, with_transposed(x, q.rowwise_data, q.rowwise_scale_inv, transposed))


def written_into(out, made):
    """``made`` (a stood-in cast's outputs), or with ``out`` (an earlier call's) written there."""
    if out is None:
        return made
    CASTS_INTO.append(out)
    assert len(out) == len(made)
    for kept, fresh in zip(out, made):
        assert kept.shape == fresh.shape and kept.dtype == fresh.dtype
        kept.copy_(fresh)
    return out


ACT_CASTS = []  # power_2_scales of each stood-in GEMM with the act cast in its epilogue


def gemm_act_cast(x, weight, offsets, *, activation, power_2_scales=False, columns=False, **epilogue):
    """`grouped_gemm_act_quant_sm90`'s contract: `gemm`'s pre, and its act as the torch quantizer
    casts it (1 x 128 blocks), the act itself not returned; without an activation no pre, and
    the output cast; with ``columns`` also the act's `BlockColumns` (as `column_cast` makes them)."""
    ACT_CASTS.append((power_2_scales, columns))
    pre, act = gemm(x, weight, offsets, activation=activation, **epilogue)
    if activation is None:
        pre, act = None, pre
    if columns:
        made, data, scale_inv = column_cast(act, offsets, rows=True, power_2_scales=power_2_scales)
        COLUMN_CASTS.pop()  # made in the epilogue, not by a cast kernel
        CAST_POWER_2.pop()
        return pre, data, scale_inv, made
    q = quantize(act, Float8BlockScaling(power_2_scales=power_2_scales))
    return pre, q.rowwise_data, q.rowwise_scale_inv


FP8_ACT_CASTS = []  # power_2_scales of each stood-in FP8 FC1 that cast its act in the epilogue


def fp8_gemm_act_cast(x, x_scale_inv, weight, weight_scale_inv, offsets, *, activation, power_2_scales=False,
                      columns=False, out_dtype=torch.bfloat16, **epilogue):
    """`grouped_gemm_act_quant_fp8_sm90`'s contract: `fp8_gemm`'s pre, and its act as the torch
    quantizer casts it (1 x 128 blocks), the act itself not returned."""
    assert not columns, "the layer casts the FP8 FC1's act in the epilogue without the column-wise copy"
    FP8_ACT_CASTS.append(power_2_scales)
    pre, act = fp8_gemm(x, x_scale_inv, weight, weight_scale_inv, offsets, activation=activation, out_dtype=out_dtype,
                        **epilogue)
    q = quantize(act, Float8BlockScaling(power_2_scales=power_2_scales))
    return pre, q.rowwise_data, q.rowwise_scale_inv


def tensor_cast(x, block_rows, offsets=None, amax_parts=None, transposed=False, out=None):
    """`tensor_quantize_sm90`'s contract: the torch quantizer's data, its one scale over the grid
    (from ``amax_parts`` when given: they must hold the amax of x's grouped rows), with
    ``transposed`` followed by both transposed per group; with ``out`` written there."""
    CASTS.append(block_rows)
    CAST_POWER_2.append(False)
    assert (offsets is not None) == (block_rows == 1), "rows are cast with their offsets, weights without"
    q = quantize(x, "fp8_current", offsets=offsets) if block_rows == 1 else quantize_weight(x, "fp8_current")
    if amax_parts is not None:
        assert any(parts is amax_parts for parts in AMAX_PARTS), "amax parts not from the GEMM that wrote x"
        assert torch.equal(amax_parts.max() / torch.tensor(448.0), q.rowwise_scale_inv)
    grid = (-(-x.shape[-2] // block_rows), -(-x.shape[-1] // 128))
    scale_inv = q.rowwise_scale_inv.expand(*x.shape[:-2], *grid).contiguous()
    return written_into(out, with_transposed(x, q.rowwise_data, scale_inv, transposed))


DACT_FP8_CALLS = []


EMITTED_ACTS = []  # shapes of the acts each stood-in FP8 dActivation wrote (emit_act)


def dgrad_dact_fp8(dy, dy_scale_inv, weight_t, weight_t_scale_inv, offsets, pre, d_pre_amax=False, emit_act=False,
                   **epilogue):
    """`grouped_dgrad_dact_fp8_sm90`'s contract: `dgrad_dact` on the dequantized operands, its act
    only with ``emit_act``; with ``d_pre_amax`` also d_pre's amax parts."""
    DACT_FP8_CALLS.append(tuple(weight_t.shape))
    dy_values = dy.float() * _expand(dy_scale_inv, dy.shape[-1:])
    w_values = (weight_t.float() * _expand(weight_t_scale_inv, weight_t.shape[-2:])).transpose(1, 2)
    d_pre, act, d_probs = dgrad_dact(dy_values, w_values, offsets, pre, **epilogue)
    d_pre = d_pre.to(pre.dtype)
    outputs = (d_pre, d_probs)
    if emit_act:
        EMITTED_ACTS.append(tuple(act.shape))
        outputs = (d_pre, act.to(pre.dtype), d_probs)
    return (*outputs, amax_parts(d_pre, offsets)) if d_pre_amax else outputs


UNCASTS = []  # shapes of each stood-in dequantization


def block_uncast(data, scale_inv, dtype):
    """`block_dequantize_sm90`'s contract: float32 data times its 1 x 128 multipliers, saturated to dtype."""
    UNCASTS.append(tuple(data.shape))
    finite_max = torch.finfo(dtype).max
    return (data.float() * _expand(scale_inv, data.shape[-1:])).clamp(-finite_max, finite_max).to(dtype)


COLUMN_CASTS = []  # (with rows, from E4M3 rows) of each stood-in column-wise cast


def column_cast(x, offsets, *, x_scale_inv=None, rows=False, power_2_scales=False):
    """`block_columns_sm90`'s contract: the torch quantizer's per-group column-wise copy of x (of
    its dequantized row-wise copy with ``x_scale_inv``), block-padded; with ``rows`` also x's
    row-wise cast (data, multipliers)."""
    COLUMN_CASTS.append((rows, x_scale_inv is not None))
    CAST_POWER_2.append(power_2_scales)
    values = x if x_scale_inv is None else x.float() * _expand(x_scale_inv, x.shape[-1:])
    q = quantize(values, Float8BlockScaling(power_2_scales=power_2_scales), rowwise=rows, columnwise=True,
                 offsets=offsets)
    columns = block_padded(q.columnwise_data, q.columnwise_scale_inv, offsets)
    return (columns, q.rowwise_data, q.rowwise_scale_inv) if rows else columns


WGRAD_FP8_CALLS = []  # (G, N, K) of each stood-in FP8 weight gradient


def wgrad_fp8(dy_columns, x_columns, offsets, *, out_dtype, main_grad=None, **_):
    """`grouped_wgrad_fp8_sm90`'s contract in float32: per group, the sum over its 128-token
    blocks of the blocks' dequantized products."""
    values = [(c.data.float() * c.scale_inv.t().repeat_interleave(128, dim=1)) for c in (dy_columns, x_columns)]
    ends = offsets[1:].long().clamp(0, dy_columns.num_tokens).cummax(0).values
    blocks = (ends - torch.cat([ends.new_zeros(1), ends[:-1]]) + 127) // 128
    first = torch.cat([blocks.new_zeros(1), blocks.cumsum(0)]).tolist()
    spans = [slice(128 * first[g], 128 * first[g + 1]) for g in range(len(blocks))]
    dw = torch.stack([values[0][:, span] @ values[1][:, span].t() for span in spans])
    WGRAD_FP8_CALLS.append(tuple(dw.shape))
    if main_grad is not None:
        main_grad.add_(dw)
    return dw.to(out_dtype)


def wgrad(dy, x, offsets, main_grad=None, **_):
    dw = grouped_wgrad(dy, x, offsets)
    if main_grad is not None:
        main_grad.add_(dw.float())
    return dw


GATHERED_WGRADS = []  # (gathered operand, its shape) of each stood-in gathered weight gradient


def gathered_wgrad(dy, x, index, offsets, gathered="x", **kwargs):
    """`grouped_wgrad_gathered_sm90`'s contract: `grouped_wgrad_sm90` on x[index] (gathered "x")
    or dy[index] ("dy")."""
    source = x if gathered == "x" else dy
    GATHERED_WGRADS.append((gathered, tuple(source.shape)))
    rows = source[index.long().clamp(0, source.shape[0] - 1)]
    return wgrad(dy, rows, offsets, **kwargs) if gathered == "x" else wgrad(rows, x, offsets, **kwargs)


def kernel_contract(fn):
    """``fn`` (a kernel's stand-in) that first checks what the kernel wrappers check of every
    tensor argument: contiguous and 16-byte aligned."""
    def checked(*args, **kwargs):
        for i, t in enumerate((*args, *kwargs.values())):
            if isinstance(t, torch.Tensor) and t.numel():
                assert t.is_contiguous() and t.data_ptr() % 16 == 0, (fn.__name__, i, t.shape, t.stride())
        return fn(*args, **kwargs)
    return checked


@pytest.fixture
def sm90_stand_ins(monkeypatch):
    import te_fused_ops.backends.sm90.linear as sm90
    import te_fused_ops.backends.sm90.rules as dact_rule
    from te_fused_ops.backends.sm90 import SM90

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")  # compile-only mode: the kernels count as available
    monkeypatch.setattr(SM90, "unavailable_reason", lambda info: None)  # any device
    for module, name, stand_in in (
        (sm90, "grouped_gemm_fp8_sm90", fp8_gemm),
        (sm90, "block_quantize_sm90", block_cast),
        (sm90, "tensor_quantize_sm90", tensor_cast),
        (sm90, "block_dequantize_sm90", block_uncast),
        (sm90, "grouped_wgrad_sm90", wgrad),
        (sm90, "grouped_wgrad_gathered_sm90", gathered_wgrad),
        (sm90, "block_columns_sm90", column_cast),
        (sm90, "grouped_wgrad_fp8_sm90", wgrad_fp8),
        (sm90, "grouped_column_sums_sm90", lambda dy, offsets, **_: grouped_row_sum(dy, offsets)),
        (sm90, "grouped_gemm_sm90", gemm),
        (sm90, "grouped_gemm_act_quant_sm90", gemm_act_cast),
        (sm90, "grouped_gemm_act_quant_fp8_sm90", fp8_gemm_act_cast),
        (dact_rule, "grouped_dgrad_dact_sm90", dgrad_dact),
        (dact_rule, "grouped_dgrad_dact_fp8_sm90", dgrad_dact_fp8),
    ):
        monkeypatch.setattr(module, name, kernel_contract(stand_in))


def fp8_mlp(recipe, quantize_x=True):
    torch.manual_seed(0)
    fc1 = GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16)
    fc2 = GroupedLinear(G, I, H, dtype=torch.bfloat16)
    with torch.no_grad():
        for fc in (fc1, fc2):  # block (i, j) of group g scaled by 2**(3 (i - j) + g): no symmetry
            grid = (G, fc.weight.shape[1] // 128, fc.weight.shape[2] // 128)
            g, i, j = torch.meshgrid(*(torch.arange(n) for n in grid), indexing="ij")
            fc.weight.mul_(_expand(torch.exp2(3.0 * (i - j) + g), fc.weight.shape[-2:]).bfloat16())
    ops = [fc1, SwiGLU(), Quantize(recipe), Transpose(), fc2]
    return Sequential(*([Quantize(recipe)] if quantize_x else []), *ops)


def step(seq, x, dy, **side):
    leaves = (x, *side.values(), *seq.parameters())
    for t in leaves:
        t.grad = None
    y = seq(x, split_sizes=SPLITS, **side)
    y.backward(dy)
    return [y.detach(), *[t.grad for t in leaves]]


@pytest.mark.parametrize("act", [SwiGLU, ScaledSwiGLU, SReLU, ClampedSwiGLU, GeGLU])
def test_bf16_plan_glue_matches_the_torch_backend(act, sm90_stand_ins, monkeypatch):
    torch.manual_seed(0)
    glu = act is not SReLU
    seq = Sequential(GroupedLinear(G, H, 2 * I if glu else I, bias=True, dtype=torch.bfloat16), act(),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16))
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    side = {"probs": torch.rand(ROWS, requires_grad=True)} if act is ScaledSwiGLU else {}
    text = seq.explain(x, split_sizes=SPLITS, **side)
    for step_text in ("[0:2] GroupedLinear, " + act.__name__ + " -> rule 'grouped_linear+activation' (backend sm90)",
                      "[2] GroupedLinear -> rule 'grouped_linear' (backend sm90)",
                      "[1:3] " + act.__name__ + ", GroupedLinear -> rule 'dactivation+grouped_linear' (backend sm90)",
                      "[0] GroupedLinear -> rule 'grouped_linear_backward' (backend sm90)"):
        assert step_text in text, text
    got = step(seq, x, dy, **side)
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    want = step(seq, x, dy, **side)
    for i, (a, b) in enumerate(zip(got, want)):
        assert ref.rel_err(a, b) <= 1e-2, i
    assert torch.all(got[0][SPLITS.sum():] == 0)


@pytest.mark.parametrize("routed", [None, "narrow", "wide"])
def test_frozen_fc2_weight_skips_the_dactivation_act(routed, sm90_stand_ins, monkeypatch):
    """With FC2's weight frozen nothing reads the activation's output in the backward: the
    dActivation kernel is asked not to write it (``emit_act=False``; in the routed layer with dy
    read by index where FC2 is narrow, on dy's copy where FC2's weight gradient would wait for
    d_pre), and every other gradient is bit for bit the trainable step's."""
    import te_fused_ops.backends.sm90.rules as dact_rule
    from te_fused_ops.backends.sm90.rules import GATHER_DY_MAX_WIDTH

    if routed:
        width = I if routed == "narrow" else GATHER_DY_MAX_WIDTH + 32
        seq, x, indices, probs, dy = routed_layer(monkeypatch, act=ScaledSwiGLU, width=width, tokens=40)
        side = {"indices": indices, "probs": probs}
    else:
        torch.manual_seed(0)
        seq = Sequential(GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), ScaledSwiGLU(),
                         GroupedLinear(G, I, H, dtype=torch.bfloat16))
        x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
        side = {"split_sizes": SPLITS, "probs": torch.rand(ROWS, requires_grad=True)}
    emitted, dact = [], dact_rule.grouped_dgrad_dact_sm90
    monkeypatch.setattr(dact_rule, "grouped_dgrad_dact_sm90",
                        lambda *a, **kw: emitted.append(kw.get("emit_act", True)) or dact(*a, **kw))

    def grads():
        leaves = (x, side["probs"], *seq.parameters())
        for t in leaves:
            t.grad = None
        y = seq(x, **side)
        y.backward(dy)
        return [y.detach(), *(None if t.grad is None else t.grad.clone() for t in leaves)]

    trainable = grads()
    seq[-2 if routed else -1].weight.requires_grad_(False)
    frozen = grads()
    assert emitted == [True, False]
    assert frozen[-1] is None and trainable[-1] is not None
    for a, b in zip(trainable[:-1], frozen[:-1]):
        assert torch.equal(a, b)


def _check_in_place_unless_retained(seq, outs) -> torch.Tensor:
    """One step of ``seq`` records d_pre written over pre in ``outs`` (the dActivation's recorder);
    a retain_graph backward then gets a buffer of its own, the second backward pre's place, and the
    two sum to twice the step's gradients. Returns the dy used."""
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    once = step(seq, x, dy)
    assert outs == [True]
    for t in (x, *seq.parameters()):
        t.grad = None
    y = seq(x, split_sizes=SPLITS)
    y.backward(dy, retain_graph=True)
    y.backward(dy)
    assert outs == [True, False, True]
    for a, b in zip(once[1:], [x.grad, *(p.grad for p in seq.parameters())]):
        torch.testing.assert_close(b, 2 * a, rtol=1e-2, atol=1e-2)
    return dy


def test_d_pre_is_written_over_pre_unless_the_graph_is_kept(sm90_stand_ins, monkeypatch):
    """The dActivation kernel writes d_pre over the saved pre-activation (FC1's output, private to
    the call) when the backward frees the graph; with retain_graph it gets a buffer of its own, so a
    second backward reads pre intact. An activation fed the caller's tensor never writes over it."""
    import te_fused_ops.backends.sm90.rules as dact_rule

    outs = []
    dgrad = dact_rule.grouped_dgrad_dact_sm90

    def recording(dy, weight, offsets, pre, **kwargs):
        outs.append(kwargs.get("out") is not None and kwargs["out"].data_ptr() == pre.data_ptr())
        return dgrad(dy, weight, offsets, pre, **kwargs)

    monkeypatch.setattr(dact_rule, "grouped_dgrad_dact_sm90", recording)
    torch.manual_seed(0)
    seq = Sequential(GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), SwiGLU(),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16))
    dy = _check_in_place_unless_retained(seq, outs)

    tail = Sequential(SwiGLU(), GroupedLinear(G, I, H, dtype=torch.bfloat16))
    pre = torch.randn(ROWS, 2 * I, dtype=torch.bfloat16, requires_grad=True)
    kept = pre.detach().clone()
    tail(pre, split_sizes=SPLITS).backward(dy)
    assert outs[-1] is False and torch.equal(pre.detach(), kept)


def test_fc2_weight_gradient_waits_for_d_pre_to_be_freed(sm90_stand_ins, monkeypatch):
    """In the routed layer FC2's weight gradient reads dy by index and its act (half of d_pre): it
    runs last, after FC1's, and the runner has freed d_pre's storage (written over pre, held by
    autograd until the backward returns) before it, so FC2's gradient never meets d_pre and FC1's
    at the peak. With retain_graph neither happens (pre must stay intact); in the MLP, whose FC2
    reads a dy larger than d_pre, the gradient does not wait (waiting would hold dy to the end).
    Gradients bit for bit the same in every order."""
    import te_fused_ops.backends.sm90.linear as sm90_linear
    import te_fused_ops.backends.sm90.rules as dact_rule

    events, written = [], []
    dgrad, by_index = dact_rule.grouped_dgrad_dact_sm90, sm90_linear.grouped_wgrad_gathered_sm90

    def recording_dact(dy, weight, offsets, pre, **kwargs):
        if kwargs.get("out") is not None:
            written.append(kwargs["out"])
        return dgrad(dy, weight, offsets, pre, **kwargs)

    def freed():
        return bool(written) and written[-1].untyped_storage().size() == 0

    def recording_wgrad(dy, x, offsets, **kwargs):
        events.append(("dW1" if x.shape[1] == H else "dW2", freed()))  # FC2 reads act (rows, I)
        return wgrad(dy, x, offsets, **kwargs)

    def recording_gathered(dy, x, index, offsets, **kwargs):
        events.append(("dW1" if kwargs.get("gathered", "x") == "x" else "dW2", freed()))
        return by_index(dy, x, index, offsets, **kwargs)

    monkeypatch.setattr(dact_rule, "grouped_dgrad_dact_sm90", recording_dact)
    monkeypatch.setattr(sm90_linear, "grouped_wgrad_sm90", recording_wgrad)
    monkeypatch.setattr(sm90_linear, "grouped_wgrad_gathered_sm90", recording_gathered)
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "auto")
    seq, x, indices, probs, dy = routed_layer(monkeypatch, ScaledSwiGLU)

    def backward(retain_graph):
        events.clear(), written.clear()
        for t in (x, probs, *seq.parameters()):
            t.grad = None
        seq(x, indices=indices, probs=probs).backward(dy, retain_graph=retain_graph)
        return [x.grad, probs.grad, *(p.grad for p in seq.parameters())]

    waited = backward(False)
    assert events == [("dW1", False), ("dW2", True)], events
    kept = backward(True)
    assert events == [("dW2", False), ("dW1", False)], events
    for a, b in zip(waited, kept):
        assert torch.equal(a, b)

    torch.manual_seed(0)
    mlp = Sequential(GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), SwiGLU(),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16))
    events.clear(), written.clear()
    step(mlp, torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True), torch.randn(ROWS, H, dtype=torch.bfloat16))
    assert events == [("dW2", False), ("dW1", False)], events
    assert written and written[-1].untyped_storage().size() == 0  # freed all the same, once FC1's backward ran


def test_wgrad_setting_reads_rows_by_index_in_the_weight_gradients_alone(sm90_stand_ins, monkeypatch):
    """TE_FUSED_OPS_GATHER_ROWS=wgrad: FC1's forward reads the permuted copy and FC2's data gradient
    + dActivation dy's expert-ordered copy, while both weight gradients read the rows by index and
    run last: dW1 after the permute's backward, dW2 after d_pre's storage is freed and after dy's
    copy is gone (the peak of 1 without its gathers in the forward and the data gradient).
    Gradients bit for bit those of the other settings."""
    import weakref

    import te_fused_ops.backends.sm90.linear as sm90_linear
    import te_fused_ops.backends.sm90.rules as dact_rule

    events, copies, written = [], [], []
    dgrad, by_index = dact_rule.grouped_dgrad_dact_sm90, sm90_linear.grouped_wgrad_gathered_sm90

    def recording_dact(dy, weight, offsets, pre, **kwargs):
        events.append(("dact", kwargs.get("dy_index") is not None))
        copies.append(weakref.ref(dy))
        written.append(kwargs["out"])
        return dgrad(dy, weight, offsets, pre, **kwargs)

    def recording_gathered(dy, x, index, offsets, **kwargs):
        copy_alive = any(ref() is not None for ref in copies)
        d_pre_freed = written[-1].untyped_storage().size() == 0
        events.append(("dW1" if kwargs.get("gathered", "x") == "x" else "dW2", copy_alive, d_pre_freed))
        return by_index(dy, x, index, offsets, **kwargs)

    monkeypatch.setattr(dact_rule, "grouped_dgrad_dact_sm90", recording_dact)
    monkeypatch.setattr(sm90_linear, "grouped_wgrad_gathered_sm90", recording_gathered)
    seq, x, indices, probs, dy = routed_layer(monkeypatch, ScaledSwiGLU)
    grads = {}
    for setting in ("wgrad", "1", "0"):
        monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", setting)
        events.clear(), copies.clear(), written.clear(), SCATTERS.clear(), GATHERED_GEMMS.clear()
        for t in (x, probs, *seq.parameters()):
            t.grad = None
        seq(x, indices=indices, probs=probs).backward(dy)
        grads[setting] = [x.grad, probs.grad, *(p.grad for p in seq.parameters())]
        if setting == "wgrad":
            # the permute and the combine's backward write copies; no GEMM gathers rows but dW1, dW2
            assert len(SCATTERS) == 2 and not GATHERED_GEMMS, (SCATTERS, GATHERED_GEMMS)
            assert events == [("dact", False), ("dW1", False, False), ("dW2", False, True)], events
    assert events == [("dact", False)], events  # 0: no weight gradient reads rows by index
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "wgrad")
    text = seq.explain(x, indices=indices, probs=probs)
    assert "TE_FUSED_OPS_GATHER_ROWS=wgrad (FC1 reads the permuted copy)" in text, text
    assert "rule 'dactivation+grouped_linear+unpermute'" in text, text
    for other in ("1", "0"):
        for a, b in zip(grads["wgrad"], grads[other]):
            assert torch.equal(a, b)


def test_backward_follows_the_plan_its_forward_ran(sm90_stand_ins, monkeypatch):
    """TE_FUSED_OPS_GATHER_ROWS changed between a forward and its backward: the backward still runs
    the forward's plan (its rows read by index, or not, as planned), never half of each."""
    seq, x, indices, probs, dy = routed_layer(monkeypatch, ScaledSwiGLU)
    grads = {}
    for forward_setting, backward_setting in (("1", "1"), ("1", "0"), ("0", "1")):
        monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", forward_setting)
        for t in (x, probs, *seq.parameters()):
            t.grad = None
        y = seq(x, indices=indices, probs=probs)
        monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", backward_setting)
        DY_GATHERS.clear(), GATHERED_WGRADS.clear()
        y.backward(dy)
        by_index = (len(DY_GATHERS), len(GATHERED_WGRADS))
        assert by_index == ((1, 2) if forward_setting == "1" else (0, 0)), (forward_setting, by_index)
        grads[forward_setting, backward_setting] = [x.grad, probs.grad, *(p.grad for p in seq.parameters())]
    for a, b, c in zip(*grads.values()):
        assert torch.equal(a, b) and torch.equal(a, c)


@pytest.mark.parametrize("setting,freed", [("0", True), ("1", False)])
def test_d_pre_is_freed_once_nothing_left_reads_it(setting, freed, sm90_stand_ins, monkeypatch):
    """The runner frees d_pre (written over the saved pre-activation) right after the step that
    reads it as its data gradient, FC1's backward, where that step keeps no deferred gradient
    reading it: before the permute's backward sums the slots (0: FC1's weight gradient on the
    copy, made in the step). With 1 FC1's weight gradient reads x by index later, deferred, and
    d_pre lives until it has run. Gradients bit for bit the same."""
    import te_fused_ops.backends.sm90.moe as sm90_moe
    import te_fused_ops.backends.sm90.rules as sm90_rules

    written, at_dispatch_backward = [], []
    dact = sm90_rules.grouped_dgrad_dact_sm90

    def recording_dact(*args, **kwargs):
        written.append(kwargs["out"])
        return dact(*args, **kwargs)

    grads = {}
    for gather in (setting, "0" if setting == "1" else "1"):
        monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", gather)
        layer = routed_layer(monkeypatch, ScaledSwiGLU)
        gather_sum = sm90_moe.gather_sum

        def recording_sum(*args, gather_sum=gather_sum, **kwargs):
            if written:  # the permute's backward (the combine's forward ran before the dActivation)
                at_dispatch_backward.append(written[-1].untyped_storage().size() == 0)
            return gather_sum(*args, **kwargs)

        monkeypatch.setattr(sm90_rules, "grouped_dgrad_dact_sm90", recording_dact)
        monkeypatch.setattr(sm90_moe, "gather_sum", recording_sum)
        written.clear(), at_dispatch_backward.clear()
        grads[gather] = routed_step(*layer)
        if gather == setting:
            assert at_dispatch_backward == [freed], at_dispatch_backward
    for a, b in zip(*grads.values()):
        assert torch.equal(a, b)


def test_freeing_d_pre_spares_the_sequentials_own_data_gradient():
    """The runner frees a data gradient written over the saved input (`free_grad_over_input`),
    except where the Sequential returns a tensor living in the same storage as its dx."""
    from types import SimpleNamespace

    from te_fused_ops.runner import free_grad_over_input

    d_pre, other = torch.randn(8, 4), torch.randn(8, 4)
    returned = SimpleNamespace(grad_over_input=d_pre)
    free_grad_over_input(returned, d_pre[2:])
    assert returned.grad_over_input is None and d_pre.untyped_storage().size() == d_pre.numel() * 4
    freed = SimpleNamespace(grad_over_input=other)
    free_grad_over_input(freed, d_pre)
    assert freed.grad_over_input is None and other.untyped_storage().size() == 0


@pytest.mark.parametrize("quantize_x", [True, False])  # False: the recipe's MLP, FC1 in bf16
@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_blockwise_pow2", "fp8_current"])
def test_fp8_plan_glue_matches_the_emulation(recipe, quantize_x, sm90_stand_ins, monkeypatch):
    current = recipe == "fp8_current"
    if recipe == "fp8_blockwise_pow2":
        recipe = Float8BlockScaling(power_2_scales=True)
    seq = fp8_mlp(recipe, quantize_x)
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    x.data[SPLITS.sum():] = 1e4  # padding rows: no part of any amax
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    text = seq.explain(x, split_sizes=SPLITS)
    first = int(quantize_x)  # index of FC1
    # fp8_current: the act's amax from FC1's epilogue; fp8_blockwise: the act cast in FC1's
    # epilogue (bf16 x) with its column-wise copy (the Transpose), or after FC1 (FP8 x: the FP8
    # kernel's act cast takes no column-wise copy) as FC2's input format, rows and columns from one read
    epilogue_cast = not current and not quantize_x
    x_in = "Quantize, " if quantize_x else ""  # x's cast: FC1's input format
    if epilogue_cast:
        fc1_forward = ["[0:4] GroupedLinear, SwiGLU, Quantize, Transpose -> rule 'grouped_linear+activation' "
                       "(backend sm90)"]
        fc2 = "[4] GroupedLinear -> rule 'grouped_linear' (backend sm90)"
    elif current:
        fc1_forward = [f"[0:{first + 3}] {x_in}GroupedLinear, SwiGLU, Quantize -> rule 'grouped_linear+activation' "
                       "(backend sm90)",
                       f"not fired: rule 'grouped_linear+activation' on [0:{first + 4}]: ran on [0:{first + 3}] "
                       "instead; sm90 backend: fp8_current: the epilogue writes no column-wise copy"]
        fc2 = f"[{first + 3}:{first + 5}] Transpose, GroupedLinear -> rule 'grouped_linear' (backend sm90)"
    else:  # x cast with its column-wise copy (FC1's FP8 weight gradient reads it), FC1 + SwiGLU as their rule
        fc1_forward = ["[0:3] Quantize, GroupedLinear, SwiGLU -> rule 'grouped_linear+activation' (backend sm90)",
                       "not fired: rule 'grouped_linear+activation' on [0:5]: ran on [0:3] instead; sm90 backend: "
                       "quantized input with FP8 weight gradients: the FP8 kernel's act cast with the column-wise copy "
                       "measured no faster"]
        fc2 = "[3:6] Quantize, Transpose, GroupedLinear -> rule 'grouped_linear' (backend sm90)"
    # all FP8: FC1's backward fed from the dAct epilogue in the same rule (fp8_current: d_pre's
    # amax; fp8_blockwise: d_pre's row- and column-wise copies)
    backward = ([f"[{first}:{first + 5}] GroupedLinear, SwiGLU, Quantize, Transpose, GroupedLinear -> rule "
                 "'grouped_linear+dactivation+grouped_linear' (backend sm90)"]
                if quantize_x else
                [f"[{first + 1}:{first + 5}] SwiGLU, Quantize, Transpose, GroupedLinear -> rule "
                 "'dactivation+grouped_linear' (backend sm90)",
                 f"[{first}] GroupedLinear -> rule 'grouped_linear_backward' (backend sm90)"])
    expected = [*fc1_forward, fc2, *backward]
    x_columns = quantize_x and not current  # x's column copy from its cast in the forward
    act_columns = quantize_x and not current  # the act's column copy from its cast, FC2's input format
    for step_text in expected:
        assert step_text in text, text
    for calls in (CASTS, CAST_POWER_2, ACT_CASTS, UNCASTS, DACT_FP8_CALLS, AMAX_PARTS, COLUMN_CASTS, WGRAD_FP8_CALLS,
                  TRANSPOSED_CASTS):
        calls.clear()
    got = step(seq, x, dy)
    assert len(AMAX_PARTS) == int(current) * (1 + quantize_x), AMAX_PARTS  # the act's, d_pre's
    power_2 = isinstance(recipe, Float8BlockScaling) and recipe.power_2_scales
    assert CAST_POWER_2 == [power_2] * (len(CASTS) + len(COLUMN_CASTS)), CAST_POWER_2
    assert DACT_FP8_CALLS == [(G, I, H)], DACT_FP8_CALLS  # FC2's dgrad + dSwiGLU: one FP8 kernel
    assert ACT_CASTS == [(power_2, True)] * epilogue_cast, ACT_CASTS
    fp8_linears = 1 + quantize_x  # FC2, and FC1 after a Quantize of x
    # row-wise: the activation (unless cast in FC1's epilogue) and x; each weight once
    row_casts = [1] * (1 + quantize_x - epilogue_cast - x_columns - act_columns) + [128] * fp8_linears
    # each FP8 weight cast once, writing its transposed copy (its data gradient's operand) too
    assert sorted(TRANSPOSED_CASTS) == sorted([(G, H, I)] + [(G, 2 * I, H)] * quantize_x), TRANSPOSED_CASTS
    if current:  # fp8_current: each dy cast row-wise, the bf16 weight gradients on the inputs dequantized
        assert sorted(CASTS) == sorted(row_casts + [1] * fp8_linears), CASTS
        assert COLUMN_CASTS == [] and WGRAD_FP8_CALLS == [], (COLUMN_CASTS, WGRAD_FP8_CALLS)
        assert sorted(UNCASTS) == [(ROWS, I)] + [(ROWS, H)] * quantize_x, UNCASTS
    else:  # fp8_blockwise: each dy's row- and column-wise copies from one cast, each input's columns
        # from its rows (the act's from FC1's epilogue where it casts the act, else with its rows
        # as FC2's input format; x's with its rows), the FP8 weight gradients on those; nothing dequantized
        assert sorted(CASTS) == row_casts, CASTS
        from_rows = fp8_linears - epilogue_cast - x_columns - act_columns
        with_rows = fp8_linears + x_columns + act_columns
        assert sorted(COLUMN_CASTS) == [(False, True)] * from_rows + [(True, False)] * with_rows, COLUMN_CASTS
        assert WGRAD_FP8_CALLS == [(G, H, I)] + [(G, 2 * I, H)] * quantize_x, WGRAD_FP8_CALLS
        assert UNCASTS == [], UNCASTS
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    want = step(seq, x, dy)
    for name, a, b in zip(("y", "dx", "dW1", "dW2"), got, want):
        assert ref.rel_err(a, b) <= 5e-2, name
    assert torch.all(got[0][SPLITS.sum():] == 0)


@pytest.mark.parametrize("quantize_x", [False, True])
def test_fp8_plan_with_16_bit_weight_gradients(quantize_x, sm90_stand_ins, monkeypatch):
    """Float8BlockScaling(high_precision_wgrad=True): the FP8 forward and data gradients, the
    weight gradients on the 16-bit kernel over the unquantized inputs and dy: no column-wise copy,
    no FP8 weight gradient, nothing dequantized. FC1 casts its act in the epilogue (the bf16 or the
    FP8 kernel) and FC2's dActivation kernel writes the act its weight gradient reads (no recompute
    from pre); within the tolerance the FP8 plan keeps to the torch backend's."""
    recipe = Float8BlockScaling(high_precision_wgrad=True)
    seq = fp8_mlp(recipe, quantize_x)
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    first = int(quantize_x)
    backward = (f"[{first}:{first + 5}] GroupedLinear, SwiGLU, Quantize, Transpose, GroupedLinear -> rule "
                "'grouped_linear+dactivation+grouped_linear' (backend sm90)" if quantize_x else
                f"[{first + 1}:{first + 5}] SwiGLU, Quantize, Transpose, GroupedLinear -> rule "
                "'dactivation+grouped_linear' (backend sm90)")
    assert backward in seq.explain(x, split_sizes=SPLITS)
    for calls in (CASTS, ACT_CASTS, FP8_ACT_CASTS, UNCASTS, DACT_FP8_CALLS, COLUMN_CASTS, WGRAD_FP8_CALLS,
                  EMITTED_ACTS):
        calls.clear()
    got = step(seq, x, dy)
    assert DACT_FP8_CALLS == [(G, I, H)], DACT_FP8_CALLS
    assert COLUMN_CASTS == [] and WGRAD_FP8_CALLS == [] and UNCASTS == [], (COLUMN_CASTS, WGRAD_FP8_CALLS, UNCASTS)
    # FC1's epilogue casts the act, rows only: the bf16 kernel after bf16 x, the FP8 one after FP8 x
    assert ACT_CASTS == [(False, False)] * (not quantize_x), ACT_CASTS
    assert FP8_ACT_CASTS == [False] * quantize_x, FP8_ACT_CASTS
    assert len(EMITTED_ACTS) == 1 and EMITTED_ACTS[0][1] == I, EMITTED_ACTS  # FC2's weight gradient input
    # row-wise: dy, and with an FP8 FC1 x and d_pre; each weight once
    assert sorted(CASTS) == [1] * (1 + 2 * quantize_x) + [128] * (1 + quantize_x), CASTS
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    want = step(seq, x, dy)
    for name, a, b in zip(("y", "dx", "dW1", "dW2"), got, want):
        assert ref.rel_err(a, b) <= 5e-2, name
    assert torch.all(got[0][SPLITS.sum():] == 0)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", "fp8_blockwise_pow2", "fp8_current"])
def test_output_cast_in_the_epilogue(recipe, sm90_stand_ins, monkeypatch):
    """GroupedLinear, Quantize, GroupedLinear: fp8_blockwise casts FC1's output in its epilogue
    (its output format), fp8_current after it (FC2's input format); FC2 runs the FP8 kernel either way.
    Results against the torch backend."""
    current = recipe == "fp8_current"
    if recipe == "fp8_blockwise_pow2":
        recipe = Float8BlockScaling(power_2_scales=True)
    torch.manual_seed(0)
    seq = Sequential(GroupedLinear(G, H, I, bias=True, dtype=torch.bfloat16), Quantize(recipe),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16))
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    text = seq.explain(x, split_sizes=SPLITS)
    forward = (["[0] GroupedLinear -> rule 'grouped_linear' (backend sm90)",
                "[1:3] Quantize, GroupedLinear -> rule 'grouped_linear' (backend sm90)"] if current else
               ["[0:2] GroupedLinear, Quantize -> rule 'grouped_linear' (backend sm90)"])
    for line in (*forward, "[2] GroupedLinear -> rule 'grouped_linear_backward' (backend sm90)"):
        assert line in text, text
    ACT_CASTS.clear()
    got = step(seq, x, dy)
    power_2 = isinstance(recipe, Float8BlockScaling) and recipe.power_2_scales
    assert ACT_CASTS == [(power_2, False)] * (not current), ACT_CASTS
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    want = step(seq, x, dy)
    for name, a, b in zip(("y", "dx", "dW1", "db1", "dW2"), got, want):
        assert ref.rel_err(a, b) <= 5e-2, name


@pytest.mark.parametrize("power_2", [False, True])
def test_output_cast_with_columns_in_the_epilogue(power_2, sm90_stand_ins, monkeypatch):
    """GroupedLinear, Quantize, Transpose, GroupedLinear (fp8_blockwise): FC1's epilogue writes
    the output's rows and its column-wise copy (its output format with a Transpose); FC2
    keeps only the column copy for its FP8 weight gradient (no column cast, the rows not saved).
    Results against the torch backend."""
    torch.manual_seed(0)
    recipe = Float8BlockScaling(power_2_scales=power_2)
    seq = Sequential(GroupedLinear(G, H, I, bias=True, dtype=torch.bfloat16), Quantize(recipe), Transpose(),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16))
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    text = seq.explain(x, split_sizes=SPLITS)
    for line in ("[0:3] GroupedLinear, Quantize, Transpose -> rule 'grouped_linear' (backend sm90)",
                 "[3] GroupedLinear -> rule 'grouped_linear' (backend sm90)",
                 "[3] GroupedLinear -> rule 'grouped_linear_backward' (backend sm90)"):
        assert line in text, text
    for calls in (ACT_CASTS, COLUMN_CASTS, WGRAD_FP8_CALLS):
        calls.clear()
    saved = []

    def keep(t):
        saved.append((tuple(t.shape), t.dtype))
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        got = step(seq, x, dy)
    assert ACT_CASTS == [(power_2, True)], ACT_CASTS
    assert COLUMN_CASTS == [(True, False)], COLUMN_CASTS  # dy's rows and columns only
    assert WGRAD_FP8_CALLS == [(G, H, I)], WGRAD_FP8_CALLS
    assert ((ROWS, I), torch.float8_e4m3fn) not in saved, saved  # FC2 keeps the column copy, not the rows
    assert ((I, 128 * (-(-ROWS // 128) + G)), torch.float8_e4m3fn) in saved, saved
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    want = step(seq, x, dy)
    for name, a, b in zip(("y", "dx", "dW1", "db1", "dW2"), got, want):
        assert ref.rel_err(a, b) <= 5e-2, name


def test_block_columns_only_input_dequantizes_in_torch():
    """A QuantizedTensor holding only the block-padded column copy (what FC2 keeps) dequantizes
    to the values of that copy, padding rows zero, and round-trips through the saved-tensor
    packing with its fields."""
    from te_fused_ops.saved import pack, unpack

    torch.manual_seed(0)
    offsets = torch.tensor([0, 70, 70, 200, 260], dtype=torch.int32)
    values = torch.randn(ROWS, I)
    q = quantize(values, "fp8_blockwise", rowwise=False, columnwise=True, offsets=offsets)
    columns = column_cast(values, offsets)
    kept = QuantizedTensor(values.shape, values.dtype, values.device, recipe=q.recipe, role="activation",
                           offsets=offsets, block_columns_data=columns.data, block_columns_scale_inv=columns.scale_inv)
    tensors = []
    kept = unpack(pack(kept, tensors, {}), tensors)
    assert kept.block_columns_data is columns.data and kept.block_columns_scale_inv is columns.scale_inv
    got = kept.dequantize()
    assert torch.equal(got[:260], q.dequantize()[:260])
    assert torch.all(got[260:] == 0)


def test_fp8_dact_rule_declines_a_quantized_gradient(sm90_stand_ins):
    """Quantize(quantize_grad=True) casts the gradient between FC2's dgrad and the dActivation:
    the fused FP8 backward says so and the ops run one by one."""
    torch.manual_seed(0)
    seq = Sequential(GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), SwiGLU(),
                     Quantize("fp8_blockwise", quantize_grad=True), GroupedLinear(G, I, H, dtype=torch.bfloat16))
    text = seq.explain(torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True), split_sizes=SPLITS)
    for line in ("[3] GroupedLinear -> rule 'grouped_linear_backward' (backend sm90)",
                 "[2] Quantize -> basic op", "[1] SwiGLU -> basic op",
                 "not fired: rule 'dactivation+grouped_linear' on [1:4]",
                 "sm90 backend: Quantize(quantize_grad=True) casts the gradient between the GEMM and the dActivation"):
        assert line in text, text


@pytest.mark.parametrize("act", [ScaledSwiGLU, SReLU, ClampedSwiGLU])
def test_fp8_dact_without_transpose_matches_the_emulation(act, sm90_stand_ins, monkeypatch):
    """Activation, Quantize, GroupedLinear (no Transpose): the FP8 dAct backward rule, with the
    router-probability gradient and a non-GLU activation, against the torch backend."""
    torch.manual_seed(0)
    glu = act is not SReLU
    seq = Sequential(GroupedLinear(G, H, 2 * I if glu else I, dtype=torch.bfloat16), act(),
                     Quantize("fp8_blockwise"), GroupedLinear(G, I, H, dtype=torch.bfloat16))
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    side = {"probs": torch.rand(ROWS, requires_grad=True)} if act is ScaledSwiGLU else {}
    text = seq.explain(x, split_sizes=SPLITS, **side)
    # forward: a GLU act cast to E4M3 in FC1's epilogue, SReLU's after FC1 (FC2's input format)
    forward = ([f"[0:3] GroupedLinear, {act.__name__}, Quantize -> rule 'grouped_linear+activation' (backend sm90)"]
               if glu else ["[0:2] GroupedLinear, SReLU -> rule 'grouped_linear+activation' (backend sm90)",
                            "[2:4] Quantize, GroupedLinear -> rule 'grouped_linear' (backend sm90)"])
    for expected in (*forward,
                     f"[1:4] {act.__name__}, Quantize, GroupedLinear -> rule 'dactivation+grouped_linear' "
                     "(backend sm90)"):
        assert expected in text, text
    DACT_FP8_CALLS.clear()
    ACT_CASTS.clear()
    got = step(seq, x, dy, **side)
    assert DACT_FP8_CALLS == [(G, I, H)], DACT_FP8_CALLS
    assert ACT_CASTS == [(False, False)] * glu, ACT_CASTS
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    want = step(seq, x, dy, **side)
    for i, (a, b) in enumerate(zip(got, want)):
        assert ref.rel_err(a, b) <= 5e-2, i


@pytest.mark.parametrize("fp8_fc2", [False, True])  # True: FC1's act cast in its epilogue, FC2 in FP8
def test_recompute_output_reruns_fc1_in_the_backward(fp8_fc2, sm90_stand_ins):
    """GroupedLinear(recompute_output=True) as FC1: the forward keeps no pre-activation, the
    backward's dSwiGLU reads it from one more run of the plain GEMM; results as without it."""
    def run(recompute):
        torch.manual_seed(0)
        tail = [Quantize("fp8_blockwise"), Transpose()] if fp8_fc2 else []
        seq = Sequential(GroupedLinear(G, H, 2 * I, bias=True, recompute_output=recompute, dtype=torch.bfloat16),
                         SwiGLU(), *tail, GroupedLinear(G, I, H, dtype=torch.bfloat16))
        x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
        GEMM_CALLS.clear()
        return step(seq, x, dy), list(GEMM_CALLS)

    kept, kept_calls = run(False)
    recomputed, recomputed_calls = run(True)
    assert recomputed_calls == kept_calls + [None], (kept_calls, recomputed_calls)  # FC1 again, no activation
    for a, b in zip(kept, recomputed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("bias,i", [(True, I), (False, 96)])
def test_blockwise_three_op_backward_with_fc1_bias_and_partial_blocks(bias, i, sm90_stand_ins, monkeypatch):
    """fp8_blockwise all the way: d_pre is written in 16 bits and cast after the kernel, so the
    three-op backward runs with an FC1 bias (its gradient sums that d_pre) and with I not a
    multiple of 128; the step matches the torch backend."""
    torch.manual_seed(0)
    fc1 = GroupedLinear(G, H, 2 * i, bias=bias, dtype=torch.bfloat16)
    fc2 = GroupedLinear(G, i, H, dtype=torch.bfloat16)
    seq = Sequential(Quantize("fp8_blockwise"), fc1, SwiGLU(), Quantize("fp8_blockwise"), Transpose(), fc2)
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    text = seq.explain(x, split_sizes=SPLITS)
    assert ("[1:6] GroupedLinear, SwiGLU, Quantize, Transpose, GroupedLinear -> rule "
            "'grouped_linear+dactivation+grouped_linear' (backend sm90)") in text, text
    got = step(seq, x, dy)
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    want = step(seq, x, dy)
    for name, a, b in zip(("y", "dx", "dW1", "db1", "dW2"), got, want):
        assert ref.rel_err(a, b) <= 5e-2, name


@pytest.mark.parametrize("bias,i", [(True, 128), (False, 96)])
def test_16_bit_weight_gradients_lift_the_d_pre_cast_limits(bias, i, sm90_stand_ins, monkeypatch):
    """With `high_precision_wgrad` d_pre is made in 16 bits, so the three-op backward runs with an
    FC1 bias and with I not a multiple of 128 (its cast after the kernel); FC1's act cast stays in
    its epilogue at I 96 (no column copy to block it); the step matches the torch backend."""
    torch.manual_seed(0)
    recipe = Float8BlockScaling(high_precision_wgrad=True)
    fc1 = GroupedLinear(G, H, 2 * i, bias=bias, dtype=torch.bfloat16)
    fc2 = GroupedLinear(G, i, H, bias=bias, dtype=torch.bfloat16)
    seq = Sequential(Quantize(recipe), fc1, SwiGLU(), Quantize(recipe), Transpose(), fc2)
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    text = seq.explain(x, split_sizes=SPLITS)
    assert ("[1:6] GroupedLinear, SwiGLU, Quantize, Transpose, GroupedLinear -> rule "
            "'grouped_linear+dactivation+grouped_linear' (backend sm90)") in text, text
    got = step(seq, x, dy)
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    want = step(seq, x, dy)
    for name, a, b in zip(("y", "dx", "dW1", "db1", "dW2", "db2") if bias else ("y", "dx", "dW1", "dW2"), got, want):
        assert ref.rel_err(a, b) <= 5e-2, name
    monkeypatch.delenv("TE_FUSED_OPS_BACKEND")
    bf16_fc1 = Sequential(fc1, SwiGLU(), Quantize(recipe), Transpose(), fc2)
    assert ("[0:4] GroupedLinear, SwiGLU, Quantize, Transpose -> rule 'grouped_linear+activation' (backend sm90)"
            in bf16_fc1.explain(x, split_sizes=SPLITS)), bf16_fc1.explain(x, split_sizes=SPLITS)


@pytest.mark.parametrize("case", ["frozen_fc1", "partial_block"])
def test_column_copies_in_the_forward_only_where_they_are_read(case, sm90_stand_ins, monkeypatch):
    """x's column copy comes with its cast only when FC1's weight gradient runs in FP8 (a frozen
    FC1 needs none: the rows only, as FC1's input format); the act's comes from FC1's epilogue only
    when I is a multiple of 128 (I = 96: the act cast in the epilogue, its columns made in FC2's
    backward from the rows). The steps still match the emulation."""
    torch.manual_seed(0)
    i = 96 if case == "partial_block" else I
    fc1 = GroupedLinear(G, H, 2 * i, dtype=torch.bfloat16)
    fc2 = GroupedLinear(G, i, H, dtype=torch.bfloat16)
    fc1.weight.requires_grad_(case != "frozen_fc1")
    tail = [SwiGLU(), Quantize("fp8_blockwise"), Transpose(), fc2]
    seq = Sequential(*([Quantize("fp8_blockwise")] if case == "frozen_fc1" else []), fc1, *tail)
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    text = seq.explain(x, split_sizes=SPLITS)
    if case == "frozen_fc1":  # x cast rows only (no weight gradient reads its columns)
        expected = ["[0:3] Quantize, GroupedLinear, SwiGLU -> rule 'grouped_linear+activation' (backend sm90)",
                    "[3:6] Quantize, Transpose, GroupedLinear -> rule 'grouped_linear' (backend sm90)"]
    else:
        expected = ["[0:3] GroupedLinear, SwiGLU, Quantize -> rule 'grouped_linear+activation' (backend sm90)",
                    "[3:5] Transpose, GroupedLinear -> rule 'grouped_linear' (backend sm90)",
                    "not fired: rule 'grouped_linear+activation' on [0:4]: ran on [0:3] instead; ",
                    "sm90 backend: 96 cast columns, not a multiple of 128 (column-wise copy)"]
    for line in expected:
        assert line in text, text
    COLUMN_CASTS.clear()
    got = step(seq, x, dy)
    # FC2's dy, rows and columns from one cast; the act's columns from its rows in the backward
    # (partial block), or with its rows as FC2's input format (after the FP8 FC1 of the frozen
    # case the act is cast after FC1); no copy of x at all (frozen FC1: no weight gradient)
    act_columns = (True, False) if case == "frozen_fc1" else (False, True)
    assert sorted(COLUMN_CASTS) == sorted([act_columns, (True, False)]), COLUMN_CASTS
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    want = step(seq, x, dy)
    for name, a, b in zip(("y", "dx", "dW1", "dW2"), got, want):
        assert (a is None) == (b is None), name
        if a is not None:
            assert ref.rel_err(a, b) <= 5e-2, name


def test_sm_margin_reaches_every_kernel_from_the_environment(sm90_stand_ins, monkeypatch):
    """The kernels read no environment: the sm90 backend reads TE_FUSED_OPS_SM_MARGIN at each call
    and passes it to every GEMM of the forward and the backward."""
    import te_fused_ops.backends.sm90.linear as sm90
    import te_fused_ops.backends.sm90.rules as sm90_rules

    seen = []

    def recording(module, name):
        real = getattr(module, name)

        def call(*args, **kwargs):
            seen.append((name, kwargs.get("sm_margin")))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, call)

    for name in ("grouped_gemm_sm90", "grouped_wgrad_sm90", "grouped_column_sums_sm90"):
        recording(sm90, name)
    recording(sm90_rules, "grouped_dgrad_dact_sm90")
    seq = Sequential(GroupedLinear(G, H, 2 * I, bias=True, dtype=torch.bfloat16), SwiGLU(),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16))
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    for margin in (16, 0):
        monkeypatch.setenv("TE_FUSED_OPS_SM_MARGIN", str(margin))
        seen.clear()
        step(seq, x, torch.randn(ROWS, H, dtype=torch.bfloat16))
        assert {name for name, _ in seen} == {"grouped_gemm_sm90", "grouped_wgrad_sm90", "grouped_column_sums_sm90",
                                              "grouped_dgrad_dact_sm90"}, seen
        assert all(m == margin for _, m in seen), seen


SCATTERS = []  # x's shape of each stood-in row scatter


def scatter_rows_stand_in(x, rows, num_kept, out=None, scale=None, y=None, dot_out=None, num_rows=None):
    """`moe_rows.scatter_rows`' contract: kept slot (t, j) writes x[t] (times scale) to row
    rows[t, j], a dropped slot's row is zero; with ``y`` the slots' dots <x[t], y[row]>."""
    SCATTERS.append(tuple(x.shape))
    tokens, k = rows.shape
    flat, kept = rows.reshape(-1).long(), rows.reshape(-1) < num_kept
    values = x.float().repeat_interleave(k, 0)
    if scale is not None:
        values = values * scale.reshape(-1, 1).float()
    result = torch.zeros(num_rows or tokens * k, x.shape[1], dtype=x.dtype) if out is None else out.zero_()
    inside = flat < result.shape[0]  # a dropped slot's id may lie past the rows (expert parallel)
    result[flat[inside]] = torch.where(kept[:, None], values, 0)[inside].to(x.dtype)
    if dot_out is not None:
        dots = (x.float().repeat_interleave(k, 0) * y[flat.clamp(0, y.shape[0] - 1)].float()).sum(1)
        dot_out.copy_(torch.where(kept, dots, 0).view(tokens, k))
    return result


def gather_sum_stand_in(src, rows, num_kept, out=None, weights=None):
    """`moe_rows.gather_sum`'s contract: each token's kept rows summed in float32 (weighted); a
    dropped slot's row id may lie past src's rows (it is never read)."""
    picked = src.float()[rows.long().clamp(0, max(src.shape[0] - 1, 0))]
    factor = (rows < num_kept).float() * (1.0 if weights is None else weights.float())
    return (picked * factor[..., None]).sum(1).to(src.dtype)


GATHERED_GEMMS = []  # activation of each stood-in gathered forward


def gathered_gemm_stand_in(x, x_index, weight, offsets, *, activation=None, **epilogue):
    """`grouped_gemm_gathered_sm90`'s contract: `grouped_gemm_sm90` on x[x_index]."""
    GATHERED_GEMMS.append(activation)
    return gemm(x[x_index.long().clamp(0, x.shape[0] - 1)], weight, offsets, activation=activation, **epilogue)


def routed_layer(monkeypatch, act=SwiGLU, width=I, tokens=90):
    """The routed layer (Permute, FC1 (H -> 2 ``width``), ``act``, FC2, Unpermute) with the row
    kernels and the gathered forward stood in too, and its inputs: (layer, x (``tokens``, H),
    indices (``tokens``, 3) with dropped slots, probs, dy)."""
    import te_fused_ops.backends.sm90.moe as sm90_moe
    import te_fused_ops.backends.sm90.rules as sm90_rules
    from te_fused_ops import Permute, Unpermute

    monkeypatch.setattr(sm90_moe, "scatter_rows", kernel_contract(scatter_rows_stand_in))
    monkeypatch.setattr(sm90_moe, "gather_sum", kernel_contract(gather_sum_stand_in))
    monkeypatch.setattr(sm90_rules, "grouped_gemm_gathered_sm90", kernel_contract(gathered_gemm_stand_in))
    torch.manual_seed(0)
    k = 3
    seq = Sequential(Permute(G), GroupedLinear(G, H, 2 * width, dtype=torch.bfloat16), act(),
                     GroupedLinear(G, width, H, dtype=torch.bfloat16), Unpermute())
    x = torch.randn(tokens, H, dtype=torch.bfloat16, requires_grad=True)
    indices = torch.randint(0, G, (tokens, k))
    indices[::7, 1] = -1  # dropped slots: padding rows past the groups
    return seq, x, indices, torch.rand(tokens, k, requires_grad=True), torch.randn(tokens, H, dtype=torch.bfloat16)


def routed_step(seq, x, indices, probs, dy):
    """One step of a `routed_layer`, the stand-ins' call records cleared first: [y, x's, probs'
    and the parameters' gradients]."""
    leaves = (x, probs, *seq.parameters())
    for t in leaves:
        t.grad = None
    for calls in (SCATTERS, GATHERED_GEMMS, GATHERED_WGRADS, DY_GATHERS):
        calls.clear()
    y = seq(x, indices=indices, probs=probs)
    y.backward(dy)
    return [y.detach(), *(t.grad.clone() for t in leaves)]


def test_auto_reads_every_row_by_index_up_to_its_widths(sm90_stand_ins, monkeypatch):
    """auto at the widest layer it reads by index (FC2's input `GATHER_DY_MAX_WIDTH`, FC1 twice
    that, within `GATHER_MAX_WIDTH` and `GATHER_WGRAD_MAX_WIDTH`) runs the plan of 1: no row
    scatter, FC1's forward, FC2's dActivation and both weight gradients read rows by index, the
    gradients bit for bit 1's. 64 columns wider, every GEMM reads the copies (three scatters: the
    permute, the combine's backward, x permuted again for FC1's weight gradient) but FC2's weight
    gradient, whose wait for d_pre would hold dy's copy here
    (`test_wide_fc2_weight_gradient_reads_dy_by_index_where_its_wait_would_hold_the_copy`)."""
    from te_fused_ops.backends.sm90.linear import GATHER_WGRAD_MAX_WIDTH
    from te_fused_ops.backends.sm90.rules import GATHER_DY_MAX_WIDTH, GATHER_MAX_WIDTH

    assert 2 * GATHER_DY_MAX_WIDTH == GATHER_MAX_WIDTH == GATHER_WGRAD_MAX_WIDTH
    counts, outputs = {}, {}
    for width, setting in ((GATHER_DY_MAX_WIDTH, "auto"), (GATHER_DY_MAX_WIDTH, "1"),
                           (GATHER_DY_MAX_WIDTH + 64, "auto")):
        monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", setting)
        outputs[width, setting] = routed_step(*routed_layer(monkeypatch, ScaledSwiGLU, width=width))
        counts[width, setting] = tuple(len(calls) for calls in (SCATTERS, GATHERED_GEMMS, DY_GATHERS,
                                                                  GATHERED_WGRADS))
    assert counts[GATHER_DY_MAX_WIDTH, "auto"] == counts[GATHER_DY_MAX_WIDTH, "1"] == (0, 1, 1, 2), counts
    assert counts[GATHER_DY_MAX_WIDTH + 64, "auto"] == (3, 0, 0, 1), counts
    for a, b in zip(outputs[GATHER_DY_MAX_WIDTH, "auto"], outputs[GATHER_DY_MAX_WIDTH, "1"]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("tokens,waits", [(90, True), (400, False)])
def test_wide_fc2_weight_gradient_reads_dy_by_index_where_its_wait_would_hold_the_copy(
        tokens, waits, sm90_stand_ins, monkeypatch):
    """Auto past `GATHER_DY_MAX_WIDTH`: FC2's data gradient + dActivation reads dy's expert-ordered
    copy; its weight gradient reads dy by index (and waits for d_pre to be freed) where a wait on
    the copy would hold it to the end (act + copy no larger than W2 and d_pre: 90 tokens), else
    it reads the copy at once (400 tokens: act + copy larger than W2). Waiting, it runs with the
    copy gone and d_pre's storage freed. Gradients bit for bit 0's."""
    import weakref

    import te_fused_ops.backends.sm90.linear as sm90_linear
    import te_fused_ops.backends.sm90.rules as sm90_rules
    from te_fused_ops.backends.sm90.rules import GATHER_DY_MAX_WIDTH

    copies, written, when_dw2 = [], [], []
    dact, by_index = sm90_rules.grouped_dgrad_dact_sm90, sm90_linear.grouped_wgrad_gathered_sm90

    def recording_dact(dy, weight, offsets, pre, **kwargs):
        copies.append(weakref.ref(dy))
        written.append(kwargs["out"])
        return dact(dy, weight, offsets, pre, **kwargs)

    def recording_gathered(dy, x, index, offsets, **kwargs):
        when_dw2.append((copies[-1]() is None, written[-1].untyped_storage().size() == 0))
        return by_index(dy, x, index, offsets, **kwargs)

    monkeypatch.setattr(sm90_rules, "grouped_dgrad_dact_sm90", recording_dact)
    monkeypatch.setattr(sm90_linear, "grouped_wgrad_gathered_sm90", recording_gathered)
    width = GATHER_DY_MAX_WIDTH + 64
    outputs = {}
    for setting in ("auto", "0"):
        monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", setting)
        layer = routed_layer(monkeypatch, ScaledSwiGLU, width=width, tokens=tokens)
        copies.clear(), written.clear(), when_dw2.clear()
        outputs[setting] = routed_step(*layer)
        if setting == "auto":
            assert not DY_GATHERS, DY_GATHERS
            assert [operand for operand, _ in GATHERED_WGRADS] == (["dy"] if waits else []), GATHERED_WGRADS
            assert when_dw2 == ([(True, True)] if waits else []), when_dw2
    for a, b in zip(*outputs.values()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("setting", ["0", "1", "auto"])
def test_fc1_reads_the_permuted_rows_by_index(setting, sm90_stand_ins, monkeypatch):
    """TE_FUSED_OPS_GATHER_ROWS (auto: FC1 this narrow gathers): FC1 + activation in the routed
    layer reads x's rows by index (rule 'permute+grouped_linear+activation'; the forward writes no
    permuted copy), and so does FC1's weight gradient (no permuted copy in the backward either);
    the layer's output and gradients equal those of the plan without it bit for bit, and the
    torch backend's."""
    seq, x, indices, probs, dy = routed_layer(monkeypatch)
    tokens = x.shape[0]

    def run():
        return routed_step(seq, x, indices, probs, dy)

    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "0")
    default = run()
    assert len(SCATTERS) == 3 and not GATHERED_GEMMS + GATHERED_WGRADS  # permute, combine's backward, FC1's input
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", setting)
    gather = setting != "0"
    text = seq.explain(x, indices=indices, probs=probs)
    assert ("[0:3] Permute, GroupedLinear, SwiGLU -> rule 'permute+grouped_linear+activation' (backend sm90)"
            in text) == gather, text
    got = run()
    if gather:  # the combine's backward alone; FC1's weight gradient reads x's rows by index too
        assert len(SCATTERS) == 1 and GATHERED_GEMMS == ["swiglu"] and GATHERED_WGRADS == [("x", (tokens, H))]
    for a, b in zip(got, default):
        assert torch.equal(a, b)
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    for a, b in zip(got, run()):
        assert ref.rel_err(a, b) <= 1e-2


@pytest.mark.parametrize("setting", ["0", "1", "auto"])
def test_fc2_backward_reads_dy_rows_by_index(setting, sm90_stand_ins, monkeypatch):
    """TE_FUSED_OPS_GATHER_ROWS (auto: FC2's input this narrow gathers; 0 keeps dy's copy): with the probabilities
    applied in ScaledSwiGLU the combine is a plain sum, and FC2's data gradient + dActivation and
    its weight gradient read dy's token rows by index (rule 'dactivation+grouped_linear+unpermute'): the
    backward writes no expert-ordered copy of dy; output and gradients bit for bit those of the
    plan without it, and the torch backend's. With the probabilities in the combine the rule runs
    the combine's backward first (its rows are scaled copies)."""
    combined = routed_layer(monkeypatch)[0]
    scaled, x, indices, probs, dy = routed_layer(monkeypatch, ScaledSwiGLU)
    tokens = x.shape[0]

    def run(seq):
        return routed_step(seq, x, indices, probs, dy)

    rule = "[2:5] ScaledSwiGLU, GroupedLinear, Unpermute -> rule 'dactivation+grouped_linear+unpermute' (backend sm90)"
    for seq, fires_alone in ((scaled, True), (combined, False)):
        monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "0")
        default = run(seq)
        assert len(SCATTERS) == 3 and not DY_GATHERS  # permute, combine's backward, FC1's input again
        monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", setting)
        gather = setting != "0"
        text = seq.explain(x, indices=indices, probs=probs)
        assert (rule.replace("ScaledSwiGLU", type(seq[2]).__name__) in text) == gather, text
        got = run(seq)
        if gather and fires_alone:  # no row written in expert order: both gradients of FC2 read dy by index
            assert not SCATTERS and DY_GATHERS == [(tokens, H)]
            # FC1's weight gradient first: FC2's waits until d_pre's storage is freed
            assert GATHERED_WGRADS == [("x", (tokens, H)), ("dy", (tokens, H))]
        elif gather:  # FC1 gathers too: the combine's backward is the one scatter
            assert len(SCATTERS) == 1 and not DY_GATHERS
        for a, b in zip(got, default):
            assert torch.equal(a, b)
        monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
        for a, b in zip(got, run(seq)):
            assert ref.rel_err(a, b) <= 1e-2
        monkeypatch.delenv("TE_FUSED_OPS_BACKEND")


def test_fc2_backward_keeps_dy_copy_when_asked_or_with_bias(sm90_stand_ins, monkeypatch):
    """FC2's backward keeps dy's expert-ordered copy, without its rule reading dy by index, with
    TE_FUSED_OPS_GATHER_ROWS=0 and with an FC2 bias (its gradient sums dy's expert rows); explain()
    says why. Wider than `GATHER_DY_MAX_WIDTH` the rule runs under auto, 1 and wgrad (under auto its
    data gradient reads the copy; its weight gradient:
    `test_wide_fc2_weight_gradient_reads_dy_by_index_where_its_wait_would_hold_the_copy`)."""
    from te_fused_ops import Permute, Unpermute
    from te_fused_ops.backends.sm90.rules import GATHER_DY_MAX_WIDTH

    x = torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True)
    indices, probs = torch.randint(0, G, (16, 2)), torch.rand(16, 2)
    wide = GATHER_DY_MAX_WIDTH + 32
    rule = "-> rule 'dactivation+grouped_linear+unpermute'"
    for setting, width, bias, reason in (
            ("auto", wide, False, None),
            ("1", wide, False, None),
            ("wgrad", wide, False, None),
            ("0", I, False, "TE_FUSED_OPS_GATHER_ROWS=0 (FC2's backward reads dy's expert-ordered copy)"),
            ("1", I, True, "FC2 has a bias")):
        monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", setting)
        seq = Sequential(Permute(G), GroupedLinear(G, H, 2 * width, dtype=torch.bfloat16), ScaledSwiGLU(),
                         GroupedLinear(G, width, H, bias=bias, dtype=torch.bfloat16), Unpermute())
        text = seq.explain(x, indices=indices, probs=probs)
        assert (rule in text) == (reason is None), text
        assert reason is None or reason in text, text


@pytest.mark.parametrize("setting,width,gathers", [("auto", 4096, True), ("auto", 4104, False), ("1", 8192, True),
                                                   ("wgrad", 8192, True), ("0", 1024, False)])
def test_weight_gradient_reads_rows_by_index_where_fc1_is_narrow(setting, width, gathers, monkeypatch):
    """TE_FUSED_OPS_GATHER_ROWS for FC1's weight gradient: auto gathers up to
    `GATHER_WGRAD_MAX_WIDTH` output columns (where it measured level with permuting x again, and
    the step's peak falls)."""
    from te_fused_ops.backends.sm90.linear import GATHER_WGRAD_MAX_WIDTH, gather_wgrad

    assert GATHER_WGRAD_MAX_WIDTH == 4096
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", setting)
    assert gather_wgrad(torch.empty(4, width)) is gathers


def test_wide_fc1_reads_the_permuted_copy_unless_asked(sm90_stand_ins, monkeypatch):
    """TE_FUSED_OPS_GATHER_ROWS=auto leaves an FC1 wider than `GATHER_MAX_WIDTH` on the permuted
    copy (and says why in explain()); 1 gathers it anyway."""
    from te_fused_ops import Permute, Unpermute
    from te_fused_ops.backends.sm90.rules import GATHER_MAX_WIDTH

    seq = Sequential(Permute(G), GroupedLinear(G, H, GATHER_MAX_WIDTH + 128, dtype=torch.bfloat16), SwiGLU(),
                     GroupedLinear(G, (GATHER_MAX_WIDTH + 128) // 2, H, dtype=torch.bfloat16), Unpermute())
    x = torch.randn(16, H, dtype=torch.bfloat16, requires_grad=True)
    indices, probs = torch.randint(0, G, (16, 2)), torch.rand(16, 2)
    rule = "-> rule 'permute+grouped_linear+activation'"
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "auto")
    text = seq.explain(x, indices=indices, probs=probs)
    assert rule not in text and f"FC1 width {GATHER_MAX_WIDTH + 128} > {GATHER_MAX_WIDTH}" in text, text
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "1")
    assert rule in seq.explain(x, indices=indices, probs=probs)


def test_compiled_gathered_layer_recomputes_with_the_kernels(sm90_stand_ins, monkeypatch):
    """torch.compile of the routed layer with FC1 gathering x's rows: the fake run saves what the
    rule's reference saves (FC1's input as the permute's torch recompute), the real run what the
    sm90 kernels save (the same tensors, recomputed by the row kernels); the compiled step equals
    eager bit for bit and its backward recomputes FC1's input with the kernels."""
    import te_fused_ops.backends.sm90.moe as sm90_moe
    import te_fused_ops.backends.sm90.rules as sm90_rules
    from te_fused_ops import Permute, Unpermute

    monkeypatch.setattr(sm90_moe, "scatter_rows", kernel_contract(scatter_rows_stand_in))
    monkeypatch.setattr(sm90_moe, "gather_sum", kernel_contract(gather_sum_stand_in))
    monkeypatch.setattr(sm90_rules, "grouped_gemm_gathered_sm90", kernel_contract(gathered_gemm_stand_in))
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "1")
    torch.manual_seed(0)
    tokens, k = 96, 2
    seq = Sequential(Permute(G), GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), SwiGLU(),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16), Unpermute())
    compiled = torch.compile(seq, backend="eager", dynamic=False)
    dy = torch.randn(tokens, H, dtype=torch.bfloat16)
    for seed in (1, 2):
        torch.manual_seed(seed)
        x0 = torch.randn(tokens, H, dtype=torch.bfloat16)
        indices, probs0 = torch.randint(0, G, (tokens, k)), torch.rand(tokens, k)
        runs = []
        for fn in (compiled, seq):
            for t in seq.parameters():
                t.grad = None
            SCATTERS.clear()
            GATHERED_WGRADS.clear()
            x, probs = x0.clone().requires_grad_(), probs0.clone().requires_grad_()
            y = fn(x, indices=indices, probs=probs)
            y.backward(dy)
            # the backward's: the combine's scatter; FC1's weight gradient reads the kernels' rows by index
            assert len(SCATTERS) == 1 and GATHERED_WGRADS == [("x", (tokens, H))]
            runs.append([y.detach(), x.grad, probs.grad, *(t.grad.clone() for t in seq.parameters())])
        for a, b in zip(*runs):
            assert torch.equal(a, b)


def test_compiled_rule_saving_other_tensors_than_its_reference_raises(sm90_stand_ins):
    """Under torch.compile a backend's implementation may recompute a saved value with other
    functions than the rule's reference (above), but must save the same tensors: one that keeps
    a tensor more raises, naming the rule and backend."""
    import te_fused_ops as tfo

    def reference(ops, ctxs, x):
        return ops[1].op_forward(ctxs[1], ops[0].op_forward(ctxs[0], x))

    def saves_more(ops, ctxs, x):
        y = reference(ops, ctxs, x)
        ctxs[1].saved.extra = x * 2  # nothing reads it; the reference keeps no such tensor
        return y

    rule = tfo.fusion_rule(name="saves_more", pattern=(GroupedLinear, SReLU), passes="forward", priority=100)(
        reference)
    rule.implementation("sm90")(saves_more)
    try:
        seq = Sequential(GroupedLinear(G, H, H, dtype=torch.bfloat16), SReLU())
        x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
        assert "rule 'saves_more' (backend sm90)" in seq.explain(x, split_sizes=SPLITS)
        compiled = torch.compile(seq, backend="eager", dynamic=False)
        with pytest.raises(RuntimeError, match=r"saved other values for the backward than the first \(fake\) "
                                               r"run .*'saves_more' \(sm90\)"):
            compiled(x, split_sizes=SPLITS)
    finally:
        tfo.unregister_rule("saves_more")


def test_strided_and_misaligned_inputs_reach_the_kernels_as_contiguous_copies(sm90_stand_ins):
    """A slice of a wider x, an x at an odd offset into a buffer and a strided dy run on the sm90
    plan as on a plain x and dy (the kernels read contiguous, 16-byte aligned rows: the backend
    copies such inputs first; the stand-ins check it, `kernel_contract`), bit for bit."""
    torch.manual_seed(0)
    seq = Sequential(GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), SwiGLU(),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16))
    x0 = torch.randn(ROWS, H, dtype=torch.bfloat16)
    dy0 = torch.randn(ROWS, H, dtype=torch.bfloat16)
    want = step(seq, x0.clone().requires_grad_(), dy0)
    wide = torch.zeros(ROWS, 2 * H, dtype=torch.bfloat16)
    wide[:, 1:H + 1] = x0
    buffer = torch.zeros(ROWS * H + 1, dtype=torch.bfloat16)
    buffer[1:] = x0.reshape(-1)
    strided_dy = torch.zeros(ROWS, 2 * H, dtype=torch.bfloat16)
    strided_dy[:, ::2] = dy0
    for x, dy in ((wide[:, 1:H + 1], dy0), (buffer[1:].view(ROWS, H), strided_dy[:, ::2])):
        assert not x.is_contiguous() or x.data_ptr() % 16
        got = step(seq, x.detach().requires_grad_(), dy)
        for a, b in zip(got, want):
            assert torch.equal(a, b)


def test_strided_layer_input_reaches_the_row_kernels_contiguous(sm90_stand_ins, monkeypatch):
    """A strided x (rows 2H apart) through the routed layer with every gather on: each kernel gets
    contiguous, aligned rows (the stand-ins check), the gradients equal the torch backend's."""
    import te_fused_ops.backends.sm90.moe as sm90_moe
    import te_fused_ops.backends.sm90.rules as sm90_rules
    from te_fused_ops import Permute, Unpermute

    monkeypatch.setattr(sm90_moe, "scatter_rows", kernel_contract(scatter_rows_stand_in))
    monkeypatch.setattr(sm90_moe, "gather_sum", kernel_contract(gather_sum_stand_in))
    monkeypatch.setattr(sm90_rules, "grouped_gemm_gathered_sm90", kernel_contract(gathered_gemm_stand_in))
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "1")
    torch.manual_seed(0)
    seq = Sequential(Permute(G), GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), SwiGLU(),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16), Unpermute())
    wide = torch.randn(40, 2 * H, dtype=torch.bfloat16)
    indices, probs = torch.randint(0, G, (40, 2)), torch.rand(40, 2)

    def grads():
        for t in seq.parameters():
            t.grad = None
        x = wide[:, :H].detach().requires_grad_()
        seq(x, indices=indices, probs=probs).float().square().sum().backward()
        return [x.grad, *(t.grad for t in seq.parameters())]

    got = grads()
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    for a, b in zip(got, grads()):
        assert ref.rel_err(a, b) <= 1e-2


def test_gathered_weight_gradient_runs_after_the_permute_backward(sm90_stand_ins, monkeypatch):
    """FC1's weight gradient reading x's rows by index is deferred to the end of the backward: the
    permute's backward has summed (and freed) the expert-ordered data gradient before dW exists."""
    import te_fused_ops.backends.sm90.linear as sm90_linear
    import te_fused_ops.backends.sm90.moe as sm90_moe
    import te_fused_ops.backends.sm90.rules as sm90_rules
    from te_fused_ops import Permute, Unpermute

    events = []

    def logged(name, fn):
        def call(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(sm90_moe, "scatter_rows", kernel_contract(scatter_rows_stand_in))
    monkeypatch.setattr(sm90_moe, "gather_sum", logged("gather_sum", kernel_contract(gather_sum_stand_in)))
    monkeypatch.setattr(sm90_rules, "grouped_gemm_gathered_sm90", kernel_contract(gathered_gemm_stand_in))
    monkeypatch.setattr(sm90_linear, "grouped_wgrad_gathered_sm90", logged("wgrad", sm90_linear.grouped_wgrad_gathered_sm90))
    monkeypatch.setattr(sm90_linear, "grouped_gemm_sm90", logged("dgrad", sm90_linear.grouped_gemm_sm90))
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", "auto")
    torch.manual_seed(0)
    seq = Sequential(Permute(G), GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), SwiGLU(),
                     GroupedLinear(G, I, H, dtype=torch.bfloat16), Unpermute())
    x = torch.randn(48, H, dtype=torch.bfloat16, requires_grad=True)
    indices, probs = torch.randint(0, G, (48, 2)), torch.rand(48, 2)
    y = seq(x, indices=indices, probs=probs)
    events.clear()
    y.backward(torch.randn_like(y))
    assert events == ["dgrad", "gather_sum", "wgrad"], events  # FC1's data gradient, the slot sum, then dW1
    assert seq[1].weight.grad is not None and seq[1].weight.grad.shape == seq[1].weight.shape


def scatter_cast_rows_stand_in(x, rows, num_kept, power_2_scales=False):
    """`moe_rows.scatter_cast_rows`' contract: each token's 1x128 cast (the torch quantizer)
    written to its kept slots' rows, zeros (multiplier 1) at the others."""
    q = quantize(x, Float8BlockScaling(power_2_scales=power_2_scales))
    data = torch.zeros(rows.numel(), x.shape[1], dtype=torch.float8_e4m3fn)
    scales = torch.ones(rows.numel(), q.rowwise_scale_inv.shape[1])
    flat, kept = rows.reshape(-1).long(), (rows < num_kept).reshape(-1)
    tokens = torch.arange(x.shape[0]).repeat_interleave(rows.shape[1])
    data.view(torch.uint8)[flat[kept]] = q.rowwise_data.view(torch.uint8)[tokens[kept]]
    scales[flat[kept]] = q.rowwise_scale_inv[tokens[kept]]
    return data, scales


@pytest.mark.parametrize("frozen_fc2_weight", [False, True])
def test_fp8_layer_with_16_bit_weight_gradients_on_the_row_kernels(frozen_fc2_weight, sm90_stand_ins, monkeypatch):
    """The FP8 MoE layer with `high_precision_wgrad` on the sm90 rules: each token cast once in the
    dispatch and in the combine's backward, FC1's weight gradient reading x's rows by index, FC2's
    on dy's 16-bit expert rows (its bias too; none made when neither reads them) and the act the
    FP8 dActivation writes (FC1's epilogue cast the act; none written for a frozen FC2), no FP8
    weight gradient and no column copy; within the torch backend's tolerance."""
    import te_fused_ops.backends.sm90.moe as sm90_moe
    from te_fused_ops import Permute, Unpermute

    monkeypatch.setattr(sm90_moe, "scatter_rows", kernel_contract(scatter_rows_stand_in))
    monkeypatch.setattr(sm90_moe, "gather_sum", kernel_contract(gather_sum_stand_in))
    monkeypatch.setattr(sm90_moe, "scatter_cast_rows", kernel_contract(scatter_cast_rows_stand_in))
    torch.manual_seed(0)
    recipe = Float8BlockScaling(high_precision_wgrad=True)
    fc2 = GroupedLinear(G, I, H, bias=True, dtype=torch.bfloat16)
    fc2.weight.requires_grad_(not frozen_fc2_weight)
    seq = Sequential(Permute(G), Quantize(recipe), GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), ScaledSwiGLU(),
                     Quantize(recipe), Transpose(), fc2, Unpermute())
    tokens, k = 90, 3
    x = torch.randn(tokens, H, dtype=torch.bfloat16, requires_grad=True)
    indices = torch.randint(0, G, (tokens, k))
    indices[::7, 1] = -1
    probs = torch.rand(tokens, k, requires_grad=True)
    dy = torch.randn(tokens, H, dtype=torch.bfloat16)
    text = seq.explain(x, indices=indices, probs=probs)
    assert "[0:2] Permute, Quantize -> rule 'permute+quantize' (backend sm90)" in text, text
    assert "rule 'grouped_linear+dactivation+grouped_linear+unpermute' (backend sm90)" in text, text

    def run():
        leaves = (x, probs, *(p for p in seq.parameters() if p.requires_grad))
        for t in leaves:
            t.grad = None
        for calls in (SCATTERS, GATHERED_WGRADS, COLUMN_CASTS, WGRAD_FP8_CALLS, FP8_ACT_CASTS, EMITTED_ACTS):
            calls.clear()
        seq(x, indices=indices, probs=probs).backward(dy)
        return [t.grad.clone() for t in leaves]

    got = run()
    assert GATHERED_WGRADS == [("x", (tokens, H))] and COLUMN_CASTS == [] and WGRAD_FP8_CALLS == []
    assert FP8_ACT_CASTS == [False] and len(EMITTED_ACTS) == int(not frozen_fc2_weight), (FP8_ACT_CASTS, EMITTED_ACTS)
    assert SCATTERS == [(tokens, H)]  # dy's 16-bit rows for FC2's weight and bias gradients
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    for name, a, b in zip(("dx", "dprobs", "dW1", "dW2 or db2", "db2"), got, run()):
        assert ref.rel_err(a, b) <= 5e-2, name


def test_fp8_layer_with_an_fc1_bias_casts_d_pre_after_the_kernel(sm90_stand_ins, monkeypatch):
    """The all-FP8 MoE layer with an FC1 bias runs the four-op backward: FC2's FP8 data gradient
    writes d_pre in 16 bits over the saved pre-activation (FC1's bias gradient sums it), and one
    cast kernel makes FC1's row-wise and column-wise copies from it; within the torch backend's
    tolerance."""
    import te_fused_ops.backends.sm90.moe as sm90_moe
    from te_fused_ops import Permute, Unpermute

    monkeypatch.setattr(sm90_moe, "scatter_rows", kernel_contract(scatter_rows_stand_in))
    monkeypatch.setattr(sm90_moe, "gather_sum", kernel_contract(gather_sum_stand_in))
    monkeypatch.setattr(sm90_moe, "scatter_cast_rows", kernel_contract(scatter_cast_rows_stand_in))
    monkeypatch.setattr(sm90_moe, "block_columns_sm90", kernel_contract(column_cast))
    torch.manual_seed(0)
    recipe = Float8BlockScaling()
    seq = Sequential(Permute(G), Quantize(recipe), GroupedLinear(G, H, 2 * I, bias=True, dtype=torch.bfloat16),
                     ScaledSwiGLU(), Quantize(recipe), Transpose(), GroupedLinear(G, I, H, dtype=torch.bfloat16),
                     Unpermute())
    tokens, k = 90, 3
    x = torch.randn(tokens, H, dtype=torch.bfloat16, requires_grad=True)
    indices = torch.randint(0, G, (tokens, k))
    probs = torch.rand(tokens, k, requires_grad=True)
    dy = torch.randn(tokens, H, dtype=torch.bfloat16)
    text = seq.explain(x, indices=indices, probs=probs)
    assert "rule 'grouped_linear+dactivation+grouped_linear+unpermute' (backend sm90)" in text, text

    def run():
        leaves = (x, probs, *seq.parameters())
        for t in leaves:
            t.grad = None
        COLUMN_CASTS.clear()
        seq(x, indices=indices, probs=probs).backward(dy)
        return [t.grad.clone() for t in leaves]

    got = run()
    assert (True, False) in COLUMN_CASTS, COLUMN_CASTS  # d_pre's rows and columns from its 16 bits
    monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
    # dW2 reads dy's column copy made from its E4M3 rows (each token cast once in the combine's
    # backward); the torch backend's is cast from the 16-bit expert rows: a second rounding
    for name, a, b in zip(("dx", "dprobs", "dW1", "db1", "dW2"), got, run()):
        assert ref.rel_err(a, b) <= (7e-2 if name == "dW2" else 5e-2), name


def _tensors(value):
    """The tensors in a kernel's output (nested tuples, named tuples)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, tuple):
        return [t for part in value for t in _tensors(part)]
    return []


@pytest.mark.parametrize("gather", ["auto", "0"])  # FC1's weight gradient reading x by index, or recomputed rows
@pytest.mark.parametrize("wgrad16", [True, False])
def test_fp8_layer_frees_dy_copies_before_fc1_backward(wgrad16, gather, sm90_stand_ins, monkeypatch):
    """FC2's copies of dy made in the combine's backward (the E4M3 rows and scales, the column
    copy of FP8 weight gradients, the 16-bit rows of `high_precision_wgrad`) die with FC2's
    backward: none is alive when FC1's data or weight gradient runs. With 16-bit weight gradients
    on recomputed rows, FC1's weight gradient runs before its data gradient, so those rows never
    meet dx."""
    import weakref

    import te_fused_ops.backends.sm90.linear as sm90_linear
    import te_fused_ops.backends.sm90.moe as sm90_moe
    from te_fused_ops import Permute, Unpermute

    copies, events, state = [], [], {"recording": False}

    def making(fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            if state["recording"]:
                copies.extend(weakref.ref(t) for t in _tensors(out))
            return out
        return call

    def logged(name, fn):
        def call(*args, **kwargs):
            if name == "wgrad":
                state["recording"] = False  # the first is FC2's: every copy of dy is made by then
            events.append((name, sum(ref() is not None for ref in copies)))
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(sm90_moe, "scatter_rows", making(kernel_contract(scatter_rows_stand_in)))
    monkeypatch.setattr(sm90_moe, "gather_sum", kernel_contract(gather_sum_stand_in))
    monkeypatch.setattr(sm90_moe, "scatter_cast_rows", making(kernel_contract(scatter_cast_rows_stand_in)))
    monkeypatch.setattr(sm90_moe, "block_columns_sm90", making(kernel_contract(column_cast)))
    for name in ("grouped_wgrad_sm90", "grouped_wgrad_gathered_sm90", "grouped_wgrad_fp8_sm90"):
        monkeypatch.setattr(sm90_linear, name, logged("wgrad", getattr(sm90_linear, name)))
    monkeypatch.setattr(sm90_linear, "grouped_gemm_fp8_sm90", logged("dgrad", sm90_linear.grouped_gemm_fp8_sm90))
    monkeypatch.setenv("TE_FUSED_OPS_GATHER_ROWS", gather)
    torch.manual_seed(0)
    recipe = Float8BlockScaling(high_precision_wgrad=wgrad16)
    seq = Sequential(Permute(G), Quantize(recipe), GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16), ScaledSwiGLU(),
                     Quantize(recipe), Transpose(), GroupedLinear(G, I, H, dtype=torch.bfloat16), Unpermute())
    tokens = 90
    x = torch.randn(tokens, H, dtype=torch.bfloat16, requires_grad=True)
    indices, probs = torch.randint(0, G, (tokens, 3)), torch.rand(tokens, 3, requires_grad=True)
    assert "rule 'grouped_linear+dactivation+grouped_linear+unpermute'" in seq.explain(x, indices=indices, probs=probs)
    y = seq(x, indices=indices, probs=probs)
    events.clear()
    state["recording"] = True
    y.backward(torch.randn_like(y))
    assert len(copies) >= (3 if wgrad16 else 2), copies  # E4M3 rows, scales (and 16-bit rows or columns)
    fc1 = events[1:]  # after FC2's weight gradient
    assert sorted(name for name, _ in fc1) == ["dgrad", "wgrad"] and all(alive == 0 for _, alive in fc1), events
    if wgrad16 and gather == "0":
        assert [name for name, _ in fc1] == ["wgrad", "dgrad"], events
    assert all(p.grad is not None for p in seq.parameters()) and x.grad is not None


@pytest.mark.parametrize("recipe", [Float8BlockScaling(), Float8BlockScaling(high_precision_wgrad=True),
                                    "fp8_current"])
def test_fp8_d_pre_is_written_over_pre_unless_the_graph_is_kept(recipe, sm90_stand_ins, monkeypatch):
    """The FP8 dActivation kernel (d_pre leaves it in 16 bits with every recipe) writes it over the saved
    pre-activation when the backward frees the graph, as the bf16 one does; with retain_graph d_pre
    gets a buffer of its own and the second backward equals the first."""
    import te_fused_ops.backends.sm90.rules as dact_rule

    outs = []
    dgrad = dact_rule.grouped_dgrad_dact_fp8_sm90

    def recording(*args, **kwargs):
        outs.append(kwargs.get("out") is not None and kwargs["out"].data_ptr() == args[5].data_ptr())
        return dgrad(*args, **kwargs)

    monkeypatch.setattr(dact_rule, "grouped_dgrad_dact_fp8_sm90", recording)
    seq = fp8_mlp(recipe)
    _check_in_place_unless_retained(seq, outs)


@pytest.mark.parametrize("hidden", [512, 384])  # 384: E4M3 rows could not travel as whole vectors, 16-bit rows do
def test_expert_parallel_16_bit_rows_are_cast_on_the_cast_kernel(hidden, sm90_stand_ins, monkeypatch, tmp_path):
    """Expert parallel (a gloo group of one process) with `high_precision_wgrad`: the 16-bit rows
    that arrive are cast on the cast kernel (stood in), not by the torch quantizer, whatever the
    E4M3 payload would need of the hidden size; the layer equals the torch backend's."""
    import torch.distributed as dist

    import te_fused_ops.backends.sm90.moe as sm90_moe
    from te_fused_ops import Permute, Unpermute

    casts = []

    def recorded_cast(x, block_rows, power_2_scales=False, transposed=False):
        casts.append((tuple(x.shape), block_rows))
        return block_cast(x, block_rows, power_2_scales, transposed)

    monkeypatch.setattr(sm90_moe, "scatter_rows", kernel_contract(scatter_rows_stand_in))
    monkeypatch.setattr(sm90_moe, "gather_sum", kernel_contract(gather_sum_stand_in))
    monkeypatch.setattr(sm90_moe, "block_quantize_sm90", kernel_contract(recorded_cast))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        recipe = Float8BlockScaling(high_precision_wgrad=True)
        seq = Sequential(Permute(G, group=dist.group.WORLD, capacity_factor=1.0), Quantize(recipe),
                         GroupedLinear(G, hidden, 2 * I, dtype=torch.bfloat16), SwiGLU(),
                         GroupedLinear(G, I, hidden, dtype=torch.bfloat16), Unpermute(group=dist.group.WORLD))
        tokens = 64
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, requires_grad=True)
        indices, probs = torch.randint(-1, G, (tokens, 2)), torch.rand(tokens, 2)
        assert "[0:2] Permute, Quantize -> rule 'permute+quantize' (backend sm90)" in seq.explain(
            x, indices=indices, probs=probs)

        def run():
            for t in (x, *seq.parameters()):
                t.grad = None
            casts.clear()
            seq(x, indices=indices, probs=probs).float().square().sum().backward()
            return [x.grad, *(p.grad for p in seq.parameters())]

        got = run()
        assert casts and casts[0] == ((tokens * 2, hidden), 1), casts  # the rows that arrived, 1x128 blocks
        monkeypatch.setenv("TE_FUSED_OPS_BACKEND", "torch")
        for a, b in zip(got, run()):
            assert ref.rel_err(a, b) <= 2e-2
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe", [Float8BlockScaling(), "fp8_current"])
def test_graph_captured_weight_copies_are_recast_in_their_storage(recipe, sm90_stand_ins, monkeypatch):
    """FP8 weights under `cast_weights_once_per_step` read by a (stood-in) CUDA graph capture: the
    optimizer step casts each kept copy on the cast kernel straight into its storage (``out=``, no
    fresh copy copied in), and the layer after the step equals a fresh model's."""
    import te_fused_ops.quantization as quantization

    seq = fp8_mlp(recipe)
    x = torch.randn(ROWS, H, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(ROWS, H, dtype=torch.bfloat16)
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2, foreach=False)
    with cast_weights_once_per_step(opt, seq) as casts:
        step(seq, x, dy)
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        step(seq, x, dy)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        kept = [c.value for c in casts.scope.copies.values()]
        assert len(kept) == 2 and all(c.captured for c in casts.scope.copies.values())
        storage = [[t.data_ptr() for t in value] for value in kept]
        monkeypatch.setattr(quantization, "refill", lambda *args: pytest.fail("copied in, not cast into"))
        CASTS_INTO.clear()
        opt.step()
        assert [id(out) for out in CASTS_INTO] == [id(value) for value in kept]
        assert [c.value for c in casts.scope.copies.values()] == kept
        assert [[t.data_ptr() for t in value] for value in kept] == storage
        fresh = copy.deepcopy(seq)
        fresh.load_state_dict({k: v.clone() for k, v in seq.state_dict().items()})
        x_fresh = x.detach().clone().requires_grad_(True)
        for a, b in zip(step(seq, x, dy), step(fresh, x_fresh, dy)):
            assert torch.equal(a, b)
