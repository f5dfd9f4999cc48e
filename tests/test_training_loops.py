"""The library inside real training loops: weights as the forward saw them, autograd-saved tensors.

Each test trains or evaluates the way user code does (fused AdamW, .data writes, parametrize,
functional_call, activation checkpointing, saved-tensor hooks, retain_graph, gradcheck) and
compares with a fresh model or a float64 reference. The FP8 recipes are used where a quantized
weight copy is involved: that copy is what went stale.
"""

import copy
import gc
import io
import pickle
import threading
import weakref

import pytest
import torch
from torch.nn.utils import parametrize

import reference as ref
import te_fused_ops as tfo
from te_fused_ops import GroupedLinear, Quantize, ScaledSwiGLU, Sequential, SwiGLU
from te_fused_ops.quantization import Float8BlockScaling
from te_fused_ops.runner import saved_tensor_bytes
from te_fused_ops.splits import split_offsets, validation_enabled

G, H, I, ROWS = 4, 32, 16, 40
SPLITS = torch.tensor([9, 0, 14, 11])  # 6 padding rows
WGRAD16 = Float8BlockScaling(high_precision_wgrad=True)  # FP8 GEMMs, 16-bit weight gradients


def mlp(recipe="fp8_blockwise", bias=False, seed=0):
    torch.manual_seed(seed)
    ops = [GroupedLinear(G, H, 2 * I, bias=bias), SwiGLU(), GroupedLinear(G, I, H)]
    if recipe is not None:
        ops.insert(0, Quantize(recipe))
    return Sequential(*ops)


def fresh_copy(seq):
    """A new model of the same architecture loaded from ``seq``'s state_dict (no shared caches)."""
    other = copy.deepcopy(seq)
    other.load_state_dict({k: v.clone() for k, v in seq.state_dict().items()})
    return other


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(ROWS, H, generator=gen)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", WGRAD16])
@pytest.mark.parametrize("fused", [True, False])
def test_adamw_training_matches_a_fresh_model_every_step(fused, recipe):
    seq = mlp(recipe)
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2, fused=fused, foreach=None if fused else False)
    for step in range(4):
        x = batch(step)
        y = seq(x, split_sizes=SPLITS)
        assert torch.equal(y, fresh_copy(seq)(x, split_sizes=SPLITS)), f"stale weights at step {step}"
        y.square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_data_writes_and_dtype_round_trips_are_seen():
    seq = mlp()
    x = batch(1)
    first = seq(x, split_sizes=SPLITS)
    seq[1].weight.data.mul_(0.5)  # no version bump
    second = seq(x, split_sizes=SPLITS)
    assert not torch.equal(first, second)
    assert torch.equal(second, fresh_copy(seq)(x, split_sizes=SPLITS))
    seq.half().float()  # fresh parameter tensors, possibly at reused addresses, version 0
    with torch.no_grad():
        seq[1].weight.add_(0.01)
    assert torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))


class _Scale(torch.nn.Module):
    def forward(self, w):
        return w * 1.5


def test_parametrize_training_gets_gradients_and_eval_follows_updates():
    seq = mlp()
    parametrize.register_parametrization(seq[1], "weight", _Scale())
    original = seq[1].parametrizations.weight.original
    x = batch(2).requires_grad_(True)
    seq(x, split_sizes=SPLITS).sum().backward()
    assert original.grad is not None and original.grad.abs().sum() > 0

    plain = mlp()
    with torch.no_grad():
        plain[1].weight.copy_(original * 1.5)
    x2 = x.detach().clone().requires_grad_(True)
    plain(x2, split_sizes=SPLITS).sum().backward()
    assert ref.rel_err(original.grad, plain[1].weight.grad * 1.5) <= 1e-6
    assert ref.rel_err(x.grad, x2.grad) <= 1e-6

    seq.eval()
    with torch.no_grad():
        for step in range(10):
            original.add_(torch.randn_like(original) * 0.01)
            plain[1].weight.copy_(original * 1.5)
            xs = batch(10 + step)
            assert torch.equal(seq(xs, split_sizes=SPLITS), plain(xs, split_sizes=SPLITS)), f"eval call {step}"


def test_functional_call_routes_gradients_to_the_given_weight():
    seq = mlp(recipe=None)
    w = (torch.randn_like(seq[0].weight) * 0.1).requires_grad_(True)
    x = batch(3).requires_grad_(True)
    y = torch.func.functional_call(seq, {"0.weight": w}, (x,), {"split_sizes": SPLITS})
    dy = torch.randn_like(y)
    y.backward(dy)
    assert seq[0].weight.grad is None
    assert w.grad is not None

    x64 = x.detach().double().requires_grad_(True)
    w64 = w.detach().double().requires_grad_(True)
    w2 = seq[2].weight.detach().double()
    splits = SPLITS.tolist()
    y64 = ref.grouped_linear(ref.swiglu(ref.grouped_linear(x64, w64, None, splits)), w2, None, splits)
    y64.backward(dy.double())
    assert ref.rel_err(y, y64) <= 1e-5
    assert ref.rel_err(w.grad, w64.grad) <= 1e-5
    assert ref.rel_err(x.grad, x64.grad) <= 1e-5


