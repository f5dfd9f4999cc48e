"""FSDP2 (``fully_shard``) over 2 gloo processes on the CPU: the sharded model trains like the
unsharded one, and every forward uses the weights of that step (no stale weight copies)."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, STEPS, G, H, I, ROWS = 2, 20, 4, 16, 16, 24

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")


class Model(torch.nn.Module):
    """What a user shards: a module holding the Sequential (FSDP2 unshards in its forward)."""

    def __init__(self, recipe):
        super().__init__()
        from te_fused_ops import GroupedLinear, Quantize, Sequential, SwiGLU

        ops = [GroupedLinear(G, H, 2 * I, bias=True), SwiGLU(), GroupedLinear(G, I, H)]
        self.mlp = Sequential(*([Quantize(recipe)] if recipe else []), *ops)

    def forward(self, x, split_sizes):
        return self.mlp(x, split_sizes=split_sizes)


def local_batch(step, rank):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    sizes = torch.randint(0, ROWS // G + 2, (G,), generator=gen)
    return torch.randn(ROWS, H, generator=gen), sizes


def _worker(rank, init_file, recipe, reshard_after_forward):
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        import reference as ref

        torch.manual_seed(0)
        sharded = Model(recipe)
        unsharded = Model(recipe)
        unsharded.load_state_dict(sharded.state_dict())
        fully_shard(sharded, mesh=init_device_mesh("cpu", (WORLD,)), reshard_after_forward=reshard_after_forward)
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        opt_ref = torch.optim.AdamW(unsharded.parameters(), lr=1e-2)
        for step in range(STEPS):
            # the step's weights, gathered: a fresh unsharded model must give the same output
            full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
            fresh = Model(recipe)
            fresh.load_state_dict(full)
            x, sizes = local_batch(step, rank)
            y = sharded(x, sizes)
            assert ref.rel_err(y, fresh(x, sizes)) <= 1e-6, f"rank {rank} step {step}: stale weights"
            y.square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            # the unsharded model on the global batch (FSDP2 averages gradients over ranks)
            loss = sum(unsharded(*local_batch(step, r)).square().mean() for r in range(WORLD)) / WORLD
            loss.backward()
            opt_ref.step()
            opt_ref.zero_grad(set_to_none=True)
            if recipe is None:
                for name, p in unsharded.state_dict().items():
                    got = sharded.state_dict()[name].full_tensor()
                    assert ref.rel_err(got, p) <= 1e-5, f"rank {rank} step {step}: {name} diverged"
        dist.barrier()  # no rank tears gloo down while its peer still runs a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("reshard_after_forward", [True, False])
@pytest.mark.parametrize("recipe", [None, "fp8_blockwise"])
def test_fully_shard_trains_like_unsharded_model(recipe, reshard_after_forward, tmp_path):
    # without resharding, the unsharded parameters keep their address and version across steps:
    # a weight copy cached on (address, version) went stale there
    mp.spawn(_worker, args=(str(tmp_path / "init"), recipe, reshard_after_forward), nprocs=WORLD, join=True)
