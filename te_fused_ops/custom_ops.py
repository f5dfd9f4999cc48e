"""torch.compile support: a call of a Sequential (or of a lone op) as two torch.library custom ops.

``te_fused_ops::sequential_forward(template, x, side, params) -> [y, *saved]`` and
``te_fused_ops::sequential_backward(template, dy, saved, grad_shapes) -> grads``, tied together by
``register_autograd``. ``template`` is the id of a `RunTemplate`: what is fixed for one owner and
one call signature (ops, plan, parameter positions, and after the first forward the skeleton of
what the ops save). Dynamo does not trace into the ops, so split values never reach a guard and
the CPU path may read offsets on the host. The fake forward runs each rule's reference implementation
on meta tensors; the fake backward allocates gradients shaped as the inputs.

Eager calls do not come here: they run `runner.SequenceFunction` directly (no dispatcher
round trip, and saved tensors that alias inputs need no copy).
"""

import dataclasses
import hashlib
import weakref
from typing import Optional

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from .context import OpContext, registered_owner
from .fusion import FusionRuleError
from .quantization import is_quantized
from .runner import Run, get_plan, plan_info, side_input_names
from .saved import slot_indices
from .splits import validation

_templates: "weakref.WeakValueDictionary[int, RunTemplate]" = weakref.WeakValueDictionary()
_made: dict = {}  # structure digest -> templates made with it in this process


def _new_template_id(ops, plan, key) -> int:
    """A template id that names its structure: a digest of the ops' plan signatures, the plan's
    steps and the call signature, and how many templates of that structure this process made
    before. Inductor's on-disk cache keys a compiled graph by its text, where the id is a constant:
    another process reaching the same id has the same structure, so a cached graph's saved-tensor
    shapes hold for it (a plain counter would let another model's graph be reused)."""
    text = repr((key, [op.plan_signature() for op in ops], [step.label(ops) for step in plan.forward + plan.backward]))
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:5], "big")
    made = _made[digest] = _made.get(digest, -1) + 1
    return digest << 20 | made % (1 << 20)


