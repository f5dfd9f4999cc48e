"""`Sequential` and the runner that executes a plan inside one autograd.Function."""

import copy
import functools
import warnings

import torch
from torch import nn

from .custom_ops import compiled_call
from .fusion import PlanInfo, forced_backend, fusion_enabled_by_env, make_plan, registry_version
from .ops.base import BasicOp, OpContext, is_quantized, register_owner
from .saved import pack, unpack


@functools.cache
def _cuda_capability(index: int):
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device):
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def _plan_info(
    ops, device, dtype, x_requires_grad: bool, side_grad: frozenset, params_grad: list, x_recipe=None,
    grad_on: bool = None,
) -> PlanInfo:
    """``side_grad``: names of side inputs requiring grad; ``params_grad``: per op, whether any
    parameter this call reads requires grad; ``x_recipe``: the input's Recipe if it is a
    QuantizedTensor; ``grad_on``: gradients wanted (default: grad mode)."""
    grad_on = torch.is_grad_enabled() if grad_on is None else grad_on
    input_rg, params_rg, input_recipe = [], [], []
    running = grad_on and x_requires_grad
    for op, param_grad in zip(ops, params_grad):
        input_rg.append(running)
        input_recipe.append(x_recipe)
        x_recipe = op.output_recipe(x_recipe)
        needs = grad_on and (param_grad or not side_grad.isdisjoint(op.side_inputs))
        params_rg.append(needs)
        running = running or needs
    return PlanInfo(device.type, _capability(device), dtype, tuple(input_rg), tuple(params_rg), tuple(input_recipe))


def _recipe_of(x):
    return x.recipe if is_quantized(x) else None


def _side_grad(side: dict) -> frozenset:
    return frozenset(n for n, v in side.items() if isinstance(v, torch.Tensor) and v.requires_grad)


def _params_grad(op_params) -> list:
    return [any(p.requires_grad for p in params.values()) for params in op_params]


def _get_plan(ops, info: PlanInfo, cache: dict, fuse: bool):
    key = (
        registry_version(),
        fuse,
        fusion_enabled_by_env(),
        forced_backend(),
        info,
        tuple(op.plan_signature() for op in ops),
    )
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = make_plan(ops, info, fuse)
    return plan


def _check_side_inputs(owner: str, ops, side: dict) -> None:
    consumed = {name for op in ops for name in op.side_inputs}
    unknown = sorted(set(side) - consumed)
    if unknown:
        raise ValueError(
            f"{owner}: side input(s) {', '.join(map(repr, unknown))} not consumed by any op "
            f"(consumed: {', '.join(sorted(consumed)) or 'none'})"
        )
    for i, op in enumerate(ops):
        for name in op.side_inputs:
            if side.get(name) is None and name not in op.optional_side_inputs:
                raise ValueError(f"{op.op_name} (op {i}): missing side input '{name}'")


class _Run:
    """One call: the ops, their contexts and the plan; runs both passes.

    ``param_slots`` maps (op index, parameter name) to the position of that tensor among the
    autograd.Function's parameter inputs (a parameter shared by two ops has one slot).
    After the forward, the contexts hold a skeleton of what the backward needs (`saved.pack`);
    the tensors themselves live in the Function's saved tensors.
    """

    def __init__(self, ops, ctxs, plan, grad_side_names, param_slots, num_params):
        self.ops, self.ctxs, self.plan = ops, ctxs, plan
        self.grad_side_names = grad_side_names
        self.param_slots = param_slots
        self.num_params = num_params

    def forward(self, x, steps=None):
        """Run the forward steps (default: the plan's) on ``x``; returns the output."""
        for step in self.plan.forward if steps is None else steps:
            if step.start > 0:
                self.ctxs[step.start].input_recompute = self.ctxs[step.start - 1].recompute_output
            x = step.run(self.ops, self.ctxs, x, "forward")
        return x

    def pack(self, tensors=None, index=None) -> list:
        """Replace the tensors the contexts keep by slots; return them (for save_for_backward).

        ``tensors``/``index`` (id -> slot) may come pre-filled: tensors found there keep their slot.
        """
        tensors, index = ([], {}) if tensors is None else (tensors, index)
        for ctx in self.ctxs:
            ctx.saved = pack(ctx.saved, tensors, index)
            ctx.side = pack(ctx.side, tensors, index)
            ctx.params = {}
            ctx.recompute_output = ctx.input_recompute = None
        return tensors

    def backward(self, dy, saved_tensors):
        """(dx, side-input grads, parameter grads) from the contexts rebuilt on ``saved_tensors``."""
        ctxs = [copy.copy(ctx) for ctx in self.ctxs]
        for ctx in ctxs:
            ctx.saved = unpack(ctx.saved, saved_tensors)
            ctx.side = unpack(ctx.side, saved_tensors)
        op_grads = [None] * len(self.ops)
        for step in self.plan.backward:
            dy, grads = step.run(self.ops, ctxs, dy, "backward")
            op_grads[step.start : step.stop] = grads
        side_grads = {name: None for name in self.grad_side_names}
        param_grads = [None] * self.num_params
        for i, grads in enumerate(op_grads):
            for name, grad in (grads or {}).items():
                if grad is None:
                    continue
                if name in side_grads:
                    side_grads[name] = grad if side_grads[name] is None else side_grads[name] + grad
                    continue
                slot = self.param_slots[(i, name)]
                param_grads[slot] = grad if param_grads[slot] is None else param_grads[slot] + grad
        return dy, [side_grads[n] for n in self.grad_side_names], param_grads


