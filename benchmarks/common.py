"""Pieces the benchmarks share: model shapes, routing, torch baselines, timing, result files.

torch is imported inside the functions that use it, so that a GPU-only benchmark can import
``require_sm90`` and exit at once on a machine without a Hopper GPU (importing torch takes seconds).
"""

from __future__ import annotations

import functools
import json
import operator
import os
import re
import sys
import time

MODEL_SHAPES = {  # name: (M tokens, H hidden, I expert width, E local experts)
    "qwen3-30b-a3b": (65536, 2048, 768, 128),
    "dsv3-ep8": (32768, 7168, 2048, 32),
    "mixtral-8x7b": (32768, 4096, 14336, 8),
    "gptoss-120b-ep4": (32768, 2880, 2880, 32),
}


def require_sm90(script: str, kernels: bool = True) -> None:
    """Exit (status 2) with one line, ``<script>: needs a CUDA GPU with sm_90``, unless the GPU this
    process uses (``LOCAL_RANK`` under torchrun, else 0) is an sm_90 one (H100 / H200) that torch
    can use. Called by each GPU-only benchmark before it imports torch, triton or the kernels:
    without a CUDA driver it decides without importing torch. ``kernels``: also exit, with the
    reason, where this library's sm90 backend cannot run (the CuTe DSL not importable, e.g. a
    PYTHONPATH that replaced the one naming it): the library would then time its torch backend
    under the fused contenders' names."""
    name = os.path.basename(script)
    if any(arg in ("-h", "--help") for arg in sys.argv[1:]):  # the options are readable anywhere
        return
    if not _sm90_usable():
        print(f"{name}: needs a CUDA GPU with sm_90", file=sys.stderr, flush=True)
        sys.exit(2)
    if kernels:
        from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason

        reason = sm90_unavailable_reason()
        if reason is not None:
            print(f"{name}: {reason}", file=sys.stderr, flush=True)
            sys.exit(2)


def _sm90_usable() -> bool:
    import ctypes

    try:
        ctypes.CDLL("libcuda.so.1")  # the driver: absent on a machine without an NVIDIA GPU
    except OSError:
        return False
    import torch

    index = int(os.environ.get("LOCAL_RANK", "0"))
    return (torch.cuda.is_available() and index < torch.cuda.device_count()
            and torch.cuda.get_device_capability(index) == (9, 0))


