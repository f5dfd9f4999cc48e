"""Transformer Engine's te.ops grouped MLP with and without te_fused_ops' integration (H100/H200).

    python benchmarks/bench_te_ops.py [--shapes qwen3-30b-a3b,...] [--out DIR]

Per shape (common.MODEL_SHAPES; bf16, SwiGLU, no bias, skewed routing with counts multiples of 8,
the same splits for every variant), a training step (forward + backward, gradients set to None
first; common.sustained_ms medians at the power-capped steady clock, common.rotated_medians over
the variants) of
  te          te.ops.Sequential(GroupedLinear, SwiGLU, GroupedLinear), TE 2.20 alone
  te+tfo      the same module after te_fused_ops.integrations.transformer_engine.install()
  te+tfo 1p   the same with TE's one-parameter grouped weight (single_grouped_weight,
              NVTE_GROUPED_LINEAR_SINGLE_PARAM=1): 2 parameters instead of 2 x G
  tfo         te_fused_ops' own Sequential(GroupedLinear, SwiGLU, GroupedLinear)
  torch       plain torch: torch._grouped_mm + compiled SwiGLU / dSwiGLU (bench_train_step.ReferenceMLP)
  te+tfo graph, tfo graph
              the te+tfo and tfo steps captured in one CUDA graph each and replayed (no host time)
Gradients of te+tfo and te+tfo 1p are checked against te first (rel. Frobenius <= 2e-2); the host time
to issue a step is timed for te+tfo, te+tfo 1p and tfo.
"""

import argparse
import os
import warnings

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
from bench_train_step import ReferenceMLP
from common import (
    MODEL_SHAPES, device_tag, gpu_us_per_kernel, host_us_per_call, rotated_medians, skewed_splits, sustained_ms,
    write_results,
)

from te_fused_ops import GroupedLinear, Sequential, SwiGLU
from te_fused_ops.integrations import transformer_engine as tfo_te


def arguments() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(MODEL_SHAPES))
    ap.add_argument("--out", default=None, help="folder for the JSON/markdown result (default: print only)")
    ap.add_argument("--profile", action="store_true", help="also print the kernels of a te+tfo and a tfo step")
    return ap


if __name__ == "__main__":
    arguments().parse_args()  # --help answers here, where Transformer Engine is not installed too

import transformer_engine  # noqa: E402
import transformer_engine.pytorch as te  # noqa: E402


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def te_mlp(h, i, e, **kwargs):
    return te.ops.Sequential(
        te.ops.GroupedLinear(e, h, 2 * i, bias=False, device="cuda", dtype=torch.bfloat16, **kwargs),
        te.ops.SwiGLU(),
        te.ops.GroupedLinear(e, i, h, bias=False, device="cuda", dtype=torch.bfloat16, **kwargs),
    )


def single_param_mlp(plain, h, i, e):
    """te_mlp with TE's one-parameter grouped weights (TE 2.20 gates them on an environment
    variable), holding ``plain``'s values."""
    before = os.environ.get("NVTE_GROUPED_LINEAR_SINGLE_PARAM")
    os.environ["NVTE_GROUPED_LINEAR_SINGLE_PARAM"] = "1"
    try:
        model = te_mlp(h, i, e, single_grouped_weight=True)
    finally:
        if before is None:
            del os.environ["NVTE_GROUPED_LINEAR_SINGLE_PARAM"]
        else:
            os.environ["NVTE_GROUPED_LINEAR_SINGLE_PARAM"] = before
    with torch.no_grad():
        for k in (0, 2):
            fc = model[k]
            fc.weight.rowwise_data.view(e, fc.out_features, fc.in_features).copy_(
                torch.stack(list(plain[k]._get_weight_tensors()))
            )
    return model


def step_fn(call, leaves, dy):
    def run():
        for t in leaves:
            t.grad = None
        call().backward(dy)

    return run


def step_ms(run):
    return sustained_ms(run, 0.25, 0.25)


def graphed(call, leaves, dy):
    """The step of ``call`` captured in a CUDA graph (gradients None before the capture, so each
    replay writes them afresh): (replay, the gradient tensors the replays write)."""
    run = step_fn(call, leaves, dy)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    for t in leaves:
        t.grad = None
    with torch.cuda.graph(graph):
        call().backward(dy)
    written = [t.grad for t in leaves]
    for t in leaves:
        t.grad = None  # the eager variants allocate their own
    return graph.replay, written


def grads(call, leaves, dy):
    for t in leaves:
        t.grad = None
    call().backward(dy)
    return [t.grad.clone() for t in leaves]


def kernel_diff(runs: dict, rows=14) -> str:
    """GPU us per kernel name of one step of each variant in ``runs`` (torch.profiler), the
    kernels whose time differs most between them first."""
    per = {label: gpu_us_per_kernel(run) for label, run in runs.items()}
    names = set().union(*per.values())
    spread = lambda n: max(p.get(n, 0.0) for p in per.values()) - min(p.get(n, 0.0) for p in per.values())
    lines = [" | ".join(["us", *per]) + " | kernel"]
    for n in sorted(names, key=spread, reverse=True)[:rows]:
        lines.append(" | ".join(f"{per[label].get(n, 0.0):9.0f}" for label in per) + f" | {n[:90]}")
    lines.append(" | ".join(f"{sum(p.values()):9.0f}" for p in per.values()) + " | total")
    return "\n".join(lines)