class _SequenceFunction(torch.autograd.Function):
    """Runs a whole plan; inputs: the run, x, side inputs needing grad, the parameters."""

    @staticmethod
    def forward(ctx, run: _Run, x, *flat):
        y = run.forward(x)
        ctx.save_for_backward(*run.pack())
        ctx.run = run
        return y

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        dx, side_grads, param_grads = ctx.run.backward(dy, ctx.saved_tensors)
        if is_quantized(dx):
            dx = dx.dequantize()
        return (None, dx, *side_grads, *param_grads)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a call computes in: autocast's for x's device where it is on, else x's."""
    if torch.is_autocast_enabled(x.device.type) and _autocast_eligible(x):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def _autocast_eligible(t: torch.Tensor) -> bool:
    """What autocast casts: floating tensors other than float64 (and not quantized)."""
    return t.is_floating_point() and t.dtype != torch.float64 and not is_quantized(t)


def _autocast_cast(x, op_params, dtype):
    """x and the floating parameters cast to ``dtype`` through autograd (as nn.Linear under autocast)."""
    def cast(t):
        return t.to(dtype) if _autocast_eligible(t) else t

    return cast(x), [{name: cast(p) for name, p in params.items()} for params in op_params]


def run_ops(owner: nn.Module, ops, x, side: dict, cache: dict, fuse: bool):
    """Check inputs, plan (cached) and run ``ops`` on ``x`` with named side inputs.

    Under autocast, x and the floating parameters are cast to the autocast dtype first and the
    ops run with autocast off. Under torch.compile, the call is one custom op (`custom_ops`).
    """
    owner_name = type(owner).__name__
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{owner_name}: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
    _check_side_inputs(owner_name, ops, side)
    op_params = [op.call_params() for op in ops]
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        x, op_params = _autocast_cast(x, op_params, compute_dtype(x))
        with torch.autocast(device_type, enabled=False):
            return _run(owner, ops, x, side, cache, fuse, op_params)
    return _run(owner, ops, x, side, cache, fuse, op_params)


def _run(owner, ops, x, side, cache, fuse, op_params):
    """`run_ops` after the checks and autocast casts: the ops' parameters in ``op_params``."""
    if torch.compiler.is_compiling():
        return compiled_call(owner, ops, x, side, op_params)
    run, params, grad_needed = prepare_run(ops, x, side, op_params, cache, fuse, torch.is_grad_enabled())
    if not grad_needed:
        with torch.no_grad():
            return run.forward(x)
    return _SequenceFunction.apply(run, x, *[side[n] for n in run.grad_side_names], *params)


