"""Hopper (sm_90a) sync-free grouped weight gradient over the token dimension, in CuTe DSL.

    dW[g]         = dy[s:e].T @ x[s:e]      s, e = offsets[g], offsets[g+1] clamped to [0, M]
    main_grad[g] += dW[g]                   (opt-in fp32 accumulation)

dy (M, N) and x (M, K) row-major, read in place (groups may start at any row); dW / main_grad
(G, N, K) row-major. Per group this is a GEMM whose K dim is the group's tokens: A = dy_g^T
(N x tokens) and B = x_g^T (K x tokens), both MN-major, fed to 16-bit WGMMA from MN-major
(column-major) swizzled shared-memory layouts.

Persistent, warp-specialized: warpgroup 0 is the TMA producer (one warp), warpgroups 1-2 run
WGMMA on a 128 x tile_n output tile (64 rows each) and the epilogue. Every group owns the same
ceil(N/128) * ceil(K/tile_n) tiles, so the schedule over (group, m-tile, n-tile) is static
(cluster tile ids clusterIdx, clusterIdx + numClusters, ...); only the k-loop length
ceil(rows_g / 64) depends on the offsets tensor (0 for an empty group: its tiles are written as
zeros). With cluster_m=2 a pair of CTAs takes vertically adjacent m-tiles of one group and n-tile
(hence the same k-loop) and multicasts the shared x tile, each CTA loading half of it.
Groups are visited largest first (each CTA ranks the groups by k-tile count in shared memory at
start, for G <= SORT_MAX_G, else in index order), so the round-robin tiles of a wave cost about
the same and the last waves are the cheap ones.

Loads never see another group's tokens: dy and x get a "ragged" TMA view of the token dim (two
extra modes whose strides wrap around the 64-bit address space), in which group g's view ends
exactly at its last token; the TMA unit zero-fills the rest of the last k-tile, and the first
k-tile starts at the group's first row. Stores go through a plain (N, K, G) view of the output.

dW in ``dtype``: a tile's output waits in registers (bf16/fp16, 64 per thread at tile_n 256) and
is stored one 128 x 32 sub-tile after each of the next tile's first tile_n / 32 k-tiles is issued,
so the stores run under its WGMMAs; the last tile's after the loop. Every code path before a
WGMMA stays warpgroup-uniform (ptxas otherwise serializes all WGMMAs of the kernel: C7520).

Block-scaled FP8 (``ab_dtype`` E4M3, the weight gradient of the DeepSeek-V3 recipe): the operands
are per-group column-wise copies of dy and x, E4M3 with 1 x 128 token blocks that never straddle
groups, in the block-padded layout of `BlockColumnQuantizeSm90`: dy^T (N, 128 * blocks) and x^T
(K, 128 * blocks), block b in columns [128 b, 128 b + 128), zeros past a group's last token,
group g's blocks from block_start[g] = sum over h < g of ceil(rows_h / 128); multipliers
(blocks, N) and (blocks, K). FP8 WGMMA reads K-major operands only, and a TMA box must start on a
16-byte boundary: the padding puts every k-tile (one block) on a 128-byte one and makes the
operands' tails zero, so no load is clipped. A k-tile's product goes to a second accumulator and
is added to the first scaled per (row, column) by the two blocks' multipliers, which the producer
loads by TMA into the stage next to the operands. Group boundaries and block starts come from one
warp's prefix scan over the offsets at kernel start (`scan_group_blocks`, G <= SORT_MAX_G).

With ``accumulate`` the epilogue is fp32 and works in place in each epilogue slot: TMA-load a
128 x 32 sub-tile of main_grad, add the accumulator, TMA-store it back. The first slots - 1
sub-tile loads of a tile are issued before its mainloop; each epilogue step issues the next.
"""

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass.tensor_utils import LayoutEnum

from .group_tile_scheduler import RASTER_BAND, banded_tile, scan_group_blocks
from .mainloop_sm90 import mma_block, mma_stage

_BIG = 2**30
_HUGE = 2**31 - 1
SORT_MAX_G = 512  # groups ranked by size in shared memory up to this count


def _ragged_tokens(t: cute.Tensor) -> cute.Tensor:
    """(tokens, C) row-major -> (C, BIG, HUGE, HUGE) view whose token mode can be clipped.

    Element (c, BIG - length + r, BIG, start + length) sits at offset
    c + (start + r) * ld + BIG * 2**34 = c + (start + r) * ld (mod 2**64); tokens r >= length
    fall outside mode 1 and the TMA unit zero-fills them."""
    ld = t.stride[0]
    layout = cute.make_layout(
        (t.shape[1], _BIG, _HUGE, _HUGE), stride=(1, ld, Int64(2**34) - ld, ld)
    )
    return cute.make_tensor(t.iterator, layout)