def test_in_place_change_after_forward_raises():
    seq = mlp(recipe=None)
    x = batch(4).requires_grad_(True)
    y = seq(x, split_sizes=SPLITS)
    with torch.no_grad():
        seq[2].weight.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y = seq(x, split_sizes=SPLITS)
    with torch.no_grad():
        x.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def _packed_bytes(fn):
    """(result, bytes of distinct storages packed by autograd while fn() runs)."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


@pytest.mark.parametrize("recipe", [None, "fp8_blockwise", WGRAD16])
def test_saved_tensor_hooks_see_every_saved_tensor(recipe):
    seq = mlp(recipe)
    x = batch(5).requires_grad_(True)
    params = sum(p.untyped_storage().nbytes() for p in seq.parameters())
    y, packed = _packed_bytes(lambda: seq(x, split_sizes=SPLITS))
    # what the hooks see = activations (saved_tensor_bytes) + the weights saved for data gradients
    assert packed == saved_tensor_bytes(y) + params
    if recipe is None:
        assert saved_tensor_bytes(y) >= ROWS * (H + 2 * I) * 4  # x and the pre-activation at least

    offloaded = []

    def pack(t):  # activation offloading: keep a copy, hand back the copy
        offloaded.append(t.detach().clone())
        return len(offloaded) - 1

    x2 = x.detach().clone().requires_grad_(True)
    seq2 = fresh_copy(seq)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda i: offloaded[i]):
        y2 = seq2(x2, split_sizes=SPLITS)
    y.sum().backward()
    y2.sum().backward()
    assert torch.equal(x.grad, x2.grad)
    for p, p2 in zip(seq.parameters(), seq2.parameters()):
        assert torch.equal(p.grad, p2.grad)


@pytest.mark.parametrize("recipe", [None, WGRAD16])
def test_activation_checkpointing_drops_saved_tensors(recipe):
    seq = mlp(recipe=recipe, bias=True)
    x = batch(6).requires_grad_(True)
    y, plain = _packed_bytes(lambda: seq(x, split_sizes=SPLITS))
    x2 = x.detach().clone().requires_grad_(True)
    seq2 = fresh_copy(seq)
    y2, checkpointed = _packed_bytes(
        lambda: torch.utils.checkpoint.checkpoint(seq2, x2, split_sizes=SPLITS, use_reentrant=False)
    )
    assert plain >= ROWS * (H + 2 * I) * 4
    assert checkpointed == x2.untyped_storage().nbytes()  # only the checkpoint's input is kept
    y.sum().backward()
    y2.sum().backward()
    assert torch.equal(y, y2) and torch.equal(x.grad, x2.grad)
    for p, p2 in zip(seq.parameters(), seq2.parameters()):
        assert torch.equal(p.grad, p2.grad)


@pytest.mark.parametrize("recipe", ["fp8_blockwise", WGRAD16])
def test_retain_graph_twice_gives_twice_the_gradient(recipe):
    seq = mlp(recipe)
    x = batch(7).requires_grad_(True)
    y = seq(x, split_sizes=SPLITS)
    y.sum().backward(retain_graph=True)
    once = [x.grad.clone()] + [p.grad.clone() for p in seq.parameters()]
    y.sum().backward()
    twice = [x.grad] + [p.grad for p in seq.parameters()]
    for a, b in zip(once, twice):
        assert torch.allclose(b, 2 * a, rtol=1e-6, atol=0)


def test_gradcheck_float64():
    torch.manual_seed(0)
    seq = Sequential(
        GroupedLinear(3, 6, 8, bias=True, dtype=torch.float64), ScaledSwiGLU(), GroupedLinear(3, 4, 5, dtype=torch.float64)
    )
    splits = torch.tensor([2, 0, 3])
    x = torch.randn(7, 6, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(7, dtype=torch.float64, requires_grad=True)
    w1, b1, w2 = (p for p in seq.parameters())

    def fn(x, probs, w1, b1, w2):
        params = {"0.weight": w1, "0.bias": b1, "2.weight": w2}
        return torch.func.functional_call(seq, params, (x,), {"split_sizes": splits, "probs": probs})

    assert torch.autograd.gradcheck(fn, (x, probs, w1, b1, w2))


def test_forward_only_call_frees_saved_tensors_without_gc():
    seq = mlp(recipe=None)
    x = batch(8).requires_grad_(True)
    gc.disable()
    try:
        y = seq(x, split_sizes=SPLITS)
        saved = [weakref.ref(t) for t in y.grad_fn.saved_tensors if t is not x and t.shape == (ROWS, 2 * I)]
        assert saved
        del y
        assert all(r() is None for r in saved), "a reference cycle keeps the pre-activation alive"
    finally:
        gc.enable()


def test_contexts_keep_no_tensors_and_backward_frees_them():
    seq = mlp()
    y = seq(batch(9).requires_grad_(True), split_sizes=SPLITS)
    run = y.grad_fn.run

    def tensors_in(value):
        if isinstance(value, torch.Tensor):
            return 1
        if isinstance(value, dict):
            return sum(tensors_in(v) for v in value.values())
        if isinstance(value, (list, tuple)):
            return sum(tensors_in(v) for v in value)
        return sum(tensors_in(v) for v in getattr(value, "__dict__", {}).values())

    assert tensors_in([{k: v for k, v in ctx.__dict__.items() if k != "op"} for ctx in run.ctxs]) == 0
    y.sum().backward()
    with pytest.raises(RuntimeError):
        y.grad_fn.saved_tensors


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_overflowing_split_sizes_are_clamped(dtype):
    big = 2**62 if dtype == torch.int64 else 2**30
    sizes = torch.tensor([big, big, big, 3], dtype=dtype)
    offsets = split_offsets(sizes, ROWS)
    assert offsets.tolist() == [0, ROWS, ROWS, ROWS, ROWS]
    offsets = split_offsets(torch.tensor([-(2**63), 5, 2**63 - 1, 2**63 - 1]), ROWS)
    assert offsets.tolist() == [0, 0, 5, ROWS, ROWS]

    seq = mlp(recipe=None)
    x = batch(10).requires_grad_(True)
    with tfo.validation(False):  # unchecked values, as on a GPU without validation: clamped
        y = seq(x, split_sizes=sizes)
    y.sum().backward()
    want = seq(x.detach(), split_sizes=torch.tensor([ROWS, 0, 0, 0]))  # group 0 owns every row
    assert torch.equal(y, want)
    with pytest.raises(ValueError, match=r"GroupedLinear: argument 'split_sizes' sums to"):
        seq(x, split_sizes=sizes)  # CPU split sizes are checked by default


@pytest.mark.parametrize("recipe", [None, "fp8_blockwise", "fp8_current", "mxfp8"])
@pytest.mark.parametrize("quantize_grad", [False, True])
def test_padding_rows_never_change_grouped_rows(recipe, quantize_grad):
    valid = int(SPLITS.sum())
    seq = mlp(recipe=None)
    if recipe is not None:
        seq = Sequential(Quantize(recipe, quantize_grad=quantize_grad), *seq)
    results = []
    for garbage in (0.0, 1e4):
        x = batch(11).clone()
        x[valid:] = garbage
        x.requires_grad_(True)
        y = seq(x, split_sizes=SPLITS)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
        dy[valid:] = garbage
        y.backward(dy)
        results.append([y[:valid], x.grad[:valid], *[p.grad for p in seq.parameters()]])
        assert torch.all(y[valid:] == 0) and torch.all(x.grad[valid:] == 0)
        seq.zero_grad(set_to_none=True)
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_validation_is_thread_local():
    seen = []
    with tfo.validation():
        thread = threading.Thread(target=lambda: seen.append(validation_enabled()))
        thread.start()
        thread.join()
        assert validation_enabled()
    assert seen == [False]


def test_reuse_quantized_weights_is_an_explicit_scope():
    seq = mlp()
    x = batch(12)
    with tfo.reuse_quantized_weights():
        first = seq(x, split_sizes=SPLITS)
        seq[1].weight.data.mul_(0.5)
        assert torch.equal(seq(x, split_sizes=SPLITS), first)  # reused, as promised by the scope
    after = seq(x, split_sizes=SPLITS)
    assert not torch.equal(after, first)
    assert torch.equal(after, fresh_copy(seq)(x, split_sizes=SPLITS))


def _count_weight_casts(monkeypatch) -> list:
    import te_fused_ops.quantization as quantization

    casts, real = [], quantization.quantize_weight
    monkeypatch.setattr(quantization, "quantize_weight", lambda w, recipe, **kw: casts.append(w.shape) or real(w, recipe, **kw))
    return casts


@pytest.mark.parametrize("fused", [True, False])
def test_weights_cast_once_per_optimizer_step(fused, monkeypatch):
    """Gradient accumulation with `cast_weights_once_per_step`: FC1's FP8 weight is cast once per
    optimizer step (not per micro-batch, not again in the data gradient), and every output and
    gradient equals a fresh model's that casts on every call, after every (fused) AdamW step."""
    casts = _count_weight_casts(monkeypatch)
    seq = mlp()
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2, fused=fused, foreach=None if fused else False)
    with tfo.cast_weights_once_per_step(opt, seq):
        for step in range(3):
            fresh = fresh_copy(seq)
            casts.clear()
            for micro_batch in range(3):
                x = batch(10 * step + micro_batch).requires_grad_(True)
                x_fresh = x.detach().clone().requires_grad_(True)
                y = seq(x, split_sizes=SPLITS)
                y.square().mean().backward()
                expected = fresh(x_fresh, split_sizes=SPLITS)
                expected.square().mean().backward()
                assert torch.equal(y, expected), f"stale weights at step {step}"
                assert torch.equal(x.grad, x_fresh.grad)
                for p, q in zip(seq.parameters(), fresh.parameters()):
                    assert torch.equal(p.grad, q.grad)
            assert len(casts) == 1 + 2 * 3  # this model: one a step; the fresh copy: in each forward and dgrad
            opt.step()
            opt.zero_grad(set_to_none=True)
    casts.clear()
    seq(batch(0), split_sizes=SPLITS)
    seq(batch(0), split_sizes=SPLITS)
    assert len(casts) == 2  # detached: a cast per call again


