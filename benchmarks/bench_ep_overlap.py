"""Expert parallelism on 2 GPUs: all-to-all overlapped with the grouped MLP, per SM margin.

    torchrun --nproc-per-node 2 benchmarks/bench_ep_overlap.py [--shapes dsv3-ep8,...] [--out DIR]

Per shape (M rows = the received buffer of one micro-batch, W * C slots; H, I, E local experts
from common.MODEL_SHAPES; bf16, SwiGLU; 90% of the slots used, skewed over the experts), each
micro-batch i of a step has
  pre(i)   two all_to_all_single of (M, H): the tokens to the experts (dispatch) and the output
           gradient to the experts (the combine's backward)
  mlp(i)   te_fused_ops Sequential(GroupedLinear, SwiGLU, GroupedLinear) forward + backward
  post(i)  two all_to_all_single of (M, H): the output back (combine) and the input gradient back
           (the dispatch's backward)
Schedules over B micro-batches (weight gradients accumulate over them):
  serial     pre(i), mlp(i), post(i) one after the other on one stream
  overlap    mlp(i) on the compute stream while a communication stream runs pre(i+1) and post(i-1)
  compute    mlp(i) only;  comm: pre(i), post(i) only
The sm90 kernels are persistent: with SM margin 0 they hold every SM, and NCCL's kernels wait for
a free one. TE_FUSED_OPS_SM_MARGIN leaves SMs free; the exchanges run on a high-priority stream,
with NCCL's default CTA count or (``NCCL CTAs = margin``) in a group whose communicator is limited
to as many CTAs as the margin frees. Times: median of CUDA-event-timed steps, max over the ranks.
"""

import argparse
import os

from common import require_sm90

if __name__ == "__main__":  # before torch, triton and the kernels load: one line, exit 2, on other machines
    require_sm90(__file__)

import torch
import torch.distributed as dist
from common import MODEL_SHAPES, device_tag, skewed_splits, write_results

from te_fused_ops import GroupedLinear, Sequential, SwiGLU

SM_MARGIN = "TE_FUSED_OPS_SM_MARGIN"  # read by the sm90 backend at each call


class Step:
    """Buffers of B micro-batches of one shape and the schedules over them."""

    def __init__(self, shape, micro_batches, device, seed):
        rows, hidden, ffn, experts = shape
        self.group = None  # the process group of the exchanges (None: the default group)
        self.mlp = Sequential(
            GroupedLinear(experts, hidden, 2 * ffn, dtype=torch.bfloat16, device=device),
            SwiGLU(),
            GroupedLinear(experts, ffn, hidden, dtype=torch.bfloat16, device=device),
        )
        used = int(0.9 * rows)

        def buffer():
            return torch.randn(rows, hidden, dtype=torch.bfloat16, device=device)

        self.send_x = [buffer() for _ in range(micro_batches)]
        self.send_dy = [buffer() for _ in range(micro_batches)]
        self.recv_x = [torch.empty_like(t) for t in self.send_x]
        self.recv_dy = [torch.empty_like(t) for t in self.send_dy]
        self.back_y = [torch.empty_like(t) for t in self.send_x]
        self.back_dx = [torch.empty_like(t) for t in self.send_x]
        self.splits = [skewed_splits(used, experts, seed + i).to(device) for i in range(micro_batches)]
        self.outputs = [None] * micro_batches  # (y, dx) of mlp(i), read by post(i)
        self.comm = torch.cuda.Stream(device, priority=-1)  # high priority: NCCL first to a free SM

    def pre(self, i):
        dist.all_to_all_single(self.recv_x[i], self.send_x[i], group=self.group)
        dist.all_to_all_single(self.recv_dy[i], self.send_dy[i], group=self.group)

    def run_mlp(self, i):
        x = self.recv_x[i].detach().requires_grad_()
        y = self.mlp(x, split_sizes=self.splits[i])
        y.backward(self.recv_dy[i])
        self.outputs[i] = (y.detach(), x.grad)

    def post(self, i):
        y, dx = self.outputs[i]
        for t in (y, dx):
            t.record_stream(torch.cuda.current_stream())
        dist.all_to_all_single(self.back_y[i], y, group=self.group)
        dist.all_to_all_single(self.back_dx[i], dx, group=self.group)

    def clear_grads(self):
        for p in self.mlp.parameters():
            p.grad = None

    def serial(self):
        self.clear_grads()
        for i in range(len(self.splits)):
            self.pre(i)
            self.run_mlp(i)
            self.post(i)

    def compute_only(self):
        self.clear_grads()
        for i in range(len(self.splits)):
            self.run_mlp(i)

    def comm_only(self):
        for i in range(len(self.splits)):
            self.outputs[i] = (self.send_x[i], self.send_dy[i])
            self.pre(i)
            self.post(i)

    def overlap(self):
        self.clear_grads()
        compute, n = torch.cuda.current_stream(), len(self.splits)
        pre_done = [torch.cuda.Event() for _ in range(n)]
        mlp_done = [torch.cuda.Event() for _ in range(n)]
        self.comm.wait_stream(compute)
        with torch.cuda.stream(self.comm):
            self.pre(0)
            pre_done[0].record()
        for i in range(n):
            compute.wait_event(pre_done[i])
            self.run_mlp(i)
            mlp_done[i].record()
            with torch.cuda.stream(self.comm):
                if i + 1 < n:
                    self.pre(i + 1)
                    pre_done[i + 1].record()
                if i >= 1:
                    self.comm.wait_event(mlp_done[i - 1])
                    self.post(i - 1)
        with torch.cuda.stream(self.comm):
            self.comm.wait_event(mlp_done[n - 1])
            self.post(n - 1)
        compute.wait_stream(self.comm)


