"""Communication beside computation: a chunked segment of a sequence on two streams.

An op with ``chunks`` n > 1 (``Permute(E, group=g, chunks=n)``) opens a segment that the next op
with ``closes_chunks`` (its ``Unpermute``) closes. The segment runs as n chunks of the local
experts: chunk c holds experts [c L/n, (c+1) L/n) of every rank (L = E / W), the rows routed to
them, and the ops' per-expert parameters (``expert_params``) as slices, so every expert is computed
once and each weight gradient lands in its own slice of one buffer; the chunks' outputs (partial
combines, T x H) and input gradients are summed. The first and last steps of the segment (the
exchanges) run on a side stream, the steps between them (the experts) on the current one:

    side:  dispatch 0 | dispatch 1 | combine 0 | dispatch 2 | combine 1 | ...
    main:             | experts 0              | experts 1              | ...

and the backward alike (the combine's backward as the dispatch, the dispatch's as the combine).
While the experts run beside an exchange, the kernels that take an SM margin leave
``overlap_sms`` SMs free (`reserved_sms`). On the CPU and the meta device there are no streams:
the same order runs on one thread.
"""

import copy
import threading
from dataclasses import dataclass

import torch

from .quantization import QuantizedTensor

_local = threading.local()  # .reserved: SMs the kernels running now leave free
_side_streams: dict = {}  # CUDA device index -> the side stream


def reserved_sms() -> int:
    """SMs that kernels launched now should leave free for the exchanges running beside them."""
    return getattr(_local, "reserved", 0)


class _Reserving:
    def __init__(self, sms: int):
        self.sms = sms

    def __enter__(self):
        self.previous = reserved_sms()
        _local.reserved = max(self.previous, self.sms)

    def __exit__(self, *exc):
        _local.reserved = self.previous


@dataclass(frozen=True)
class Segment:
    """ops[start:stop] run in ``chunks`` chunks (ops[start] opens it, ops[stop - 1] closes it)."""

    start: int
    stop: int
    chunks: int


def find_segment(ops):
    """The chunked `Segment` of ``ops``, or None; an opening op without a closing one raises."""
    for start, op in enumerate(ops):
        if getattr(op, "chunks", 1) > 1:
            stop = next((i + 1 for i in range(start + 1, len(ops)) if getattr(ops[i], "closes_chunks", False)), None)
            if stop is None:
                raise ValueError(f"{op.op_name} (op {start}): chunks={op.chunks} needs an op that closes the chunks "
                                 "(an Unpermute with its group) later in the sequence")
            return Segment(start, stop, op.chunks)
    return None


def segment_steps(ops, segment: Segment, steps: list, passes: str) -> tuple:
    """(first, stop): the indices of the ``passes`` plan ``steps`` over ``segment``, checked to
    cover it alone, its closing op in a step of its own (made once, with the plan)."""
    first = next(i for i, step in enumerate(steps) if segment.start <= step.start < segment.stop)
    stop = first
    while stop < len(steps) and segment.start <= steps[stop].start < segment.stop:
        stop += 1
    spans = [(s.start, s.stop) for s in steps[first:stop]]
    opening, closing = (spans[0], spans[-1]) if passes == "forward" else (spans[-1], spans[0])
    if len(spans) < 2 or opening[0] != segment.start or closing != (segment.stop - 1, segment.stop) or max(
            end for _, end in spans) > segment.stop:
        raise ValueError(f"{ops[segment.start].op_name} (op {segment.start}): the chunked segment [{segment.start}:"
                         f"{segment.stop}] must be planned as steps of its own, its last op alone (the {passes} "
                         f"plan: {', '.join(s.label(ops) for s in steps[first:stop])})")
    return first, stop


def _tensors(value) -> list:
    if isinstance(value, QuantizedTensor):
        return [t for t in vars(value).values() if isinstance(t, torch.Tensor)]
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return _tensors(list(value.values()))
    return []


