"""`Sequential`: a container of basic ops run through the fusion pass (`call.run_ops`)."""

import functools
import warnings

import torch
from torch import nn

from .call import check_params, run_ops
from .context import PlanOwner
from .errors import OpValueError, bool_argument
from .fusion import side_value_users
from .ops.base import BasicOp
from .runner import (
    check_side_inputs,
    compute_dtype,
    get_plan,
    grad_side_names,
    params_need_grad,
    plan_info,
    recipe_of,
)


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


def _expert_shards(seq: "Sequential", prefix: str):
    """(state_dict key, process group) of each parameter that holds this rank's experts of an
    expert-parallel layer: the ``expert_params`` of the ops that take the counts of a dispatch
    with a ``group`` (dim 0: E / W local experts, rank r holding experts [r E / W, (r + 1) E / W))."""
    ops = list(seq)
    for i, op in enumerate(ops):
        group = getattr(op, "group", None)
        if group is None or "split_sizes" not in op.side_outputs:
            continue
        for j in side_value_users(ops, i, "split_sizes"):
            for name in ops[j].expert_params:
                if getattr(ops[j], name, None) is not None:
                    yield f"{prefix}{j}.{name}", group


@functools.cache
def _mesh(group, device_type: str):
    """The 1-D DeviceMesh of ``group`` (made once per group and device type)."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, device_type)


def _expert_shards_as_dtensors(seq, state_dict, prefix, local_metadata):
    """state_dict post-hook: an expert-parallel layer's local experts as DTensors sharded on dim 0
    over its group, so that a distributed checkpoint keeps every rank's experts (plain tensors of
    one key on several ranks are saved once, as replicas) and can load them at another W."""
    from torch.distributed.tensor import DTensor, Shard

    for key, group in _expert_shards(seq, prefix):
        local = state_dict.get(key)
        if isinstance(local, torch.Tensor) and not isinstance(local, DTensor):
            state_dict[key] = DTensor.from_local(local, _mesh(group, local.device.type), [Shard(0)], run_check=False)


def _expert_shards_from_dtensors(seq, state_dict, prefix, *args):
    """load_state_dict pre-hook: the DTensors of `_expert_shards_as_dtensors` back to this rank's shard."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Shard

    for key, group in _expert_shards(seq, prefix):
        value = state_dict.get(key)
        if not isinstance(value, DTensor):
            continue
        ranks = dist.get_world_size(group)
        if tuple(value.placements) != (Shard(0),) or value.device_mesh.size() != ranks:
            raise OpValueError(f"Sequential.load_state_dict: '{key}' holds experts as a DTensor placed "
                               f"{tuple(value.placements)} over {value.device_mesh.size()} ranks; this layer's are "
                               f"sharded on dim 0 over its group's {ranks}")
        state_dict[key] = value.to_local()


class Sequential(PlanOwner, nn.Module):
    """A container of basic ops, run through the fusion pass.

    ``seq(x, split_sizes=s, probs=p)``: side inputs by name, each consumed by the ops declaring it.
    Behaves like ``torch.nn.Sequential`` for indexing, parameters, state_dict, to(), train()/eval().
    ``fuse=False`` (or env TE_FUSED_OPS_FUSION=0) runs every op on its own.
    """

    def __init__(self, *ops, fuse: bool = True):
        super().__init__()
        fuse = bool_argument("Sequential", "fuse", fuse)
        for i, op in enumerate(ops):
            if not isinstance(op, BasicOp):
                raise TypeError(f"Sequential: argument 'ops' [{i}] must be a te_fused_ops basic op, got {type(op).__name__}")
            self.add_module(str(i), op)
        self.fuse = fuse
        self._init_plan_owner()
        self.register_state_dict_post_hook(_expert_shards_as_dtensors)
        self.register_load_state_dict_pre_hook(_expert_shards_from_dtensors)

    def add_module(self, name: str, module) -> None:
        if not isinstance(module, BasicOp):
            raise TypeError(f"Sequential: module '{name}' must be a te_fused_ops basic op, got {type(module).__name__}")
        super().add_module(name, module)

    register_module = add_module

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, nn.Module) and not isinstance(value, BasicOp):
            raise TypeError(f"Sequential: attribute '{name}' would add a {type(value).__name__}, not a te_fused_ops "
                            "basic op; a Sequential holds basic ops only (append them)")
        super().__setattr__(name, value)

    def __len__(self) -> int:
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def __getitem__(self, index):
        """An op, or for a slice a Sequential of the same ops (parameters shared) under the same
        names, as ``torch.nn.Sequential`` slices: its state_dict keys are the parent's."""
        if isinstance(index, slice):
            part = Sequential(fuse=self.fuse)
            for name, op in list(self._modules.items())[index]:
                part.add_module(name, op)
            return part
        ops = list(self._modules.values())
        if not -len(ops) <= index < len(ops):
            raise IndexError(f"Sequential: index {index} out of range for {len(ops)} ops")
        return ops[index]

    def append(self, op: BasicOp) -> "Sequential":
        if not isinstance(op, BasicOp):
            raise TypeError(f"Sequential.append: argument 'op' must be a te_fused_ops basic op, got {type(op).__name__}")
        # the next number after the last numeric name (a slice keeps its parent's names)
        numbers = [int(name) for name in self._modules if name.isdecimal()]
        self.add_module(str(max(numbers) + 1) if numbers else "0", op)
        return self

    def extend(self, ops) -> "Sequential":
        for op in ops:
            self.append(op)
        return self

    def _refuse_in_place(self, *args, **kwargs):
        raise TypeError("Sequential: ops are appended, never inserted, removed or replaced in place (the names in "
                        "state_dict would shift); build a new Sequential from its ops or slices (parameters shared)")

    insert = pop = __setitem__ = __delitem__ = _refuse_in_place

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
        if isinstance(x, torch.Tensor):  # the checks a call makes before planning (a meta x plans only)
            check_side_inputs("Sequential", ops, side)
            if x.device.type != "meta":
                check_params("Sequential", ops, x, op_params)
        if x is None:
            param = next(self.parameters(), None)
            device = param.device if param is not None else torch.device("cpu")
            dtype = compute_dtype(param) if param is not None else torch.get_default_dtype()
            info = plan_info(ops, device, dtype, False, grad_side_names(side), params_need_grad(op_params))
        else:
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"Sequential.plan: argument 'x' must be a torch.Tensor or None, got {type(x).__name__}")
            info = plan_info(ops, x.device, compute_dtype(x), x.requires_grad, grad_side_names(side),
                             params_need_grad(op_params), recipe_of(x))
        return get_plan(ops, info, self._plans, self.fuse)

    def explain(self, x=None, **side) -> str:
        """Readable plan: which rule fired on which ops with which backend, and why others did not."""
        return self.plan(x, **side).explain(list(self))