def _rows_by_block(t: cute.Tensor) -> cute.Tensor:
    """(blocks, C) row-major multipliers -> the (C, blocks) view the scale TMA tiles (tile, 1)."""
    return cute.make_tensor(
        t.iterator, cute.make_layout((t.shape[1], t.shape[0]), stride=(1, t.stride[0]))
    )


def _group_tokens(mRagged: cute.Tensor, start: Int32, length: Int32) -> cute.Tensor:
    """(C, tokens) coordinate view of one group: token r < length is row start + r."""
    return cute.domain_offset(
        (None, _BIG - length), mRagged[(None, None, _BIG, start + length)]
    )


@cute.jit
def _group_rows(mOffsets: cute.Tensor, g: Int32, m_total: Int32):
    """(start, length) of group g with offsets clamped to [0, M] and end >= start."""
    start = cutlass.max(cutlass.min(mOffsets[g], m_total), Int32(0))
    end = cutlass.max(cutlass.min(mOffsets[g + 1], m_total), start)
    return start, end - start


class GroupedWgradSm90:
    """Grouped dW = dy_g^T @ x_g for sm_90a (see the module docstring).

    Compile-time configuration: ``dtype`` of dy and x (cutlass.BFloat16 / Float16), ``tile_n``
    (128 or 256, along K of dW; tile_m = 128 along N, tile_k = 64 tokens), ``ab_dtype``
    (None: ``dtype``; cutlass.Float8E4M3FN: block-scaled FP8 operands, module docstring, dW in
    ``dtype``; tile_n 128, tile_k 128), ``accumulate``
    (fp32 main_grad += dW instead of writing dW in ``dtype``), ``cluster_m`` (1, or 2: CTA pairs
    multicast the x tile), ``sort_groups`` (visit groups largest first), ``ab_stages`` /
    ``epi_slots`` (None: defaults that fill shared memory), ``raster_band`` (m-tiles per band of
    the tile order inside a group, `banded_tile`). The persistent grid size (at least cluster_m)
    is a launch argument.
    """

    tile_m = 128
    tile_k = 64
    epi_n = 32

    def __init__(
        self, dtype, tile_n, accumulate, cluster_m=1, sort_groups=True, ab_stages=None,
        epi_slots=None, raster_band=RASTER_BAND, ab_dtype=None,
    ):
        if tile_n not in (128, 256):
            raise ValueError("tile_n must be 128 or 256")
        self.ab_dtype = dtype if ab_dtype is None else ab_dtype
        # FP8: one k-tile is one 128-token scale block; its product waits in a second accumulator
        # of the same size, so tile_n is 128 (64 + 64 registers per thread)
        self.block_scaled = self.ab_dtype.width == 8
        if self.block_scaled:
            if tile_n != 128:
                raise ValueError("FP8 operands need tile_n 128")
            self.tile_k = 128
        if cluster_m not in (1, 2):
            raise ValueError("cluster_m must be 1 or 2")
        self.cluster_m = cluster_m
        self.sort_groups = sort_groups
        self.raster_band = raster_band
        self.dtype = dtype
        self.acc_dtype = Float32
        self.out_dtype = Float32 if accumulate else dtype
        self.accumulate = accumulate
        self.tile_n = tile_n
        self.num_steps = tile_n // self.epi_n
        self.num_mma_wg = 2
        self.threads = 128 * (1 + self.num_mma_wg)
        self.epi_tile = (self.tile_m, self.epi_n)
        stage_bytes = (self.tile_m + tile_n) * self.tile_k * self.ab_dtype.width // 8
        if self.block_scaled:  # the two blocks' multipliers ride in the stage
            stage_bytes += (self.tile_m + tile_n) * 4
        buf_bytes = self.tile_m * self.epi_n * self.out_dtype.width // 8
        smem = cutlass.memory.get_smem_capacity_in_bytes("sm_90") - 1024
        if sort_groups:
            smem -= 2 * SORT_MAX_G * 4
        if self.block_scaled:  # group edges and first blocks
            smem -= 2 * (SORT_MAX_G + 1) * 4
        if ab_stages is None:
            # accumulate: leave room for 4 main_grad slots (prefetch 3 sub-tiles ahead)
            ab_stages = (smem - (4 if accumulate else 2) * buf_bytes) // stage_bytes
        if epi_slots is None:
            epi_slots = (
                min((smem - ab_stages * stage_bytes) // buf_bytes, self.num_steps)
                if accumulate
                else 2
            )
        if accumulate and epi_slots > self.num_steps:
            raise ValueError("epi_slots must not exceed tile_n / 32 with accumulate")
        if ab_stages < 2 or epi_slots < 2 or ab_stages * stage_bytes + epi_slots * buf_bytes > smem:
            raise ValueError("tile configuration does not fit in shared memory")
        self.ab_stages = ab_stages
        self.epi_slots = epi_slots
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=128 * self.num_mma_wg)

    # ------------------------------------------------------------------ host side (traced)
    @cute.jit
    def __call__(
        self,
        mDy: cute.Tensor,  # (M, N); FP8: dy^T (N, M)
        mX: cute.Tensor,  # (M, K); FP8: x^T (K, M)
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mOut: cute.Tensor,  # (G, N, K): dW in dtype, or fp32 main_grad (accumulate)
        mScaleDy,  # FP8: (blocks, N) float32 multipliers of dy^T's token blocks; else None
        mScaleX,  # FP8: (blocks, K) of x^T's; else None
        num_tokens,  # FP8: M, the rows the offsets index (Int32); else None
        max_ctas: Int32,  # persistent grid size (SMs left free by the caller's margin)
        stream,
    ):
        dt = self.ab_dtype
        major = cute.nvgpu.OperandMajorMode.K if const_expr(self.block_scaled) else cute.nvgpu.OperandMajorMode.MN
        smem_major = LayoutEnum.ROW_MAJOR if const_expr(self.block_scaled) else LayoutEnum.COL_MAJOR
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dt, dt, major, major, self.acc_dtype, (self.num_mma_wg, 1, 1), tiler_mn=(64, self.tile_n)
        )
        mma_tiler = (self.tile_m, self.tile_n, self.tile_k)
        self.sA_layout = sm90_utils.make_smem_layout_a(smem_major, mma_tiler, dt, self.ab_stages)
        self.sB_layout = sm90_utils.make_smem_layout_b(smem_major, mma_tiler, dt, self.ab_stages)
        sSFA_layout, sSFB_layout = self._scale_layouts()
        self.sD_layout = sm90_utils.make_smem_layout_epi(
            self.out_dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.epi_slots
        )
        sA_one = cute.slice_(self.sA_layout, (None, None, 0))
        sB_one = cute.slice_(self.sB_layout, (None, None, 0))
        sD_one = cute.slice_(self.sD_layout, (None, None, 0))
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        # FP8: the block-padded (rows, tokens) K-major copies as they are; 16-bit: ragged token views
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mDy if const_expr(self.block_scaled) else _ragged_tokens(mDy), sA_one, (self.tile_m, self.tile_k)
        )
        tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if const_expr(self.cluster_m > 1)
            else g2s,
            mX if const_expr(self.block_scaled) else _ragged_tokens(mX),
            sB_one,
            (self.tile_n, self.tile_k),
            num_multicast=self.cluster_m,
        )
        tma_sfa, tma_mSFA, tma_sfb, tma_mSFB = None, None, None, None
        m_total = cute.size(mDy, mode=[0])
        if const_expr(self.block_scaled):
            m_total = num_tokens
            tma_sfa, tma_mSFA = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, _rows_by_block(mScaleDy), cute.slice_(sSFA_layout, (None, None, 0)), (self.tile_m, 1)
            )
            tma_sfb, tma_mSFB = cute.nvgpu.cpasync.make_tiled_tma_atom(
                g2s, _rows_by_block(mScaleX), cute.slice_(sSFB_layout, (None, None, 0)), (self.tile_n, 1)
            )
        n = cute.size(mOut, mode=[1])
        k = cute.size(mOut, mode=[2])
        num_groups = cute.size(mOut, mode=[0])
        mD = cute.make_tensor(  # (N, K, G)
            mOut.iterator,
            cute.make_layout((n, k, num_groups), stride=(mOut.stride[1], 1, mOut.stride[0])),
        )
        tma_d, tma_mD = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), mD, sD_one, self.epi_tile
        )
        tma_c = None
        tma_mC = None
        if const_expr(self.accumulate):
            tma_c, tma_mC = cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, mD, sD_one, self.epi_tile)
        self.tma_bytes = cute.size_in_bytes(dt, sA_one) + cute.size_in_bytes(dt, sB_one)
        if const_expr(self.block_scaled):
            self.tma_bytes += (self.tile_m + self.tile_n) * 4
        self.c_bytes = cute.size_in_bytes(self.out_dtype, sD_one)

        @cute.struct
        class SharedStorage:
            ab_full_empty: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            c_full: cute.struct.MemRange[cutlass.Int64, self.epi_slots]
            sched: cute.struct.MemRange[Int32, 2 * SORT_MAX_G if self.sort_groups else 1]
            edges: cute.struct.MemRange[Int32, 2 * (SORT_MAX_G + 1) if self.block_scaled else 1]
            sSFA: cute.struct.Align[
                cute.struct.MemRange[Float32, cute.cosize(sSFA_layout) if self.block_scaled else 1], 128
            ]
            sSFB: cute.struct.Align[
                cute.struct.MemRange[Float32, cute.cosize(sSFB_layout) if self.block_scaled else 1], 128
            ]
            sA: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(self.sB_layout)], 1024]
            sD: cute.struct.Align[
                cute.struct.MemRange[self.out_dtype, cute.cosize(self.sD_layout)], 1024
            ]

        self.shared_storage = SharedStorage

        cluster_rows = self.tile_m * self.cluster_m
        m_tiles = (n + cluster_rows - 1) // cluster_rows  # per cluster
        n_tiles = (k + self.tile_n - 1) // self.tile_n
        total_tiles = num_groups * m_tiles * n_tiles
        num_clusters = cutlass.min(total_tiles, max_ctas // self.cluster_m)
        self.kernel(
            tma_a,
            tma_mA,
            tma_b,
            tma_mB,
            tma_d,
            tma_mD,
            tma_c,
            tma_mC,
            (tma_sfa, tma_mSFA, tma_sfb, tma_mSFB),
            mOffsets,
            m_total,
            self.tiled_mma,
            self.sA_layout,
            self.sB_layout,
            self.sD_layout,
        ).launch(
            grid=[num_clusters * self.cluster_m, 1, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster_m, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,  # (N, BIG, HUGE, HUGE) ragged dy^T
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,  # (K, BIG, HUGE, HUGE) ragged x^T
        tma_d: cute.CopyAtom,
        mD: cute.Tensor,  # (N, K, G)
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,  # (N, K, G) load view of main_grad, or None
        block_scales: tuple,  # FP8: (tma_sfa, mSFA (N, blocks), tma_sfb, mSFB (K, blocks)); else Nones
        mOffsets: cute.Tensor,
        m_total: Int32,
        tiled_mma: cute.TiledMma,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sD_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        rank = Int32(0)
        if const_expr(self.cluster_m > 1):
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        first_tile = bidx // self.cluster_m
        num_clusters = gdim // self.cluster_m

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_d)
            if const_expr(self.block_scaled):
                cute.nvgpu.cpasync.prefetch_descriptor(block_scales[0])
                cute.nvgpu.cpasync.prefetch_descriptor(block_scales[2])
            if const_expr(self.accumulate):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_c)

        cluster_rows = self.tile_m * self.cluster_m
        m_tiles = (cute.size(mD, mode=[0]) + cluster_rows - 1) // cluster_rows  # per cluster
        n_tiles = (cute.size(mD, mode=[1]) + self.tile_n - 1) // self.tile_n
        num_groups = cute.size(mD, mode=[2])
        tiles_per_group = m_tiles * n_tiles
        total_tiles = num_groups * tiles_per_group
        n_rows = cute.size(mD, mode=[0])

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_full_empty.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_mma_wg * 4 * self.cluster_m
            ),
            tx_count=self.tma_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)),
            defer_sync=True,
        )
        c_full = storage.c_full.data_ptr()
        if const_expr(self.accumulate):
            if warp_idx == 0:
                with cute.arch.elect_one():
                    for s in cutlass.range_constexpr(self.epi_slots):
                        cute.arch.mbarrier_init(c_full + s, 1)
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sD = storage.sD.get_tensor(sD_layout.outer, swizzle=sD_layout.inner)

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))
        sSched = storage.sched.get_tensor(
            cute.make_layout(2 * SORT_MAX_G if self.sort_groups else 1)
        )
        is_sorted = num_groups <= SORT_MAX_G
        sEdges = None  # FP8: `scan_group_blocks` (group rows and first blocks)
        if const_expr(self.block_scaled):
            sEdges = storage.edges.get_tensor(cute.make_layout(2 * (SORT_MAX_G + 1)))
            if warp_idx == 0:
                scan_group_blocks(sEdges, SORT_MAX_G + 1, mOffsets, num_groups, m_total, self.tile_k)
            cute.arch.sync_threads()
        if const_expr(self.sort_groups):
            self._rank_groups(sSched, is_sorted, mOffsets, sEdges, num_groups, m_total, tidx)
        tma_sfa, mSFA, tma_sfb, mSFB = block_scales
        sSFA, sSFB = None, None
        if const_expr(self.block_scaled):
            sSFA_layout, sSFB_layout = self._scale_layouts()
            sSFA = storage.sSFA.get_tensor(sSFA_layout)
            sSFB = storage.sSFB.get_tensor(sSFB_layout)

        if wg_idx == 0:
            # ---------------------------------------------------------- TMA producer
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.ab_stages
                )
                b_mcast_mask = 0
                if const_expr(self.cluster_m > 1):
                    b_mcast_mask = cutlass.Int16((1 << self.cluster_m) - 1)
                tile_id = first_tile
                while tile_id < total_tiles:
                    g, mt, nt = self._tile_coords(
                        tile_id, m_tiles, n_tiles, rank, sSched, is_sorted
                    )
                    start, length, block0 = self._group_span(mOffsets, sEdges, g, num_groups, m_total)
                    gA = cute.local_tile(  # (tile_m, tile_k, k-tiles)
                        self._group_view(mA, start, length, block0), (self.tile_m, self.tile_k), (mt, None)
                    )
                    gB = cute.local_tile(
                        self._group_view(mB, start, length, block0), (self.tile_n, self.tile_k), (nt, None)
                    )
                    tSFAs, tSFAg, tSFBs, tSFBg = None, None, None, None
                    if const_expr(self.block_scaled):  # (tile, blocks) of each operand's multipliers
                        tSFAs, tSFAg = cute.nvgpu.cpasync.tma_partition(
                            tma_sfa, 0, cute.make_layout(1), cute.group_modes(sSFA, 0, 2),
                            cute.group_modes(cute.local_tile(mSFA, (self.tile_m, 1), (mt, None)), 0, 2),
                        )
                        tSFBs, tSFBg = cute.nvgpu.cpasync.tma_partition(
                            tma_sfb, 0, cute.make_layout(1), cute.group_modes(sSFB, 0, 2),
                            cute.group_modes(cute.local_tile(mSFB, (self.tile_n, 1), (nt, None)), 0, 2),
                        )
                    tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                        tma_a, 0, cute.make_layout(1), cute.group_modes(sA, 0, 2),
                        cute.group_modes(gA, 0, 2),
                    )
                    tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(  # this CTA's half of B
                        tma_b, rank, cute.make_layout(self.cluster_m), cute.group_modes(sB, 0, 2),
                        cute.group_modes(gB, 0, 2),
                    )
                    for kt in range((length + self.tile_k - 1) // self.tile_k):
                        ab_pipe.producer_acquire(state)
                        bar = ab_pipe.producer_get_barrier(state)
                        cute.copy(
                            tma_a, tAgA[(None, kt)], tAsA[(None, state.index)], tma_bar_ptr=bar
                        )
                        cute.copy(
                            tma_b, tBgB[(None, kt)], tBsB[(None, state.index)], tma_bar_ptr=bar,
                            mcast_mask=b_mcast_mask,
                        )
                        if const_expr(self.block_scaled):
                            cute.copy(
                                tma_sfa, tSFAg[(None, block0 + kt)], tSFAs[(None, state.index)], tma_bar_ptr=bar
                            )
                            cute.copy(
                                tma_sfb, tSFBg[(None, block0 + kt)], tSFBs[(None, state.index)], tma_bar_ptr=bar
                            )
                        ab_pipe.producer_commit(state)
                        state.advance()
                    tile_id = tile_id + num_clusters
                ab_pipe.producer_tail(state)
        else:
            # ---------------------------------------------------------- MMA + epilogue
            cute.arch.setmaxregister_increase(232)
            mma_tidx = tidx - 128
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(
                thr_mma.partition_shape_C((self.tile_m, self.tile_n)), self.acc_dtype
            )
            acc_block, fp8_args = None, None  # FP8: one token block's product; its k-tile's arguments
            if const_expr(self.block_scaled):
                acc_block = cute.make_rmem_tensor(acc.shape, self.acc_dtype)
                tCcAcc = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
                fp8_args = (acc_block, tCrA, tCrB, (sSFA, sSFB, tCcAcc))

            # register <-> smem copies in the accumulator's thread-value layout (stmatrix: 16-bit)
            copy_atom_c = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), cutlass.Float16
            )
            tiled_copy_r2s = cute.make_tiled_copy_S(
                sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.out_dtype, self.acc_dtype),
                cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma),
            )
            thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
            tRS_sD = thr_copy_r2s.partition_D(sD)  # (R2S, R2S_M, R2S_N, slot)
            tRS_rAcc = tiled_copy_r2s.retile(acc)
            rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))[:3]
            frag = cute.size(rD_shape)
            rSum = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
            rOut = cute.make_rmem_tensor(rD_shape, self.out_dtype)
            # dW (not accumulate): a tile's output waits in registers, one sub-tile per k-tile of
            # the next tile (`_store_step`), so its stores run under that tile's WGMMAs
            pending = None
            if const_expr(not self.accumulate):
                pending = [cute.make_rmem_tensor(rD_shape, self.out_dtype) for _ in range(self.num_steps)]
            has_pending = cutlass.Boolean(False)
            pending_g, pending_mt, pending_nt = Int32(0), Int32(0), Int32(0)
            pending_rows = cutlass.Boolean(False)
            dest = (tRS_sD, sD, tma_d, mD)

            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_slots,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 128 * self.num_mma_wg
                ),
            )
            is_store_warp = warp_idx == 4
            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages
            )
            release_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages
            )
            epi_count = Int32(0)  # epilogue sub-tiles done by this CTA: slot and C-load phase
            tile_id = first_tile
            while tile_id < total_tiles:
                g, mt, nt = self._tile_coords(
                    tile_id, m_tiles, n_tiles, rank, sSched, is_sorted
                )
                start, length, _ = self._group_span(mOffsets, sEdges, g, num_groups, m_total)
                k_tiles = (length + self.tile_k - 1) // self.tile_k
                has_rows = mt * self.tile_m < n_rows  # else only feeds its cluster peer
                bSG_sD, bSG_gD, bGS_sC, bGS_gC = None, None, None, None
                if const_expr(self.accumulate):
                    gD = cute.local_tile(mD[(None, None, g)], self.epi_tile, (None, None))
                    bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                        tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2),
                        cute.group_modes(gD, 0, 2),
                    )
                    gC = cute.local_tile(mC[(None, None, g)], self.epi_tile, (None, None))
                    bGS_sC, bGS_gC = cute.nvgpu.cpasync.tma_partition(
                        tma_c, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2),
                        cute.group_modes(gC, 0, 2),
                    )
                    if is_store_warp:
                        # earlier stores must have left every slot before it is refilled
                        cute.arch.cp_async_bulk_wait_group(0, read=True)
                        for j in cutlass.range_constexpr(self.epi_slots - 1):
                            self._load_c(tma_c, bGS_gC, bGS_sC, c_full, mt, nt, j, epi_count + j)

                # ------------------------------------------------------ mainloop
                acc.fill(0.0)
                # the first k-tiles are issued outside the loop: one, or with deferred stores
                # (dW) num_steps, each followed by one sub-tile store of the previous tile
                peeled = 1 if self.accumulate else self.num_steps
                for step in cutlass.range_constexpr(peeled):
                    if step < k_tiles:
                        if const_expr(self.block_scaled):
                            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                            multipliers = self._fp8_block(ab_pipe, read_state, tiled_mma, fp8_args)
                            read_state.advance()
                            self._promote(acc, acc_block, multipliers)
                        else:
                            if const_expr(step == 0):
                                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                                cute.nvgpu.warpgroup.fence()
                            ab_pipe.consumer_wait(read_state)
                            mma_stage(tiled_mma, acc, tCrA, tCrB, read_state.index)
                            cute.nvgpu.warpgroup.commit_group()
                            read_state.advance()
                            if const_expr(step > 0):
                                cute.nvgpu.warpgroup.wait_group(1)
                                ab_pipe.consumer_release(release_state)
                                release_state.advance()
                    if const_expr(not self.accumulate):
                        if has_pending:
                            self._store_step(
                                tiled_copy_r2s, pending[step], dest, (pending_g, pending_mt, pending_nt, pending_rows),
                                step, epi_count, store_pipe, is_store_warp,
                            )
                            epi_count = epi_count + 1
                for kt in range(peeled, k_tiles):
                    if const_expr(self.block_scaled):
                        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                        multipliers = self._fp8_block(ab_pipe, read_state, tiled_mma, fp8_args)
                        read_state.advance()
                        self._promote(acc, acc_block, multipliers)
                    else:
                        ab_pipe.consumer_wait(read_state)
                        mma_stage(tiled_mma, acc, tCrA, tCrB, read_state.index)
                        cute.nvgpu.warpgroup.commit_group()
                        cute.nvgpu.warpgroup.wait_group(1)
                        ab_pipe.consumer_release(release_state)
                        release_state.advance()
                        read_state.advance()
                if const_expr(not self.block_scaled):
                    cute.nvgpu.warpgroup.wait_group(0)  # unconditional: ptxas sees every path waited
                    if k_tiles > 0:
                        ab_pipe.consumer_release(release_state)
                        release_state.advance()

                # ------------------------------------------------------ epilogue
                if const_expr(self.accumulate):  # main_grad += dW, slot by slot
                    for step in cutlass.range_constexpr(self.num_steps):
                        slot = epi_count % self.epi_slots
                        tRS_slot = tRS_sD[(None, None, None, slot)]
                        for v in cutlass.range_constexpr(frag):
                            rSum[v] = tRS_rAcc[step * frag + v]
                        cute.arch.mbarrier_wait(c_full + slot, (epi_count // self.epi_slots) % 2)
                        rSum.store(rSum.load() + tRS_slot.load())
                        rOut.store(rSum.load().to(self.out_dtype))
                        cute.copy(tiled_copy_r2s, rOut, tRS_slot)
                        cute.arch.fence_proxy("async.shared", space="cta")
                        self.epi_barrier.arrive_and_wait()
                        if is_store_warp:
                            if has_rows:
                                cute.copy(
                                    tma_d, bSG_sD[(None, slot)],
                                    bSG_gD[(None, mt, nt * self.num_steps + step)],
                                )
                            store_pipe.producer_commit()
                        # refill the slot of the previous step (its store may still be reading only
                        # if it is the one just issued) with sub-tile step + slots - 1
                        if const_expr(step + self.epi_slots - 1 < self.num_steps):
                            if is_store_warp:
                                cute.arch.cp_async_bulk_wait_group(1, read=True)
                                self._load_c(
                                    tma_c, bGS_gC, bGS_sC, c_full, mt, nt,
                                    step + self.epi_slots - 1, epi_count + self.epi_slots - 1,
                                )
                        epi_count = epi_count + 1
                else:  # dW: stored under the next tile's k-tiles
                    for step in cutlass.range_constexpr(self.num_steps):
                        for v in cutlass.range_constexpr(frag):
                            rSum[v] = tRS_rAcc[step * frag + v]
                        pending[step].store(rSum.load().to(self.out_dtype))
                    has_pending = cutlass.Boolean(True)
                    pending_g, pending_mt, pending_nt, pending_rows = g, mt, nt, has_rows
                tile_id = tile_id + num_clusters
            if const_expr(not self.accumulate):
                if has_pending:
                    for step in cutlass.range_constexpr(self.num_steps):
                        self._store_step(
                            tiled_copy_r2s, pending[step], dest, (pending_g, pending_mt, pending_nt, pending_rows),
                            step, epi_count, store_pipe, is_store_warp,
                        )
                        epi_count = epi_count + 1
            if is_store_warp:
                store_pipe.producer_tail()

    @cute.jit
    def _store_step(self, tiled_copy_r2s, rOut, dest, tile, step, epi_count, store_pipe, is_store_warp):
        """dW sub-tile ``step`` (128 x 32, in ``rOut``) of ``tile`` (g, mt, nt, has_rows) through
        epilogue slot epi_count % epi_slots to ``dest`` (tRS_sD, sD, tma_d, mD) by TMA; the slot is
        free again on return."""
        tRS_sD, sD, tma_d, mD = dest
        g, mt, nt, has_rows = tile
        slot = epi_count % self.epi_slots
        cute.copy(tiled_copy_r2s, rOut, tRS_sD[(None, None, None, slot)])
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epi_barrier.arrive_and_wait()
        if is_store_warp:
            if has_rows:
                gD = cute.local_tile(mD[(None, None, g)], self.epi_tile, (None, None))
                bSG_sD, bSG_gD = cute.nvgpu.cpasync.tma_partition(
                    tma_d, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), cute.group_modes(gD, 0, 2),
                )
                cute.copy(tma_d, bSG_sD[(None, slot)], bSG_gD[(None, mt, nt * self.num_steps + step)])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        self.epi_barrier.arrive_and_wait()

    def _scale_layouts(self):
        """FP8: shared-memory layouts of the per-stage multipliers, (tile_m, 1, stages) of A's rows
        and (tile_n, 1, stages) of B's."""
        return tuple(
            cute.make_layout((rows, 1, self.ab_stages), stride=(1, 0, rows)) for rows in (self.tile_m, self.tile_n)
        )

    @cute.jit
    def _group_span(self, mOffsets, sEdges, g, num_groups, m_total):
        """(first row, rows, first scale block) of group g: `_group_rows` (block 0); FP8, from the
        scan of `scan_group_blocks`."""
        if const_expr(self.block_scaled):
            start = sEdges[g]
            return start, sEdges[g + 1] - start, sEdges[SORT_MAX_G + 1 + g]
        start, length = _group_rows(mOffsets, g, m_total)
        return start, length, Int32(0)

    def _group_view(self, mTokens, start, length, block0):
        """TMA coordinate view of one group's tokens: FP8, (rows, tokens) of the block-padded copy
        from the group's first block ``block0``; 16-bit, the ragged view clipped at its last token."""
        if const_expr(self.block_scaled):
            return cute.domain_offset((0, block0 * self.tile_k), mTokens)
        return _group_tokens(mTokens, start, length)

    @cute.jit
    def _fp8_block(self, ab_pipe, read_state, tiled_mma, fp8_args):
        """FP8: acc_block = the product of the k-tile in ``read_state``'s stage (the caller has turned
        ACCUMULATE off); returns the block's multipliers (`_block_multipliers`) and releases the stage."""
        acc_block, tCrA, tCrB, scales = fp8_args
        ab_pipe.consumer_wait(read_state)
        cute.nvgpu.warpgroup.fence()
        mma_block(tiled_mma, acc_block, tCrA, tCrB, read_state.index)
        cute.nvgpu.warpgroup.commit_group()
        cute.nvgpu.warpgroup.wait_group(0)
        multipliers = self._block_multipliers(scales, read_state.index)
        ab_pipe.consumer_release(read_state)
        return multipliers

    @cute.jit
    def _block_multipliers(self, scales, stage):
        """FP8: this thread's multipliers of the k-tile in ``stage``: (rows, columns), the A rows
        row0 and row0 + 8 and the B columns col0 + i + 8 j of its accumulator values (i, r, j)."""
        sSFA, sSFB, tCcAcc = scales
        row0, col0 = tCcAcc[0]
        rows = (sSFA[row0, 0, stage], sSFA[row0 + 8, 0, stage])
        cols = [sSFB[col0 + v % 2 + v // 2 * 8, 0, stage] for v in range(self.tile_n // 4)]
        return rows, cols

    @cute.jit
    def _promote(self, acc, acc_block, multipliers):
        """acc += acc_block scaled per (row, column) by the two operands' block multipliers."""
        rows, cols = multipliers
        for v in cutlass.range_constexpr(cute.size(acc)):
            scale = rows[v // 2 % 2] * cols[v // 4 * 2 + v % 2]
            acc[v] = acc[v] + acc_block[v] * scale

    @cute.jit
    def _rank_groups(self, sSched, is_sorted, mOffsets, sEdges, num_groups, m_total, tidx):
        """sSched[SORT_MAX_G + r] = the group of rank r by k-tile count (descending, then index).
        All threads of the CTA take part; sSched[:G] holds the counts. The loops' trip counts do not
        depend on the thread (a per-thread loop here made ptxas serialize every WGMMA: C7520)."""
        if is_sorted:
            for base in range(0, num_groups, self.threads):
                g = base + tidx
                if g < num_groups:
                    _, length, _ = self._group_span(mOffsets, sEdges, g, num_groups, m_total)
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

    @cute.jit
    def _tile_coords(self, tile_id, m_tiles, n_tiles, rank, sSched, is_sorted):
        """(group, m-tile, n-tile) of a cluster tile id: groups by rank, `banded_tile` within one."""
        tiles_per_group = m_tiles * n_tiles
        g = tile_id // tiles_per_group
        local = tile_id - g * tiles_per_group
        if const_expr(self.sort_groups):
            if is_sorted:
                g = sSched[SORT_MAX_G + g]
        mt, nt = banded_tile(local, m_tiles, n_tiles, self.raster_band)
        return g, mt * self.cluster_m + rank, nt

    @cute.jit
    def _load_c(self, tma_c, bGS_gC, bGS_sC, c_full, mt, nt, step, count):
        """TMA-load main_grad sub-tile ``step`` of tile (mt, nt) into slot count % epi_slots."""
        slot = count % self.epi_slots
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(c_full + slot, self.c_bytes)
        cute.copy(
            tma_c,
            bGS_gC[(None, mt, nt * self.num_steps + step)],
            bGS_sC[(None, slot)],
            tma_bar_ptr=c_full + slot,
        )