def test_step_casts_never_reuse_a_copy_of_a_freed_weight():
    """``p.data = t`` inside a step frees the old storage, whose address a later tensor often takes
    (same shape, same version counter): each forward still equals a fresh model's, not the copy
    of the weight that lived there before."""
    seq = mlp()
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    x = batch(3)
    with torch.no_grad(), tfo.cast_weights_once_per_step(opt, seq):
        for i in range(12):
            torch.testing.assert_close(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS),
                                       rtol=0, atol=0, msg=f"stale copy after write {i}")
            seq[1].weight.data = torch.randn_like(seq[1].weight)


def test_step_casts_see_another_optimizers_fused_step():
    """A second optimizer over the same weights (an expert optimizer, or one made again after a
    checkpoint load): its fused step bumps no version counter, and still the next forward reads
    the weights it wrote."""
    seq = mlp()
    registered = torch.optim.SGD(seq.parameters(), lr=0.1)
    other = torch.optim.AdamW(seq.parameters(), lr=0.1, fused=True)
    x = batch(4)
    with tfo.cast_weights_once_per_step(registered, seq):
        seq(x, split_sizes=SPLITS).square().mean().backward()
        version = seq[1].weight._version
        other.step()
        assert seq[1].weight._version == version  # unseen by the version counter
        with torch.no_grad():
            torch.testing.assert_close(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS), rtol=0, atol=0)


