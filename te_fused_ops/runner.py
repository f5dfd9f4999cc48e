"""The runner: plans (cached per call signature) and runs them inside one autograd.Function.

`prepare_run` plans one call and builds its op contexts; `Run` executes the plan's forward and
backward steps; `SequenceFunction` is the autograd.Function around a `Run`. `call.run_ops`
(Sequential and lone ops), `custom_ops` (torch.compile) and the integrations all go through here.
"""

import copy
import functools

import torch

from . import env
from .backends import backends_version
from .context import DeferredGrad, OpContext
from .errors import OpValueError
from .overlap import ChunkedSegment
from .fusion import (
    FusionRuleValueError,
    PlanInfo,
    forced_backend,
    fusion_enabled_by_env,
    make_plan,
    registry_version,
    side_value_users,
)
from .quantization import is_quantized
from .saved import pack, storage_bases, unpack


@functools.cache
def _cuda_capability(index: int):
    return torch.cuda.get_device_capability(index)


def _capability(device: torch.device):
    if device.type != "cuda":
        return None
    return _cuda_capability(device.index if device.index is not None else torch.cuda.current_device())


def plan_info(
    ops, device, dtype, x_requires_grad: bool, side_grad: frozenset, params_grad: list, x_recipe=None,
    grad_on: bool = None,
) -> PlanInfo:
    """``side_grad``: names of side inputs requiring grad; ``params_grad``: per op, whether any
    parameter this call reads requires grad; ``x_recipe``: the input's Recipe if it is a
    QuantizedTensor; ``grad_on``: gradients wanted (default: grad mode). A side value an op
    produces (``grad_side_outputs``) needs a gradient when that op's input or parameters do."""
    grad_on = torch.is_grad_enabled() if grad_on is None else grad_on
    input_rg, params_rg, input_recipe = [], [], []
    running = grad_on and x_requires_grad
    grad_names = set(side_grad)
    for op, param_grad in zip(ops, params_grad):
        input_rg.append(running)
        input_recipe.append(x_recipe)
        x_recipe = op.output_recipe(x_recipe)
        needs = grad_on and (param_grad or not grad_names.isdisjoint(op.side_inputs))
        params_rg.append(needs)
        grad_names.difference_update(op.side_outputs)
        if running or needs:
            grad_names.update(op.grad_side_outputs)
        running = running or needs
    return PlanInfo(device.type, _capability(device), dtype, tuple(input_rg), tuple(params_rg), tuple(input_recipe))


def recipe_of(x):
    return x.recipe if is_quantized(x) else None


def grad_side_names(side: dict) -> frozenset:
    return frozenset(n for n, v in side.items() if isinstance(v, torch.Tensor) and v.requires_grad)


def params_need_grad(op_params) -> list:
    return [any(p.requires_grad for p in params.values()) for params in op_params]


def get_plan(ops, info: PlanInfo, cache: dict, fuse: bool):
    key = (
        registry_version(),
        backends_version(),
        fuse,
        fusion_enabled_by_env(),
        forced_backend(),
        env.plan_settings(),
        info,
        tuple(op.plan_signature() for op in ops),
    )
    plan = cache.get(key)
    if plan is None:
        check_side_value_experts(ops)
        # the two versions only grow: plans made under older ones can never be looked up again
        for stale in [made for made in cache if made[:2] != key[:2]]:
            del cache[stale]
        plan = cache[key] = make_plan(ops, info, fuse)
    return plan


def check_side_value_experts(ops) -> None:
    """Each side value an op produces spans as many experts as each of its consumers
    (`fusion.side_value_users`) expects (`BasicOp.side_value_experts`), and none is consumed after
    the op that ends it (`BasicOp.side_outputs_end`)."""
    for i, producer in enumerate(ops):
        for name, ender in producer.side_outputs_end.items():
            ends = side_value_users(ops, i, ender)
            late = [j for j in side_value_users(ops, i, name) if ends and j > ends[0]]
            if late:
                raise OpValueError(
                    f"{ops[late[0]].op_name} (op {late[0]}): side input '{name}' from {producer.op_name} (op {i}) "
                    f"describes rows that {ops[ends[0]].op_name} (op {ends[0]}) has already consumed; place this op "
                    f"between op {i} and op {ends[0]}")
        for name in producer.side_outputs:
            made = producer.side_value_experts(name)
            for j in side_value_users(ops, i, name) if made is not None else ():
                expected = ops[j].side_value_experts(name)
                if expected is not None and made != expected:
                    raise OpValueError(
                        f"{ops[j].op_name} (op {j}): side input '{name}' from {producer.op_name} (op {i}) spans "
                        f"{made} experts, this op has {expected}")


