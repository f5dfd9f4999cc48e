"""Hopper (sm_90a) sync-free grouped GEMM with activation epilogues, in CuTe DSL.

    pre[r, :] = x[r, :] @ W[g].T (+ b[g])      for offsets[g] <= r < offsets[g+1]
    act       = activation(pre)                 (GLU: act(pre[:, :N/2]) * pre[:, N/2:])
    pre, act  = 0                               for offsets[G] <= r < M

x (M, K) K-major, W (G, N, K) K-major, bias (G, N), pre (M, N), act (M, N/2) for GLU or (M, N)
for srelu. GLU weights and biases are natural: gate = rows [0, N/2) of W[g], up = rows [N/2, N).
Persistent, warp-specialized: warpgroup 0 is the TMA producer (one warp issues the loads),
warpgroups 1-2 run WGMMA on a 128 x tile_n tile (64 rows each) and the epilogue
(registers -> smem -> TMA store). Tiles come from ``group_tile_scheduler`` (device prefix sums
over the offsets tensor); the launch depends on tensor shapes only. With cluster_m=2 a pair of
CTAs takes two vertically adjacent tiles of one group and multicasts the shared W tile (each CTA
loads half); a CTA whose tile lies past its group's end still runs the mainloop for its peer and
stores nothing.

Stores never cross a group's last row: the output tensors get a "ragged" TMA view (the idea of
Triton's ragged TMA descriptors) with two extra modes whose strides wrap around the 64-bit
address space, so a tile of group g sees a tensor whose row extent ends exactly at the group's
last row and the TMA unit clips the rest.

For GLU, n-tile nt covers gate rows [nt * tile_n/2, (nt+1) * tile_n/2) and the same up rows: each
B stage is filled by two TMA boxes of tile_n/2 rows (gate, then up) from a view of W with a separate
gate/up mode, (N/2, K, 2, G), so each half is clipped at its own end. Accumulator columns
[0, tile_n/2) are gate and [tile_n/2, tile_n) up; epilogue step s pairs 32-column sub-tile s with
s + tile_n/64 and writes gate and up back to their halves of ``pre``.
"""

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32, Int64, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.tensor_utils import LayoutEnum

from .group_tile_scheduler import locate_tile, segment_rows
from .grouped_gemm import ACTIVATIONS, GLU_ACTIVATIONS

_BIG = 2**30
_HUGE = 2**31 - 1


def _ragged_rows(t: cute.Tensor) -> cute.Tensor:
    """(rows, cols) row-major tensor -> (BIG, cols, HUGE, HUGE) view for ragged TMA stores.

    Element (BIG - length + r, c, BIG, start + length) sits at offset
    (start + r) * ld + c + BIG * 2**34 = (start + r) * ld + c (mod 2**64): rows r >= length are
    out of bounds of mode 0 and clipped by the TMA unit."""
    ld = t.stride[0]
    layout = cute.make_layout(
        (_BIG, t.shape[1], _HUGE, _HUGE), stride=(ld, 1, Int64(2**34) - ld, ld)
    )
    return cute.make_tensor(t.iterator, layout)


def _segment_view(mD_ragged: cute.Tensor, start: Int32, length: Int32) -> cute.Tensor:
    """Coordinate tensor whose rows 0..length-1 are rows start..start+length-1 of the output."""
    return cute.domain_offset(
        (_BIG - length, None), mD_ragged[(None, None, _BIG, start + length)]
    )


