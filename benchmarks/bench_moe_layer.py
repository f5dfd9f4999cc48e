"""The whole MoE layer's training step on Hopper: dispatch, expert MLP, combine, forward + backward.

The layer: dispatch (tokens to expert order, each token once per chosen expert) -> FC1
(GroupedLinear E, H -> 2I) -> SwiGLU -> FC2 (GroupedLinear E, I -> H) -> combine (back to token
order, each token's k slot outputs summed, weighted by its router probs). bf16 throughout: x (T, H)
and the router probs (T, k) are bf16 leaves that require grad, dy (T, H) random; each step sets
every gradient to None, runs the forward and the backward.

Routing (`skewed_topk`, seed 0, on the CPU then copied): expert shares p_e ~ U(0,1)^2, the same
skew as `common.skewed_splits(seed=0)`; each token's router logits are log p_e + Gumbel(0, 1)
noise, its `indices` (T, k) int64 the top-k of them: k distinct experts sampled without
replacement with probabilities proportional to p (the Gumbel-top-k trick); its `probs` (T, k) the
softmax over the k chosen logits in float32, rounded to bf16 (the layer's dtype, kept bf16).

Contenders (one process, the same weights and inputs: each contender uses the same Parameter
objects, gradients None before every step):
  a          plain torch, written well: permute with a stable argsort of the expert ids,
             x.index_select whose backward is a slot sum compiled per shape (dx[t] = sum_j
             dx_perm[rows[t, j]]: a gather, where autograd's index_select backward is an
             index_add with atomics), per-expert counts by a sync-free scatter_add_, int32
             cumsum offsets;
             the expert MLP as `bench_train_step.ReferenceMLP` (one autograd.Function, six
             torch._grouped_mm, SwiGLU and dSwiGLU compiled per shape); the combine a gather
             (one autograd.Function compiled per shape, forward and backward): rows = the inverse
             permutation (T, k), out = sum_j probs[t, j] * y_perm[rows[t, j]]; its backward
             gathers too (d y_perm = probs * dy[token of the row]; d probs = <dy, y_perm[rows]>),
             where autograd's own backward of y_perm[rows] would be an index_put with
             accumulate (atomics, compiled or not)
  b          this library's expert Sequential(GroupedLinear, ScaledSwiGLU, GroupedLinear) with
             the torch permute of (a) around it (eager) and probs_perm = probs.flatten()[order],
             the combine the plain gather-sum y_perm[rows].sum(1) (eager, autograd): what a user
             of the library writes
  c          the fused layer: Sequential(Permute(E), GroupedLinear, ScaledSwiGLU, GroupedLinear,
             Unpermute())(x, indices=indices, probs=probs)
  c-combine  the same with SwiGLU: Unpermute applies the probs
  c-keep-act the fused layer with ScaledSwiGLU(recompute_output=False): the activation's output
             kept for FC2's weight gradient, the dActivation writing only d_pre
With ``--recipe fp8_blockwise`` (or another recipe name) two more, and no router rows:
  c-fp8      Sequential(Permute(E), Quantize(recipe), GroupedLinear, ScaledSwiGLU, Quantize(recipe),
             Transpose(), GroupedLinear, Unpermute()): both GEMMs in FP8, the weights cast every step
  c-fp8-4mb  the same on its own copy of the weights under `cast_weights_once_per_step`: timed
             as one optimizer step of 4 micro-batches (the first casts the weights, the other
             three reuse the copies, the optimizer step's drop ends it) and reported per
             micro-batch: the average micro-batch of the gradient-accumulation regime
  c-fp8w16, c-fp8w16-4mb  (fp8_blockwise) the same two with Float8BlockScaling(
             high_precision_wgrad=True): FP8 forward and data gradients, 16-bit weight gradients
  and a "vs c" column (the bf16 fused layer's ms / this ms). The FP8 contenders are checked
  against (a) with TOL_FP8 (their relative error against bf16 is the printed check).
With ``--gather-rows wgrad,1`` (settings of TE_FUSED_OPS_GATHER_ROWS) one more per setting:
  c-rows-<setting>  (c) whose forward runs with the variable set to it (its backward follows
             that forward's plan): where the layer reads rows by index, in one process with (c)
(c) runs where te_fused_ops has Permute, Unpermute and TopKRouter; else a printed line skips it.
Router rows: the step with the router in it, x (T, H) -> router -> layer, the router weight Wr
(E, H) bf16 (randn / sqrt(H), seed 0; its routing is what a random router picks, near uniform,
not the skewed one). a+router / b+router: logits = (x @ Wr.T).float(), softmax, top-k,
renormalized, probs to bf16, then (a) / (b); c+router: Sequential(TopKRouter(H, E, k,
score="softmax", normalize=True), Permute(E), ...)(x) (its probs float32), its router weight a copy
of Wr. No aux loss in the step. The router rows route differently from the layer rows: compare
them with each other.

Before timing, each contender's output and gradients (dx, d probs or d Wr, dW1, dW2) are compared
with (a)'s (relative Frobenius error, printed); one above TOL is marked "mismatch" and not timed
(a router contender is also compared on its chosen experts). Per shape and contender: step ms
(`common.sustained_ms`: per-call median at the clock a long run settles at, L2 flushed; the median
over `--rounds` passes of `common.rotated_medians`), TFLOPS (step = 3 x forward FLOPs, forward
2*T*k*H*2I + 2*T*k*I*H, plus 2*T*H*E for the router rows), (a) ms / ms and (b) ms / ms, peak
memory of one step above what was allocated before it (`common.extra_peak_mib`: the parameter
gradients are in it; a -4mb contender's optimizer step, whose first micro-batch makes the weight
copies), and the activations saved for the backward (`saved_activation_bytes`:
saved_tensors_hooks over one forward, each storage once, parameters and the inputs x / probs
excluded; for (c) also `te_fused_ops.runner.saved_tensor_bytes`, which counts the inputs, beside
the hooks' count with the inputs). Writes benchmarks/results/moe_layer_<device>.json/.md (--out
DIR: there instead; --smoke: the git-ignored benchmarks/results/runs/moe_layer_smoke_<device>) and
prints the table last. The model and contender builders run on the CPU too (``compiled=False``):
tests/test_bench.py checks (a), (b) and, where its ops import, (c) there on the smoke shape.

    python benchmarks/bench_moe_layer.py [--shapes qwen3-30b-a3b,...] [--rounds N] [--out DIR]
    python benchmarks/bench_moe_layer.py --smoke      # T 64, k 2, E 4, H 64, I 64: seconds
    python benchmarks/bench_moe_layer.py --recipe fp8_blockwise   # + the FP8 layer, two regimes
    python benchmarks/bench_moe_layer.py --profile a,c   # + where each one's step goes (kernels, host)
    python benchmarks/bench_moe_layer.py --memory-trace c   # + what is live at the step's peak
    python benchmarks/bench_moe_layer.py --gather-rows wgrad,1   # + the layer under those row settings
"""

