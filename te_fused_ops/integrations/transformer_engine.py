"""te_fused_ops' Hopper kernels inside Transformer Engine's ``te.ops`` fuser (TE 2.20).

    from te_fused_ops.integrations import transformer_engine as tfo_te
    tfo_te.install()                   # before the first forward of the te.ops.Sequential
    y = model(x, split_sizes, probs, split_sizes)
    print(tfo_te.explain(model))       # the windows taken, and why the others are not
    tfo_te.uninstall()                 # TE's own fusions only

``install()`` registers one forward-backward fusion with TE's fuser. It takes the windows
``GroupedLinear -> {SwiGLU, ScaledSwiGLU, ClampedSwiGLU, GEGLU, SReLU} -> GroupedLinear`` and every
other lone ``GroupedLinear`` and runs them as te_fused_ops plans (the sm90 kernels, forward and
backward) on TE's parameters in place: the per-group ``weight{i}`` (views of one packed
(G, out, in) buffer, as TE allocates them) or ``single_grouped_weight``, the biases,
``main_grad`` with ``accumulate_into_main_grad`` (``overwrite_main_grad`` and
``grad_added_to_main_grad`` as TE treats them). Split sizes stay TE's extra inputs on the GPU; the
router probabilities of ``ScaledSwiGLU`` get their gradient. TE's GLU order (act(first half) *
second half) is te_fused_ops' order.

Where a window cannot be taken, TE's path runs: at fusion time (an FP8 recipe, an option the
kernels do not have, a shape or dtype the sm90 plan does not put on the kernels), or at run time
(input dtype, different split tensors for FC1 and FC2, split sizes off the GPU, output buffers
passed by the caller), where the fused op runs TE's basic ops itself. ``explain`` says which.
"""

import functools
import weakref

import torch

from ..fusion import PlanInfo, make_plan
from ..ops import ClampedSwiGLU, GeGLU, GroupedLinear, ScaledSwiGLU, SReLU, SwiGLU
from ..runner import prepare_run

# first TE op of a window -> {window length: Decision} of the latest fusion
_decisions: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


@functools.cache
def _te():
    """TE's modules this integration uses (imported once, on first use)."""
    try:
        import transformer_engine.pytorch.ops as te_ops
        from transformer_engine.pytorch.distributed_weight import is_distributed_weight
        from transformer_engine.pytorch.ops import _common
        from transformer_engine.pytorch.ops.fuser import OperationFuser
    except ImportError as error:
        raise ImportError(
            "te_fused_ops.integrations.transformer_engine needs Transformer Engine 2.20 "
            "(pip install 'te_fused_ops[te]')"
        ) from error
    return te_ops, _common, OperationFuser, is_distributed_weight


# ---- matching: TE ops -> te_fused_ops ops, or the reason why not ---------------------------------


def _activation(act):
    """The te_fused_ops op computing TE activation ``act``, or a reason string."""
    te_ops = _te()[0]
    interleave = getattr(act, "glu_interleave_size", None)
    if interleave:
        return f"{type(act).__name__}(glu_interleave_size={interleave}): the sm90 kernels read [gate; up] halves"
    if type(act) is te_ops.SwiGLU:
        return SwiGLU()
    if type(act) is te_ops.ScaledSwiGLU:
        return ScaledSwiGLU()
    if type(act) is te_ops.GEGLU:
        return GeGLU()
    if type(act) is te_ops.SReLU:
        return SReLU()
    if type(act) is te_ops.ClampedSwiGLU:
        if act.glu_linear_offset != 1.0:
            return f"ClampedSwiGLU(glu_linear_offset={act.glu_linear_offset}): the kernels compute (up + 1)"
        return ClampedSwiGLU(limit=act.limit, alpha=act.alpha)
    return f"no te_fused_ops kernel for {type(act).__name__}"


