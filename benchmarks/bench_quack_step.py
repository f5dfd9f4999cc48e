"""Training step of a grouped SwiGLU MLP with quack (quack-kernels 0.6.5) vs the plain-torch reference.

The same step, shapes, routing and reference as `bench_train_step.py` (bf16, counts multiples of 8),
with quack's varlen grouped GEMMs in place of ours, SonicMoE-style (one autograd.Function, group
offsets as ``cu_seqlens``):
  forward   FC1 ``gemm_act(x, W1^T, "swiglu", cu_seqlens_m)`` storing pre-activation and activation,
            FC2 ``gemm(act, W2^T, cu_seqlens_m)``; saves x and pre only
  backward  FC2 dgrad + dSwiGLU ``gemm_dact(dy, W2, pre, "swiglu", cu_seqlens_m)`` (also recomputes
            act), dW2 ``gemm(dy^T, act, cu_seqlens_k)``, FC1 dgrad ``gemm(d_pre, W1, cu_seqlens_m)``,
            dW1 ``gemm(d_pre^T, x, cu_seqlens_k)``; backward GEMMs with ``dynamic_scheduler=True``,
            as quack's own MLP runs them
quack's gated epilogue pairs adjacent columns (gate, up), so its W1 is the reference's [gate; up]
W1 with rows interleaved once, outside timing; its dW1 is de-interleaved for the check.
Variants: ``quack`` (``tuned=False``: quack's default sm90 config) and ``quack_tuned``
(``tuned=True``, quack's default: its autotuner benchmarks every sm90 config of each GEMM on the
first call per shape and keeps the winner, also on disk under ``QUACK_CACHE_DIR``).
Outputs and gradients are checked against the reference (rel. Frobenius <= 1e-2) before timing;
times as in `bench_train_step.py` (`time_variants`: rotated medians of `common.sustained_ms`).
Then each backward GEMM of quack (tuned, or default with ``--no-tune``) against the torch kernel
doing the same work, the rows `bench_train_step.py` prints for this library's kernels.

quack 0.6.5 needs CuTe DSL 4.7.1, so this runs in its own environment on the GPU machine:
    bash benchmarks/quack_env/prepare.sh        # here: fills .quackcarry/ (git-ignored, about 58 MiB)
    source .quackcarry/bootstrap.sh && python3 benchmarks/bench_quack_step.py [--shapes ...] [--out DIR]
"""

import argparse
import time

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__, kernels=False)  # quack's environment: its own CuTe DSL, this library's kernels not timed

import torch
from bench_train_step import SHAPES, ReferenceMLP, dswiglu, problem, rel_err, step_rows, step_timelines, swiglu
from common import device_tag, model_shape, print_timeline, rotated_medians, sustained_ms, write_results


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names or MxHxIxE sizes")
    ap.add_argument("--out", default=None, help="folder for the JSON/markdown result (default: print only)")
    ap.add_argument("--no-tune", action="store_true", help="skip the autotuned quack variant")
    ap.add_argument("--profile", action="store_true", help="also print the GPU timeline (busy, idle, largest "
                    "gaps) of a quack and a reference step")
    return ap


if __name__ == "__main__":
    arguments().parse_args()  # --help answers here, where quack is not installed too

import quack  # noqa: E402
import quack.gemm_interface as qg  # noqa: E402