def side_input_names(ops) -> list:
    """The side values the caller passes (sorted): those an op consumes before any op produces them."""
    names, produced = set(), set()
    for op in ops:
        names.update(n for n in op.side_inputs if n not in produced)
        produced.update(op.side_outputs)
    return sorted(names)


def check_side_inputs(owner: str, ops, side: dict) -> None:
    consumed = set(side_input_names(ops))
    unknown = sorted(set(side) - consumed)
    if unknown:
        produced = [n for n in unknown if any(n in op.side_outputs for op in ops)]
        if produced:
            op = next(op for op in ops if produced[0] in op.side_outputs)
            raise OpValueError(f"{owner}: side input '{produced[0]}' is produced by {op.op_name} in this sequence; "
                             "do not pass it")
        raise OpValueError(
            f"{owner}: side input(s) {', '.join(map(repr, unknown))} not consumed by any op "
            f"(consumed: {', '.join(sorted(consumed)) or 'none'})"
        )
    available = {n for n, v in side.items() if v is not None}
    for i, op in enumerate(ops):
        for name in op.side_inputs:
            if name not in available and name not in op.optional_side_inputs:
                producer = next((p.op_name for p in ops[i + 1:] if name in p.side_outputs), None)
                hint = f" (produced by {producer}, which must come before it)" if producer else ""
                raise OpValueError(f"{op.op_name} (op {i}): missing side input '{name}'{hint}")
        available.update(op.side_outputs)


class SideValues:
    """The side values of one call as the ops see them: the caller's side inputs, then what the
    ops produce for the ops after them (``ctx.produced``: at bind time, e.g. a permute's routing,
    or in the forward, e.g. a router's probabilities).

    ``source``: name -> index of the op that produced the current value (absent: the caller's);
    ``grad_names``: names whose current value needs a gradient; ``memo``: binding state shared by
    the ops of one call (offsets computed once, which probabilities were already applied).
    """

    def __init__(self, side: dict, grad_names):
        self.values = {n: v for n, v in side.items() if v is not None}
        self.source: dict = {}
        self.grad_names = set(grad_names)
        self.memo: dict = {}

    def bind(self, ops, ctxs, start: int, stop: int, x) -> None:
        """Bind the side inputs of ops[start:stop] (a step about to run on ``x``)."""
        like = x
        for i in range(start, stop):
            op, ctx = ops[i], ctxs[i]
            ctx.side = op.bind_side_inputs(self.values, like, self.memo)
            ctx.side_sources = {n: self.source[n] for n in op.side_inputs if n in self.source}
            ctx.grad_names = ctx.grad_names | {n for n in op.side_inputs if n in self.grad_names}
            ctx.produced = dict(op.bound_side_outputs(ctx))
            self.publish(i, ctx)
            like = op.output_like(ctx, like)

    def for_chunk(self, chunk: int, chunks: int) -> "SideValues":
        """The side values as chunk ``chunk`` of a chunked segment sees them: the same values, a
        memo of its own (holding the chunk, and state shared by the chunks of this call)."""
        values = SideValues(self.values, self.grad_names)
        values.source = dict(self.source)
        values.memo = {"chunk": chunk, "chunks": chunks, "chunks shared": self.memo.setdefault("chunks shared", {})}
        return values

    def publish(self, i: int, ctx) -> None:
        """Make what op ``i`` produced visible to the ops after it."""
        for name, value in ctx.produced.items():
            self.values[name], self.source[name] = value, i
            if name in ctx.op.grad_side_outputs and (ctx.input_requires_grad or ctx.params_require_grad):
                self.grad_names.add(name)
            else:
                self.grad_names.discard(name)


