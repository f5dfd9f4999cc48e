"""te_fused_ops inside TE's te.ops fuser (GPU, TE 2.20): the fused windows match TE's own path,
read nothing on the host, replay as a CUDA graph, and uninstall() restores TE's behaviour."""

import copy

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.te]
te = pytest.importorskip("transformer_engine.pytorch")
tfo_te = pytest.importorskip("te_fused_ops.integrations.transformer_engine")

G, H, I = 4, 256, 128
DT = torch.bfloat16
ACTIVATIONS = {
    "swiglu": lambda: te.ops.SwiGLU(),
    "scaled_swiglu": lambda: te.ops.ScaledSwiGLU(),
    "clamped_swiglu": lambda: te.ops.ClampedSwiGLU(limit=7.0, alpha=1.702),
    "geglu": lambda: te.ops.GEGLU(),
    "srelu": lambda: te.ops.SReLU(),
}


@pytest.fixture(autouse=True)
def installed():
    tfo_te.install()
    yield
    tfo_te.uninstall()


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def mlp(act, bias=False, **linear_kwargs):
    fc1_out = 2 * I if act not in ("srelu",) else I
    torch.manual_seed(0)
    return te.ops.Sequential(
        te.ops.GroupedLinear(G, H, fc1_out, bias=bias, device="cuda", dtype=DT, **linear_kwargs),
        ACTIVATIONS[act](),
        te.ops.GroupedLinear(G, I, H, bias=bias, device="cuda", dtype=DT, **linear_kwargs),
    )


def extra_inputs(act, splits, probs):
    return (splits, probs, splits) if act == "scaled_swiglu" else (splits, splits)


def step(model, act, x, splits, probs, dy):
    """Forward + backward, gradients set to None first; (y, dx, dprobs, parameter grads by name)."""
    for p in model.parameters():
        p.grad = None
    x = x.detach().clone().requires_grad_()
    probs = probs.detach().clone().requires_grad_()
    y = model(x, *extra_inputs(act, splits, probs))
    y.backward(dy)
    grads = {n: p.grad for n, p in model.named_parameters()}
    return y, x.grad, probs.grad if act == "scaled_swiglu" else None, grads


def inputs(m, splits, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, H, device="cuda", dtype=DT, generator=gen)
    probs = torch.rand(m, device="cuda", generator=gen)
    dy = torch.randn(m, H, device="cuda", dtype=DT, generator=gen)
    return x, torch.tensor(splits, device="cuda"), probs, dy


def compare(got, want, tol=2e-2):
    (y, dx, dp, grads), (y_ref, dx_ref, dp_ref, grads_ref) = got, want
    pairs = [("y", y, y_ref), ("dx", dx, dx_ref)] + ([("dprobs", dp, dp_ref)] if dp_ref is not None else [])
    pairs += [(n, grads[n], g) for n, g in grads_ref.items()]
    for name, a, b in pairs:
        assert a is not None and b is not None, name
        assert rel_err(a, b) <= tol, f"{name}: {rel_err(a, b):.3e}"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("act", list(ACTIVATIONS))
@pytest.mark.parametrize("splits", [[100, 0, 37, 119], [0, 0, 256, 0], [64, 64, 64, 64]])
def test_fused_window_matches_te(act, bias, splits):
    model = mlp(act, bias)
    reference = copy.deepcopy(model)
    x, s, probs, dy = inputs(sum(splits), splits)
    got = step(model, act, x, s, probs, dy)
    explanation = tfo_te.explain(model)
    assert "[0:3]" in explanation and "-> te_fused_ops" in explanation, explanation
    tfo_te.uninstall(reference)
    want = step(reference, act, x, s, probs, dy)
    assert "[0:3]" in tfo_te.explain(reference) and "not installed" in tfo_te.explain(reference)
    compare(got, want)