class RunTemplate:
    """What every compiled call of one owner with one call signature runs.

    ``side_names``: the side inputs the ops consume, sorted (their order in the custom op);
    ``param_slots``: (op index, name) -> position among the parameters;
    ``grad_positions``/``grad_meta``: positions among ``[x, *side, *params]`` that get a gradient,
    and its (dtype, dim); ``flags``: per op (input needs grad, params need grad, grad names);
    after the first forward: ``ctxs`` (the contexts, packed), ``saved_positions`` (positions among
    the ``num_tensors`` tensors ``[x, *side, *params, *outputs]`` that the backward reads),
    ``outputs_meta`` ((dtype, dim) of each output).
    """

    def __init__(self, ops, plan, key):
        _, dtype, x_requires_grad, x_dim, grad_on, params_key, side_key, _ = key
        self.id = _new_template_id(ops, plan, key)
        self.ops, self.plan = ops, plan
        self.side_names = side_input_names(ops)
        side = dict(zip(self.side_names, side_key))
        for i, op in enumerate(ops):
            reason = op.compile_unsupported_reason()
            if reason is not None:
                raise NotImplementedError(f"{op.op_name} (op {i}): {reason} is not supported under torch.compile")
            if op.output_recipe(None) is not None:
                raise NotImplementedError(
                    f"{op.op_name} (op {i}): quantized outputs are not supported under torch.compile yet; "
                    "run this module eagerly (torch.compiler.disable)"
                )
        self.grad_side_names = sorted(n for n, v in side.items() if grad_on and v is not None and v[1])
        inputs = [(dtype, x_requires_grad, x_dim), *side.values(), *(p[1:] for params in params_key for p in params)]
        self.grad_positions = [i for i, v in enumerate(inputs) if grad_on and v is not None and v[1]]
        self.grad_meta = [(inputs[i][0], inputs[i][2]) for i in self.grad_positions]
        self.param_slots = {}
        for i, params in enumerate(params_key):
            for name, *_ in params:
                self.param_slots[(i, name)] = len(self.param_slots)
        self.flags = [
            (
                plan.info.input_requires_grad[i],
                plan.info.params_require_grad[i],
                frozenset(name for name, _, rg, _ in params_key[i] if grad_on and rg),
            )
            for i, op in enumerate(ops)
        ]
        self.ctxs = self.skeleton = self.saved_positions = self.outputs_meta = self.num_tensors = None
        self.ctxs_from_fake = False

    def run(self, params: list, side: dict):
        """A `Run` with fresh contexts holding ``params``, on the side inputs ``side``."""
        ctxs = []
        for i, (op, (input_rg, params_rg, grad_names)) in enumerate(zip(self.ops, self.flags)):
            ctx = OpContext(op, i, input_rg, params_rg)
            ctx.grad_names = grad_names
            ctx.params = {name: params[slot] for (j, name), slot in self.param_slots.items() if j == i}
            ctxs.append(ctx)
        return Run(self.ops, ctxs, self.plan, self.grad_side_names, self.param_slots, len(self.param_slots), side)

    def forward(self, x, side_values: list, params: list, fake: bool) -> list:
        """``[y, *saved]`` of one call; ``fake``: shapes only (torch backends on meta tensors)."""
        inputs = [x, *side_values, *params]
        if not fake:
            run = self.run(params, dict(zip(self.side_names, side_values)))
            outputs = _unaliased([t.contiguous() for t in self._run_and_pack(run, inputs, None)], inputs)
            self._record(run, outputs, len(inputs), fake=False)
            return outputs
        with unset_fake_temporarily(), validation(False):  # real meta tensors: reading their values fails loudly
            meta: dict = {}
            inputs = [None if t is None else _meta(t, meta) for t in inputs]
            run = self.run(inputs[1 + len(side_values):], dict(zip(self.side_names, inputs[1:1 + len(side_values)])))
            try:
                outputs = self._run_and_pack(run, inputs, self.fake_steps())
            except FusionRuleError as error:
                raise type(error)(
                    f"{error} [under torch.compile, each rule's torch backend runs on meta tensors to learn "
                    "what the forward saves: it may not read tensor values (.tolist(), .item())]"
                ) from error
        outputs = [torch.empty(t.shape, dtype=t.dtype, device=x.device) for t in outputs]
        self._record(run, outputs, len(inputs), fake=True)
        return outputs

    def _run_and_pack(self, run, inputs: list, steps) -> list:
        """Run the forward on ``inputs[0]``, pack the contexts; ``[y, *saved tensors not in inputs]``."""
        y = run.forward(inputs[0], steps)
        if not isinstance(y, torch.Tensor) or is_quantized(y):
            raise TypeError(f"{self.ops[-1].op_name}: the output must be a plain tensor under torch.compile")
        tensors = [*inputs, y]
        index = {id(t): i for i, t in enumerate(inputs) if t is not None}
        index.setdefault(id(y), len(inputs))
        run.pack(tensors, index)
        return tensors[len(inputs) :]

    def fake_steps(self) -> list:
        """The forward steps, each rule on its reference implementation (they run on the meta device)."""
        for step in self.plan.forward:
            if step.rule is not None and step.rule.reference is None:
                raise FusionRuleError(
                    f"fusion rule '{step.rule.name}' has no reference implementation, which torch.compile needs: "
                    "its fake run executes each rule's reference on meta tensors to learn what it saves"
                )
        return [dataclasses.replace(step, implementation=step.rule.reference) if step.rule is not None else step
                for step in self.plan.forward]

    def _record(self, run, outputs, num_inputs: int, fake: bool) -> None:
        """Keep the first forward's packed contexts; later forwards must save the same structure
        (the functions of `Recompute`s aside). The first real forward's contexts replace a fake
        run's: the backward then recomputes values with the backend's functions, not the rules'
        references the fake run used."""
        outputs_meta = [(t.dtype, t.dim()) for t in outputs]
        skeleton = [(c.saved, c.side) for c in run.contexts()]
        if self.ctxs is None:
            self.ctxs, self.outputs_meta, self.skeleton = run.ctxs, outputs_meta, skeleton
            self.saved_positions = sorted(slot_indices(skeleton))
            self.num_tensors = num_inputs + len(outputs)
            self.ctxs_from_fake = fake
        elif outputs_meta != self.outputs_meta or skeleton != self.skeleton:
            rules = ", ".join(f"'{s.rule.name}' ({s.backend})" for s in self.plan.forward if s.rule is not None)
            raise RuntimeError(
                f"te_fused_ops under torch.compile: this call saved other values for the backward than "
                f"the first (fake) run of the same plan (forward rules: {rules or 'none'}); each rule's "
                "backends must save the same structure, dtypes and ranks"
            )
        elif self.ctxs_from_fake and not fake:
            self.ctxs, self.ctxs_from_fake = run.ctxs, False

    def backward(self, dy, saved: list, grad_shapes: list) -> list:
        """Gradients for ``grad_positions`` (zeros where the ops returned none)."""
        tensors = [None] * self.num_tensors
        for position, tensor in zip(self.saved_positions, saved):
            tensors[position] = tensor
        run = Run(self.ops, self.ctxs, self.plan, self.grad_side_names, self.param_slots, len(self.param_slots))
        dx, side_grads, param_grads = run.backward(dy, tensors)
        if is_quantized(dx):
            dx = dx.dequantize()
        num_side = len(self.side_names)
        by_position = {0: dx, **{1 + num_side + k: g for k, g in enumerate(param_grads)}}
        by_position.update({1 + self.side_names.index(n): g for n, g in zip(self.grad_side_names, side_grads)})
        grads = []
        for position, shape, (dtype, _) in zip(self.grad_positions, self.split_shapes(grad_shapes), self.grad_meta):
            grad = by_position.get(position)
            grads.append(dy.new_zeros(shape, dtype=dtype) if grad is None else grad.to(dtype).contiguous())
        return _unaliased(grads, [dy, *saved])

    def split_shapes(self, flat: list) -> list:
        """The gradient shapes, one per ``grad_positions``, from their flattened sizes."""
        shapes, start = [], 0
        for _, dim in self.grad_meta:
            shapes.append(flat[start : start + dim])
            start += dim
        return shapes


