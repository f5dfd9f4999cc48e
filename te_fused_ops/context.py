"""What one op's forward leaves for its backward, whichever step ran it (`OpContext`, `Saved`,
`Recompute`, the folded `Format`s), and the registry of modules that torch.compile finds by id.

Depends on nothing in the package but `quantization`, so the ops, the runner, the planner and
the backends can all import it.
"""

import copy
import functools
import itertools
import weakref
from types import SimpleNamespace

import torch
from torch import nn

from .quantization import current_reuse_scope, step_scope_of

_owners: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()
_uids = itertools.count()


def register_owner(module: nn.Module) -> int:
    """A new id for ``module`` (a Sequential or a BasicOp); torch.compile finds it by that id."""
    uid = next(_uids)
    _owners[uid] = module
    return uid


class PlanOwner:
    """What a `Sequential` and a `BasicOp` share as owners of a plan cache (mixed in before
    ``nn.Module``): the cache ``_plans`` and the id torch.compile finds them by. A copy (deepcopy,
    pickle) is another owner and leaves the cache behind: plans hold rules and their checks, which
    need not pickle, and belong to this process's rule registry (the copy plans again)."""

    shared_on_copy: tuple = ()  # attributes a copy shares instead of copying (a process group)

    def _init_plan_owner(self) -> None:
        self._plans: dict = {}
        self._owner_id = register_owner(self)

    def __getstate__(self):
        state = self.__dict__.copy()
        state["_plans"] = {}
        return state

    def __setstate__(self, state):
        super().__setstate__(state)
        self._owner_id = register_owner(self)

    def __deepcopy__(self, memo):
        # the pickling pair, called by name: a parametrized module's class (made by
        # torch.nn.utils.parametrize) replaces __getstate__ with one that raises, and copies
        # __dict__ directly unless its class has __deepcopy__
        replica = self.__class__.__new__(self.__class__)
        memo[id(self)] = replica
        for name in self.shared_on_copy:
            shared = getattr(self, name)
            memo[id(shared)] = shared
        PlanOwner.__setstate__(replica, copy.deepcopy(PlanOwner.__getstate__(self), memo))
        return replica


def registered_owner(uid: int) -> nn.Module:
    """The module registered as ``uid``."""
    return _owners[uid]


class DeferredGrad(functools.partial):
    """A parameter gradient a backward step hands back uncomputed (a `functools.partial`): called
    after every step of the backward (`runner.Run.backward`, in op order), once the tensors the
    steps after it make and free (e.g. a permute's data gradient in expert order, a d_pre written
    over the saved pre-activation) are gone, so the gradient's buffer never meets them at the
    peak."""


def backward_keeps_graph() -> bool:
    """Whether the running backward keeps the graph for another one (``retain_graph``); True
    outside a backward and where torch does not say."""
    keep_graph = getattr(torch._C._autograd, "_get_current_graph_task_keep_graph", None)
    return True if keep_graph is None else bool(keep_graph())


class Recompute:
    """Stands in for a saved tensor that can be recomputed in the backward as ``fn(*args)``.

    ``args`` may hold tensors (saved through autograd like any other saved value) and other
    `Recompute`s (called first); ``fn`` must not capture tensors itself (a bound method of the
    op, a module-level function).
    """

    def __init__(self, fn, *args):
        self.fn, self.args = fn, args

    def __call__(self):
        return self.fn(*(arg() if isinstance(arg, Recompute) else arg for arg in self.args))


class Saved(SimpleNamespace):
    """Values an op keeps for its backward, as named fields (``ctx.saved.input``,
    ``ctx.saved.weight``, ...): tensors, QuantizedTensors, `Recompute`s, plain values."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        raise AttributeError(
            f"ctx.saved has no field '{name}' (fields: {', '.join(sorted(vars(self))) or 'none'}); the forward "
            "that ran this op (its own or a fusion rule's) must set it"
        )

    def get(self, name: str, default=None):
        return vars(self).get(name, default)


class Format:
    """A ``Quantize(recipe)[, Transpose()]`` (or a lone ``Transpose()``) that the planner folded
    into a step as the input or output format of one of its ops.

    ``recipe``: the Quantize's recipe, None for a lone Transpose; ``columns``: a Transpose is
    folded (the per-group column-wise copy is wanted too); ``quantize_grad``: the Quantize's
    backward casts the gradient; ``ops``/``ctxs``: the folded ops and their contexts, whose own
    forwards `apply` runs (the reference); ``offsets``: the groups' row offsets (G+1,) or None.
    """

    def __init__(self, ops: list, ctxs: list):
        self.ops, self.ctxs = ops, ctxs
        quantize = ops[0] if ops[0].format_role == "quantize" else None
        self.recipe = quantize.recipe if quantize is not None else None
        self.quantize_grad = bool(quantize is not None and quantize.quantize_grad)
        self.columns = len(ops) == 2 or quantize is None
        self.offsets = next((c.side.get("offsets") for c in ctxs if c.side.get("offsets") is not None), None)

    def apply(self, x):
        """``x`` through the folded ops' own forwards (the unfused result)."""
        for op, ctx in zip(self.ops, self.ctxs):
            x = op.op_forward(ctx, x)
        return x

    def backward(self, dy):
        """``dy`` through the folded ops' own backwards (straight-through, or the gradient's cast
        with ``quantize_grad``)."""
        for op, ctx in zip(reversed(self.ops), reversed(self.ctxs)):
            dy, _ = op.op_backward(ctx, dy)
        return dy

    def __repr__(self) -> str:
        return " + ".join(op.op_name for op in self.ops)


