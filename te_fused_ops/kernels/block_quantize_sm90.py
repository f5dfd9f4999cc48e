"""E4M3 block quantization ("fp8_blockwise"): 1 x 128 blocks of activations, 128 x 128 of weights.

For each block of ``block_rows`` x 128 elements of x (G, R, C), bf16/fp16:

    amax      = max |x| over the block's finite values (NaN and +-Inf count as 0)
    scale_inv = amax / 448 (IEEE division), 1 where that is 0
    data      = E4M3(x / scale_inv), round to nearest even, saturating to +-448 (NaN stays NaN)

bit for bit what `te_fused_ops.quantization` computes in torch for Float8BlockScaling with
power_2_scales=False. One warp per block: lane l holds columns 4l..4l+3 of each block row;
the amax is a butterfly over the warp. Blocks at the right / bottom edge are partial (a block
never crosses from one group g into the next). Grid-stride over blocks.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32

WARP = 32
WARPS = 4
COLS = 128
E4M3_MAX = 448.0


class BlockQuantizeSm90:
    """mX (G, R, C) -> mData (G, R, C) E4M3, mScaleInv (G, ceil(R / block_rows), ceil(C / 128))
    float32. ``block_rows``: 1 (activations, 1 x 128) or 128 (weights, 128 x 128)."""

    def __init__(self, block_rows: int):
        if block_rows not in (1, 128):
            raise ValueError("block_rows must be 1 or 128")
        self.block_rows = block_rows

    @cute.jit
    def __call__(self, mX: cute.Tensor, mData: cute.Tensor, mScaleInv: cute.Tensor, max_ctas: Int32, stream):
        self.kernel(mX, mData, mScaleInv).launch(grid=(max_ctas, 1, 1), block=(WARP * WARPS, 1, 1), stream=stream)

    @cute.jit
    def _finite_abs(self, value: Float32) -> Float32:
        magnitude = cutlass.max(value, -value)
        result = Float32(0.0)
        if magnitude < Float32(float("inf")):  # false for NaN and Inf
            result = magnitude
        return result

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mData: cute.Tensor, mScaleInv: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        lane = tidx % WARP
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        groups = cute.size(mX, mode=[0])
        rows = cute.size(mX, mode=[1])
        cols = cute.size(mX, mode=[2])
        row_blocks = cute.size(mScaleInv, mode=[1])
        col_blocks = cute.size(mScaleInv, mode=[2])
        num_blocks = groups * row_blocks * col_blocks
        values = cute.make_rmem_tensor(cute.make_layout(4), Float32)
        quantized = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float8E4M3FN)

        block = bidx * WARPS + warp
        while block < num_blocks:
            g = block // (row_blocks * col_blocks)
            rb = block // col_blocks % row_blocks
            cb = block % col_blocks
            row0 = rb * self.block_rows
            row_end = cutlass.min(row0 + self.block_rows, rows)
            col0 = cb * COLS + lane * 4
            amax = Float32(0.0)
            for r in range(row0, row_end):
                for i in cutlass.range_constexpr(4):
                    if col0 + i < cols:
                        amax = cutlass.max(amax, self._finite_abs(Float32(mX[g, r, col0 + i])))
            for step in cutlass.range_constexpr(5):
                amax = cutlass.max(amax, cute.arch.shuffle_sync_bfly(amax, 1 << step))
            scale_inv = amax / Float32(E4M3_MAX)
            if scale_inv == Float32(0.0):  # amax is finite: only 0 needs replacing
                scale_inv = Float32(1.0)
            for r in range(row0, row_end):
                for i in cutlass.range_constexpr(4):
                    values[i] = Float32(0.0)
                    if col0 + i < cols:
                        values[i] = Float32(mX[g, r, col0 + i]) / scale_inv
                quantized.store(values.load().to(cutlass.Float8E4M3FN))
                for i in cutlass.range_constexpr(4):
                    if col0 + i < cols:
                        mData[g, r, col0 + i] = quantized[i]
            if lane == 0:
                mScaleInv[g, rb, cb] = scale_inv
            block = block + gdim * WARPS
