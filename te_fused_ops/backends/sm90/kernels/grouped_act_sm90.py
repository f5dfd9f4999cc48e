"""Forward epilogues of the sm90 grouped GEMM core (`grouped_gemm_sm90`), varlen-M:

    pre = A_g @ W[g] (+ bias[g]),  act = activation(pre) (* probs)

`GroupedGemmActSm90` (16-bit operands; also the plain GEMM, e.g. the data gradient
dx = dy_g @ W[g]), `GroupedGemmGatheredSm90` (the same with A's rows read by index),
`GroupedGemmActQuantSm90` (the act or plain output cast to 1 x 128 E4M3 blocks
in the epilogue, optionally with its per-group column-wise copy) and `GroupedGemmActFp8Sm90`
(block-scaled FP8 operands).
"""

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from ....activations import activation_spec
from .activation_math_sm90 import ACTIVATION_MATH, ActivationConstants
from .block_quantize_sm90 import e4m3_scale_inv, e4m3_scaled
from .epilogue_cast_sm90 import (
    COLUMN_SCRATCH,
    fragment_column_slots,
    fragment_row_slots,
    load_column_values,
    load_row_values,
    make_amax_state,
    quad_column_groups,
    stage_transposed,
    store_quad_rows,
    store_staged_columns,
    track_amax,
    write_amax_parts,
)
from .group_tile_scheduler import Tile
from .grouped_gemm_sm90 import GroupedGemmSm90


class ForwardParams(NamedTuple):
    """What the forward epilogue hooks read (the kernel's ``epi_params``; the field order is the
    order of the kernel's parameters): bias (G, N) and probs (M,) float32 or None, the activation
    constants (`ActivationConstants`), the rows of x; act_amax: the amax parts (P,) float32; act quant: the cast
    output data (M, C) E4M3 and scale_inv (M, ceil(C/128)) float32, and with ``columns`` its
    column-wise copy (data (C, 128 * blocks), scale_inv (blocks, C)). None where unused."""

    bias: object
    probs: object
    constants: object
    m_total: object
    amax_parts: object = None
    data: object = None
    scale: object = None
    col_data: object = None
    col_scale: object = None