def test_step_casts_outlive_their_optimizer():
    """The README's loop keeps no handle: once the optimizer is made again (a checkpoint resumed),
    the first one's hooks are gone, and still the new optimizer's fused steps are seen (the model
    keeps its `StepCasts`) and ``load_state_dict`` works."""
    seq = mlp()
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2, fused=True)
    tfo.cast_weights_once_per_step(opt, seq)
    x = batch(6)
    seq(x, split_sizes=SPLITS).square().mean().backward()
    opt.step()
    state = {name: value.clone() for name, value in seq.state_dict().items()}
    del opt
    gc.collect()
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2, fused=True)
    for _ in range(3):
        seq(x, split_sizes=SPLITS).square().mean().backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            assert torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))
    seq.load_state_dict(state)
    assert torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))


def test_a_model_under_step_casts_saves_whole_and_so_do_its_copies():
    """``torch.save(model)`` while attached, and a deepcopy made then (an EMA model), saved after
    ``remove()``: nothing the library attaches to the modules is a local function."""
    seq = mlp()
    x = batch(7)
    casts = tfo.cast_weights_once_per_step(torch.optim.SGD(seq.parameters(), lr=0.1), seq)
    seq(x, split_sizes=SPLITS)
    for model in (seq, copy.deepcopy(seq)):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        assert torch.equal(loaded(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))
    ema = copy.deepcopy(seq)
    casts.remove()
    pickle.loads(pickle.dumps(ema))


@pytest.mark.parametrize("conversion", ["to", "load_state_dict"])
def test_kept_copies_let_parameters_be_swapped(conversion):
    """Under ``torch.__future__.set_swap_module_params_on_conversion(True)`` ``module.to`` and
    ``load_state_dict`` swap each parameter's tensor, which torch refuses for a tensor with a
    Python weak reference: the kept copies hold none."""
    seq = mlp()
    x = batch(8)
    state = mlp(seed=5).state_dict()
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        with tfo.cast_weights_once_per_step(torch.optim.SGD(seq.parameters(), lr=0.1), seq), \
                tfo.reuse_quantized_weights():
            seq(x, split_sizes=SPLITS).square().mean().backward()
            if conversion == "to":
                seq.to(torch.float64).to(torch.float32)
            else:
                seq.load_state_dict(state)
            assert torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def test_step_casts_name_swapped_or_missing_arguments():
    seq = mlp()
    optimizer = torch.optim.SGD(seq.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"argument 'optimizer' must be a torch optimizer .* got Sequential"):
        tfo.cast_weights_once_per_step(seq, optimizer)
    with pytest.raises(TypeError, match=r"argument 'model' must be a torch.nn.Module, got NoneType"):
        tfo.cast_weights_once_per_step(optimizer, None)