import argparse
import functools
import os
from dataclasses import dataclass

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from common import (
    accumulation_step,
    clock_and_power,
    compile_per_shape,
    device_tag,
    extra_peak_mib,
    gpu_us_per_kernel,
    host_us_per_call,
    kernel_timeline,
    live_at_peak,
    per_micro_batch,
    print_timeline,
    rotated_medians,
    slot_terms_sum,
    sustained_ms,
    write_results,
)

import copy

import te_fused_ops
from te_fused_ops import GroupedLinear, Quantize, ScaledSwiGLU, Sequential, SwiGLU, Transpose
from te_fused_ops.quantization import Float8BlockScaling, get_recipe

SHAPES = {  # name: (T tokens, k experts per token, E experts, H hidden, I expert width)
    "qwen3-30b-a3b": (8192, 8, 128, 2048, 768),
    "dsv3-ep8": (4096, 8, 32, 7168, 2048),
    "mixtral-8x7b": (16384, 2, 8, 4096, 14336),
    "gptoss-120b-ep4": (8192, 4, 32, 2880, 2880),  # SwiGLU here too (not its clamped one), for comparability
}
SMOKE_SHAPES = {"smoke": (64, 2, 4, 64, 64)}
TOL = 1e-2  # largest relative Frobenius error against (a) of a contender that is timed
TOL_FP8 = 0.1  # the same for the FP8 contenders (E4M3 operands: about 6-7% from bf16)
MICRO_BATCHES = 4  # c-fp8-4mb: forwards per optimizer step
ROUTING = ("skewed top-k, seed 0: expert shares p_e ~ U(0,1)^2; per token the top-k of log p_e + Gumbel(0,1) "
           "(k distinct experts sampled without replacement, proportional to p); probs = softmax of the k chosen "
           "logits in float32, rounded to bf16")
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def skewed_topk(t: int, k: int, e: int, seed: int = 0):
    """(indices (t, k) int64, probs (t, k) float32) on the CPU: k distinct experts per token drawn
    without replacement with probabilities proportional to p_e ~ U(0,1)^2 (`common.skewed_splits`'s
    shares), as the top-k of logits log p_e + Gumbel noise; probs the softmax of the chosen logits."""
    gen = torch.Generator().manual_seed(seed)
    share = (torch.rand(e, generator=gen) ** 2).clamp_min(1e-12)
    uniform = torch.rand(t, e, generator=gen, dtype=torch.float64).clamp(1e-30, 1 - 1e-16)
    logits = share.double().log() - torch.log(-torch.log(uniform))
    top, indices = logits.topk(k, dim=-1)
    return indices, torch.softmax(top, dim=-1).float()


@dataclass
class Problem:
    name: str
    t: int
    k: int
    e: int
    h: int
    i: int
    fc1: GroupedLinear
    fc2: GroupedLinear
    x: torch.Tensor        # (T, H) bf16 leaf
    indices: torch.Tensor  # (T, k) int64
    probs: torch.Tensor    # (T, k) bf16 leaf
    dy: torch.Tensor       # (T, H) bf16
    wr: torch.Tensor       # (E, H) bf16 leaf, the router rows' weight

    def layer_flops(self) -> int:
        """Forward FLOPs of the expert MLP: FC1 2*T*k*H*2I + FC2 2*T*k*I*H."""
        rows = self.t * self.k
        return 2 * rows * self.h * 2 * self.i + 2 * rows * self.i * self.h

    def router_flops(self) -> int:
        return 2 * self.t * self.h * self.e


