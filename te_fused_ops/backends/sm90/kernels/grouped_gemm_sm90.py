"""Hopper (sm_90a) sync-free grouped GEMM core over contiguous row groups ("varlen-M"), in CuTe DSL.

    acc[r, :] = A[r, :] @ B[g]        for offsets[g] <= r < offsets[g+1]      (fp32)
    outputs   = epilogue(acc, ...)    rows >= offsets[G] get the epilogue of acc = 0 (zeros)

A (M, K) K-major. The weight is read in place in either major mode (``b_major``): "k": W (G, N, K),
acc = A_g @ W[g].T; "mn": W (G, K, N), acc = A_g @ W[g] (16-bit WGMMA reads MN-major B from smem).
Persistent, warp-specialized: warpgroup 0 is the TMA producer (one warp issues the loads),
warpgroups 1-2 run WGMMA on a 128 x tile_n tile (64 rows each) and the epilogue. Tiles come from
``group_tile_scheduler`` (device prefix sums over the offsets tensor), searched by the producer
warp, which passes each tile on to the MMA warpgroups through a small shared-memory ring (so no
search sits between their tiles); the launch depends on tensor shapes only, the grid size (SM
margin) is a runtime argument. With cluster_m=2 a pair of CTAs takes
two vertically adjacent tiles of one group and multicasts the shared B tile (each CTA loads half);
a CTA whose tile lies past its group's end still runs the mainloop for its peer and stores nothing.

The epilogue works on 128 x 32 sub-tiles ("chunks"), one per step: an optional C-tile load (TMA
into smem, issued ahead by the first consumer warp, before the tile's mainloop for the first steps),
the subclass's element-wise ``epi_visit`` in fp32 registers, registers -> smem -> TMA store.
Subclasses declare their outputs as ``epi_stores`` and loaded inputs as ``epi_loads``: one
(tensor index, half) pair per smem buffer, half 1 being the columns [n_box, 2 n_box) of a
[gate, up] tensor; with no ``epi_stores`` the steps skip shared memory and its barriers (the
subclass stores from registers). Stores never cross a group's last row: outputs get a "ragged" TMA
view (the idea of Triton's ragged TMA descriptors) with two extra modes whose strides wrap around
the 64-bit address space, so a tile of group g sees a tensor whose row extent ends exactly at the
group's last row and the TMA unit clips the rest.

With ``epilogue_warps`` (subclasses with ``supports_epilogue_warps``, 16-bit operands) the epilogue
overlaps the next tile's mainloop instead: the MMA warpgroups hand the accumulator over in dtype
through one shared-memory buffer (an mbarrier pair) and go on; warps 1-3 of the producer
warpgroup run the same hooks on 8-row blocks with 16-byte loads and stores straight between
global memory and registers (no TMA, no C or D buffers). A fourth warpgroup would cap every thread
at 128 registers (ptxas budgets the kernel by its thread count, whatever setmaxnreg says later).

With ``b_boxes`` = 2 (forward GLU), n-tile nt covers B rows [nt * tile_n/2, (nt+1) * tile_n/2) and
the same rows of the second half: each B stage is filled by two TMA boxes of tile_n/2 (gate, then
up) from a view of W with a separate half mode, (N/2, K, 2, G), so each half is clipped at its
own end. Accumulator columns [0, tile_n/2) are gate and [tile_n/2, tile_n) up; epilogue step s
pairs 32-column sub-tile s with s + tile_n/64.

Varlen-K (``varlen_k``, `GroupedWgradSm90` in ``grouped_wgrad_sm90``: dW[g] = dy_g^T @ x_g) is a
second schedule of the same kernel: the token dim is K, so every group owns the same
ceil(N/128) * ceil(K_out/tile_n) output tiles (a static schedule over (group, m-tile, n-tile),
groups visited largest first when ranked in shared memory at start) and only the k-loop length
ceil(rows_g / tile_k) comes from the offsets (0 for an empty group: its tiles store zeros). A and
B are the MN-major token views dy^T and x^T of the group ("ragged" token views ending at its last
row; FP8: K-major block-padded column copies whose per-block multipliers ride in the stage).
With ``defer_stores`` a tile's outputs wait in registers and leave one 128 x 32 chunk after each of
the next tile's first k-tiles (the stores run under its WGMMAs).

Variants: ``GroupedGemmActSm90`` (below; bias + activation forward, and the plain GEMM in both
weight layouts, e.g. the data gradient dx = dy_g @ W[g]) and ``GroupedGemmDActSm90``
(``grouped_dact_sm90``; data gradient + the activation's backward, C-tile load of ``pre``).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, Int64, Uint32, const_expr
from cutlass.tensor_utils import LayoutEnum

from .activation_math_sm90 import ACTIVATION_MATH
from ....activations import activation_spec
from .block_quantize_sm90 import e4m3_scale_inv, e4m3_scaled
from .group_tile_scheduler import (
    RASTER_BAND,
    SORT_MAX_G,
    banded_tile,
    cluster_tile,
    locate_tile,
    scan_group_blocks,
    segment_rows,
)
from .mainloop_sm90 import mma_block, mma_stage

_EPI_VEC = 8  # 16-bit elements per 16-byte load / store of the epilogue warps
# the tile ring: tiles the producer warp has located, read by the MMA warpgroups
# (entry: found, seg, start, end, mt, nt, row0, has_rows)
_TILE_SLOTS = 4
_TILE_FIELDS = 8
_MAX_EPI_SLOTS = 2  # TMA-store slots of 128 x 32 (tile_m x epi_n) where shared memory has room
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


def _ragged_tokens(t: cute.Tensor) -> cute.Tensor:
    """(tokens, C) row-major -> (C, BIG, HUGE, HUGE) view whose token mode can be clipped.

    Element (c, BIG - length + r, BIG, start + length) sits at offset
    c + (start + r) * ld + BIG * 2**34 = c + (start + r) * ld (mod 2**64); tokens r >= length
    fall outside mode 1 and the TMA unit zero-fills them."""
    ld = t.stride[0]
    layout = cute.make_layout((t.shape[1], _BIG, _HUGE, _HUGE), stride=(1, ld, Int64(2**34) - ld, ld))
    return cute.make_tensor(t.iterator, layout)


def _group_tokens(mRagged: cute.Tensor, start: Int32, length: Int32) -> cute.Tensor:
    """(C, tokens) coordinate view of one group of a `_ragged_tokens` view: token r < length is
    row start + r."""
    return cute.domain_offset((None, _BIG - length), mRagged[(None, None, _BIG, start + length)])


def _rows_by_block(t: cute.Tensor) -> cute.Tensor:
    """(blocks, C) row-major multipliers -> the (C, blocks) view the scale TMA tiles (tile, 1)."""
    return cute.make_tensor(t.iterator, cute.make_layout((t.shape[1], t.shape[0]), stride=(1, t.stride[0])))


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


class GroupedGemmSm90:
    """Persistent grouped GEMM core for sm_90a; subclasses add the epilogue and ``__call__``.

    Compile-time configuration: ``dtype`` (cutlass.BFloat16 / Float16: A, B and the epilogue
    tensors; Float32 epilogue tensors with a 16-bit ``ab_dtype``), ``tile_n`` (128 or 256; tile_m
    is 128, tile_k 64; FP8 operands: 128 or 192, tile_k 128), ``a_major`` / ``b_major`` ("k" or
    "mn": A (M, K) / (K, M) and W (G, N, K) / (G, K, N); varlen-K: the token views), ``cluster_m``
    (1, or 2: B multicast to a CTA pair), ``ab_stages`` / ``epi_slots`` (None: fill shared
    memory), ``c_stages`` (C-tile load buffers: chunks loaded ahead, default 2), ``raster_band``
    (m-tiles per band of the tile order inside a group, `banded_tile`), ``split_tail`` (varlen-M,
    cluster_m 2: a group's odd last m-tile split along N over the pair, `cluster_tile`),
    ``epilogue_warps`` (the epilogue on warps of its own, module docstring), ``defer_stores`` (one
    output, no loads: stored under the next tile's mainloop). Subclasses set ``b_boxes``,
    ``epi_stores``, ``epi_loads`` (and ``varlen_k``, ``sort_groups``) before calling this
    ``__init__``.
    """

    tile_m = 128
    tile_k = 64
    epi_n = 32
    b_boxes = 1
    epi_stores: tuple  # set by subclasses
    epi_loads = ()
    varlen_k = False  # the token (K) dim grouped: module docstring
    # varlen-M: each group's first 128-row block (`scan_group_blocks`) in shared memory for the
    # epilogue hooks (per-group column-wise casts), G <= SORT_MAX_G
    group_blocks = False
    epi_scratch = 0  # elements of dtype of shared memory the epilogue hooks use themselves
    sort_groups = False  # varlen-K: visit groups largest first (ranked in shared memory, G <= SORT_MAX_G)

    supports_epilogue_warps = False  # subclasses whose hooks are element-wise over (row, col)

    def __init__(
        self, dtype, tile_n, b_major="k", cluster_m=2, ab_stages=None, epi_slots=None, ab_dtype=None, c_stages=2,
        raster_band=RASTER_BAND, split_tail=True, epilogue_warps=False, a_major="k", defer_stores=False,
    ):
        if b_major not in ("k", "mn") or a_major not in ("k", "mn"):
            raise ValueError("a_major and b_major must be 'k' or 'mn'")
        if cluster_m not in (1, 2):
            raise ValueError("cluster_m must be 1 or 2")
        self.dtype = dtype
        self.ab_dtype = dtype if ab_dtype is None else ab_dtype
        # FP8 operands are block-scaled: one k-tile is one 128-deep scale block, promoted into
        # the fp32 accumulator after its WGMMAs (a second accumulator of the same size, so
        # tile_n is at most 192: 96 + 96 registers per thread)
        self.block_scaled = self.ab_dtype.width == 8
        if self.block_scaled:
            if tile_n not in ((128,) if self.varlen_k else (128, 192)) or "mn" in (a_major, b_major):
                raise ValueError(
                    f"FP8 operands need tile_n {'128' if self.varlen_k else '128 or 192'} and K-major operands"
                )
            self.tile_k = 128
        elif tile_n not in (128, 256):
            raise ValueError("tile_n must be 128 or 256")
        self.acc_dtype = Float32
        self.tile_n = tile_n
        self.a_layout = LayoutEnum.ROW_MAJOR if a_major == "k" else LayoutEnum.COL_MAJOR
        self.b_major = b_major
        self.b_layout = LayoutEnum.ROW_MAJOR if b_major == "k" else LayoutEnum.COL_MAJOR
        self.cluster_m = cluster_m
        self.c_stages = c_stages
        self.raster_band = raster_band
        self.split_tail = split_tail and cluster_m == 2 and not self.varlen_k
        # varlen-K FP8: the k-tile's multipliers (A rows, B columns) are loaded with the operands
        self.stage_scales = self.varlen_k and self.block_scaled
        self.box_n = tile_n // self.b_boxes
        self.box_may_split = 128 % self.box_n != 0  # FP8: a B box can cross a W scale block
        self.num_out = len(self.epi_stores)
        self.num_in = len(self.epi_loads)
        self.num_steps = self.box_n // self.epi_n
        self.num_mma_wg = 2
        if epilogue_warps and (self.block_scaled or not self.supports_epilogue_warps or self.num_out == 0
                               or self.varlen_k):
            raise ValueError(f"{type(self).__name__}: epilogue_warps needs 16-bit operands and stored outputs")
        if defer_stores and (self.num_out != 1 or self.num_in or self.b_boxes != 1 or epilogue_warps):
            raise ValueError(f"{type(self).__name__}: defer_stores needs one output and no loaded inputs")
        # epilogue_warps: warps 1-3 of the producer warpgroup run the epilogue; every warpgroup keeps the
        # launch's 168 registers (no setmaxnreg)
        self.epilogue_warps = epilogue_warps
        self.defer_stores = defer_stores
        self.threads = 128 * (1 + self.num_mma_wg)
        self.hook_warps = 3 if epilogue_warps else 4 * self.num_mma_wg  # warps running the epilogue hooks
        self.epi_tile = (self.tile_m, self.epi_n)
        stage_bytes = (self.tile_m + tile_n) * self.tile_k * self.ab_dtype.width // 8
        if self.stage_scales:
            stage_bytes += (self.tile_m + tile_n) * 4
        buf_bytes = self.tile_m * self.epi_n * dtype.width // 8
        smem = cutlass.memory.get_smem_capacity_in_bytes("sm_90") - 1024 - _TILE_SLOTS * (_TILE_FIELDS * 4 + 16)
        if self.varlen_k and self.sort_groups:  # k-tile counts and the ranked order
            smem -= 2 * SORT_MAX_G * 4
        if self.stage_scales or self.group_blocks:  # group edges and first blocks (`scan_group_blocks`)
            smem -= 2 * (SORT_MAX_G + 1) * 4
        smem -= self.epi_scratch * dtype.width // 8  # the epilogue hooks' own shared memory
        # store slots: one for three-buffer epilogues at tile_n 256, else two, decide the A/B
        # stages; the room those stages leave then takes more slots, up to _MAX_EPI_SLOTS
        slots = epi_slots
        if slots is None:
            slots = 1 if self.num_out + self.num_in >= 3 and tile_n == 256 else 2
        in_bytes = buf_bytes * self.num_in * self.c_stages
        epi_bytes = buf_bytes * self.num_out * slots + in_bytes
        if epilogue_warps:  # no store or load buffers: the accumulator handed over in dtype, one chunk per step
            epi_bytes = buf_bytes * self.b_boxes * self.num_steps
        if ab_stages is None:
            ab_stages = (smem - epi_bytes) // stage_bytes
        if ab_stages * stage_bytes + epi_bytes > smem or ab_stages < 2:
            raise ValueError("tile configuration does not fit in shared memory")
        if epi_slots is None and self.num_out and not epilogue_warps:
            room = smem - ab_stages * stage_bytes - in_bytes
            slots = max(slots, min(_MAX_EPI_SLOTS, room // (buf_bytes * self.num_out)))
        self.epi_slots = slots
        self.ab_stages = ab_stages
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=1, num_threads=128 * self.num_mma_wg)

    # ------------------------------------------------------------------ host side (traced)
    def launch(self, mA, mW, mOffsets, outputs, inputs, epi_params, max_clusters, stream, scales=None, m_total=None):
        """Build the TMA atoms and launch; called from a subclass's ``@cute.jit __call__``.

        Varlen-M: mA (M, K); mW (G, N, K) or (G, K, N) per ``b_major``; outputs / inputs: tuples
        of row-major (M, cols) tensors, indexed by ``epi_stores`` / ``epi_loads``; scales (FP8
        operands): (mSFA (M, ceil(K/128)), mSFB (G, ceil(N/128), ceil(K/128))) float32
        dequantization multipliers of A's 1x128 and W's 128x128 blocks.
        Varlen-K: mA (N, tokens) and mW (K_out, tokens) token views (`_ragged_tokens`, or FP8's
        block-padded copies), outputs / inputs (N, K_out, G) views, scales (FP8) the (blocks, N)
        and (blocks, K_out) multipliers, m_total the rows the offsets index.
        epi_params: tuple handed to the epilogue hooks; max_clusters: Int32, the persistent grid in
        clusters.
        """
        dt = self.ab_dtype
        if const_expr(self.varlen_k):
            mB = mW
        else:
            m_total = cute.size(mA, mode=[0])
            n_mode, k_mode = (1, 2) if const_expr(self.b_major == "k") else (2, 1)
            n_box = cute.size(mW, mode=[n_mode]) // self.b_boxes
            # B as (N / b_boxes, K, b_boxes, G): forward GLU (N/2, K, 2, G), box h = 0 gate, 1 up
            mB = cute.make_tensor(
                mW.iterator,
                cute.make_layout(
                    (n_box, cute.size(mW, mode=[k_mode]), self.b_boxes, cute.size(mW, mode=[0])),
                    stride=(mW.stride[n_mode], mW.stride[k_mode], n_box * mW.stride[n_mode], mW.stride[0]),
                ),
            )
        n_box = cute.size(mB, mode=[0])
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            dt,
            dt,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            self.acc_dtype,
            (self.num_mma_wg, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        sA_layout = sm90_utils.make_smem_layout_a(self.a_layout, tile_mnk, dt, self.ab_stages)
        sB_layout = sm90_utils.make_smem_layout_b(self.b_layout, tile_mnk, dt, self.ab_stages)
        sD_layout = sm90_utils.make_smem_layout_epi(
            self.dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, max(self.num_out, 1) * self.epi_slots
        )
        sC_layout = sm90_utils.make_smem_layout_epi(
            self.dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, max(self.num_in, 1) * self.c_stages
        )
        g2s = cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
        tma_a, tma_mA = cute.nvgpu.cpasync.make_tiled_tma_atom(
            g2s, mA, cute.slice_(sA_layout, (None, None, 0)), (self.tile_m, self.tile_k)
        )
        sB_box_layout = sm90_utils.make_smem_layout_b(
            self.b_layout, (self.tile_m, self.box_n, self.tile_k), dt, 1
        )
        tma_b, tma_mB = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp() if const_expr(self.cluster_m > 1) else g2s,
            mB,
            cute.slice_(sB_box_layout, (None, None, 0)),
            (self.box_n, self.tile_k),
            num_multicast=self.cluster_m,
        )
        sAcc_layout = sm90_utils.make_smem_layout_epi(
            self.dtype, LayoutEnum.ROW_MAJOR, self.epi_tile, self.b_boxes * self.num_steps
        )
        sD_one = cute.slice_(sD_layout, (None, None, 0))
        store_tmas, load_tmas, epi_tensors = (), (), ((), ())
        if const_expr(self.epilogue_warps):  # global memory straight from the epilogue warps' registers
            epi_tensors = (outputs, inputs)
        else:
            store_tmas = tuple(
                cute.nvgpu.cpasync.make_tiled_tma_atom(
                    cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
                    t if const_expr(self.varlen_k) else _ragged_rows(t),
                    sD_one,
                    self.epi_tile,
                )
                for t in outputs
            )
            load_tmas = tuple(
                cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, t, cute.slice_(sC_layout, (None, None, 0)), self.epi_tile)
                for t in inputs
            )
        self.ab_bytes = cute.size_in_bytes(dt, cute.slice_(sA_layout, (None, None, 0))) + (
            cute.size_in_bytes(dt, cute.slice_(sB_layout, (None, None, 0)))
        )
        sSFA_layout, sSFB_layout = self._stage_scale_layouts()
        if const_expr(self.stage_scales):  # (tile, 1) boxes of each operand's multipliers, into the stage
            self.ab_bytes += (self.tile_m + self.tile_n) * 4
            scales = tuple(
                cute.nvgpu.cpasync.make_tiled_tma_atom(
                    g2s, _rows_by_block(t), cute.slice_(layout, (None, None, 0)), (cute.size(layout, mode=[0]), 1)
                )
                for t, layout in zip(scales, (sSFA_layout, sSFB_layout))
            )
        self.c_bytes = self.num_in * cute.size_in_bytes(self.dtype, cute.slice_(sC_layout, (None, None, 0)))

        sD_used = self.num_out > 0 and not self.epilogue_warps
        sC_used = self.num_in > 0 and not self.epilogue_warps
        sorted_groups = self.varlen_k and self.sort_groups

        @cute.struct
        class SharedStorage:
            ab_full_empty: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            c_full_empty: cute.struct.MemRange[cutlass.Int64, self.c_stages * 2]
            acc_full_empty: cute.struct.MemRange[cutlass.Int64, 2 if self.epilogue_warps else 0]
            tile_full_empty: cute.struct.MemRange[cutlass.Int64, 2 * _TILE_SLOTS]
            tiles: cute.struct.MemRange[Int32, _TILE_FIELDS * _TILE_SLOTS]
            sched: cute.struct.MemRange[Int32, 2 * SORT_MAX_G if sorted_groups else 0]
            edges: cute.struct.MemRange[Int32, 2 * (SORT_MAX_G + 1) if self.stage_scales or self.group_blocks else 0]
            scratch: cute.struct.Align[cute.struct.MemRange[self.dtype, self.epi_scratch], 128]
            sSFA: cute.struct.Align[
                cute.struct.MemRange[Float32, cute.cosize(sSFA_layout) if self.stage_scales else 0], 128
            ]
            sSFB: cute.struct.Align[
                cute.struct.MemRange[Float32, cute.cosize(sSFB_layout) if self.stage_scales else 0], 128
            ]
            sA: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sA_layout)], 1024]
            sB: cute.struct.Align[cute.struct.MemRange[dt, cute.cosize(sB_layout)], 1024]
            sD: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sD_layout) if sD_used else 0], 1024]
            sC: cute.struct.Align[cute.struct.MemRange[self.dtype, cute.cosize(sC_layout) if sC_used else 0], 1024]
            sAcc: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(sAcc_layout) if self.epilogue_warps else 0], 1024
            ]

        self.shared_storage = SharedStorage

        n_tiles = (n_box + self.box_n - 1) // self.box_n
        rows = self.tile_m * self.cluster_m
        if const_expr(self.varlen_k):  # every group's (N, K_out) tiles
            max_tiles = cute.size(outputs[0], mode=[2]) * ((cute.size(mA, mode=[0]) + rows - 1) // rows) * n_tiles
        else:  # upper bound on the number of cluster tiles (shape-only): no idle CTAs on small problems
            max_tiles = ((m_total + rows - 1) // rows + cute.size(mW, mode=[0]) + 1) * n_tiles
        grid_x = cutlass.min(max_tiles, max_clusters) * self.cluster_m
        self.kernel(
            tma_a,
            tma_mA,
            tma_b,
            tma_mB,
            store_tmas,
            load_tmas,
            epi_tensors,
            mOffsets,
            m_total,
            epi_params,
            scales,
            tiled_mma,
            sA_layout,
            sB_layout,
            sD_layout,
            sC_layout,
            sAcc_layout,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster_m, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _stage_scale_layouts(self):
        """Varlen-K FP8: shared-memory layouts of the per-stage multipliers, (tile_m, 1, stages) of
        A's rows and (tile_n, 1, stages) of B's."""
        return tuple(
            cute.make_layout((rows, 1, self.ab_stages), stride=(1, 0, rows)) for rows in (self.tile_m, self.tile_n)
        )

    # ------------------------------------------------------------------ epilogue hooks
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

    # ------------------------------------------------------------------ device side
    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        store_tmas: tuple,
        load_tmas: tuple,
        epi_tensors: tuple,
        mOffsets: cute.Tensor,
        m_total: Int32,
        epi_params: tuple,
        scales,
        tiled_mma: cute.TiledMma,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sD_layout: cute.ComposedLayout,
        sC_layout: cute.ComposedLayout,
        sAcc_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        wg_idx = cute.arch.make_warp_uniform(tidx // 128)
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        # the scheduler hands out cluster tiles; `cluster_tile` gives CTA `rank` its m- and n-tile
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        first_tile = bidx // self.cluster_m
        num_clusters = gdim // self.cluster_m
        b_mcast_mask = cutlass.Int16((1 << self.cluster_m) - 1)

        if warp_idx == 0:
            cute.nvgpu.cpasync.prefetch_descriptor(tma_a)
            cute.nvgpu.cpasync.prefetch_descriptor(tma_b)
            for atom, _ in store_tmas + load_tmas:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)
            if const_expr(self.stage_scales):
                for atom, _ in scales:
                    cute.nvgpu.cpasync.prefetch_descriptor(atom)

        n_box = cute.size(mB, mode=[0])  # N / b_boxes; varlen-K: K_out
        n_tiles = (n_box + self.box_n - 1) // self.box_n
        half_chunks = n_box // self.epi_n  # chunk offset of half 1 in a [gate, up] tensor
        k_tiles = (cute.size(mA, mode=[1]) + self.tile_k - 1) // self.tile_k  # varlen-M
        if const_expr(self.varlen_k):
            num_groups = cute.size(store_tmas[0][1], mode=[2])
        else:
            num_groups = cute.size(mB, mode=[3])

        smem = cutlass.memory.SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_full_empty.data_ptr(),
            num_stages=self.ab_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_mma_wg * 4 * self.cluster_m
            ),
            tx_count=self.ab_bytes,
            cta_layout_vmnk=cute.make_layout((1, self.cluster_m, 1, 1)),
            defer_sync=True,
        )
        c_pipe = None
        if const_expr(self.num_in > 0 and not self.epilogue_warps):
            # CTA-local: the first consumer warp loads, every consumer warp's lane 0 releases
            c_pipe = pipeline.PipelineTmaAsync.create(
                barrier_storage=storage.c_full_empty.data_ptr(),
                num_stages=self.c_stages,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.num_mma_wg * 4),
                tx_count=self.c_bytes,
                defer_sync=True,
            )
        acc_pipe = None
        if const_expr(self.epilogue_warps):  # MMA warpgroups -> epilogue warps, one accumulator buffer
            acc_pipe = pipeline.PipelineAsync.create(
                barrier_storage=storage.acc_full_empty.data_ptr(),
                num_stages=1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.num_mma_wg),
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32 * self.hook_warps),
                defer_sync=True,
            )
        # producer warp -> MMA warpgroups: where each tile sits (`_publish_tile`), so that no
        # schedule search sits between their tiles (the epilogue warps, off that path, search)
        tile_pipe = pipeline.PipelineAsync.create(
            barrier_storage=storage.tile_full_empty.data_ptr(),
            num_stages=_TILE_SLOTS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.num_mma_wg),
            defer_sync=True,
        )
        sTiles = storage.tiles.get_tensor(cute.make_layout((_TILE_FIELDS, _TILE_SLOTS)))
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)

        sA = storage.sA.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.sB.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sD = None
        sC = None
        sAcc = None
        if const_expr(self.epilogue_warps):
            sAcc = storage.sAcc.get_tensor(sAcc_layout.outer, swizzle=sAcc_layout.inner)
        else:
            if const_expr(self.num_out > 0):
                sD = storage.sD.get_tensor(sD_layout.outer, swizzle=sD_layout.inner)
            if const_expr(self.num_in > 0):
                sC = storage.sC.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)
        # ((box_n, tile_k), b_boxes, 1, stages): box h fills rows [h * box_n, (h+1) * box_n)
        sB_boxes = cute.group_modes(cute.flat_divide(sB, (self.box_n, self.tile_k)), 0, 2)
        sSFA, sSFB = None, None
        if const_expr(self.stage_scales):
            sSFA_layout, sSFB_layout = self._stage_scale_layouts()
            sSFA = storage.sSFA.get_tensor(sSFA_layout)
            sSFB = storage.sSFB.get_tensor(sSFB_layout)

        pipeline.pipeline_init_wait(cluster_shape_mn=(self.cluster_m, 1))
        sched = self._schedule(storage, mOffsets, num_groups, m_total, n_tiles, cute.size(mA, mode=[0]), tidx,
                               warp_idx)
        epi_shared = (
            storage.scratch.get_tensor(cute.make_layout(self.epi_scratch)) if const_expr(self.epi_scratch) else None,
            storage.edges.get_tensor(cute.make_layout(2 * (SORT_MAX_G + 1))) if const_expr(self.group_blocks) else None,
        )

        if wg_idx == 0:
            # ---------------------------------------------------------- TMA producer
            if const_expr(not self.epilogue_warps):
                cute.arch.setmaxregister_decrease(40)
            if warp_idx == 0:
                state = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.ab_stages
                )
                tile_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, _TILE_SLOTS)
                tile_id = first_tile
                found, seg, seg_first, c_start, c_base = self._locate(tile_id, Int32(0), Int32(0), sched)
                while found:
                    tile, has_rows, split, block0 = self._tile(tile_id, seg, seg_first, rank, sched)
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
                                self._group_view(mA, start, length, block0), (self.tile_m, self.tile_k), (mt, None)
                            )
                            gB = cute.local_tile(
                                self._group_view(mB, start, length, block0), (self.box_n, self.tile_k), (nt, None)
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
                        for k in range(tile_k_tiles):
                            ab_pipe.producer_acquire(state)
                            bar = ab_pipe.producer_get_barrier(state)
                            cute.copy(tma_a, tAgA[(None, k)], tAsA[(None, state.index)], tma_bar_ptr=bar)
                            for h in cutlass.range_constexpr(self.b_boxes):
                                if split:
                                    for sB_r, gB_r in slices:
                                        cute.copy(
                                            tma_b, gB_r[(None, k, h)], sB_r[(None, h, 0, state.index)],
                                            tma_bar_ptr=bar, mcast_mask=own_mask,
                                        )
                                else:
                                    cute.copy(
                                        tma_b,
                                        tBgB[(None, k) if const_expr(self.varlen_k) else (None, k, h)],
                                        tBsB[(None, h, 0, state.index)],
                                        tma_bar_ptr=bar,
                                        mcast_mask=b_mcast_mask if const_expr(self.cluster_m > 1) else 0,
                                    )
                            for (atom, _), (tSFs, tSFg) in zip(scales if const_expr(self.stage_scales) else (),
                                                                scale_parts):
                                cute.copy(atom, tSFg[(None, block0 + k)], tSFs[(None, state.index)], tma_bar_ptr=bar)
                            ab_pipe.producer_commit(state)
                            state.advance()
                    tile_id = tile_id + num_clusters
                    found, seg, seg_first, c_start, c_base = self._locate(tile_id, c_start, c_base, sched)
                tile_pipe.producer_acquire(tile_write)
                if cute.arch.lane_idx() == 0:
                    sTiles[0, tile_write.index] = Int32(0)  # the end of the schedule
                tile_pipe.producer_commit(tile_write)
                ab_pipe.producer_tail(state)
            elif const_expr(self.epilogue_warps):
                # ------------------------------------------------------ epilogue warps
                self._run_epilogue_warps(
                    acc_pipe, sAcc, epi_tensors, epi_params, first_tile, num_clusters, rank, sched, n_box,
                )
        else:
            # ---------------------------------------------------------- MMA (+ epilogue)
            if const_expr(not self.epilogue_warps):
                cute.arch.setmaxregister_increase(232)
            mma_tidx = tidx - 128
            thr_mma = tiled_mma.get_slice(mma_tidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc_shape = thr_mma.partition_shape_C((self.tile_m, self.tile_n))
            acc = cute.make_rmem_tensor(acc_shape, self.acc_dtype)
            fp8_args = None  # FP8: one scale block's product (before promotion into acc), its scales
            if const_expr(self.block_scaled):
                tCcAcc = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
                block_scales = (sSFA, sSFB) if const_expr(self.stage_scales) else scales
                fp8_args = (cute.make_rmem_tensor(acc_shape, self.acc_dtype), tCrA, tCrB, block_scales, tCcAcc)

            # register -> smem copies in the accumulator's thread-value layout (stmatrix: 16-bit)
            copy_atom_c = cute.make_tiled_copy_C_atom(
                cute.make_copy_atom(
                    cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4),
                    self.dtype if const_expr(self.dtype.width == 16) else cutlass.Float16,
                ),
                tiled_mma,
            )
            tiled_copy_r2s = cute.make_tiled_copy_S(
                sm90_utils.get_smem_store_op(LayoutEnum.ROW_MAJOR, self.dtype, self.acc_dtype),
                copy_atom_c,
            )
            thr_copy_r2s = tiled_copy_r2s.get_slice(mma_tidx)
            tRS_sD = None
            if const_expr(self.epilogue_warps):
                tRS_sD = thr_copy_r2s.partition_D(sAcc)  # (R2S, R2S_M, R2S_N, chunk)
            elif const_expr(self.num_out > 0):
                tRS_sD = thr_copy_r2s.partition_D(sD)  # (R2S, R2S_M, R2S_N, buf)
            tRS_rAcc = tiled_copy_r2s.retile(acc)
            # coordinates (row, col in the chunk) of each register value
            tRS_cD = thr_copy_r2s.partition_S(cute.make_identity_tensor(self.epi_tile))
            rD_shape = cute.shape(tRS_cD)
            frag = cute.size(rD_shape)
            rAcc = [cute.make_rmem_tensor(rD_shape, self.acc_dtype) for _ in range(self.b_boxes)]
            rOut = [cute.make_rmem_tensor(rD_shape, self.acc_dtype) for _ in range(self.num_out)]
            rStore = cute.make_rmem_tensor(rD_shape, self.dtype)
            rIn = [cute.make_rmem_tensor(rD_shape, self.dtype) for _ in range(self.num_in)]
            tiled_copy_s2r = None
            tSR_sC = None
            tSR_rIn = None
            c_write = None
            c_read = None
            if const_expr(self.num_in > 0 and not self.epilogue_warps):
                if const_expr(self.dtype.width == 16):  # ldmatrix
                    tiled_copy_s2r = cute.make_tiled_copy_S(
                        cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), self.dtype),
                        copy_atom_c,
                    )
                    thr_copy_s2r = tiled_copy_s2r.get_slice(mma_tidx)
                    tSR_sC = thr_copy_s2r.partition_S(sC)
                    tSR_rIn = [thr_copy_s2r.retile(r) for r in rIn]
                else:  # 32-bit inputs: plain loads in the store's thread-value layout
                    tSR_sC = thr_copy_r2s.partition_D(sC)
                c_write = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Producer, self.c_stages
                )
                c_read = pipeline.make_pipeline_state(
                    pipeline.PipelineUserType.Consumer, self.c_stages
                )
            state = self.epi_make_state(tiled_copy_r2s, self.epi_tile, epi_shared)
            # defer_stores: the previous tile's output chunks in dtype, and where they go
            # (valid, seg, start, length, mt, nt, has_rows)
            pending = None
            pending_tile = None
            if const_expr(self.defer_stores):
                pending = [cute.make_rmem_tensor(rD_shape, self.dtype) for _ in range(self.num_steps)]
                pending_tile = cute.make_rmem_tensor((7,), Int32)
                pending_tile[0] = Int32(0)

            store_pipe = None
            acc_write = None
            if const_expr(self.epilogue_warps):
                acc_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
            if const_expr(self.num_out > 0 and not self.epilogue_warps):
                store_pipe = pipeline.PipelineTmaStore.create(
                    num_stages=self.epi_slots,
                    producer_group=pipeline.CooperativeGroup(
                        pipeline.Agent.Thread, 128 * self.num_mma_wg
                    ),
                )
            is_store_warp = warp_idx == 4
            store_args = (tiled_copy_r2s, tRS_sD, sD, store_tmas, store_pipe, is_store_warp)
            read_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages
            )
            release_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.ab_stages
            )
            # the first k-tiles are issued outside the k-loop: with defer_stores num_steps, each
            # followed by one chunk store of the previous tile; else one (16-bit: it starts the
            # WGMMA chain) or none (FP8: every block is alike)
            peeled = self.num_steps if const_expr(self.defer_stores) else 0 if const_expr(self.block_scaled) else 1
            epi_count = Int32(0)
            tile_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, _TILE_SLOTS)
            tile_pipe.consumer_wait(tile_read)
            found = sTiles[0, tile_read.index] != 0
            while found:
                tile, has_rows = self._read_tile(sTiles, tile_read.index, num_groups)
                tile_pipe.consumer_release(tile_read)
                tile_read.advance()
                start, mt, nt, is_group = tile.start, tile.mt, tile.nt, tile.is_group
                tile_k_tiles = k_tiles if is_group else 0
                if const_expr(self.varlen_k):
                    tile_k_tiles = (tile.end - start + self.tile_k - 1) // self.tile_k

                # C-tile loads of the first steps run under the mainloop (padding tiles: none,
                # their inputs read as zeros)
                bGS_sC = None
                bGS_gC = None
                if const_expr(self.num_in > 0 and not self.epilogue_warps):
                    bGS_sC, bGS_gC = self._partition_loads(load_tmas, sC, tile)
                    if is_group and is_store_warp:
                        for step in cutlass.range_constexpr(min(self.c_stages, self.num_steps)):
                            self._load_c(load_tmas, c_pipe, c_write, bGS_sC, bGS_gC, mt,
                                         nt * self.num_steps + step, half_chunks)
                            c_write.advance()

                # ------------------------------------------------------ mainloop
                # FP8: each block's WGMMAs, then its promotion (`_fp8_k_tile`). A k-tile count of 0
                # (padding tiles, empty groups) leaves acc at zero; the accumulate flag changes
                # inside the loops and stays loop-carried
                acc.fill(0.0)
                multipliers = Float32(0.0)
                if const_expr(self.block_scaled and not self.stage_scales):
                    multipliers = self._block_scales(scales, tile, fp8_args[4], 0, n_box, m_total)
                # varlen-M: one branch around the whole mainloop (k-tiles or none); defer_stores: the
                # previous tile's stores run whatever this tile's k-tile count
                runs = Boolean(True) if const_expr(self.defer_stores) else tile_k_tiles > 0
                if runs:
                    for step in cutlass.range_constexpr(peeled):
                        if step < tile_k_tiles:
                            if const_expr(self.block_scaled):
                                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                                multipliers = self._fp8_k_tile(ab_pipe, read_state, tiled_mma, acc, fp8_args, tile,
                                                               step, multipliers, n_box, m_total)
                                read_state.advance()
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
                        if const_expr(self.defer_stores):
                            if pending_tile[0] != 0:
                                self._store_chunk(store_args, pending[step], pending_tile, step, epi_count)
                                epi_count = epi_count + 1
                    for k in range(peeled, tile_k_tiles):
                        if const_expr(self.block_scaled):
                            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                            multipliers = self._fp8_k_tile(ab_pipe, read_state, tiled_mma, acc, fp8_args, tile, k,
                                                           multipliers, n_box, m_total)
                            read_state.advance()
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
                        if tile_k_tiles > 0:
                            ab_pipe.consumer_release(release_state)
                            release_state.advance()

                # ------------------------------------------------------ epilogue
                if const_expr(self.epilogue_warps):
                    # hand the accumulator over in dtype (the epilogue warpgroup waits on the padding
                    # segment for nothing, and a tile without rows has no epilogue)
                    if is_group and has_rows:
                        acc_pipe.producer_acquire(acc_write)
                        for sub in cutlass.range_constexpr(self.b_boxes * self.num_steps):
                            for v in cutlass.range_constexpr(frag):
                                rStore[v] = tRS_rAcc[sub * frag + v].to(self.dtype)
                            cute.copy(tiled_copy_r2s, rStore, tRS_sD[(None, None, None, sub)])
                        acc_pipe.producer_commit(acc_write)
                        acc_write.advance()
                elif const_expr(self.defer_stores):  # outputs wait for the next tile's k-tiles
                    self.epi_begin_tile(epi_params, tile, n_box, tRS_rAcc, tRS_cD, state)
                    for step in cutlass.range_constexpr(self.num_steps):
                        for v in cutlass.range_constexpr(frag):
                            rAcc[0][v] = tRS_rAcc[step * frag + v]
                        self.epi_visit(epi_params, tile, step, nt * self.num_steps + step, n_box, rAcc, rIn, rOut,
                                       tRS_cD, state)
                        pending[step].store(rOut[0].load().to(self.dtype))
                    self.epi_end_tile(epi_params, tile, n_box, tRS_cD, state)
                    for i, value in enumerate((1, tile.seg, start, tile.end - start, mt, nt, Int32(has_rows))):
                        pending_tile[i] = Int32(value)
                else:
                    bSG_sD = None
                    bSG_gD = []
                    for atom_and_view in store_tmas:
                        bSG_sD, bSG_g = self._partition_store(atom_and_view, sD, tile.seg, start, tile.end - start)
                        bSG_gD.append(bSG_g)
                    self.epi_begin_tile(epi_params, tile, n_box, tRS_rAcc, tRS_cD, state)

                    for step in cutlass.range_constexpr(self.num_steps):
                        chunk = nt * self.num_steps + step  # 32-column chunk (of each half)
                        # forward GLU: sub-tile `step` is gate (j = 0), `step + num_steps` up (j = 1)
                        for j in cutlass.range_constexpr(self.b_boxes):
                            sub = step + j * self.num_steps
                            for v in cutlass.range_constexpr(frag):
                                rAcc[j][v] = tRS_rAcc[sub * frag + v]
                        if const_expr(self.num_in > 0):
                            if is_group:
                                c_pipe.consumer_wait(c_read)
                                for i in cutlass.range_constexpr(self.num_in):
                                    sC_i = tSR_sC[(None, None, None, c_read.index * self.num_in + i)]
                                    if const_expr(self.dtype.width == 16):
                                        cute.copy(tiled_copy_s2r, sC_i, tSR_rIn[i])
                                    else:
                                        rIn[i].store(sC_i.load())
                                c_pipe.consumer_release(c_read)
                                c_read.advance()
                            else:
                                for i in cutlass.range_constexpr(self.num_in):
                                    rIn[i].fill(0.0)
                        self.epi_visit(epi_params, tile, step, chunk, n_box, rAcc, rIn, rOut, tRS_cD, state)
                        slot = epi_count % self.epi_slots
                        if const_expr(self.num_out > 0):  # else the subclass stored from registers
                            for o in cutlass.range_constexpr(self.num_out):
                                rStore.store(rOut[o].load().to(self.dtype))
                                cute.copy(
                                    tiled_copy_r2s,
                                    rStore,
                                    tRS_sD[(None, None, None, slot * self.num_out + o)],
                                )
                            cute.arch.fence_proxy("async.shared", space="cta")
                            self.epi_barrier.arrive_and_wait()
                        if const_expr(self.num_in > 0 and step + self.c_stages < self.num_steps):
                            if is_group and is_store_warp:
                                self._load_c(load_tmas, c_pipe, c_write, bGS_sC, bGS_gC, mt,
                                             chunk + self.c_stages, half_chunks)
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
                            self.epi_barrier.arrive_and_wait()
                            epi_count = epi_count + 1
                    self.epi_end_tile(epi_params, tile, n_box, tRS_cD, state)

                tile_pipe.consumer_wait(tile_read)
                found = sTiles[0, tile_read.index] != 0
            if const_expr(self.defer_stores):
                if pending_tile[0] != 0:
                    for step in cutlass.range_constexpr(self.num_steps):
                        self._store_chunk(store_args, pending[step], pending_tile, step, epi_count)
                        epi_count = epi_count + 1
            if const_expr(self.epilogue_warps):
                acc_pipe.producer_tail(acc_write)
            else:
                self.epi_end_kernel(epi_params, mma_tidx // 32, state)
                if const_expr(self.num_out > 0):
                    if is_store_warp:
                        store_pipe.producer_tail()

    # ------------------------------------------------------------------ schedules
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
        seg, start, end, mt, nt, row0, has_rows = (sTiles[i, index] for i in range(1, _TILE_FIELDS))
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

    def _group_view(self, mTokens, start, length, block0):
        """Varlen-K: TMA coordinate view of one group's tokens: FP8, (rows, tokens) of the
        block-padded copy from the group's first block ``block0``; 16-bit, the ragged view clipped
        at its last token."""
        if const_expr(self.stage_scales):
            return cute.domain_offset((0, block0 * self.tile_k), mTokens)
        return _group_tokens(mTokens, start, length)

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

    # ------------------------------------------------------------------ epilogue pieces
    def _partition_store(self, atom_and_view, sD, seg, start, length):
        """TMA partitions (smem buffers, gmem chunks (mt, chunk)) of one output for a tile of segment
        ``seg`` (rows [start, start + length)): the ragged rows of the segment; varlen-K, group seg's
        (N, K_out) slice."""
        atom, mD = atom_and_view
        if const_expr(self.varlen_k):
            view = mD[(None, None, seg)]
        else:
            view = _segment_view(mD, start, length)
        gD = cute.local_tile(view, self.epi_tile, (None, None))
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
        vec = _EPI_VEC
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
            tile_id = tile_id + num_clusters
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
        vec = _EPI_VEC
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
        return cute.group_modes(cute.local_tile(mT, (1, _EPI_VEC), (row, col_vec)), 0, 2)

    def _partition_loads(self, load_tmas, sC, tile: Tile):
        """TMA partitions (smem buffers, gmem chunks (mt, chunk)) of the C-tile inputs for a tile: its
        segment's rows; varlen-K, group seg's (N, K_out) slice."""
        bGS_sC = None
        bGS_gC = []
        for atom, mC in load_tmas:
            view = mC[(None, None, tile.seg)] if const_expr(self.varlen_k) else cute.domain_offset((tile.start, None), mC)
            gC = cute.local_tile(view, self.epi_tile, (None, None))
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
        rows = (mSFA[cutlass.min(row0, m_total - 1), k], mSFA[cutlass.min(row0 + 8, m_total - 1), k])
        boxes = []
        for h in cutlass.range_constexpr(self.b_boxes):
            first_row = h * n_box + tile.nt * self.box_n
            block = first_row // 128
            first = mSFB[seg, block, k]
            second, split = first, Int32(0)
            if const_expr(self.box_may_split):
                second = mSFB[seg, cutlass.min(block + 1, last_block), k]
                split = (128 - first_row % 128) // 8
            boxes.append((first, second, split))
        return rows, tuple(boxes)

    @cute.jit
    def _promote(self, acc, acc_block, multipliers):
        """acc += acc_block scaled per (row, W block) (`_block_scales` gives the multipliers)."""
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
            if const_expr(self.box_may_split):
                scale = Float32(cutlass.select_(j % cols_per_box < boxes[h][2], first[r][h], second[r][h]))
            acc[v] = acc[v] + acc_block[v] * scale

    @cute.jit
    def _fp8_k_tile(self, ab_pipe, read_state, tiled_mma, acc, fp8_args, tile: Tile, k, held, n_box, m_total):
        """FP8: acc += the product of the k-tile in ``read_state``'s stage (one scale block; the caller
        has turned ACCUMULATE off) scaled by its multipliers, and release the stage. Varlen-M: ``held``
        are this block's multipliers (`_block_scales`), the next block's are loaded under the WGMMAs
        and returned; varlen-K: they ride in the stage (`_stage_multipliers`), ``held`` is returned."""
        acc_block, tCrA, tCrB, scales, tCcAcc = fp8_args
        ab_pipe.consumer_wait(read_state)
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
            self._promote(acc, acc_block, held)
        return ahead

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
    def _promote_columns(self, acc, acc_block, multipliers):
        """acc += acc_block scaled per (row, column) (`_stage_multipliers`)."""
        rows, cols = multipliers
        for v in cutlass.range_constexpr(cute.size(acc)):
            acc[v] = acc[v] + acc_block[v] * (rows[v // 2 % 2] * cols[v // 4 * 2 + v % 2])


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
        for j in cutlass.range_constexpr(16):
            value = rValues[j].to(Float32)
            magnitude = cutlass.max(value, -value)
            if magnitude < Float32(float("inf")):  # NaN, Inf count as 0
                amax = cutlass.max(amax, magnitude)
    amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, offset=1))
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
def _row_value(mVec: cute.Tensor, row: Int32, tile: Tile, m_total: Int32) -> Float32:
    """mVec[row] of a (M,) float32 tensor inside a group's tile, 0 elsewhere (padding rows)."""
    value = Float32(0.0)
    if tile.is_group:
        value = mVec[cutlass.min(row, m_total - 1)]
    return value


class GroupedGemmActSm90(GroupedGemmSm90):
    """pre = A_g @ B[g] (+ bias[g]), act = activation(pre) (see the module docstring).

    ``activation``: None or a name of ``activations.ACTIVATIONS``; ``has_bias``. Outputs: pre
    (M, N) (GLU: [gate, up], B rows natural [gate; up] for "k", columns for "mn"), act (M, N/2)
    for GLU, (M, N) for srelu; bias (G, N); probs (M,) float32 when the activation takes probs.

    ``act_amax`` (fp8_current's scale from the producing epilogue): also mActAmax (P,) float32,
    P >= the CTAs x 8: consumer warp w of CTA b writes the max |act| (as stored, finite values,
    rows of the groups only) it saw at [b * 8 + w] and zeros at the further indices of its
    stride; max(mActAmax) is the act's amax.
    """

    stores_act = True  # False: a subclass writes the activation itself
    stores_pre = True  # False (no activation only): a subclass writes the output itself

    def __init__(self, dtype, tile_n, activation, has_bias, b_major="k", cluster_m=2, act_amax=False, **opts):
        self.spec = activation_spec(activation, "GroupedGemmActSm90")
        if act_amax and self.spec is None:
            raise ValueError("act_amax needs an activation")
        self.act_amax = act_amax
        self.has_bias = has_bias
        glu = self.spec is not None and self.spec.glu
        self.b_boxes = 2 if glu else 1
        # output buffers: GLU (gate, up) -> pre, act -> act; srelu pre, act; none pre
        if self.spec is None:
            self.epi_stores = ((0, 0),) if self.stores_pre else ()
        elif glu:
            self.epi_stores = ((0, 0), (0, 1), (1, 0)) if self.stores_act else ((0, 0), (0, 1))
        else:
            self.epi_stores = ((0, 0), (1, 0))
        super().__init__(dtype, tile_n, b_major, cluster_m, **opts)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (M, K)
        mW: cute.Tensor,  # (G, N, K) "k" / (G, K, N) "mn"
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mPre: cute.Tensor,  # (M, N)
        mAct: cute.Tensor,  # (M, N/2) GLU, (M, N) srelu, None
        mBias: cute.Tensor,  # (G, N) or None
        mProbs: cute.Tensor,  # (M,) float32 or None
        mActAmax: cute.Tensor,  # (P,) float32 with act_amax, else None
        limit: Float32,
        alpha: Float32,
        max_clusters: Int32,
        stream,
    ):
        self._launch_forward(mX, mW, mOffsets, mPre, mAct, mBias, mProbs, mActAmax, limit, alpha, max_clusters,
                             stream)

    @cute.jit
    def _launch_forward(
        self, mX, mW, mOffsets, mPre, mAct, mBias, mProbs, mActAmax, limit, alpha, max_clusters, stream, scales=None
    ):
        outputs = (mPre,) if const_expr(self.spec is None) else (mPre, mAct)
        m_total = cute.size(mX, mode=[0])
        self.launch(mX, mW, mOffsets, outputs, (), (mBias, mProbs, limit, alpha, m_total, mActAmax),
                    max_clusters, stream, scales)

    def epi_make_state(self, tiled_copy, epi_tile, shared):
        """With act_amax: the thread's running max |act|, over all its tiles."""
        return make_amax_state() if self.act_amax else None

    @cute.jit
    def epi_visit(self, params, tile: Tile, step, chunk, n_box, rAcc, rIn, rOut, tRS_cD, state):
        for v in cutlass.range_constexpr(cute.size(rAcc[0])):
            act = self._pre_act(params, tile, chunk, n_box, rAcc, rOut, tRS_cD, v)
            if const_expr(self.act_amax):  # the amax of what the cast will read
                track_amax(state, act, self.dtype, tile, tile.row0 + tRS_cD[v][0],
                           chunk * self.epi_n + tRS_cD[v][1], n_box)

    @cute.jit
    def epi_end_kernel(self, params, consumer_warp, state):
        if const_expr(self.act_amax):
            write_amax_parts(params[5], state, consumer_warp, self.hook_warps)

    @cute.jit
    def _pre(self, params, tile: Tile, chunk, n_box, rAcc, rOut, tRS_cD, v):
        """rOut[j][v] = pre of B box j (acc + bias) for value v of the chunk."""
        mBias = params[0]
        g_safe = tile.seg
        if const_expr(self.has_bias):
            g_safe = cutlass.min(tile.seg, cute.size(mBias, mode=[0]) - 1)
        for j in cutlass.range_constexpr(self.b_boxes):
            x = rAcc[j][v]
            if const_expr(self.has_bias):
                col = chunk * self.epi_n + tRS_cD[v][1]
                b = Float32(0.0)
                if tile.is_group and col < n_box:
                    b = mBias[g_safe, j * n_box + col].to(Float32)
                x = x + b
            rOut[j][v] = x

    @cute.jit
    def _pre_act(self, params, tile: Tile, chunk, n_box, rAcc, rOut, tRS_cD, v):
        """Value v of the chunk: rOut[j][v] = pre of B box j (acc + bias); returns the activation
        (times probs), also written to rOut[-1][v] when this class stores it; None without one."""
        _, mProbs, limit, alpha, m_total = params[:5]
        self._pre(params, tile, chunk, n_box, rAcc, rOut, tRS_cD, v)
        value = None
        if const_expr(self.spec is not None):
            up = rOut[1][v] if const_expr(self.spec.glu) else None
            value, _, _ = ACTIVATION_MATH[self.spec.name](rOut[0][v], up, limit, alpha)
            if const_expr(self.spec.takes_probs):
                value = value * _row_value(mProbs, tile.row0 + tRS_cD[v][0], tile, m_total)
            if const_expr(self.stores_act):
                rOut[self.num_out - 1][v] = value
        return value


