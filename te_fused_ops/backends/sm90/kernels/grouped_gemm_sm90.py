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

With ``pingpong`` (16-bit varlen-M kernels, tile_n 128 or 192) each MMA warpgroup takes every other
tile whole (two 64-row WGMMA slabs, tile_n fp32 accumulator registers a thread): both read every
tile-ring entry and pass over the other's k-tiles and C chunks; their mainloops take turns on the
tensor cores and each one's epilogue (16-column chunks, so a thread holds as many values per chunk
as on two warpgroups) runs under the other's mainloop, the turns kept by named barriers
(`named_barriers_sm90`). It pays where the epilogue is a large share of a tile (short K, several
outputs, loaded inputs).

With ``gather_a`` (16-bit varlen-M, cooperative or ping-pong) A's rows are read by index, A[r]
= x[a_index[r]] (sm90 has no TMA gather): the producer warpgroup's 128 threads each load 16 bytes
of 8 rows a k-tile with cp.async into the swizzled stage TMA would fill, and signal the stage's
full barrier with `cp.async.mbarrier.arrive.noinc` beside warp 0's B transaction (129 arrivals);
warp 0 alone publishes the tiles and loads B. Registers: producer 56, MMA warpgroups 224 (ping-pong
too; a subclass may move them after ``__init__``). On varlen-K, ``gather_a`` fills
A's MN-major stage with x[index[token]]'s 128 columns, a token per 16 threads (16 bytes each);
tokens past the group's end read its last row and columns past x's width the last 8 (B's ragged
token view zero-fills those tokens, and the stores clip those rows), so every read is in bounds
and nothing is zero-filled by hand; B is multicast over a CTA pair as usual. With ``d_major``
"m" the tile is stored transposed: a weight gradient dW (N, K_out) comes out of the product
dW^T = x_g^T dy_g with the gathered x as A.

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

