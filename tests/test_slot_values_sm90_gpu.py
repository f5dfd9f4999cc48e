"""GPU tests of the slot-value kernels (`kernels.slot_values`): slot values to the expert rows
(float32) and the rows' partial sums back to the slots, against float64 of the same values and
bit for bit against the torch path of `routing.slots_to_rows` / `routing.rows_to_slots`, over the
routing edge cases (one slot, every slot dropped, every slot on one expert, the same expert twice
in a token, ids outside [0, E)), bf16 / fp16 / fp32 slots, one to five partials; outputs NaN-poisoned
before the kernel runs; no host sync; a CUDA graph replayed on new values."""

import contextlib

import pytest
import torch

from test_grouped_dgrad_sm90_gpu import poison_allocator
from test_route_sm90_gpu import NEEDS_FFI_KERNELS, expert_ids

from te_fused_ops import routing
from te_fused_ops.backends import helper_kernel
from te_fused_ops.backends.sm90.kernels.slot_values import (
    compile_rows_to_slots,
    compile_slots_to_rows,
    slot_values_supported,
)

pytestmark = [pytest.mark.gpu, NEEDS_FFI_KERNELS]

# T, k, E, share of dropped slots, how the ids are drawn (`test_route_sm90_gpu.expert_ids`)
CASES = [
    (1, 1, 1, 0.0, "uniform"),
    (7, 3, 5, 0.2, "uniform"),
    (8192, 8, 128, 0.05, "skewed"),
    (300, 4, 16, 1.0, "uniform"),
    (2500, 8, 64, 0.0, "one expert"),
    (999, 4, 32, 0.1, "duplicates"),
    (1200, 3, 40, 0.0, "out of range"),
]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def routed(case, seed=0):
    tokens, k, num_experts, drop, kind = case
    return routing.route(expert_ids(tokens, k, num_experts, drop, kind, torch.int64, seed), num_experts)


@contextlib.contextmanager
def no_host_sync():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}-E{c[2]}-{c[4]}" for c in CASES])
def test_slots_to_rows(case, dtype):
    tokens, k = case[:2]
    route = routed(case)
    slot_values = torch.rand(tokens, k, device="cuda").to(dtype)
    assert slot_values_supported(route.row_slots, dtype)
    poison_allocator(((tokens * k,), torch.float32))
    with no_host_sync():
        got = helper_kernel("slots_to_rows", slot_values, route)
    assert got is not None and got.dtype == torch.float32 and got.shape == (tokens * k,)
    kept = route.kept_slots().reshape(-1)[route.row_slots]
    want = torch.where(kept, slot_values.double().reshape(-1)[route.row_slots], 0)
    assert torch.equal(got.double(), want)  # a 16-bit or float32 value is exact in float32
    assert torch.equal(got, routing.slots_to_rows_torch(slot_values, route))


@pytest.mark.parametrize("parts", [1, 3, 5])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}x{c[1]}-E{c[2]}-{c[4]}" for c in CASES])
def test_rows_to_slots(case, dtype, parts):
    tokens, k = case[:2]
    route = routed(case, seed=1)
    row_parts = torch.randn(parts, tokens * k, device="cuda")
    poison_allocator(((tokens * k,), dtype))
    with no_host_sync():
        got = helper_kernel("rows_to_slots", row_parts, route, dtype)
    assert got is not None and got.dtype == dtype and got.shape == (tokens, k)
    assert not got.isnan().any()
    sequential = row_parts[0].clone()  # the kernel's order: p = 0, 1, ... in float32
    for p in range(1, parts):
        sequential += row_parts[p]
    want = torch.where(route.kept_slots(), sequential[route.slot_rows], 0).to(dtype)
    assert torch.equal(got, want)
    exact = torch.where(route.kept_slots(), row_parts.double().sum(0)[route.slot_rows], 0)
    torch.testing.assert_close(got.double(), exact, rtol=1e-5 if dtype == torch.float32 else 2**-8, atol=1e-5)
    # the torch path of routing.rows_to_slots sums in its own order: equal to float32 rounding,
    # which may move a value across one rounding step of a 16-bit output
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(got, routing.rows_to_slots_torch(row_parts, route, dtype), rtol=ulp, atol=1e-6)


def test_routing_functions_take_the_kernels_and_torch_where_they_do_not_apply():
    route = routed((500, 4, 16, 0.1, "uniform"))
    slot_values = torch.rand(500, 4, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(routing.slots_to_rows(slot_values, route), routing.slots_to_rows_torch(slot_values, route))
    doubles = slot_values.double()  # float64: not the kernel's, the torch path keeps float64
    rows = routing.slots_to_rows(doubles, route)
    assert rows.dtype == torch.float64 and helper_kernel("slots_to_rows", doubles, route) is None
    row_grad = torch.randn(500 * 4, device="cuda")  # (M,) as the torch backend's activation leaves it
    assert torch.equal(routing.rows_to_slots(row_grad, route, torch.bfloat16),
                       routing.rows_to_slots_torch(row_grad[None], route, torch.bfloat16))
    empty = routing.route(torch.empty(0, 4, dtype=torch.int64, device="cuda"), 16)
    assert routing.slots_to_rows(torch.empty(0, 4, device="cuda"), empty).shape == (0,)
    assert routing.rows_to_slots(torch.empty(2, 0, device="cuda"), empty, torch.bfloat16).shape == (0, 4)


def test_slot_values_in_a_cuda_graph():
    """Captured once, replayed on new routings and values: equal to eager each time."""
    tokens, k, num_experts = 1024, 8, 32
    ids = expert_ids(tokens, k, num_experts, 0.05, "skewed", torch.int64, 0)
    slot_values = torch.rand(tokens, k, device="cuda", dtype=torch.bfloat16)
    row_parts = torch.randn(3, tokens * k, device="cuda")
    compile_slots_to_rows(torch.bfloat16)
    compile_rows_to_slots(torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: every launcher validated outside the capture
        route = routing.route(ids, num_experts)
        routing.slots_to_rows(slot_values, route)
        routing.rows_to_slots(row_parts, route, torch.bfloat16)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route = routing.route(ids, num_experts)
        rows = routing.slots_to_rows(slot_values, route)
        slots = routing.rows_to_slots(row_parts, route, torch.bfloat16)
    for seed in range(3):
        ids.copy_(expert_ids(tokens, k, num_experts, 0.1 * seed, "uniform", torch.int64, seed + 5))
        slot_values.copy_(torch.rand(tokens, k, device="cuda"))
        row_parts.normal_()
        graph.replay()
        eager = routing.route(ids, num_experts)
        assert torch.equal(rows, routing.slots_to_rows(slot_values, eager))
        assert torch.equal(slots, routing.rows_to_slots(row_parts, eager, torch.bfloat16))
