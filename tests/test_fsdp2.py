"""FSDP2 (``fully_shard``) over 2 gloo processes on the CPU: the sharded model trains like the
unsharded one, and every forward uses the weights of that step (no stale weight copies)."""

import os
import sys

import pytest
import torch
import torch.distributed as dist
from spawn import spawn

from te_fused_ops.quantization import Float8BlockScaling

WORLD, STEPS, G, H, I, ROWS = 2, 20, 4, 16, 16, 24

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")


class Model(torch.nn.Module):
    """What a user shards: a module holding the Sequential (FSDP2 unshards in its forward)."""

    def __init__(self, recipe):
        super().__init__()
        from te_fused_ops import GroupedLinear, Permute, Quantize, ScaledSwiGLU, Sequential, SwiGLU, TopKRouter, Unpermute

        self.routed = recipe == "moe"
        if self.routed:  # the whole MoE layer, routed by its own router
            ops = [TopKRouter(H, G, 2, normalize=True), Permute(G),
                   GroupedLinear(G, H, 2 * I), ScaledSwiGLU(), GroupedLinear(G, I, H), Unpermute()]
            self.mlp = Sequential(*ops)
            return
        ops = [GroupedLinear(G, H, 2 * I, bias=True), SwiGLU(), GroupedLinear(G, I, H)]
        self.mlp = Sequential(*([Quantize(recipe)] if recipe else []), *ops)

    def forward(self, x, split_sizes):
        return self.mlp(x) if self.routed else self.mlp(x, split_sizes=split_sizes)


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
        if recipe not in (None, "moe") and not reshard_after_forward:  # the weight copies kept per step
            import te_fused_ops as tfo

            tfo.cast_weights_once_per_step(opt, sharded)
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
            if recipe in (None, "moe"):
                for name, p in unsharded.state_dict().items():
                    got = sharded.state_dict()[name].full_tensor()
                    assert ref.rel_err(got, p) <= 1e-5, f"rank {rank} step {step}: {name} diverged"
        dist.barrier()  # no rank tears gloo down while its peer still runs a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("recipe,reshard_after_forward", [
    (None, True), (None, False), ("fp8_blockwise", True), ("fp8_blockwise", False),
    (Float8BlockScaling(high_precision_wgrad=True), False),
])
def test_fully_shard_trains_like_unsharded_model(recipe, reshard_after_forward, tmp_path):
    # without resharding, the unsharded parameters keep their address and version across steps:
    # a weight copy cached on (address, version) went stale there; that case runs with
    # `cast_weights_once_per_step`, whose copies the optimizer step drops
    spawn(_worker, (str(tmp_path / "init"), recipe, reshard_after_forward), WORLD)


def _shard_per_op(module, mesh, reshard_after_forward=True):
    """``fully_shard`` on every op holding parameters, then on ``module`` (the root)."""
    from torch.distributed.fsdp import fully_shard

    for op in module.modules():
        if op is not module and getattr(op, "param_names", None) and any(True for _ in op.parameters()):
            fully_shard(op, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward)


def _mlp():
    from te_fused_ops import GroupedLinear, Sequential, SwiGLU

    return Sequential(GroupedLinear(G, H, 2 * I, bias=True), SwiGLU(), GroupedLinear(G, I, H))