def main():
    args = arguments().parse_args()
    gpu = torch.cuda.get_device_name()
    rows, host_rows, payload = [], [], {"device": gpu, "te": transformer_engine.__version__, "shapes": {}}
    for name in args.shapes.split(","):
        m, h, i, e = MODEL_SHAPES[name]
        torch.manual_seed(0)
        splits = skewed_splits(m, e, align=8).cuda()
        x = torch.randn(m, h, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        dy = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
        tfo_te.uninstall()
        plain = te_mlp(h, i, e)
        fused = te_mlp(h, i, e)  # not deepcopy: nn.Parameter's deepcopy unpacks TE's (G, out, in) buffer
        fused.load_state_dict(plain.state_dict())  # in place: the packed buffers stay
        want = grads(lambda: plain(x, splits, splits), [x, *plain.parameters()], dy)  # fuses without tfo
        tfo_te.install(fused)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TE calls single grouped parameters experimental
            single = single_param_mlp(plain, h, i, e)
        ours = Sequential(
            GroupedLinear(e, h, 2 * i, dtype=torch.bfloat16, device="cuda"), SwiGLU(),
            GroupedLinear(e, i, h, dtype=torch.bfloat16, device="cuda"),
        )
        ends = torch.cumsum(splits, 0).to(torch.int32)
        w1, w2 = (ours[k].weight for k in (0, 2))
        calls = {
            "te": (lambda: plain(x, splits, splits), [x, *plain.parameters()]),
            "te+tfo": (lambda: fused(x, splits, splits), [x, *fused.parameters()]),
            "te+tfo 1p": (lambda: single(x, splits, splits), [x, *single.parameters()]),
            "tfo": (lambda: ours(x, split_sizes=splits), [x, *ours.parameters()]),
            "torch": (lambda: ReferenceMLP.apply(x, w1, w2, ends), [x, w1, w2]),
        }
        for model in (fused, single):  # fuse (with the integration installed) before checking
            model(x, splits, splits)
            explained = tfo_te.explain(model)
            assert "-> te_fused_ops" in explained and "stacked" not in explained, explained
        got = grads(*calls["te+tfo"], dy)
        err = max(rel_err(a, b) for a, b in zip(got, want))
        dx, dw1, dw2 = grads(*calls["te+tfo 1p"], dy)
        per_group = [want[0], torch.cat(want[1 : 1 + e]), torch.cat(want[1 + e :])]
        err = max([err] + [rel_err(a.reshape(b.shape), b) for a, b in zip((dx, dw1, dw2), per_group)])
        assert err <= 2e-2, f"{name}: te+tfo gradients differ from te's by {err:.3e}"
        flops = 3 * 2 * m * h * 3 * i  # forward: 2*m*h*2i + 2*m*i*h; step: 3x
        runs = {k: step_fn(*v, dy) for k, v in calls.items()}
        for label in ("te+tfo", "tfo"):
            replay, written = graphed(*calls[label], dy)
            replay()
            expected = grads(*calls[label], dy)
            graph_err = max(rel_err(a, b) for a, b in zip(written, expected))
            assert graph_err <= 1e-2, f"{name}: the graphed {label} step differs from the eager one by {graph_err:.3e}"
            runs[f"{label} graph"] = replay
        times = rotated_medians(runs, step_ms)
        if args.profile:
            print(f"--- {name}: kernels of one step\n{kernel_diff({k: runs[k] for k in ('te+tfo', 'tfo')})}", flush=True)
        host = {k: host_us_per_call(runs[k], calls=2, batches=10) / 1e3 for k in ("te+tfo", "te+tfo 1p", "tfo")}
        payload["shapes"][name] = {"ms": times, "host_ms": host, "max_grad_rel_err": err}
        host_rows.append(f"| {name} | " + " | ".join(f"{host[k]:.2f}" for k in host) + f" | {times['tfo']:.2f} |")
        rows.append(
            f"| {name} | {times['te']:.2f} ({flops / times['te'] / 1e9:.0f}) | {times['te+tfo']:.2f} "
            f"({flops / times['te+tfo'] / 1e9:.0f}) | {times['te+tfo 1p']:.2f} | {times['tfo']:.2f} "
            f"| {times['torch']:.2f} | {times['te'] / times['te+tfo']:.2f}x | {times['te+tfo'] / times['tfo']:.3f} "
            f"| {times['te+tfo 1p'] / times['tfo']:.3f} | {times['te+tfo graph']:.2f} | {times['tfo graph']:.2f} "
            f"| {times['te+tfo graph'] / times['tfo graph']:.3f} "
            f"| {times['torch'] / times['te+tfo']:.2f}x |"
        )
        print(f"{name}: te {times['te']:.2f} ms, te+tfo {times['te+tfo']:.2f} ms, "
              f"te+tfo 1p {times['te+tfo 1p']:.2f} ms, tfo {times['tfo']:.2f} ms, "
              f"torch {times['torch']:.2f} ms, graphed te+tfo {times['te+tfo graph']:.2f} / tfo {times['tfo graph']:.2f} ms",
              flush=True)
        del runs, calls, replay, written, plain, fused, single, ours  # the next shape's models and graphs
        torch.cuda.empty_cache()
    table = "\n".join(
        [
            f"{gpu}, TE {transformer_engine.__version__}, bf16 SwiGLU MLP training step, ms (TFLOPS)",
            "",
            "| shape | te.ops | te.ops + install() | the same, 1p | te_fused_ops Sequential | plain torch | speedup "
            "| (te+tfo)/tfo | (te+tfo 1p)/tfo | te+tfo graph | tfo graph | ratio graphed | te+tfo vs plain torch |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
            *rows,
            "",
            "Host time to issue one step (ms; the GPU time is about the Sequential's step)",
            "",
            "| shape | te+tfo | te+tfo 1p | te_fused_ops Sequential | Sequential step |",
            "|---|---|---|---|---|",
            *host_rows,
        ]
    )
    print(table)
    if args.out:
        write_results(args.out, f"te_ops_{device_tag(gpu)}", payload, table)


if __name__ == "__main__":
    main()
