"""Hopper (sm_90a) grouped data-gradient GEMM with the activation's backward in the epilogue.

The backward of FC2 fused with the activation's backward (GroupGemm + dActivation), on the core of
``grouped_gemm_sm90``:

    h[r, :]  = dY[r, :] @ W[g]                 for offsets[g] <= r < offsets[g+1]   (fp32)
    GLU:     d_pre = [h p up act'(gate), h p act(gate)],  act = act(gate) up p
             d_probs[r] = sum_c h act(gate) up              (scaled_swiglu only; p = probs[r],
                                                             else p = 1)
    srelu:   d_pre = h 2 relu(pre),  act = relu(pre)^2
    d_pre, act, d_probs = 0                    for offsets[G] <= r < M

dY (M, H); W (G, H, I) the FC2 weight in its natural layout, read in place (MN-major B); pre (the
saved pre-activation) (M, 2I) [gate, up] for GLU, (M, I) for srelu, loaded per 128 x 32 chunk with
TMA in the epilogue; d_pre like pre; act (M, I), the FC2 input recomputed for its weight gradient;
probs (M,) float32; d_probs as per-(n-tile, row) fp32 partials (ceil(I / tile_n), M) summed by the
caller, so the reduction is deterministic. GLU needs I % 32 == 0 (a gate chunk never reaches into
the up half). ``d_pre_amax`` (FP8 kernel; fp8_current's scale for FC1's data gradient): also d_pre's
amax as partial maxima per consumer warp (`epilogue_cast_sm90.write_amax_parts`).
`GroupedGemmDActGatheredSm90` reads dY's rows by index from the token-order gradient (T, H).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ....activations import activation_spec
from .activation_math_sm90 import ACTIVATION_MATH, ActivationConstants
from .epilogue_cast_sm90 import (
    fragment_row_slots,
    load_row_values,
    make_amax_state,
    track_amax,
    write_amax_parts,
)
from .group_tile_scheduler import Tile
from .grouped_gemm_sm90 import GroupedGemmSm90


# one store slot and one C stage, the rest of shared memory as operand stages (`deep_operands`)
DEEP_OPERAND_SPLIT = {"epi_slots": 1, "c_stages": 1}


class DActState(NamedTuple):
    """An MMA thread's dActivation state across a tile's epilogue steps, None where unused:
    d_probs (slots,) its rows' running sums of h act(gate) up over the tile's columns, products
    (frag,) one step's terms, row_probs (slots,) its rows' probs (read once a tile), amax its
    running max |d_pre| over all its tiles (d_pre_amax)."""

    d_probs: object
    products: object
    row_probs: object
    amax: object


class DActParams(NamedTuple):
    """What the dActivation epilogue hooks read (the kernel's ``epi_params``; the field order is
    the order of the kernel's parameters): probs (M,) float32 and the d_probs partials
    (ceil(I / tile_n), M) float32 or None, the activation constants (`ActivationConstants`), the rows of dy;
    d_pre_amax: the amax parts (P,) float32; quant: d_pre's row-wise copy (data (M, C) E4M3,
    scale_inv (M, C/128) float32) and column-wise copy (data (C, 128 * blocks), scale_inv
    (blocks, C)). None where unused."""

    probs: object
    d_probs_part: object
    constants: object
    m_total: object
    amax_parts: object = None
    row_data: object = None
    row_scale: object = None
    col_data: object = None
    col_scale: object = None


class GroupedGemmDActSm90(GroupedGemmSm90):
    """Grouped dgrad GEMM + dActivation epilogue for sm_90a.

    Compile-time configuration: ``dtype``, ``tile_n`` (over I), ``activation`` (a name of
    ``activations.ACTIVATIONS``), ``cluster_m``, ``b_major`` (bf16: "mn", W (G, H, I) read in
    place), ``emit_act`` (store act), ``d_pre_amax`` (`DActParams.amax_parts`) and the core's
    options.
    """

    supports_epilogue_warps = True

    def __init__(self, dtype, tile_n, activation, cluster_m=2, b_major="mn", emit_act=True, d_pre_amax=False,
                 **opts):
        self.spec = activation_spec(activation, "GroupedGemmDActSm90")
        if self.spec is None:
            raise ValueError("GroupedGemmDActSm90 needs an activation")
        self.d_pre_amax = d_pre_amax
        # outputs: d_pre (gate and up halves for GLU), act (``emit_act``); input: pre (both halves)
        self.emit_act = emit_act
        self.epi_stores = ((0, 0), (0, 1)) if self.spec.glu else ((0, 0),)
        if emit_act:
            self.epi_stores += ((1, 0),)
        self.epi_loads = ((0, 0), (0, 1)) if self.spec.glu else ((0, 0),)
        super().__init__(dtype, tile_n, b_major, cluster_m, **opts)

    @cute.jit
    def __call__(
        self,
        mDy: cute.Tensor,  # (M, H)
        mW: cute.Tensor,  # (G, H, I)
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mPre: cute.Tensor,  # (M, 2I) GLU, (M, I) srelu
        mDPre: cute.Tensor,  # like mPre
        mAct: cute.Tensor,  # (M, I) with emit_act, else None
        mProbs: cute.Tensor,  # (M,) float32 or None
        mDProbsPart: cute.Tensor,  # (ceil(I / tile_n), M) float32 or None
        constants: ActivationConstants,
        max_clusters: Int32,
        stream,
    ):
        m_total = cute.size(mDy, mode=[0])
        outputs = (mDPre, mAct) if const_expr(self.emit_act) else (mDPre,)
        self.launch(mDy, mW, mOffsets, outputs, (mPre,), DActParams(mProbs, mDProbsPart, constants, m_total),
                    max_clusters, stream)

    def epi_make_state(self, tiled_copy, epi_tile, shared):
        """A `DActState`: for scaled_swiglu the thread's d_probs sums, products and probs per row
        slot; with d_pre_amax the thread's running max |d_pre|."""
        d_probs = products = row_probs = None
        if self.spec.takes_probs:
            self.row_slot, self.slot_value = fragment_row_slots(tiled_copy, epi_tile)
            d_probs = cute.make_rmem_tensor((len(self.slot_value),), Float32)
            products = cute.make_rmem_tensor((len(self.row_slot),), Float32)
            row_probs = cute.make_rmem_tensor((len(self.slot_value),), Float32)
        return DActState(d_probs, products, row_probs, make_amax_state() if self.d_pre_amax else None)

    @cute.jit
    def epi_begin_tile(self, params, tile: Tile, n_box, tRS_rAcc, tRS_cD, state):
        if const_expr(self.spec.takes_probs):
            state.d_probs.fill(0.0)
            # a thread's rows are the same in every chunk of the tile: one load a row, not a value
            load_row_values(state.row_probs, params.probs, tile, tRS_cD, self.slot_value, params.m_total)

    @cute.jit
    def epi_visit(self, params, tile: Tile, step, chunk, n_box, rAcc, rIn, rOut, tRS_cD, state):
        glu = self.spec.glu
        for v in cutlass.range_constexpr(cute.size(rAcc[0])):
            h = rAcc[0][v]
            up = rIn[1][v].to(Float32) if const_expr(glu) else None
            value, d_x, d_u = ACTIVATION_MATH[self.spec.name](rIn[0][v].to(Float32), up, params.constants)
            if const_expr(self.spec.takes_probs):
                # rounded as a product of its own (mul.rn, never contracted into the sum's adds):
                # the same bits whatever ptxas fuses, so every schedule and tile width agrees
                state.products[v] = cute.math.mul(h, value, rounding=cute.math.RoundingMode.NEAREST_EVEN)
                p = state.row_probs[self.row_slot[v]]
                h = h * p
                value = value * p
            rOut[0][v] = h * d_x
            if const_expr(glu):
                rOut[1][v] = h * d_u
            if const_expr(self.d_pre_amax):  # gate and up columns alike
                row, col = tile.row0 + tRS_cD[v][0], chunk * self.epi_n + tRS_cD[v][1]
                for j in cutlass.range_constexpr(2 if glu else 1):
                    track_amax(state.amax, rOut[j][v], self.dtype, tile, row, col, n_box)
            if const_expr(self.emit_act):
                rOut[self.num_out - 1][v] = value
        if const_expr(self.spec.takes_probs):
            # chunks past I hold no columns of h; a select, not a branch: ptxas serializes every
            # WGMMA of the kernel around this branch at tile_n 128 (C7520)
            in_range = chunk * self.epi_n < n_box
            for v in cutlass.range_constexpr(cute.size(rAcc[0])):
                term = cutlass.select_(in_range, state.products[v], Float32(0.0))
                state.d_probs[self.row_slot[v]] = state.d_probs[self.row_slot[v]] + term

    @cute.jit
    def epi_end_tile(self, params, tile: Tile, n_box, tRS_cD, state):
        if const_expr(self.spec.takes_probs):
            mDProbsPart = params.d_probs_part
            lane = cute.arch.lane_idx()
            for r in cutlass.range_constexpr(len(self.slot_value)):
                total = state.d_probs[r]
                total = total + cute.arch.shuffle_sync_bfly(total, offset=1)
                total = total + cute.arch.shuffle_sync_bfly(total, offset=2)
                row = tile.row0 + tRS_cD[self.slot_value[r]][0]
                if lane % 4 == 0 and row < tile.end:
                    mDProbsPart[tile.nt, row] = total

    @cute.jit
    def epi_end_kernel(self, params, consumer_warp, state):
        if const_expr(self.d_pre_amax):
            write_amax_parts(params.amax_parts, state.amax, consumer_warp, self.hook_warps)


