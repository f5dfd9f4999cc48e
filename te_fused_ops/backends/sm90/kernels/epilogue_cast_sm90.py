"""Device helpers shared by the sm90 epilogues (`grouped_act_sm90`, `grouped_dact_sm90`): row
slots and quad transposes of the accumulator fragment, the 1 x 128 E4M3 row and column casts,
running amax, per-row vector reads.

Fragments are a consumer thread's values of a 128 x 32 epilogue chunk in the sm90 accumulator
layout: a quad (4 lanes) holds the same rows, two adjacent columns per lane per 8-column group.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Uint32

from .block_quantize_sm90 import e4m3_scale_inv, e4m3_scaled, packed_finite_abs_max
from .group_tile_scheduler import SORT_MAX_G, Tile


def _value_coords(tiled_copy_r2s, epi_tile, lane: int) -> list:
    """Static (row, col) in the epilogue chunk of each fragment value of consumer thread ``lane``."""
    coords = tiled_copy_r2s.get_slice(lane).partition_S(cute.make_identity_tensor(epi_tile))
    return [tuple(coords[v]) for v in range(cute.size(coords))]


def fragment_row_slots(tiled_copy_r2s, epi_tile):
    """(row_slot, slot_value) of a thread's epilogue fragment: the slot (distinct row) of each
    value v, and one value of each slot. Static: every thread's pattern is thread 0's shifted,
    and the 4 lanes of a quad hold the same rows (sm90 accumulator layout; asserted)."""
    rows = [r for r, _ in _value_coords(tiled_copy_r2s, epi_tile, 0)]
    for lane in (1, 2, 3):
        assert [r for r, _ in _value_coords(tiled_copy_r2s, epi_tile, lane)] == rows, (
            "row slots assume the sm90 accumulator layout")
    distinct = sorted(set(rows))
    return [distinct.index(r) for r in rows], [rows.index(r) for r in distinct]


def fragment_column_slots(tiled_copy_r2s, epi_tile):
    """(column_slot, slot_value) of a thread's epilogue fragment: the slot (distinct column) of
    each value v, and one value of each slot. Static: every lane's columns are lane 0's shifted
    by one offset (sm90 accumulator layout; asserted)."""
    cols = [c for _, c in _value_coords(tiled_copy_r2s, epi_tile, 0)]
    for lane in range(1, 128):
        shifted = [c for _, c in _value_coords(tiled_copy_r2s, epi_tile, lane)]
        assert [c - shifted[0] + cols[0] for c in shifted] == cols, "column slots assume the sm90 accumulator layout"
    distinct = sorted(set(cols))
    return [distinct.index(c) for c in cols], [cols.index(c) for c in distinct]


def quad_column_groups(tiled_copy_r2s, epi_tile, row_slot):
    """[slot][j] -> the pair index p whose values 2p, 2p + 1 sit at columns 8 j + 2 q, + 1 of the
    thread's row slot (``row_slot`` of `fragment_row_slots`; q = lane % 4, the quad position): an
    8-column group of a row is spread over a quad, two adjacent columns per lane (sm90 accumulator
    layout; asserted for every lane)."""
    first = _value_coords(tiled_copy_r2s, epi_tile, 0)
    groups = {(row_slot[2 * p], first[2 * p][1] // 8): p for p in range(len(first) // 2)}
    slots, width = max(row_slot) + 1, epi_tile[1] // 8
    assert sorted(groups) == [(s, j) for s in range(slots) for j in range(width)], "quad groups"
    for lane in range(128):
        coords = _value_coords(tiled_copy_r2s, epi_tile, lane)
        for (slot, j), p in groups.items():
            (r0, c0), (r1, c1) = coords[2 * p], coords[2 * p + 1]
            assert r0 == r1 and c0 == 8 * j + 2 * (lane % 4) and c1 == c0 + 1, (
                "quad groups assume the sm90 accumulator layout")
    return [[groups[(slot, j)] for j in range(width)] for slot in range(slots)]


@cute.jit
def quad_gather(values, q):
    """Four 16-bit values per lane of a quad (``values[j]``: this lane's 2 bytes of column group
    j, in the low half of a Uint32) -> the 8 bytes of group q (``q`` = lane % 4) as two Uint32
    words (columns 8q .. 8q + 3, 8q + 4 .. 8q + 7): a 4 x 4 transpose across the quad in two
    shuffles."""
    def pick(cond, if_value, else_value):  # select_ may hand back a signed value: keep it unsigned
        return Uint32(cutlass.select_(cond, if_value, else_value))

    def hi(word):  # the upper 16 bits, as a low half
        return (word >> 16) & Uint32(0xFFFF)

    def lo(word):
        return word & Uint32(0xFFFF)

    # round 1, with lane q ^ 2: lane q keeps groups 2 (q // 2), + 1 of lanes q % 2 (a) and q % 2 + 2 (b)
    upper = q >= 2
    w0 = values[0] | (values[1] << 16)
    w1 = values[2] | (values[3] << 16)
    got = Uint32(cute.arch.shuffle_sync_bfly(pick(upper, w0, w1), offset=2))
    a = pick(upper, got, w0)
    b = pick(upper, w1, got)
    # round 2, with lane q ^ 1: each lane keeps its own group's halves, sends the partner's
    odd = (q % 2) == 1
    send = pick(odd, lo(a) | (lo(b) << 16), hi(a) | (hi(b) << 16))
    got = Uint32(cute.arch.shuffle_sync_bfly(send, offset=1))
    keep_a = pick(odd, hi(a), lo(a))  # group q of lane q % 2
    keep_b = pick(odd, hi(b), lo(b))  # group q of lane q % 2 + 2
    lane0 = pick(odd, lo(got), keep_a)
    lane1 = pick(odd, keep_a, lo(got))
    lane2 = pick(odd, hi(got), keep_b)
    lane3 = pick(odd, keep_b, hi(got))
    return lane0 | (lane1 << 16), lane2 | (lane3 << 16)


@cute.jit
def store_quad_rows(mData: cute.Tensor, data: cute.Tensor, quad_pairs, tile: Tile, tRS_cD, col0, col_end, m_total):
    """One chunk's E4M3 bytes ``data`` (a thread's fragment) into mData (M, C) at columns col0 ..:
    a quad holds a row's 8-column groups two bytes per lane (`quad_column_groups` ``quad_pairs``),
    so a transpose across the quad (`quad_gather`) gives lane q group q whole: one 8-byte store per
    row slot, rows of the tile's group and columns below ``col_end`` only (C % 8 == 0)."""
    pairs = cute.recast_tensor(data, cutlass.Int16)
    mDataGroups = cute.recast_tensor(mData, cutlass.Uint64)
    q = cute.arch.lane_idx() % 4
    for slot in cutlass.range_constexpr(len(quad_pairs)):
        word0, word1 = quad_gather([Uint32(pairs[p]) & Uint32(0xFFFF) for p in quad_pairs[slot]], q)
        row = tile.row0 + tRS_cD[2 * quad_pairs[slot][0]][0]
        col = col0 + 8 * q
        if row < tile.end and row < m_total and col < col_end:
            mDataGroups[row, col // 8] = cutlass.Uint64(word0) | (cutlass.Uint64(word1) << 32)


# a 128 x 128 tile staged transposed for its column-wise cast: the column stride in elements (264
# bytes of 16-bit values, so the accumulator layout's stores (lanes 4 apart 2 columns apart) and
# 8-byte loads along 16 columns per warp hit distinct banks), and the staging tile's elements
COLUMN_STRIDE = 132
COLUMN_SCRATCH = 128 * COLUMN_STRIDE


@cute.jit
def stage_transposed(sScratch: cute.Tensor, value, tile: Tile, row, col, dtype: cutlass.Constexpr):
    """Value (row, col) of a 128 x 128 tile (tile coordinates) into the transposed staging tile,
    zero for rows past the group's end."""
    sScratch[col * COLUMN_STRIDE + row] = dtype(cutlass.select_(tile.row0 + row < tile.end, value, dtype(0.0)))


@cute.jit
def store_staged_columns(mColData: cute.Tensor, mColScale: cute.Tensor, sScratch: cute.Tensor, sEdges: cute.Tensor,
                         tile: Tile, col0, dtype: cutlass.Constexpr, power_2_scales: cutlass.Constexpr[bool],
                         barrier):
    """The column-wise 1 x 128 E4M3 copy (`BlockColumns`: data (C, 128 * blocks), scale_inv
    (blocks, C)) of a varlen-M tile's 128 columns col0 .. col0 + 127, staged by every consumer
    thread with `stage_transposed`: the tile's 128 rows are one column block of its group (tiles
    start at their group's first row; ``sEdges`` from `scan_group_blocks`). Two consumer threads
    per column, 64 rows each: the amax over 16 8-byte loads, then the loads again, 16 values at a
    time, scaled and stored as 16 bytes. Waits on ``barrier`` (the consumer threads) before, and
    after, so the next staging cannot overwrite what is read."""
    barrier.arrive_and_wait()
    block = sEdges[SORT_MAX_G + 1 + tile.seg] + tile.mt
    tidx, _, _ = cute.arch.thread_idx()
    column, part = (tidx - 128) // 2, tidx % 2  # the column this thread casts, rows 64 part ..
    sUnits = cute.recast_tensor(sScratch, cutlass.Uint64)
    rUnits = cute.make_rmem_tensor((4,), cutlass.Uint64)
    rValues = cute.recast_tensor(rUnits, dtype)
    amax = Float32(0.0)
    for b in cutlass.range_constexpr(4):
        for k in cutlass.range_constexpr(4):
            rUnits[k] = sUnits[column * (COLUMN_STRIDE // 4) + 16 * part + 4 * b + k]
        amax = cute.arch.fmax(amax, packed_finite_abs_max(rValues))  # NaN, Inf count as 0
    amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, offset=1))
    scale_inv, m1, m2 = e4m3_scale_inv(amax, power_2_scales)
    col_out = col0 + column
    in_bounds = block < sEdges[SORT_MAX_G + 2 + tile.seg]  # offsets that decrease give fewer blocks
    if part == 0 and in_bounds:
        mColScale[block, col_out] = scale_inv
    scaled = cute.make_rmem_tensor((16,), Float32)
    data = cute.make_rmem_tensor((16,), cutlass.Float8E4M3FN)
    words = cute.recast_tensor(data, cutlass.Uint64)
    mColUnits = cute.recast_tensor(mColData, cutlass.Uint64)
    for b in cutlass.range_constexpr(4):
        for k in cutlass.range_constexpr(4):
            rUnits[k] = sUnits[column * (COLUMN_STRIDE // 4) + 16 * part + 4 * b + k]
        for j in cutlass.range_constexpr(16):
            scaled[j] = e4m3_scaled(rValues[j].to(Float32), scale_inv, m1, m2, power_2_scales)
        data.store(scaled.load().to(cutlass.Float8E4M3FN))
        if in_bounds:
            for w in cutlass.range_constexpr(2):
                mColUnits[col_out, block * 16 + part * 8 + 2 * b + w] = words[w]
    barrier.arrive_and_wait()


def make_amax_state():
    """A consumer thread's running max |output| (one fp32 register, 0), kept over all its tiles."""
    amax = cute.make_rmem_tensor((1,), Float32)
    amax.fill(0.0)
    return amax


@cute.jit
def track_amax(amax: cute.Tensor, value: Float32, dtype: cutlass.Constexpr, tile: Tile, row, col, n_cols):
    """amax[0] = max(amax[0], |value| as stored in ``dtype``) for a finite value at (row, col) of
    a group's rows and the output's columns (< n_cols); NaN, Inf, padding rows count not."""
    stored = value.to(dtype).to(Float32)
    magnitude = cutlass.max(stored, -stored)
    if magnitude < Float32(float("inf")) and tile.is_group and row < tile.end and col < n_cols:
        amax[0] = cutlass.max(amax[0], magnitude)


@cute.jit
def write_amax_parts(mParts: cute.Tensor, amax: cute.Tensor, consumer_warp, warps: cutlass.Constexpr[int]):
    """After a CTA's last tile: the warp's max of amax[0] at mParts[CTA * warps + consumer_warp]
    (lane 0), zeros at the further indices of its stride (grid * warps), so a buffer of at least
    grid * warps entries is fully written and its max is the output's amax."""
    value = amax[0]
    for step in cutlass.range_constexpr(5):
        value = cutlass.max(value, cute.arch.shuffle_sync_bfly(value, 1 << step))
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    first = bidx * warps + consumer_warp
    if cute.arch.lane_idx() == 0:
        for j in cutlass.range(first, cute.size(mParts), gdim * warps):
            part = Float32(0.0)
            if j == first:
                part = value
            mParts[j] = part


@cute.jit
def load_column_values(rValues: cute.Tensor, mRows: cute.Tensor, row, col0, n_cols, tRS_cD, slot_value, valid):
    """rValues[j * slots + s] = mRows[row, j * n_cols + col0 + c] (float32), c the column of the
    thread's slot s in the chunk (``slot_value`` of `fragment_column_slots`), for each of the
    len(rValues) // slots boxes j; 0 at columns from ``n_cols`` on and where not ``valid``: one
    load a column, not one a value."""
    slots = len(slot_value)
    rValues.fill(0.0)
    if valid:
        for j in cutlass.range_constexpr(cute.size(rValues) // slots):
            for s in cutlass.range_constexpr(slots):
                col = col0 + tRS_cD[slot_value[s]][1]
                if col < n_cols:
                    rValues[j * slots + s] = mRows[row, j * n_cols + col].to(Float32)


@cute.jit
def load_row_values(rValues: cute.Tensor, mVec: cute.Tensor, tile: Tile, tRS_cD, slot_value, m_total: Int32):
    """rValues[s] = mVec[row] of a (M,) float32 tensor at the thread's row slot s of the tile
    (``slot_value`` of `fragment_row_slots`; tRS_cD the chunk's coordinates, the same rows in
    every chunk), 0 outside a group (padding tiles): one load a row, not one a value."""
    rValues.fill(0.0)
    if tile.is_group:
        for s in cutlass.range_constexpr(len(slot_value)):
            rValues[s] = mVec[cutlass.min(tile.row0 + tRS_cD[slot_value[s]][0], m_total - 1)]

