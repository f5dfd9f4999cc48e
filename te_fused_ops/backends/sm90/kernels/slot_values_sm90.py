"""One value per slot <-> one value per expert row, one launch each (the router probabilities and
their gradient in the MoE layer).

M slots (the (T, k) values flattened, slot s = t * k + j) and M rows in expert order, as a
`te_fused_ops.routing.Routing` maps them; rows from num_kept on are the dropped slots' (padding).

    to rows   mRowValues[r] = float32(mSlotValues[mRowSlots[r]])     r < num_kept, else 0
    to slots  mSlotValues[s] = sum_p mRowParts[p, mSlotRows[s]]      mSlotRows[s] < num_kept, else 0
              (p = 0, 1, ... in order, in float32, rounded once to mSlotValues' type)

A thread per value; a row or slot id outside its tensor's extent counts as dropped, so no value
of the routing can make a read out of bounds.
"""

import cutlass
from cutlass import Float32, Int32, Int64, cute

THREADS = 256


class SlotsToRowsSm90:
    """mSlotValues (M,) bf16/fp16/fp32; mRowSlots (M,) int64; mNumKept (1,) int32; mRowValues (M,)
    float32."""

    @cute.jit
    def __call__(self, mSlotValues: cute.Tensor, mRowSlots: cute.Tensor, mNumKept: cute.Tensor,
                 mRowValues: cute.Tensor, stream):
        ctas = (cute.size(mRowValues, mode=[0]) + THREADS - 1) // THREADS
        self.kernel(mSlotValues, mRowSlots, mNumKept, mRowValues).launch(
            grid=(ctas, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mSlotValues: cute.Tensor, mRowSlots: cute.Tensor, mNumKept: cute.Tensor,
               mRowValues: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        row = bidx * THREADS + tidx
        if row < cute.size(mRowValues, mode=[0]):
            value = Float32(0.0)
            if row < mNumKept[0]:
                slot = mRowSlots[row]
                if slot >= Int64(0) and slot < Int64(cute.size(mSlotValues, mode=[0])):
                    value = mSlotValues[slot].to(Float32)
            mRowValues[row] = value


class RowsToSlotsSm90:
    """mRowParts (P, M) float32 (P >= 1 partial sums per row); mSlotRows (M,) int32; mNumKept (1,)
    int32; mSlotValues (M,) bf16/fp16/fp32."""

    @cute.jit
    def __call__(self, mRowParts: cute.Tensor, mSlotRows: cute.Tensor, mNumKept: cute.Tensor,
                 mSlotValues: cute.Tensor, stream):
        ctas = (cute.size(mSlotValues, mode=[0]) + THREADS - 1) // THREADS
        self.kernel(mRowParts, mSlotRows, mNumKept, mSlotValues).launch(
            grid=(ctas, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mRowParts: cute.Tensor, mSlotRows: cute.Tensor, mNumKept: cute.Tensor,
               mSlotValues: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        slot = bidx * THREADS + tidx
        if slot < cute.size(mSlotValues, mode=[0]):
            total = Float32(0.0)
            row = mSlotRows[slot]
            num_rows = cute.size(mRowParts, mode=[1])
            if row >= Int32(0) and row < mNumKept[0] and row < num_rows:
                total = mRowParts[0, row]
                for p in range(1, cute.size(mRowParts, mode=[0])):
                    total = total + mRowParts[p, row]
            mSlotValues[slot] = total.to(mSlotValues.element_type)