def _linear(fc):
    """te_fused_ops' GroupedLinear for TE GroupedLinear ``fc`` (meta device: configuration only,
    the parameters are TE's), or a reason string."""
    _, _, _, is_distributed_weight = _te()
    if fc.wgrad_store.delay_wgrad_compute():
        return "delay_wgrad_compute=True (TE's WeightGradStore queues the weight gradient)"
    if fc._scale_bias:
        return "scale_bias=True"
    if fc.single_grouped_weight and fc.use_bias and not fc.single_grouped_bias:
        return "single_grouped_weight with per-group biases"
    weight = fc._get_weight_tensors()[0]
    if is_distributed_weight(weight):
        return "distributed weights (TE materializes them per pass)"
    return GroupedLinear(
        fc.num_groups, fc.in_features, fc.out_features, bias=fc.use_bias, device="meta",
        accumulate_main_grad=fc._accumulate_into_main_grad,
    )


def _plan_reason(ops, dtype, device) -> str | None:
    """Why te_fused_ops' plan of ``ops`` would not run every step on the sm90 kernels (training,
    everything requiring grad), or None."""
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    n = len(ops)
    info = PlanInfo(device.type, capability, dtype, (True,) * n, (True,) * n, (None,) * n)
    plan = make_plan(ops, info)
    for passes, steps in (("forward", plan.forward), ("backward", plan.backward)):
        for step in steps:
            if step.backend != "sm90":
                names = ", ".join(op.op_name for op in ops[step.start : step.stop])
                why = "; ".join(r for _, r in step.skipped_backends) or "no sm90 rule"
                return f"{passes} of {names} would run on te_fused_ops' {step.backend} path ({why})"
    return None


class Decision:
    """What the fusion function decided for one window: ``ops`` (te_fused_ops') or ``reason``."""

    def __init__(self, names, ops=None, reason=None):
        self.names, self.ops, self.reason = names, ops, reason
        self.fallback = None  # the reason of the latest run-time fallback to TE, if any
        self.copied_weights = False  # the latest call stacked per-group weights (not one buffer)


def _decide(window, recipe) -> Decision:
    """Decision for a window of TE basic ops: [fc1, act, fc2] or [fc]."""
    names = [type(op).__name__ for op in window]
    if recipe is not None:
        return Decision(names, reason=f"quantization recipe {type(recipe).__name__}: FP8 is not wired to TE yet")
    ours = [_activation(op) if i == 1 else _linear(op) for i, op in enumerate(window)]
    for item in ours:
        if isinstance(item, str):
            return Decision(names, reason=item)
    if len(window) == 3 and window[0].num_groups != window[2].num_groups:
        return Decision(names, reason=f"FC1 has {window[0].num_groups} groups, FC2 {window[2].num_groups}")
    weight = window[0]._get_weight_tensors()[0]
    reason = _plan_reason(ours, weight.dtype, weight.device)
    return Decision(names, ours, reason) if reason else Decision(names, ours)


def _is_activation(op) -> bool:
    te_ops = _te()[0]
    return isinstance(op, (te_ops.SwiGLU, te_ops.ScaledSwiGLU, te_ops.ClampedSwiGLU, te_ops.GEGLU, te_ops.SReLU))


def _is_mlp(ops, i) -> bool:
    te_ops = _te()[0]
    return (
        i + 2 < len(ops)
        and isinstance(ops[i], te_ops.GroupedLinear)
        and _is_activation(ops[i + 1])
        and isinstance(ops[i + 2], te_ops.GroupedLinear)
    )


def _windows(ops, decide):
    """(start, stop, decision) of each window of a list of TE basic ops, ``decide(window)`` giving
    the decision: the MLP triples, and lone GroupedLinears (also those of a triple not taken)."""
    te_ops = _te()[0]
    i = 0
    while i < len(ops):
        if _is_mlp(ops, i):
            decision = decide(ops[i : i + 3])
            yield i, i + 3, decision
            if decision.reason is not None:
                yield i, i + 1, decide(ops[i : i + 1])
                yield i + 2, i + 3, decide(ops[i + 2 : i + 3])
            i += 3
        elif isinstance(ops[i], te_ops.GroupedLinear):
            yield i, i + 1, decide(ops[i : i + 1])
            i += 1
        else:
            i += 1