class GroupedGemmActQuantSm90(GroupedGemmActSm90):
    """`GroupedGemmActSm90` whose cast output, the GLU activation or, without an activation, the
    GEMM output itself, leaves as E4M3 in 1 x 128 blocks ("fp8_blockwise") instead of bf16:
    data (M, C) float8_e4m3fn and scale_inv (M, ceil(C / 128)) float32 (C = I = N/2 for GLU, N
    without an activation), bit for bit the torch quantizer (``Float8BlockScaling(
    power_2_scales)``) applied to what `GroupedGemmActSm90` writes (its bf16 rounding included).
    GLU: pre (M, 2I) as before, tile_n 256 (a tile's 128 act columns are one block of each of its
    rows). Without an activation nothing else is written; tile_n 128 or 256 (one or two blocks).

    Before the steps, a pass over the whole accumulator computes each value as stored and takes
    each row's amax per block (a quad holds a row; two shuffles); GLU keeps the act in registers
    (dtype, 64 values per thread), the plain output is recomputed from the accumulator. Each step
    then scales its chunk (`e4m3_scaled`: a reciprocal multiplication with an exact-residual
    correction, or two exact multiplications with power-of-two scales) and stores the E4M3 bytes
    straight from registers, one 8-byte store per row and quad lane after `quad_gather` (rows of
    the tile's group only).

    ``columns`` (`Transpose` after the cast): also the per-group column-wise copy the next
    GroupedLinear's FP8 weight gradient reads (`BlockColumns`: data (C, 128 * blocks), group g's
    128-row block j at columns 128 (first_block[g] + j), scale_inv (blocks, C)), cast from the
    same stored values: each step stages its chunk transposed in shared memory, and after a
    block's last step `store_staged_columns` casts the block's 128 columns (a varlen-M tile's 128
    rows are one column block of its group). Needs C % 128 == 0 and G <= 512 (the groups' first
    blocks scanned into shared memory).
    """

    stores_act = False

    def __init__(self, dtype, activation, has_bias, b_major="k", cluster_m=2, power_2_scales=False, tile_n=256,
                 columns=False, **opts):
        spec = activation_spec(activation, "GroupedGemmActQuantSm90")
        if spec is not None and (not spec.glu or tile_n != 256):
            raise ValueError("GroupedGemmActQuantSm90 casts a GLU activation (tile_n 256) or the plain output")
        self.power_2_scales = power_2_scales
        self.columns = columns
        if columns:
            self.group_blocks = True
            self.epi_scratch = COLUMN_SCRATCH
        self.stores_pre = spec is not None
        super().__init__(dtype, tile_n, activation, has_bias, b_major, cluster_m, **opts)
        self.blocks = self.box_n // 128  # cast blocks per row of a tile
        self.block_steps = 128 // self.epi_n

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (M, K)
        mW: cute.Tensor,  # (G, N, K) "k" / (G, K, N) "mn"
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mPre: cute.Tensor,  # (M, N) GLU, else None
        mData: cute.Tensor,  # (M, C) float8_e4m3fn
        mScale: cute.Tensor,  # (M, ceil(C/128)) float32
        mColData: cute.Tensor,  # (C, 128 * blocks) float8_e4m3fn with columns, else None
        mColScale: cute.Tensor,  # (blocks, C) float32 with columns, else None
        mBias: cute.Tensor,  # (G, N) or None
        mProbs: cute.Tensor,  # (M,) float32 or None
        limit: Float32,
        alpha: Float32,
        max_clusters: Int32,
        stream,
    ):
        m_total = cute.size(mX, mode=[0])
        outputs = (mPre,) if const_expr(self.stores_pre) else ()
        self.launch(mX, mW, mOffsets, outputs, (),
                    (mBias, mProbs, limit, alpha, m_total, None, mData, mScale, mColData, mColScale),
                    max_clusters, stream)

    def epi_make_state(self, tiled_copy, epi_tile, shared):
        """(per block and row slot: scale_inv and the two multipliers of `e4m3_scale_inv`; GLU: the
        tile's act as stored, step-major, else None; fp32 and E4M3 scratch of one chunk; with
        ``columns`` the transposed staging tile and the groups' first blocks (shared))."""
        self.row_slot, self.slot_value = fragment_row_slots(tiled_copy, epi_tile)
        self.quad_pairs = quad_column_groups(tiled_copy, epi_tile, self.row_slot)
        frag, slots = len(self.row_slot), len(self.slot_value)
        return (
            [cute.make_rmem_tensor((self.blocks * slots,), Float32) for _ in range(3)],
            cute.make_rmem_tensor((self.num_steps * frag,), self.dtype) if self.spec is not None else None,
            cute.make_rmem_tensor((frag,), Float32),
            cute.make_rmem_tensor((frag,), cutlass.Float8E4M3FN),
            *shared,
        )

    @cute.jit
    def _stored(self, params, tile: Tile, chunk, n_box, rAcc, rPre, tRS_cD, v):
        """Value v of the chunk as `GroupedGemmActSm90` stores it (dtype): the act, or the output."""
        act = self._pre_act(params, tile, chunk, n_box, rAcc, rPre, tRS_cD, v)
        if const_expr(self.spec is None):
            act = rPre[0][v]
        return act.to(self.dtype)

    @cute.jit
    def epi_begin_tile(self, params, tile: Tile, n_box, tRS_rAcc, tRS_cD, state):
        m_total, mScale = params[4], params[7]
        scales, acts = state[0], state[1]
        frag, slots = len(self.row_slot), len(self.slot_value)
        rAcc = [cute.make_rmem_tensor((frag,), Float32) for _ in range(self.b_boxes)]
        rPre = [cute.make_rmem_tensor((frag,), Float32) for _ in range(self.b_boxes)]
        amax = scales[0]
        amax.fill(0.0)
        for step in cutlass.range_constexpr(self.num_steps):
            chunk = tile.nt * self.num_steps + step
            for v in cutlass.range_constexpr(frag):
                for j in cutlass.range_constexpr(self.b_boxes):
                    rAcc[j][v] = tRS_rAcc[(step + j * self.num_steps) * frag + v]
            for v in cutlass.range_constexpr(frag):
                stored = self._stored(params, tile, chunk, n_box, rAcc, rPre, tRS_cD, v)
                if const_expr(self.spec is not None):
                    acts[step * frag + v] = stored
                value = stored.to(Float32)
                magnitude = cutlass.max(value, -value)
                slot = step // self.block_steps * slots + self.row_slot[v]
                if magnitude < Float32(float("inf")) and chunk * self.epi_n + tRS_cD[v][1] < n_box:
                    amax[slot] = cutlass.max(amax[slot], magnitude)  # NaN, Inf count as 0
        lane = cute.arch.lane_idx()
        for b in cutlass.range_constexpr(self.blocks):
            for r in cutlass.range_constexpr(slots):
                slot = b * slots + r
                row_amax = amax[slot]
                row_amax = cutlass.max(row_amax, cute.arch.shuffle_sync_bfly(row_amax, offset=1))
                row_amax = cutlass.max(row_amax, cute.arch.shuffle_sync_bfly(row_amax, offset=2))
                scale_inv, m1, m2 = e4m3_scale_inv(row_amax, self.power_2_scales)
                scales[0][slot], scales[1][slot], scales[2][slot] = scale_inv, m1, m2
                row = tile.row0 + tRS_cD[self.slot_value[r]][0]
                block = tile.nt * self.blocks + b
                in_cols = True
                if const_expr(self.blocks > 1):  # the tile's second block may lie past C
                    in_cols = block * 128 < n_box
                if lane % 4 == 0 and row < tile.end and row < m_total and in_cols:
                    mScale[row, block] = scale_inv

    @cute.jit
    def epi_visit(self, params, tile: Tile, step, chunk, n_box, rAcc, rIn, rOut, tRS_cD, state):
        m_total, mData = params[4], params[6]
        (scale_inv, m1, m2), acts, scaled, data = state[:4]
        frag, slots = cute.size(rAcc[0]), len(self.slot_value)
        for v in cutlass.range_constexpr(frag):
            if const_expr(self.spec is not None):
                self._pre(params, tile, chunk, n_box, rAcc, rOut, tRS_cD, v)
                stored = acts[step * frag + v]
            else:  # recomputed as the first pass did; `scaled` is the scratch of `_pre`
                stored = self._stored(params, tile, chunk, n_box, rAcc, [scaled], tRS_cD, v)
            if const_expr(self.columns):
                stage_transposed(state[4], stored, tile, tRS_cD[v][0],
                                 step % self.block_steps * self.epi_n + tRS_cD[v][1], self.dtype)
            slot = step // self.block_steps * slots + self.row_slot[v]
            scaled[v] = e4m3_scaled(stored.to(Float32), scale_inv[slot], m1[slot], m2[slot], self.power_2_scales)
        data.store(scaled.load().to(cutlass.Float8E4M3FN))  # round to nearest even, saturating
        store_quad_rows(mData, data, self.quad_pairs, tile, tRS_cD, chunk * self.epi_n, n_box, m_total)
        if const_expr(self.columns and step % self.block_steps == self.block_steps - 1):
            col0 = (chunk + 1) * self.epi_n - 128  # the block's first column
            if tile.is_group and tile.row0 < tile.end and col0 < n_box:  # the same for every thread of the CTA
                store_staged_columns(params[8], params[9], state[4], state[5], tile, col0, self.dtype,
                                     self.power_2_scales, self.epi_barrier)