def time_ms(fn, warmup=3, iters=10):
    """Median step time over ``iters`` CUDA-event-timed runs, max over the ranks."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median = torch.tensor([sorted(times)[len(times) // 2]], device="cuda")
    dist.all_reduce(median, op=dist.ReduceOp.MAX)
    return median.item()


def check_overlap_matches_serial(step):
    """The overlapped schedule computes what the serial one does (outputs, returned gradients and
    weight gradients bit for bit: same kernels, same order per stream)."""
    step.serial()
    want = [t.clone() for t in step.back_y + step.back_dx] + [p.grad.clone() for p in step.mlp.parameters()]
    for t in step.back_y + step.back_dx:
        t.fill_(float("nan"))
    step.overlap()
    torch.cuda.synchronize()
    got = step.back_y + step.back_dx + [p.grad for p in step.mlp.parameters()]
    return all(torch.equal(a, b) for a, b in zip(got, want))


def render_table(payload: dict) -> str:
    """The markdown table of a result. bound: what the overlap schedule can reach, compute + the
    exchanges nothing overlaps (pre of the first and post of the last micro-batch)."""
    b = payload["micro_batches"]
    rows = [
        f"{payload['world']} x {payload['device']}, {b} micro-batches per step, bf16; ms per step (max over ranks)",
        "",
        "| shape | SM margin | NCCL CTAs | serial | overlap | serial/overlap | compute only | comm only | bound |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, result in payload["shapes"].items():
        for config, t in result["margins"].items():
            margin, ctas = config.split("/")
            rows.append(
                f"| {name} | {margin} | {ctas} | {t['serial_ms']:.2f} | {t['overlap_ms']:.2f} "
                f"| {t['serial_ms'] / t['overlap_ms']:.2f}x | {t['compute_ms']:.2f} | {t['comm_ms']:.2f} "
                f"| {t['compute_ms'] + t['comm_ms'] / b:.2f} |"
            )
        rows.append(f"| {name} | best: {result['best_margin']} | | | | | | | |")
    return "\n".join(rows)


def limited_group(ctas: int):
    """A group over every rank whose NCCL communicator uses at most ``ctas`` CTAs."""
    options = dist.ProcessGroupNCCL.Options()
    options.config.min_ctas = 1
    options.config.max_ctas = ctas
    return dist.new_group(backend="nccl", pg_options=options)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="dsv3-ep8,qwen3-30b-a3b")
    ap.add_argument("--margins", default="0,8,16")
    ap.add_argument("--micro-batches", type=int, default=4)
    ap.add_argument("--out", default=None, help="folder for the JSON/markdown result (rank 0; default: print only)")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    gpu = torch.cuda.get_device_name()
    margins = [int(m) for m in args.margins.split(",")]
    configs = [(m, None) for m in margins] + [(m, limited_group(m)) for m in margins if m > 0]
    payload = {"device": gpu, "world": world, "micro_batches": args.micro_batches, "shapes": {}}
    for name in args.shapes.split(","):
        torch.manual_seed(rank)
        step = Step(MODEL_SHAPES[name], args.micro_batches, torch.device("cuda", local_rank), seed=rank)
        os.environ[SM_MARGIN] = "0"
        ok = torch.tensor([float(check_overlap_matches_serial(step))], device="cuda")
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if ok.item() != 1.0:
            raise SystemExit(f"{name}: the overlapped schedule differs from the serial one")
        result = {"margins": {}}
        for margin, group in configs:
            os.environ[SM_MARGIN] = str(margin)
            step.group = group
            ctas = "default" if group is None else str(margin)
            timed = [time_ms(fn) for fn in (step.serial, step.overlap, step.compute_only, step.comm_only)]
            serial, overlap, compute, comm = timed
            result["margins"][f"{margin}/{ctas}"] = dict(zip(("serial_ms", "overlap_ms", "compute_ms", "comm_ms"), timed))
            if rank == 0:
                print(f"{name}: margin {margin}, NCCL CTAs {ctas}: serial {serial:.2f} ms, overlap {overlap:.2f} ms", flush=True)
        step.group = None
        best = min(result["margins"], key=lambda m: result["margins"][m]["overlap_ms"])
        result["best_margin"] = best
        payload["shapes"][name] = result
        del step
        torch.cuda.empty_cache()
    os.environ.pop(SM_MARGIN, None)
    table = render_table(payload)
    if rank == 0:
        print(table)
        if args.out:
            write_results(args.out, f"ep_overlap_{device_tag(gpu)}x{world}", payload, table)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