def test_lone_grouped_linear_and_main_grad():
    torch.manual_seed(0)
    model = te.ops.Sequential(
        te.ops.GroupedLinear(G, H, I, bias=False, device="cuda", dtype=DT, accumulate_into_main_grad=True)
    )
    reference = copy.deepcopy(model)
    for m in (model, reference):
        main = torch.zeros(G, I, H, device="cuda")  # one packed float32 buffer, as Megatron's
        for i in range(G):
            w = getattr(m[0], f"weight{i}")
            w.main_grad = main[i]
            w.grad_added_to_main_grad = False
    splits = [10, 200, 0, 46]
    x, s, _, _ = inputs(256, splits)
    dy = torch.randn(256, I, device="cuda", dtype=DT)
    outs = []
    for m in (model, reference):
        if m is reference:
            tfo_te.uninstall(reference)
        xi = x.clone().requires_grad_()
        for _ in range(2):  # accumulates over two backward passes
            m(xi, s).backward(dy)
        outs.append((xi.grad, [getattr(m[0], f"weight{i}").main_grad.clone() for i in range(G)]))
        assert all(getattr(m[0], f"weight{i}").grad_added_to_main_grad for i in range(G))
    assert "[0] GroupedLinear -> te_fused_ops" in tfo_te.explain(model)
    assert rel_err(outs[0][0], outs[1][0]) <= 2e-2
    for a, b in zip(outs[0][1], outs[1][1]):
        assert rel_err(a, b) <= 2e-2


def test_padding_rows_and_runtime_fallback():
    model = mlp("swiglu")
    splits = [50, 0, 30, 20]  # 100 of 160 rows
    x, s, probs, dy = inputs(160, splits)
    y, dx, _, _ = step(model, "swiglu", x, s, probs, dy)
    assert torch.count_nonzero(y[100:]) == 0 and torch.count_nonzero(dx[100:]) == 0
    # different split tensors for FC1 and FC2: TE's ops run inside the fused op, and explain says why
    # (TE's own path needs the splits to cover every row)
    s1, s2 = torch.tensor([50, 0, 30, 80], device="cuda"), torch.tensor([50, 0, 30, 80], device="cuda")
    y2 = model(x, s1, s2)
    assert "the latest call ran TE's ops: FC1 and FC2 got different split_sizes tensors" in tfo_te.explain(model)
    reference = copy.deepcopy(model)
    tfo_te.uninstall(reference)
    assert torch.equal(y2, reference(x, s1, s2))


def test_window_not_taken_names_the_reason():
    model = te.ops.Sequential(
        te.ops.GroupedLinear(G, H, 2 * I, bias=False, device="cuda", dtype=DT),
        te.ops.SwiGLU(glu_interleave_size=32),
        te.ops.GroupedLinear(G, I, H, bias=False, device="cuda", dtype=DT),
    )
    x, s, probs, dy = inputs(256, [64, 64, 64, 64])
    got = step(model, "swiglu", x, s, probs, dy)
    text = tfo_te.explain(model)
    assert "[0:3]" in text and "TE: SwiGLU(glu_interleave_size=32)" in text, text
    assert "[0] GroupedLinear -> te_fused_ops" in text and "[2] GroupedLinear -> te_fused_ops" in text, text
    reference = copy.deepcopy(model)
    tfo_te.uninstall(reference)
    compare(got, step(reference, "swiglu", x, s, probs, dy))


def test_no_host_sync_and_cuda_graph_with_three_routings():
    model = mlp("scaled_swiglu", bias=True)
    reference = copy.deepcopy(model)
    m = 256
    static_x, static_s, static_p, dy = inputs(m, [64, 64, 64, 64])
    static_x.requires_grad_()
    static_p.requires_grad_()
    params = list(model.parameters())

    def train_step():
        for t in (static_x, static_p, *params):
            t.grad = None
        y = model(static_x, static_s, static_p, static_s)
        y.backward(dy)
        return y.detach()

    train_step()  # warm up (kernels compiled)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        train_step()
    finally:
        torch.cuda.set_sync_debug_mode(0)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            train_step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for p in (static_x, static_p, *params):
        p.grad = None
    with torch.cuda.graph(graph):
        y_static = train_step()

    tfo_te.uninstall(reference)
    for seed, routing in enumerate([[100, 0, 37, 119], [0, 256, 0, 0], [1, 2, 3, 250]]):
        x, s, probs, _ = inputs(m, routing, seed=seed + 5)
        with torch.no_grad():
            static_x.copy_(x)
            static_s.copy_(s)
            static_p.copy_(probs)
        graph.replay()
        want = step(reference, "scaled_swiglu", x, s, probs, dy)
        got = (y_static, static_x.grad, static_p.grad, {n: p.grad for n, p in model.named_parameters()})
        compare(got, want)


