"""One value per slot <-> one value per expert row, one launch each (the router probabilities and
their gradient in the MoE layer).

M slots (the (T, k) values flattened, slot s = t * k + j) and M rows in expert order, as a
`te_fused_ops.routing.Routing` maps them; rows from num_kept on are the dropped slots' (padding).

    to rows   row_values[r] = float32(slot_values[row_slots[r]])    r < num_kept, else 0
    to slots  slot_values[s] = sum_p row_parts[p, slot_rows[s]]     slot_rows[s] < num_kept, else 0
              (p = 0, 1, ... in order, in float32, rounded once to slot_values' type)

A thread per value; a row or slot id outside its tensor's extent counts as dropped, so no value
of the routing can make a read out of bounds.
"""

import cutlass
from cutlass import Float32, Int32, Int64, cute

THREADS = 256


class SlotValuesSm90:
    """``to_rows``: mSource (M,) slot values bf16/fp16/fp32, mIndex (M,) int64 row_slots, mOut (M,)
    float32 row values. Else: mSource (P, M) float32 row partials (P >= 1), mIndex (M,) int32
    slot_rows, mOut (M,) bf16/fp16/fp32 slot values. mNumKept (1,) int32 either way."""

    def __init__(self, to_rows: bool):
        self.to_rows = to_rows

    @cute.jit
    def __call__(self, mSource: cute.Tensor, mIndex: cute.Tensor, mNumKept: cute.Tensor, mOut: cute.Tensor, stream):
        ctas = (cute.size(mOut, mode=[0]) + THREADS - 1) // THREADS
        self.kernel(mSource, mIndex, mNumKept, mOut).launch(grid=(ctas, 1, 1), block=(THREADS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mSource: cute.Tensor, mIndex: cute.Tensor, mNumKept: cute.Tensor, mOut: cute.Tensor):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * THREADS + tidx
        if i < cute.size(mOut, mode=[0]):
            value = Float32(0.0)
            if cutlass.const_expr(self.to_rows):  # i is a row, mIndex[i] its slot
                slot = mIndex[i]
                if i < mNumKept[0] and slot >= Int64(0) and slot < Int64(cute.size(mSource, mode=[0])):
                    value = mSource[slot].to(Float32)
            else:  # i is a slot, mIndex[i] its row
                row = mIndex[i]
                if row >= Int32(0) and row < mNumKept[0] and row < cute.size(mSource, mode=[1]):
                    value = mSource[0, row]
                    for p in range(1, cute.size(mSource, mode=[0])):
                        value = value + mSource[p, row]
            mOut[i] = value.to(mOut.element_type)