class Run:
    """One call: the ops, their contexts and the plan; runs both passes.

    ``param_slots`` maps (op index, parameter name) to the position of that tensor among the
    autograd.Function's parameter inputs (a parameter shared by two ops has one slot).
    After the forward, the contexts hold a skeleton of what the backward needs (`saved.pack`);
    the tensors themselves live in the Function's saved tensors.
    """

    def __init__(self, ops, ctxs, plan, grad_side_names, param_slots, num_params, side=None):
        self.ops, self.ctxs, self.plan = ops, ctxs, plan
        self.grad_side_names = grad_side_names
        self.param_slots = param_slots
        self.num_params = num_params
        self.side = SideValues(side or {}, grad_side_names)

    def forward(self, x, steps=None):
        """Run the forward steps (default: the plan's) on ``x``; returns the output. Each step's
        ops are bound to the side values just before it runs."""
        steps = self.plan.forward if steps is None else steps
        index = 0
        while index < len(steps):
            step = steps[index]
            index += 1
            if self.plan.segment is not None and index - 1 == self.plan.segment_steps["forward"][0]:
                stop = self.plan.segment_steps["forward"][1]
                chunked = self.ctxs[step.start].chunked = ChunkedSegment(self, self.plan.segment)
                x = chunked.forward(self, steps[index - 1:stop], x)
                index = stop
                continue
            if step.start > 0:
                self.ctxs[step.start].input_recompute = self.ctxs[step.start - 1].recompute_output
            self.side.bind(self.ops, self.ctxs, step.start, step.stop, x)
            x = step.run(self.ops, self.ctxs, x, "forward")
            for i in range(step.start, step.stop):
                self.side.publish(i, self.ctxs[i])
        return x

    def contexts(self) -> list:
        """Every context of this call: the ops', then each chunk's of a chunked segment."""
        seg = self.plan.segment
        chunked = self.ctxs[seg.start].chunked if seg is not None else None
        if chunked is None:
            return list(self.ctxs)
        return [*self.ctxs, *(c[i] for c in chunked.contexts for i in range(seg.start, seg.stop))]

    def pack(self, tensors=None, index=None) -> list:
        """Replace the tensors the contexts keep by slots; return them (for save_for_backward).

        ``tensors``/``index`` (id -> slot) may come pre-filled: tensors found there keep their slot.
        """
        tensors, index = ([], {}) if tensors is None else (tensors, index)
        # views of the pre-filled tensors (the inputs) are kept as such: they reach the backward unchanged
        bases = storage_bases(tensors)
        self.side = SideValues({}, ())  # the forward's side values: only what the contexts saved lives on
        for ctx in self.contexts():
            ctx.saved = pack(ctx.saved, tensors, index, bases)
            ctx.side = pack(ctx.side, tensors, index, bases)
            ctx.params, ctx.produced = {}, {}
            ctx.recompute_output = ctx.input_recompute = None
        return tensors

    @staticmethod
    def _unpacked(ctx, saved_tensors, memo: dict = None):
        """A copy of ``ctx`` with its saved values rebuilt on ``saved_tensors`` (``memo``: `unpack`'s)."""
        ctx = copy.copy(ctx)
        ctx.saved = unpack(ctx.saved, saved_tensors, memo)
        ctx.side = unpack(ctx.side, saved_tensors, memo)
        ctx.produced_grads = {}
        return ctx

    def backward(self, dy, saved_tensors):
        """(dx, side-input grads, parameter grads) from the contexts rebuilt on ``saved_tensors``,
        under the settings the plan was made with (`env.settings_of_plan`)."""
        with env.settings_of_plan(self.plan.settings):
            return self._backward(dy, saved_tensors)

    def _backward(self, dy, saved_tensors):
        memo = {}
        ctxs = [self._unpacked(ctx, saved_tensors, memo) for ctx in self.ctxs]
        op_grads = [None] * len(self.ops)
        returned = [set() for _ in self.ops]  # per op: the names a step returned a gradient for
        steps, index = self.plan.backward, 0
        while index < len(steps):
            step = steps[index]
            index += 1
            seg = self.plan.segment
            if seg is not None and index - 1 == self.plan.segment_steps["backward"][0]:
                stop = self.plan.segment_steps["backward"][1]
                if not self.plan.info.needs_backward(seg.start, seg.stop):
                    dy, index = None, stop
                    continue
                chunked = ctxs[seg.start].chunked
                contexts = [[*ctxs[:seg.start], *(self._unpacked(chunk[i], saved_tensors, memo) for i in range(seg.start, seg.stop)),
                             *ctxs[seg.stop:]] for chunk in chunked.contexts]
                dy, grads = chunked.backward(self, steps[index - 1:stop], dy, contexts)
                index = stop
                step_start = seg.start
            else:
                if not self.plan.info.needs_backward(step.start, step.stop):
                    dy = None
                    continue
                dy, grads = step.run(self.ops, ctxs, dy, "backward")
                step_start = step.start
            op_grads[step_start : step_start + len(grads or ())] = grads or ()
            free_unread_grads_over_inputs(ctxs, dy, op_grads)
            for i, op_grad in enumerate(grads or (), step_start):
                returned[i].update(name for name, grad in (op_grad or {}).items() if grad is not None)
                for name, grad in list((op_grad or {}).items()):
                    producer = ctxs[i].side_sources.get(name)
                    if producer is not None and grad is not None:  # for the op that produced it
                        del op_grad[name]
                        earlier = ctxs[producer].produced_grads.get(name)
                        ctxs[producer].produced_grads[name] = grad if earlier is None else earlier + grad
        for grads in op_grads:  # the deferred ones, after every step, in op order
            for name, grad in (grads or {}).items():
                if isinstance(grad, DeferredGrad):
                    grads[name] = grad()
                    free_unread_grads_over_inputs(ctxs, dy, op_grads)
        side_grads = {name: None for name in self.grad_side_names}
        param_grads = [None] * self.num_params
        for i, grads in enumerate(op_grads):
            for name, grad in (grads or {}).items():
                if grad is None:
                    continue
                if name in side_grads:
                    side_grads[name] = grad if side_grads[name] is None else side_grads[name] + grad
                    continue
                slot = self.param_slots.get((i, name))
                if slot is None:
                    if name in self.ops[i].side_inputs:  # a side input needing none: as for a frozen parameter
                        continue
                    raise self._rule_error(i, f"a gradient named {name!r} for {{op}}, which has no such parameter or "
                                              "side input needing one")
                shape = self.ops[i].param_shapes.get(name)
                if shape is not None and tuple(grad.shape) != tuple(shape):
                    raise self._rule_error(i, f"a gradient of shape {tuple(grad.shape)} for parameter {name!r} of "
                                              f"{{op}}, which has shape {tuple(shape)}")
                param_grads[slot] = grad if param_grads[slot] is None else param_grads[slot] + grad
        side_returned = set().union(*returned)  # a side value's gradient may come from any of its users
        for i, ctx in enumerate(ctxs):
            for name in sorted(ctx.grad_names):
                is_param = (i, name) in self.param_slots
                if name not in (returned[i] if is_param else side_returned) and not self.ops[i].grad_kept_elsewhere(name):
                    raise self._rule_error(i, f"no gradient for {name!r} of {{op}}, which needs one")
        return dy, [side_grads[n] for n in self.grad_side_names], param_grads

    def _rule_error(self, i: int, what: str) -> FusionRuleValueError:
        """The error for what the backward step covering op ``i`` returned (``what``, its
        ``{op}`` naming the op): a gradient under a name neither a parameter the op read in this
        call nor a side input (a misspelled key), of a parameter's other shape, or none where one
        is needed."""
        step = next(s for s in self.plan.backward if s.start <= i < s.stop)
        return FusionRuleValueError(f"{step.label(self.ops)}: its backward returned "
                                    + what.format(op=f"{self.ops[i].op_name} (op {i})"))