def prepare_run(ops, x, side: dict, op_params: list, cache: dict, fuse: bool, grad_on: bool):
    """The plan (cached in ``cache``) and the contexts of one call, outside autograd.

    ``op_params``: per op, name -> tensor; ``grad_on``: whether gradients are wanted (then the
    tensors' requires_grad say which). Returns (run, the distinct parameter tensors in slot order,
    whether any gradient is needed). The caller runs ``run.forward(x)``, keeps ``run.pack()``
    and later calls ``run.backward(dy, kept)``: this is what `_SequenceFunction` does, and what
    an integration running inside another autograd.Function does itself.
    """
    side_grad = _side_grad(side) if grad_on else frozenset()
    params_grad = _params_grad(op_params)
    info = _plan_info(ops, x.device, x.dtype, x.requires_grad, side_grad, params_grad, _recipe_of(x), grad_on)
    plan = _get_plan(ops, info, cache, fuse)

    memo: dict = {}
    ctxs, params, param_slots = [], [], {}
    slot_of = {}  # id(tensor) -> position in params
    for i, op in enumerate(ops):
        ctx = OpContext(op, i, info.input_requires_grad[i], info.params_require_grad[i])
        ctx.side = op.bind_side_inputs(side, x, memo)
        ctx.params = op_params[i]
        for name, param in ctx.params.items():
            if id(param) not in slot_of:
                slot_of[id(param)] = len(params)
                params.append(param)
            param_slots[(i, name)] = slot_of[id(param)]
        if grad_on:
            ctx.grad_names = frozenset(
                name for name, value in (*ctx.params.items(), *ctx.side.items())
                if isinstance(value, torch.Tensor) and value.requires_grad
            )
        ctxs.append(ctx)

    grad_needed = info.input_requires_grad[-1] or info.params_require_grad[-1] if ops else False
    grad_side_names = sorted(side_grad)  # every side input is consumed (checked)
    return _Run(ops, ctxs, plan, grad_side_names, param_slots, len(params)), params, grad_needed