class ForwardState(NamedTuple):
    """An MMA thread's forward epilogue state, None where unused: amax its running max |act| over
    all its tiles (act_amax), row_probs (slots,) its rows' probs, read once a chunk."""

    amax: object
    row_probs: object


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
        constants: ActivationConstants,
        max_clusters: Int32,
        stream,
    ):
        self._launch_forward(mX, mW, mOffsets, mPre, mAct, mBias, mProbs, mActAmax, constants, max_clusters,
                             stream)

    @cute.jit
    def _launch_forward(
        self, mX, mW, mOffsets, mPre, mAct, mBias, mProbs, mActAmax, constants, max_clusters, stream, scales=None
    ):
        outputs = (mPre,) if const_expr(self.spec is None) else (mPre, mAct)
        m_total = cute.size(mX, mode=[0])
        self.launch(mX, mW, mOffsets, outputs, (), ForwardParams(mBias, mProbs, constants, m_total, mActAmax),
                    max_clusters, stream, scales)

    def epi_make_state(self, tiled_copy, epi_tile, shared):
        """A `ForwardState`: with act_amax the thread's running max |act| over all its tiles; for
        an activation that takes probs its rows' probs (read once a chunk)."""
        self._column_slots(tiled_copy, epi_tile)
        row_probs = None
        if self._takes_probs():
            self.row_slot, self.slot_value = fragment_row_slots(tiled_copy, epi_tile)
            row_probs = cute.make_rmem_tensor((len(self.slot_value),), Float32)
        return ForwardState(make_amax_state() if self.act_amax else None, row_probs)

    def _takes_probs(self) -> bool:
        return self.spec is not None and self.spec.takes_probs

    def _column_slots(self, tiled_copy, epi_tile):
        """With a bias: the fragment's column slots (`fragment_column_slots`) for `_bias_columns`."""
        if self.has_bias:
            self.column_slot, self.column_value = fragment_column_slots(tiled_copy, epi_tile)

    @cute.jit
    def _bias_columns(self, params, tile: Tile, chunk, n_box, tRS_cD):
        """The bias of the thread's columns of the chunk, per B box and column slot (float32), one
        load a column; 0 outside a group and past n_box. None without a bias."""
        if const_expr(not self.has_bias):
            return None
        mBias = params.bias
        columns = cute.make_rmem_tensor((self.b_boxes * len(self.column_value),), Float32)
        g_safe = cutlass.min(tile.seg, cute.size(mBias, mode=[0]) - 1)
        load_column_values(columns, mBias, g_safe, chunk * self.epi_n, n_box, tRS_cD, self.column_value,
                           tile.is_group)
        return columns

    @cute.jit
    def epi_visit(self, params, tile: Tile, step, chunk, n_box, rAcc, rIn, rOut, tRS_cD, state):
        if const_expr(self._takes_probs()):
            # once a chunk, not once a tile: held across the tile, the ping-pong kernels spill
            load_row_values(state.row_probs, params.probs, tile, tRS_cD, self.slot_value, params.m_total)
        bias = self._bias_columns(params, tile, chunk, n_box, tRS_cD)
        for v in cutlass.range_constexpr(cute.size(rAcc[0])):
            act = self._pre_act(params, rAcc, rOut, v, state.row_probs, bias)
            if const_expr(self.act_amax):  # the amax of what the cast will read
                track_amax(state.amax, act, self.dtype, tile, tile.row0 + tRS_cD[v][0],
                           chunk * self.epi_n + tRS_cD[v][1], n_box)

    @cute.jit
    def epi_end_kernel(self, params, consumer_warp, state):
        if const_expr(self.act_amax):
            write_amax_parts(params.amax_parts, state.amax, consumer_warp, self.hook_warps)

    @cute.jit
    def _pre(self, rAcc, rOut, v, bias):
        """rOut[j][v] = pre of B box j (acc + bias) for value v of the chunk (``bias``: the
        chunk's `_bias_columns`)."""
        for j in cutlass.range_constexpr(self.b_boxes):
            x = rAcc[j][v]
            if const_expr(self.has_bias):
                x = x + bias[j * len(self.column_value) + self.column_slot[v]]
            rOut[j][v] = x

    @cute.jit
    def _pre_act(self, params, rAcc, rOut, v, row_probs, bias):
        """Value v of the chunk: rOut[j][v] = pre of B box j (acc + ``bias``, `_bias_columns`);
        returns the activation (times the probs of v's row, ``row_probs`` by row slot; None for an
        activation without probs), also written to rOut[-1][v] when this class stores it; None
        without one."""
        self._pre(rAcc, rOut, v, bias)
        value = None
        if const_expr(self.spec is not None):
            up = rOut[1][v] if const_expr(self.spec.glu) else None
            value, _, _ = ACTIVATION_MATH[self.spec.name](rOut[0][v], up, params.constants)
            if const_expr(self.spec.takes_probs):
                value = value * row_probs[self.row_slot[v]]
            if const_expr(self.stores_act):
                rOut[self.num_out - 1][v] = value
        return value


