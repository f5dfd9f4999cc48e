"""One call of ops (a Sequential's, or a lone op's): input checks, autocast, then the eager
runner or, under torch.compile, the custom op."""

import torch
from torch import nn

from .custom_ops import compiled_call
from .errors import OpTypeError, OpValueError
from .quantization import AUTOCAST_SOURCE
from .runner import (
    SequenceFunction,
    autocast_eligible,
    check_side_inputs,
    compute_dtype,
    prepare_run,
)


def _autocast_cast(x, ops, op_params, dtype):
    """x and the floating parameters cast to ``dtype`` through autograd (as nn.Linear under
    autocast), but an op's ``float32_params``. A parameter's cast copy names its parameter
    (`AUTOCAST_SOURCE`: kept weight casts are found by it) and carries its ``main_grad``."""
    def cast(t):
        return t.to(dtype) if autocast_eligible(t) else t

    def cast_param(param):
        copy = cast(param)
        if copy is not param:
            setattr(copy, AUTOCAST_SOURCE, param)
            if hasattr(param, "main_grad"):
                copy.main_grad = param.main_grad
        return copy

    return cast(x), [{name: p if name in op.float32_params else cast_param(p) for name, p in params.items()}
                     for op, params in zip(ops, op_params)]


def _check_one_dtype(op, index: int, params: dict) -> None:
    """The op's floating parameters (other than its ``float32_params``) share one dtype."""
    first = None
    for name, param in params.items():
        dtype = param.dtype
        if not dtype.is_floating_point or name in op.float32_params:
            continue
        if first is None:
            first = name, dtype
        elif dtype != first[1]:
            raise OpTypeError(
                f"{op.op_name} (op {index}): parameter '{name}' has dtype {dtype} but parameter '{first[0]}' "
                f"has {first[1]}; give the op's parameters one dtype (module.to(dtype))"
            )


def check_params(owner_name: str, ops, x: torch.Tensor, op_params: list) -> None:
    """x on a real device, every parameter on x's device and of its op's shape (a weight
    substituted by ``functional_call``, ``.data`` or a parametrization too), before any kernel
    runs."""
    if x.device.type == "meta":
        raise OpValueError(
            f"{owner_name}: argument 'x' is on the meta device (no data to compute on); "
            "pass a tensor on the CPU or a GPU"
        )
    for i, (op, params) in enumerate(zip(ops, op_params)):
        shapes = op.param_shapes
        if len(params) > 1:
            _check_one_dtype(op, i, params)
        for name, param in params.items():
            if param.shape != shapes.get(name, param.shape):
                raise OpValueError(
                    f"{op.op_name} (op {i}): parameter '{name}' must have shape {shapes[name]}, got "
                    f"{tuple(param.shape)}"
                )
            if param.device != x.device:
                fix = ("materialize it first (module.to_empty(device=...), then initialize or load the "
                       "parameters)" if param.device.type == "meta" else "move the module to the input's device "
                       "(module.to(x.device))")
                raise OpValueError(
                    f"{op.op_name} (op {i}): parameter '{name}' is on {param.device} but argument 'x' is on "
                    f"{x.device}; {fix}"
                )


def run_ops(owner: nn.Module, ops, x, side: dict, cache: dict, fuse: bool):
    """Check inputs, plan (cached) and run ``ops`` on ``x`` with named side inputs.

    Under autocast, x and the floating parameters are cast to the autocast dtype first and the
    ops run with autocast off. Under torch.compile, the call is one custom op (`custom_ops`).
    """
    owner_name = type(owner).__name__
    if not isinstance(x, torch.Tensor):
        raise OpTypeError(f"{owner_name}: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
    if torch._C._are_functorch_transforms_active():
        raise NotImplementedError(
            f"{owner_name}: torch.func transforms (grad, vmap, jacrev, ...) are not supported; torch.autograd "
            "and torch.func.functional_call outside them are"
        )
    check_side_inputs(owner_name, ops, side)
    op_params = [op.call_params() for op in ops]
    check_params(owner_name, ops, x, op_params)
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        if x.dtype != torch.float64:  # as nn.Linear: autocast leaves float64 (and so the weights) alone
            x, op_params = _autocast_cast(x, ops, op_params, compute_dtype(x))
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
    return SequenceFunction.apply(run, x, *[side[n] for n in run.grad_side_names], *params)