def make_problem(name: str, shape, device="cuda") -> Problem:
    t, k, e, h, i = shape
    indices, probs = skewed_topk(t, k, e)
    torch.manual_seed(0)
    kw = {"dtype": torch.bfloat16, "device": device}
    fc1, fc2 = GroupedLinear(e, h, 2 * i, **kw), GroupedLinear(e, i, h, **kw)
    x = torch.randn(t, h, **kw).requires_grad_()
    dy = torch.randn(t, h, **kw)
    wr = (torch.randn(e, h, device=device) / h**0.5).to(torch.bfloat16).requires_grad_()
    return Problem(name, t, k, e, h, i, fc1, fc2, x, indices.to(device),
                   probs.to(device, torch.bfloat16).requires_grad_(), dy, wr)


# --- (a): plain torch ----------------------------------------------------------------------------

def swiglu_math(pre):
    gate, up = pre.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(pre.dtype)


def dswiglu_math(pre, d_act):  # as bench_train_step's dswiglu
    gate, up = pre.float().chunk(2, dim=-1)
    s = torch.sigmoid(gate)
    d = d_act.float()
    return torch.cat([d * up * s * (1 + gate * (1 - s)), d * gate * s], dim=-1).to(pre.dtype)


def combine_math(y_perm, probs, rows):
    """(T, H): sum_j probs[t, j] * y_perm[rows[t, j]] in float32, rounded once."""
    p = probs.float()
    return slot_terms_sum(y_perm[rows[:, j]].float() * p[:, j, None] for j in range(rows.shape[1])).to(y_perm.dtype)


