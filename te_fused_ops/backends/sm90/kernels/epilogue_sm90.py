"""The epilogue machinery of the sm90 grouped GEMM core (`grouped_gemm_sm90`): `Sm90Epilogue`, a
mixin of the core, runs a kernel's hooks (``epi_make_state``, ``epi_begin_tile``, ``epi_visit``,
``epi_end_tile``, ``epi_end_kernel``, defined by the epilogue classes) over 128 x 32 chunks and
moves their inputs and outputs: C-tile loads and stores by TMA through shared memory, outputs
deferred under the next tile's mainloop (``defer_stores``), or the epilogue warps' 16-byte
register loads and stores (``epilogue_warps``).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Int32, const_expr
from cutlass.tensor_utils import LayoutEnum

from .group_tile_scheduler import Tile
from .varlen_sm90 import input_view, output_view

EPI_VEC = 8  # 16-bit elements per 16-byte load / store of the epilogue warps


class EpiFragments(NamedTuple):
    """An MMA thread's epilogue registers and copies (`Sm90Epilogue._epilogue_fragments`): the
    register -> smem copy and its destinations (store buffers, or the handed-over accumulator),
    the accumulator retiled by chunk, the (row, col) of each value of a chunk, per-chunk fp32
    fragments rAcc (per B box) / rIn (loaded inputs) / rOut (outputs), rStore (dtype), and the
    C-tile smem -> register copy with its sources and destinations; None where unused."""

    tiled_copy_r2s: object
    tRS_sD: object
    tRS_rAcc: object
    tRS_cD: object
    rAcc: list
    rIn: list
    rOut: list
    rStore: object
    tiled_copy_s2r: object
    tSR_sC: object
    tSR_rIn: object


class Sm90Epilogue:
    """Kernel-core mixin: the epilogue hooks' defaults and the code around them. Uses the core's
    epi_tile, epi_n, num_steps, b_boxes, epi_stores / epi_loads (num_out / num_in), epi_slots,
    c_stages, hook_warps, epi_barrier, dtype."""

    def epi_make_state(self, tiled_copy, epi_tile, shared):
        """Per-thread register state carried across the epilogue steps of a tile, or None;
        ``tiled_copy`` gives each thread's values of an ``epi_tile`` sub-tile; ``shared``:
        (``epi_scratch`` elements of dtype in shared memory as a 1-D tensor, or None; with
        ``group_blocks`` the `scan_group_blocks` tensor (first blocks from SORT_MAX_G + 1), or None)."""
        return None

    def epi_begin_tile(self, params, tile: Tile, n_box, tRS_rAcc, tRS_cD, state):
        """Before the tile's first step (all consumer threads): reset ``state``, or read the
        whole accumulator (``tRS_rAcc``: chunk s of B box j at values [(s + j num_steps) frag,
        ...)). With ``epilogue_warps``: once per 8-row block of the tile, ``tRS_rAcc`` None."""

    def epi_visit(self, params, tile: Tile, step, chunk, n_box, rAcc, rIn, rOut, tRS_cD, state):
        """fp32 outputs of one 128 x 32 chunk (``step`` of the tile, static; ``chunk`` its index in
        the output): rAcc[j] the accumulator of B box j, rIn[i] the loaded inputs (epi_loads
        order), rOut[o] to fill (epi_stores order); per-thread fragments, element v at (row, col)
        = tRS_cD[v] of the chunk (with ``epilogue_warps``: 8 columns of one row of the chunk)."""
        raise NotImplementedError

    def epi_end_tile(self, params, tile: Tile, n_box, tRS_cD, state):
        """After the tile's last step (all consumer threads)."""

    def epi_end_kernel(self, params, consumer_warp, state):
        """After the CTA's last tile (all consumer threads; ``consumer_warp`` 0..7)."""


    def _partition_store(self, atom_and_view, sD, seg, start, length):
        """TMA partitions (smem buffers, gmem chunks (mt, chunk)) of one output for a tile of segment
        ``seg`` (rows [start, start + length)): the ragged rows of the segment; varlen-K, group seg's
        (N, K_out) slice."""
        atom, mD = atom_and_view
        gD = cute.local_tile(output_view(mD, self.varlen_k, seg, start, length), self.epi_tile, (None, None))
        return cute.nvgpu.cpasync.tma_partition(
            atom, 0, cute.make_layout(1), cute.group_modes(sD, 0, 2), cute.group_modes(gD, 0, 2)
        )

    @cute.jit
    def _store_chunk(self, store_args, rChunk, pending_tile, step, epi_count):
        """defer_stores: chunk ``step`` (128 x 32, in dtype in ``rChunk``) of the tile recorded in
        ``pending_tile`` through epilogue slot epi_count % epi_slots by TMA; the slot is free again
        on return."""
        tiled_copy_r2s, tRS_sD, sD, store_tmas, store_pipe, is_store_warp = store_args
        slot = epi_count % self.epi_slots
        cute.copy(tiled_copy_r2s, rChunk, tRS_sD[(None, None, None, slot)])
        cute.arch.fence_proxy("async.shared", space="cta")
        self.epi_barrier.arrive_and_wait()
        if is_store_warp:
            if pending_tile[6] != 0:
                bSG_sD, bSG_gD = self._partition_store(
                    store_tmas[0], sD, pending_tile[1], pending_tile[2], pending_tile[3]
                )
                chunk = pending_tile[5] * self.num_steps + step
                cute.copy(store_tmas[0][0], bSG_sD[(None, slot)], bSG_gD[(None, pending_tile[4], chunk)])
            store_pipe.producer_commit()
            store_pipe.producer_acquire()
        self.epi_barrier.arrive_and_wait()

    @cute.jit
    def _run_epilogue_warps(self, acc_pipe, sAcc, epi_tensors, epi_params, first_tile, num_clusters, rank, sched, n_box):
        """``epilogue_warps``, warps 1-3: the epilogue of each tile the MMA warpgroups hand over (its
        accumulator in ``sAcc`` as dtype, one 128 x 32 chunk per step) while they run the next tile's
        mainloop.

        A warp takes 8-row blocks of the tile (warp w: blocks w, w + 3, ...), a lane 8 adjacent columns
        of one row (row lane // 4 of the block, columns 8 (lane % 4) of each chunk); inputs and
        outputs move as 16-byte loads and stores between global memory and registers. The hooks see
        one block at a time: begin / visit every chunk / end per (tile, block), with the coordinates
        of the block's values in the chunk. Loads are clamped to the tensor, stores predicated on the
        segment's rows and the columns < n_box.
        """
        outputs, inputs = epi_tensors
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx()) - 1
        lane = cute.arch.lane_idx()
        vec = EPI_VEC
        block_rows = 32 // (self.epi_n // vec)
        blocks = self.tile_m // block_rows
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        tiled_copy = cute.make_tiled_copy_tv(
            atom, cute.make_layout((block_rows, 32 // block_rows), stride=(32 // block_rows, 1)),
            cute.make_layout((1, vec)),
        )
        thr_copy = tiled_copy.get_slice(lane)
        tEsAcc = thr_copy.partition_S(sAcc)  # (vec, block, 1, chunk)
        tEcD = thr_copy.partition_S(cute.make_identity_tensor(self.epi_tile))  # (vec, block, 1)
        state = self.epi_make_state(tiled_copy, (block_rows, self.epi_n), (None, None))
        frag_shape = cute.shape(tEcD[(None, 0, 0)])
        frags = (  # registers: the accumulator as loaded and in fp32, every step's inputs, outputs, a store
            cute.make_rmem_tensor(frag_shape, self.dtype),
            [cute.make_rmem_tensor(frag_shape, self.acc_dtype) for _ in range(self.b_boxes)],
            [[cute.make_rmem_tensor((vec,), self.dtype) for _ in range(self.num_in)] for _ in range(self.num_steps)],
            [cute.make_rmem_tensor(frag_shape, self.acc_dtype) for _ in range(self.num_out)],
            cute.make_rmem_tensor((vec,), self.dtype),
        )
        acc_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, 1)

        m_total = sched[2]
        tile_id = first_tile
        found, seg, seg_first, c_start, c_base = self._locate(tile_id, Int32(0), Int32(0), sched)
        while found:
            tile, has_rows, _, _ = self._tile(tile_id, seg, seg_first, rank, sched)
            is_group = tile.is_group
            if is_group and has_rows:
                acc_pipe.consumer_wait(acc_read)
            for b in range(warp if has_rows else blocks, blocks, self.hook_warps):
                if is_group:
                    self._epilogue_block(epi_params, tile, b, True, tEsAcc, tEcD, inputs, outputs, state, frags,
                                         m_total, n_box)
                else:  # padding rows: the epilogue of zeros
                    self._epilogue_block(epi_params, tile, b, False, tEsAcc, tEcD, inputs, outputs, state, frags,
                                         m_total, n_box)
            if is_group and has_rows:
                acc_pipe.consumer_release(acc_read)
                acc_read.advance()
            tile_id = self._next_tile_id(tile_id, first_tile, num_clusters)
            found, seg, seg_first, c_start, c_base = self._locate(tile_id, c_start, c_base, sched)
        self.epi_end_kernel(epi_params, warp, state)

    @cute.jit
    def _epilogue_block(self, params, tile: Tile, b, loaded: cutlass.Constexpr, tEsAcc, tEcD, inputs, outputs, state,
                        frags, m_total, n_box):
        """The hooks over 8-row block ``b`` of the tile (`_run_epilogue_warps`); ``loaded``: the
        accumulator and inputs are read (every step's inputs first, so their loads overlap), else
        they are zeros (padding rows)."""
        rLoad, rAcc, rIns, rOut, rStore = frags
        lane = cute.arch.lane_idx()
        vec = EPI_VEC
        vec_cols = self.epi_n // vec  # lanes along a chunk row
        vecs = n_box // vec  # column vectors of a half
        tEcD_b = tEcD[(None, b, 0)]
        row = tile.row0 + b * (32 // vec_cols) + lane // vec_cols
        load_row = cutlass.min(row, m_total - 1)
        cols = [(tile.nt * self.num_steps + step) * vec_cols + lane % vec_cols for step in range(self.num_steps)]
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.dtype, num_bits_per_copy=128)
        for step in cutlass.range_constexpr(self.num_steps):
            for i in cutlass.range_constexpr(self.num_in):
                if const_expr(loaded):
                    t, half = self.epi_loads[i]
                    col = cutlass.min(cols[step], vecs - 1) + half * vecs
                    cute.copy(atom, self._vector(inputs[t], load_row, col), rIns[step][i])
                else:
                    rIns[step][i].fill(0.0)
        self.epi_begin_tile(params, tile, n_box, None, tEcD_b, state)
        for step in cutlass.range_constexpr(self.num_steps):
            for j in cutlass.range_constexpr(self.b_boxes):
                if const_expr(loaded):
                    cute.autovec_copy(tEsAcc[(None, b, 0, step + j * self.num_steps)], rLoad)
                    rAcc[j].store(rLoad.load().to(self.acc_dtype))
                else:
                    rAcc[j].fill(0.0)
            chunk = tile.nt * self.num_steps + step
            self.epi_visit(params, tile, step, chunk, n_box, rAcc, rIns[step], rOut, tEcD_b, state)
            for o in cutlass.range_constexpr(self.num_out):
                t, half = self.epi_stores[o]
                for v in cutlass.range_constexpr(vec):
                    rStore[v] = rOut[o][v].to(self.dtype)
                if row < tile.end and cols[step] < vecs:
                    cute.copy(atom, rStore, self._vector(outputs[t], row, cols[step] + half * vecs))
        self.epi_end_tile(params, tile, n_box, tEcD_b, state)

    @staticmethod
    def _vector(mT: cute.Tensor, row, col_vec):
        """The 8 elements (one 16-byte vector) of row ``row``, columns 8 col_vec .. 8 col_vec + 7."""
        return cute.group_modes(cute.local_tile(mT, (1, EPI_VEC), (row, col_vec)), 0, 2)

    def _partition_loads(self, load_tmas, sC, tile: Tile):
        """TMA partitions (smem buffers, gmem chunks (mt, chunk)) of the C-tile inputs for a tile: its
        segment's rows; varlen-K, group seg's (N, K_out) slice."""
        bGS_sC = None
        bGS_gC = []
        for atom, mC in load_tmas:
            gC = cute.local_tile(input_view(mC, self.varlen_k, tile.seg, tile.start), self.epi_tile, (None, None))
            bGS_sC, bGS_g = cute.nvgpu.cpasync.tma_partition(
                atom, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2), cute.group_modes(gC, 0, 2)
            )
            bGS_gC.append(bGS_g)
        return bGS_sC, bGS_gC

    @cute.jit
    def _load_c(self, load_tmas, c_pipe, c_write, bGS_sC, bGS_gC, mt, chunk, half_chunks):
        """Issue the TMA loads of every ``epi_loads`` buffer of ``chunk`` (one warp)."""
        c_pipe.producer_acquire(c_write)
        bar = c_pipe.producer_get_barrier(c_write)
        for i in cutlass.range_constexpr(self.num_in):
            t, half = self.epi_loads[i]
            cute.copy(
                load_tmas[t][0],
                bGS_gC[t][(None, mt, chunk + half * half_chunks)],
                bGS_sC[(None, c_write.index * self.num_in + i)],
                tma_bar_ptr=bar,
            )

    def _epilogue_fragments(self, tiled_mma, mma_tidx, acc, smem_tensors):
        """The MMA thread's `EpiFragments`: register -> smem copies in the accumulator's
        thread-value layout (stmatrix: 16-bit), into the store buffers or the handed-over
        accumulator, the chunk registers, and the C-tile smem -> register copies (ldmatrix: 16-bit)."""
        copy_atom_c = cute.make_tiled_copy_C_atom(
            cute.make_copy_atom(
                cute.nvgpu.warp.StMatrix8x8x16bOp(self.d_layout == LayoutEnum.COL_MAJOR, 4),
                self.dtype if const_expr(self.dtype.width == 16) else cutlass.Float16,
            ),
            tiled_mma,
        )
        tiled_copy_r2s = cute.make_tiled_copy_S(
            sm90_utils.get_smem_store_op(self.d_layout, self.dtype, self.acc_dtype),
            copy_atom_c,
        )
        thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
        tRS_sD = None
        if const_expr(self.epilogue_warps):
            tRS_sD = thr_copy_r2s.partition_D(smem_tensors.sAcc)  # (R2S, R2S_M, R2S_N, chunk)
        elif const_expr(self.num_out > 0):
            tRS_sD = thr_copy_r2s.partition_D(smem_tensors.sD)  # (R2S, R2S_M, R2S_N, buf)
        # the accumulator by chunk: value v of chunk s at index s * frag + v, in tRS_cD's order. The
        # retiled accumulator is ((V, N), M, 1): V values of one 16-column group of a 64-row slab,
        # N groups along tile_n, M slabs; with ping-pong's two slabs (128-row tiles on one
        # warpgroup) a chunk is 2 groups of both, so the view orders the values (V, M, N)
        tRS_rAcc = tiled_copy_r2s.retile(acc)
        if const_expr(self.pingpong):
            (values, groups), slabs = tRS_rAcc.shape[0], tRS_rAcc.shape[1]
            (value_stride, group_stride), slab_stride = tRS_rAcc.stride[0], tRS_rAcc.stride[1]
            tRS_rAcc = cute.make_tensor(
                tRS_rAcc.iterator,
                cute.make_layout((values, slabs, groups), stride=(value_stride, slab_stride, group_stride)),
            )
        # coordinates (row, col in the chunk) of each register value
        tRS_cD = thr_copy_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))
        rD_shape = cute.shape(tRS_cD)
        rAcc = [cute.make_rmem_tensor(rD_shape, self.acc_dtype) for _ in range(self.b_boxes)]
        rOut = [cute.make_rmem_tensor(rD_shape, self.acc_dtype) for _ in range(self.num_out)]
        rStore = cute.make_rmem_tensor(rD_shape, self.dtype)
        rIn = [cute.make_rmem_tensor(rD_shape, self.dtype) for _ in range(self.num_in)]
        tiled_copy_s2r = None
        tSR_sC = None
        tSR_rIn = None
        if const_expr(self.num_in > 0 and not self.epilogue_warps):
            if const_expr(self.dtype.width == 16):  # ldmatrix
                tiled_copy_s2r = cute.make_tiled_copy_S(
                    cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), self.dtype),
                    copy_atom_c,
                )
                thr_copy_s2r = tiled_copy_s2r.get_slice(mma_tidx)
                tSR_sC = thr_copy_s2r.partition_S(smem_tensors.sC)
                tSR_rIn = [thr_copy_s2r.retile(r) for r in rIn]
            else:  # 32-bit inputs: plain loads in the store's thread-value layout
                tSR_sC = thr_copy_r2s.partition_D(smem_tensors.sC)
        return EpiFragments(tiled_copy_r2s, tRS_sD, tRS_rAcc, tRS_cD, rAcc, rIn, rOut, rStore, tiled_copy_s2r, tSR_sC,
                            tSR_rIn)

    @cute.jit
    def _hand_over_acc(self, acc_pipe, acc_write, epi, tile: Tile, has_rows):
        """``epilogue_warps``: the accumulator into sAcc in dtype for the epilogue warps (the
        epilogue warpgroup waits on the padding segment for nothing, and a tile without rows has
        no epilogue); returns acc_write."""
        frag = cute.size(cute.shape(epi.tRS_cD))
        if tile.is_group and has_rows:
            acc_pipe.producer_acquire(acc_write)
            for sub in cutlass.range_constexpr(self.b_boxes * self.num_steps):
                for v in cutlass.range_constexpr(frag):
                    epi.rStore[v] = epi.tRS_rAcc[sub * frag + v].to(self.dtype)
                cute.copy(epi.tiled_copy_r2s, epi.rStore, epi.tRS_sD[(None, None, None, sub)])
            acc_pipe.producer_commit(acc_write)
            acc_write.advance()
        return acc_write

    @cute.jit
    def _defer_outputs(self, params, epi, tile: Tile, has_rows, n_box, state, pending, pending_tile):
        """``defer_stores``: the tile's output chunks in dtype into ``pending`` and where they go into
        ``pending_tile``; `_store_chunk` stores them under the next tile's k-tiles."""
        frag = cute.size(cute.shape(epi.tRS_cD))
        rAcc, rOut = epi.rAcc, epi.rOut
        self.epi_begin_tile(params, tile, n_box, epi.tRS_rAcc, epi.tRS_cD, state)
        for step in cutlass.range_constexpr(self.num_steps):
            for v in cutlass.range_constexpr(frag):
                rAcc[0][v] = epi.tRS_rAcc[step * frag + v]
            self.epi_visit(params, tile, step, tile.nt * self.num_steps + step, n_box, rAcc, epi.rIn, rOut,
                           epi.tRS_cD, state)
            pending[step].store(rOut[0].load().to(self.dtype))
        self.epi_end_tile(params, tile, n_box, epi.tRS_cD, state)
        for i, value in enumerate((1, tile.seg, tile.start, tile.end - tile.start, tile.mt, tile.nt, Int32(has_rows))):
            pending_tile[i] = Int32(value)

    @cute.jit
    def _epilogue_tile(self, params, epi, tile: Tile, has_rows, n_box, half_chunks, state, sD, store_tmas, load_tmas,
                       store_pipe, is_store_warp, c_pipe, c_read, c_write, c_loads, epi_count, epi_barrier):
        """The tile's epilogue on the MMA warpgroup(s), one 128 x epi_n chunk per step: the loaded
        inputs (zeros on padding rows), the hooks, the outputs through the store slots by TMA;
        ``epi_barrier`` joins the threads of the tile. Returns (c_read, c_write, epi_count)."""
        frag = cute.size(cute.shape(epi.tRS_cD))
        rAcc, rIn, rOut, rStore = epi.rAcc, epi.rIn, epi.rOut, epi.rStore
        mt = tile.mt
        bSG_sD = None
        bSG_gD = []
        for atom_and_view in store_tmas:
            bSG_sD, bSG_g = self._partition_store(atom_and_view, sD, tile.seg, tile.start, tile.end - tile.start)
            bSG_gD.append(bSG_g)
        self.epi_begin_tile(params, tile, n_box, epi.tRS_rAcc, epi.tRS_cD, state)

        for step in cutlass.range_constexpr(self.num_steps):
            chunk = tile.nt * self.num_steps + step  # 32-column chunk (of each half)
            # forward GLU: sub-tile `step` is gate (j = 0), `step + num_steps` up (j = 1)
            for j in cutlass.range_constexpr(self.b_boxes):
                sub = step + j * self.num_steps
                for v in cutlass.range_constexpr(frag):
                    rAcc[j][v] = epi.tRS_rAcc[sub * frag + v]
            if const_expr(self.num_in > 0):
                if tile.is_group:
                    c_pipe.consumer_wait(c_read)
                    for i in cutlass.range_constexpr(self.num_in):
                        sC_i = epi.tSR_sC[(None, None, None, c_read.index * self.num_in + i)]
                        if const_expr(self.dtype.width == 16):
                            cute.copy(epi.tiled_copy_s2r, sC_i, epi.tSR_rIn[i])
                        else:
                            rIn[i].store(sC_i.load())
                    c_pipe.consumer_release(c_read)
                    c_read.advance()
                else:
                    for i in cutlass.range_constexpr(self.num_in):
                        rIn[i].fill(0.0)
            self.epi_visit(params, tile, step, chunk, n_box, rAcc, rIn, rOut, epi.tRS_cD, state)
            slot = epi_count % self.epi_slots
            if const_expr(self.num_out > 0):  # else the epilogue class stored from registers
                for o in cutlass.range_constexpr(self.num_out):
                    rStore.store(rOut[o].load().to(self.dtype))
                    cute.copy(epi.tiled_copy_r2s, rStore, epi.tRS_sD[(None, None, None, slot * self.num_out + o)])
                cute.arch.fence_proxy("async.shared", space="cta")
                epi_barrier.arrive_and_wait()
            if const_expr(self.num_in > 0 and step + self.c_stages < self.num_steps):
                if tile.is_group and is_store_warp:
                    self._load_c(load_tmas, c_pipe, c_write, *c_loads, mt, chunk + self.c_stages, half_chunks)
                    c_write.advance()
            if const_expr(self.num_out > 0):
                if is_store_warp and has_rows:
                    if chunk * self.epi_n < n_box:
                        for o in cutlass.range_constexpr(self.num_out):
                            t, half = self.epi_stores[o]
                            cute.copy(
                                store_tmas[t][0],
                                bSG_sD[(None, slot * self.num_out + o)],
                                bSG_gD[t][(None, mt, chunk + half * half_chunks)],
                            )
                if is_store_warp:
                    store_pipe.producer_commit()
                    store_pipe.producer_acquire()
                epi_barrier.arrive_and_wait()
                epi_count = epi_count + 1
        self.epi_end_tile(params, tile, n_box, epi.tRS_cD, state)
        return c_read, c_write, epi_count