def free_unread_grads_over_inputs(ctxs, dy, op_grads) -> None:
    """Free each data gradient written over a saved input (`OpContext.grad_over_input`) that the
    rest of the backward no longer reads: neither the next step's data gradient ``dy``, nor a
    deferred gradient in ``op_grads``, nor a produced value's gradient holds its storage."""
    pending = [ctx for ctx in ctxs if ctx.grad_over_input is not None]
    if not pending:  # most steps: nothing written over an input, nothing to look for
        return
    produced = [c.produced_grads for c in ctxs]
    for ctx in pending:
        if not still_read(ctx.grad_over_input, dy, op_grads, produced):
            free_grad_over_input(ctx, dy)


def still_read(grad: torch.Tensor, *holders) -> bool:
    """Whether ``grad``'s storage is held in ``holders`` (tensors, nested in tuples, lists, dicts
    and `DeferredGrad` operands; the steps still to run read only their dy and what the forward
    saved)."""
    ptr = grad.untyped_storage().data_ptr()

    def holds(value) -> bool:
        if isinstance(value, torch.Tensor):
            if is_quantized(value):  # a wrapper: its data, multipliers and source are its attributes
                return holds(list(vars(value).values()))
            return value.untyped_storage().data_ptr() == ptr
        if isinstance(value, (tuple, list)):
            return any(holds(v) for v in value)
        if isinstance(value, dict):
            return any(holds(v) for v in value.values())
        if isinstance(value, DeferredGrad):
            return holds(value.args) or holds(value.keywords)
        return False

    return holds(holders)