class GroupedGemmGatheredSm90(GroupedGemmActSm90):
    """`GroupedGemmActSm90` on "k" weights whose A rows are read by index (``gather_a``): pre[r] =
    x[index[r]] @ W[g].T (+ bias[g]), act = activation(pre): a permute folded into FC1's loads.
    x (T, K), K a multiple of 64; index (M,) int32, ids outside [0, T) clamped."""

    def __init__(self, dtype, tile_n, activation, has_bias, cluster_m=2, **opts):
        super().__init__(dtype, tile_n, activation, has_bias, "k", cluster_m, gather_a=True, **opts)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (T, K)
        mIndex: cute.Tensor,  # (M,) int32
        mW: cute.Tensor,  # (G, N, K)
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mPre: cute.Tensor,  # (M, N)
        mAct: cute.Tensor,  # (M, N/2) GLU, (M, N) srelu, None
        mBias: cute.Tensor,  # (G, N) or None
        mProbs: cute.Tensor,  # (M,) float32 or None
        constants: ActivationConstants,
        max_clusters: Int32,
        stream,
    ):
        outputs = (mPre,) if const_expr(self.spec is None) else (mPre, mAct)
        params = ForwardParams(mBias, mProbs, constants, cute.size(mIndex, mode=[0]))
        self.launch(mX, mW, mOffsets, outputs, (), params, max_clusters, stream, gather=(mX, mIndex))


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
        constants: ActivationConstants,
        max_clusters: Int32,
        stream,
    ):
        self._launch_cast(mX, mW, mOffsets, mPre, mData, mScale, mColData, mColScale, mBias, mProbs, constants,
                          max_clusters, stream)

    def _launch_cast(self, mX, mW, mOffsets, mPre, mData, mScale, mColData, mColScale, mBias, mProbs, constants,
                     max_clusters, stream, scales=None):
        outputs = (mPre,) if const_expr(self.stores_pre) else ()
        params = ForwardParams(mBias, mProbs, constants, cute.size(mX, mode=[0]), data=mData, scale=mScale,
                               col_data=mColData, col_scale=mColScale)
        self.launch(mX, mW, mOffsets, outputs, (), params, max_clusters, stream, scales)

    def epi_make_state(self, tiled_copy, epi_tile, shared):
        """(per block and row slot: scale_inv and the two multipliers of `e4m3_scale_inv`; GLU: the
        tile's act as stored, step-major, else None; fp32 and E4M3 scratch of one chunk; with
        ``columns`` the transposed staging tile and the groups' first blocks (shared))."""
        self.row_slot, self.slot_value = fragment_row_slots(tiled_copy, epi_tile)
        self.quad_pairs = quad_column_groups(tiled_copy, epi_tile, self.row_slot)
        self._column_slots(tiled_copy, epi_tile)
        frag, slots = len(self.row_slot), len(self.slot_value)
        return (
            [cute.make_rmem_tensor((self.blocks * slots,), Float32) for _ in range(3)],
            cute.make_rmem_tensor((self.num_steps * frag,), self.dtype) if self.spec is not None else None,
            cute.make_rmem_tensor((frag,), Float32),
            cute.make_rmem_tensor((frag,), cutlass.Float8E4M3FN),
            *shared,
        )

    @cute.jit
    def _stored(self, params, rAcc, rPre, v, row_probs, bias):
        """Value v of the chunk as `GroupedGemmActSm90` stores it (dtype): the act, or the output."""
        act = self._pre_act(params, rAcc, rPre, v, row_probs, bias)
        if const_expr(self.spec is None):
            act = rPre[0][v]
        return act.to(self.dtype)

    @cute.jit
    def epi_begin_tile(self, params, tile: Tile, n_box, tRS_rAcc, tRS_cD, state):
        m_total, mScale = params.m_total, params.scale
        scales, acts = state[0], state[1]
        frag, slots = len(self.row_slot), len(self.slot_value)
        rAcc = [cute.make_rmem_tensor((frag,), Float32) for _ in range(self.b_boxes)]
        rPre = [cute.make_rmem_tensor((frag,), Float32) for _ in range(self.b_boxes)]
        amax = scales[0]
        amax.fill(0.0)
        row_probs = None
        if const_expr(self._takes_probs()):
            row_probs = cute.make_rmem_tensor((slots,), Float32)
            load_row_values(row_probs, params.probs, tile, tRS_cD, self.slot_value, m_total)
        for step in cutlass.range_constexpr(self.num_steps):
            chunk = tile.nt * self.num_steps + step
            for v in cutlass.range_constexpr(frag):
                for j in cutlass.range_constexpr(self.b_boxes):
                    rAcc[j][v] = tRS_rAcc[(step + j * self.num_steps) * frag + v]
            bias = self._bias_columns(params, tile, chunk, n_box, tRS_cD)
            for v in cutlass.range_constexpr(frag):
                stored = self._stored(params, rAcc, rPre, v, row_probs, bias)
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
        m_total, mData = params.m_total, params.data
        (scale_inv, m1, m2), acts, scaled, data = state[:4]
        frag, slots = cute.size(rAcc[0]), len(self.slot_value)
        bias = self._bias_columns(params, tile, chunk, n_box, tRS_cD)
        for v in cutlass.range_constexpr(frag):
            if const_expr(self.spec is not None):
                self._pre(rAcc, rOut, v, bias)
                stored = acts[step * frag + v]
            else:  # recomputed as the first pass did; `scaled` is the scratch of `_pre`
                stored = self._stored(params, rAcc, [scaled], v, None, bias)
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
                store_staged_columns(params.col_data, params.col_scale, state[4], state[5], tile, col0, self.dtype,
                                     self.power_2_scales, self.epi_barrier)


