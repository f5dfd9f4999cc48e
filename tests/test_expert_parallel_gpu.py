"""The expert-parallel layer on 2 GPUs over NCCL: bf16 and FP8, with and without the overlap
(``chunks``), static capacity and dropless (exact sizes), equal to the single-GPU layer on all ranks' tokens (output, gradients of x, probs and
every rank's experts); sync-free with a static capacity; one CUDA graph of the whole step replayed
with three routings equals eager; FSDP2 on the router beside the experts. Skipped without 2 GPUs."""

import faulthandler
import os
import sys

import pytest
import torch
import torch.distributed as dist
from spawn import process_group, spawn

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

WORLD, E, H, I, T, K = 2, 8, 256, 128, 512, 2


def tokens(rank, step=0):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(T, H, generator=gen)
    indices = torch.randint(-1, E, (T, K), generator=gen)
    return x, indices, torch.rand(T, K, generator=gen), torch.randn(T, H, generator=gen)


def layers(group, chunks, fp8, local, device, capacity_factor):
    from te_fused_ops import GroupedLinear, Permute, Quantize, Sequential, SwiGLU, Unpermute

    torch.manual_seed(0)
    kw = dict(dtype=torch.bfloat16, device=device)
    full1, full2 = GroupedLinear(E, H, 2 * I, **kw), GroupedLinear(E, I, H, **kw)
    fc1, fc2 = GroupedLinear(local.stop - local.start, H, 2 * I, **kw), GroupedLinear(local.stop - local.start, I, H, **kw)
    with torch.no_grad():
        fc1.weight.copy_(full1.weight[local])
        fc2.weight.copy_(full2.weight[local])
    cast = [Quantize("fp8_blockwise")] if fp8 else []
    layer = Sequential(Permute(E, group=group, capacity_factor=capacity_factor, chunks=chunks), *cast, fc1, SwiGLU(),
                       fc2, Unpermute(group=group))
    reference = Sequential(Permute(E), *cast, full1, SwiGLU(), full2, Unpermute())
    return layer, reference


CONFIGS = [  # (chunks, fp8, capacity_factor): WORLD static and dropless; None dropless with exact sizes (one host read)
    (1, False, float(WORLD)), (2, False, float(WORLD)), (2, True, float(WORLD)), (1, False, None),
]