def _per_op_worker(rank, init_file, ckpt_dir):
    """Per-op ``fully_shard`` trains like the unsharded model; DCP save/load round trips of the
    whole-model and the per-op sharded Sequential; the full state dict loads into a plain one."""
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor import DTensor

        import reference as ref

        mesh = init_device_mesh("cpu", (WORLD,))

        # 1. per-op + root sharding, resharding after forward or not, against the unsharded model
        torch.manual_seed(0)
        unsharded = Model(None)
        sharded = {}
        for reshard in (True, False):
            sharded[reshard] = Model(None)
            sharded[reshard].load_state_dict(unsharded.state_dict())
            _shard_per_op(sharded[reshard], mesh, reshard)
        calls = []
        sharded[True].mlp[2].register_forward_hook(lambda op, args, out: calls.append(out.shape))
        opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2) for k, m in sharded.items()}
        opt_ref = torch.optim.AdamW(unsharded.parameters(), lr=1e-2)
        for step in range(STEPS):
            x, sizes = local_batch(step, rank)
            for reshard, model in sharded.items():
                full = {k: v.full_tensor() for k, v in model.state_dict().items()}
                fresh = Model(None)
                fresh.load_state_dict(full)
                y = model(x, sizes)
                assert ref.rel_err(y, fresh(x, sizes)) <= 1e-6, f"rank {rank} step {step}: stale weights"
                y.square().mean().backward()
                opts[reshard].step()
                opts[reshard].zero_grad(set_to_none=True)
            loss = sum(unsharded(*local_batch(step, r)).square().mean() for r in range(WORLD)) / WORLD
            loss.backward()
            opt_ref.step()
            opt_ref.zero_grad(set_to_none=True)
            for reshard, model in sharded.items():
                for op in model.mlp:
                    assert all(isinstance(p, DTensor) for p in op.parameters())
                for name, p in unsharded.state_dict().items():
                    got = model.state_dict()[name].full_tensor()
                    assert ref.rel_err(got, p) <= 1e-5, f"rank {rank} step {step} reshard {reshard}: {name} diverged"
        assert calls == [(ROWS, H)] * STEPS, calls  # a user hook on an op: once per call, on the output

        # 2. DCP round trip and full state dict, whole-model and per-op sharding of a Sequential
        for per_op in (False, True):
            torch.manual_seed(0)
            model = _shard_per_op(_mlp(), mesh) if per_op else fully_shard(_mlp(), mesh=mesh)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            for step in range(3):
                x, sizes = local_batch(step, rank)
                model(x, split_sizes=sizes).square().mean().backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            path = os.path.join(ckpt_dir, f"per_op{int(per_op)}")
            dcp.save(get_model_state_dict(model), checkpoint_id=path)
            torch.manual_seed(1)  # other initial weights
            loaded = _shard_per_op(_mlp(), mesh) if per_op else fully_shard(_mlp(), mesh=mesh)
            x, sizes = local_batch(STEPS, rank)
            with torch.no_grad():
                want = model(x, split_sizes=sizes)
                assert ref.rel_err(loaded(x, split_sizes=sizes), want) > 1e-3
                state = get_model_state_dict(loaded)
                dcp.load(state, checkpoint_id=path)
                set_model_state_dict(loaded, state)
                assert torch.equal(loaded(x, split_sizes=sizes), want), f"rank {rank} per_op {per_op}: DCP load"
            loaded(x, split_sizes=sizes).sum().backward()  # and the loaded model runs a backward
            full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            plain = _mlp()
            assert list(full) == list(plain.state_dict()) == ["0.weight", "0.bias", "2.weight"], list(full)
            assert full["0.weight"].shape == (G, 2 * I, H) and not isinstance(full["0.weight"], DTensor)
            for name, value in full.items():
                assert torch.equal(value, model.state_dict()[name].full_tensor()), name
            plain.load_state_dict(full)
            with torch.no_grad():
                assert torch.equal(plain(x, split_sizes=sizes), want), f"rank {rank} per_op {per_op}: full state dict"
        dist.barrier()  # no rank tears gloo down while its peer still runs a collective
    finally:
        dist.destroy_process_group()


def test_per_op_fully_shard_and_distributed_checkpoint(tmp_path):
    # one spawn for both checks (each spawn costs seconds); the checkpoint directory is shared
    spawn(_per_op_worker, (str(tmp_path / "init"), str(tmp_path / "ckpt")), WORLD)


def _routed_per_op_worker(rank, init_file):
    """The routed layer (router, permute, experts, combine) with every op sharded on its own
    trains like the unsharded one (FSDP2's per-op hooks around the ops' shared call)."""
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        import reference as ref

        torch.manual_seed(0)
        unsharded, sharded = Model("moe"), Model("moe")
        sharded.load_state_dict(unsharded.state_dict())
        _shard_per_op(sharded, init_device_mesh("cpu", (WORLD,)))
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        opt_ref = torch.optim.AdamW(unsharded.parameters(), lr=1e-2)
        for step in range(5):
            sharded(*local_batch(step, rank)).square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss = sum(unsharded(*local_batch(step, r)).square().mean() for r in range(WORLD)) / WORLD
            loss.backward()
            opt_ref.step()
            opt_ref.zero_grad(set_to_none=True)
            for name, p in unsharded.state_dict().items():
                got = sharded.state_dict()[name].full_tensor()
                assert ref.rel_err(got, p) <= 1e-5, f"rank {rank} step {step}: {name} diverged"
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_per_op_fully_shard_of_the_routed_layer(tmp_path):
    spawn(_routed_per_op_worker, (str(tmp_path / "init"),), WORLD)


def _micro_batch_worker(rank, init_file):
    """FSDP2 all-gathers each weight at a new address for every forward and backward: the copies
    `cast_weights_once_per_step` keeps must not pile up over the micro-batches of a step (each
    gather made one more, kept until the optimizer step), and each forward reads that step's
    weights."""
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        import reference as ref
        import te_fused_ops as tfo

        torch.manual_seed(0)
        sharded = Model("fp8_blockwise")
        _shard_per_op(sharded, init_device_mesh("cpu", (WORLD,)))
        opt = torch.optim.AdamW(sharded.parameters(), lr=1e-2)
        casts = tfo.cast_weights_once_per_step(opt, sharded)
        for step in range(3):
            fresh = Model("fp8_blockwise")
            fresh.load_state_dict({k: v.full_tensor() for k, v in sharded.state_dict().items()})
            kept = []
            for micro_batch in range(4):
                x, sizes = local_batch(4 * step + micro_batch, rank)
                y = sharded(x, sizes)
                assert ref.rel_err(y, fresh(x, sizes)) <= 1e-6, f"rank {rank} step {step}: stale weights"
                y.square().mean().backward()
                kept.append(len(casts.scope.copies))
            assert kept == kept[:1] * 4, f"rank {rank} step {step}: copies kept after each micro-batch {kept}"
            opt.step()
            opt.zero_grad(set_to_none=True)
        casts.remove()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_weight_copies_do_not_pile_up_over_micro_batches(tmp_path):
    spawn(_micro_batch_worker, (str(tmp_path / "init"),), WORLD)
