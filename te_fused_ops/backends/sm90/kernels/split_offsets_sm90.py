"""Split sizes -> clamped group offsets in one launch (one CTA, block-wide prefix sum).

    offsets[0] = 0,  offsets[g+1] = min(sum_{j<=g} clamp(sizes[j], 0, M), M)

The same values as `te_fused_ops.splits.split_offsets` computes with torch ops (six launches):
the running sum saturates at M, which for nonnegative terms equals clamping the exact sum, so the
int32 partial sums never overflow and offsets are nondecreasing within [0, M] whatever the sizes.
Thread t walks a contiguous chunk of ceil(G / 1024) sizes; chunk totals are scanned with warp
shuffles, then across warps through shared memory; each thread then writes its chunk's offsets.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64

THREADS = 1024
WARP = 32


@cute.jit
def _saturating_add(a: Int64, b: Int64, limit: Int64) -> Int64:
    return cutlass.min(a + b, limit)


class SplitOffsetsSm90:
    """mSizes (G,) int32/int64, mOffsets (G+1,) int32 (the caller allocates G+1), num_rows M."""

    @cute.jit
    def __call__(self, mSizes: cute.Tensor, mOffsets: cute.Tensor, num_rows: Int32, stream):
        self.kernel(mSizes, mOffsets, num_rows).launch(grid=(1, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.jit
    def _clamped(self, mSizes: cute.Tensor, i, limit: Int64) -> Int64:
        value = Int64(mSizes[i])
        return cutlass.max(cutlass.min(value, limit), Int64(0))

    @cute.kernel
    def kernel(self, mSizes: cute.Tensor, mOffsets: cute.Tensor, num_rows: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        lane = tidx % WARP
        warp = tidx // WARP
        limit = Int64(num_rows)
        num_groups = cute.size(mSizes, mode=[0])
        per_thread = (num_groups + THREADS - 1) // THREADS
        start = cutlass.min(tidx * per_thread, num_groups)
        end = cutlass.min(start + per_thread, num_groups)

        chunk = Int64(0)
        for i in range(start, end):
            chunk = _saturating_add(chunk, self._clamped(mSizes, i, limit), limit)

        # inclusive scan of the chunk totals within the warp (values <= M fit int32)
        inclusive = Int32(chunk)
        for step in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(inclusive, 1 << step)
            if lane >= (1 << step):
                inclusive = Int32(_saturating_add(Int64(inclusive), Int64(other), limit))

        smem = cutlass.memory.SmemAllocator()
        sWarp = smem.allocate_tensor(Int32, cute.make_layout(WARP), byte_alignment=16)
        if lane == WARP - 1:
            sWarp[warp] = inclusive
        cute.arch.sync_threads()
        if warp == 0:
            total = sWarp[lane]
            for step in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(total, 1 << step)
                if lane >= (1 << step):
                    total = Int32(_saturating_add(Int64(total), Int64(other), limit))
            sWarp[lane] = total
        cute.arch.sync_threads()

        # exclusive prefix of this thread's chunk: earlier warps, then earlier lanes of this warp
        before_lane = cute.arch.shuffle_sync_up(inclusive, 1)
        running = Int64(0)
        if warp > 0:
            running = Int64(sWarp[warp - 1])
        if lane > 0:
            running = _saturating_add(running, Int64(before_lane), limit)
        if tidx == 0:
            mOffsets[0] = Int32(0)
        for i in range(start, end):
            running = _saturating_add(running, self._clamped(mSizes, i, limit), limit)
            mOffsets[i + 1] = Int32(running)