class GroupedGemmDActGatheredSm90(GroupedGemmDActSm90):
    """`GroupedGemmDActSm90` whose dy rows are read by index (the core's ``gather_a``): h[r] =
    dy[index[r]] @ W[g], the combine's backward (each expert row a copy of its token's gradient)
    folded into FC2's data-gradient loads. dy (T, H), H a multiple of 64; index (M,) int32, ids
    outside [0, T) clamped; pre, d_pre, act, probs with M rows as before."""

    def __init__(self, dtype, tile_n, activation, cluster_m=2, **opts):
        if opts.get("pingpong") and tile_n == 192:
            # a fifth operand stage for the gathering producer, in the room of one store slot and
            # one C stage: 2-3% faster at ping-pong 192 (H100, qwen3 and gpt-oss; the cooperative
            # 256-wide kernel is 4-7% slower so, the kernel on the copied rows too on qwen3:
            # docs/notes/backward-kernels.md)
            for name, value in DEEP_OPERAND_SPLIT.items():
                opts.setdefault(name, value)
        super().__init__(dtype, tile_n, activation, cluster_m, gather_a=True, **opts)
        if self.pingpong and tile_n == 192:
            # whole 192-wide accumulators: the dActivation epilogue takes the copy kernel's 240
            # registers (at 224 it spills 76 values; at 240 the producer spills 1 in CTA pairs,
            # 17 alone); at tile_n 128 the gathering split spills nothing, 24 / 240 would in the producer
            self.producer_registers, self.mma_registers = 24, 240

    @cute.jit
    def __call__(
        self,
        mDy: cute.Tensor,  # (T, H)
        mIndex: cute.Tensor,  # (M,) int32
        mW: cute.Tensor,  # (G, H, I)
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mPre: cute.Tensor,  # (M, 2I) GLU, (M, I) srelu
        mDPre: cute.Tensor,  # like mPre
        mAct: cute.Tensor,  # (M, I) with emit_act, else None
        mProbs: cute.Tensor,  # (M,) float32 or None
        mDProbsPart: cute.Tensor,  # (ceil(I / tile_n), M) float32 or None
        constants: ActivationConstants,
        max_clusters: Int32,
        stream,
    ):
        params = DActParams(mProbs, mDProbsPart, constants, cute.size(mIndex, mode=[0]))
        outputs = (mDPre, mAct) if const_expr(self.emit_act) else (mDPre,)
        self.launch(mDy, mW, mOffsets, outputs, (mPre,), params, max_clusters, stream, gather=(mDy, mIndex))


