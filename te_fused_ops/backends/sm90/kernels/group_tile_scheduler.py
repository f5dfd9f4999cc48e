"""Device-side tile scheduler for grouped GEMMs whose group row counts live on the device.

Segments 0..G-1 are the groups (rows offsets[g]..offsets[g+1], clamped to [0, M]); segment G is
the padding rows offsets[G]..M, whose tiles the kernel fills with zeros. A segment holds
`segment_tiles` cluster tiles (`cluster_tile` maps one to each CTA's m- and n-tile), numbered in
bands of m-tiles (`banded_tile`). A persistent cluster visits the linear tile ids
clusterIdx, clusterIdx + clusters, ... (varlen-K: every other wave reversed, `_next_tile_id`);
each warp maps its id to a segment with a warp-wide prefix sum over 32 segments at a time. Ids
only grow, so the search resumes where the previous one stopped (state: first segment of the
current 32-chunk and the tiles before it).
No host sync, no global scratch; every warp computes the same answer independently.

`GroupTileScheduler` (a mixin of the kernel core) holds both schedules of the core: varlen-M
(the search above) and varlen-K (every group owns the same tiles, groups ranked by size), and the
tile ring through which the producer warp passes each located tile on to the MMA warpgroups.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, const_expr

# m-tiles per raster band: a wave of ~66 clusters then spans about 8 x 8 tiles of a segment, so
# it reads ~16 distinct operand tiles where a tall segment walked m-fastest reads ~67
RASTER_BAND = 8
# varlen-K: groups ranked by size in shared memory up to this count (and FP8's group scan)
SORT_MAX_G = 512
# the tile ring: tiles the producer warp has located, read by the MMA warpgroups
# (entry: found, seg, start, end, mt, nt, row0, has_rows)
TILE_SLOTS = 4
TILE_FIELDS = 8


class Tile(NamedTuple):
    """Where the current tile sits: segment ``seg`` (a group, or the padding rows when seg == G)
    with rows [start, end); m-tile mt of the segment (first row ``row0``), n-tile nt."""

    seg: Int32
    start: Int32
    end: Int32
    mt: Int32
    nt: Int32
    row0: Int32
    is_group: Boolean


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


def reversed_wave_tile(wave: Int32, cluster: Int32, clusters: Int32):
    """Linear tile of ``cluster`` in wave ``wave`` when every odd wave of ``clusters`` tiles is
    dealt in reverse: wave * clusters + cluster, or + clusters - 1 - cluster. Straight-line
    arithmetic, callable on Python ints."""
    return wave * clusters + cluster + wave % 2 * (clusters - 1 - 2 * cluster)


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


class GroupTileScheduler:
    """Kernel-core mixin: the tile schedule (varlen-M or, with ``varlen_k``, varlen-K) and the tile
    ring. Uses the core's tile_m, tile_k, cluster_m, split_tail, raster_band, threads,
    sort_groups, stage_scales and group_blocks."""

    @cute.jit
    def _schedule(self, storage, mOffsets, num_groups, m_total, n_tiles, a_rows, tidx, warp_idx):
        """The tile schedule's state (all threads, before the roles split). Varlen-M: (mOffsets,
        num_groups, m_total, n_tiles). Varlen-K adds m_tiles (cluster tiles along N = ``a_rows``),
        N, the group order (sSched, is_sorted: `_rank_groups`) and FP8's group scan (sEdges).
        FP8 varlen-K and ``group_blocks`` scan the groups' 128-row blocks into shared memory first."""
        sched = (mOffsets, num_groups, m_total, n_tiles)
        sEdges = None  # `scan_group_blocks` (group rows and first blocks)
        if const_expr(self.stage_scales or self.group_blocks):
            sEdges = storage.edges.get_tensor(cute.make_layout(2 * (SORT_MAX_G + 1)))
            if warp_idx == 0:
                scan_group_blocks(sEdges, SORT_MAX_G + 1, mOffsets, num_groups, m_total, 128)
            cute.arch.sync_threads()
        if const_expr(self.varlen_k):
            rows = self.tile_m * self.cluster_m
            sSched = None
            is_sorted = num_groups <= SORT_MAX_G
            if const_expr(self.sort_groups):
                sSched = storage.sched.get_tensor(cute.make_layout(2 * SORT_MAX_G))
            sched = (mOffsets, num_groups, m_total, n_tiles, (a_rows + rows - 1) // rows, a_rows, sSched, is_sorted,
                     sEdges)
            if const_expr(self.sort_groups):
                self._rank_groups(sched, tidx)
        return sched

    @cute.jit
    def _next_tile_id(self, tile_id, first_tile, num_clusters):
        """The linear cluster tile after ``tile_id`` for the cluster whose first is ``first_tile``.
        Varlen-M: ``tile_id + num_clusters``. Varlen-K, whose groups run largest first so a tile
        costs no more than any before it: every other wave of ``num_clusters`` tiles is taken in
        reverse (cluster c takes tile c, then 2 C - 1 - c, then 2 C + c, ...), so no cluster gets
        the dearest tile of every wave. Ids still grow per cluster."""
        result = tile_id + num_clusters
        if const_expr(self.varlen_k):
            result = reversed_wave_tile(tile_id // num_clusters + 1, first_tile, num_clusters)
        return result

    @cute.jit
    def _locate(self, tile_id, c_start, c_base, sched):
        """(found, seg, seg_first, c_start, c_base) of linear cluster tile ``tile_id``: segment (group)
        ``seg`` whose first tile is ``seg_first``; pass c_start, c_base back in with the next id
        (varlen-M: `locate_tile`'s search state; varlen-K: unused, groups by rank)."""
        if const_expr(self.varlen_k):
            _, num_groups, _, n_tiles, m_tiles, _, sSched, is_sorted, _ = sched
            per_group = m_tiles * n_tiles
            found = tile_id < num_groups * per_group
            g = tile_id // per_group
            seg = g
            if const_expr(self.sort_groups):
                if is_sorted & found:
                    seg = sSched[SORT_MAX_G + g]
            result = (found, seg, g * per_group, c_start, c_base)
        else:
            mOffsets, num_groups, m_total, n_tiles = sched
            result = locate_tile(tile_id, c_start, c_base, mOffsets, num_groups, m_total, n_tiles, self.tile_m,
                                 self.cluster_m, self.split_tail)
        return result

    @cute.jit
    def _tile(self, tile_id, seg, seg_first, rank, sched):
        """(Tile, has_rows, split, block0) of this CTA for linear tile ``tile_id`` of segment ``seg``
        (first tile ``seg_first``). has_rows False: the CTA's m-tile lies past the segment's end
        (varlen-K: past N), it only helps its peer load B; split: `cluster_tile`'s split tail (varlen-M);
        block0: the group's first scale block (varlen-K FP8, else 0)."""
        if const_expr(self.varlen_k):
            mt, nt = self._varlen_k_tile(tile_id, seg_first, rank, sched)
            start, length, block0 = self._group_span(seg, sched)
            n_rows = sched[5]
            result = (Tile(seg, start, start + length, mt, nt, mt * self.tile_m, Boolean(True)),
                      mt * self.tile_m < n_rows, Boolean(False), block0)
        else:
            mOffsets, num_groups, m_total, n_tiles = sched
            start, end = segment_rows(mOffsets, seg, num_groups, m_total)
            mt, nt, split = cluster_tile(
                tile_id - seg_first, end - start, n_tiles, rank, self.tile_m, self.cluster_m, self.split_tail,
                self.raster_band,
            )
            result = (Tile(seg, start, end, mt, nt, start + mt * self.tile_m, seg < num_groups),
                      mt * self.tile_m < end - start, split, Int32(0))
        return result

    @cute.jit
    def _publish_tile(self, tile_pipe, tile_write, sTiles, found, tile: Tile, has_rows):
        """Producer warp: one entry of the tile ring (``found`` 0: the schedule's end)."""
        tile_pipe.producer_acquire(tile_write)
        if cute.arch.lane_idx() == 0:
            for i, value in enumerate((found, tile.seg, tile.start, tile.end, tile.mt, tile.nt, tile.row0, has_rows)):
                sTiles[i, tile_write.index] = Int32(value)
        tile_pipe.producer_commit(tile_write)

    @cute.jit
    def _read_tile(self, sTiles, index, num_groups):
        """(Tile, has_rows) of tile-ring entry ``index``."""
        seg, start, end, mt, nt, row0, has_rows = (sTiles[i, index] for i in range(1, TILE_FIELDS))
        is_group = Boolean(True) if const_expr(self.varlen_k) else seg < num_groups
        return Tile(seg, start, end, mt, nt, row0, is_group), has_rows != 0

    @cute.jit
    def _varlen_k_tile(self, tile_id, seg_first, rank, sched):
        """Varlen-K: (m-tile, n-tile) of this CTA for linear tile ``tile_id`` of a group whose first tile
        is ``seg_first`` (`banded_tile` over cluster tiles; CTA ``rank`` takes the pair's m-tile)."""
        n_tiles, m_tiles = sched[3], sched[4]
        mt, nt = banded_tile(tile_id - seg_first, m_tiles, n_tiles, self.raster_band)
        return mt * self.cluster_m + rank, nt

    @cute.jit
    def _group_span(self, g, sched):
        """Varlen-K: (first row, rows, first scale block) of group g, offsets clamped to [0, M]
        (block 0); FP8, from the scan of `scan_group_blocks`."""
        mOffsets, _, m_total, _, _, _, _, _, sEdges = sched
        if const_expr(self.stage_scales):
            start = sEdges[g]
            length = sEdges[g + 1] - start
            block0 = sEdges[SORT_MAX_G + 1 + g]
        else:
            start = cutlass.max(cutlass.min(mOffsets[g], m_total), Int32(0))
            length = cutlass.max(cutlass.min(mOffsets[g + 1], m_total), start) - start
            block0 = Int32(0)
        return start, length, block0

    @cute.jit
    def _rank_groups(self, sched, tidx):
        """Varlen-K: sSched[SORT_MAX_G + r] = the group of rank r by k-tile count (descending, then
        index). All threads of the CTA take part; sSched[:G] holds the counts. The loops' trip counts
        do not depend on the thread (a per-thread loop here made ptxas serialize every WGMMA: C7520)."""
        num_groups, sSched, is_sorted = sched[1], sched[6], sched[7]
        if is_sorted:
            for base in range(0, num_groups, self.threads):
                g = base + tidx
                if g < num_groups:
                    _, length, _ = self._group_span(g, sched)
                    sSched[g] = (length + self.tile_k - 1) // self.tile_k
        cute.arch.sync_threads()
        if is_sorted:
            for base in range(0, num_groups, self.threads):
                g = base + tidx
                if g < num_groups:
                    kg = sSched[g]
                    r = Int32(0)
                    for h in range(num_groups):
                        kh = sSched[h]
                        if (kh > kg) | ((kh == kg) & (h < g)):
                            r = r + 1
                    sSched[SORT_MAX_G + r] = g
        cute.arch.sync_threads()