Module map: `group_tile_scheduler` (`GroupTileScheduler`: both schedules, the tile ring),
`mainloop_sm90` (`Sm90Mainloop`: producer loads, k-loop, FP8 promotion), `epilogue_sm90`
(`Sm90Epilogue`: the hooks' chunk loop, C loads, TMA / deferred / epilogue-warp stores),
`varlen_sm90` (the ragged row and token views). Epilogues (kernels): `grouped_act_sm90` (forward:
bias + activation, the plain GEMM, the E4M3 cast, FP8 operands), `grouped_dact_sm90` (data
gradient + the activation's backward), `grouped_wgrad_sm90` (varlen-K weight gradient).
"""

from types import SimpleNamespace
from typing import NamedTuple

import cutlass
import cutlass.cute as cute
import cutlass.memory
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Float32, Int32, const_expr
from cutlass.tensor_utils import LayoutEnum

from .epilogue_sm90 import Sm90Epilogue
from .group_tile_scheduler import RASTER_BAND, SORT_MAX_G, TILE_FIELDS, TILE_SLOTS, GroupTileScheduler, Tile
from .mainloop_sm90 import Sm90Mainloop
from .named_barriers_sm90 import EPI_BARRIER, EPI_TURN, MMA_TURN
from .varlen_sm90 import ragged_rows, rows_by_block

MAX_EPI_SLOTS = 2  # TMA-store slots of 128 x 32 (tile_m x epi_n) where shared memory has room


class Pipelines(NamedTuple):
    """The kernel's pipelines: A/B stages (producer warp -> MMA warpgroups, cluster-wide), C-tile
    loads (first consumer warp -> consumer warps), the handed-over accumulator (MMA warpgroups ->
    epilogue warps) and the tile ring; None where the configuration has none."""

    ab: object
    c: object
    acc: object
    tile: object


class TileContext(NamedTuple):
    """What an MMA warpgroup's every tile uses (`GroupedGemmSm90._consume_tile`): the pipelines,
    the mainloop's fragments (`_mma_fragments`), the epilogue's (`EpiFragments`) and its hooks'
    state, the shared-memory tensors, the store / load TMA atoms and views, the TMA store pipeline
    and whether this warp issues the stores, the barrier of the tile's consumer threads, the
    hooks' parameters, the FP8 multipliers, N / b_boxes, the chunk offset of a [gate, up] tensor's
    half 1, the rows the offsets index, the MMA warpgroup (0, 1), and defer_stores' store
    arguments and pending outputs (None where unused)."""

    pipes: object
    mainloop_args: object
    epi: object
    state: object
    smem_tensors: object
    store_tmas: tuple
    load_tmas: tuple
    store_pipe: object
    is_store_warp: object
    epi_barrier: object
    epi_params: object
    scales: object
    n_box: object
    half_chunks: object
    m_total: object
    mma_wg: object
    store_args: object
    pending: object
    pending_tile: object


class TileStates(NamedTuple):
    """The pipeline states and counters a tile advances (`GroupedGemmSm90._consume_tile`): the MMA
    (its ACCUMULATE flag), the A/B stages' read and release states, the chunk stores so far, the
    C-tile loads' read and write states and the accumulator hand-over (None where unused)."""

    tiled_mma: object
    read_state: object
    release_state: object
    epi_count: object
    c_read: object
    c_write: object
    acc_write: object


class SmemTensors(NamedTuple):
    """The kernel's shared-memory tensors: A/B stages (sB_boxes: ((box_n, tile_k), b_boxes, 1,
    stages), box h filling B rows [h box_n, (h+1) box_n)), store buffers sD and load buffers sC,
    the handed-over accumulator sAcc (``epilogue_warps``), the staged multipliers sSFA / sSFB
    (varlen-K FP8); None where unused."""

    sA: object
    sB: object
    sD: object
    sC: object
    sAcc: object
    sB_boxes: object
    sSFA: object
    sSFB: object


class GroupedGemmSm90(GroupTileScheduler, Sm90Mainloop, Sm90Epilogue):
    """Persistent grouped GEMM core for sm_90a; subclasses add the epilogue and ``__call__``.

    Compile-time configuration: ``dtype`` (cutlass.BFloat16 / Float16: A, B and the epilogue
    tensors; Float32 epilogue tensors with a 16-bit ``ab_dtype``), ``tile_n`` (128, 192 or 256; tile_m
    is 128, tile_k 64; FP8 operands: 128 or 192, tile_k 128), ``a_major`` / ``b_major`` ("k" or
    "mn": A (M, K) / (K, M) and W (G, N, K) / (G, K, N); varlen-K: the token views), ``cluster_m``
    (1, or 2: B multicast to a CTA pair), ``ab_stages`` / ``epi_slots`` (None: fill shared
    memory), ``c_stages`` (C-tile load buffers: chunks loaded ahead, default 2), ``raster_band``
    (m-tiles per band of the tile order inside a group, `banded_tile`), ``split_tail`` (varlen-M,
    cluster_m 2: a group's odd last m-tile split along N over the pair, `cluster_tile`),
    ``epilogue_warps`` (the epilogue on warps of its own, module docstring), ``defer_stores`` (one
    output, no loads: stored under the next tile's mainloop), ``pingpong`` (each MMA warpgroup on
    tiles of its own, module docstring). Subclasses set ``b_boxes``,
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
        pingpong=False, overlap_promotion=False, gather_a=False, d_major="n", up_box_split=False,
    ):
        if b_major not in ("k", "mn") or a_major not in ("k", "mn"):
            raise ValueError("a_major and b_major must be 'k' or 'mn'")
        if cluster_m not in (1, 2):
            raise ValueError("cluster_m must be 1 or 2")
        self.dtype = dtype
        self.ab_dtype = dtype if ab_dtype is None else ab_dtype
        # FP8 operands are block-scaled: one k-tile is one 128-deep scale block, promoted into
        # the fp32 accumulator after its WGMMAs (a second accumulator of the same size, so
        # tile_n 128 or 192: 96 + 96 registers per thread; tile_n 256 takes the block's product
        # in two 128-column halves, 128 + 64 registers, `split_products`)
        self.block_scaled = self.ab_dtype.width == 8
        if self.block_scaled:
            if tile_n not in (128, 192, 256) or "mn" in (a_major, b_major):
                raise ValueError("FP8 operands need tile_n 128, 192 or 256 and K-major operands")
            self.tile_k = 128
        elif tile_n not in (128, 192, 256):
            raise ValueError("tile_n must be 128, 192 or 256")
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
        self.split_products = self.block_scaled and tile_n == 256  # each half inside one W scale block
        # FP8 GLU at tile 256 with N/2 an odd multiple of 64: the up box starts 64 rows into a W
        # scale block, so its half's first and last 64 columns take two blocks' multipliers
        if up_box_split and not (self.split_products and self.b_boxes == 2):
            raise ValueError(f"{type(self).__name__}: up_box_split needs FP8 operands, a GLU and tile_n 256")
        self.up_box_split = up_box_split
        self.num_out = len(self.epi_stores)
        self.num_in = len(self.epi_loads)
        # ping-pong: a warpgroup holds a whole 128-row tile, twice the rows a thread holds of a
        # chunk; 16-column chunks keep its epilogue registers those of a 128 x 32 chunk on two
        self.pingpong = pingpong
        if pingpong:
            self.epi_n = 16
        self.num_steps = self.box_n // self.epi_n
        self.num_mma_wg = 2
        if epilogue_warps and (self.block_scaled or not self.supports_epilogue_warps or self.num_out == 0
                               or self.varlen_k):
            raise ValueError(f"{type(self).__name__}: epilogue_warps needs 16-bit operands and stored outputs")
        if defer_stores and (self.num_out != 1 or self.num_in or self.b_boxes != 1 or epilogue_warps):
            raise ValueError(f"{type(self).__name__}: defer_stores needs one output and no loaded inputs")
        if pingpong and (tile_n not in (128, 192) or self.block_scaled or dtype.width != 16 or epilogue_warps
                         or defer_stores or self.group_blocks or self.epi_scratch):
            raise ValueError(
                f"{type(self).__name__}: pingpong needs tile_n 128 or 192, 16-bit operands and outputs, and an "
                "epilogue of the MMA warpgroups without shared scratch"
            )
        # FP8: two block products in flight (`_fp8_overlapped_k_tiles`): 3 x 64 fp32 registers a
        # thread at tile_n 128
        if overlap_promotion and (not self.block_scaled or tile_n != 128 or defer_stores):
            raise ValueError(f"{type(self).__name__}: overlap_promotion needs FP8 operands, tile_n 128 and stores "
                             "that are not deferred")
        self.overlap_promotion = overlap_promotion
        # gather_a: the producer warpgroup reads A's rows (varlen-M) / tokens (varlen-K) by index (module docstring)
        if gather_a and (self.block_scaled or a_major != ("mn" if self.varlen_k else "k") or epilogue_warps
                         or (self.varlen_k and pingpong)):
            raise ValueError(f"{type(self).__name__}: gather_a needs 16-bit operands, K-major rows (varlen-M) or "
                             "MN-major tokens (varlen-K, the MMA warpgroups sharing tiles) and the MMA warpgroups' "
                             "own epilogue")
        self.gather_a = gather_a
        # d_major "m": the outputs stored M-contiguous (a varlen-K product whose output is the
        # transpose of the (M, N) tile: stmatrix transposed into M-major store slots)
        if d_major not in ("n", "m") or (d_major == "m" and (dtype.width != 16 or self.num_in or epilogue_warps)):
            raise ValueError(f"{type(self).__name__}: d_major must be 'n', or 'm' for 16-bit outputs without loaded "
                             "inputs or epilogue warps")
        self.d_layout = LayoutEnum.ROW_MAJOR if d_major == "n" else LayoutEnum.COL_MAJOR
        # ping-pong: each MMA warpgroup takes every other tile whole (128 x tile_n, tile_n fp32
        # accumulator registers a thread); their mainloops take turns, and one's epilogue runs
        # under the other's mainloop
        self.mma_atoms = 1 if pingpong else self.num_mma_wg  # MMA warpgroups on one tile
        # registers a thread after setmaxnreg, at most 504 over the three warpgroups (the launch's 168
        # a thread: setmaxnreg moves registers within the CTA's allocation, and an increase past it
        # never completes: the kernel hangs): the gathering producer warpgroup holds its rows' source
        # addresses; else ping-pong's whole-tile accumulators take what the producer warp can spare
        self.producer_registers, self.mma_registers = (56, 224) if gather_a else (24, 240) if pingpong else (40, 232)
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
        smem = cutlass.memory.get_smem_capacity_in_bytes("sm_90") - 1024 - TILE_SLOTS * (TILE_FIELDS * 4 + 16)
        if self.varlen_k and self.sort_groups:  # k-tile counts and the ranked order
            smem -= 2 * SORT_MAX_G * 4
        if self.stage_scales or self.group_blocks:  # group edges and first blocks (`scan_group_blocks`)
            smem -= 2 * (SORT_MAX_G + 1) * 4
        smem -= self.epi_scratch * dtype.width // 8  # the epilogue hooks' own shared memory
        # store slots: one for three-buffer epilogues at tile_n 256, else two, decide the A/B
        # stages; the room those stages leave then takes more slots, up to MAX_EPI_SLOTS
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
            slots = max(slots, min(MAX_EPI_SLOTS, room // (buf_bytes * self.num_out)))
        self.epi_slots = slots
        self.ab_stages = ab_stages
        self.epi_barrier = pipeline.NamedBarrier(barrier_id=EPI_BARRIER, num_threads=128 * self.mma_atoms)

    # ------------------------------------------------------------------ host side (traced)
    def launch(self, mA, mW, mOffsets, outputs, inputs, epi_params, max_clusters, stream, scales=None, m_total=None,
               gather=None):
        """Build the TMA atoms and launch; called from a subclass's ``@cute.jit __call__``.

        Varlen-M: mA (M, K); mW (G, N, K) or (G, K, N) per ``b_major``; outputs / inputs: tuples
        of row-major (M, cols) tensors, indexed by ``epi_stores`` / ``epi_loads``; scales (FP8
        operands): (mSFA (M, ceil(K/128)), mSFB (G, ceil(N/128), ceil(K/128))) float32
        dequantization multipliers of A's 1x128 and W's 128x128 blocks.
        Varlen-K: mA (N, tokens) and mW (K_out, tokens) token views (`ragged_tokens`, or FP8's
        block-padded copies), outputs / inputs (N, K_out, G) views, scales (FP8) the (blocks, N)
        and (blocks, K_out) multipliers, m_total the rows the offsets index.
        epi_params: what the epilogue hooks read, a kernel argument (a NamedTuple of the subclass,
        e.g. `grouped_act_sm90.ForwardParams`, or ()); max_clusters: Int32, the persistent grid in
        clusters. ``gather`` (gather_a): (x (T, C), index (M,) int32), the rows read by index, ids
        clamped to [0, T): A's row r is x[index[r]] (mA is x itself, K = C a multiple of 64;
        varlen-K: A's token r, mA x's token view, N = C).
        """
        dt = self.ab_dtype
        if const_expr(self.varlen_k):
            mB = mW
        else:
            m_total = cute.size(gather[1] if const_expr(self.gather_a) else mA, mode=[0])
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
            (self.mma_atoms, 1, 1),
            tiler_mn=(64, self.tile_n),
        )
        tile_mnk = (self.tile_m, self.tile_n, self.tile_k)
        sA_layout = sm90_utils.make_smem_layout_a(self.a_layout, tile_mnk, dt, self.ab_stages)
        sB_layout = sm90_utils.make_smem_layout_b(self.b_layout, tile_mnk, dt, self.ab_stages)
        sD_layout = sm90_utils.make_smem_layout_epi(
            self.dtype, self.d_layout, self.epi_tile, max(self.num_out, 1) * self.epi_slots
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
                    t if const_expr(self.varlen_k) else ragged_rows(t),
                    sD_one,
                    self.epi_tile,
                )
                for t in outputs
            )
            load_tmas = tuple(
                cute.nvgpu.cpasync.make_tiled_tma_atom(g2s, t, cute.slice_(sC_layout, (None, None, 0)), self.epi_tile)
                for t in inputs
            )
        # gathered rows arrive by cp.async, outside the transaction count
        self.ab_bytes = cute.size_in_bytes(dt, cute.slice_(sB_layout, (None, None, 0)))
        if const_expr(not self.gather_a):
            self.ab_bytes += cute.size_in_bytes(dt, cute.slice_(sA_layout, (None, None, 0)))
        sSFA_layout, sSFB_layout = self._stage_scale_layouts()
        if const_expr(self.stage_scales):  # (tile, 1) boxes of each operand's multipliers, into the stage
            self.ab_bytes += (self.tile_m + self.tile_n) * 4
            scales = tuple(
                cute.nvgpu.cpasync.make_tiled_tma_atom(
                    g2s, rows_by_block(t), cute.slice_(layout, (None, None, 0)), (cute.size(layout, mode=[0]), 1)
                )
                for t, layout in zip(scales, (sSFA_layout, sSFB_layout))
            )
        self.c_bytes = self.num_in * cute.size_in_bytes(self.dtype, cute.slice_(sC_layout, (None, None, 0)))

        self.shared_storage = self._shared_storage(sA_layout, sB_layout, sD_layout, sC_layout, sAcc_layout, sSFA_layout,
                                                   sSFB_layout)

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
            gather if const_expr(self.gather_a) else None,
        ).launch(
            grid=[grid_x, 1, 1],
            block=[self.threads, 1, 1],
            cluster=[self.cluster_m, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    def _shared_storage(self, sA_layout, sB_layout, sD_layout, sC_layout, sAcc_layout, sSFA_layout, sSFB_layout):
        """The kernel's shared-memory struct: barriers, the tile ring, the schedule's and the
        epilogue's scratch, the multipliers, the A/B stages and the epilogue buffers."""
        dt = self.ab_dtype
        sD_used = self.num_out > 0 and not self.epilogue_warps
        sC_used = self.num_in > 0 and not self.epilogue_warps
        sorted_groups = self.varlen_k and self.sort_groups

        @cute.struct
        class SharedStorage:
            ab_full_empty: cute.struct.MemRange[cutlass.Int64, self.ab_stages * 2]
            c_full_empty: cute.struct.MemRange[cutlass.Int64, self.c_stages * 2]
            acc_full_empty: cute.struct.MemRange[cutlass.Int64, 2 if self.epilogue_warps else 0]
            tile_full_empty: cute.struct.MemRange[cutlass.Int64, 2 * TILE_SLOTS]
            tiles: cute.struct.MemRange[Int32, TILE_FIELDS * TILE_SLOTS]
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


        return SharedStorage

    def _stage_scale_layouts(self):
        """Varlen-K FP8: shared-memory layouts of the per-stage multipliers, (tile_m, 1, stages) of
        A's rows and (tile_n, 1, stages) of B's."""
        return tuple(
            cute.make_layout((rows, 1, self.ab_stages), stride=(1, 0, rows)) for rows in (self.tile_m, self.tile_n)
        )

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
        gather: tuple,
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
        pipes = self._make_pipelines(storage)
        sTiles = storage.tiles.get_tensor(cute.make_layout((TILE_FIELDS, TILE_SLOTS)))
        pipeline.pipeline_init_arrive(cluster_shape_mn=(self.cluster_m, 1), is_relaxed=True)
        smem_tensors = self._smem_tensors(storage, sA_layout, sB_layout, sD_layout, sC_layout, sAcc_layout)

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
                cute.arch.setmaxregister_decrease(self.producer_registers)
            if const_expr(self.gather_a):  # the whole warpgroup loads the gathered operand
                self._produce(pipes, sTiles, smem_tensors, tma_a, mA, tma_b, mB, scales, sched, first_tile,
                              num_clusters, rank, k_tiles, gather, warp_idx)
            elif warp_idx == 0:
                self._produce(pipes, sTiles, smem_tensors, tma_a, mA, tma_b, mB, scales, sched, first_tile,
                              num_clusters, rank, k_tiles)
            elif const_expr(self.epilogue_warps):
                # ------------------------------------------------------ epilogue warps
                self._run_epilogue_warps(
                    pipes.acc, smem_tensors.sAcc, epi_tensors, epi_params, first_tile, num_clusters, rank, sched,
                    n_box,
                )
        else:
            # ---------------------------------------------------------- MMA (+ epilogue)
            if const_expr(not self.epilogue_warps):
                cute.arch.setmaxregister_increase(self.mma_registers)
            self._consume(pipes, sTiles, smem_tensors, tiled_mma, store_tmas, load_tmas, epi_params, epi_shared,
                          scales, num_groups, n_box, half_chunks, k_tiles, m_total, tidx, warp_idx)

    @cute.jit
    def _make_pipelines(self, storage):
        """The kernel's `Pipelines` over their shared-memory barriers (before the init sync)."""
        ab_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.ab_full_empty.data_ptr(),
            num_stages=self.ab_stages,
            # gather_a: warp 0's transaction and each producer thread's cp.async arrival
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 129 if self.gather_a else 1),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.mma_atoms * 4 * self.cluster_m
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
                consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_atoms * 4),
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
            num_stages=TILE_SLOTS,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 32),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.num_mma_wg),
            defer_sync=True,
        )
        return Pipelines(ab_pipe, c_pipe, acc_pipe, tile_pipe)

    @cute.jit
    def _smem_tensors(self, storage, sA_layout, sB_layout, sD_layout, sC_layout, sAcc_layout):
        """The kernel's `SmemTensors` in its shared storage."""
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
        return SmemTensors(sA, sB, sD, sC, sAcc, sB_boxes, sSFA, sSFB)

    @cute.jit
    def _consume(self, pipes, sTiles, smem_tensors, tiled_mma, store_tmas, load_tmas, epi_params, epi_shared, scales,
                 num_groups, n_box, half_chunks, k_tiles, m_total, tidx, warp_idx):
        """MMA warpgroups: each tile of the ring through the k-loop (`_mainloop_tile`), then its
        epilogue: handed over to the epilogue warps, deferred under the next tile, or run here.
        Ping-pong: both warpgroups read every ring entry and each takes every other tile, passing
        over the other's k-tiles and C chunks; the mainloops take turns (MMA_TURN, passed on once a
        warpgroup's last WGMMAs are issued), and so do the epilogues (EPI_TURN, passed on once its
        stores have left shared memory).

        The tile loop carries one record, `consumer_loop_state`: the helpers hand their pipeline
        states back into it, and its field order is the order of the loop-carried values."""
        tile_pipe = pipes.tile
        mma_wg = cute.arch.make_warp_uniform(tidx // 128 - 1)  # MMA warpgroup 0 or 1
        mma_tidx = tidx % 128 if const_expr(self.pingpong) else tidx - 128
        mainloop_args = self._mma_fragments(tiled_mma, mma_tidx, smem_tensors, scales)
        acc = mainloop_args[0]
        epi = self._epilogue_fragments(tiled_mma, mma_tidx, acc, smem_tensors)
        if const_expr(self.split_products):  # the k-loop issues the half-width MMA
            tiled_mma = self._half_tiled_mma()
        state = self.epi_make_state(epi.tiled_copy_r2s, self.epi_tile, epi_shared)
        # defer_stores: the previous tile's output chunks in dtype, and where they go
        # (valid, seg, start, length, mt, nt, has_rows)
        pending = None
        pending_tile = None
        if const_expr(self.defer_stores):
            pending = [cute.make_rmem_tensor(cute.shape(epi.tRS_cD), self.dtype) for _ in range(self.num_steps)]
            pending_tile = cute.make_rmem_tensor((7,), Int32)
            pending_tile[0] = Int32(0)

        store_pipe = None
        if const_expr(self.num_out > 0 and not self.epilogue_warps):
            store_pipe = pipeline.PipelineTmaStore.create(
                num_stages=self.epi_slots,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 128 * self.mma_atoms),
            )
        # the first warp of the tile's warpgroup(s) issues the TMA stores and C loads
        is_store_warp = warp_idx % 4 == 0 if const_expr(self.pingpong) else warp_idx == 4
        epi_barrier = self.epi_barrier
        if const_expr(self.pingpong):
            epi_barrier = pipeline.NamedBarrier(barrier_id=EPI_BARRIER + mma_wg, num_threads=128)
        store_args = (epi.tiled_copy_r2s, epi.tRS_sD, smem_tensors.sD, store_tmas, store_pipe, is_store_warp)
        context = TileContext(pipes, mainloop_args, epi, state, smem_tensors, store_tmas, load_tmas, store_pipe,
                              is_store_warp, epi_barrier, epi_params, scales, n_box, half_chunks, m_total, mma_wg,
                              store_args, pending, pending_tile)
        loop = self.consumer_loop_state(tiled_mma, mma_wg)
        if const_expr(self.pingpong):
            if mma_wg == 0:  # the first turns are warpgroup 0's
                cute.arch.barrier_arrive(barrier_id=MMA_TURN, number_of_threads=256)
                cute.arch.barrier_arrive(barrier_id=EPI_TURN, number_of_threads=256)
        tile_pipe.consumer_wait(loop.tile_read)
        loop.found = sTiles[0, loop.tile_read.index] != 0
        while loop.found:
            tile, has_rows = self._read_tile(sTiles, loop.tile_read.index, num_groups)
            tile_pipe.consumer_release(loop.tile_read)
            loop.tile_read.advance()
            tile_k_tiles = k_tiles if tile.is_group else 0
            if const_expr(self.varlen_k):
                tile_k_tiles = (tile.end - tile.start + self.tile_k - 1) // self.tile_k
            states = TileStates(loop.tiled_mma, loop.read_state, loop.release_state, loop.epi_count, loop.c_read,
                                loop.c_write, loop.acc_write)
            if const_expr(self.pingpong):
                if loop.mine:
                    states = self._consume_tile(context, states, tile, has_rows, tile_k_tiles)
                else:  # the other warpgroup's tile: its k-tiles and C chunks pass by
                    read_state, release_state, c_read, c_write = (states.read_state, states.release_state,
                                                                  states.c_read, states.c_write)
                    read_state.advance(tile_k_tiles)
                    release_state.advance(tile_k_tiles)
                    if const_expr(self.num_in > 0):
                        chunks = self.num_steps if tile.is_group else 0
                        c_read.advance(Int32(chunks))
                        c_write.advance(Int32(chunks))
                    states = states._replace(read_state=read_state, release_state=release_state, c_read=c_read,
                                             c_write=c_write)
                loop.mine = not loop.mine
            else:
                states = self._consume_tile(context, states, tile, has_rows, tile_k_tiles)
            (loop.tiled_mma, loop.read_state, loop.release_state, loop.epi_count, loop.c_read, loop.c_write,
             loop.acc_write) = states
            tile_pipe.consumer_wait(loop.tile_read)
            loop.found = sTiles[0, loop.tile_read.index] != 0
        epi_count = loop.epi_count
        if const_expr(self.defer_stores):
            if pending_tile[0] != 0:
                for step in cutlass.range_constexpr(self.num_steps):
                    self._store_chunk(store_args, pending[step], pending_tile, step, epi_count)
                    epi_count = epi_count + 1
        if const_expr(self.epilogue_warps):
            pipes.acc.producer_tail(loop.acc_write)
        else:
            self.epi_end_kernel(epi_params, (tidx - 128) // 32, state)
            if const_expr(self.num_out > 0):
                if is_store_warp:
                    store_pipe.producer_tail()

    @cute.jit
    def _consume_tile(self, context: TileContext, states: TileStates, tile: Tile, has_rows, tile_k_tiles):
        """One tile on the MMA warpgroup(s) (`_consume`): C prefetch, mainloop, epilogue; returns
        ``states`` advanced."""
        (pipes, mainloop_args, epi, state, smem_tensors, store_tmas, load_tmas, store_pipe, is_store_warp,
         epi_barrier, epi_params, scales, n_box, half_chunks, m_total, mma_wg, store_args, pending,
         pending_tile) = context
        tiled_mma, read_state, release_state, epi_count, c_read, c_write, acc_write = states
        # C-tile loads of the first steps run under the mainloop (padding tiles: none, their inputs
        # read as zeros); ping-pong: at the start of the epilogue's turn, the C stages being the
        # other warpgroup's until then
        c_loads = None
        if const_expr(self.num_in > 0 and not self.epilogue_warps):
            c_loads = self._partition_loads(load_tmas, smem_tensors.sC, tile)
            if const_expr(not self.pingpong):
                c_write = self._prefetch_c(load_tmas, pipes.c, c_write, c_loads, tile, is_store_warp, half_chunks)

        tiled_mma, read_state, release_state, epi_count = self._mainloop_tile(
            pipes.ab, read_state, release_state, tiled_mma, mainloop_args, scales, tile, tile_k_tiles, n_box,
            m_total, store_args, pending, pending_tile, epi_count, mma_wg,
        )

        # ------------------------------------------------------ epilogue
        if const_expr(self.epilogue_warps):
            acc_write = self._hand_over_acc(pipes.acc, acc_write, epi, tile, has_rows)
        elif const_expr(self.defer_stores):  # outputs wait for the next tile's k-tiles
            self._defer_outputs(epi_params, epi, tile, has_rows, n_box, state, pending, pending_tile)
        else:
            if const_expr(self.pingpong):
                cute.arch.barrier(barrier_id=EPI_TURN + mma_wg, number_of_threads=256)
                if const_expr(self.num_in > 0):
                    c_write = self._prefetch_c(load_tmas, pipes.c, c_write, c_loads, tile, is_store_warp,
                                               half_chunks)
            c_read, c_write, epi_count = self._epilogue_tile(
                epi_params, epi, tile, has_rows, n_box, half_chunks, state, smem_tensors.sD, store_tmas, load_tmas,
                store_pipe, is_store_warp, pipes.c, c_read, c_write, c_loads, epi_count, epi_barrier,
            )
            if const_expr(self.pingpong):
                if const_expr(self.num_out > 0):
                    if is_store_warp:  # the store buffers are the other warpgroup's next
                        store_pipe.producer_tail()
                cute.arch.barrier_arrive(barrier_id=EPI_TURN + 1 - mma_wg, number_of_threads=256)
        return TileStates(tiled_mma, read_state, release_state, epi_count, c_read, c_write, acc_write)

    @cute.jit
    def _prefetch_c(self, load_tmas, c_pipe, c_write, c_loads, tile: Tile, is_store_warp, half_chunks):
        """The TMA loads of the tile's first C chunks (group tiles; the store warp); returns c_write."""
        if tile.is_group and is_store_warp:
            for step in cutlass.range_constexpr(min(self.c_stages, self.num_steps)):
                self._load_c(load_tmas, c_pipe, c_write, *c_loads, tile.mt, tile.nt * self.num_steps + step,
                             half_chunks)
                c_write.advance()
        return c_write

    def consumer_loop_state(self, tiled_mma, mma_wg):
        """The values the MMA warpgroups' tile loop carries, as one record (a SimpleNamespace, which
        the DSL carries field by field in this order): the chunk stores so far (store slot),
        whether a tile was found, the pipeline states of the tile ring and the C-tile loads
        (write), the MMA (its ACCUMULATE flag, set inside the k-loop, goes from tile to tile as in
        one kernel body), the pipeline states of the A/B stages (read, release), the accumulator
        hand-over and the C-tile loads (read) (None where unused), and with ping-pong whether the
        next tile is this warpgroup's. The order is the code's: ptxas assigns the carried
        registers in it."""
        c_write, c_read, acc_write = None, None, None
        if const_expr(self.num_in > 0 and not self.epilogue_warps):
            c_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.c_stages)
            c_read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.c_stages)
        if const_expr(self.epilogue_warps):
            acc_write = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, 1)
        return SimpleNamespace(
            epi_count=Int32(0),
            found=None,
            tile_read=pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, TILE_SLOTS),
            c_write=c_write,
            tiled_mma=tiled_mma,
            read_state=pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages),
            release_state=pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.ab_stages),
            acc_write=acc_write,
            c_read=c_read,
            mine=Boolean(mma_wg == 0) if const_expr(self.pingpong) else None,
        )
