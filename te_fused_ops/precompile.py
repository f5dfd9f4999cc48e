"""Warm the on-disk kernel cache before a job: ``python -m te_fused_ops.precompile``.

Builds the expert MLP (or, with ``--moe``, the routed layer) for the given shapes and recipes and
runs one forward and backward of each on random data, on the GPU the job will use, so every kernel
those steps launch is compiled once and written to the cache (`te_fused_ops.kernel_cache`). Later
processes, e.g. the ranks of the job, load them instead of compiling. Kernel choices depend on the
token count, so pass the counts a rank sees (``--tokens`` takes several).

``--jobs N`` first records the steps' kernels (one run with the missing ones put off) and compiles
them in N forked processes (`compile_step_kernels`), then runs the steps, which load them.

Example (qwen3-30b-a3b experts, bf16 and FP8)::

    python -m te_fused_ops.precompile --experts 128 --hidden 2048 --ffn 768 --tokens 8192 \\
        --moe --topk 8 --recipe bf16 --recipe fp8_blockwise
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from . import kernel_cache
from .fusion import forced_backend
from .ops import ClampedSwiGLU, GeGLU, GroupedLinear, Permute, Quantize, ScaledSwiGLU, SReLU, SwiGLU, Transpose, Unpermute
from .sequential import Sequential

ACTIVATION_OPS = {op.kernel_name: op for op in (SwiGLU, GeGLU, SReLU, ClampedSwiGLU, ScaledSwiGLU)}
RECIPES = ("bf16", "fp8_blockwise", "fp8_current")


def build_layer(args, recipe: str, device) -> Sequential:
    """The layer a training step of ``args`` runs under ``recipe`` (bf16, or FP8 casts before both
    linears, FC2's input with its column-wise copy)."""
    act_op = ACTIVATION_OPS[args.activation]
    fc1_out = 2 * args.ffn if act_op is not SReLU else args.ffn
    kw = dict(device=device, dtype=args.dtype)
    fc1 = GroupedLinear(args.experts, args.hidden, fc1_out, **kw)
    fc2 = GroupedLinear(args.experts, args.ffn, args.hidden, **kw)
    ops = [fc1, act_op(), fc2]
    if recipe != "bf16":
        ops = [Quantize(recipe), fc1, act_op(), Quantize(recipe), Transpose(), fc2]
    if args.moe:
        ops = [Permute(args.experts), *ops, Unpermute()]
    return Sequential(*ops)


def run_step(layer: Sequential, args, tokens: int, device) -> dict:
    """One forward and backward of ``layer`` on ``tokens`` random tokens (random routing); the
    output and every gradient, by name."""
    x = torch.randn(tokens, args.hidden, device=device, dtype=args.dtype, requires_grad=True)
    if args.moe:
        indices = torch.randint(0, args.experts, (tokens, args.topk), device=device)
        side = {"indices": indices, "probs": torch.rand(tokens, args.topk, device=device)}
    else:
        side = {"split_sizes": torch.full((args.experts,), tokens // args.experts, device=device)}
        if args.activation == "scaled_swiglu":
            side["probs"] = torch.rand(tokens, device=device)
    out = layer(x, **side)
    out.float().square().mean().backward()
    torch.cuda.synchronize(device)
    grads = {f"grad {name}": p.grad for name, p in layer.named_parameters()}
    return {"out": out.detach(), "grad x": x.grad, **grads}


def compile_step_kernels(step, workers: int | None = None, timeout_s: float = 600.0) -> dict:
    """Compile every kernel ``step()`` launches in parallel processes, before its first real run.

    ``step`` runs once inside `kernel_cache.recording()`: a kernel missing from the on-disk cache
    is neither compiled nor launched there, so what that run computes, and any state it updates
    (gradients, cached weight casts), is garbage: give it a throwaway layer, as the command line
    does. The kernels are then compiled in ``workers`` forked processes (default: one per kernel,
    at most the CPUs less one) into the cache, and the next run of ``step`` loads them (a
    slow-to-compile kernel's stand-in, the same bits, runs while it still compiles in the
    background). Returns
    `kernel_cache.compile_in_workers`'s report with "record s"; {"skipped": reason} where the
    cache is off or unusable (then the kernels compile when first launched, as usual)."""
    if not kernel_cache.enabled():
        return {"skipped": "TE_FUSED_OPS_KERNEL_CACHE=0 turns the cache off"}
    reason = kernel_cache.directory_unsafe_reason(kernel_cache.cache_dir())
    if reason:
        return {"skipped": f"cache directory not usable: {reason}"}
    started = time.perf_counter()
    with kernel_cache.recording() as requests:
        step()
    recorded = time.perf_counter() - started
    if workers is None:  # kernels with a stand-in compile in background processes of their own
        waited_for = sum(request.stand_in is None for request in requests)
        workers = min(max(1, waited_for), max(1, (os.cpu_count() or 2) - 1))
    return {**kernel_cache.compile_in_workers(requests, workers, timeout_s), "record s": recorded}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}")
    return value


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="python -m te_fused_ops.precompile", description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=_positive_int, required=True, help="experts (groups) on this rank")
    parser.add_argument("--hidden", type=_positive_int, required=True, help="model width H")
    parser.add_argument("--ffn", type=_positive_int, required=True, help="expert width I (FC1 makes 2I for a GLU)")
    parser.add_argument("--tokens", type=_positive_int, nargs="+", action="extend",
                        help="tokens per step (several allowed, repeatable; default 8192)")
    parser.add_argument("--activation", default="swiglu", choices=sorted(ACTIVATION_OPS))
    parser.add_argument("--recipe", action="append", choices=RECIPES, help="bf16 (default) or an FP8 recipe; repeatable")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--moe", action="store_true", help="the routed layer: Permute .. Unpermute around the MLP")
    parser.add_argument("--topk", type=_positive_int, default=8, help="slots per token with --moe")
    parser.add_argument("--jobs", type=_positive_int, default=1,
                        help="compile the steps' kernels in this many processes first (forked; 1: one after another)")
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)
    args.recipe = args.recipe or ["bf16"]
    args.tokens = args.tokens or [8192]
    return args