def test_step_casts_see_writes_through_the_parameter_and_new_tensors():
    seq = mlp()
    x = batch(1)
    with tfo.cast_weights_once_per_step(torch.optim.SGD(seq.parameters(), lr=0.1), seq) as casts:
        seq(x, split_sizes=SPLITS)
        seq.load_state_dict(mlp(seed=5).state_dict())  # copies in place: the version counter moves
        assert torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))
        with torch.no_grad():
            seq[1].weight.mul_(0.5)
        assert torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))
        seq[1].weight.data = seq[1].weight.data * 2  # a new tensor
        assert torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))
        seq[1].weight.data = seq[1].weight.data.transpose(1, 2)  # same storage, shape and version; other strides
        assert torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))
        seq[1].weight.data.mul_(3)  # through .data: no version bump, not seen (documented) ...
        assert not torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))
        casts.drop()  # ... until the copies are dropped
        assert torch.equal(seq(x, split_sizes=SPLITS), fresh_copy(seq)(x, split_sizes=SPLITS))


def _pretend_capturing(monkeypatch, on: bool) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: on)


def test_a_graph_capture_reads_the_step_copies_and_the_optimizer_step_refills_them(monkeypatch):
    """A capture reads the `cast_weights_once_per_step` copies made before it (no cast in the
    graph); the optimizer step then casts each captured copy again into its own storage (where the
    graph reads it), so replays and eager calls after the step see the stepped weights, and the
    eager calls cast nothing more. A weight first read during a capture is cast in the graph and
    not kept."""
    casts = _count_weight_casts(monkeypatch)
    seq = mlp()
    x = batch(4)
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2, fused=False, foreach=False)
    with tfo.cast_weights_once_per_step(opt, seq) as steps:
        seq(x, split_sizes=SPLITS).square().mean().backward()
        assert len(casts) == 1
        _pretend_capturing(monkeypatch, True)
        seq(x, split_sizes=SPLITS).square().mean().backward()
        assert len(casts) == 1  # the "captured" forward and backward read the copy
        (copy_before,) = [c for c in steps.scope.copies.values()]
        assert copy_before.captured
        storage = copy_before.value.data_ptr()
        _pretend_capturing(monkeypatch, False)
        for step in range(2):
            before = len(casts)
            opt.step()
            opt.zero_grad(set_to_none=True)
            assert len(casts) == before + 1  # refilled once a step, into the same storage
            (kept,) = steps.scope.copies.values()
            assert kept is copy_before and kept.value.data_ptr() == storage
            y = seq(x, split_sizes=SPLITS)
            y.square().mean().backward()
            assert len(casts) == before + 1  # the eager forward and backward cast nothing
            assert torch.equal(kept.value, kept.make())
            assert torch.equal(y, fresh_copy(seq)(x, split_sizes=SPLITS)), f"stale copy after step {step}"
        steps.drop()  # by hand (after a write through .data): refilled as well
        assert steps.scope.copies and kept.value.data_ptr() == storage


def test_a_captured_copy_whose_weight_changed_shape_is_refused(monkeypatch):
    """A weight given a new shape after a graph captured its copy cannot be recast into that
    copy's storage: a clear error, never a broadcast into the old copy."""
    seq = mlp()
    with tfo.cast_weights_once_per_step(torch.optim.SGD(seq.parameters(), lr=0.1), seq) as steps:
        seq(batch(0), split_sizes=SPLITS)
        _pretend_capturing(monkeypatch, True)
        seq(batch(0), split_sizes=SPLITS)
        _pretend_capturing(monkeypatch, False)
        seq[1].weight.data = torch.randn(1, 2 * I, H)  # would broadcast over the kept (G, 2I, H) copy
        with pytest.raises(ValueError, match="cast_weights_once_per_step: a weight copy a CUDA graph captured.*"
                                             "capture it again"):
            steps.drop()
        steps.drop()  # said once: the copy no graph can read is no longer recast


def _graph_copy_values(steps, weight):
    """The values of the kept copy a (pretended) capture read for ``weight``."""
    (copy,) = [c for c in steps.scope.captured if c.held is weight]
    return copy.value.dequantize() if hasattr(copy.value, "dequantize") else copy.value


def test_load_state_dict_after_a_capture_recasts_the_copies_the_graph_reads(monkeypatch):
    """A checkpoint loaded after a capture (a resume, or weights for evaluation) reaches the
    graph's replays at once, not only after the next optimizer step."""
    seq, other = mlp(), mlp(seed=1)
    with tfo.cast_weights_once_per_step(torch.optim.SGD(seq.parameters(), lr=0.1), seq) as steps:
        seq(batch(0), split_sizes=SPLITS)
        _pretend_capturing(monkeypatch, True)
        seq(batch(0), split_sizes=SPLITS)
        _pretend_capturing(monkeypatch, False)
        before = _graph_copy_values(steps, seq[1].weight).clone()
        seq.load_state_dict(other.state_dict())
        after = _graph_copy_values(steps, seq[1].weight)
        want = fresh_copy(seq)
        assert not torch.equal(before, after)
        assert torch.equal(seq(batch(1), split_sizes=SPLITS), want(batch(1), split_sizes=SPLITS))