def fuse(ops, *, recipe=None, **unused):
    """TE fusion function: the windows te_fused_ops takes become `TEGroupedOps`."""

    def decide(window):
        decision = _decide(window, recipe)
        _decisions.setdefault(window[0], {})[len(window)] = decision
        return decision

    out, taken = [], 0
    for start, stop, decision in list(_windows(ops, decide)):
        if decision.reason is None:
            out.extend(ops[taken:start])
            out.append(_fused_class()(ops[start:stop], decision))
            taken = stop
    return out + list(ops[taken:])


# ---- the fused operation --------------------------------------------------------------------


@functools.cache
def _weight_names(groups: int) -> tuple:
    return tuple(f"weight{i}" for i in range(groups))


def _weights(fc) -> list:
    """TE GroupedLinear ``fc``'s weight parameters in registration order: what its
    ``_get_weight_tensors`` returns, without a module attribute lookup per group (this runs
    several times per step; qwen3-30b-a3b has 128 groups)."""
    if fc.single_grouped_weight:
        return [fc.weight]
    params = fc._parameters
    return [params[name] for name in _weight_names(fc.num_groups)]


def _packed_weight(fc, weights, memo: dict) -> tuple:
    """((G, out, in) tensor, whether it is a copy): TE's weights (``_weights(fc)``) in place (the
    single grouped weight's buffer, or one view when the per-group weights are consecutive views
    of one buffer, as TE allocates them; else a stacked copy)."""
    g, shape = fc.num_groups, (fc.out_features, fc.in_features)
    if fc.single_grouped_weight:
        return fc.weight.rowwise_data.view(g, *shape), False
    packed = _packed(weights, (g, *shape), memo)
    return packed, packed.data_ptr() != weights[0].data_ptr()


def _packed(tensors, shape, memo=None) -> torch.Tensor:
    """``tensors`` (each of shape[1:]) as one (len, ...) tensor: a view when they are consecutive
    in one storage, else a copy. ``memo`` (a dict, or None) keeps the view under the tensors'
    identities and data pointers: a later call with the same objects at the same addresses
    gets it without the per-tensor checks (the view holds the storage, so no other tensor can
    take those addresses meanwhile; in-place updates are seen, being the same memory)."""
    first = tensors[0]
    key = None
    if memo is not None:
        key = (first.dtype, first.shape, tuple(map(id, tensors)), tuple(map(torch.Tensor.data_ptr, tensors)))
        view = memo.get(key)
        if view is not None:
            return view.detach()
    step = first.numel() * first.element_size()
    storage = first.untyped_storage().data_ptr()
    if all(
        t.is_contiguous() and t.dtype == first.dtype and t.untyped_storage().data_ptr() == storage
        and t.data_ptr() == first.data_ptr() + i * step
        for i, t in enumerate(tensors)
    ):
        view = first.detach().as_strided(shape, (first.numel(), *first.stride()))
        if memo is not None:
            memo.clear()
            memo[key] = view
        return view.detach()
    return torch.stack([t.detach() for t in tensors])


def _main_grads(fc):
    """(G, out, in) float32 view of the weights' main_grad buffers, or a reason string."""
    _, common, _, _ = _te()
    g, shape = fc.num_groups, (fc.out_features, fc.in_features)
    if fc.single_grouped_weight:
        grad = common.get_main_grad_from_param(fc.weight, op_label="GroupedLinear")
        grads = [grad.view(g, *shape)[i] for i in range(g)]
    else:
        grads = [common.get_main_grad_from_param(getattr(fc, f"weight{i}"), op_label="GroupedLinear") for i in range(g)]
    if grads[0].dtype != torch.float32:
        return f"main_grad in {grads[0].dtype} (the kernels accumulate into float32)"
    packed = _packed(grads, (g, *shape))
    if packed.data_ptr() != grads[0].data_ptr():
        return "main_grad buffers are not consecutive in one storage"
    return packed


