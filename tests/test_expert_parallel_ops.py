"""`Permute(E, group=...)` / `Unpermute(group=...)`: the routed layer with its experts split over 2
gloo processes equals the float64 slot-by-slot reference of all ranks' tokens on one process
(output, and the gradients of x, probs and every rank's experts); slots past a destination's
capacity are dropped and counted like the reference rule; torch.compile compiles the layer once
for new routing; activation checkpointing recomputes it bit for bit; a TopKRouter before it gets
its gradient; a Quantize after the permute sends E4M3 rows and scales; FSDP2 on the router beside
the expert-parallel experts trains like a replicated router; bad input raises on every rank."""

import math
import os
import sys

import pytest
import torch
import torch.distributed as dist
from spawn import spawn

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed not available")

WORLD, E, H, I, T, K = 2, 6, 16, 8, 13, 3


def rank_inputs(rank):
    """This rank's tokens, routing (with -1 dropped slots and duplicate experts) and probs."""
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    indices = torch.randint(-1, E, (T, K), generator=gen)
    indices[0] = torch.tensor([2, 2, 5])
    probs = torch.rand(T, K, generator=gen, dtype=torch.float64)
    return x, indices, probs


def weights():
    gen = torch.Generator().manual_seed(7)
    return (torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64) / H**0.5,
            torch.randn(E, H, I, generator=gen, dtype=torch.float64) / I**0.5)