def combine_backward_math(dout, y_perm, probs, rows, order):
    """(d y_perm, d probs): gathers only (``order`` is the inverse permutation of ``rows``)."""
    k = rows.shape[1]
    d = dout.float()
    d_y = (d[order // k] * probs.flatten()[order].float().unsqueeze(-1)).to(y_perm.dtype)
    d_probs = (d.unsqueeze(1) * y_perm[rows].float()).sum(-1).to(probs.dtype)
    return d_y, d_probs


def slot_sum_math(dx_perm, rows):
    """(T, H): sum_j dx_perm[rows[t, j]] in float32, rounded once (the permute's backward)."""
    return slot_terms_sum(dx_perm[rows[:, j]].float() for j in range(rows.shape[1])).to(dx_perm.dtype)


class LayerMath:
    """The elementwise parts of (a): compiled per shape (CUDA), or eager (``compiled=False``: the
    CPU test)."""

    def __init__(self, compiled: bool):
        wrap = compile_per_shape if compiled else (lambda fn: fn)
        self.swiglu, self.dswiglu = wrap(swiglu_math), wrap(dswiglu_math)
        self.combine, self.combine_backward = wrap(combine_math), wrap(combine_backward_math)
        self.slot_sum = wrap(slot_sum_math)


@functools.cache
def layer_math(compiled: bool) -> LayerMath:
    return LayerMath(compiled)


class ExpertMLP(torch.autograd.Function):
    """`bench_train_step.ReferenceMLP` with its elementwise math passed in: y = swiglu(x @ W1[g].T)
    @ W2[g].T per group, ends = group ends (int32); six torch._grouped_mm per step."""

    @staticmethod
    def forward(ctx, x, w1, w2, ends, math):
        pre = torch._grouped_mm(x, w1.transpose(-2, -1), offs=ends)
        act = math.swiglu(pre)
        ctx.math = math
        ctx.save_for_backward(x, w1, w2, ends, pre, act)
        return torch._grouped_mm(act, w2.transpose(-2, -1), offs=ends)

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, ends, pre, act = ctx.saved_tensors
        dy = dy.contiguous()
        d_act = torch._grouped_mm(dy, w2, offs=ends)
        dw2 = torch._grouped_mm(dy.t(), act, offs=ends)
        d_pre = ctx.math.dswiglu(pre, d_act)
        dx = torch._grouped_mm(d_pre, w1, offs=ends)
        dw1 = torch._grouped_mm(d_pre.t(), x, offs=ends)
        return dx, dw1, dw2, None, None


class GatherPermute(torch.autograd.Function):
    """x_perm = x[order // k] (index_select), with a gather slot-sum backward (no atomics)."""

    @staticmethod
    def forward(ctx, x, order, rows, math):
        ctx.math = math
        ctx.save_for_backward(rows)
        return x.index_select(0, order // rows.shape[1])

    @staticmethod
    def backward(ctx, dx_perm):
        (rows,) = ctx.saved_tensors
        return ctx.math.slot_sum(dx_perm.contiguous(), rows), None, None, None


class GatherCombine(torch.autograd.Function):
    """out[t] = sum_j probs[t, j] * y_perm[rows[t, j]], with a gather backward (no atomics)."""

    @staticmethod
    def forward(ctx, y_perm, probs, rows, order, math):
        ctx.math = math
        ctx.save_for_backward(y_perm, probs, rows, order)
        return math.combine(y_perm, probs, rows)

    @staticmethod
    def backward(ctx, dout):
        y_perm, probs, rows, order = ctx.saved_tensors
        d_y, d_probs = ctx.math.combine_backward(dout.contiguous(), y_perm, probs, rows, order)
        return d_y, d_probs, None, None, None


@dataclass
class TorchRouting:
    order: torch.Tensor   # (T*k,) int64: slot (t*k + j) of each expert-ordered row
    rows: torch.Tensor    # (T, k) int64: row of each slot (the inverse permutation)
    counts: torch.Tensor  # (E,) int64 rows per expert
    ends: torch.Tensor    # (E,) int32 cumulative counts (torch._grouped_mm's offs)


def torch_permute(x, indices, e: int, gather: bool = True):
    """(TorchRouting, x_perm (T*k, H), or None without ``gather``): sync-free (no value reaches
    the host)."""
    t, k = indices.shape
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(e, dtype=torch.int64, device=x.device).scatter_add_(0, flat, torch.ones_like(flat))
    rows = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=x.device)).view(t, k)
    routing = TorchRouting(order, rows, counts, torch.cumsum(counts, 0, dtype=torch.int32))
    return routing, x.index_select(0, order // k) if gather else None


def torch_router(x, wr, k: int):
    """(indices (T, k) int64, probs (T, k) x's dtype): softmax over the experts in float32 of
    x @ Wr.T, top-k, renormalized over the k."""
    scores = torch.softmax(torch.nn.functional.linear(x, wr).float(), dim=-1)
    top, indices = scores.topk(k, dim=-1)
    return indices, (top / top.sum(-1, keepdim=True)).to(x.dtype)


def plain_layer(x, indices, probs, w1, w2, e: int, math: LayerMath):
    """(a): torch permute with a gather backward (GatherPermute), ExpertMLP, GatherCombine."""
    routing, _ = torch_permute(x.detach(), indices, e, gather=False)
    x_perm = GatherPermute.apply(x, routing.order, routing.rows, math)
    y_perm = ExpertMLP.apply(x_perm, w1, w2, routing.ends, math)
    return GatherCombine.apply(y_perm, probs, routing.rows, routing.order, math)


def experts_layer(x, indices, probs, experts, e: int):
    """(b): torch permute (eager), the library's expert Sequential, eager gather-sum combine."""
    routing, x_perm = torch_permute(x, indices, e)
    probs_perm = probs.reshape(-1)[routing.order]
    y_perm = experts(x_perm, split_sizes=routing.counts, probs=probs_perm)
    return y_perm[routing.rows].sum(1)


# --- contenders ---------------------------------------------------------------------------------

@dataclass
class Contender:
    forward: object  # () -> (T, H) output
    leaves: dict     # role ("x", "probs" or "router", "w1", "w2") -> tensor whose .grad is checked
    inputs: tuple    # the step's inputs (not counted as saved activations)
    indices: object = None  # () -> (T, k) expert ids the contender routes to (router rows), or None
    optimizer_step: object = None  # what an optimizer step does to it after MICRO_BATCHES micro-batches (-4mb), or None


def fused_ops():
    """(Permute, Unpermute, TopKRouter) from te_fused_ops, or None where they are not there yet."""
    try:
        from te_fused_ops import Permute, TopKRouter, Unpermute
    except ImportError:
        return None
    return Permute, Unpermute, TopKRouter


def fp8_contenders(p: Problem, permute, unpermute, recipe: str, leaves: dict, inputs: tuple) -> dict:
    """c-fp8 and c-fp8-4mb (module docstring): the layer with both GEMMs in FP8 (``recipe``), its
    weights cast every step, and on its own weight copies cast once per optimizer step of
    MICRO_BATCHES forwards; for fp8_blockwise also c-fp8w16 and c-fp8w16-4mb, the same with
    `Float8BlockScaling(high_precision_wgrad=True)` (16-bit weight gradients)."""
    recipes = {"c-fp8": recipe}
    if get_recipe(recipe) == Float8BlockScaling():
        recipes["c-fp8w16"] = Float8BlockScaling(high_precision_wgrad=True)
    runs = {}
    for label, made in recipes.items():
        runs.update(fp8_regimes(p, permute, unpermute, made, label, leaves, inputs))
    return runs


def fp8_regimes(p: Problem, permute, unpermute, recipe, label: str, leaves: dict, inputs: tuple) -> dict:
    """``label`` (weights cast every step) and ``label``-4mb (cast once per MICRO_BATCHES) for the
    FP8 layer with ``recipe``."""
    def layer(fc1, fc2):
        return Sequential(permute(p.e), Quantize(recipe), fc1, ScaledSwiGLU(), Quantize(recipe), Transpose(), fc2,
                          unpermute())

    every_step = layer(p.fc1, p.fc2)
    fc1_own, fc2_own = copy.deepcopy(p.fc1), copy.deepcopy(p.fc2)  # the step casts reach only these
    once = layer(fc1_own, fc2_own)
    casts = te_fused_ops.cast_weights_once_per_step(torch.optim.SGD(once.parameters(), lr=0.0), once)
    return {
        label: Contender(lambda: every_step(p.x, indices=p.indices, probs=p.probs), leaves, inputs),
        f"{label}-4mb": Contender(lambda: once(p.x, indices=p.indices, probs=p.probs),
                                  dict(leaves, w1=fc1_own.weight, w2=fc2_own.weight), inputs,
                                  optimizer_step=casts.drop),  # what the optimizer step does to the copies
    }


def under_gather_rows(setting: str, forward):
    """``forward`` run with TE_FUSED_OPS_GATHER_ROWS set to ``setting`` (restored after it; the
    backward follows the plan the forward ran)."""
    name = "TE_FUSED_OPS_GATHER_ROWS"

    def call():
        before = os.environ.get(name)
        os.environ[name] = setting
        try:
            return forward()
        finally:
            if before is None:
                del os.environ[name]
            else:
                os.environ[name] = before
    return call


def build_contenders(p: Problem, compiled: bool = True, fused: bool = True, recipe: str | None = None,
                     gather_rows: tuple = ()) -> dict:
    """label -> Contender for the layer with the given routing: a, b, and (``fused`` and the ops
    importable) c, c-combine, c-keep-act (`ScaledSwiGLU(recompute_output=False)`), c-rows-<setting>
    for each of ``gather_rows`` and, with a ``recipe``, c-fp8 and c-fp8-4mb."""
    math = layer_math(compiled)
    w1, w2 = p.fc1.weight, p.fc2.weight
    leaves = {"x": p.x, "probs": p.probs, "w1": w1, "w2": w2}
    inputs = (p.x, p.probs)
    experts = Sequential(p.fc1, ScaledSwiGLU(), p.fc2)
    runs = {
        "a": Contender(lambda: plain_layer(p.x, p.indices, p.probs, w1, w2, p.e, math), leaves, inputs),
        "b": Contender(lambda: experts_layer(p.x, p.indices, p.probs, experts, p.e), leaves, inputs),
    }
    ops = fused_ops() if fused else None
    if fused and ops is None:
        print("  (c) skipped: te_fused_ops has no Permute / Unpermute / TopKRouter yet", flush=True)
    if ops is not None:
        permute, unpermute, _ = ops
        for label, act in (("c", ScaledSwiGLU), ("c-combine", SwiGLU)):
            layer = Sequential(permute(p.e), p.fc1, act(), p.fc2, unpermute())
            runs[label] = Contender(lambda layer=layer: layer(p.x, indices=p.indices, probs=p.probs), leaves, inputs)
        try:  # the activation's output kept for FC2's weight gradient (a build that has the option)
            keep_act = ScaledSwiGLU(recompute_output=False)
        except TypeError:
            keep_act = None
        if keep_act is not None:
            layer = Sequential(permute(p.e), p.fc1, keep_act, p.fc2, unpermute())
            runs["c-keep-act"] = Contender(lambda layer=layer: layer(p.x, indices=p.indices, probs=p.probs), leaves,
                                           inputs)
        for setting in gather_rows:
            layer = Sequential(permute(p.e), p.fc1, ScaledSwiGLU(), p.fc2, unpermute())
            forward = under_gather_rows(setting, lambda layer=layer: layer(p.x, indices=p.indices, probs=p.probs))
            runs[f"c-rows-{setting}"] = Contender(forward, leaves, inputs)
        if recipe is not None:
            runs.update(fp8_contenders(p, permute, unpermute, recipe, leaves, inputs))
    return runs


def build_router_contenders(p: Problem, compiled: bool = True, fused: bool = True) -> dict:
    """label -> Contender for the step with the router: a+router, b+router, and (``fused`` and
    the ops importable) c+router, whose router weight is a copy of p.wr."""
    math = layer_math(compiled)
    w1, w2 = p.fc1.weight, p.fc2.weight
    leaves = {"x": p.x, "router": p.wr, "w1": w1, "w2": w2}
    experts = Sequential(p.fc1, ScaledSwiGLU(), p.fc2)

    def routed(layer):
        def forward():
            indices, probs = torch_router(p.x, p.wr, p.k)
            return layer(p.x, indices, probs)
        return forward

    runs = {
        "a+router": Contender(routed(lambda x, ind, pr: plain_layer(x, ind, pr, w1, w2, p.e, math)), leaves,
                              (p.x,), lambda: torch_router(p.x, p.wr, p.k)[0]),
        "b+router": Contender(routed(lambda x, ind, pr: experts_layer(x, ind, pr, experts, p.e)), leaves,
                              (p.x,), lambda: torch_router(p.x, p.wr, p.k)[0]),
    }
    ops = fused_ops() if fused else None
    if ops is not None:
        permute, unpermute, top_k_router = ops
        router = top_k_router(p.h, p.e, p.k, score="softmax", normalize=True, dtype=p.wr.dtype,
                              device=p.wr.device)
        weights = [w for w in router.parameters() if w.shape == p.wr.shape]
        if len(weights) != 1 or len(list(router.parameters())) != 1:
            print(f"  c+router skipped: TopKRouter's parameters {[tuple(w.shape) for w in router.parameters()]} "
                  f"are not one ({p.e}, {p.h}) weight", flush=True)
        else:
            with torch.no_grad():
                weights[0].copy_(p.wr)
            layer = Sequential(router, permute(p.e), p.fc1, ScaledSwiGLU(), p.fc2, unpermute())
            runs["c+router"] = Contender(lambda: layer(p.x), dict(leaves, router=weights[0]), (p.x,))
    return runs


# --- checks and measurements --------------------------------------------------------------------

def rel_err(a, b) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def clear(leaves) -> None:
    for t in leaves:
        t.grad = None


def step_fn(run: Contender, dy):
    """One micro-batch: every gradient None, forward, backward."""
    leaves = list(run.leaves.values())

    def step():
        clear(leaves)
        run.forward().backward(dy)
    return step


def timed_step(run: Contender, dy):
    """What is timed: `step_fn`, or for a -4mb contender the `common.accumulation_step` of
    MICRO_BATCHES of them and its optimizer step (timed per micro-batch, its weight casts in)."""
    if run.optimizer_step is None:
        return step_fn(run, dy)
    return accumulation_step(step_fn(run, dy), run.optimizer_step, MICRO_BATCHES)


def outputs_and_grads(run: Contender, dy) -> dict:
    clear(run.leaves.values())
    out = run.forward()
    out.backward(dy)
    got = {"out": out.detach().clone()}
    got.update({f"d{role}": t.grad.clone() for role, t in run.leaves.items()})
    clear(run.leaves.values())
    return got


def check_contenders(runs: dict, dy, reference: str) -> dict:
    """label -> {"status": "ok" | "mismatch" | "error", "rel_err": {name: err}, "max_rel_err", ...}:
    each contender's output and gradients against ``reference``'s (printed). A contender that
    raises is marked "error" (with its message) unless it is the reference."""
    want = outputs_and_grads(runs[reference], dy)
    checks = {}
    for label, run in runs.items():
        try:
            got = want if label == reference else outputs_and_grads(run, dy)
        except Exception as error:  # noqa: BLE001  (the fused layer's ops are new: report, go on)
            print(f"  {label:10s} ERROR {type(error).__name__}: {error}", flush=True)
            checks[label] = {"status": "error", "error": f"{type(error).__name__}: {error}"}
            continue
        errs = {name: rel_err(got[name], want[name]) for name in want}
        check = {"rel_err": errs, "max_rel_err": max(errs.values())}
        if run.indices is not None and runs[reference].indices is not None:
            check["same_experts"] = (run.indices().sort(-1).values == runs[reference].indices().sort(-1).values
                                     ).all(-1).float().mean().item()
        check["status"] = "ok" if check["max_rel_err"] <= (TOL_FP8 if "fp8" in label else TOL) else "mismatch"
        checks[label] = check
        print(f"  {label:10s} {'MISMATCH, not timed' if check['status'] == 'mismatch' else 'matches'} {reference}: "
              + "  ".join(f"{name} {err:.1e}" for name, err in errs.items()), flush=True)
    return checks


def saved_activation_bytes(forward, exclude=()) -> tuple:
    """(bytes, output): the storages autograd saves in one ``forward()``, each counted once,
    those of ``exclude`` (parameters, inputs) left out."""
    seen = {t.untyped_storage().data_ptr() for t in exclude}
    total = 0

    def pack(t):
        nonlocal total
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return total, out


def runner_saved_bytes(out):
    try:
        from te_fused_ops.runner import saved_tensor_bytes
        return saved_tensor_bytes(out)
    except (ImportError, ValueError):
        return None


def measure(runs: dict, checks: dict, dy, flops: int, rounds: int, window_s: float) -> dict:
    """label -> the row of each contender: its check, and where it matched, step_ms, tflops,
    vs_a / vs_b ((a) or (b) ms / its ms), peak_mib, saved_mib (and for the fused ones the
    runner's count and the hooks' count with the inputs)."""
    timed = {label: timed_step(run, dy) for label, run in runs.items() if checks[label]["status"] == "ok"}
    passes = [rotated_medians(timed, lambda fn: sustained_ms(fn, window_s, window_s)) for _ in range(rounds)]
    rows = {}
    for label, run in runs.items():
        row = dict(checks[label])
        if label in timed:
            ms = sorted(p[label] for p in passes)[len(passes) // 2]
            params = [t for role, t in run.leaves.items() if role not in ("x", "probs")]
            saved, _ = saved_activation_bytes(run.forward, exclude=params + list(run.inputs))
            row.update(step_ms=ms, tflops=3 * flops / (ms * 1e-3) / 1e12, saved_mib=saved / 2**20)
            if label.startswith("c"):
                with_inputs, out = saved_activation_bytes(run.forward, exclude=params)
                runner = runner_saved_bytes(out)
                row["saved_mib_with_inputs"] = with_inputs / 2**20
                row["runner_saved_mib"] = None if runner is None else runner / 2**20
                del out
            clear(run.leaves.values())
            if run.optimizer_step is not None:  # its first micro-batch casts: the peak counts the copies
                run.optimizer_step()
            row["peak_mib"] = extra_peak_mib(timed[label])
            clear(run.leaves.values())
        rows[label] = row
    for base in ("a", "b", "c"):
        base_ms = next((r["step_ms"] for label, r in rows.items() if label.split("+")[0] == base and "step_ms" in r),
                       None)
        for r in rows.values():
            r[f"vs_{base}"] = base_ms / r["step_ms"] if base_ms and "step_ms" in r else None
    return rows


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(device: str, results: list) -> str:
    lines = [
        (f"MoE layer training step (gradients None, forward, backward; dispatch, FC1, SwiGLU, FC2, combine), "
         f"bf16, skewed top-k routing, {device}; median ms of rotated rounds; TFLOPS = 3 x forward FLOPs / step; "
         "vs a / vs b / vs c = their ms / this ms; peak = MiB above the step's start; saved = activation MiB kept for "
         "the backward (inputs and parameters excluded)"),
        "",
        "| shape | contender | step ms | TFLOPS | vs a | vs b | vs c | peak MiB | saved MiB | max rel err | status |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for res in results:
        for label, r in {**res["layer"], **res["router"]}.items():
            lines.append(
                f"| {res['shape']} | {label} | {fmt(r.get('step_ms'), '.3f')} | {fmt(r.get('tflops'), '.0f')} | "
                f"{fmt(r.get('vs_a'), '.2f')} | {fmt(r.get('vs_b'), '.2f')} | {fmt(r.get('vs_c'), '.2f')} | "
                f"{fmt(r.get('peak_mib'), '.0f')} | "
                f"{fmt(r.get('saved_mib'), '.0f')} | {fmt(r.get('max_rel_err'), '.1e')} | {r['status']} |")
    return "\n".join(lines)


def profile_contender(label: str, run: Contender, dy, step_ms: float) -> dict:
    """Where one step of ``run`` goes: GPU time and launches per kernel (torch.profiler, one step
    at the profiler's clock, not the timed one's: their sum against the step is a rough idle
    estimate), the host time to issue a step, and the step's timeline queued behind a GPU sleep
    (`common.kernel_timeline`: idle time between its kernels, each launch's time in order). A -4mb
    contender's times are per micro-batch of its `timed_step`, its launches those of the whole
    optimizer step."""
    launches, step = {}, timed_step(run, dy)
    kernels = {kernel: per_micro_batch(step, us) for kernel, us in gpu_us_per_kernel(step, launches).items()}
    kernel_ms = sum(kernels.values()) / 1e3
    host_ms = per_micro_batch(step, host_us_per_call(step, calls=2, batches=10)) / 1e3
    print(f"  profile {label}: kernels {kernel_ms:.3f} ms of the {step_ms:.3f} ms step (idle {step_ms - kernel_ms:.3f}),"
          f" host {host_ms:.3f} ms to issue a step, {len(kernels)} kernels", flush=True)
    for kernel, us in sorted(kernels.items(), key=lambda item: -item[1])[:12]:
        print(f"    {us:9.1f} us  x{launches[kernel]:<3d} {kernel[:110]}", flush=True)
    clocks = clock_and_power(step)
    if clocks:
        print(f"  clocks {label}: SM {clocks['sm_mhz']:.0f} MHz, {clocks['power_w']:.0f} W of "
              f"{clocks['power_limit_w']:.0f} W (medians of {clocks['samples']} samples, steps back to back)", flush=True)
    timeline = kernel_timeline(step)
    print_timeline(label, timeline)
    for launch in timeline["launches"]:
        if launch["us"] >= 20:
            print(f"    in order: {launch['us']:9.1f} us  {launch['name']}", flush=True)
    return {"kernel_ms": kernel_ms, "host_ms": host_ms, "kernels_us": kernels, "launches": launches,
            "clocks": clocks, "timeline": timeline}


def memory_trace(label: str, run: Contender, dy) -> dict:
    """What is live at the peak of one step of ``run`` (`common.live_at_peak`), printed and returned."""
    step = step_fn(run, dy)
    step()
    clear(run.leaves.values())
    peak_mib, rows = live_at_peak(step)
    clear(run.leaves.values())
    print(f"  memory {label}: {peak_mib:.0f} MiB above the step's start at its peak, live then:", flush=True)
    for n, mib, where in rows[:12]:
        print(f"    {n} x {mib:9.1f} MiB  {where}", flush=True)
    return {"peak_mib": peak_mib, "live": [{"count": n, "mib": mib, "where": where} for n, mib, where in rows]}


def run_shape(name: str, shape, rounds: int, window_s: float, recipe: str | None = None, profile=(),
              memory=(), gather_rows=()) -> dict:
    t, k, e, h, i = shape
    print(f"[{name}] T={t} k={k} E={e} H={h} I={i} ...", flush=True)
    p = make_problem(name, shape)
    counts = torch.bincount(p.indices.flatten(), minlength=e)
    result = {"shape": name, "T": t, "k": k, "E": e, "H": h, "I": i, "max_rows_per_expert": int(counts.max()),
              "min_rows_per_expert": int(counts.min()), "layer_flops_fwd": p.layer_flops()}
    runs = build_contenders(p, recipe=recipe, gather_rows=gather_rows)
    result["layer"] = measure(runs, check_contenders(runs, p.dy, "a"), p.dy, p.layer_flops(), rounds, window_s)
    for label in profile:
        if label in runs and "step_ms" in result["layer"].get(label, {}):
            result["layer"][label]["profile"] = profile_contender(label, runs[label], p.dy,
                                                                  result["layer"][label]["step_ms"])
    for label in memory:
        if label in runs and "step_ms" in result["layer"].get(label, {}):
            result["layer"][label]["memory_trace"] = memory_trace(label, runs[label], p.dy)
    result["router"] = {}
    if recipe is None:
        runs = build_router_contenders(p)
        result["router"] = measure(runs, check_contenders(runs, p.dy, "a+router"), p.dy,
                                   p.layer_flops() + p.router_flops(), rounds, window_s)
        for label in profile:
            if label in runs and "step_ms" in result["router"].get(label, {}):
                result["router"][label]["profile"] = profile_contender(label, runs[label], p.dy,
                                                                       result["router"][label]["step_ms"])
    for label, r in {**result["layer"], **result["router"]}.items():
        if "step_ms" in r:
            extra = ""
            if r.get("saved_mib_with_inputs") is not None:
                extra = (f"  (with inputs {r['saved_mib_with_inputs']:.1f}, runner "
                         f"{fmt(r['runner_saved_mib'], '.1f')})")
            print(f"  {label:10s} step {r['step_ms']:8.3f} ms  {r['tflops']:5.0f} TFLOPS  vs a {fmt(r['vs_a'], '.2f')}"
                  f"  vs b {fmt(r['vs_b'], '.2f')}  vs c {fmt(r['vs_c'], '.2f')}  peak {r['peak_mib']:8.0f} MiB  saved {r['saved_mib']:8.1f} MiB"
                  + extra, flush=True)
    del p, runs
    torch.cuda.empty_cache()
    return result


def layer_shape(name: str, ap) -> tuple:
    """(T, k, E, H, I) of a ``TxkxExHxI`` name."""
    try:
        t, k, e, h, i = (int(v) for v in name.lower().split("x"))
    except ValueError:
        ap.error(f"--shapes: {name!r} is neither one of {', '.join(SHAPES)} nor TxkxExHxI")
    return t, k, e, h, i


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default=None, help=f"comma-separated, of {','.join(SHAPES)} or TxkxExHxI (any "
                    "sizes, e.g. 4096x6x64x2048x1408; default: the four named)")
    ap.add_argument("--rounds", type=int, default=1, help="passes of rotated rounds; the median pass is kept")
    ap.add_argument("--smoke", action="store_true", help="tiny shape (T 64, k 2, E 4, H 64, I 64), short windows")
    ap.add_argument("--recipe", default=None, help="also the FP8 layer with this recipe (e.g. fp8_blockwise), "
                    "weights cast every step and once per 4 micro-batches; no router rows")
    ap.add_argument("--out", default=None, help="folder for the .json/.md (default: benchmarks/results, with "
                    "--smoke its git-ignored runs/ folder)")
    ap.add_argument("--profile", default="", help="contenders (e.g. a,c,c+router) whose step is also broken down: GPU time "
                    "per kernel, idle GPU time, host time to issue a step, SM clock and power")
    ap.add_argument("--memory-trace", default="", help="contenders (e.g. c) whose step's peak is broken down: the "
                    "blocks live then, by the library frames that allocated them")
    ap.add_argument("--gather-rows", default="", help="settings of TE_FUSED_OPS_GATHER_ROWS (e.g. wgrad,1): the "
                    "fused layer under each too, as c-rows-<setting>")
    args = ap.parse_args()
    shapes = dict(SMOKE_SHAPES if args.smoke else SHAPES)
    names = args.shapes.split(",") if args.shapes else list(shapes)
    for name in names:
        if name not in shapes:
            shapes[name] = layer_shape(name, ap)
    window_s = 0.02 if args.smoke else 0.4
    device = torch.cuda.get_device_name()
    profile = [label for label in args.profile.split(",") if label]
    memory = [label for label in args.memory_trace.split(",") if label]
    gather_rows = tuple(setting for setting in args.gather_rows.split(",") if setting)
    results = [run_shape(name, shapes[name], args.rounds, window_s, args.recipe, profile, memory, gather_rows)
               for name in names]
    text = table(device, results)
    stem = f"moe_layer{'_' + args.recipe if args.recipe else ''}{'_smoke' if args.smoke else ''}_{device_tag(device)}"
    payload = {"device": device, "routing": ROUTING, "tolerance": TOL, "recipe": args.recipe,
               "rounds": args.rounds, "results": results}
    write_results(args.out or (os.path.join(RESULTS, "runs") if args.smoke else RESULTS), stem, payload, text)
    print(text)


if __name__ == "__main__":
    main()