def free_grad_over_input(ctx: OpContext, dx) -> None:
    """Free the storage of ``ctx.grad_over_input`` (a data gradient written over the op's saved
    input, which autograd holds until the whole backward returns), unless the Sequential's own
    data gradient ``dx`` lives in it."""
    grad, ctx.grad_over_input = ctx.grad_over_input, None
    if grad is None:
        return
    storage = grad.untyped_storage()
    if isinstance(dx, torch.Tensor) and dx.untyped_storage().data_ptr() == storage.data_ptr():
        return
    storage.resize_(0)


class SequenceFunction(torch.autograd.Function):
    """Runs a whole plan; inputs: the run, x, side inputs needing grad, the parameters."""

    @staticmethod
    def forward(ctx, run: Run, x, *flat):
        y = run.forward(x)
        ctx.save_for_backward(*run.pack())
        ctx.run = run
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():  # create_graph=True: the kernels' gradients have no graph of their own
            names = ", ".join(dict.fromkeys(op.op_name for op in ctx.run.ops))
            raise NotImplementedError(
                f"te_fused_ops ({names}): double backward (create_graph=True, e.g. a gradient penalty) is not "
                "supported; the gradients these ops return are not differentiable"
            )
        if torch._C._functorch.is_legacy_batchedtensor(dy):  # batched gradients (is_grads_batched, jacobian)
            names = ", ".join(dict.fromkeys(op.op_name for op in ctx.run.ops))
            raise NotImplementedError(
                f"te_fused_ops ({names}): batched gradients (is_grads_batched=True, jacobian(vectorize=True)) "
                "are not supported; compute one gradient at a time"
            )
        dx, side_grads, param_grads = ctx.run.backward(dy, ctx.saved_tensors)
        if is_quantized(dx):
            dx = dx.dequantize()
        return (None, dx, *side_grads, *param_grads)


def autocast_eligible(t: torch.Tensor) -> bool:
    """What autocast casts: floating tensors other than float64 (and not quantized)."""
    return t.is_floating_point() and t.dtype != torch.float64 and not is_quantized(t)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a call computes in: autocast's for x's device where it is on, else x's (a meta
    tensor has no autocast to ask)."""
    if x.device.type != "meta" and torch.is_autocast_enabled(x.device.type) and autocast_eligible(x):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def prepare_run(ops, x, side: dict, op_params: list, cache: dict, fuse: bool, grad_on: bool):
    """The plan (cached in ``cache``) and the contexts of one call, outside autograd.

    ``op_params``: per op, name -> tensor; ``grad_on``: whether gradients are wanted (then the
    tensors' requires_grad say which). Returns (run, the distinct parameter tensors in slot order,
    whether any gradient is needed). The caller runs ``run.forward(x)``, keeps ``run.pack()``
    and later calls ``run.backward(dy, kept)``: this is what `SequenceFunction` does, and what
    an integration running inside another autograd.Function does itself.
    """
    side_grad = grad_side_names(side) if grad_on else frozenset()
    params_grad = params_need_grad(op_params)
    info = plan_info(ops, x.device, x.dtype, x.requires_grad, side_grad, params_grad, recipe_of(x), grad_on)
    plan = get_plan(ops, info, cache, fuse)

    ctxs, params, param_slots = [], [], {}
    slot_of = {}  # id(tensor) -> position in params
    for i, op in enumerate(ops):
        ctx = OpContext(op, i, info.input_requires_grad[i], info.params_require_grad[i])
        ctx.params = op_params[i]
        for name, param in ctx.params.items():
            if id(param) not in slot_of:
                slot_of[id(param)] = len(params)
                params.append(param)
            param_slots[(i, name)] = slot_of[id(param)]
        if grad_on:
            ctx.grad_names = frozenset(name for name, value in ctx.params.items() if value.requires_grad)
        ctxs.append(ctx)

    grad_needed = info.input_requires_grad[-1] or info.params_require_grad[-1] if ops else False
    side_names = sorted(side_grad)  # every side input is consumed (checked)
    return Run(ops, ctxs, plan, side_names, param_slots, len(params), side), params, grad_needed


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



