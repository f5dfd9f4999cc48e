"""Torch grouped matmuls over row groups: the reference path every fused kernel is checked against.

All take ``offsets`` (G+1,) int32 from `splits.split_offsets`. On CUDA they never sync with the
host: bf16 goes through ``torch._grouped_mm``; other dtypes use masked per-group products
(G dense products, a fallback). On the CPU they slice groups with host offsets (no device to
sync with). Padding rows (>= offsets[G]) of every row-grouped output are zero.
"""

import torch

from .splits import row_group_ids, valid_rows_mask


def _grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    first = tensors[0]
    if first.device.type != "cuda" or first.dtype != torch.bfloat16:
        return False
    if torch.cuda.get_device_capability(first.device) < (9, 0):
        return False
    return all(t.dtype == first.dtype and t.shape[-1] % 8 == 0 for t in tensors)


def _host_bounds(offsets: torch.Tensor) -> list[int]:
    return offsets.tolist()  # CPU tensors only: no device to sync with


def _cpu_product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` on the CPU. 16-bit operands are multiplied in float32 and rounded once
    into ``out``: the same float32 accumulation as torch's 16-bit CPU matmul, which without bf16
    instructions runs 10-90x slower, depending on the operands' layout."""
    if a.dtype in (torch.bfloat16, torch.float16):
        out.copy_(torch.matmul(a.float(), b.float()))
    else:
        torch.matmul(a, b, out=out)


def grouped_mm_nt(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of group g: ``y = x @ weight[g].T``. x (M, K), weight (G, N, K) -> y (M, N), x's dtype."""
    num_rows, num_groups, out_features = x.shape[0], weight.shape[0], weight.shape[1]
    if x.device.type == "cpu":
        y = x.new_zeros(num_rows, out_features)
        bounds = _host_bounds(offsets)
        for g in range(num_groups):
            lo, hi = bounds[g], bounds[g + 1]
            if hi > lo:
                _cpu_product(x[lo:hi], weight[g].t(), y[lo:hi])
        return y
    if _grouped_mm_ok(x, weight) and out_features % 8 == 0:
        y = torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets[1:])
        return y.masked_fill_(~valid_rows_mask(offsets, num_rows), 0)
    group_ids = row_group_ids(offsets, num_rows).unsqueeze(1)
    y = x.new_zeros(num_rows, out_features)
    for g in range(num_groups):
        y += torch.where(group_ids == g, x, 0) @ weight[g].t()
    return y


def grouped_mm_nn(dy: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Rows of group g: ``dx = dy @ weight[g]``. dy (M, N), weight (G, N, K) -> dx (M, K)."""
    return grouped_mm_nt(dy, weight.transpose(-2, -1), offsets)


def grouped_wgrad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, out_dtype=None) -> torch.Tensor:
    """Per group ``dW[g] = dy_g.T @ x_g`` over the token dim. dy (M, N), x (M, K) -> (G, N, K) in
    ``out_dtype`` (default dy's). A float32 ``out_dtype`` of 16-bit operands keeps the float32 sums
    unrounded, except on ``torch._grouped_mm`` (CUDA, sm90+), whose output is 16-bit."""
    num_groups = offsets.shape[0] - 1
    out_dtype = out_dtype or dy.dtype
    if x.device.type == "cpu":
        dw = dy.new_zeros(num_groups, dy.shape[1], x.shape[1], dtype=out_dtype)
        bounds = _host_bounds(offsets)
        for g in range(num_groups):
            lo, hi = bounds[g], bounds[g + 1]
            if hi > lo:
                _cpu_product(dy[lo:hi].t(), x[lo:hi], dw[g])
        return dw
    if _grouped_mm_ok(dy, x):
        dy_aligned, x_aligned, aligned_ends = align_groups(offsets, dy, x)
        return torch._grouped_mm(dy_aligned.t(), x_aligned, offs=aligned_ends).to(out_dtype)
    group_ids = row_group_ids(offsets, x.shape[0]).unsqueeze(1)
    compute = torch.promote_types(dy.dtype, out_dtype)
    dy_c, x_c = dy.to(compute), x.to(compute)
    return torch.stack([torch.where(group_ids == g, dy_c, 0).t() @ x_c for g in range(num_groups)]).to(out_dtype)


def align_groups(offsets: torch.Tensor, *tensors: torch.Tensor, align: int = 8):
    """Copies of row-grouped ``tensors`` (M, *) where each group starts at a multiple of
    ``align`` rows, gaps and padding rows zero; returns (*copies, aligned group ends (G,) int32).

    ``torch._grouped_mm`` needs 16-byte aligned groups along a contiguous grouped dim (the
    weight-gradient form); this meets it for any split sizes without a host sync. Capacity is
    the static bound ``M + G * (align - 1) + 1``; the last row collects padding rows.
    """
    num_rows, num_groups = tensors[0].shape[0], offsets.shape[0] - 1
    sizes = offsets[1:] - offsets[:-1]
    aligned_ends = torch.cumsum((sizes + align - 1) // align * align, 0)
    aligned_starts = torch.cat([aligned_ends.new_zeros(1), aligned_ends[:-1]])
    capacity = num_rows + num_groups * (align - 1) + 1
    group_ids = row_group_ids(offsets, num_rows)
    shift = torch.cat([aligned_starts - offsets[:-1], aligned_starts.new_zeros(1)])
    rows = torch.arange(num_rows, device=offsets.device)
    dest = torch.where(group_ids < num_groups, rows + shift[group_ids], capacity - 1)
    copies = []
    for t in tensors:
        copy = t.new_zeros(capacity, *t.shape[1:])
        copy.index_copy_(0, dest, t)
        copies.append(copy)
    return (*copies, aligned_ends.to(torch.int32))


def grouped_row_sum(dy: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Per-group column sums (the bias gradient): dy (M, N) -> (G, N) in dy's dtype, summed in
    float32 (16-bit dy) or dy's dtype in a fixed order (run to run identical). CUDA: the (G, M)
    row-membership matrix times dy, one read of dy and no host sync; CPU: each group's rows summed
    over host offsets."""
    num_groups = offsets.shape[0] - 1
    if dy.device.type == "cpu":
        bounds = _host_bounds(offsets)
        accumulate = torch.float32 if dy.dtype in (torch.bfloat16, torch.float16) else dy.dtype
        sums = dy.new_zeros(num_groups, dy.shape[1], dtype=accumulate)
        for g in range(num_groups):
            if bounds[g + 1] > bounds[g]:
                sums[g] = dy[bounds[g] : bounds[g + 1]].to(accumulate).sum(0)
        return sums.to(dy.dtype)
    rows = torch.arange(dy.shape[0], device=dy.device, dtype=offsets.dtype)
    members = ((rows >= offsets[:-1, None]) & (rows < offsets[1:, None])).to(dy.dtype)
    if dy.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(members, dy, out_dtype=torch.float32).to(dy.dtype)
    return members @ dy
