"""Row movement of the MoE dispatch and combine: token order <-> expert order, at memory speed.

T tokens with k <= 16 slots each, H hidden (bf16/fp16, a multiple of 8), M = T * k rows in
expert order. mRows (T, k) int32: the row of slot (t, j); mNumKept (1,) int32: rows below it are
kept. A slot is kept when its row is in [0, min(num_kept, M)), else dropped, whatever the
values (a garbage row is never dereferenced).

    ScatterRowsSm90: out[rows[t, j]] = x[t] (* scale[t, j]) for kept slots, zeros for dropped
                     slots whose row is in [0, M); optionally dot[t, j] = <x[t], y[rows[t, j]]>
                     (0 for dropped slots)
    ScatterCastRowsSm90: the same rows cast to E4M3 on the way, 1x128 blocks: x[t] cast once
                     (bit for bit `BlockQuantizeSm90`), its data and block multipliers written
                     to the rows of its kept slots (zeros at dropped slots' rows)
    GatherSumSm90:   out[t] = sum over kept j of weights[t, j] * src[rows[t, j]] (weights absent:
                     1), in slot order j = 0..k-1, float32, rounded once

Work split: a warp per token, WARPS tokens per CTA, a CTA per WARPS tokens (on an H100, 2 or 4
warps per token measured within a few percent: faster at H = 7168, slower at H = 2048). Lane l
reads slot l's row (and scale / weight) once; slot j's reach every lane by shuffle, so the slot
loop is unrolled to MAX_SLOTS with a warp-uniform j < k guard.
Columns go in chunks of `unroll` 16-byte vectors per lane, vector u of lane l at l + 32 u: each
warp access covers 512 contiguous bytes (whole sectors, so stores need no read from DRAM) and a
lane has `unroll` loads in flight. The scatter reads a chunk of x once and stores it to the k
rows (x read once, each output row written once); the gather loads the chunk of each kept row in
turn, accumulating in registers. Every byte is touched once, so there is no L2 reuse to arrange;
L1 no-allocate / non-coherent loads and streaming stores measured no different.
"""

import cutlass
from cutlass import Float32, Int32, const_expr, cute

from .block_quantize_sm90 import e4m3_scale_inv, e4m3_scaled, packed_finite_abs_max

WARP = 32
WARPS = 4  # tokens per CTA
VEC = 8  # elements per 16-byte vector
MAX_SLOTS = 16  # k <= MAX_SLOTS: a lane per slot, the slot loop unrolled


def _vector(mT: cute.Tensor, row, v):
    """The VEC elements of mT (R, H) at ``row``, columns VEC v .. VEC v + VEC - 1."""
    return cute.local_tile(mT[row, None], (VEC,), (v,))