def kept_slots(indices_per_rank, capacity, chunks=1):
    """(T, k) bool per source rank: its slot fits in the ``capacity`` rows of its destination (and
    chunk of the destination's experts), filled in the order (expert, token, slot): the rule,
    written as a host loop."""
    local = E // WORLD
    kept = []
    for indices in indices_per_rank:
        used = {}
        mask = torch.zeros(indices.shape, dtype=torch.bool)
        for e, t, j in sorted((e, t, j) for t, row in enumerate(indices.tolist()) for j, e in enumerate(row) if e >= 0):
            where = (e // local, e % local // (local // chunks))
            if used.get(where, 0) < capacity:
                used[where] = used.get(where, 0) + 1
                mask[t, j] = True
        kept.append(mask)
    return kept


def _worker(rank, init_file, capacity_factor, chunks):
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        import reference as ref

        from te_fused_ops import GroupedLinear, Permute, Sequential, SwiGLU, Unpermute

        local = E // WORLD
        w1, w2 = weights()
        fc1 = GroupedLinear(local, H, 2 * I, dtype=torch.float64)
        fc2 = GroupedLinear(local, I, H, dtype=torch.float64)
        with torch.no_grad():
            fc1.weight.copy_(w1[rank * local:(rank + 1) * local])
            fc2.weight.copy_(w2[rank * local:(rank + 1) * local])
        group = dist.group.WORLD
        layer = Sequential(Permute(E, group=group, capacity_factor=capacity_factor, chunks=chunks), fc1, SwiGLU(),
                           fc2, Unpermute(group=group))
        x, indices, probs = rank_inputs(rank)
        x.requires_grad_(True)
        probs.requires_grad_(True)
        y = layer(x, indices=indices, probs=probs)
        chunked = y.grad_fn.run.ctxs[0].chunked
        assert (chunked is not None and len(chunked.contexts) == chunks) == (chunks > 1)
        plan = layer.explain(x, indices=indices, probs=probs)
        assert (f"chunked: ops [0:5] run as {chunks} chunks of the experts" in plan) == (chunks > 1), plan
        dy = torch.randn(T, H, generator=torch.Generator().manual_seed(50 + rank), dtype=torch.float64)
        y.backward(dy)

        # the reference on all ranks' tokens, with the slots the capacity rule drops set to -1
        inputs = [rank_inputs(r) for r in range(WORLD)]
        capacity = T * K if capacity_factor is None else max(1, math.ceil(capacity_factor * T * K / (WORLD * chunks)))
        kept = kept_slots([i for _, i, _ in inputs], capacity, chunks)
        xs = torch.cat([i[0] for i in inputs]).requires_grad_(True)
        ps = torch.cat([i[2] for i in inputs]).requires_grad_(True)
        ids = torch.cat([torch.where(k, i[1], -1) for i, k in zip(inputs, kept)])
        rw1, rw2 = w1.clone().requires_grad_(True), w2.clone().requires_grad_(True)
        ry = ref.moe_layer(xs, ids, ps, rw1, rw2)
        dys = torch.cat([torch.randn(T, H, generator=torch.Generator().manual_seed(50 + r), dtype=torch.float64)
                         for r in range(WORLD)])
        ry.backward(dys)
        mine = slice(rank * T, (rank + 1) * T)
        close = dict(rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(y, ry[mine], **close)
        torch.testing.assert_close(x.grad, xs.grad[mine], **close)
        torch.testing.assert_close(probs.grad, ps.grad[mine], **close)
        experts = slice(rank * local, (rank + 1) * local)
        torch.testing.assert_close(fc1.weight.grad, rw1.grad[experts], **close)
        torch.testing.assert_close(fc2.weight.grad, rw2.grad[experts], **close)
        from test_expert_parallel import no_host_reads

        from te_fused_ops.routing import route_expert_parallel

        with no_host_reads():  # the routing reads no value back to the host
            routing = route_expert_parallel(indices, E, group, capacity)
        if capacity_factor is None:  # dropless: exactly the valid slots travel, sized by one host read
            exact = route_expert_parallel(indices, E, group, None)
            valid = int((indices >= 0).sum())
            assert exact.send_slots.shape[0] == sum(exact.splits[0]) == valid, (exact.splits, valid)
            balance = torch.tensor([sum(exact.splits[1]) - valid])  # what all ranks receive = what all send
            dist.all_reduce(balance)
            assert int(balance) == 0
        expected_dropped = int(((inputs[rank][1] >= 0) & ~kept[rank]).sum())
        assert int(layer[0].dropped) == expected_dropped, (int(layer[0].dropped), expected_dropped)
        if chunks == 1:
            assert int(routing.dropped) == expected_dropped
        assert (expected_dropped > 0) == (capacity_factor is not None and capacity_factor < 1)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("capacity_factor, chunks", [
    (float(WORLD), 1), (0.5, 1), (None, 1), (3.0 * WORLD, 3), (0.5, 3), (None, 3)],
    ids=["no drops", "drops", "dropless", "chunked, no drops", "chunked, drops", "chunked, dropless"])
def test_expert_parallel_layer_equals_one_process(capacity_factor, chunks, tmp_path):
    """``chunks=3``: one local expert per chunk, each chunk's exchanges beside another's experts."""
    spawn(_worker, (str(tmp_path / "init"), capacity_factor, chunks), WORLD)


def _bad_input_worker(rank, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from te_fused_ops import GroupedLinear, OpValueError, Permute, Sequential, Unpermute

        with pytest.raises(OpValueError, match=r"Permute: argument 'num_experts' \(5\) must split evenly over the 2"):
            Permute(5, group=dist.group.WORLD)
        layer = Sequential(Permute(4, group=dist.group.WORLD), Unpermute())
        with pytest.raises(OpValueError, match="Unpermute: argument 'group' must be the group of the Permute"):
            layer(torch.randn(3, 8), indices=torch.zeros(3, 1, dtype=torch.int64))
        layer = Sequential(Permute(4, group=dist.group.WORLD), Unpermute(group=dist.group.WORLD))
        tokens = 3 + 4 * rank  # a different capacity on each rank
        with pytest.raises(OpValueError, match="Permute: the ranks of 'group' send 2 to 4 rows per rank pair"):
            layer(torch.randn(tokens, 8), indices=torch.zeros(tokens, 1, dtype=torch.int64))
        with pytest.raises(OpValueError, match=r"Permute: argument 'chunks' \(3\) must divide the 2 experts"):
            Permute(4, group=dist.group.WORLD, chunks=3)
        with pytest.raises(OpValueError, match=r"Permute: argument 'chunks' > 1 overlaps .* needs 'group'"):
            Permute(4, chunks=2)
        with pytest.raises(ValueError, match=r"Permute \(op 0\): chunks=2 needs an op that closes the chunks"):
            Sequential(Permute(4, group=dist.group.WORLD, chunks=2))(torch.randn(3, 8),
                                                                     indices=torch.zeros(3, 1, dtype=torch.int64))
        global_experts = Sequential(Permute(4, group=dist.group.WORLD), GroupedLinear(4, 8, 8),
                                    Unpermute(group=dist.group.WORLD))
        with pytest.raises(OpValueError, match=r"GroupedLinear \(op 1\): side input 'split_sizes' from Permute "
                                               r"\(op 0\) spans 2 experts, this op has 4"):  # local experts, not all
            global_experts(torch.randn(3, 8), indices=torch.zeros(3, 1, dtype=torch.int64))
        message = (r"Permute: argument 'indices' holds 4, outside \[0, 4\)" if rank == 1 else
                   r"Permute: argument 'indices' holds ids outside \[0, 4\) on another rank")
        with pytest.raises(OpValueError, match=message):  # bad ids on rank 1 only: both raise, none waits
            layer(torch.randn(3, 8), indices=torch.full((3, 1), 4 if rank == 1 else 0))
        # an input failing its own checks on rank 1 only: rank 1 names it, rank 0 raises too
        others = r"an input failed its checks on another rank of 'group'"
        combine = Sequential(Permute(4, group=dist.group.WORLD), GroupedLinear(2, 8, 8), Unpermute(group=dist.group.WORLD))
        indices = torch.zeros(3, 2, dtype=torch.float32 if rank == 1 else torch.int64)
        with pytest.raises((TypeError, ValueError), match="must have dtype int32 or int64" if rank == 1 else
                           "Permute: " + others):
            combine(torch.randn(3, 8), indices=indices, probs=torch.rand(3, 2))
        probs = torch.rand(3, 3 if rank == 1 else 2)
        with pytest.raises(OpValueError, match="Unpermute: argument 'probs'" if rank == 1 else "Unpermute: " + others):
            combine(torch.randn(3, 8), indices=torch.zeros(3, 2, dtype=torch.int64), probs=probs)
        with pytest.raises(OpValueError, match=r"Permute: argument 'x' is 8 to 9 wide on the ranks of 'group'"):
            combine(torch.randn(3, 8 + rank), indices=torch.zeros(3, 2, dtype=torch.int64), probs=torch.rand(3, 2))
        with pytest.raises(OpValueError, match="Unpermute: argument 'group' is another group object"):
            Sequential(Permute(4, group=dist.group.WORLD), Unpermute(group=dist.new_group([0, 1])))(
                torch.randn(3, 8), indices=torch.zeros(3, 1, dtype=torch.int64))
        with pytest.raises(OpValueError, match=r"'capacity_factor' must be > 0 and finite"):
            Permute(4, group=dist.group.WORLD, capacity_factor=float("inf"))
        huge = Sequential(Permute(4, group=dist.group.WORLD, capacity_factor=1e300), Unpermute(group=dist.group.WORLD))
        huge(torch.randn(3, 8), indices=torch.zeros(3, 2, dtype=torch.int64))  # C is at most T * k: no overflow
        alone = dist.new_group([0])
        if rank == 1:
            with pytest.raises(OpValueError, match=r"Permute: this rank \(1\) is not a member of argument 'group'"):
                Permute(4, group=alone)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_expert_parallel_bad_input_raises_on_every_rank(tmp_path):
    spawn(_bad_input_worker, (str(tmp_path / "init"),), WORLD)


def _compile_worker(rank, init_file, chunks):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from te_fused_ops import GroupedLinear, Permute, Sequential, SwiGLU, Unpermute

        torch.manual_seed(0)
        group = dist.group.WORLD
        layer = Sequential(Permute(E, group=group, capacity_factor=2.0 * chunks, chunks=chunks),
                           GroupedLinear(E // WORLD, H, 2 * I), SwiGLU(), GroupedLinear(E // WORLD, I, H),
                           Unpermute(group=group))
        torch._dynamo.reset()
        compiled = torch.compile(layer)
        for step, tokens in enumerate((T, T, T, T + 4, T - 5)):  # a new routing each step, then new counts
            gen = torch.Generator().manual_seed(10 * step + rank)
            x = torch.randn(tokens, H, generator=gen, requires_grad=True)
            indices, probs = torch.randint(0, E, (tokens, K), generator=gen), torch.rand(tokens, K, generator=gen)
            y = compiled(x, indices=indices, probs=probs)
            y.square().sum().backward()
            x_eager = x.detach().clone().requires_grad_(True)
            y_eager = layer(x_eager, indices=indices, probs=probs)
            y_eager.square().sum().backward()
            torch.testing.assert_close(y, y_eager)
            torch.testing.assert_close(x.grad, x_eager.grad)
            if step == 2:
                assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1  # compiled once for new routing
        assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 2  # and once more with a symbolic count
        dropless = Sequential(Permute(E, group=group, capacity_factor=None), GroupedLinear(E // WORLD, H, H),
                              Unpermute(group=group))
        with pytest.raises(Exception, match=r"Permute \(op 0\): capacity_factor=None with group .* not supported "
                                            r"under torch.compile"):
            torch.compile(dropless)(x, indices=indices, probs=probs)

        # activation checkpointing: the recomputed forward exchanges again; bit-equal gradients
        from torch.utils.checkpoint import checkpoint

        probs.requires_grad_(True)
        x = x.detach().requires_grad_(True)
        layer.zero_grad(set_to_none=True)
        y = checkpoint(lambda x, probs: layer(x, indices=indices, probs=probs), x, probs, use_reentrant=False)
        y.square().sum().backward()
        kept = [x.grad, probs.grad, *(p.grad.clone() for p in layer.parameters())]
        x.grad = probs.grad = None
        layer.zero_grad(set_to_none=True)
        layer(x, indices=indices, probs=probs).square().sum().backward()
        for a, b in zip(kept, [x.grad, probs.grad, *(p.grad for p in layer.parameters())]):
            assert torch.equal(a, b)

        # a TopKRouter first: its probabilities' gradient comes back from the combine
        from te_fused_ops import TopKRouter

        router = TopKRouter(H, E, K, normalize=True)
        routed = Sequential(router, *layer)
        x = x.detach().requires_grad_(True)
        routed(x).square().sum().backward()
        x_ref = x.detach().clone().requires_grad_(True)
        weight = router.weight.detach().clone().requires_grad_(True)
        top, chosen = torch.softmax(x_ref @ weight.t(), -1).topk(K, -1)
        layer(x_ref, indices=chosen, probs=top / top.sum(-1, keepdim=True)).square().sum().backward()
        torch.testing.assert_close(router.weight.grad, weight.grad)
        torch.testing.assert_close(x.grad, x_ref.grad)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunks", [1, 3])
def test_expert_parallel_layer_under_compile_checkpointing_and_a_router(chunks, tmp_path):
    spawn(_compile_worker, (str(tmp_path / "init"), chunks), WORLD)


def _fp8_worker(rank, init_file, chunks, wgrad16=False):
    """The FP8 payload: each token cast once and sent as E4M3 rows + scales; the layer equals the
    single-process layer that casts after permuting (the 1x128 blocks are row-local). With 16-bit
    weight gradients (``wgrad16``) the 16-bit rows travel instead and are cast on arrival (the
    weight gradient reads them)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        from te_fused_ops import GroupedLinear, Permute, Quantize, Sequential, SwiGLU, Unpermute
        from te_fused_ops import routing as rows
        from te_fused_ops.quantization import Float8BlockScaling

        recipe = Float8BlockScaling(high_precision_wgrad=wgrad16)

        local, group = E // WORLD, dist.group.WORLD
        fc1, fc2 = GroupedLinear(local, H * 8, 2 * I), GroupedLinear(local, I, H * 8)
        ref1, ref2 = GroupedLinear(E, H * 8, 2 * I), GroupedLinear(E, I, H * 8)
        gen = torch.Generator().manual_seed(11)
        w1 = torch.randn(E, 2 * I, H * 8, generator=gen) / 32
        w2 = torch.randn(E, H * 8, I, generator=gen) / 4
        with torch.no_grad():
            ref1.weight.copy_(w1), ref2.weight.copy_(w2)
            fc1.weight.copy_(w1[rank * local:(rank + 1) * local]), fc2.weight.copy_(w2[rank * local:(rank + 1) * local])
        layer = Sequential(Permute(E, group=group, capacity_factor=float(WORLD * chunks), chunks=chunks),
                           Quantize(recipe), fc1, SwiGLU(), fc2, Unpermute(group=group))
        inputs = []
        for r in range(WORLD):
            g = torch.Generator().manual_seed(300 + r)
            inputs.append((torch.randn(T, H * 8, generator=g), torch.randint(-1, E, (T, K), generator=g),
                           torch.rand(T, K, generator=g)))
        x, indices, probs = (t.clone() for t in inputs[rank])
        x.requires_grad_(True)
        assert "[0:2] Permute, Quantize -> rule 'permute+quantize'" in layer.explain(x, indices=indices, probs=probs)
        sent = []
        real = rows.all_to_all
        rows.all_to_all = lambda t, g, *sizes: sent.append(t.dtype) or real(t, g, *sizes)
        try:
            y = layer(x, indices=indices, probs=probs)
        finally:
            rows.all_to_all = real
        # the counts, then per chunk the E4M3 rows and their scales (no 16/32-bit rows), and the combine's rows
        if wgrad16:
            assert torch.uint8 not in sent and sent[0] == torch.int64, sent
        elif chunks == 1:
            assert sent == [torch.int64, torch.uint8, torch.float32, torch.float32], sent
        else:
            assert sent[0] == torch.int64 and sent.count(torch.uint8) == chunks and len(sent) == 1 + 3 * chunks, sent
        y.square().sum().backward()

        reference = Sequential(Permute(E), Quantize(recipe), ref1, SwiGLU(), ref2, Unpermute())
        xs = torch.cat([i[0] for i in inputs]).requires_grad_(True)
        ry = reference(xs, indices=torch.cat([i[1] for i in inputs]), probs=torch.cat([i[2] for i in inputs]))
        ry.square().sum().backward()
        mine = slice(rank * T, (rank + 1) * T)
        torch.testing.assert_close(y, ry[mine], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x.grad, xs.grad[mine], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(fc1.weight.grad, ref1.weight.grad[rank * local:(rank + 1) * local], rtol=1e-5, atol=1e-5)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("chunks,wgrad16", [(1, False), (3, False), (1, True), (3, True)])
def test_expert_parallel_fp8_payload_equals_casting_after_the_exchange(chunks, wgrad16, tmp_path):
    spawn(_fp8_worker, (str(tmp_path / "init"), chunks, wgrad16), WORLD)


def train_router_beside_experts(rank, device, sizes, chunks=1):
    """FSDP2 on the router (data parallel over the world group) beside expert parallelism on the
    experts (``chunks`` of them overlapped): three SGD steps equal a replicated router whose
    gradient is averaged by hand. ``sizes``: (experts, hidden, intermediate, tokens, k)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from te_fused_ops import GroupedLinear, Permute, Sequential, SwiGLU, TopKRouter, Unpermute

    experts, hidden, ffn, tokens, k = sizes
    group, world = dist.group.WORLD, dist.get_world_size()
    local = experts // world

    def make():
        torch.manual_seed(0)  # the router the same on every rank; the experts this rank's own
        router = TopKRouter(hidden, experts, k, normalize=True, device=device)
        torch.manual_seed(1 + rank)
        return Sequential(router, Permute(experts, group=group, capacity_factor=float(world * chunks), chunks=chunks),
                          GroupedLinear(local, hidden, 2 * ffn, device=device), SwiGLU(),
                          GroupedLinear(local, ffn, hidden, device=device), Unpermute(group=group))

    sharded, plain = make(), make()
    fully_shard(sharded[0], mesh=init_device_mesh(device.type, (world,)))
    def param_groups(m):  # the router's DTensors apart from the experts' tensors: a foreach step may not mix them
        router = list(m[0].parameters())
        return [{"params": router}, {"params": [p for p in m.parameters() if all(p is not r for r in router)]}]

    opt, opt_plain = (torch.optim.SGD(param_groups(m), lr=0.1) for m in (sharded, plain))
    for step in range(3):
        x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(10 * step + rank)).to(device)
        sharded(x).square().mean().backward()
        plain(x).square().mean().backward()
        dist.all_reduce(plain[0].weight.grad, group=group)
        plain[0].weight.grad /= world
        for o in (opt, opt_plain):
            o.step()
            o.zero_grad(set_to_none=True)
        torch.testing.assert_close(sharded[0].weight.full_tensor(), plain[0].weight.detach())
        for mine, other in ((sharded[2], plain[2]), (sharded[4], plain[4])):
            torch.testing.assert_close(mine.weight, other.weight)


def _fsdp_worker(rank, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        train_router_beside_experts(rank, torch.device("cpu"), (E, H, I, T, K))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_fsdp2_router_beside_expert_parallel_experts(tmp_path):
    spawn(_fsdp_worker, (str(tmp_path / "init"),), WORLD)


def _checkpoint_worker(rank, init_file, path):
    sys.path.insert(0, os.path.dirname(__file__))
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        import torch.distributed.checkpoint as dcp

        from te_fused_ops import GroupedLinear, Permute, Sequential, SwiGLU, Unpermute

        local, group = E // WORLD, dist.group.WORLD

        def layer(seed):
            torch.manual_seed(seed)
            return Sequential(Permute(E, group=group), GroupedLinear(local, H, 2 * I, bias=True), SwiGLU(),
                              GroupedLinear(local, I, H), Unpermute(group=group))

        saved = layer(rank)  # each rank's experts differ
        dcp.save(saved.state_dict(), checkpoint_id=path)
        loaded = layer(10 + rank)
        state = loaded.state_dict()
        dcp.load(state, checkpoint_id=path)
        loaded.load_state_dict(state)
        for name, p in saved.named_parameters():
            assert torch.equal(loaded.get_parameter(name), p), (rank, name)
        # one process holding all E experts (no group) reads the same checkpoint: rank r's experts
        # are its [r E / W, (r + 1) E / W)
        whole = Sequential(Permute(E), GroupedLinear(E, H, 2 * I, bias=True), SwiGLU(), GroupedLinear(E, I, H),
                           Unpermute())
        state = whole.state_dict()
        alone = [dist.new_group([r], backend="gloo") for r in range(WORLD)]  # made by every rank, in one order
        dcp.load(state, checkpoint_id=path, process_group=alone[rank])
        whole.load_state_dict(state)
        for name, p in saved.named_parameters():
            assert torch.equal(whole.get_parameter(name)[rank * local:(rank + 1) * local], p), (rank, name)
    finally:
        dist.destroy_process_group()


def test_distributed_checkpoint_keeps_every_ranks_experts(tmp_path):
    """Each rank's experts sit under the same state_dict keys; as plain tensors a distributed
    checkpoint would keep one rank's (it takes same-named tensors for replicas). They are DTensors
    sharded on dim 0 over the layer's group: every rank gets its own back, and a process holding
    all experts reads them in expert order."""
    spawn(_checkpoint_worker, (str(tmp_path / "init"), str(tmp_path / "ckpt")), WORLD)