class Streams:
    """The current stream and a side stream of a CUDA device (elsewhere: one thread, inline)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        if self.cuda:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.main = torch.cuda.current_stream(index)
            if index not in _side_streams:
                _side_streams[index] = torch.cuda.Stream(index, priority=-1)
            self.side = _side_streams[index]

    def on_side(self, fn, inputs):
        """``(fn(), event)``: fn on the side stream after all work queued on the current one so far
        (``inputs`` made on the current stream stay allocated until the side stream used them)."""
        if not self.cuda:
            return fn(), None
        self.side.wait_stream(self.main)
        with torch.cuda.stream(self.side):
            for t in _tensors(inputs):
                t.record_stream(self.side)
            result = fn()
            event = torch.cuda.Event()
            event.record(self.side)
        return result, event

    def take(self, value, event):
        """``value`` made on the side stream, for the current one (which waits for ``event``)."""
        if self.cuda:
            self.main.wait_event(event)
            for t in _tensors(value):
                t.record_stream(self.main)
        return value

    def join(self) -> None:
        if self.cuda:
            self.main.wait_stream(self.side)


def _sum(values: list):
    total = values[0]
    for value in values[1:]:
        total = total + value
    return total


class ChunkedSegment:
    """One call's chunked segment: per chunk, the contexts of its ops and their expert range.

    ``contexts[c]``: a full-length list of contexts, those of the segment's ops chunk c's own
    (the others shared); ``ranges[c]``: (first, stop) of chunk c's local experts;
    ``grad_shapes``: (op index, name) -> (shape, dtype) of each sliced parameter needing a gradient.
    """

    def __init__(self, run, segment: Segment):
        self.segment = segment
        opener = run.ops[segment.start]
        self.ranges = [opener.chunk_experts(c) for c in range(segment.chunks)]
        self.overlap_sms = getattr(opener, "overlap_sms", 0)
        self.contexts, self.grad_shapes = [], {}
        for c, (first, stop) in enumerate(self.ranges):
            ctxs = list(run.ctxs)
            for i in range(segment.start, segment.stop):
                ctx = ctxs[i] = copy.copy(run.ctxs[i])
                ctx.saved, ctx.main_grads, ctx.grad_buffers = type(ctx.saved)(), {}, {}
                ctx.params = dict(ctx.params)
                for name in run.ops[i].expert_params:
                    if name in ctx.params:
                        ctx.params[name] = self._slice(ctx, name, ctx.params[name], first, stop)
            self.contexts.append(ctxs)

    def _slice(self, ctx, name: str, param: torch.Tensor, first: int, stop: int) -> torch.Tensor:
        local = self.ranges[-1][1]
        if param.shape[0] != local:
            raise ValueError(f"{ctx.op.op_name} (op {ctx.index}): parameter '{name}' holds {param.shape[0]} experts "
                             f"but the chunked segment's ranks hold {local} each")
        part = param[first:stop]
        main_grad = getattr(param, "main_grad", None)
        if main_grad is not None:
            part.main_grad = main_grad[first:stop]
        if ctx.needs_grad(name) and not getattr(ctx.op, "accumulate_main_grad", False):
            self.grad_shapes[(ctx.index, name)] = (param.shape, param.dtype)
        return part

    def forward(self, run, steps: list, x):
        """The segment's output: ``steps`` (the plan's forward steps over the segment) per chunk."""
        seg, streams = self.segment, Streams(x.device)
        sides = [run.side.for_chunk(c, seg.chunks) for c in range(seg.chunks)]
        for c, ctxs in enumerate(self.contexts):
            ctxs[seg.start].input_recompute = run.ctxs[seg.start - 1].recompute_output if seg.start else None
            sides[c].bind(run.ops, ctxs, seg.start, seg.stop, x)
        for i in range(seg.start, seg.stop):  # the backward routes side-value gradients by them
            run.ctxs[i].side_sources = self.contexts[0][i].side_sources

        def step(c, at, value):
            ctxs = self.contexts[c]
            if at.start > seg.start:
                ctxs[at.start].input_recompute = ctxs[at.start - 1].recompute_output
            value = at.run(run.ops, ctxs, value, "forward")
            for i in range(at.start, at.stop):
                sides[c].publish(i, ctxs[i])
            return value

        return _sum(self._pipelined(streams, step, steps, x))

    def backward(self, run, steps: list, dy, contexts: list):
        """(dx, per-op grads of the segment's ops) from ``steps`` (the plan's backward steps over
        the segment, last op first) on the unpacked per-chunk ``contexts``."""
        seg, streams = self.segment, Streams(dy.device)
        buffers = {key: torch.empty(shape, dtype=dtype, device=dy.device) for key, (shape, dtype) in
                   self.grad_shapes.items()}
        for c, ctxs in enumerate(contexts):
            begin, end = self.ranges[c]
            for (i, name), buffer in buffers.items():
                ctxs[i].grad_buffers = {name: buffer[begin:end]}
        chunk_grads = [[{} for _ in range(seg.start, seg.stop)] for _ in contexts]

        def step(c, at, value):
            value, grads = at.run(run.ops, contexts[c], value, "backward")
            for i, grad in enumerate(grads or (), at.start):
                chunk_grads[c][i - seg.start] = grad or {}
            return value

        dx_parts = [dx for dx in self._pipelined(streams, step, steps, dy) if dx is not None]
        return (_sum(dx_parts) if dx_parts else None), self._merge(chunk_grads, buffers)

    def _pipelined(self, streams: Streams, step, steps: list, value) -> list:
        """``step(c, at, value)`` over ``steps`` for every chunk c: the first step (on ``value``) and
        the last on the side stream, the others on the current one, chunk c + 1's first step and
        chunk c's last beside chunk c's (c + 1's) others; the last steps' results, in chunk order."""
        first, inner, last = steps[0], steps[1:-1], steps[-1]
        pending = [streams.on_side(lambda: step(0, first, value), value)]
        results = []
        for c in range(self.segment.chunks):
            rows = streams.take(*pending[c])
            if c + 1 < self.segment.chunks:
                pending.append(streams.on_side(lambda c=c: step(c + 1, first, value), value))
            with _Reserving(self.overlap_sms if streams.cuda else 0):
                for at in inner:
                    rows = step(c, at, rows)
            results.append(streams.on_side(lambda c=c, rows=rows: step(c, last, rows), rows))
        streams.join()
        return [streams.take(result, event) for result, event in results]

    def _merge(self, chunk_grads: list, buffers: dict) -> list:
        """Per op of the segment: sliced parameters' gradients as their full buffer (a chunk's
        gradient that was not written in place is copied into its slice), the others summed."""
        merged = []
        for offset in range(self.segment.stop - self.segment.start):
            i, grads = self.segment.start + offset, {}
            for c, per_op in enumerate(chunk_grads):
                for name, grad in per_op[offset].items():
                    if grad is None:
                        continue
                    buffer = buffers.get((i, name))
                    if buffer is not None:
                        begin, end = self.ranges[c]
                        if grad.data_ptr() != buffer[begin:end].data_ptr():
                            buffer[begin:end].copy_(grad)
                        grads[name] = buffer
                    else:
                        grads[name] = grad if name not in grads else grads[name] + grad
            merged.append(grads)
        return merged