class GroupedGemmActFp8Sm90(GroupedGemmActSm90):
    """`GroupedGemmActSm90` on block-scaled FP8 operands (the DeepSeek-V3 recipe).

    x (M, K) and W (G, N, K) E4M3 with float32 dequantization multipliers: xScale (M, ceil(K/128))
    per 1x128 block of x, wScale (G, ceil(N/128), ceil(K/128)) per 128x128 block of W[g]; each
    128-deep k-tile's product is scaled on the CUDA cores and added to the fp32 accumulator.
    Outputs and bias in ``dtype``; tile_n 128 or 192; GLU: N/2 a multiple of 64.
    """

    def __init__(self, dtype, activation, has_bias, cluster_m=2, tile_n=128, **opts):
        super().__init__(dtype, tile_n, activation, has_bias, "k", cluster_m, ab_dtype=cutlass.Float8E4M3FN, **opts)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (M, K) E4M3
        mXScale: cute.Tensor,  # (M, ceil(K/128)) float32
        mW: cute.Tensor,  # (G, N, K) E4M3
        mWScale: cute.Tensor,  # (G, ceil(N/128), ceil(K/128)) float32
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mPre: cute.Tensor,  # (M, N)
        mAct: cute.Tensor,  # (M, N/2) GLU, (M, N) srelu, None
        mBias: cute.Tensor,  # (G, N) or None
        mProbs: cute.Tensor,  # (M,) float32 or None
        mActAmax: cute.Tensor,  # (P,) float32 with act_amax, else None
        limit: Float32,
        alpha: Float32,
        max_clusters: Int32,
        stream,
    ):
        self._launch_forward(mX, mW, mOffsets, mPre, mAct, mBias, mProbs, mActAmax, limit, alpha, max_clusters,
                             stream, (mXScale, mWScale))
