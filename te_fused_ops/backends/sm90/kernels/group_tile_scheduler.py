"""Device-side tile scheduler for grouped GEMMs whose group row counts live on the device.

Segments 0..G-1 are the groups (rows offsets[g]..offsets[g+1], clamped to [0, M]); segment G is
the padding rows offsets[G]..M, whose tiles the kernel fills with zeros. A segment holds
`segment_tiles` cluster tiles (`cluster_tile` maps one to each CTA's m- and n-tile), numbered in
bands of m-tiles (`banded_tile`). A persistent cluster visits the linear tile ids
clusterIdx, clusterIdx + clusters, ... ; each warp maps its id to a segment with
a warp-wide prefix sum over 32 segments at a time. Ids only grow, so the search resumes where the
previous one stopped (state: first segment of the current 32-chunk and the tiles before it).
No host sync, no global scratch; every warp computes the same answer independently.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32

# m-tiles per raster band: a wave of ~66 clusters then spans about 8 x 8 tiles of a segment, so
# it reads ~16 distinct operand tiles where a tall segment walked m-fastest reads ~67
RASTER_BAND = 8
# varlen-K: groups ranked by size in shared memory up to this count (and FP8's group scan)
SORT_MAX_G = 512


@cute.jit
def segment_rows(mOffsets: cute.Tensor, seg: Int32, num_groups: Int32, m_total: Int32):
    """Clamped (start, end) rows of segment ``seg`` (0 <= seg <= num_groups)."""
    start = cutlass.max(cutlass.min(mOffsets[seg], m_total), Int32(0))
    end = m_total
    if seg < num_groups:
        end = cutlass.max(cutlass.min(mOffsets[seg + 1], m_total), start)
    return start, end


def banded_tile(local: Int32, m_tiles: Int32, n_tiles: Int32, band: cutlass.Constexpr[int]):
    """(m-tile, n-tile) of tile ``local`` of an ``m_tiles`` x ``n_tiles`` segment. Tiles run in
    bands of ``band`` m-tiles (the last band may be shorter); a band is walked n-tile by n-tile,
    m fastest inside it, so consecutive tiles (one wave of the persistent grid) share A tiles
    along n and B tiles along m. ``m_tiles <= band`` is the plain m-fastest order. Straight-line
    arithmetic: traced inline by the kernels, and callable on Python ints."""
    first = local // (band * n_tiles) * band
    rest = local - first * n_tiles
    height = cutlass.min(m_tiles - first, band)
    return first + rest % height, rest // height


def _cluster_rows(rows: Int32, tile_m: int, cluster_m: int, split_tail: bool):
    """(cluster tiles stacked along M, 1 if an odd last m-tile is split along N else 0) of a
    segment of ``rows`` rows; Python branches on the compile-time arguments only."""
    m_tiles = (rows + tile_m - 1) // tile_m
    if split_tail and cluster_m == 2:
        return m_tiles // 2, m_tiles % 2
    return (m_tiles + cluster_m - 1) // cluster_m, 0


def segment_tiles(rows: Int32, n_tiles: Int32, tile_m: int, cluster_m: int, split_tail: bool):
    """Cluster tiles of a segment of ``rows`` rows: ceil(m-tiles / cluster_m) * n_tiles; with
    ``split_tail`` (cluster_m 2) an odd last m-tile takes ceil(n_tiles / 2) (`cluster_tile`).
    Straight-line arithmetic, callable on Python ints."""
    stacked, tail = _cluster_rows(rows, tile_m, cluster_m, split_tail)
    return stacked * n_tiles + tail * ((n_tiles + 1) // 2)


@cute.jit
def cluster_tile(
    local: Int32,
    rows: Int32,
    n_tiles: Int32,
    rank: Int32,
    tile_m: cutlass.Constexpr[int],
    cluster_m: cutlass.Constexpr[int],
    split_tail: cutlass.Constexpr[bool],
    band: cutlass.Constexpr[int],
):
    """(m-tile, n-tile, split) of CTA ``rank`` for cluster tile ``local`` of a segment of ``rows``
    rows. A cluster takes cluster_m vertically adjacent m-tiles of one n-tile (they share the B
    tile: multicast), in `banded_tile` order. With ``split_tail`` (cluster_m 2) a segment's odd
    last m-tile is not paired with an empty one: its n-tiles go to the pair two at a time, CTA
    ``rank`` taking n-tile 2t + rank of the same m-tile (split: each CTA loads its own B); an
    odd last n-tile stays a vertical pair whose second CTA has no rows."""
    pairs, _ = _cluster_rows(rows, tile_m, cluster_m, split_tail)
    body = pairs * n_tiles
    mt = Int32(0)
    nt = Int32(0)
    split = Boolean(False)
    if local < body:
        mt, nt = banded_tile(local, pairs, n_tiles, band)
        mt = mt * cluster_m + rank
    else:
        t = local - body
        mt = pairs * cluster_m
        nt = 2 * t
        if nt + 1 < n_tiles:
            nt = nt + rank
            split = Boolean(True)
        else:
            mt = mt + rank
    return mt, nt, split


@cute.jit
def _warp_inclusive_sum(x: Int32, lane: Int32) -> Int32:
    for i in cutlass.range_constexpr(5):
        y = cute.arch.shuffle_sync_up(x, 1 << i)
        if lane >= (1 << i):
            x = x + y
    return x


@cute.jit
def locate_tile(
    tile_id: Int32,
    chunk_start: Int32,
    chunk_base: Int32,
    mOffsets: cute.Tensor,
    num_groups: Int32,
    m_total: Int32,
    n_tiles: Int32,
    tile_m: cutlass.Constexpr[int],
    cluster_m: cutlass.Constexpr[int],
    split_tail: cutlass.Constexpr[bool],
):
    """Find the segment holding linear tile ``tile_id``; called by a whole warp.

    Returns (found, seg, seg_first_tile, chunk_start, chunk_base); pass the last two back in on
    the next call with a larger ``tile_id``.
    """
    lane = cute.arch.lane_idx()
    found = Boolean(False)
    searching = chunk_start <= num_groups
    seg = Int32(0)
    seg_first = Int32(0)
    while searching:
        s = chunk_start + lane
        cnt = Int32(0)
        if s <= num_groups:
            start, end = segment_rows(mOffsets, s, num_groups, m_total)
            cnt = segment_tiles(end - start, n_tiles, tile_m, cluster_m, split_tail)
        incl = _warp_inclusive_sum(cnt, lane)
        total = cute.arch.shuffle_sync(incl, 31)
        if tile_id < chunk_base + total:
            mask = cute.arch.vote_ballot_sync(chunk_base + incl > tile_id)
            first = Int32(cute.arch.clz(cute.arch.brev(mask)))
            seg = chunk_start + first
            seg_first = chunk_base + cute.arch.shuffle_sync(incl - cnt, first)
            found = Boolean(True)
            searching = Boolean(False)
        else:
            chunk_base = chunk_base + total
            chunk_start = chunk_start + 32
            searching = chunk_start <= num_groups
    return found, seg, seg_first, chunk_start, chunk_base


@cute.jit
def scan_group_blocks(sScan: cute.Tensor, second: int, mOffsets: cute.Tensor, num_groups: Int32, m_total: Int32,
                      block: int):
    """One warp: the groups' rows and first ``block``-row blocks, into shared memory sScan.

    sScan[g] (g <= G) = group g's first row: the offsets clamped to [0, M] and made
    non-decreasing, group 0 from row 0 (as `quantization.group_block_index` reads them);
    sScan[second + g] (g <= G) = group g's first block, the blocks (ceil(rows / block)) of the
    groups before it, so sScan[second + G] is their total. Scans 32 groups at a time."""
    lane = cute.arch.lane_idx()
    end_before = Int32(0)
    blocks_before = Int32(0)
    if lane == 0:
        sScan[0] = Int32(0)
    for base in range(0, num_groups, 32):
        g = base + lane
        end = Int32(0)
        if g < num_groups:
            end = cutlass.max(cutlass.min(mOffsets[g + 1], m_total), Int32(0))
        for step in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(end, 1 << step)
            if lane >= (1 << step):
                end = cutlass.max(end, other)
        end = cutlass.max(end, end_before)
        begin = cute.arch.shuffle_sync_up(end, 1)
        if lane == 0:
            begin = end_before
        blocks = (end - begin + block - 1) // block
        through = blocks  # blocks of this chunk's groups up to this lane's
        for step in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(through, 1 << step)
            if lane >= (1 << step):
                through = through + other
        if g < num_groups:
            sScan[g + 1] = end
            sScan[second + g] = blocks_before + through - blocks
        end_before = cute.arch.shuffle_sync(end, 31)
        blocks_before = blocks_before + cute.arch.shuffle_sync(through, 31)
    if lane == 0:
        sScan[second + num_groups] = blocks_before