def saved_tensor_bytes(output: torch.Tensor) -> int:
    """Bytes of activations a Sequential/op call keeps for its backward (parameters excluded,
    lazily recomputed tensors excluded, each storage counted once).

    ``output`` is the call's result (its grad_fn is the call's autograd.Function).
    """
    if getattr(output.grad_fn, "run", None) is None:
        raise ValueError("saved_tensor_bytes: argument 'output' is not the output of a te_fused_ops call with grad")
    seen = {p.untyped_storage().data_ptr() for op in output.grad_fn.run.ops for p in op.call_params().values()}
    total = 0
    for t in output.grad_fn.saved_tensors:
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def _run_pre_hooks(op, args: tuple, kwargs: dict):
    """``op``'s forward pre-hooks on (args, kwargs), as ``nn.Module.__call__`` runs them."""
    for hook_id, hook in op._forward_pre_hooks.items():
        if hook_id in op._forward_pre_hooks_with_kwargs:
            result = hook(op, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(
                        f"forward pre-hook must return None or a tuple of (new_args, new_kwargs), but got {result}."
                    )
                args, kwargs = result
        else:
            result = hook(op, args)
            if result is not None:
                args = result if isinstance(result, tuple) else (result,)
    return args, kwargs


def _run_post_hooks(op, args: tuple, kwargs: dict, output, only_always_called: bool = False):
    """``op``'s forward hooks on ``output``, as ``nn.Module.__call__`` runs them (after an
    error: only those registered with ``always_call=True``, their own errors turned into warnings)."""
    for hook_id, hook in op._forward_hooks.items():
        if only_always_called and hook_id not in op._forward_hooks_always_called:
            continue
        try:
            if hook_id in op._forward_hooks_with_kwargs:
                result = hook(op, args, kwargs, output)
            else:
                result = hook(op, args, output)
        except Exception as error:
            if not only_always_called:
                raise
            warnings.warn(
                "module forward hook with ``always_call=True`` raised an exception that was silenced "
                f"as another error was raised in forward: {error}",
                stacklevel=3,
            )
            continue
        if result is not None:
            output = result
    return output


def _run_with_op_hooks(seq: "Sequential", ops: list, x, side: dict):
    """`Sequential.forward` when some op has forward (pre-)hooks, e.g. FSDP2's from a per-op
    ``fully_shard``: the ops never run through ``op.__call__``, so the sequence runs them itself.

    One autograd.Function runs the whole sequence (fused steps span ops), so each op's hooks see
    the sequence's input and output: every op's pre-hooks run first, in op order, on ``(x,)`` and
    the side inputs that op consumes (what a hook returns replaces them for the later ops and the
    run, so FSDP2 unshards the parameters before they are read and hooks its post-backward on the
    input); then the run; then every op's forward hooks, in op order, on the output (FSDP2
    reshards and hooks its pre-backward on the output, i.e. before the sequence's backward).
    Backward hooks of the ops (``register_full_backward_hook``) are not run.
    """
    side = dict(side)
    entered = []  # [op, args, kwargs] of the ops whose pre-hooks ran
    posted = 0  # how many of them had their forward hooks run
    try:
        for i, op in enumerate(ops):
            if not (op._forward_pre_hooks or op._forward_hooks) or any(op is e[0] for e in entered):
                continue  # an op placed twice: its hooks run once (FSDP2 unshards/reshards once)
            args, kwargs = (x,), {name: side[name] for name in op.side_inputs if name in side}
            entered.append([op, args, kwargs])
            if op._forward_pre_hooks:
                args, kwargs = _run_pre_hooks(op, args, kwargs)
                if len(args) != 1:
                    raise TypeError(
                        f"{op.op_name} (op {i}): a forward pre-hook returned {len(args)} positional "
                        "arguments; inside a Sequential an op takes exactly one (x)"
                    )
                entered[-1][1:] = args, kwargs
                x = args[0]
                side.update(kwargs)
        output = run_ops(seq, ops, x, side, seq._plans, seq.fuse)
        while posted < len(entered):
            op, args, kwargs = entered[posted]
            posted += 1
            output = _run_post_hooks(op, args, kwargs, output)
        return output
    except Exception:
        if torch.compiler.is_compiling():
            raise
        # as nn.Module.__call__: the always_call hooks of the ops whose hooks did not run yet
        for op, args, kwargs in entered[posted:]:
            if any(h in op._forward_hooks_always_called for h in op._forward_hooks):
                _run_post_hooks(op, args, kwargs, None, only_always_called=True)
        raise


class Sequential(nn.Module):
    """A container of basic ops, run through the fusion pass.

    ``seq(x, split_sizes=s, probs=p)``: side inputs by name, each consumed by the ops declaring it.
    Behaves like ``torch.nn.Sequential`` for indexing, parameters, state_dict, to(), train()/eval().
    ``fuse=False`` (or env TE_FUSED_OPS_FUSION=0) runs every op on its own.
    """

    def __init__(self, *ops, fuse: bool = True):
        super().__init__()
        for i, op in enumerate(ops):
            if not isinstance(op, BasicOp):
                raise TypeError(f"Sequential: argument 'ops' [{i}] must be a te_fused_ops basic op, got {type(op).__name__}")
            self.add_module(str(i), op)
        self.fuse = fuse
        self._plans: dict = {}
        self._owner_id = register_owner(self)

    def __setstate__(self, state):
        super().__setstate__(state)
        self._owner_id = register_owner(self)  # a copy is another owner

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, index):
        ops = list(self._modules.values())
        if isinstance(index, slice):
            return Sequential(*ops[index], fuse=self.fuse)
        return ops[index]

    def append(self, op: BasicOp) -> "Sequential":
        if not isinstance(op, BasicOp):
            raise TypeError(f"Sequential.append: argument 'op' must be a te_fused_ops basic op, got {type(op).__name__}")
        self.add_module(str(len(self)), op)
        return self

    def forward(self, x, **side):
        ops = list(self)
        if any(op._forward_pre_hooks or op._forward_hooks for op in ops):
            return _run_with_op_hooks(self, ops, x, side)
        return run_ops(self, ops, x, side, self._plans, self.fuse)

    def plan(self, x=None, **side):
        """The plan a call with these inputs would run (x None: the parameters' device and dtype;
        under autocast, the autocast dtype)."""
        ops = list(self)
        op_params = [op.call_params() for op in ops]
        if x is None:
            param = next(self.parameters(), None)
            device = param.device if param is not None else torch.device("cpu")
            dtype = compute_dtype(param) if param is not None else torch.get_default_dtype()
            info = _plan_info(ops, device, dtype, False, _side_grad(side), _params_grad(op_params))
        else:
            side_grad, params_grad = _side_grad(side), _params_grad(op_params)
            info = _plan_info(ops, x.device, compute_dtype(x), x.requires_grad, side_grad, params_grad, _recipe_of(x))
        return _get_plan(ops, info, self._plans, self.fuse)

    def explain(self, x=None, **side) -> str:
        """Readable plan: which rule fired on which ops with which backend, and why others did not."""
        return self.plan(x, **side).explain(list(self))