@functools.cache
def _fused_class():
    """`TEGroupedOps`, a te.ops FusedOperation (defined on first use: it subclasses TE's class)."""
    te_ops, common, _, _ = _te()

    class TEGroupedOps(te_ops.FusedOperation):
        """TE basic ops [fc1, act, fc2] or [fc] run as one te_fused_ops plan (forward and backward)."""

        def __init__(self, window, decision: Decision):
            super().__init__(window)
            self._ours = decision.ops
            self._decision = decision
            self._plans: dict = {}
            self._weight_views: list = [{} for _ in window]  # per basic op: `_packed`'s memo

        # run time: inputs, TE parameters -> te_fused_ops' call, or the reason to run TE's ops
        def _call_args(self, ctxs, x, extra_inputs, kwargs):
            if not installed():
                return "te_fused_ops' fusion was uninstalled"
            linears = [op for op in self.basic_ops if isinstance(op, te_ops.GroupedLinear)]
            splits = [extra_inputs[i][0] for i, op in enumerate(self.basic_ops) if isinstance(op, te_ops.GroupedLinear)]
            split_sizes = splits[0]
            if any(s is not split_sizes and s.data_ptr() != split_sizes.data_ptr() for s in splits[1:]):
                return "FC1 and FC2 got different split_sizes tensors"
            if split_sizes.device != x.device or split_sizes.numel() != linears[0].num_groups:
                return f"split_sizes on {split_sizes.device} with {split_sizes.numel()} entries"
            if x.dtype != _weights(linears[0])[0].dtype:
                return f"input dtype {x.dtype} differs from the weights' (autocast: TE casts)"
            if torch.is_autocast_enabled(x.device.type):
                return "autocast is on (TE casts the weights)"
            if any(kwargs):
                return "output buffers passed through op_kwargs"
            side = {"split_sizes": split_sizes if split_sizes.dtype in (torch.int32, torch.int64) else split_sizes.long()}
            grad_on = any(ctx.requires_grad for ctx in ctxs)
            op_params = []
            for op, ctx, memo in zip(self.basic_ops, ctxs, self._weight_views):
                params = {}
                if isinstance(op, te_ops.GroupedLinear):
                    weights = _weights(op)
                    weight = weights[0]
                    packed, copied = _packed_weight(op, weights, memo)
                    params["weight"] = packed.requires_grad_(ctx.requires_grad and weight.requires_grad)
                    self._decision.copied_weights |= copied
                    if op._accumulate_into_main_grad and params["weight"].requires_grad:
                        main_grad = _main_grads(op)
                        if isinstance(main_grad, str):
                            return main_grad
                        params["weight"].main_grad = main_grad
                    if op.use_bias:
                        bias = op.bias if op.single_grouped_bias else op.bias0
                        params["bias"] = op._get_packed_bias_tensor(x.dtype).detach()
                        params["bias"].requires_grad_(ctx.requires_grad and bias.requires_grad)
                elif isinstance(op, te_ops.ScaledSwiGLU):
                    probs = extra_inputs[1][0]
                    side["probs"] = probs.detach().requires_grad_(grad_on and probs.requires_grad)
                op_params.append(params)
            x = x.reshape(-1, linears[0].in_features).detach().requires_grad_(ctxs[0].requires_grad)
            return x, side, op_params, grad_on

        def fuser_forward(
            self, basic_op_ctxs, input_, *, basic_op_extra_inputs, prev_op_grad_output_quantizer,
            next_op_input_quantizer, basic_op_kwargs,
        ):
            self._decision.copied_weights = False
            args = self._call_args(basic_op_ctxs, input_, basic_op_extra_inputs, basic_op_kwargs)
            first = basic_op_ctxs[0]
            first.tfo_run = None
            self._decision.fallback = args if isinstance(args, str) else None
            if isinstance(args, str):
                return self._te_forward(
                    basic_op_ctxs, input_, basic_op_extra_inputs, prev_op_grad_output_quantizer,
                    next_op_input_quantizer, basic_op_kwargs,
                )
            x, side, op_params, grad_on = args
            run, _, grad_needed = prepare_run(self._ours, x, side, op_params, self._plans, True, grad_on)
            with torch.no_grad():  # gradients are this op's job (TE's fuser runs it inside its Function)
                y = run.forward(x)
            if grad_needed:
                first.save_for_backward(*run.pack())
                first.tfo_run = run
                first.tfo_in_shape = input_.shape
            y = y.view(*input_.shape[:-1], y.shape[-1])
            return y, [()] * len(self.basic_ops)

        def fuser_backward(self, basic_op_ctxs, grad_output, *, basic_op_grad_extra_outputs):
            first = basic_op_ctxs[0]
            if first.tfo_run is None:
                return self._te_backward(basic_op_ctxs, grad_output, basic_op_grad_extra_outputs)
            run = first.tfo_run
            for op, ctx in zip(self.basic_ops, run.ctxs):
                main_grad = ctx.main_grads.get("weight")
                if main_grad is not None and not common.get_accumulate_flag_in_param(_weights(op)[0]):
                    main_grad.zero_()  # overwrite_main_grad: the kernel accumulates into zeros
            dy = grad_output.reshape(-1, grad_output.shape[-1])
            with torch.no_grad():
                dx, side_grads, param_grads = run.backward(dy, first.saved_tensors)
            first.tfo_run = None
            side_grads = dict(zip(run.grad_side_names, side_grads))
            grad_params, grad_extra = [], []
            for i, (op, ctx) in enumerate(zip(self.basic_ops, run.ctxs)):
                if isinstance(op, te_ops.GroupedLinear):
                    grads = {name: param_grads[run.param_slots[(i, name)]] for name in ("weight", "bias") if (i, name) in run.param_slots}
                    grad_params.append(self._te_param_grads(op, ctx, grads))
                    grad_extra.append((None,))
                else:
                    grad_params.append(())
                    grad_extra.append((side_grads.get("probs"),) if op.num_extra_inputs else ())
            if dx is not None:
                dx = dx.view(first.tfo_in_shape)
            return dx, grad_params, grad_extra

        def _te_param_grads(self, op, ctx, grads):
            """te_fused_ops' (G, out, in)/(G, out) gradients in TE's parameter order and form."""
            weights = _weights(op)
            if "weight" in ctx.grad_names and op._accumulate_into_main_grad:
                weight_grads = common.get_dummy_wgrads_for_params(weights)  # main_grad holds it (TE's way)
            elif grads.get("weight") is None:
                weight_grads = [None] * len(weights)
            elif op.single_grouped_weight:
                weight_grads = [grads["weight"]]
            else:
                weight_grads = list(grads["weight"].unbind(0))
            if not op.use_bias:
                return weight_grads
            bias = grads.get("bias")
            if op.single_grouped_bias:
                bias_grads = [bias]
            else:
                bias_grads = [None] * op.num_groups if bias is None else list(bias.unbind(0))
            if op.single_grouped_weight and not op.single_grouped_bias:
                return bias_grads + weight_grads  # TE registers the grouped weight after the biases
            return weight_grads + bias_grads

        # TE's own basic ops, for what te_fused_ops does not take at run time
        def _te_forward(self, ctxs, x, extra_inputs, prev_quantizer, next_quantizer, kwargs):
            ops = list(self.basic_ops)
            for i, (op, ctx) in enumerate(zip(ops, ctxs)):
                x, _ = op.fuser_forward(
                    [ctx], x, basic_op_extra_inputs=[extra_inputs[i]],
                    prev_op_grad_output_quantizer=prev_quantizer if i == 0 else ops[i - 1].get_grad_output_quantizer(),
                    next_op_input_quantizer=next_quantizer if i == len(ops) - 1 else ops[i + 1].get_input_quantizer(),
                    basic_op_kwargs=[kwargs[i]],
                )
            return x, [()] * len(ops)

        def _te_backward(self, ctxs, dy, grad_extra_outputs):
            grad_params, grad_extra = [None] * len(ctxs), [None] * len(ctxs)
            for i in reversed(range(len(ctxs))):
                dy, params, extra = self.basic_ops[i].fuser_backward(
                    [ctxs[i]], dy, basic_op_grad_extra_outputs=[grad_extra_outputs[i]]
                )
                grad_params[i], grad_extra[i] = params[0], extra[0]
            return dy, grad_params, grad_extra

    return TEGroupedOps