class GroupedGemmActFp8Sm90(GroupedGemmActSm90):
    """`GroupedGemmActSm90` on block-scaled FP8 operands (the DeepSeek-V3 recipe).

    x (M, K) and W (G, N, K) E4M3 with float32 dequantization multipliers: xScale (M, ceil(K/128))
    per 1x128 block of x, wScale (G, ceil(N/128), ceil(K/128)) per 128x128 block of W[g]; each
    128-deep k-tile's product is scaled on the CUDA cores and added to the fp32 accumulator.
    Outputs and bias in ``dtype``; tile_n 128, 192 or 256; GLU: N/2 a multiple of 64.
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
        constants: ActivationConstants,
        max_clusters: Int32,
        stream,
    ):
        self._launch_forward(mX, mW, mOffsets, mPre, mAct, mBias, mProbs, mActAmax, constants, max_clusters,
                             stream, (mXScale, mWScale))


class GroupedGemmActQuantFp8Sm90(GroupedGemmActQuantSm90):
    """`GroupedGemmActQuantSm90` on block-scaled FP8 operands (x, W and their multipliers as
    `GroupedGemmActFp8Sm90` takes them): the FP8 FC1 whose GLU act leaves only as E4M3 1 x 128
    blocks (and, with ``columns``, their column-wise copy), bit for bit the cast of the act
    `GroupedGemmActFp8Sm90` writes. tile_n 256: each block's product in two 128-column halves, a
    tile's 128 act columns one cast block of each row; N/2 a multiple of 128.
    """

    def __init__(self, dtype, activation, has_bias, cluster_m=2, power_2_scales=False, columns=False, **opts):
        super().__init__(dtype, activation, has_bias, "k", cluster_m, power_2_scales, 256, columns,
                         ab_dtype=cutlass.Float8E4M3FN, **opts)

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,  # (M, K) E4M3
        mXScale: cute.Tensor,  # (M, ceil(K/128)) float32
        mW: cute.Tensor,  # (G, N, K) E4M3
        mWScale: cute.Tensor,  # (G, N/128, ceil(K/128)) float32
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mPre: cute.Tensor,  # (M, N)
        mData: cute.Tensor,  # (M, N/2) float8_e4m3fn
        mScale: cute.Tensor,  # (M, N/256) float32
        mColData: cute.Tensor,  # (N/2, 128 * blocks) float8_e4m3fn with columns, else None
        mColScale: cute.Tensor,  # (blocks, N/2) float32 with columns, else None
        mBias: cute.Tensor,  # (G, N) or None
        mProbs: cute.Tensor,  # (M,) float32 or None
        constants: ActivationConstants,
        max_clusters: Int32,
        stream,
    ):
        self._launch_cast(mX, mW, mOffsets, mPre, mData, mScale, mColData, mColScale, mBias, mProbs, constants,
                          max_clusters, stream, (mXScale, mWScale))