def model_shape(name: str):
    """(M, H, I, E) of a `MODEL_SHAPES` name or of ``MxHxIxE`` (any sizes, e.g. ``32768x2880x1408x16``)."""
    if name in MODEL_SHAPES:
        return MODEL_SHAPES[name]
    try:
        m, h, i, e = (int(v) for v in name.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {name!r} is neither one of {', '.join(MODEL_SHAPES)} nor MxHxIxE") from None
    return m, h, i, e


def mlp_problem(name: str):
    """A model shape's MLP step inputs on the GPU, seed 0: (splits (E,) int64 skewed, multiples of 8;
    fc1 (E, H -> 2I) and fc2 (E, I -> H) bf16 GroupedLinears; x (M, H) requiring grad; dy (M, H))."""
    import torch
    from te_fused_ops import GroupedLinear

    m, h, i, e = model_shape(name)
    torch.manual_seed(0)
    splits = skewed_splits(m, e, 0, align=8).cuda()
    fc1 = GroupedLinear(e, h, 2 * i, dtype=torch.bfloat16, device="cuda")
    fc2 = GroupedLinear(e, i, h, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(m, h, dtype=torch.bfloat16, device="cuda", requires_grad=True)
    dy = torch.randn(m, h, dtype=torch.bfloat16, device="cuda")
    return splits, fc1, fc2, x, dy


def extra_peak_mib(fn) -> float:
    """MiB allocated at the peak of one call of ``fn`` beyond what was allocated before it."""
    import torch

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def live_at_peak(fn, where=("te_fused_ops", "fusion_rules")) -> tuple:
    """What one call of ``fn`` has allocated at its peak: (MiB above the start, [(count, MiB each,
    the innermost frames of files whose path contains one of ``where``)], largest first), from the
    allocator's history over the call (blocks allocated before it are not in it)."""
    import collections
    import os

    import torch

    def frames_of(block):
        kept = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in block.get("frames", [])
                if any(part in f.get("filename", "") for part in where)]
        return " < ".join(kept[:3]) or "?"

    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    try:
        fn()
        torch.cuda.synchronize()
        trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    live, current, peak, at_peak = {}, 0, 0, {}
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            current += event["size"]
            if current > peak:
                peak, at_peak = current, dict(live)
        elif event["action"] == "free_requested" and event["addr"] in live:
            current -= live.pop(event["addr"])["size"]
    groups = collections.Counter((frames_of(b), b["size"]) for b in at_peak.values())
    rows = sorted(((n, size / 2**20, where) for (where, size), n in groups.items()), key=lambda r: -r[0] * r[1])
    return peak / 2**20, rows


def skewed_splits(m: int, e: int, seed: int = 0, align: int = 1) -> torch.Tensor:
    """Skewed routing on the CPU: expert shares ~ U(0,1)^2, counts multiples of ``align``
    (the largest absorbs the rest), summing to m. int64 (e,)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    p = torch.rand(e, generator=gen) ** 2
    s = torch.floor(p / p.sum() * m / align).long() * align
    s[torch.argmax(s)] += m - int(s.sum())
    return s


def host_us_per_call(fn, calls: int = 100, batches: int = 30) -> float:
    """Host time per call: min over batches of back-to-back calls, synchronized between batches so
    the launch queue never fills (else GPU time would be measured)."""
    import torch

    best = float("inf")
    for _ in range(batches):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def rotated_medians(fns: dict, time_us) -> dict:
    """label -> median of ``time_us(fn)`` over 2 x len(fns) rounds in which every variant takes
    every position, in rotated and then reversed order, after one warm-up pass: a variant timed
    first after an idle gap runs at a higher clock under the power cap, so a fixed order (or the
    least of a few rounds) favours it (`sustained_ms` removes most of that bias itself)."""
    labels = list(fns)
    for label in labels:
        time_us(fns[label])
    samples = {label: [] for label in labels}
    for r in range(2 * len(labels)):
        order = labels[r % len(labels):] + labels[: r % len(labels)]
        for label in order if r < len(labels) else order[::-1]:
            samples[label].append(time_us(fns[label]))
    return {label: sorted(v)[len(v) // 2] for label, v in samples.items()}


def time_and_print_variants(shapes: str, variants, check, warm_s: float, time_s: float) -> dict:
    """Per shape of the comma-separated ``shapes``: ``fns = variants(name)`` (label -> call),
    ``check(fns)``, then each call's time in us (`sustained_ms` medians of `rotated_medians`),
    printed as it comes and as one markdown table (shapes by labels) at the end. Returns
    {shape: {label: us}}."""
    import torch

    results = {}
    for name in shapes.split(","):
        fns = variants(name)
        check(fns)
        results[name] = {label: 1e3 * ms for label, ms in
                         rotated_medians(fns, lambda fn: sustained_ms(fn, warm_s, time_s)).items()}
        for label, us in results[name].items():
            print(f"  {name:20s} {label:16s} {us:8.1f} us", flush=True)
    labels = list(next(iter(results.values())))
    print(f"\nus, {torch.cuda.get_device_name()}\n")
    print("| shape | " + " | ".join(labels) + " |\n|---|" + "---|" * len(labels))
    for name, us in results.items():
        print(f"| {name} | " + " | ".join(f"{us[label]:.0f}" for label in labels) + " |")
    return results


def slot_terms_sum(terms):
    """The sum over a token's k slots written out term by term (compiled per shape): inductor
    compiles ``.sum(1)`` over k >= 8 slots (its unroll threshold) into a reduction kernel, which ran
    the k = 8 gather-sums at about a third of memory speed on an H100; the unrolled sum is one
    elementwise kernel with the same bits."""
    return functools.reduce(operator.add, terms)


def compile_per_shape(fn):
    """``torch.compile`` with one static kernel per shape, what a user training one model gets: the
    default recompiles with dynamic sizes once a shape loop reaches its second shape (a 5-9% slower
    plain-torch step on H100). Dynamo's recompile limit (8) is raised so every shape of a run keeps
    its kernel instead of falling back to eager."""
    import torch

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=False)


@functools.cache
def _l2_flush_buffer() -> torch.Tensor:
    """256 MiB, zeroed before every timed call (as triton's do_bench does)."""
    import torch

    return torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")


def accumulation_step(micro_batch, optimizer_step, micro_batches: int):
    """One optimizer step of a gradient-accumulation loop as one call: ``micro_batch()``
    ``micro_batches`` times, then ``optimizer_step()``. Its ``micro_batches`` attribute makes the
    timers (`sustained_ms`, `per_micro_batch`) report the average micro-batch of the step: timed
    one call each, the median micro-batch would be one that found the weights already cast."""
    def step():
        for _ in range(micro_batches):
            micro_batch()
        optimizer_step()
    step.micro_batches, step.micro_batch, step.optimizer_step = micro_batches, micro_batch, optimizer_step
    return step


def per_micro_batch(fn, ms: float) -> float:
    """``ms`` of one call of ``fn`` per micro-batch it runs (an `accumulation_step` runs several)."""
    return ms / getattr(fn, "micro_batches", 1)


def sustained_ms(fn, warm_s: float = 0.4, time_s: float = 0.4) -> float:
    """Median ms per call of ``fn`` (per micro-batch of an `accumulation_step`) at the clock a long
    run settles at: ``fn`` runs back to back for ``warm_s`` first, then ~``time_s`` of calls are
    each timed by CUDA events (L2 flushed before each), with no host sync between them. An H100 at its 700 W cap leaves its 1980 MHz
    boost within ~0.1 s of a GEMM load and settles at 1300-1700 MHz depending on the kernels, so a
    ~100 ms do_bench window measures a mix of the two that depends on what ran just before. A first
    call runs before the warm-up window: it may compile the kernel (seconds of an idle GPU, which
    would otherwise fill the window and leave a handful of calls timed straight after it)."""
    import torch

    flush = _l2_flush_buffer()
    fn()
    torch.cuda.synchronize()
    calls, start = 0, time.perf_counter()
    while True:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        if elapsed >= warm_s:
            break
    return per_micro_batch(fn, median_event_ms(fn, max(8, round(time_s * calls / elapsed)), flush))


def median_event_ms(fn, calls: int, flush) -> float:
    """Median ms of ``calls`` calls of ``fn`` queued back to back, each timed by CUDA events with
    the L2 flushed (``flush.zero_()``) before it."""
    import torch

    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    for begin, end in events:
        flush.zero_()
        begin.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return sorted(begin.elapsed_time(end) for begin, end in events)[calls // 2]


def clock_and_power(fn, seconds: float = 2.0, interval_ms: int = 50) -> dict:
    """The SM clock and board power while ``fn`` runs back to back for ``seconds`` after 0.5 s of
    warm-up, sampled by ``nvidia-smi`` every ``interval_ms`` ms: medians of ``sm_mhz`` and
    ``power_w``, the ``power_limit_w`` and ``samples``; {} where nvidia-smi is missing or
    returns no samples."""
    import shutil
    import statistics
    import subprocess

    import torch

    if shutil.which("nvidia-smi") is None:
        return {}
    index = torch.cuda.current_device()
    query = ["nvidia-smi", "-i", str(index), "--query-gpu=clocks.sm,power.draw,power.limit",
             "--format=csv,noheader,nounits", f"-lms={interval_ms}"]
    end = time.perf_counter() + 0.5
    while time.perf_counter() < end:
        fn()
        torch.cuda.synchronize()
    sampler = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(4):
            fn()
        torch.cuda.synchronize()
    sampler.terminate()
    rows = []
    for line in sampler.communicate()[0].splitlines():
        try:
            rows.append([float(v) for v in line.split(",")])
        except ValueError:
            continue
    if not rows:
        return {}
    return {"sm_mhz": statistics.median(r[0] for r in rows), "power_w": statistics.median(r[1] for r in rows),
            "power_limit_w": rows[-1][2], "samples": len(rows)}


def gpu_us_per_kernel(fn, launches: dict | None = None) -> dict:
    """GPU microseconds per kernel name in one call of ``fn`` after a warm-up call (torch.profiler);
    ``launches``: filled with each name's launch count."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name] = kernels.get(event.name, 0.0) + event.device_time_total
            if launches is not None:
                launches[event.name] = launches.get(event.name, 0) + 1
    return kernels


def kernel_timeline(fn, gaps_listed: int = 6) -> dict:
    """One call of ``fn`` after a warm-up call, under torch.profiler, as a timeline of its GPU work
    (`timeline_of`). The call is queued behind a GPU sleep of 5-8 ms, so that the host is ahead of
    the GPU as in a training loop (and in `sustained_ms`) and the gaps are the GPU's own, not the
    host's latency to its first launches. Returns ``span_us`` from the first kernel's start to the
    last one's end, ``busy_us`` (the union of the kernels' intervals, memsets and copies included),
    ``idle_us`` = span - busy, ``kernels`` (the launch count) and ``gaps``: the largest idle
    intervals between consecutive kernels, each {us, after, before} (the names on either side,
    shortened)."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(10**7)  # 10 M cycles: 5-8 ms at the clocks of an H100 / H200
        fn()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    work = sorted((e["ts"], e["ts"] + e["dur"], _short_kernel_name(e["name"])) for e in events
                  if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy") and "dur" in e)
    return timeline_of(work[1:], gaps_listed)  # after the sleep


def timeline_of(work: list, gaps_listed: int = 6) -> dict:
    """`kernel_timeline`'s summary of ``work``: (start us, end us, name) intervals sorted by start,
    overlapping ones allowed (a gap is time no interval covers); ``launches``: each interval's
    {name, us} in start order."""
    if not work:
        return {"span_us": 0.0, "busy_us": 0.0, "idle_us": 0.0, "kernels": 0, "gaps": [], "launches": []}
    gaps, end, last = [], work[0][1], work[0][2]
    for start, stop, name in work[1:]:
        if start > end:
            gaps.append({"us": start - end, "after": last, "before": name})
        if stop >= end:
            end, last = stop, name
    span = end - work[0][0]
    idle = sum(g["us"] for g in gaps)
    gaps.sort(key=lambda g: -g["us"])
    return {"span_us": span, "busy_us": span - idle, "idle_us": idle, "kernels": len(work),
            "gaps": gaps[:gaps_listed],
            "launches": [{"name": name, "us": stop - start} for start, stop, name in work]}


def _short_kernel_name(name: str) -> str:
    """A kernel's name without its template and argument lists or the CuTe DSL's module prefix."""
    name = re.sub(r"^kernel_cutlass_kernel_", "", name)
    name = re.sub(r"^te_fused_opsbackendssm90kernels", "", name)
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)" and depth:
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out)[:60]


def print_timeline(label: str, timeline: dict) -> None:
    """`kernel_timeline`'s summary, one line, then its gaps."""
    print(f"  {label}: {timeline['kernels']} kernels over {timeline['span_us']:.0f} us, busy "
          f"{timeline['busy_us']:.0f} us, idle {timeline['idle_us']:.0f} us", flush=True)
    for g in timeline["gaps"]:
        print(f"    gap {g['us']:7.1f} us  after {g['after']}  before {g['before']}", flush=True)


def device_tag(device_name: str) -> str:
    """Short tag for result file names: h100, h200 or gpu."""
    return "h100" if "H100" in device_name else ("h200" if "H200" in device_name else "gpu")


def write_results(out: str, stem: str, payload: dict, table: str) -> None:
    """``out``/``stem``.json (payload) and .md (table)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{stem}.json"), "w") as f:
        json.dump(payload, f, indent=1)
    with open(os.path.join(out, f"{stem}.md"), "w") as f:
        f.write(table + "\n")
