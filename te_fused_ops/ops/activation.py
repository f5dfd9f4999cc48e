"""Activations: SwiGLU, GeGLU, SReLU, ClampedSwiGLU (GPT-OSS), ScaledSwiGLU (router probs).

GLU convention (TE's): gate = the first half of the last dim, up = the second half;
``y = act(gate) * up`` has half the last dim. Math runs in float32 and rounds once to the
input dtype (float64 stays float64); gradients likewise. On CUDA the math of each op runs as
one ``torch.compile``d elementwise kernel (eager on the CPU, with TE_FUSED_OPS_COMPILE=0, or
where compilation fails): the fastest unfused activation, also for the fused rules' torch
backends.
"""

import math
import warnings

import torch

from .. import env
from ..errors import OpTypeError, OpValueError, bool_argument, real_argument
from ..routing import ExpertParallelRouting, rows_to_slots, slots_to_rows
from .base import BasicOp, OpContext, Recompute, is_quantized

_GELU_K = math.sqrt(2.0 / math.pi)
_GELU_C = 0.044715


def _silu_and_grad(g: torch.Tensor):
    s = torch.sigmoid(g)
    return g * s, s * (1 + g * (1 - s))


def _gelu_tanh_and_grad(g: torch.Tensor):
    t = torch.tanh(_GELU_K * (g + _GELU_C * g**3))
    value = 0.5 * g * (1 + t)
    grad = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _GELU_K * (1 + 3 * _GELU_C * g * g)
    return value, grad


_compiled: dict = {}  # (op class, method name) -> compiled function, or None after a failure


def _run_math(op, name: str, *args):
    """``type(op).<name>(op, *args)``, compiled on CUDA (one kernel per op class and config)."""
    method = getattr(type(op), name)
    if args[0].device.type != "cuda" or not env.read("TE_FUSED_OPS_COMPILE", op.op_name):
        return method(op, *args)
    key = (type(op), name)
    if key not in _compiled:
        _compiled[key] = torch.compile(method)
    compiled = _compiled[key]
    if compiled is not None:
        try:
            return compiled(op, *args)
        except Exception as error:  # no triton / inductor failure: eager from now on
            warnings.warn(f"{op.op_name}: torch.compile of the activation math failed ({error}); running eager")
            _compiled[key] = None
    return method(op, *args)


_MATH_METHODS = ("act", "act_grad", "gate_fn", "forward_math", "backward_math", "compute", "input_grad")


