"""GPU tests of the routing kernel (`kernels.route`): every output bit for bit the torch routing
(`routing.route_torch`) over the routing edge cases (one slot, one expert, every slot dropped,
every slot on one expert, the same expert twice in a token, ids outside [0, E) of both signs and
past int32, the most experts the kernel takes, many CTAs), int32 and int64 ids; the kernel's outputs
and scratch poisoned before it runs; no host sync; `routing.route` on the kernel where it applies
and on torch past it."""

import pytest
import torch

from te_fused_ops import routing
from te_fused_ops.backends.sm90.kernels import sm90_unavailable_reason
from te_fused_ops.backends.sm90.kernels.launch import ffi_kernels_available
from te_fused_ops.backends.sm90.kernels.route import (
    MAX_BUCKETS,
    SLOTS_PER_CTA,
    compile_route,
    route_supported,
)

# the TVM-FFI-only kernels (routing, row movers, slot values) need the launcher as well as sm90
NEEDS_FFI_KERNELS = pytest.mark.skipif(
    torch.cuda.is_available() and not ffi_kernels_available(),
    reason=str(sm90_unavailable_reason() or "TVM-FFI not importable") if torch.cuda.is_available() else "",
)
pytestmark = [pytest.mark.gpu, NEEDS_FFI_KERNELS]

POISON = -7

# T, k, E, share of dropped slots, how the ids are drawn
CASES = [
    (1, 1, 1, 0.0, "uniform"),
    (7, 3, 5, 0.2, "uniform"),
    (4096, 8, 128, 0.0, "skewed"),
    (8192, 8, 128, 0.05, "uniform"),
    (1000, 6, MAX_BUCKETS - 1, 0.1, "uniform"),
    (33333, 8, 256, 0.02, "skewed"),
    (5000, 2, 8, 0.3, "uniform"),
    (300, 4, 16, 1.0, "uniform"),
    (2500, 8, 64, 0.0, "one expert"),
    (999, 4, 32, 0.1, "duplicates"),
    (1200, 3, 40, 0.0, "out of range"),
]


def expert_ids(tokens, k, num_experts, drop, kind, dtype, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    if kind == "skewed":  # a few experts take most slots
        weights = torch.rand(num_experts, device="cuda", generator=gen) ** 4 + 1e-3
        ids = torch.multinomial(weights, tokens * k, replacement=True, generator=gen).view(tokens, k)
    elif kind == "one expert":
        ids = torch.full((tokens, k), num_experts // 2, device="cuda")
    elif kind == "duplicates":  # a token's slots often name one expert twice
        ids = torch.randint(0, 3, (tokens, k), device="cuda", generator=gen)
    else:
        ids = torch.randint(0, num_experts, (tokens, k), device="cuda", generator=gen)
    ids = ids.to(dtype)
    ids[torch.rand(tokens, k, device="cuda", generator=gen) < drop] = -1
    if kind == "out of range":  # every kind of id that is not an expert: dropped slots
        wrong = torch.tensor([num_experts, num_experts + 5, -3, 2**31 - 1, -(2**31)], device="cuda")
        if dtype == torch.int64:
            wrong = torch.cat([wrong, torch.tensor([2**40, -(2**40), 2**32 + 1], device="cuda")])
        pick = torch.randint(0, wrong.numel(), (tokens, k), device="cuda", generator=gen)
        ids = torch.where(torch.rand(tokens, k, device="cuda", generator=gen) < 0.3, wrong[pick].to(dtype), ids)
    return ids


def launch_poisoned(ids, num_experts):
    """The kernel's outputs, every output and the scratch filled with POISON before it runs."""
    t, k = ids.shape
    m = t * k
    full = dict(device="cuda", dtype=torch.int32)
    cta_counts = torch.full((-(-m // SLOTS_PER_CTA), num_experts + 1), POISON, **full)
    offsets, counts = torch.full((num_experts + 1,), POISON, **full), torch.full((num_experts,), POISON, **full)
    slot_rows, row_tokens = torch.full((m,), POISON, **full), torch.full((m,), POISON, **full)
    row_slots = torch.full((m,), POISON, device="cuda", dtype=torch.int64)
    flat = ids.reshape(-1).contiguous()
    compile_route(ids.dtype)(flat, cta_counts, offsets, counts, slot_rows, row_slots, row_tokens, num_experts, k)
    return slot_rows.view(t, k), row_slots, row_tokens, offsets, counts


def assert_routing_equal(got, want):
    for name, g, w in zip(("slot_rows", "row_slots", "row_tokens", "offsets", "counts"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        assert torch.equal(g, w), f"{name} differs at {torch.nonzero(g != w)[:5].flatten().tolist()}"


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}-E{c[2]}-{c[4]}" for c in CASES])
def test_route_kernel_equals_torch(case, dtype):
    tokens, k, num_experts, drop, kind = case
    ids = expert_ids(tokens, k, num_experts, drop, kind, dtype, seed=tokens + k)
    want = routing.route_torch(ids, num_experts)
    got = launch_poisoned(ids, num_experts)
    assert_routing_equal(got, (want.slot_rows, want.row_slots, want.row_tokens, want.offsets, want.counts))
    assert int(got[4].sum()) == int((ids >= 0).logical_and(ids < num_experts).sum())


def test_route_takes_the_kernel_sync_free_and_torch_past_it():
    ids = expert_ids(4096, 8, 128, 0.05, "uniform", torch.int32, seed=3)
    assert route_supported(ids, 128)
    want = routing.route_torch(ids, 128)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = routing.route(ids, 128)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert_routing_equal([getattr(got, f) for f in ("slot_rows", "row_slots", "row_tokens", "offsets", "counts")],
                         (want.slot_rows, want.row_slots, want.row_tokens, want.offsets, want.counts))
    wide = expert_ids(500, 4, MAX_BUCKETS, 0.0, "uniform", torch.int64, seed=4)  # E + 1 > MAX_BUCKETS: torch
    assert not route_supported(wide, MAX_BUCKETS)
    assert torch.equal(routing.route(wide, MAX_BUCKETS).slot_rows, routing.route_torch(wide, MAX_BUCKETS).slot_rows)
    assert not route_supported(ids[:0], 128) and routing.route(ids[:0], 128).offsets.tolist() == [0] * 129