def _worker(rank, init_file, chunks, fp8, capacity_factor):
    # every 240 s each rank prints where it is (a collective that never returns, or a long compile);
    # run with -s to see it and the configuration lines as they come
    faulthandler.dump_traceback_later(240, repeat=True)
    sys.path.insert(0, os.path.dirname(__file__))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    with process_group("nccl", init_file, rank, WORLD):
        import reference as ref

        from te_fused_ops import CudaGraphStep

        group, per_rank = dist.group.WORLD, E // WORLD
        local = slice(rank * per_rank, (rank + 1) * per_rank)
        static_capacity = capacity_factor is not None
        where = f"rank {rank}, chunks {chunks}, fp8 {fp8}, capacity_factor {capacity_factor}"
        print(where, flush=True)
        layer, reference = layers(group, chunks, fp8, local, device, capacity_factor)
        plan = layer.explain(torch.empty(T, H, dtype=torch.bfloat16, device=device, requires_grad=True),
                             indices=tokens(rank)[1].to(device), probs=tokens(rank)[2].to(device))
        rules = ["'unpermute' (backend sm90)", "'unpermute_backward' (backend sm90)",
                 "'permute_backward' (backend sm90)",
                 "'permute+quantize' (backend sm90)" if fp8 else "'permute' (backend sm90)"]
        assert all(rule in plan for rule in rules), plan
        x, indices, probs, dy = (t.to(device) for t in tokens(rank))
        x, probs = x.bfloat16().requires_grad_(), probs.requires_grad_()
        layer(x, indices=indices, probs=probs).float().backward(dy)  # compiles the kernels
        x.grad = probs.grad = None
        layer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error" if static_capacity else 0)  # static capacity: no host read
        try:
            y = layer(x, indices=indices, probs=probs)
            y.float().backward(dy)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        batches = [tokens(r) for r in range(WORLD)]
        xs = torch.cat([b[0] for b in batches]).to(device, torch.bfloat16).requires_grad_()
        ps = torch.cat([b[2] for b in batches]).to(device).requires_grad_()
        ry = reference(xs, indices=torch.cat([b[1] for b in batches]).to(device), probs=ps)
        ry.float().backward(torch.cat([b[3] for b in batches]).to(device))
        mine = slice(rank * T, (rank + 1) * T)
        tol = 3e-2 if fp8 else 1e-2
        # FP8: the one-GPU layer casts FC1's input column-wise from its bf16 rows; the
        # expert-parallel FC1 receives E4M3 rows only and its FP8 weight gradient casts them
        # column-wise again (`quantized_input_param_grads`), so dW1 differs by a second E4M3 cast
        tols = {"dw1": 1e-1} if fp8 else {}
        for name, got, want in [("y", y, ry[mine]), ("dx", x.grad, xs.grad[mine]),
                                ("dprobs", probs.grad, ps.grad[mine]),
                                ("dw1", layer[-4].weight.grad, reference[-4].weight.grad[local]),
                                ("dw2", layer[-2].weight.grad, reference[-2].weight.grad[local])]:
            err = ref.rel_err(got, want)
            assert err <= tols.get(name, tol), f"{where}: {name} rel err {err:.2e}"
        assert int(layer[0].dropped) == 0, where
        # the eager graphs hold the parameters' AccumulateGrad nodes, made on the default
        # stream: released before capturing (a capture may not make that stream wait)
        del y, ry, x, probs, xs, ps
        if not static_capacity:  # the exchanged sizes are read on the host: not capturable
            dist.barrier()
            return

        # one CUDA graph of the whole step, replayed with three routings, equals eager
        static = [t.to(device) for t in tokens(rank)[:3]]
        static[0] = static[0].bfloat16()
        static[0].requires_grad_()
        static[2].requires_grad_()
        params = [layer[-4].weight, layer[-2].weight]

        def step():
            for t in (static[0], static[2], *params):
                t.grad = None
            out = layer(static[0], indices=static[1], probs=static[2])
            out.float().backward(dy)
            return out.detach()

        graphed = CudaGraphStep(step)
        for replay in range(1, 4):
            nx, ni, npr, _ = (t.to(device) for t in tokens(rank, replay))
            with torch.no_grad():
                static[0].copy_(nx.bfloat16())
                static[1].copy_(ni)
                static[2].copy_(npr)
            out = graphed()
            ex, ep = nx.bfloat16().requires_grad_(), npr.clone().requires_grad_()
            want = layer(ex, indices=ni, probs=ep)
            grads = torch.autograd.grad(want.float(), [ex, ep, *params], dy)
            got = [out, static[0].grad, static[2].grad, *(p.grad for p in params)]
            for a, b in zip(got, [want, *grads]):
                assert torch.equal(a, b), f"{where}: CUDA graph replay {replay} differs from eager"
        del graphed, out  # the graph holds the captured exchanges: released before the group is torn down
        torch.cuda.synchronize()
        dist.barrier()


@pytest.mark.parametrize("chunks,fp8,capacity_factor", CONFIGS)
def test_expert_parallel_layer_on_two_gpus_equals_one_gpu(chunks, fp8, capacity_factor, tmp_path):
    spawn(_worker, (str(tmp_path / "init"), chunks, fp8, capacity_factor), WORLD)


def _fsdp_worker(rank, init_file):
    """FSDP2 on the router (NCCL) beside two overlapped chunks of each rank's experts."""
    sys.path.insert(0, os.path.dirname(__file__))
    torch.cuda.set_device(rank)
    with process_group("nccl", init_file, rank, WORLD):
        from test_expert_parallel_ops import train_router_beside_experts

        train_router_beside_experts(rank, torch.device("cuda", rank), (E, H, I, T, K), chunks=2)
        dist.barrier()


def test_fsdp2_router_beside_expert_parallel_experts_on_two_gpus(tmp_path):
    spawn(_fsdp_worker, (str(tmp_path / "init"),), WORLD)