def _refuse(reason: str):
    raise SystemExit(f"te_fused_ops.precompile: {reason}")


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        _refuse("needs the GPU the job runs on (the kernels are built for it)")
    from .backends.sm90.kernels import sm90_unavailable_reason

    major, minor = torch.cuda.get_device_capability()
    reason = sm90_unavailable_reason() or ((major, minor) != (9, 0) and f"compute capability {major}.{minor}, needs 9.0")
    if reason:
        _refuse(f"the sm90 kernels cannot run here ({reason}): there is nothing to compile")
    try:  # a bad switch value is one line, as the other refusals
        if forced_backend() not in (None, "sm90"):
            _refuse(f"TE_FUSED_OPS_BACKEND={forced_backend()} runs no sm90 kernel: there is nothing to compile")
        if not kernel_cache.enabled():
            _refuse("TE_FUSED_OPS_KERNEL_CACHE=0 turns the cache off")
        directory = kernel_cache.cache_dir()
        reason = kernel_cache.directory_unsafe_reason(directory)
    except ValueError as e:
        _refuse(str(e))
    if reason:
        _refuse(f"cache directory not usable: {reason}")
    device = torch.device("cuda", torch.cuda.current_device())
    started = time.perf_counter()
    if args.jobs > 1:
        layers = {recipe: build_layer(args, recipe, device) for recipe in args.recipe}

        def every_step():
            for recipe, layer in layers.items():
                for tokens in args.tokens:
                    run_step(layer, args, tokens, device)

        report = compile_step_kernels(every_step, args.jobs)
        del layers, every_step  # the recording run's layers hold garbage: built again below
        print(f"{report['requests']} kernels compiled in {report['workers']} processes: {report['seconds']:.1f} s "
              f"(recording the steps {report['record s']:.1f} s, {report['failed workers']} failed)", flush=True)
    for recipe in args.recipe:
        layer = build_layer(args, recipe, device)
        for tokens in args.tokens:
            step_start = time.perf_counter()
            run_step(layer, args, tokens, device)
            print(f"{recipe:14s} tokens {tokens:6d}: {time.perf_counter() - step_start:6.1f} s", flush=True)
    if not kernel_cache.wait_for_background():  # the kernels the steps ran stand-ins for
        print("background compiles still running after 600 s: stopped, their kernels not written", flush=True)
    stats = kernel_cache.stats()
    print(f"kernel cache {directory}: {stats['compiled']} compiled, {stats['written']} written, {stats['loaded']} "
          f"already there; {time.perf_counter() - started:.1f} s (compiling {stats['compile s']:.1f}, writing "
          f"{stats['write s']:.1f}, loading {stats['load s']:.1f})")
    if stats["written"] < stats["compiled"]:
        print(f"te_fused_ops.precompile: {stats['compiled'] - stats['written']} compiled kernels could not be written "
              "(see the warnings above): the job would compile them again", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