def test_uninstall_restores_te_behaviour():
    model = mlp("swiglu")
    x, s, probs, dy = inputs(256, [64, 64, 64, 64])
    step(model, "swiglu", x, s, probs, dy)
    assert "-> te_fused_ops" in tfo_te.explain(model)
    tfo_te.uninstall(model)
    assert not tfo_te.installed()
    plain = copy.deepcopy(model)
    got, want = step(model, "swiglu", x, s, probs, dy), step(plain, "swiglu", x, s, probs, dy)
    assert "-> te_fused_ops" not in tfo_te.explain(model) and "its own ops" in tfo_te.explain(model)
    for a, b in zip(got[:2], want[:2]):
        assert torch.equal(a, b)  # the same TE kernels
    fusers = [f for f in model._module_groups if hasattr(f, "_forward_ops")]
    assert fusers and not any(
        type(op).__name__ == "TEGroupedOps" for f in fusers for op, _ in f._forward_ops
    ), "uninstall(model) must make the model fuse again without te_fused_ops"


def grouped_weight(fc):
    """(G, out, in) view of a single-grouped-weight GroupedLinear's parameter."""
    return fc.weight.rowwise_data.view(fc.num_groups, fc.out_features, fc.in_features)


@pytest.mark.parametrize("act,bias", [("swiglu", False), ("scaled_swiglu", True)])
def test_single_grouped_weight_matches_te(monkeypatch, act, bias):
    """TE's one-parameter (G, out, in) weight (NVTE_GROUPED_LINEAR_SINGLE_PARAM=1), read in place
    and given one gradient, against TE's per-group path on the same values (TE 2.20 runs single
    grouped parameters only on its grouped-tensor path, which needs cuBLASLt 13.4 on Hopper)."""
    reference = mlp(act, bias)
    monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
    model = mlp(act, bias, single_grouped_weight=True, single_grouped_bias=bias)
    assert model[0].single_grouped_weight and len(list(model.parameters())) == 2 * (1 + bias)
    for k in (0, 2):
        assert torch.equal(grouped_weight(model[k]), torch.stack(list(reference[k]._get_weight_tensors())))
    x, s, probs, dy = inputs(256, [100, 0, 37, 119])
    y, dx, dp, grads = step(model, act, x, s, probs, dy)
    text = tfo_te.explain(model)
    assert "[0:3]" in text and "-> te_fused_ops" in text and "stacked" not in text, text
    tfo_te.uninstall(reference)

    def per_group(ref):  # the reference's gradients in the single-parameter layout
        y, dx, dp, grads = ref
        out = {f"{k}.weight": torch.stack([grads[f"{k}.weight{i}"] for i in range(G)]) for k in (0, 2)}
        if bias:
            out.update({f"{k}.bias": torch.stack([grads[f"{k}.bias{i}"] for i in range(G)]) for k in (0, 2)})
        return y, dx, dp, out

    compare((y, dx, dp, grads), per_group(step(reference, act, x, s, probs, dy)))
    for m in (model, reference):  # an optimizer step updates the grouped weight in place: no stale read
        torch.optim.SGD(m.parameters(), lr=0.5).step()
    x, s, probs, dy = inputs(256, [3, 250, 0, 3], seed=2)
    want = per_group(step(reference, act, x, s, probs, dy))
    tfo_te.install()  # the reference keeps the TE fusion it made without te_fused_ops
    compare(step(model, act, x, s, probs, dy), want)


def test_single_grouped_weight_main_grad(monkeypatch):
    x, s, _, _ = inputs(256, [10, 200, 0, 46])
    dy = torch.randn(256, I, device="cuda", dtype=DT, generator=torch.Generator(device="cuda").manual_seed(3))
    outs = []
    for single in (True, False):
        if single:
            monkeypatch.setenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM", "1")
        else:
            monkeypatch.delenv("NVTE_GROUPED_LINEAR_SINGLE_PARAM")
            tfo_te.uninstall()
        torch.manual_seed(0)
        model = te.ops.Sequential(te.ops.GroupedLinear(
            G, H, I, bias=False, device="cuda", dtype=DT, accumulate_into_main_grad=True, single_grouped_weight=single
        ))
        main = torch.zeros(G, I, H, device="cuda")  # one packed float32 buffer, as Megatron's
        weights = [model[0].weight] if single else [getattr(model[0], f"weight{i}") for i in range(G)]
        for i, w in enumerate(weights):
            w.main_grad = main if single else main[i]
            w.grad_added_to_main_grad = False
        xi = x.clone().requires_grad_()
        for _ in range(2):  # accumulates over two backward passes
            model(xi, s).backward(dy)
        assert all(w.grad_added_to_main_grad for w in weights)
        assert ("integration: installed" in tfo_te.explain(model)) == single
        outs.append((xi.grad, main))
    for a, b in zip(*outs):
        assert rel_err(a, b) <= 2e-2
