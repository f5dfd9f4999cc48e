"""The mainloop of the sm90 grouped GEMM core (`grouped_gemm_sm90`, both schedules): the WGMMA
steps, and `Sm90Mainloop` (a mixin of the core) with the TMA producer warp, the consumer
warpgroups' k-loop of one tile and the FP8 block-scale promotion.

A dynamic loop carries pipeline states only when its own body advances them, so the k-loops live
in the methods that own the states and hand them back.
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Float32, Int32, const_expr

from .group_tile_scheduler import TILE_SLOTS, Tile
from .named_barriers_sm90 import MMA_TURN
from .varlen_sm90 import group_token_view


@cute.jit
def mma_stage(tiled_mma, acc, tCrA, tCrB, stage):
    """acc += the (tile_m, tile_n) product of the k-tile held in pipeline stage ``stage``."""
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], acc)


def first_rows(t):
    """The first MMA atom along M (mode 1) of a WGMMA fragment or accumulator, its modes kept."""
    shape, stride = list(t.shape), list(t.stride)
    shape[1] = 1
    return cute.make_tensor(t.iterator, cute.make_layout(tuple(shape), stride=tuple(stride)))


@cute.jit
def mma_stage_first_rows(tiled_mma, acc, tCrA, tCrB, stage):
    """acc's first 64 rows += their product of the k-tile in stage ``stage`` (one warpgroup's
    whole-tile MMA, rows 64-127 left as they are)."""
    acc_rows = first_rows(acc)
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, acc_rows, first_rows(tCrA[(None, None, kb, stage)]), tCrB[(None, None, kb, stage)],
                  acc_rows)


@cute.jit
def mma_block(tiled_mma, acc_block, tCrA, tCrB, stage):
    """acc_block = the product of the k-tile (one FP8 scale block) in stage ``stage``; the
    caller turns ACCUMULATE off first, in its loop body (so the MMA stays loop-carried)."""
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, acc_block, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], acc_block)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)


class BlockScaledOperands(NamedTuple):
    """An MMA thread's FP8 block-scaled operands: ``product`` the fp32 product of one scale block
    before its promotion into acc (with ``overlap_promotion`` a pair, one in flight while the other
    is promoted); tCrA, tCrB the WGMMA operand views of the stages; ``scales`` the multipliers'
    source (global scale tensors, or varlen-K the staged (sSFA, sSFB)); ``acc_coords`` acc's
    (row, column) coordinates in the tile."""

    product: object
    tCrA: object
    tCrB: object
    scales: object
    acc_coords: object


class Sm90Mainloop:
    """Kernel-core mixin: the producer warp's loads, the consumer warpgroups' k-loop and, for
    block-scaled FP8 operands, the per-block promotion into the fp32 accumulator."""

    @cute.jit
    def _produce(self, pipes, sTiles, smem_tensors, tma_a, mA, tma_b, mB, scales, sched, first_tile, num_clusters,
                 rank, k_tiles, gather=None, warp_idx=0):
        """Producer warp: locate each tile of the CTA, publish it in the tile ring, load its k-tiles
        (A, the B boxes and, varlen-K FP8, the multipliers) into the A/B stages. ``gather_a``: every
        warp of the producer warpgroup (``warp_idx``) runs it and loads A's rows (varlen-K: tokens) of
        ``gather`` (x, index) with cp.async; warp 0 alone publishes the tiles and loads B."""
        ab_pipe, tile_pipe = pipes.ab, pipes.tile
        sA, sB_boxes, sSFA, sSFB = smem_tensors.sA, smem_tensors.sB_boxes, smem_tensors.sSFA, smem_tensors.sSFB
        b_mcast_mask = cutlass.Int16((1 << self.cluster_m) - 1)
        state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.ab_stages
        )
        tile_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, TILE_SLOTS)
        tile_id = first_tile
        gather_copy = self._gather_copy(sA) if const_expr(self.gather_a) else None
        found, seg, seg_first, c_start, c_base = self._locate(tile_id, Int32(0), Int32(0), sched)
        while found:
            tile, has_rows, split, block0 = self._tile(tile_id, seg, seg_first, rank, sched)
            if const_expr(self.gather_a):
                if warp_idx == 0:
                    self._publish_tile(tile_pipe, tile_write, sTiles, Int32(1), tile, has_rows)
                    tile_write.advance()
            else:
                self._publish_tile(tile_pipe, tile_write, sTiles, Int32(1), tile, has_rows)
                tile_write.advance()
            if tile.is_group:
                # slice r of the B box is what CTA r of a pair loads for both; a split
                # tile's CTA loads every slice of its own box, for itself only
                start, mt, nt = tile.start, tile.mt, tile.nt
                tile_k_tiles = k_tiles
                if const_expr(self.varlen_k):
                    length = tile.end - start
                    tile_k_tiles = (length + self.tile_k - 1) // self.tile_k
                    gA = cute.local_tile(  # (tile_m, tile_k, k-tiles)
                        group_token_view(mA, start, length, block0, self.stage_scales, self.tile_k), (self.tile_m, self.tile_k), (mt, None)
                    )
                    gB = cute.local_tile(
                        group_token_view(mB, start, length, block0, self.stage_scales, self.tile_k), (self.box_n, self.tile_k), (nt, None)
                    )
                else:
                    gA = cute.local_tile(
                        cute.domain_offset((start, None), mA), (self.tile_m, self.tile_k), (mt, None)
                    )
                    gB = cute.local_tile(  # (box_n, tile_k, k_tiles, b_boxes)
                        mB[(None, None, None, seg)], (self.box_n, self.tile_k), (nt, None, None)
                    )
                tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                    tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2), cute.group_modes(gA, 0, 2)
                )
                tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                    tma_b, rank, cute.make_layout(self.cluster_m), sB_boxes, cute.group_modes(gB, 0, 2)
                )
                slices = [
                    cute.nvgpu.cpasync.tma_partition(
                        tma_b, r, cute.make_layout(self.cluster_m), sB_boxes, cute.group_modes(gB, 0, 2)
                    )
                    for r in range(self.cluster_m if const_expr(self.split_tail) else 0)
                ]
                scale_parts = ()
                if const_expr(self.stage_scales):  # (tile, blocks) of each operand's multipliers
                    scale_parts = tuple(
                        cute.nvgpu.cpasync.tma_partition(
                            atom, 0, cute.make_layout(1), cute.group_modes(sSF, 0, 2),
                            cute.group_modes(cute.local_tile(mSF, (cute.size(sSF, mode=[0]), 1), (t, None)), 0, 2),
                        )
                        for (atom, mSF), sSF, t in zip(scales, (sSFA, sSFB), (mt, nt))
                    )
                own_mask = cutlass.Int16(1) << rank
                gathers_rows = self.gather_a and not self.varlen_k
                sources = self._gather_sources(gather, tile, sched[2]) if const_expr(gathers_rows) else None
                for k in range(tile_k_tiles):
                    if const_expr(self.gather_a):
                        # every thread waits for the stage; warp 0 also expects B's bytes
                        if warp_idx == 0:
                            ab_pipe.producer_acquire(state)
                        else:
                            ab_pipe.sync_object_empty.wait(state.index, state.phase)
                        bar = ab_pipe.producer_get_barrier(state)
                        if const_expr(self.varlen_k):
                            self._gather_token_k_tile(gather_copy, gather, tile, k, state.index, bar)
                        else:
                            self._gather_k_tile(gather_copy, gather[0], sources, k, state.index, bar)
                        if warp_idx == 0:
                            self._load_b(tma_b, tBgB, tBsB, slices, split, own_mask, b_mcast_mask, k, state.index,
                                         bar)
                    else:
                        ab_pipe.producer_acquire(state)
                        bar = ab_pipe.producer_get_barrier(state)
                        cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                        self._load_b(tma_b, tBgB, tBsB, slices, split, own_mask, b_mcast_mask, k, state.index, bar)
                    for (atom, _), (tSFs, tSFg) in zip(scales if const_expr(self.stage_scales) else (),
                                                        scale_parts):
                        cute.copy(atom, tSFg[(None, block0 + k)], tSFs[(None, state.index)], tma_bar_ptr=bar)
                    ab_pipe.producer_commit(state)
                    state.advance()
            tile_id = self._next_tile_id(tile_id, first_tile, num_clusters)
            found, seg, seg_first, c_start, c_base = self._locate(tile_id, c_start, c_base, sched)
        if const_expr(self.gather_a):
            if warp_idx == 0:
                self._end_schedule(ab_pipe, tile_pipe, tile_write, sTiles, state)
            else:
                cute.arch.cp_async_wait_group(0)
        else:
            self._end_schedule(ab_pipe, tile_pipe, tile_write, sTiles, state)

    @cute.jit
    def _load_b(self, tma_b, tBgB, tBsB, slices, split, own_mask, b_mcast_mask, k, stage, bar):
        """Producer warp: k-tile k of the B boxes into stage ``stage`` (a split tile's CTA loads every
        slice of its own box, for itself only)."""
        for h in cutlass.range_constexpr(self.b_boxes):
            if split:
                for sB_r, gB_r in slices:
                    cute.copy(tma_b, gB_r[(None, k, h)], sB_r[(None, h, 0, stage)], tma_bar_ptr=bar,
                              mcast_mask=own_mask)
            else:
                cute.copy(
                    tma_b,
                    tBgB[(None, k) if const_expr(self.varlen_k) else (None, k, h)],
                    tBsB[(None, h, 0, stage)],
                    tma_bar_ptr=bar,
                    mcast_mask=b_mcast_mask if const_expr(self.cluster_m > 1) else 0,
                )

    @cute.jit
    def _end_schedule(self, ab_pipe, tile_pipe, tile_write, sTiles, state):
        """Producer warp: the tile ring's end-of-schedule entry, then wait until every A/B stage is
        released."""
        tile_pipe.producer_acquire(tile_write)
        if cute.arch.lane_idx() == 0:
            sTiles[0, tile_write.index] = Int32(0)  # the end of the schedule
        tile_pipe.producer_commit(tile_write)
        ab_pipe.producer_tail(state)

    def _gather_copy(self, sA):
        """(the 16-byte cp.async atom, this thread's view of A's gathered stages). Varlen-M: a 128 x
        64 K-major k-tile as 16 rows x 8 threads, (vector, 8 rows, 1, stages); varlen-K: a tile_m x
        64 MN-major k-tile as 8 threads along each 64-column block x 16 tokens, (vector, column
        blocks, token passes, stages)."""
        atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
                                   self.ab_dtype, num_bits_per_copy=128)  # L2 only: each row is read once here
        tidx, _, _ = cute.arch.thread_idx()
        if const_expr(self.varlen_k):
            tiled = cute.make_tiled_copy_tv(atom, cute.make_layout((8, 16), stride=(1, 8)), cute.make_layout((8, 1)))
        else:
            tiled = cute.make_tiled_copy_tv(atom, cute.make_layout((16, 8), stride=(8, 1)), cute.make_layout((1, 8)))
        return atom, tiled.get_slice(tidx % 128).partition_D(sA)

    @cute.jit
    def _gather_sources(self, gather, tile: Tile, m_total):
        """gather_a: the element offsets into x of this thread's 16 bytes of its 8 rows of the tile,
        rows tile.row0 + tidx / 8 + 16 i (past the last grouped row: the last one) at column 8 *
        (tidx % 8); token ids clamped to [0, T)."""
        mX, mIndex = gather
        tidx, _, _ = cute.arch.thread_idx()
        row = tile.row0 + (tidx % 128) // 8
        tokens, k = cute.size(mX, mode=[0]), cute.size(mX, mode=[1])
        sources = []
        for i in cutlass.range_constexpr(8):
            token = mIndex[cutlass.min(row + 16 * i, m_total - 1)]
            token = cutlass.min(cutlass.max(token, Int32(0)), tokens - 1)
            sources.append(cutlass.Int64(token) * cutlass.Int64(k) + cutlass.Int64((tidx % 8) * 8))
        return sources

    @cute.jit
    def _gather_token_k_tile(self, gather_copy, gather, tile: Tile, k, stage, bar):
        """Varlen-K gather_a: this thread's 16 bytes of x[index[token]] at columns mt * tile_m + 64 b
        + 8 * (tidx % 8) of each 64-column block b, for its tokens (tidx % 128) / 8 + 16 j of k-tile
        k of the tile's group (past the group's end: its last row), into A's stage ``stage`` by
        cp.async, and its arrival on the stage's full barrier once they have landed. A thread's
        token id is read once for all its blocks and its blocks are one row address apart by
        constants; vectors past x's width are not loaded (their A rows only reach output rows
        the stores clip)."""
        atom, tAsA = gather_copy
        mX, mIndex = gather
        tidx, _, _ = cute.arch.thread_idx()
        tokens, width = cute.size(mX, mode=[0]), cute.size(mX, mode=[1])
        item = self.ab_dtype.width // 8
        col = tile.mt * self.tile_m + (tidx % 8) * 8
        lane_base = mX.iterator.toint() + cutlass.Int64(col * item)
        first = tile.start + k * self.tile_k + (tidx % 128) // 8
        for j in cutlass.range_constexpr(self.tile_k // 16):
            token = mIndex[cutlass.min(first + 16 * j, tile.end - 1)]
            token = cutlass.min(cutlass.max(token, Int32(0)), tokens - 1)
            row = lane_base + cutlass.Int64(token) * cutlass.Int64(width * item)
            for b in cutlass.range_constexpr(self.tile_m // 64):
                if col + 64 * b < width:
                    self._copy_vector(atom, row + 64 * b * item, tAsA[(None, b, j, stage)])
        cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    @cute.jit
    def _gather_k_tile(self, gather_copy, mX, sources, k, stage, bar):
        """gather_a: this thread's 8 x 16 bytes of A's k-tile k into stage ``stage`` by cp.async, and
        its arrival on the stage's full barrier once they have landed."""
        atom, tAsA = gather_copy
        item = self.ab_dtype.width // 8
        base = mX.iterator.toint() + cutlass.Int64(k * self.tile_k * item)
        for i in cutlass.range_constexpr(8):
            self._copy_vector(atom, base + sources[i] * item, tAsA[(None, i, 0, stage)])
        cute.arch.cp_async_mbarrier_arrive_noinc(bar)

    @cute.jit
    def _copy_vector(self, atom, address, dst):
        """cp.async of the 16 bytes at global byte address ``address`` (16-byte aligned: whole
        vectors of rows whose length is a multiple of 8) into ``dst``."""
        src = cute.make_ptr(self.ab_dtype, address, cute.AddressSpace.gmem, assumed_align=16)
        cute.copy(atom, cute.make_tensor(src, cute.make_layout(dst.shape)), dst)

    def _half_tiled_mma(self):
        """`split_products`: the MMA of one 128-column half of the tile (both warpgroups on M)."""
        import cutlass.utils.hopper_helpers as sm90_utils

        return sm90_utils.make_trivial_tiled_mma(
            self.ab_dtype, self.ab_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype, (self.mma_atoms, 1, 1), tiler_mn=(64, self.tile_n // 2),
        )

    def _mma_fragments(self, tiled_mma, mma_tidx, smem_tensors, scales):
        """(acc, tCrA, tCrB, fp8_args) of an MMA thread: the fp32 accumulator, the WGMMA operand
        views of the stages and, FP8, its `BlockScaledOperands` (None otherwise).
        `split_products`: the operand views and the product are those of the half-width MMA, tCrB
        one view per 128-row half of the B stage; acc's values of half h are its
        [64 h, 64 h + 64) (the WGMMA accumulator orders a thread's values column group last)."""
        thr_mma = tiled_mma.get_slice(mma_tidx)
        # the operand views depend on the warpgroup only: sliced by its first thread, warp-uniform,
        # the FP8 k-loop builds its WGMMA descriptors in uniform registers
        operand_tidx = mma_tidx
        if const_expr(self.block_scaled):
            operand_tidx = cute.arch.make_warp_uniform(mma_tidx // 128) * 128
        thr_operands = tiled_mma.get_slice(operand_tidx)
        acc_shape = thr_mma.partition_shape_C((self.tile_m, self.tile_n))
        acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
        if const_expr(self.split_products):
            half_mma = self._half_tiled_mma()
            thr_half = half_mma.get_slice(operand_tidx)
            half = self.tile_n // 2
            tCrA = half_mma.make_fragment_A(thr_half.partition_A(smem_tensors.sA))
            tCrB = tuple(
                half_mma.make_fragment_B(thr_half.partition_B(
                    cute.local_tile(smem_tensors.sB, (half, self.tile_k, cute.size(smem_tensors.sB, mode=[2])),
                                    (h, 0, 0))))
                for h in range(2)
            )
            block_shape = thr_half.partition_shape_C((self.tile_m, half))
        else:
            tCrA = tiled_mma.make_fragment_A(thr_operands.partition_A(smem_tensors.sA))
            tCrB = tiled_mma.make_fragment_B(thr_operands.partition_B(smem_tensors.sB))
            block_shape = acc_shape
        fp8_args = None
        if const_expr(self.block_scaled):
            tCcAcc = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
            block_scales = (smem_tensors.sSFA, smem_tensors.sSFB) if const_expr(self.stage_scales) else scales
            acc_block = cute.make_rmem_tensor(block_shape, self.acc_dtype)
            if const_expr(self.overlap_promotion):  # two block products, one in flight while the other is promoted
                acc_block = (acc_block, cute.make_rmem_tensor(acc_shape, self.acc_dtype))
            fp8_args = BlockScaledOperands(acc_block, tCrA, tCrB, block_scales, tCcAcc)
        return acc, tCrA, tCrB, fp8_args

    @cute.jit
    def _mainloop_tile(self, ab_pipe, read_state, release_state, tiled_mma, mainloop_args, scales, tile: Tile,
                       tile_k_tiles, n_box, m_total, store_args, pending, pending_tile, epi_count, mma_wg):
        """acc = the tile's product over its ``tile_k_tiles`` k-tiles (0: padding tiles, empty groups,
        acc stays zero). FP8: each block's WGMMAs, then its promotion (`_fp8_k_tile`). The first
        k-tiles are issued outside the k-loop: with defer_stores num_steps, each followed by one
        chunk store of the previous tile (`_store_chunk`); else one (16-bit: it starts the WGMMA
        chain) or none (FP8: every block is alike). The accumulate flag changes inside the loops
        and stays loop-carried. Ping-pong: the k-loop waits for MMA warpgroup ``mma_wg``'s turn and
        passes it on once its last WGMMAs are issued. 16-bit varlen-M, a group's last tile half full
        or less: a cooperative warpgroup whose rows all lie past the group's end issues no WGMMAs
        but waits for and releases every stage; a ping-pong warpgroup issues its first 64 rows'
        only, in a k-loop of their own (one loop whose k-tiles branch between the two made ptxas
        serialize every WGMMA). The rows left out keep acc's zeros and the stores clip them.
        Returns (tiled_mma, read_state, release_state, epi_count)."""
        acc, tCrA, tCrB, fp8_args = mainloop_args
        if const_expr(self.pingpong):
            cute.arch.barrier(barrier_id=MMA_TURN + mma_wg, number_of_threads=256)
        acc.fill(0.0)
        multipliers = Float32(0.0)
        if const_expr(self.block_scaled and not self.stage_scales):
            multipliers = self._block_scales(scales, tile, fp8_args.acc_coords, 0, n_box, m_total)
        # varlen-M: one branch around the whole mainloop (k-tiles or none); defer_stores: the
        # previous tile's stores run whatever this tile's k-tile count
        runs = Boolean(True) if const_expr(self.defer_stores) else tile_k_tiles > 0
        # a group's last tile, half full or less: the other warpgroup has the tensor cores alone
        computes = Boolean(True)
        if const_expr(self.mma_atoms > 1 and not self.varlen_k and not self.block_scaled):
            computes = tile.end - tile.row0 > mma_wg * (self.tile_m // self.mma_atoms)
        if const_expr(self.overlap_promotion):
            if runs:
                tiled_mma, read_state, release_state = self._fp8_overlapped_k_tiles(
                    ab_pipe, read_state, release_state, tiled_mma, acc, fp8_args, tile, tile_k_tiles, multipliers,
                    n_box, m_total,
                )
        elif runs:
            loop = dict(ab_pipe=ab_pipe, tiled_mma=tiled_mma, mainloop_args=mainloop_args, tile=tile,
                        tile_k_tiles=tile_k_tiles, multipliers=multipliers, n_box=n_box, m_total=m_total,
                        store_args=store_args, pending=pending, pending_tile=pending_tile, mma_wg=mma_wg,
                        computes=computes)
            if const_expr(self.mma_atoms == 1 and self.tile_m == 128 and not self.varlen_k and not self.block_scaled):
                # a group's last tile, half full or less: the warpgroup computes its first 64 rows
                if tile.end - tile.row0 <= 64:
                    tiled_mma, read_state, release_state, epi_count = self._k_tiles(
                        read_state, release_state, epi_count, first_rows=True, **loop)
                else:
                    tiled_mma, read_state, release_state, epi_count = self._k_tiles(
                        read_state, release_state, epi_count, first_rows=False, **loop)
            elif const_expr(self.box_may_split and self.box_n == 192 and not self.stage_scales):
                # one 192-row W box: its second W block starts at column group 16 on even n-tiles
                # and 8 on odd ones; a k-loop for each keeps the choice out of every promotion
                if tile.nt % 2 == 0:
                    tiled_mma, read_state, release_state, epi_count = self._k_tiles(
                        read_state, release_state, epi_count, first_rows=False, box_split=16, **loop)
                else:
                    tiled_mma, read_state, release_state, epi_count = self._k_tiles(
                        read_state, release_state, epi_count, first_rows=False, box_split=8, **loop)
            else:
                tiled_mma, read_state, release_state, epi_count = self._k_tiles(
                    read_state, release_state, epi_count, first_rows=False, **loop)
        if const_expr(self.pingpong):
            if not runs:  # a tile without k-tiles passes the turn on at once
                cute.arch.barrier_arrive(barrier_id=MMA_TURN + 1 - mma_wg, number_of_threads=256)
        return tiled_mma, read_state, release_state, epi_count

    @cute.jit
    def _k_tiles(self, read_state, release_state, epi_count, *, ab_pipe, tiled_mma, mainloop_args, tile,
                 tile_k_tiles, multipliers, n_box, m_total, store_args, pending, pending_tile, mma_wg, computes,
                 first_rows, box_split: cutlass.Constexpr[int] = 0):
        """The k-loop of `_mainloop_tile` over a tile with k-tiles; ``first_rows`` (16-bit ping-pong):
        the WGMMAs of the tile's first 64 rows only; ``box_split``: see `_promote`. Returns (tiled_mma,
        read_state, release_state, epi_count)."""
        acc, tCrA, tCrB, fp8_args = mainloop_args
        peeled = self.num_steps if const_expr(self.defer_stores) else 0 if const_expr(self.block_scaled) else 1
        for step in cutlass.range_constexpr(peeled):
            if step < tile_k_tiles:
                if const_expr(self.block_scaled):
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                    multipliers = self._fp8_k_tile(ab_pipe, read_state, tiled_mma, acc, fp8_args, tile,
                                                   step, multipliers, n_box, m_total, box_split)
                    read_state.advance()
                else:
                    if const_expr(step == 0):
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                        cute.nvgpu.warpgroup.fence()
                    ab_pipe.consumer_wait(read_state)
                    self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index, computes, first_rows)
                    read_state.advance()
                    if const_expr(step > 0):
                        cute.nvgpu.warpgroup.wait_group(1)
                        ab_pipe.consumer_release(release_state)
                        release_state.advance()
            if const_expr(self.defer_stores):
                if pending_tile[0] != 0:
                    self._store_chunk(store_args, pending[step], pending_tile, step, epi_count)
                    epi_count = epi_count + 1
        for k in range(peeled, tile_k_tiles):
            if const_expr(self.block_scaled):
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                multipliers = self._fp8_k_tile(ab_pipe, read_state, tiled_mma, acc, fp8_args, tile, k,
                                               multipliers, n_box, m_total, box_split)
                read_state.advance()
            else:
                ab_pipe.consumer_wait(read_state)
                self._mma_k_tile(tiled_mma, acc, tCrA, tCrB, read_state.index, computes, first_rows)
                cute.nvgpu.warpgroup.wait_group(1)
                ab_pipe.consumer_release(release_state)
                release_state.advance()
                read_state.advance()
        if const_expr(not self.block_scaled):
            if const_expr(self.pingpong):
                cute.arch.barrier_arrive(barrier_id=MMA_TURN + 1 - mma_wg, number_of_threads=256)
            cute.nvgpu.warpgroup.wait_group(0)  # unconditional: ptxas sees every path waited
            if tile_k_tiles > 0:
                ab_pipe.consumer_release(release_state)
                release_state.advance()
        return tiled_mma, read_state, release_state, epi_count

    @cute.jit
    def _mma_k_tile(self, tiled_mma, acc, tCrA, tCrB, stage, computes, first_rows):
        """16-bit: the k-tile's WGMMAs (``first_rows``: of the tile's first 64 rows) and their
        commit group, inside the branch on ``computes``: outside it, ptxas gives the branch
        without WGMMAs an empty commit group a k-tile."""
        if computes:
            if const_expr(first_rows):
                mma_stage_first_rows(tiled_mma, acc, tCrA, tCrB, stage)
            else:
                mma_stage(tiled_mma, acc, tCrA, tCrB, stage)
            cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _block_scales(self, scales, tile: Tile, tCcAcc, k, n_box, m_total):
        """FP8: the multipliers of scale block ``k`` for this thread's accumulator (`_promote`
        applies them): (row 0, row 1) of A and, per B box h, (first, second, split): the
        multipliers of the two 128-row blocks of W the box can touch and the first 8-column
        group of the box inside the second one.

        The WGMMA accumulator of one thread holds values (i, r, j) at row row0 + 8 r and column
        col0 + i + 8 j (``tCcAcc``): two rows; B box h = 0 covers columns [0, box_n), h = 1 (GLU)
        [box_n, tile_n) and W rows from h n_box + nt box_n. A box of 64 or 128 rows lies inside
        one block (n_box a multiple of 64); 96 or 192 rows can cross one block edge (never two:
        the box starts at a multiple of 32 or 64 inside its block). Indices are clamped to what
        exists: the mainloop loads one block ahead, and padding tiles load before their empty
        loop."""
        mSFA, mSFB = scales
        k = cutlass.min(k, cute.size(mSFA, mode=[1]) - 1)
        seg = cutlass.min(tile.seg, cute.size(mSFB, mode=[0]) - 1)
        last_block = cute.size(mSFB, mode=[1]) - 1
        row0 = tile.row0 + tCcAcc[0][0]
        # 32-bit element offsets into flat views (2^31 multipliers of x would take 256 GiB of
        # E4M3 rows, of W 32 TiB): the layouts' 64-bit strides cost wide multiplies every block
        flat_a = cute.make_tensor(mSFA.iterator, cute.make_layout(cute.size(mSFA)))
        flat_b = cute.make_tensor(mSFB.iterator, cute.make_layout(cute.size(mSFB)))
        a_row, a_k = Int32(mSFA.layout.stride[0]), Int32(mSFA.layout.stride[1])  # a_k: 1 where compact
        b_seg, b_block, b_k = (Int32(mSFB.layout.stride[0]), Int32(mSFB.layout.stride[1]),
                               Int32(mSFB.layout.stride[2]))
        rows = (flat_a[cutlass.min(row0, m_total - 1) * a_row + k * a_k],
                flat_a[cutlass.min(row0 + 8, m_total - 1) * a_row + k * a_k])
        boxes = []
        for h in cutlass.range_constexpr(self.b_boxes):
            first_row = h * n_box + tile.nt * self.box_n
            block = first_row // 128
            first = flat_b[seg * b_seg + block * b_block + k * b_k]
            second, split = first, Int32(0)
            if const_expr(self.box_may_split or (self.up_box_split and h == 1)):
                second = flat_b[seg * b_seg + cutlass.min(block + 1, last_block) * b_block + k * b_k]
                split = (128 - first_row % 128) // 8
            boxes.append((first, second, split))
        return rows, tuple(boxes)

    @cute.jit
    def _promote(self, acc, acc_block, multipliers, box_split: cutlass.Constexpr[int] = 0):
        """acc += acc_block scaled per (row, W block) (`_block_scales` gives the multipliers).
        ``box_split``: where a box crosses a W block edge, the column group (of 8) where the second
        block starts when it is known at compile time; 0: chosen per value at run time."""
        rows, boxes = multipliers
        cols_per_box = self.box_n // 8  # j values per B box
        first = [[rows[r] * boxes[h][0] for h in range(self.b_boxes)] for r in range(2)]
        second = first
        if const_expr(self.box_may_split):
            second = [[rows[r] * boxes[h][1] for h in range(self.b_boxes)] for r in range(2)]
        for v in cutlass.range_constexpr(cute.size(acc)):
            r, j = v // 2 % 2, v // 4
            h = j // cols_per_box
            scale = first[r][h]
            if const_expr(self.box_may_split and box_split > 0):
                scale = first[r][h] if const_expr(j % cols_per_box < box_split) else second[r][h]
            elif const_expr(self.box_may_split):
                scale = Float32(cutlass.select_(j % cols_per_box < boxes[h][2], first[r][h], second[r][h]))
            acc[v] = acc[v] + acc_block[v] * scale

    @cute.jit
    def _fp8_k_tile(self, ab_pipe, read_state, tiled_mma, acc, fp8_args, tile: Tile, k, held, n_box, m_total,
                    box_split: cutlass.Constexpr[int] = 0):
        """FP8: acc += the product of the k-tile in ``read_state``'s stage (one scale block; the caller
        has turned ACCUMULATE off) scaled by its multipliers, and release the stage. Varlen-M: ``held``
        are this block's multipliers (`_block_scales`), the next block's are loaded under the WGMMAs
        and returned; varlen-K: they ride in the stage (`_stage_multipliers`), ``held`` is returned."""
        acc_block, tCrA, tCrB, scales, tCcAcc = fp8_args
        ab_pipe.consumer_wait(read_state)
        if const_expr(self.split_products):
            return self._fp8_k_tile_halves(ab_pipe, read_state, tiled_mma, acc, fp8_args, tile, k, held, n_box,
                                           m_total)
        cute.nvgpu.warpgroup.fence()
        mma_block(tiled_mma, acc_block, tCrA, tCrB, read_state.index)
        cute.nvgpu.warpgroup.commit_group()
        ahead = held
        if const_expr(self.stage_scales):
            cute.nvgpu.warpgroup.wait_group(0)
            current = self._stage_multipliers(scales, tCcAcc, read_state.index)
            ab_pipe.consumer_release(read_state)
            self._promote_columns(acc, acc_block, current)
        else:
            ahead = self._block_scales(scales, tile, tCcAcc, k + 1, n_box, m_total)
            cute.nvgpu.warpgroup.wait_group(0)
            ab_pipe.consumer_release(read_state)
            self._promote(acc, acc_block, held, box_split)
        return ahead

    @cute.jit
    def _fp8_k_tile_halves(self, ab_pipe, read_state, tiled_mma, acc, fp8_args, tile: Tile, k, held, n_box, m_total):
        """`_fp8_k_tile` with `split_products` (the stage waited for): the block's product half by
        half into one 64-register product, each half promoted before the next half's WGMMAs.
        Varlen-M: with its W block's multipliers (GLU: box h's; one 256-row box: its first or
        second block), the next block's loaded under the first half's WGMMAs and returned;
        varlen-K: with the (row, column) multipliers in the stage, ``held`` returned."""
        acc_block, tCrA, tCrB, scales, tCcAcc = fp8_args
        ahead = held
        for h in cutlass.range_constexpr(2):
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
            cute.nvgpu.warpgroup.fence()
            mma_block(tiled_mma, acc_block, tCrA, tCrB[h], read_state.index)
            cute.nvgpu.warpgroup.commit_group()
            if const_expr(h == 0 and not self.stage_scales):
                ahead = self._block_scales(scales, tile, tCcAcc, k + 1, n_box, m_total)
            cute.nvgpu.warpgroup.wait_group(0)
            if const_expr(self.stage_scales):  # varlen-K: the multipliers are read from the stage
                self._promote_from_stage(acc, acc_block, scales, tCcAcc, read_state.index, h)
                if const_expr(h == 1):
                    ab_pipe.consumer_release(read_state)
            else:
                if const_expr(h == 1):
                    ab_pipe.consumer_release(read_state)
                self._promote_half(acc, acc_block, held, h)
        return ahead

    @cute.jit
    def _promote_half(self, acc, acc_block, multipliers, h: cutlass.Constexpr[int]):
        """acc's values of half h += acc_block scaled per row by that half's W block multiplier
        (``up_box_split``, the up half: its first 64 columns by the first block's, the rest by the
        next one's; a thread's value v lies in column group v // 4 of 8 columns)."""
        rows, boxes = multipliers
        w_block = boxes[h][0] if const_expr(self.b_boxes == 2) else boxes[0][h]
        scale = [rows[r] * w_block for r in range(2)]
        scale_after = scale
        if const_expr(self.up_box_split and h == 1):
            scale_after = [rows[r] * boxes[h][1] for r in range(2)]
        half = cute.size(acc_block)
        for v in cutlass.range_constexpr(half):
            multiplier = scale[v // 2 % 2] if const_expr(v // 4 < 8) else scale_after[v // 2 % 2]
            acc[v + h * half] = acc[v + h * half] + acc_block[v] * multiplier

    @cute.jit
    def _issue_block(self, ab_pipe, read_state, tiled_mma, product, tCrA, tCrB):
        """The WGMMAs of the next block (k-tile) into ``product``, as one commit group; returns
        (tiled_mma, read_state past it): both carried by the caller's loop."""
        ab_pipe.consumer_wait(read_state)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        mma_block(tiled_mma, product, tCrA, tCrB, read_state.index)
        cute.nvgpu.warpgroup.commit_group()
        read_state.advance()
        return tiled_mma, read_state

    @cute.jit
    def _retire_block(self, ab_pipe, release_state, acc, product, multipliers, in_flight: cutlass.Constexpr[int],
                      fp8_args):
        """Once all but ``in_flight`` commit groups are done: promote the oldest block's ``product``
        into acc and release its stage; returns release_state past it. Varlen-M: ``multipliers``
        are the block's (`_block_scales`), the stage is released first; varlen-K: they are read
        from the stage while promoting (`_promote_from_stage`), which is released after."""
        cute.nvgpu.warpgroup.wait_group(in_flight)
        if const_expr(self.stage_scales):
            self._promote_from_stage(acc, product, fp8_args.scales, fp8_args.acc_coords, release_state.index)
            ab_pipe.consumer_release(release_state)
        else:
            ab_pipe.consumer_release(release_state)
            self._promote(acc, product, multipliers)
        release_state.advance()
        return release_state

    @cute.jit
    def _fp8_overlapped_k_tiles(self, ab_pipe, read_state, release_state, tiled_mma, acc, fp8_args, tile: Tile,
                                tile_k_tiles, held, n_box, m_total):
        """FP8 with ``overlap_promotion``: block k's WGMMAs go into one of two block products
        before block k - 1's promotion from the other (wait_group(1)), so the CUDA cores promote
        while the tensor cores run. Block 0 and then every even block use the first product, odd
        blocks the second: the loop takes blocks in pairs (odd, even) and a last odd block follows
        it, so on every path a product is rewritten only once its WGMMAs are done (ptxas
        serializes every WGMMA otherwise, C7514). Varlen-M: ``held`` is block 0's multipliers and
        each block's are loaded under its WGMMAs; varlen-K: they ride in the stages (``held``
        unused). Returns (tiled_mma, read_state, release_state), the states past the tile's
        k-tiles."""
        (even, odd), tCrA, tCrB, scales, tCcAcc = fp8_args
        tiled_mma, read_state = self._issue_block(ab_pipe, read_state, tiled_mma, even, tCrA, tCrB)
        for pair in range((tile_k_tiles - 1) // 2):
            for product, done in ((odd, even), (even, odd)):  # block 2 pair + 1, then 2 pair + 2
                tiled_mma, read_state = self._issue_block(ab_pipe, read_state, tiled_mma, product, tCrA, tCrB)
                ahead = held
                if const_expr(not self.stage_scales):  # under its WGMMAs
                    block = 2 * pair + (1 if product is odd else 2)
                    ahead = self._block_scales(scales, tile, tCcAcc, block, n_box, m_total)
                release_state = self._retire_block(ab_pipe, release_state, acc, done, held, 1, fp8_args)
                held = ahead
        if (tile_k_tiles - 1) % 2 == 1:  # a last, odd block
            tiled_mma, read_state = self._issue_block(ab_pipe, read_state, tiled_mma, odd, tCrA, tCrB)
            ahead = held
            if const_expr(not self.stage_scales):
                ahead = self._block_scales(scales, tile, tCcAcc, tile_k_tiles - 1, n_box, m_total)
            release_state = self._retire_block(ab_pipe, release_state, acc, even, held, 1, fp8_args)
            release_state = self._retire_block(ab_pipe, release_state, acc, odd, ahead, 0, fp8_args)
        else:
            release_state = self._retire_block(ab_pipe, release_state, acc, even, held, 0, fp8_args)
        return tiled_mma, read_state, release_state

    @cute.jit
    def _stage_multipliers(self, scales, tCcAcc, stage):
        """Varlen-K FP8: this thread's multipliers of the k-tile in ``stage``: (rows, columns), the A
        rows row0 and row0 + 8 and the B columns col0 + i + 8 j of its accumulator values (i, r, j)."""
        sSFA, sSFB = scales
        row0, col0 = tCcAcc[0]
        rows = (sSFA[row0, 0, stage], sSFA[row0 + 8, 0, stage])
        cols = [sSFB[col0 + v % 2 + v // 2 * 8, 0, stage] for v in range(self.tile_n // 4)]
        return rows, cols

    @cute.jit
    def _promote_from_stage(self, acc, acc_block, scales, tCcAcc, stage, h: cutlass.Constexpr[int] = 0):
        """Varlen-K: acc += acc_block scaled per (row, column) by the multipliers in ``stage``, each
        column's read from shared memory where it is used (`_stage_multipliers` would hold them
        all beside the block products). `split_products`: acc_block is half ``h`` of the tile,
        acc's values [64 h, 64 h + 64), its columns 128 h on."""
        sSFA, sSFB = scales
        row0, col0 = tCcAcc[0]
        rows = (sSFA[row0, 0, stage], sSFA[row0 + 8, 0, stage])
        size = cute.size(acc_block)
        for c in cutlass.range_constexpr(size // 2):
            col = sSFB[col0 + h * (self.tile_n // 2) + c % 2 + c // 2 * 8, 0, stage]
            for r in cutlass.range_constexpr(2):
                v = c // 2 * 4 + r * 2 + c % 2
                acc[v + h * size] = acc[v + h * size] + acc_block[v] * (rows[r] * col)

    @cute.jit
    def _promote_columns(self, acc, acc_block, multipliers):
        """acc += acc_block scaled per (row, column) (`_stage_multipliers`)."""
        rows, cols = multipliers
        for v in cutlass.range_constexpr(cute.size(acc)):
            acc[v] = acc[v] + acc_block[v] * (rows[v // 2 % 2] * cols[v // 4 * 2 + v % 2])