class GroupedGemmDActFp8Sm90(GroupedGemmDActSm90):
    """`GroupedGemmDActSm90` on block-scaled FP8 operands (the FP8 recipe's FC2 data gradient).

    dy (M, H) E4M3 with float32 multipliers dyScale (M, ceil(H/128)) per 1x128 block; W^T
    (G, I, H) E4M3, the forward's 128x128 weight cast transposed per group (K-major, as FP8
    WGMMA needs), with wScale (G, ceil(I/128), ceil(H/128)). tile_n 128 or 256. ``emit_act``: also
    mAct (M, I), the activation (times probs) of pre as `GroupedGemmDActSm90` writes it, for FC2's
    16-bit weight gradient where the forward wrote the act only in E4M3 (else None: that weight
    gradient reads what the forward kept). mDPreAmax (P,) float32 with ``d_pre_amax``, else None.
    """

    def __init__(self, dtype, activation, cluster_m=2, tile_n=128, emit_act=False, **opts):
        super().__init__(dtype, tile_n, activation, cluster_m, b_major="k", emit_act=emit_act,
                         ab_dtype=cutlass.Float8E4M3FN, **opts)

    @cute.jit
    def __call__(
        self,
        mDy: cute.Tensor,  # (M, H) E4M3
        mDyScale: cute.Tensor,  # (M, ceil(H/128)) float32
        mW: cute.Tensor,  # (G, I, H) E4M3
        mWScale: cute.Tensor,  # (G, ceil(I/128), ceil(H/128)) float32
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mPre: cute.Tensor,  # (M, 2I) GLU, (M, I) srelu
        mDPre: cute.Tensor,  # like mPre
        mAct: cute.Tensor,  # (M, I) with emit_act, else None
        mProbs: cute.Tensor,  # (M,) float32 or None
        mDProbsPart: cute.Tensor,  # (ceil(I / tile_n), M) float32 or None
        mDPreAmax: cute.Tensor,  # (P,) float32 with d_pre_amax, else None
        constants: ActivationConstants,
        max_clusters: Int32,
        stream,
    ):
        m_total = cute.size(mDy, mode=[0])
        outputs = (mDPre, mAct) if const_expr(self.emit_act) else (mDPre,)
        self.launch(mDy, mW, mOffsets, outputs, (mPre,),
                    DActParams(mProbs, mDProbsPart, constants, m_total, mDPreAmax),
                    max_clusters, stream, scales=(mDyScale, mWScale))