def _meta(t: torch.Tensor, memo: dict) -> torch.Tensor:
    """``t`` as an empty meta tensor (one per source tensor, so identities survive)."""
    if id(t) not in memo:
        memo[id(t)] = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    return memo[id(t)]


def _unaliased(outputs: list, inputs: list) -> list:
    """``outputs`` with each tensor sharing storage with an input or an earlier output cloned
    (a custom op's outputs may alias nothing)."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t is not None and t.untyped_storage().nbytes()}
    result = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        result.append(t)
    return result


@torch.library.custom_op("te_fused_ops::sequential_forward", mutates_args=())
def sequential_forward(
    template: int, x: torch.Tensor, side: list[Optional[torch.Tensor]], params: list[torch.Tensor]
) -> list[torch.Tensor]:
    """One call of a template's ops: ``[y, *tensors saved for the backward]``."""
    return _templates[template].forward(x, side, params, fake=False)


@sequential_forward.register_fake
def _(template, x, side, params):
    return _templates[template].forward(x, side, params, fake=True)


@torch.library.custom_op("te_fused_ops::sequential_backward", mutates_args=())
def sequential_backward(
    template: int, dy: torch.Tensor, saved: list[torch.Tensor], grad_shapes: list[int]
) -> list[torch.Tensor]:
    """The gradients of a template's call for its inputs that require grad."""
    return _templates[template].backward(dy, saved, grad_shapes)


@sequential_backward.register_fake
def _(template, dy, saved, grad_shapes):
    t = _templates[template]
    return [dy.new_empty(shape, dtype=dtype) for shape, (dtype, _) in zip(t.split_shapes(grad_shapes), t.grad_meta)]


