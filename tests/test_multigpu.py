"""Two GPUs over NCCL: FSDP2 with bf16 mixed precision trains like the unsharded model and the
sm90 kernels fire on the unsharded parameters; DCP round trip; the expert-parallel example under
torchrun, CUDA graph included. Skipped without 2 GPUs."""

import os
import pathlib
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from spawn import spawn

pytestmark = [pytest.mark.gpu, pytest.mark.multigpu]

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORLD, STEPS, G, H, I, ROWS = 2, 20, 4, 256, 128, 512


class Model(torch.nn.Module):
    """A module holding the Sequential (FSDP2 unshards in its forward)."""

    def __init__(self):
        super().__init__()
        from te_fused_ops import GroupedLinear, Sequential, SwiGLU

        self.mlp = Sequential(GroupedLinear(G, H, 2 * I), SwiGLU(), GroupedLinear(G, I, H))

    def forward(self, x, split_sizes):
        self.split_sizes = split_sizes
        return self.mlp(x, split_sizes=split_sizes)

    def record_plans(self) -> list:
        """``explain()`` of every later forward, taken where the kernels read the parameters: in a
        pre-hook of the last op, registered after FSDP2's (so every op is unsharded by then)."""
        plans = []
        self.mlp[-1].register_forward_pre_hook(
            lambda op, args: plans.append(self.mlp.explain(args[0], split_sizes=self.split_sizes))
        )
        return plans


def local_batch(step, rank, device):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    sizes = torch.randint(0, ROWS // G + 64, (G,), generator=gen)
    sizes = torch.minimum(sizes, torch.tensor(ROWS) - (torch.cumsum(sizes, 0) - sizes)).clamp_min(0)
    return torch.randn(ROWS, H, generator=gen).to(device), sizes.to(device)


def _shard(model, mesh, per_op, mp_policy):
    from torch.distributed.fsdp import fully_shard

    if per_op:
        for op in model.mlp:
            if any(True for _ in op.parameters()):
                fully_shard(op, mesh=mesh, mp_policy=mp_policy)
    return fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def _fsdp_worker(rank, init_file, ckpt_dir):
    sys.path.insert(0, os.path.dirname(__file__))
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy

        import reference as ref

        mesh = init_device_mesh("cuda", (WORLD,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for per_op in (False, True):
            torch.manual_seed(0)
            master = Model().to(device)  # fp32 master weights of the unsharded reference
            sharded = Model().to(device)
            sharded.load_state_dict(master.state_dict())
            _shard(sharded, mesh, per_op, policy)
            opt = torch.optim.AdamW(sharded.parameters(), lr=1e-3, fused=True)
            opt_ref = torch.optim.AdamW(master.parameters(), lr=1e-3, fused=True)
            plans = sharded.record_plans()
            for step in range(STEPS):
                x, sizes = local_batch(step, rank, device)
                sharded(x, sizes).float().square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                # the reference: bf16 copies of the fp32 masters run every rank's batch, gradients
                # averaged in fp32 (what FSDP2's policy does), applied to the masters
                grads = [torch.zeros_like(p) for p in master.parameters()]
                for r in range(WORLD):
                    replica = Model().to(device, torch.bfloat16)
                    replica.load_state_dict(master.state_dict())
                    xr, sr = local_batch(step, r, device)
                    replica(xr.bfloat16(), sr).float().square().mean().backward()
                    for g, p in zip(grads, replica.parameters()):
                        g += p.grad.float() / WORLD
                for p, g in zip(master.parameters(), grads):
                    p.grad = g
                opt_ref.step()
                opt_ref.zero_grad(set_to_none=True)
            for name, p in master.state_dict().items():
                got = sharded.state_dict()[name].full_tensor()
                err = ref.rel_err(got, p)
                assert err <= 2e-2, f"rank {rank} per_op {per_op}: {name} diverged ({err:.2e})"
                drift = ref.rel_err(got, Model().to(device).state_dict()[name])
                assert drift > 10 * err, f"rank {rank}: {name} barely trained ({drift:.2e})"
            assert len(plans) == STEPS
            for plan in plans:  # the sm90 kernels ran on the unsharded bf16 parameters
                steps = [line for line in plan.splitlines() if " -> " in line]
                assert len(steps) == 4 and all("(backend sm90)" in line for line in steps), plan

            # DCP round trip of the sharded model
            path = os.path.join(ckpt_dir, f"per_op{int(per_op)}")
            dcp.save(get_model_state_dict(sharded), checkpoint_id=path)
            torch.manual_seed(1)
            loaded = _shard(Model().to(device), mesh, per_op, policy)
            x, sizes = local_batch(STEPS, rank, device)
            with torch.no_grad():
                want = sharded(x, sizes)
                state = get_model_state_dict(loaded)
                dcp.load(state, checkpoint_id=path)
                set_model_state_dict(loaded, state)
                assert torch.equal(loaded(x, sizes), want), f"rank {rank} per_op {per_op}: DCP load"
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_bf16_mixed_precision_trains_like_unsharded_model_on_two_gpus(tmp_path):
    spawn(_fsdp_worker, (str(tmp_path / "init"), str(tmp_path / "ckpt")), WORLD)


def test_expert_parallel_example_under_torchrun_with_nccl_and_cuda_graph():
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29531",
         str(ROOT / "examples" / "moe_expert_parallel.py"), "--tokens", "512", "--experts", "8", "--top-k", "2"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    print(result.stdout)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "nccl, cuda" in result.stdout and "CUDA graph: 3 replays" in result.stdout, result.stdout
    assert "PASS" in result.stdout, result.stdout