@dsl_user_op
def _tanh_approx(x: Float32, *, loc=None, ip=None) -> Float32:
    """tanh.approx.f32: one SFU op (max rel. error ~2^-11)."""
    return Float32(
        llvm.inline_asm(
            T.f32(),
            [Float32(x).ir_value(loc=loc, ip=ip)],
            "tanh.approx.f32 $0, $1;",
            "=f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )
    )


@cute.jit
def _silu(x: Float32) -> Float32:
    """x sigmoid(x) = h (1 + tanh(h)), h = x / 2: one SFU op (ex2 + rcp would take two)."""
    h = 0.5 * x
    return h + h * _tanh_approx(h)


class GroupedGemmSm90:
    """Grouped GEMM + optional bias / activation epilogue for sm_90a.

    Compile-time configuration: ``dtype`` (cutlass.BFloat16 / Float16), ``tile_n`` (128 or 256;
    tile_m is 128, tile_k 64), ``epilogue`` (one of ACTIVATIONS), ``has_bias``, ``num_sms``
    (persistent grid size), ``cluster_m`` (1, or 2: a cluster of two CTAs takes vertically
    adjacent tiles of one group and multicasts the shared W tile), ``ab_stages`` / ``epi_slots``
    (None: fill shared memory).
    """

    tile_m = 128
    tile_k = 64
    epi_n = 32

    def __init__(
        self,
        dtype,
        tile_n,
        epilogue,
        has_bias,
        num_sms,
        cluster_m=2,
        ab_stages=None,
        epi_slots=None,
    ):
        if epilogue not in ACTIVATIONS:
            raise ValueError(f"unknown epilogue {epilogue!r}")
        if tile_n not in (128, 256):
            raise ValueError("tile_n must be 128 or 256")
        self.dtype = dtype
        self.acc_dtype = Float32
        self.tile_n = tile_n
        if cluster_m not in (1, 2):
            raise ValueError("cluster_m must be 1 or 2")
        self.cluster_m = cluster_m
        self.epilogue = epilogue
        self.is_glu = epilogue in GLU_ACTIVATIONS
        # TMA boxes per B stage: GLU loads box_n gate rows, then the same up rows
        self.b_boxes = 2 if self.is_glu else 1
        self.box_n = tile_n // self.b_boxes
        self.has_act = epilogue is not None
        self.has_bias = has_bias
        self.num_sms = num_sms
        # outputs written per epilogue step: GLU (gate, up, act), srelu (pre, act), none (pre)
        self.num_epi_out = 3 if self.is_glu else (2 if self.has_act else 1)
        self.num_steps = self.box_n // self.epi_n
        self.num_mma_wg = 2
        self.threads = 128 * (1 + self.num_mma_wg)
        self.epi_tile = (self.tile_m, self.epi_n)
        stage_bytes = (self.tile_m + tile_n) * self.tile_k * dtype.width // 8
        buf_bytes = self.tile_m * self.epi_n * dtype.width // 8
        smem = cutlass.memory.get_smem_capacity_in_bytes("sm_90") - 1024
        if epi_slots is None:
            epi_slots = 1 if self.is_glu and tile_n == 256 else 2
        self.epi_slots = epi_slots
        epi_bytes = buf_bytes * self.num_epi_out * epi_slots
        if ab_stages is None:
            ab_stages = (smem - epi_bytes) // stage_bytes
        if ab_stages * stage_bytes + epi_bytes > smem or ab_stages < 2:
            raise ValueError("tile configuration does not fit in shared memory")
        self.ab_stages = ab_stages
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=128 * self.num_mma_wg)

    # ------------------------------------------------------------------ host side (traced)
    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (M, K)
        mW: cute.Tensor,  # (G, N, K); GLU rows [gate; up]
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mPre: cute.Tensor,  # (M, N)
        mAct: cute.Tensor,  # (M, N/2) GLU, (M, N) srelu, None
        mBias: cute.Tensor,  # (G, N) or None; GLU [gate; up]
        mProbs: cute.Tensor,  # (M,) float32 or None
        limit: Float32,
        alpha: Float32,
        stream,
    ):
        dt = self.dtype
        # B as (N / b_boxes, K, b_boxes, G): GLU (N/2, K, 2, G), box h = 0 gate, 1 up
        n = cute.size(mW, mode=[1])
        n_box = n // self.b_boxes
        row_stride = mW.stride[1]
        mB = cute.make_tensor(
            mW.iterator,
            cute.make_layout(
                (n_box, cute.size(mW, mode=[2]), self.b_boxes, cute.size(mW, mode=[0])),
                stride=(row_stride, mW.stride[2], n_box * row_stride, mW.stride[0]),
            ),
        )
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dt,
            dt,
            cute.nvgpu.OperandMajorMode.K,
            cute.nvgpu.OperandMajorMode.K,
            self.acc_dtype,
            (self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        tile_mk = (self.tile_m, self.tile_k)
        box_nk = (self.box_n, self.tile_k)
        self.sA_layout = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.tile_k), dt, self.ab_stages
        )
        self.sB_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.tile_n, self.tile_k), dt, self.ab_stages
        )
        self.sD_layout = sm90_utils.make_smem_layout_epi(
            dt, LayoutEnum.ROW_MAJOR, self.epi_tile, self.num_epi_out * self.epi_slots
        )
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mX,
            cute.slice_(self.sA_layout, (None, None, 0)),
            tile_mk,
        )
        sB_box_layout = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (self.tile_m, self.box_n, self.tile_k), dt, 1
        )
        tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
            if const_expr(self.cluster_m > 1)
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(),
            mB,
            cute.slice_(sB_box_layout, (None, None, 0)),
            box_nk,
            num_multicast=self.cluster_m,
        )
        sD_one = cute.slice_(self.sD_layout, (None, None, 0))
        tma_pre, tma_mPre = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(), _ragged_rows(mPre), sD_one, self.epi_tile
        )
        tma_act = None
        tma_mAct = None
        if const_expr(self.has_act):
            tma_act, tma_mAct = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
                _ragged_rows(mAct),
                sD_one,
                self.epi_tile,
            )
        self.tma_bytes = cute.size_in_bytes(dt, cute.slice_(self.sA_layout, (None, None, 0))) + (
            cute.size_in_bytes(dt, cute.slice_(self.sB_layout, (None, None, 0)))
        )

        @cute.struct
        class SharedStorage:
            ab_full_empty: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            sA: cute.struct.Align[
                cute.struct.MemRange[dt, cute.cosize(self.sA_layout)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[dt, cute.cosize(self.sB_layout)], 1024
            ]
            sD: cute.struct.Align[
                cute.struct.MemRange[dt, cute.cosize(self.sD_layout)], 1024
            ]

        self.shared_storage = SharedStorage

        m_total = cute.size(mX, mode=[0])
        num_groups = cute.size(mW, mode=[0])
        n_tiles = (n + self.tile_n - 1) // self.tile_n
        # upper bound on the number of tiles (shape-only), to avoid idle CTAs on small problems
        rows = self.tile_m * self.cluster_m
        max_tiles = ((m_total + rows - 1) // rows + num_groups + 1) * n_tiles
        grid_x = cutlass.min(max_tiles, self.num_sms // self.cluster_m) * self.cluster_m
        self.kernel(
            tma_a,
            tma_mA,
            tma_b,
            tma_mB,
            tma_pre,
            tma_mPre,
            tma_act,
            tma_mAct,
            mOffsets,
            mBias,
            mProbs,
            limit,
            alpha,
            self.tiled_mma,
            self.sA_layout,
            self.sB_layout,
            self.sD_layout,
        ).launch(
            grid=[grid_x, 1, 1],
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
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_pre: cute.CopyAtom,
        mPre: cute.Tensor,
        tma_act: cute.CopyAtom,
        mAct: cute.Tensor,
        mOffsets: cute.Tensor,
        mBias: cute.Tensor,
        mProbs: cute.Tensor,
        limit: Float32,
        alpha: Float32,
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
        # the scheduler hands out cluster tiles of cluster_m * tile_m rows; CTA `rank` takes
        # m-tile cluster_m * cluster_m_tile + rank of the same group and n-tile
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        first_tile = bidx // self.cluster_m
        num_clusters = gdim // self.cluster_m
        cluster_rows = self.tile_m * self.cluster_m
        b_mcast_mask = cutlass.Int16((1 << self.cluster_m) - 1)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_pre)
            if const_expr(self.has_act):
                cute.nvgpu.cpasync.prefetch_descriptor(tma_act)

        m_total = cute.size(mA, mode=[0])
        k_tiles = (cute.size(mA, mode=[1]) + self.tile_k - 1) // self.tile_k
        n_box = cute.size(mB, mode=[0])  # N/2 for GLU, else N
        num_groups = cute.size(mB, mode=[3])
        n_tiles = (n_box + self.box_n - 1) // self.box_n

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
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sD = storage.sD.get_tensor(sD_layout.outer, swizzle=sD_layout.inner)
        # ((box_n, tile_k), b_boxes, 1, stages): box h fills rows [h * box_n, (h+1) * box_n)
        sB_boxes = cute.group_modes(cute.flat_divide(sB, (self.box_n, self.tile_k)), 0, 2)

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))

        if wg_idx == 0:
            # ---------------------------------------------------------- TMA producer
            cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.ab_stages
                )
                tile_id = first_tile
                found, seg, seg_first, c_start, c_base = locate_tile(
                    tile_id, Int32(0), Int32(0), mOffsets, num_groups, m_total, n_tiles, cluster_rows
                )
                while found:
                    if seg < num_groups:
                        start, end = segment_rows(mOffsets, seg, num_groups, m_total)
                        m_tiles = (end - start + cluster_rows - 1) // cluster_rows
                        local = tile_id - seg_first
                        mt = local % m_tiles * self.cluster_m + rank
                        nt = local // m_tiles
                        gA = cute.local_tile(
                            cute.domain_offset((start, None), mA),
                            (self.tile_m, self.tile_k),
                            (mt, None),
                        )
                        gB = cute.local_tile(  # (box_n, tile_k, k_tiles, b_boxes)
                            mB[(None, None, None, seg)], (self.box_n, self.tile_k), (nt, None, None)
                        )
                        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
                            tma_a,
                            0,
                            cute.make_layout(1),
                            cute.group_modes(sA, 0, 2),
                            cute.group_modes(gA, 0, 2),
                        )
                        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
                            tma_b,
                            rank,
                            cute.make_layout(self.cluster_m),
                            sB_boxes,
                            cute.group_modes(gB, 0, 2),
                        )
                        for k in range(k_tiles):
                            ab_pipe.producer_acquire(state)
                            bar = ab_pipe.producer_get_barrier(state)
                            cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                            for h in cutlass.range_constexpr(self.b_boxes):
                                cute.copy(
                                    tma_b,
                                    tBgB[(None, k, h)],
                                    tBsB[(None, h, 0, state.index)],
                                    tma_bar_ptr=bar,
                                    mcast_mask=b_mcast_mask if const_expr(self.cluster_m > 1) else 0,
                                )
                            ab_pipe.producer_commit(state)
                            state.advance()
                    tile_id = tile_id + num_clusters
                    found, seg, seg_first, c_start, c_base = locate_tile(
                        tile_id, c_start, c_base, mOffsets, num_groups, m_total, n_tiles, cluster_rows
                    )
                ab_pipe.producer_tail(state)
        else:
            # ---------------------------------------------------------- MMA + epilogue
            cute.arch.setmaxregister_increase(232)
            mma_tidx = tidx - 128
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc_shape = thr_mma.partition_shape_C((self.tile_m, self.tile_n))
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)

            copy_atom_r2s = sm90_utils.get_smem_store_op(
                LayoutEnum.ROW_MAJOR, self.dtype, self.acc_dtype
            )
            copy_atom_c = cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype
            )
            tiled_copy_r2s = cute.make_tiled_copy_S(
                copy_atom_r2s, cute.make_tiled_copy_C_atom(copy_atom_c, tiled_mma)
            )
            thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
            tRS_sD = thr_copy_r2s.partition_D(sD)  # (R2S, R2S_M, R2S_N, buf)
            tRS_rAcc = tiled_copy_r2s.retile(acc)
            # coordinates (row, col in the epilogue subtile) of each register value
            tRS_cD = thr_copy_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))
            rD_shape = cute.shape(thr_copy_r2s.partition_S(sD))[:3]
            frag = cute.size(rD_shape)
            rPre = [cute.make_rmem_tensor(rD_shape, self.acc_dtype) for _ in range(2)]
            rAct = cute.make_rmem_tensor(rD_shape, self.acc_dtype)
            rOut = cute.make_rmem_tensor(rD_shape, self.dtype)

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
            epi_count = Int32(0)
            tile_id = first_tile
            found, seg, seg_first, c_start, c_base = locate_tile(
                tile_id, Int32(0), Int32(0), mOffsets, num_groups, m_total, n_tiles, cluster_rows
            )
            while found:
                start, end = segment_rows(mOffsets, seg, num_groups, m_total)
                length = end - start
                m_tiles = (length + cluster_rows - 1) // cluster_rows
                local = tile_id - seg_first
                mt = local % m_tiles * self.cluster_m + rank
                nt = local // m_tiles
                has_rows = mt * self.tile_m < length  # else only helps its peer load W
                is_group = seg < num_groups

                # ------------------------------------------------------ mainloop
                acc.fill(0.0)
                if is_group:
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                    cute.nvgpu.warpgroup.fence()
                    ab_pipe.consumer_wait(read_state)
                    self._mma_stage(tiled_mma, acc, tCrA, tCrB, read_state.index)
                    cute.nvgpu.warpgroup.commit_group()
                    read_state.advance()
                    for k in range(1, k_tiles):
                        ab_pipe.consumer_wait(read_state)
                        self._mma_stage(tiled_mma, acc, tCrA, tCrB, read_state.index)
                        cute.nvgpu.warpgroup.commit_group()
                        cute.nvgpu.warpgroup.wait_group(1)
                        ab_pipe.consumer_release(release_state)
                        release_state.advance()
                        read_state.advance()
                    cute.nvgpu.warpgroup.wait_group(0)
                    ab_pipe.consumer_release(release_state)
                    release_state.advance()

                # ------------------------------------------------------ epilogue
                gPre = cute.local_tile(
                    _segment_view(mPre, start, length), self.epi_tile, (None, None)
                )
                bSG_sD, bSG_gPre = cute.nvgpu.cpasync.tma_partition(
                    tma_pre, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2),
                    cute.group_modes(gPre, 0, 2),
                )
                bSG_gAct = bSG_gPre
                if const_expr(self.has_act):
                    gAct = cute.local_tile(
                        _segment_view(mAct, start, length), self.epi_tile, (None, None)
                    )
                    _, bSG_gAct = cute.nvgpu.cpasync.tma_partition(
                        tma_act, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2),
                        cute.group_modes(gAct, 0, 2),
                    )
                g_safe = cutlass.min(seg, num_groups - 1)
                row0 = start + mt * self.tile_m

                for step in cutlass.range_constexpr(self.num_steps):
                    # GLU: sub-tile `step` is gate (j = 0), `step + num_steps` up (j = 1)
                    for j in cutlass.range_constexpr(self.b_boxes):
                        sub = step + j * self.num_steps
                        for v in cutlass.range_constexpr(frag):
                            x = tRS_rAcc[sub * frag + v]
                            if const_expr(self.has_bias):
                                col = nt * self.box_n + step * self.epi_n + tRS_cD[v][1]
                                b = Float32(0.0)
                                if is_group and col < n_box:
                                    b = mBias[g_safe, j * n_box + col].to(Float32)
                                x = x + b
                            rPre[j][v] = x
                    if const_expr(self.has_act):
                        for v in cutlass.range_constexpr(frag):
                            rAct[v] = self._activation(rPre, v, tRS_cD, row0, m_total, is_group,
                                                       mProbs, limit, alpha)
                    slot = epi_count % self.epi_slots
                    outs = [rPre[0], rPre[1], rAct] if const_expr(self.is_glu) else [rPre[0], rAct]
                    for o in cutlass.range_constexpr(self.num_epi_out):
                        rOut.store(outs[o].load().to(self.dtype))
                        cute.copy(
                            tiled_copy_r2s,
                            rOut,
                            tRS_sD[(None, None, None, slot * self.num_epi_out + o)],
                        )
                    cute.arch.fence_proxy("async.shared", space="cta")
                    self.epi_barrier.arrive_and_wait()
                    if is_store_warp and has_rows:
                        buf0 = slot * self.num_epi_out
                        chunk = nt * self.num_steps + step  # 32-column chunk (of each half for GLU)
                        if chunk * self.epi_n < n_box:
                            cute.copy(tma_pre, bSG_sD[(None, buf0)], bSG_gPre[(None, mt, chunk)])
                            if const_expr(self.is_glu):
                                up_chunk = n_box // self.epi_n + chunk
                                cute.copy(tma_pre, bSG_sD[(None, buf0 + 1)], bSG_gPre[(None, mt, up_chunk)])
                            if const_expr(self.has_act):
                                act_buf = buf0 + self.num_epi_out - 1
                                cute.copy(tma_act, bSG_sD[(None, act_buf)], bSG_gAct[(None, mt, chunk)])
                    if is_store_warp:
                        store_pipe.producer_commit()
                        store_pipe.producer_acquire()
                    self.epi_barrier.arrive_and_wait()
                    epi_count = epi_count + 1

                tile_id = tile_id + num_clusters
                found, seg, seg_first, c_start, c_base = locate_tile(
                    tile_id, c_start, c_base, mOffsets, num_groups, m_total, n_tiles, cluster_rows
                )
            if is_store_warp:
                store_pipe.producer_tail()

    @cute.jit
    def _mma_stage(self, tiled_mma, acc, tCrA, tCrB, stage):
        """acc += the (tile_m, tile_n) product of the k-tile held in pipeline stage ``stage``."""
        for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
            cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], acc)

    @cute.jit
    def _activation(self, rPre, v, tRS_cD, row0, m_total, is_group, mProbs, limit, alpha):
        """fp32 activation of fragment element v (gate = rPre[0], up = rPre[1] for GLU)."""
        x = rPre[0][v]
        out = Float32(0.0)
        if const_expr(self.epilogue == "srelu"):
            r = cutlass.max(x, Float32(0.0))
            out = r * r
        elif const_expr(self.epilogue == "geglu"):
            u = rPre[1][v]
            inner = 0.7978845608028654 * (x + 0.044715 * x * x * x)
            out = 0.5 * x * (1.0 + cute.math.tanh(inner, fastmath=True)) * u
        elif const_expr(self.epilogue == "clamped_swiglu"):
            g = cutlass.min(x, limit)
            u = cutlass.min(cutlass.max(rPre[1][v], -limit), limit)
            hg = 0.5 * g  # g sigmoid(alpha g) = hg (1 + tanh(alpha hg))
            out = (hg + hg * _tanh_approx(alpha * hg)) * (u + 1.0)
        else:  # swiglu, scaled_swiglu
            out = _silu(x) * rPre[1][v]
            if const_expr(self.epilogue == "scaled_swiglu"):
                row = cutlass.min(row0 + tRS_cD[v][0], m_total - 1)
                p = Float32(0.0)
                if is_group:
                    p = mProbs[row]
                out = out * p
        return out