def interleave(w1):
    """(E, 2I, H) [gate; up] rows -> (gate_0, up_0, gate_1, ...) rows, the layout quack's gated epilogue reads."""
    e, n, h = w1.shape
    return w1.reshape(e, 2, n // 2, h).transpose(1, 2).reshape(e, n, h).contiguous()


def deinterleave(w1):
    """Inverse of `interleave`."""
    e, n, h = w1.shape
    return w1.reshape(e, n // 2, 2, h).transpose(1, 2).reshape(e, n, h).contiguous()


class QuackMLP(torch.autograd.Function):
    """y = swiglu(x @ W1[g]^T) @ W2[g]^T per group with quack's varlen GEMMs; W1 interleaved,
    ``cu`` = group offsets (E + 1, int32, from 0)."""

    @staticmethod
    def forward(ctx, x, w1, w2, cu, tuned):
        pre, act = qg.gemm_act(x, w1.mT, activation="swiglu", cu_seqlens_m=cu, tuned=tuned)
        y = qg.gemm(act, w2.mT, cu_seqlens_m=cu, tuned=tuned)
        ctx.save_for_backward(x, w1, w2, cu, pre)
        ctx.tuned = tuned
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w1, w2, cu, pre = ctx.saved_tensors
        tuned = ctx.tuned
        dy = dy.contiguous()
        d_pre, act = qg.gemm_dact(dy, w2, pre, activation="swiglu", cu_seqlens_m=cu,
                                  dynamic_scheduler=True, tuned=tuned)
        dw2 = qg.gemm(dy.T, act, cu_seqlens_k=cu, dynamic_scheduler=True, tuned=tuned)
        dx = qg.gemm(d_pre, w1, cu_seqlens_m=cu, dynamic_scheduler=True, tuned=tuned)
        dw1 = qg.gemm(d_pre.T, x, cu_seqlens_k=cu, dynamic_scheduler=True, tuned=tuned)
        return dx, dw1, dw2, None, None


def variants(mlp, offsets, x, tune=True):
    """label -> (forward, leaves): the reference on the model's weights, quack on an interleaved
    copy of W1 (its own leaf) and the same W2."""
    w1, w2 = mlp[0].weight, mlp[2].weight
    w1q = interleave(w1.detach()).requires_grad_()
    runs = {
        "reference": (lambda: ReferenceMLP.apply(x, w1, w2, offsets[1:]), [x, w1, w2]),
        "quack": (lambda: QuackMLP.apply(x, w1q, w2, offsets, False), [x, w1q, w2]),
    }
    if tune:
        runs["quack_tuned"] = (lambda: QuackMLP.apply(x, w1q, w2, offsets, True), [x, w1q, w2])
    return runs


def first_step_s(forward, leaves, dy):
    """Wall seconds of one step with gradients set to None first (the first one compiles or tunes);
    returns (seconds, [y, dx, dW1, dW2])."""
    for t in leaves:
        t.grad = None
    torch.cuda.synchronize()
    start = time.perf_counter()
    y = forward()
    y.backward(dy)
    torch.cuda.synchronize()
    return time.perf_counter() - start, [y.detach()] + [t.grad.clone() for t in leaves]


def tuned_configs():
    """{(tuner, key): "<gemm kind> A[shape]: config"} of every quack autotuner's winners so far."""
    import quack.gemm_runtime.autotune as mod_tune

    tuners = [qg.gemm_tuned, *getattr(mod_tune, "_MOD_TUNERS", {}).values()]
    out = {}
    for tuner in tuners:
        for key, conf in getattr(tuner, "cache", {}).items():
            c = conf.kwargs.get("config")
            if c is not None:
                a_shape = next((v for v in key if isinstance(v, tuple) and len(v) > 1
                                and all(isinstance(d, int) for d in v)), ())
                out[(tuner.fn.__name__, key)] = (
                    f"{tuner.fn.__name__.removeprefix('mod_').rsplit('_', 1)[0]} A{list(a_shape)}: {c.tile_m}x{c.tile_n} "
                    f"cluster {c.cluster_m}x{c.cluster_n} {'pingpong' if c.pingpong else 'coop'}"
                    f"{' swap_ab' if c.swap_ab else ''}")
    return out


def kernel_rows(mlp, offsets, x, dy, tuned):
    """Per-kernel times of quack's backward GEMMs (``tuned`` or default) against the torch kernels
    doing the same work: the torch side is `bench_train_step.kernel_rows`'s, so each quack / torch
    ratio compares with that benchmark's ours / torch run on the same machine."""
    ends = offsets[1:]
    w1, w2, xd = mlp[0].weight.detach(), mlp[2].weight.detach(), x.detach()
    w1q = interleave(w1)
    pre = torch._grouped_mm(xd, w1.transpose(-2, -1), offs=ends)
    act = swiglu(pre)
    d_pre = dswiglu(pre, torch._grouped_mm(dy, w2, offs=ends))
    pre_q, act_q = qg.gemm_act(xd, w1q.mT, activation="swiglu", cu_seqlens_m=offsets, tuned=tuned)
    d_pre_q = qg.gemm_dact(dy, w2, pre_q, activation="swiglu", cu_seqlens_m=offsets, dynamic_scheduler=True,
                           tuned=tuned)[0]
    kw = dict(dynamic_scheduler=True, tuned=tuned)
    rows = {
        "FC2 dgrad + dSwiGLU (+ act)": (
            lambda: qg.gemm_dact(dy, w2, pre_q, activation="swiglu", cu_seqlens_m=offsets, **kw),
            lambda: dswiglu(pre, torch._grouped_mm(dy, w2, offs=ends)),
        ),
        "FC2 wgrad": (
            lambda: qg.gemm(dy.T, act_q, cu_seqlens_k=offsets, **kw),
            lambda: torch._grouped_mm(dy.t(), act, offs=ends),
        ),
        "FC1 dgrad": (
            lambda: qg.gemm(d_pre_q, w1q, cu_seqlens_m=offsets, **kw),
            lambda: torch._grouped_mm(d_pre, w1, offs=ends),
        ),
        "FC1 wgrad": (
            lambda: qg.gemm(d_pre_q.T, xd, cu_seqlens_k=offsets, **kw),
            lambda: torch._grouped_mm(d_pre.t(), xd, offs=ends),
        ),
    }
    return {
        name: rotated_medians({"quack_us": ours, "torch_us": theirs}, lambda fn: sustained_ms(fn) * 1e3)
        for name, (ours, theirs) in rows.items()
    }


def check(runs, dy, name):
    """Each quack variant's y, dx, dW1, dW2 vs the reference; label -> (first step s, max rel err,
    autotune winners of this shape)."""
    _, ref = first_step_s(*runs["reference"], dy)
    out = {}
    for label in runs:
        if label == "reference":
            continue
        before = tuned_configs()
        seconds, got = first_step_s(*runs[label], dy)
        winners = [v for k, v in tuned_configs().items() if k not in before]
        got[2] = deinterleave(got[2])
        errs = [rel_err(a, b) for a, b in zip(got, ref)]
        assert max(errs) <= 1e-2, f"{name}: {label} vs reference errors (y, dx, dW1, dW2) {errs}"
        out[label] = (seconds, max(errs), winners)
        print(f"  {label:11s} first step {seconds:7.1f} s (compile{' + autotune' if 'tuned' in label else ''})"
              f"  max rel err {max(errs):.2e}" + (f"  tuned: {'; '.join(winners)}" if winners else ""), flush=True)
    return out


def main():
    args = arguments().parse_args()
    import cutlass

    device = torch.cuda.get_device_name()
    print(f"quack {quack.__version__}, cutlass-dsl {cutlass.__version__}, torch {torch.__version__}, {device}",
          flush=True)
    results = []
    for name in args.shapes.split(","):
        m, h, i, e = model_shape(name)
        print(f"[{name}] M={m} H={h} I={i} E={e} ...", flush=True)
        mlp, _, offsets, x, dy = problem(name)
        runs = variants(mlp, offsets, x, tune=not args.no_tune)
        checked = check(runs, dy, name)
        row = {"shape": name, "M": m, "H": h, "I": i, "E": e,
               "first_step_s": {k: v[0] for k, v in checked.items()},
               "max_rel_err": {k: v[1] for k, v in checked.items()},
               "tuned_configs": checked.get("quack_tuned", (0, 0, []))[2]}
        row.update(step_rows(runs, dy, m, h, i, width=11))
        row["kernels"] = kernel_rows(mlp, offsets, x, dy, tuned=not args.no_tune)
        for kernel, r in row["kernels"].items():
            print(f"  {kernel:28s} quack{'' if args.no_tune else ' tuned'} {r['quack_us']:8.0f} us"
                  f"  torch {r['torch_us']:8.0f} us", flush=True)
        if args.profile:
            row["timelines"] = step_timelines(runs, dy, ("quack" if args.no_tune else "quack_tuned", "reference"))
            for label, timeline in row["timelines"].items():
                print_timeline(label, timeline)
        results.append(row)
        del mlp, runs, x, dy
        torch.cuda.empty_cache()

    labels = [k for k in ("quack", "quack_tuned") if k in results[0]] if results else []
    lines = [
        (f"Training step (fwd + bwd, grads None first), bf16 SwiGLU MLP, quack {quack.__version__} "
         f"(cutlass-dsl {cutlass.__version__}), {device}; median ms"),
        "",
        "| shape | reference step | " + " | ".join(f"{k} step" for k in labels) + " | "
        + " | ".join(f"reference / {k}" for k in labels) + " | "
        + " | ".join(f"bwd reference / {k}" for k in labels) + " | peak MiB reference / "
        + " / ".join(labels) + " |",
        "|---|---|" + "---|" * (3 * len(labels) + 1),
    ]
    for r in results:
        ref = r["reference"]
        lines.append(
            f"| {r['shape']} | {ref['step_ms']:.2f} | "
            + " | ".join(f"{r[k]['step_ms']:.2f}" for k in labels) + " | "
            + " | ".join(f"{ref['step_ms'] / r[k]['step_ms']:.2f}x" for k in labels) + " | "
            + " | ".join(f"{ref['bwd_ms'] / r[k]['bwd_ms']:.2f}x" for k in labels) + " | "
            + " / ".join(f"{r[k]['peak_mib']:.0f}" for k in ["reference"] + labels) + " |"
        )
    lines += ["", "| shape | kernel | quack us | torch us | speedup |", "|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {kernel} | {k['quack_us']:.0f} | {k['torch_us']:.0f} | "
              f"{k['torch_us'] / k['quack_us']:.2f}x |" for r in results for kernel, k in r["kernels"].items()]
    table = "\n".join(lines)
    print(table)
    if args.out:
        payload = {"device": device, "quack": quack.__version__, "cutlass_dsl": cutlass.__version__,
                   "torch": torch.__version__, "results": results}
        write_results(args.out, f"quack_step_{device_tag(device)}", payload, table)


if __name__ == "__main__":
    main()