def test_copies_two_captures_read_of_one_weight_are_both_kept_and_recast(monkeypatch):
    """A weight written between two captures is read by each graph through its own copy; the
    optimizer step keeps and recasts both (their keys then coincide), never freeing one a graph
    still reads."""
    seq = mlp()
    opt = torch.optim.SGD(seq.parameters(), lr=0.1)
    with tfo.cast_weights_once_per_step(opt, seq) as steps:
        for _ in range(2):
            seq(batch(0), split_sizes=SPLITS)
            _pretend_capturing(monkeypatch, True)
            seq(batch(0), split_sizes=SPLITS)
            _pretend_capturing(monkeypatch, False)
            with torch.no_grad():
                seq[1].weight.mul_(0.5)
        first, second = [c for c in steps.scope.captured if c.held is seq[1].weight]
        seq(batch(0), split_sizes=SPLITS).sum().backward()
        opt.step()
        for kept in (first, second):
            assert torch.equal(kept.value.dequantize(), _graph_copy_values_fresh(seq[1].weight))


def _graph_copy_values_fresh(weight):
    from te_fused_ops.quantization import quantize_weight

    return quantize_weight(weight.detach(), Float8BlockScaling()).dequantize()


def test_a_kept_copy_is_never_read_for_another_weight_at_its_address(monkeypatch):
    """FSDP2 frees an all-gathered weight by resizing its storage to 0 (the storage object lives
    on), and the next layer's weight may land at its address with its shape and version: that
    weight gets a copy of its own, not the other layer's."""
    import te_fused_ops.quantization as quantization

    real_key = quantization.copy_key
    monkeypatch.setattr(quantization, "copy_key", lambda weight, recipe, kind, dtype=None: (
        0,) + real_key(weight, recipe, kind, dtype)[1:])  # every weight at one address
    scope = quantization.ReuseScope(serves_graphs=True)
    a, b = torch.randn(2, 128, 128), torch.randn(2, 128, 128)
    recipe = Float8BlockScaling()
    made = [quantization.reuse_or_make(w, recipe, "blocks", lambda w=w: w.clone(), scope) for w in (a, b, a)]
    assert torch.equal(made[0], a) and torch.equal(made[1], b) and torch.equal(made[2], a)


def test_copies_outside_a_step_scope_are_not_read_or_kept_inside_a_capture(monkeypatch):
    """`reuse_quantized_weights` drops its copies when it closes, so a graph must not read them:
    during a capture every weight is cast afresh (in the graph) and nothing is stored; a
    `cast_weights_once_per_step` weight first seen during a capture is cast there and not kept."""
    casts = _count_weight_casts(monkeypatch)
    seq = mlp()
    x = batch(4)
    with tfo.reuse_quantized_weights():
        seq(x, split_sizes=SPLITS)
        assert len(casts) == 1
        _pretend_capturing(monkeypatch, True)
        seq(x, split_sizes=SPLITS)
        seq(x, split_sizes=SPLITS)
        assert len(casts) == 3
        _pretend_capturing(monkeypatch, False)
        seq(x, split_sizes=SPLITS)
        assert len(casts) == 3  # the copy from before the capture, nothing new kept during it
    with tfo.cast_weights_once_per_step(torch.optim.SGD(seq.parameters(), lr=0.1), seq) as steps:
        _pretend_capturing(monkeypatch, True)
        seq(x, split_sizes=SPLITS)
        assert len(casts) == 4 and not steps.scope.copies


def test_reuse_scope_reaches_the_backward_on_autograd_thread(monkeypatch):
    """Autograd runs a CUDA graph's backward on a thread of its own, where the forward thread's
    scope is not open: the copies a forward made in the scope are reused by its backward (run here
    on another thread, as autograd does on a GPU) and by the next micro-batch; a backward after the
    scope closed makes fresh ones, and every gradient equals the scope-free run's."""
    import te_fused_ops.quantization as quantization

    casts = []
    real_quantize_weight = quantization.quantize_weight

    def counted(weight, recipe, **kw):
        casts.append(weight.shape)
        return real_quantize_weight(weight, recipe, **kw)

    monkeypatch.setattr(quantization, "quantize_weight", counted)

    def micro_batch(seq, seed, backward_thread):
        x = batch(seed).requires_grad_(True)
        y = seq(x, split_sizes=SPLITS)
        backward = lambda: y.square().sum().backward()  # noqa: E731
        if backward_thread:
            thread = threading.Thread(target=backward)
            thread.start()
            thread.join()
        else:
            backward()
        return [x.grad, *(p.grad.clone() for p in seq.parameters())]

    seq, plain = mlp(), mlp()
    expected = [micro_batch(plain, seed, False) for seed in (1, 2)]
    assert len(casts) == 4  # FC1's weight, in each forward and each data gradient
    casts.clear()
    with tfo.reuse_quantized_weights():
        got = [micro_batch(seq, seed, True) for seed in (1, 2)]
        assert len(casts) == 1
        x = batch(3).requires_grad_(True)
        y = seq(x, split_sizes=SPLITS)
    assert len(casts) == 1
    y.sum().backward()  # the scope has closed: a fresh copy
    assert len(casts) == 2
    for a, b in zip(got, expected):
        for u, v in zip(a, b):
            assert torch.equal(u, v)