def _token_warp():
    """(token of this warp, lane)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    return bidx * WARPS + cute.arch.make_warp_uniform(tidx // WARP), tidx % WARP


def _launch_grid(mTokens: cute.Tensor):
    """(grid, block): a warp per row of mTokens (T, H)."""
    return ((cute.size(mTokens, mode=[0]) + WARPS - 1) // WARPS, 1, 1), (WARP * WARPS, 1, 1)


@cute.jit
def _lane_slot(mRows: cute.Tensor, mSlotValues, t, lane):
    """(row of slot ``lane``, its mSlotValues (T, k) float32 entry or 1); lanes >= k: row -1."""
    row = Int32(-1)
    value = Float32(1.0)
    if lane < cute.size(mRows, mode=[1]):
        row = mRows[t, lane]
        if const_expr(mSlotValues is not None):
            value = mSlotValues[t, lane]
    return row, value


@cute.jit
def _kept_limit(mNumKept: cute.Tensor, num_rows):
    """min(num_kept, M): a row r is kept when 0 <= r < this."""
    return cutlass.min(mNumKept[0], num_rows)


class ScatterRowsSm90:
    """mX (T, H) -> mOut (M, H) rows of the kept slots (times mScale (T, k) float32 when given,
    in float32, rounded once), zeros at dropped slots' rows in [0, M). ``dot``: also mDot (T, k)
    float32 = <x[t], mY[rows[t, j]]> (mY (M, H)), 0 for dropped slots; else mY, mDot are None."""

    unroll = 8  # 2048 columns a chunk: an H = 2048 row at once (4 per lane: 5% slower there)

    def __init__(self, scaled: bool, dot: bool):
        self.scaled = scaled
        self.dot = dot

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRows: cute.Tensor, mNumKept: cute.Tensor, mOut: cute.Tensor, mScale,
                 mY, mDot, stream):
        grid, block = _launch_grid(mX)
        self.kernel(mX, mRows, mNumKept, mOut, mScale, mY, mDot).launch(grid=grid, block=block, stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRows: cute.Tensor, mNumKept: cute.Tensor, mOut: cute.Tensor, mScale,
               mY, mDot):
        t, lane = _token_warp()
        num_slots = cute.size(mRows, mode=[1])
        num_rows = cute.size(mOut, mode=[0])
        vecs = cute.size(mX, mode=[1]) // VEC
        if t < cute.size(mX, mode=[0]):
            lane_row, lane_scale = _lane_slot(mRows, mScale, t, lane)
            kept_limit = _kept_limit(mNumKept, num_rows)
            tX = cute.make_rmem_tensor(cute.make_layout((self.unroll, VEC), stride=(VEC, 1)), mX.element_type)
            tY = cute.make_rmem_tensor(cute.make_layout((self.unroll, VEC), stride=(VEC, 1)), mX.element_type)
            tZero = cute.make_rmem_tensor(cute.make_layout(VEC), mOut.element_type)
            tZero.fill(0.0)
            tDot = cute.make_rmem_tensor(cute.make_layout(MAX_SLOTS), Float32)
            tDot.fill(0.0)
            for chunk in cutlass.range(0, vecs, WARP * self.unroll):
                for u in cutlass.range_constexpr(self.unroll):
                    v = chunk + u * WARP + lane
                    if v < vecs:
                        tX[u, None].store(_vector(mX, t, v).load())
                for j in cutlass.range_constexpr(MAX_SLOTS):
                    if j < num_slots:
                        row = cute.arch.shuffle_sync(lane_row, j)
                        if row >= 0 and row < kept_limit:
                            scale = cute.arch.shuffle_sync(lane_scale, j) if const_expr(self.scaled) else None
                            for u in cutlass.range_constexpr(self.unroll):
                                v = chunk + u * WARP + lane
                                if v < vecs:
                                    values = tX[u, None].load()
                                    if const_expr(self.scaled):
                                        values = (values.to(Float32) * scale).to(mOut.element_type)
                                    _vector(mOut, row, v).store(values)
                            if const_expr(self.dot):
                                tDot[j] = tDot[j] + self._chunk_dot(mY, row, chunk, lane, vecs, tX, tY)
                        elif row >= 0 and row < num_rows:
                            for u in cutlass.range_constexpr(self.unroll):
                                v = chunk + u * WARP + lane
                                if v < vecs:
                                    _vector(mOut, row, v).store(tZero.load())
            if const_expr(self.dot):
                for j in cutlass.range_constexpr(MAX_SLOTS):
                    if j < num_slots:
                        total = tDot[j]
                        for step in cutlass.range_constexpr(5):
                            total = total + cute.arch.shuffle_sync_bfly(total, 1 << step)
                        if lane == j:
                            mDot[t, j] = total

    @cute.jit
    def _chunk_dot(self, mY: cute.Tensor, row, chunk, lane, vecs, tX: cute.Tensor, tY: cute.Tensor) -> Float32:
        """This lane's part of <x chunk, y[row] chunk> in float32 (all its loads issued first)."""
        for u in cutlass.range_constexpr(self.unroll):
            if chunk + u * WARP + lane < vecs:
                tY[u, None].store(_vector(mY, row, chunk + u * WARP + lane).load())
        partial = Float32(0.0)
        for u in cutlass.range_constexpr(self.unroll):
            if chunk + u * WARP + lane < vecs:
                xs = tX[u, None].load().to(Float32)
                ys = tY[u, None].load().to(Float32)
                for i in cutlass.range_constexpr(VEC):
                    partial = partial + xs[i] * ys[i]
        return partial


class GatherSumSm90:
    """mSrc (M, H) -> mOut (T, H): out[t] = sum over kept j of mWeights[t, j] * src[rows[t, j]]
    (``weighted``: mWeights (T, k) float32, else None and 1), in slot order, float32, rounded
    once; a token without kept slots gets zeros."""

    unroll = 4  # 1024 columns a chunk: 8 measured up to 1.5% slower at H = 7168, up to 1% faster at k = 2

    def __init__(self, weighted: bool):
        self.weighted = weighted

    @cute.jit
    def __call__(self, mSrc: cute.Tensor, mRows: cute.Tensor, mNumKept: cute.Tensor, mOut: cute.Tensor, mWeights,
                 stream):
        grid, block = _launch_grid(mOut)
        self.kernel(mSrc, mRows, mNumKept, mOut, mWeights).launch(grid=grid, block=block, stream=stream)

    @cute.kernel
    def kernel(self, mSrc: cute.Tensor, mRows: cute.Tensor, mNumKept: cute.Tensor, mOut: cute.Tensor, mWeights):
        t, lane = _token_warp()
        num_slots = cute.size(mRows, mode=[1])
        vecs = cute.size(mOut, mode=[1]) // VEC
        if t < cute.size(mOut, mode=[0]):
            lane_row, lane_weight = _lane_slot(mRows, mWeights, t, lane)
            kept_limit = _kept_limit(mNumKept, cute.size(mSrc, mode=[0]))
            tSrc = cute.make_rmem_tensor(cute.make_layout((self.unroll, VEC), stride=(VEC, 1)), mSrc.element_type)
            tAcc = cute.make_rmem_tensor(cute.make_layout((self.unroll, VEC), stride=(VEC, 1)), Float32)
            for chunk in cutlass.range(0, vecs, WARP * self.unroll):
                tAcc.fill(0.0)
                for j in cutlass.range_constexpr(MAX_SLOTS):
                    if j < num_slots:
                        row = cute.arch.shuffle_sync(lane_row, j)
                        if row >= 0 and row < kept_limit:
                            for u in cutlass.range_constexpr(self.unroll):
                                v = chunk + u * WARP + lane
                                if v < vecs:
                                    tSrc[u, None].store(_vector(mSrc, row, v).load())
                            weight = cute.arch.shuffle_sync(lane_weight, j) if const_expr(self.weighted) else None
                            for u in cutlass.range_constexpr(self.unroll):
                                values = tSrc[u, None].load().to(Float32)
                                if const_expr(self.weighted):
                                    values = values * weight
                                tAcc[u, None].store(tAcc[u, None].load() + values)
                for u in cutlass.range_constexpr(self.unroll):
                    v = chunk + u * WARP + lane
                    if v < vecs:
                        _vector(mOut, t, v).store(tAcc[u, None].load().to(mOut.element_type))