def _upcast(t: torch.Tensor) -> torch.Tensor:
    """The tensor in the math precision: float32, or wider when it already is."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


class Activation(BasicOp):
    """Base of the activation ops. Subclasses define `act` and `act_grad` on float32 tensors.

    ``kernel_name`` names the epilogue of the fused GEMM kernels that computes it.
    ``recompute_output`` (default True): where a fused step made the output (GroupedLinear +
    activation), the next GroupedLinear's weight gradient gets it again from the saved
    pre-activation (the dActivation kernel writes it beside d_pre: nothing more is saved);
    False keeps the output for the backward (one (M, I) tensor more saved per layer) and the
    dActivation writes only d_pre (fewer bytes where that kernel is bound by memory).
    """

    glu = False
    kernel_name = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # a subclass with math of its own (a SwiGLU with another gate) is not its parent's kernel
        if "kernel_name" not in cls.__dict__ and any(name in cls.__dict__ for name in _MATH_METHODS):
            cls.kernel_name = None

    def __init__(self, recompute_output: bool = True):
        super().__init__()
        self.recompute_output = bool_argument(self.op_name, "recompute_output", recompute_output)

    def extra_repr(self) -> str:
        return "" if self.recompute_output else "recompute_output=False"

    def plan_signature(self) -> tuple:
        return (type(self), self.recompute_output)  # what the backward is given: a plan (and compiled template) apart

    def act(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def act_grad(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def check_input(self, x) -> None:
        if not isinstance(x, torch.Tensor):
            raise OpTypeError(f"{self.op_name}: argument 'x' must be a torch.Tensor, got {type(x).__name__}")
        if not x.is_floating_point():
            raise OpTypeError(f"{self.op_name}: argument 'x' must be a floating-point tensor, got {x.dtype}")
        if x.dim() == 0:
            raise OpValueError(f"{self.op_name}: argument 'x' must have at least one dimension")
        if self.glu and x.shape[-1] % 2:
            raise OpValueError(
                f"{self.op_name}: argument 'x' last dimension {x.shape[-1]} is odd; a GLU needs [gate; up] halves"
            )

    def compute(self, side: dict, x: torch.Tensor) -> torch.Tensor:
        """Forward value in x's dtype; ``side`` is the op's bound side inputs (ctx.side)."""
        return _run_math(self, "forward_math", x)

    def forward_math(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(_upcast(x)).to(x.dtype)

    def backward_math(self, x: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
        return self.act_grad(_upcast(x), _upcast(dy)).to(x.dtype)

    def keep_for_backward(self, ctx: OpContext, pre: torch.Tensor, output_recomputable: bool = False) -> None:
        """Save what op_backward needs: the pre-activation ``pre`` (lazily where its producer can
        recompute it). ``output_recomputable``: the consumer of this op's output may recompute it
        from the saved ``pre`` instead of keeping it (a fused forward that keeps no output)."""
        if ctx.input_requires_grad or ctx.params_require_grad:
            ctx.save_input(pre)
            if output_recomputable:
                ctx.recompute_output = Recompute(self.compute, ctx.side, ctx.saved.input)

    def op_forward(self, ctx: OpContext, x) -> torch.Tensor:
        if is_quantized(x):
            x = x.dequantize()
        self.check_input(x)
        self.keep_for_backward(ctx, x)
        return self.compute(ctx.side, x)

    def input_grad(self, ctx: OpContext, pre: torch.Tensor, dy: torch.Tensor):
        """(dx in pre's dtype, grads dict) from the saved pre-activation and the output gradient."""
        return _run_math(self, "backward_math", pre, dy), {}

    def op_backward(self, ctx: OpContext, dy):
        if not ctx.input_requires_grad and not ctx.params_require_grad:
            return None, {}
        dx, grads = self.input_grad(ctx, ctx.load_input(), dy)
        return (dx if ctx.input_requires_grad else None), grads


class _GLU(Activation):
    glu = True

    def gate_fn(self, gate: torch.Tensor):
        """(act(gate), d act / d gate), float32."""
        raise NotImplementedError

    def act(self, x):
        gate, up = x.chunk(2, dim=-1)
        return self.gate_fn(gate)[0] * up

    def act_grad(self, x, dy):
        gate, up = x.chunk(2, dim=-1)
        value, grad = self.gate_fn(gate)
        return torch.cat([dy * up * grad, dy * value], dim=-1)


class SwiGLU(_GLU):
    """``silu(gate) * up``."""

    kernel_name = "swiglu"

    def gate_fn(self, gate):
        return _silu_and_grad(gate)


class GeGLU(_GLU):
    """``gelu(gate) * up``, gelu with the tanh approximation (as TE)."""

    kernel_name = "geglu"

    def gate_fn(self, gate):
        return _gelu_tanh_and_grad(gate)


class SReLU(Activation):
    """Squared ReLU: ``relu(x) ** 2`` (not gated; keeps the last dim)."""

    kernel_name = "srelu"

    def act(self, x):
        return torch.relu(x) ** 2

    def act_grad(self, x, dy):
        return dy * 2 * torch.relu(x)


class ClampedSwiGLU(_GLU):
    """GPT-OSS SwiGLU: ``g * sigmoid(alpha * g) * (u + 1)`` with ``g = min(gate, limit)``,
    ``u = clamp(up, -limit, limit)``; the clamps pass gradient inside their bounds (inclusive)."""

    kernel_name = "clamped_swiglu"

    def __init__(self, limit: float = 7.0, alpha: float = 1.702, recompute_output: bool = True):
        super().__init__(recompute_output)
        limit, alpha = real_argument("ClampedSwiGLU", "limit", limit), real_argument("ClampedSwiGLU", "alpha", alpha)
        if not limit > 0:
            raise OpValueError(f"ClampedSwiGLU: argument 'limit' must be positive, got {limit!r}")
        if not math.isfinite(alpha):
            raise OpValueError(f"ClampedSwiGLU: argument 'alpha' must be finite, got {alpha!r}")
        self.limit, self.alpha = float(limit), float(alpha)

    def extra_repr(self) -> str:
        return ", ".join(filter(None, (f"limit={self.limit}, alpha={self.alpha}", super().extra_repr())))

    def plan_signature(self) -> tuple:
        return (ClampedSwiGLU, self.limit, self.alpha, self.recompute_output)

    def act(self, x):
        gate, up = x.chunk(2, dim=-1)
        g = gate.clamp(max=self.limit)
        return g * torch.sigmoid(self.alpha * g) * (up.clamp(-self.limit, self.limit) + 1)

    def act_grad(self, x, dy):
        gate, up = x.chunk(2, dim=-1)
        g = gate.clamp(max=self.limit)
        u = up.clamp(-self.limit, self.limit)
        s = torch.sigmoid(self.alpha * g)
        glu = g * s
        dgate = dy * (u + 1) * (s + self.alpha * glu * (1 - s)) * (gate <= self.limit)
        dup = dy * glu * ((up >= -self.limit) & (up <= self.limit))
        return torch.cat([dgate, dup], dim=-1)


class ScaledSwiGLU(SwiGLU):
    """``silu(gate) * up * probs[row]``: SwiGLU times a per-row scale (router probability).

    x: (M, 2I). Side input ``probs``: (M,) floating tensor on x's device, one per row; after a
    `Permute`, the router's (T, k) per-slot probabilities, which it takes to the rows (in float32)
    through the permute's ``routing`` (a later `Unpermute` then sums without weighting). Its
    gradient is returned too, in the dtype and shape of ``probs``. A bias of the next
    GroupedLinear is not scaled: for ``sum_slots p (W2 h + b2)`` use `SwiGLU` and a weighted `Unpermute`.
    """

    kernel_name = "scaled_swiglu"
    side_inputs = ("probs",)

    def bind_side_inputs(self, side: dict, x: torch.Tensor, memo: dict) -> dict:
        if x.dim() != 2:  # a probability per row: rows are x's first dim
            raise OpValueError(f"ScaledSwiGLU: argument 'x' must be 2-D (rows, 2 I), got shape {tuple(x.shape)}")
        probs = side["probs"]
        if not isinstance(probs, torch.Tensor):
            raise OpTypeError(f"ScaledSwiGLU: argument 'probs' must be a torch.Tensor, got {type(probs).__name__}")
        if not probs.is_floating_point():
            raise OpTypeError(f"ScaledSwiGLU: argument 'probs' must be floating point, got {probs.dtype}")
        if probs.device != x.device:
            raise OpValueError(f"ScaledSwiGLU: argument 'probs' is on {probs.device} but the input is on {x.device}")
        routing = side.get("routing")
        if isinstance(routing, ExpertParallelRouting) and probs.dim() == 2:
            raise OpValueError("ScaledSwiGLU: the rows of an expert-parallel Permute (group=) came from other "
                               "ranks; pass the tokens' 'probs' to Unpermute(group=...) instead")
        if routing is not None and probs.dim() == 2:
            if probs.shape != routing.slot_rows.shape or x.shape[0] != routing.row_slots.shape[0]:
                raise OpValueError(
                    f"ScaledSwiGLU: argument 'probs' must have the shape of the permute's 'indices' "
                    f"{tuple(routing.slot_rows.shape)}, got {tuple(probs.shape)}"
                )
            memo["probs_applied"] = True
            return {"probs": slots_to_rows(probs, routing), "routing": routing, "slot_probs_dtype": probs.dtype}
        if probs.dim() != 1 or probs.shape[0] != x.shape[0]:
            after_permute = "" if routing is None else (
                f" or, as the tokens' probabilities, the shape of the permute's 'indices' {tuple(routing.slot_rows.shape)}")
            raise OpValueError(
                f"ScaledSwiGLU: argument 'probs' must have shape ({x.shape[0]},) (one per row){after_permute}, "
                f"got {tuple(probs.shape)}"
            )
        return {"probs": probs}

    def compute(self, side: dict, x):
        return _run_math(self, "scaled_forward_math", x, side["probs"])

    def scaled_forward_math(self, x, probs):
        return (self.act(_upcast(x)) * _upcast(probs).unsqueeze(-1)).to(x.dtype)

    def scaled_backward_math(self, pre, dy, probs):
        """(d pre in pre's dtype, d probs in probs' dtype)."""
        pre_math, dy_math = _upcast(pre), _upcast(dy)
        dx = self.act_grad(pre_math, dy_math * _upcast(probs).unsqueeze(-1)).to(pre.dtype)
        return dx, (dy_math * self.act(pre_math)).sum(-1).to(probs.dtype)

    @staticmethod
    def probs_grads(ctx: OpContext, row_grad: torch.Tensor) -> dict:
        """``{"probs": gradient}`` from the per-row gradient (M,) (or (P, M) float32 partial sums
        of it, as a kernel's column tiles leave it), in the shape and dtype of the side input (per
        slot after a permute); empty when probs need none."""
        if not ctx.needs_grad("probs"):
            return {}
        routing = ctx.side.get("routing")
        if routing is not None:
            return {"probs": rows_to_slots(row_grad, routing, ctx.side["slot_probs_dtype"])}
        return {"probs": (row_grad if row_grad.dim() == 1 else row_grad.sum(0)).to(ctx.side["probs"].dtype)}

    def input_grad(self, ctx: OpContext, pre, dy):
        dx, dprobs = _run_math(self, "scaled_backward_math", pre, dy, ctx.side["probs"].detach())
        return dx, self.probs_grads(ctx, dprobs)