def test_accumulate_main_grad_adds_weight_gradients_in_float32():
    torch.manual_seed(3)
    ops = [GroupedLinear(G, H, 2 * I, dtype=torch.bfloat16, accumulate_main_grad=True), SwiGLU(),
           GroupedLinear(G, I, H, dtype=torch.bfloat16)]
    seq = Sequential(*ops)
    x = batch(13).bfloat16().requires_grad_(True)
    with pytest.raises(ValueError, match=r"GroupedLinear: accumulate_main_grad=True needs weight.main_grad"):
        seq(x, split_sizes=SPLITS)
    seq[0].weight.main_grad = torch.zeros(seq[0].weight.shape, dtype=torch.float32)
    for _ in range(2):
        seq(x, split_sizes=SPLITS).float().square().sum().backward()
    assert seq[0].weight.grad is None and seq[2].weight.grad is not None
    plain = Sequential(*[copy.deepcopy(op) for op in ops])
    plain[0].accumulate_main_grad = False
    plain(x.detach(), split_sizes=SPLITS).float().square().sum().backward()
    assert ref.rel_err(seq[0].weight.main_grad, 2 * plain[0].weight.grad.float()) <= 1e-2


def test_main_grad_gets_the_float32_sums_unrounded_on_the_cpu():
    """The torch backend's weight gradient reaches main_grad as its float32 sums: within float32
    rounding of the float64 products of the same bf16 operands, not a bf16 rounding away."""
    torch.manual_seed(4)
    lin = GroupedLinear(G, H, I, dtype=torch.bfloat16, accumulate_main_grad=True)
    lin.weight.main_grad = torch.zeros(lin.weight.shape, dtype=torch.float32)
    x = batch(13).bfloat16()
    dy = torch.randn(x.shape[0], I).bfloat16()
    Sequential(lin)(x, split_sizes=SPLITS).backward(dy)
    bounds = [0, *torch.tensor(SPLITS).cumsum(0).tolist()]
    expected = torch.stack([dy[lo:hi].double().t() @ x[lo:hi].double() for lo, hi in zip(bounds, bounds[1:])])
    assert ref.rel_err(lin.weight.main_grad, expected) <= 1e-6


def test_sm90_fp8_weight_casts_are_made_once_per_reuse_scope(monkeypatch):
    """The sm90 FP8 path's weight casts (forward, and with the data gradient's transposed copy)
    are fresh on every call, and made once inside `reuse_quantized_weights` (the kernel is stood
    in for by the torch quantizer it equals bit for bit, its transposed copy by torch's)."""
    import te_fused_ops.backends.sm90.linear as sm90
    from te_fused_ops.quantization import Float8BlockScaling, current_reuse_scope, get_recipe, quantize_weight

    casts = []

    def torch_cast(weight, block_rows, power_2_scales=False, transposed=False, out=None):
        assert out is None  # no copy is recast into here
        casts.append((block_rows, transposed))
        q = quantize_weight(weight, Float8BlockScaling(power_2_scales=power_2_scales))
        made = (q.rowwise_data, q.rowwise_scale_inv)
        return (*made, *(t.transpose(1, 2).contiguous() for t in made)) if transposed else made

    monkeypatch.setattr(sm90, "block_quantize_sm90", torch_cast)
    recipe = get_recipe("fp8_blockwise")
    w = torch.randn(2, 256, 128, dtype=torch.bfloat16)
    sm90.quantize_weight_blocks(w, recipe, None)
    sm90.quantize_weight_blocks(w, recipe, None, transposed=True)
    assert casts == [(128, False), (128, True)]
    with tfo.reuse_quantized_weights():
        scope = current_reuse_scope()
        first = sm90.quantize_weight_blocks(w, recipe, scope)
        both = sm90.quantize_weight_blocks(w, recipe, scope, transposed=True)
        again = sm90.quantize_weight_blocks(w, recipe, scope)
        assert all(a is b for a, b in zip(sm90.quantize_weight_blocks(w, recipe, scope, transposed=True), both))
    assert casts == [(128, False), (128, True), (128, False), (128, True)] and again[0] is first[0]
    assert torch.equal(both[0].view(torch.uint8), first[0].view(torch.uint8)) and torch.equal(both[1], first[1])
    assert torch.equal(both[2].view(torch.uint8), first[0].transpose(1, 2).view(torch.uint8))
    assert torch.equal(both[3], first[1].transpose(1, 2))
    sm90.quantize_weight_blocks(w, recipe, scope)
    assert len(casts) == 5  # fresh again once the scope closed