class OpContext:
    """What one op's forward leaves for its backward, whichever step (op or rule) ran it.

    params:               the op's parameters as this call sees them (``getattr`` at call time,
                          so parametrizations, ``functional_call`` and FSDP2 unsharding apply);
                          forward only, never kept for the backward
    grad_names:           parameter and side-input names whose tensors require grad
    side:                 bound side inputs (e.g. ``offsets`` for grouped ops, ``probs``)
    side_sources:         side-input name -> index of the op that produced it (None until bound)
    produced:             side values this op produced for the ops after it (forward only)
    produced_grads:       gradients of the produced values, for the backward (from the ops that used them)
    saved:                `Saved` values for the backward, by field; tensors reach the backward
                          through ``ctx.save_for_backward`` of the Sequential's autograd.Function
    input_private:        the saved input (or what its recompute returns) is an intermediate of
                          this call that only this op's backward reads: a backward that does not
                          keep the graph may write over it (`input_overwritable`)
    grad_over_input:      the data gradient this op's backward wrote over its saved input, else
                          None: `runner.Run.backward` frees that storage once the rest of the
                          backward no longer reads it (`runner.free_unread_grads_over_inputs`)
    recompute_output:     set by a fused forward that did not keep this op's output alive: a
                          `Recompute` giving the output again (the consumer saves it lazily)
    input_format:         the `Format` folded before this op in the running step, else None
    output_format:        the `Format` folded after this op in the running step, else None
    main_grads:           parameter name -> fp32 buffer the backward accumulates that gradient
                          into instead of returning it (an output, so not a saved tensor)
    grad_buffers:         parameter name -> tensor the backward may write that gradient into
                          (it still returns it; a chunked segment's slice of the full gradient)
    chunked:              the `overlap.ChunkedSegment` of the call, on the context of the op
                          that opens it (its chunks' own contexts), else None
    forward_rule:         name of the fusion rule whose forward ran this op, or None (error hints)
    reuse_scope:          the `reuse_quantized_weights` scope open when the forward ran, else the
                          op's `cast_weights_once_per_step` scope (or None): both passes make or
                          reuse weight copies in it
    """

    def __init__(self, op, index: int, input_requires_grad: bool, params_require_grad: bool):
        self.op = op
        self.index = index
        self.input_requires_grad = input_requires_grad
        self.params_require_grad = params_require_grad
        self.params: dict = {}
        self.grad_names: frozenset = frozenset()
        self.side: dict = {}
        self.side_sources = None
        self.produced: dict = {}
        self.produced_grads: dict = {}
        self.saved = Saved()
        self.recompute_output = None
        self.input_recompute = None
        self.input_private = False
        self.grad_over_input = None
        self.input_format = None
        self.output_format = None
        self.main_grads: dict = {}
        self.grad_buffers: dict = {}
        self.chunked = None
        self.forward_rule = None
        self.reuse_scope = current_reuse_scope() or step_scope_of(op)

    def save_input(self, x) -> None:
        """Keep the op's input for the backward, lazily when its producer can recompute it."""
        self.saved.input = self.input_recompute if self.input_recompute is not None else x

    def input_overwritable(self) -> bool:
        """Whether this op's backward may write its gradient over the saved input: an intermediate
        (`input_private`) and a backward that frees the graph after it (not ``retain_graph``)."""
        return self.input_private and not backward_keeps_graph()

    def load_input(self):
        value = self.saved.input
        return value() if isinstance(value, Recompute) else value

    def needs_grad(self, name: str) -> bool:
        """Whether parameter or side input ``name`` required grad when the forward ran."""
        return name in self.grad_names