# ---- install / uninstall / explain ----------------------------------------------------------


def _refresh(modules) -> None:
    """Make the te.ops.Sequential modules inside ``modules`` fuse again on their next forward."""
    te_ops = _te()[0]
    for module in modules:
        for m in module.modules():
            if isinstance(m, te_ops.Sequential):
                m._module_groups = None


def install(*modules) -> None:
    """Register the fusion with TE's fuser, before TE's own (idempotent). te.ops.Sequential modules
    fuse when first run; pass those that already ran to make them fuse again."""
    te_ops, _, fuser, _ = _te()
    if fuse not in fuser.forward_backward_fusion_functions:
        te_ops.register_forward_backward_fusion(fuse, prepend=True)
    _refresh(modules)


def uninstall(*modules) -> None:
    """Remove the fusion. The windows it took in ``modules`` fuse again on their next forward; any
    other te.ops.Sequential that ran with it runs TE's basic ops in those windows from now on."""
    fuser = _te()[2]
    while fuse in fuser.forward_backward_fusion_functions:
        fuser.forward_backward_fusion_functions.remove(fuse)
    _refresh(modules)


def installed() -> bool:
    """Whether the fusion is registered with TE's fuser."""
    return fuse in _te()[2].forward_backward_fusion_functions


def _op_runs(module):
    """(the te.ops.Sequential's fused windows or None, run) for each run of consecutive TE basic ops
    among the children of each te.ops.Sequential in ``module``. The fused windows, for a Sequential
    that fused (ran since it was built or refreshed): {(id of first op, length): Decision} of the
    `TEGroupedOps` in its fusers, i.e. what runs now."""
    te_ops = _te()[0]
    sequentials = [m for m in module.modules() if isinstance(m, te_ops.Sequential)]
    for seq in sequentials or [module]:
        fusers = [g for g in getattr(seq, "_module_groups", None) or () if hasattr(g, "_forward_ops")]
        fused = None
        if fusers:
            fused = {
                (id(op.basic_ops[0]), len(op.basic_ops)): op._decision
                for fuser in fusers for op, _ in fuser._forward_ops if isinstance(op, _fused_class())
            }
        run = []
        for child in seq.children():
            if isinstance(child, te_ops.BasicOperation):
                run.append(child)
            elif isinstance(child, te_ops.FusedOperation):
                run.extend(child.basic_ops)
            else:
                if run:
                    yield fused, run
                run = []
        if run:
            yield fused, run