def test_weights_cast_once_per_optimizer_step_under_autocast(monkeypatch):
    """Under autocast each call casts the float32 weight to bf16 first (a new tensor every call):
    the FP8 copies are still made once per optimizer step, kept by their parameter (not piling up),
    and equal a fresh model's under autocast after each step."""
    casts = _count_weight_casts(monkeypatch)
    seq = mlp()
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2)
    with tfo.cast_weights_once_per_step(opt, seq) as step_casts:
        for step in range(2):
            fresh = fresh_copy(seq)
            casts.clear()
            for micro_batch in range(3):
                x = batch(10 * step + micro_batch)
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    y = seq(x, split_sizes=SPLITS)
                    expected = fresh(x, split_sizes=SPLITS)
                y.float().square().mean().backward()
                assert torch.equal(y, expected), f"stale weights at step {step}"
                assert len(step_casts.scope.copies) == 1
            assert len(casts) == 1 + 3  # this model: one a step; the fresh copy: one a forward
            opt.step()
            opt.zero_grad(set_to_none=True)


def test_kept_copies_hold_no_autocast_duplicate_of_the_weight():
    """A copy kept by its parameter under autocast keeps nothing of the call that made it: the
    16-bit duplicate of the weight autocast made for that call is freed with the call."""
    from te_fused_ops.quantization import AUTOCAST_SOURCE

    seq = mlp()
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2)

    def duplicates():
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor) and hasattr(o, AUTOCAST_SOURCE))

    before = duplicates()
    with tfo.cast_weights_once_per_step(opt, seq) as step_casts:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            seq(batch(0), split_sizes=SPLITS).float().square().mean().backward()
        assert len(step_casts.scope.copies) == 1
        assert duplicates() == before


def test_a_parametrized_weight_keeps_one_copy_over_an_evaluation_loop():
    """A parametrization makes a new weight tensor at every call: the copy of an earlier call's
    tensor is dropped once that tensor is gone, so evaluating between two optimizer steps (or
    inference in `reuse_quantized_weights`) keeps one copy, not one per batch."""
    from te_fused_ops.quantization import current_reuse_scope

    seq = mlp()
    parametrize.register_parametrization(seq[1], "weight", _Scale())
    opt = torch.optim.AdamW(seq.parameters(), lr=1e-2)
    with torch.no_grad():
        with tfo.cast_weights_once_per_step(opt, seq) as step_casts:
            for i in range(20):
                y = seq(batch(i), split_sizes=SPLITS)
                assert torch.equal(y, fresh_copy(seq)(batch(i), split_sizes=SPLITS))
                assert len(step_casts.scope.copies) == 1
        with tfo.reuse_quantized_weights():
            for i in range(20):
                seq(batch(i), split_sizes=SPLITS)
            assert len(current_reuse_scope().copies) == 1


def test_a_model_under_step_casts_is_freed_without_the_cyclic_collector():
    """``del model, optimizer`` frees the model at once, `remove()` called or not (its hooks made
    a reference cycle that only the cyclic collector freed, and device memory does not run it)."""
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # torch's first AdamW keeps its caller's frame
    gc.collect()
    gc.disable()
    try:
        for remove in (True, False):
            seq = mlp()
            opt = torch.optim.AdamW(seq.parameters(), lr=1e-2)
            casts = tfo.cast_weights_once_per_step(opt, seq)
            seq(batch(0), split_sizes=SPLITS).square().mean().backward()
            opt.step()
            if remove:
                casts.remove()
            alive = weakref.ref(seq)
            del seq, opt, casts
            assert alive() is None, f"remove()={remove}: the model outlived its last reference"
    finally:
        gc.enable()


def test_main_grad_accumulates_under_autocast():
    """accumulate_main_grad=True under autocast adds to the parameter's main_grad (the autocast
    copy of the weight carries it), the same sums as the bf16 gradient widened."""
    torch.manual_seed(0)
    seq = Sequential(GroupedLinear(4, 32, 16, accumulate_main_grad=True))
    plain = Sequential(GroupedLinear(4, 32, 16))
    plain.load_state_dict(seq.state_dict())
    seq[0].weight.main_grad = torch.zeros_like(seq[0].weight)
    x = batch(1)
    for model in (seq, plain):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = model(x, split_sizes=SPLITS)
        y.float().square().mean().backward()
    assert seq[0].weight.grad is None and seq[0].weight.main_grad.abs().sum() > 0
    torch.testing.assert_close(seq[0].weight.main_grad, plain[0].weight.grad, rtol=1e-2, atol=1e-4)


def test_host_reading_settings_are_refused_during_a_capture(monkeypatch):
    """Value checks read split sizes on the host: during a capture that is a clear error naming
    the setting, not the stream's "operation not permitted when stream is capturing"."""
    from te_fused_ops.splits import validation_enabled

    _pretend_capturing(monkeypatch, True)
    with tfo.validation():
        with pytest.raises(RuntimeError, match=r"value checks .* a CUDA graph capture cannot"):
            validation_enabled(torch.device("cuda"))
        assert validation_enabled(torch.device("cpu"))  # CPU tensors are never captured
    assert not validation_enabled(torch.device("cuda"))