class ScatterCastRowsSm90:
    """mX (T, H) bf16/fp16 -> mData (M, H) E4M3 and mScaleInv (M, ceil(H/128)) float32: each
    token's row cast once in 1x128 blocks (amax over the block's finite values, multiplier and
    E4M3 values exactly as `BlockQuantizeSm90` makes them), written to the row of each kept slot;
    a dropped slot's row in [0, M) gets zero data and multipliers.

    A chunk is ``unroll`` 16-byte vectors a lane (vector u of lane l at l + 32 u, as the other
    row kernels): the 16 lanes of a half-warp hold one 128-column block, whose amax they reduce
    by shuffles; each lane stores its 8 E4M3 bytes, the half-warp's first lane the multiplier."""

    unroll = 4  # 1024 columns a chunk

    def __init__(self, power_2_scales: bool):
        self.power_2_scales = power_2_scales

    @cute.jit
    def __call__(self, mX: cute.Tensor, mRows: cute.Tensor, mNumKept: cute.Tensor, mData: cute.Tensor,
                 mScaleInv: cute.Tensor, stream):
        grid, block = _launch_grid(mX)
        self.kernel(mX, mRows, mNumKept, mData, mScaleInv).launch(grid=grid, block=block, stream=stream)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mRows: cute.Tensor, mNumKept: cute.Tensor, mData: cute.Tensor,
               mScaleInv: cute.Tensor):
        t, lane = _token_warp()
        num_slots = cute.size(mRows, mode=[1])
        num_rows = cute.size(mData, mode=[0])
        vecs = cute.size(mX, mode=[1]) // VEC
        if t < cute.size(mX, mode=[0]):
            lane_row, _ = _lane_slot(mRows, None, t, lane)
            kept_limit = _kept_limit(mNumKept, num_rows)
            tX = cute.make_rmem_tensor(cute.make_layout((self.unroll, VEC), stride=(VEC, 1)), mX.element_type)
            tQ = cute.make_rmem_tensor(cute.make_layout((self.unroll, VEC), stride=(VEC, 1)), cutlass.Float8E4M3FN)
            tScale = cute.make_rmem_tensor(cute.make_layout(self.unroll), Float32)
            tZero = cute.make_rmem_tensor(cute.make_layout(VEC), cutlass.Float8E4M3FN)
            tZero.fill(0.0)
            values = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
            for chunk in cutlass.range(0, vecs, WARP * self.unroll):
                for u in cutlass.range_constexpr(self.unroll):
                    v = chunk + u * WARP + lane
                    tX[u, None].fill(0.0)
                    if v < vecs:
                        tX[u, None].store(_vector(mX, t, v).load())
                for u in cutlass.range_constexpr(self.unroll):
                    amax = packed_finite_abs_max(tX[u, None])
                    for step in cutlass.range_constexpr(4):  # the 16 lanes of this block
                        amax = cute.arch.fmax(amax, cute.arch.shuffle_sync_bfly(amax, 8 >> step))
                    scales = e4m3_scale_inv(amax, self.power_2_scales)
                    tScale[u] = scales[0]
                    for i in cutlass.range_constexpr(VEC):
                        values[i] = e4m3_scaled(Float32(tX[u, i]), *scales, self.power_2_scales)
                    tQ[u, None].store(values.load().to(cutlass.Float8E4M3FN))
                for j in cutlass.range_constexpr(MAX_SLOTS):
                    if j < num_slots:
                        row = cute.arch.shuffle_sync(lane_row, j)
                        if row >= 0 and row < kept_limit:
                            for u in cutlass.range_constexpr(self.unroll):
                                v = chunk + u * WARP + lane
                                if v < vecs:
                                    _vector(mData, row, v).store(tQ[u, None].load())
                                    if lane % 16 == 0:
                                        mScaleInv[row, v // 16] = tScale[u]
                        elif row >= 0 and row < num_rows:
                            for u in cutlass.range_constexpr(self.unroll):
                                v = chunk + u * WARP + lane
                                if v < vecs:
                                    _vector(mData, row, v).store(tZero.load())
                                    if lane % 16 == 0:
                                        mScaleInv[row, v // 16] = Float32(0.0)