def explain(module) -> str:
    """Which windows of the te.ops.Sequential(s) in ``module`` run te_fused_ops, and for the others
    the first reason why not, plus the latest run-time fallback to TE's ops. A Sequential that
    fused is described as it runs now (with the reason recorded at its fusion); one not run since
    it was built or refreshed, as it would fuse without a recipe."""
    lines = [f"te_fused_ops integration: {'installed' if installed() else 'not installed'}"]
    for fused, ops in _op_runs(module):
        pending = []

        def decide(window):
            recorded = _decisions.get(window[0], {}).get(len(window))
            if fused is None:
                if recorded is None:
                    pending.append(recorded := _decide(window, None))
                return recorded
            taken = fused.get((id(window[0]), len(window)))
            if taken is not None:
                return taken
            if recorded is not None and recorded.reason is not None:
                return recorded
            names = [type(op).__name__ for op in window]
            return Decision(names, reason="its own ops (the module fused while te_fused_ops was not installed)")

        for start, stop, decision in _windows(ops, decide):
            where = f"[{start}]" if stop - start == 1 else f"[{start}:{stop}]"
            line = f"  {where} {', '.join(decision.names)} -> "
            if decision.reason is None:
                line += "te_fused_ops (sm90 kernels, forward + backward)"
                if decision.fallback:
                    line += f"; the latest call ran TE's ops: {decision.fallback}"
                elif decision.copied_weights:
                    line += (
                        "; the latest call stacked the per-group weights (they are not views of one buffer, "
                        "e.g. after copy.deepcopy): a copy per call"
                    )
            else:
                line += f"TE: {decision.reason}"
            lines.append(line + (" (not run yet)" if decision in pending else ""))
    return "\n".join(lines)