def _setup_context(ctx, inputs, output):
    template, x, side, params = inputs
    t = _templates[template]
    tensors = [x, *side, *params, *output]
    ctx.save_for_backward(*(tensors[i] for i in t.saved_positions))
    ctx.template = template
    ctx.grad_shapes = [size for i in t.grad_positions for size in tensors[i].shape]
    ctx.num_side, ctx.num_params = len(side), len(params)


def _backward(ctx, grads):
    t = _templates[ctx.template]
    computed = sequential_backward(ctx.template, grads[0], list(ctx.saved_tensors), ctx.grad_shapes)
    by_position = dict(zip(t.grad_positions, computed))
    side_grads = [by_position.get(1 + k) for k in range(ctx.num_side)]
    param_grads = [by_position.get(1 + ctx.num_side + k) for k in range(ctx.num_params)]
    return None, by_position.get(0), side_grads, param_grads


torch.library.register_autograd("te_fused_ops::sequential_forward", _backward, setup_context=_setup_context)


def _template_id(owner_id: int, key) -> int:
    """Id of the template for the owner registered as ``owner_id`` called with signature ``key``
    (made and cached on first use; runs at trace time, outside the graph)."""
    owner = registered_owner(owner_id)
    ops, fuse = (list(owner), owner.fuse) if hasattr(owner, "fuse") else ([owner], True)
    device, dtype, x_requires_grad, _, grad_on, params_key, side_key, _ = key
    side_names = side_input_names(ops)
    side_grad = frozenset(n for n, v in zip(side_names, side_key) if v is not None and v[1])
    params_grad = [any(rg for _, _, rg, _ in params) for params in params_key]
    with torch.set_grad_enabled(grad_on):
        info = plan_info(ops, device, dtype, x_requires_grad, side_grad, params_grad)
    plan = get_plan(ops, info, owner._plans, fuse)
    template = plan.templates.get(key)
    if template is None:
        template = plan.templates[key] = RunTemplate(ops, plan, key)
        _templates[template.id] = template
    return template.id


# What torch._dynamo.assume_constant_result(fn) sets; set directly because importing dynamo
# slows every eager autograd call by ~5 us (measured on the CPU), and eager users need no dynamo.
_template_id._dynamo_marked_constant = True


def _guarded_signature(op) -> tuple:
    """The plain values (numbers, strings, None, classes) of ``op.plan_signature()``: what dynamo
    can hand to `_template_id` as constants. The rest (a `Quantize`'s recipe) belongs to ops that
    refuse compilation anyway."""
    return tuple(v for v in op.plan_signature() if v is None or isinstance(v, (bool, int, float, str, type)))


def compiled_call(owner, ops, x, side: dict, op_params: list):
    """``ops`` on ``x`` as one custom op (what dynamo traces; side inputs and names already checked)."""
    if is_quantized(x):
        raise TypeError(
            f"{type(owner).__name__}: argument 'x' is a quantized tensor, not supported under torch.compile"
        )
    side_names = side_input_names(ops)
    side_values = [side.get(n) for n in side_names]
    for name, value in zip(side_names, side_values):
        if value is not None and not isinstance(value, torch.Tensor):
            op = next(op for op in ops if name in op.side_inputs)
            raise TypeError(f"{op.op_name}: argument '{name}' must be a torch.Tensor, got {type(value).__name__}")
    key = (
        x.device,
        x.dtype,
        x.requires_grad,
        x.dim(),
        torch.is_grad_enabled(),
        tuple(tuple((n, p.dtype, p.requires_grad, p.dim()) for n, p in params.items()) for params in op_params),
        tuple(None if v is None else (v.dtype, v.requires_grad, v.dim()) for v in side_values),
        # read here, in traced code, so that dynamo guards on the ops' settings: a setting that
        # changes the plan (a router's ``normalize``) recompiles instead of reusing a template
        tuple(_guarded_signature(op) for op in ops),
    )
    template = _template_id(owner._owner_id, key)
    params = [p for params in op_params for p in params.values()]
    return sequential_forward(template, x, side_values, params)[0]
