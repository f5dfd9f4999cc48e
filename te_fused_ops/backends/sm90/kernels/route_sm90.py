"""Top-k expert ids -> expert-ordered rows: a stable counting sort in three launches.

M slots (the (T, k) ids flattened, slot s = t * k + j), B = E + 1 buckets: expert e for an id in
[0, E), E for any other id (a dropped slot). Slot s goes to row offsets[bucket] + the number of
earlier slots in its bucket: torch's stable sort of the buckets, so every output is bit for bit
what `routing.route` computes with torch ops.

    count  CTA c counts the buckets of its SLOTS_PER_CTA slots: mCtaCounts[c, b]
    scan   one CTA, a thread per bucket: mCtaCounts[c, b] becomes the slots of bucket b in the
           CTAs before c; mOffsets (B,) the exclusive prefix of the bucket totals over b (the
           first row of each expert; mOffsets[E] the rows kept), mCounts (E,) the experts' totals
    place  CTA c counts again per warp, so each warp knows its first row in every bucket, then
           writes mSlotRows[s] = row, mRowSlots[row] = s and mRowTokens[row] = s // k

Warp w of CTA c takes slots c * SLOTS_PER_CTA + w * SLOTS_PER_WARP + 32 i + lane, i < BATCHES, a
batch of 32 consecutive slots at a time in slot order. Within a batch the lanes holding the same
bucket find each other with match.any: a lane's rank is the number of those below it, and the
lowest of them advances the warp's count of the bucket (each warp has its own row of counts in
shared memory, so no two lanes ever write one word at once and nothing depends on atomics).
"""

import cutlass
from cutlass import Int32, Int64, cute

WARP = 32
WARPS = 8
BATCHES = 8
SLOTS_PER_WARP = WARP * BATCHES
SLOTS_PER_CTA = SLOTS_PER_WARP * WARPS
MAX_BUCKETS = 1024  # E + 1 <= MAX_BUCKETS: the scan's CTA has a thread per bucket
SCAN_UNROLL = 8  # the scan's loads in flight per thread
FULL_MASK = 0xFFFFFFFF


class RouteSm90:
    """mIds (M,) int32/int64 expert ids; mCtaCounts (C, B) int32 scratch, C = ceil(M /
    SLOTS_PER_CTA); mOffsets (B,) int32; mCounts (E,) int32; mSlotRows (M,) int32; mRowSlots (M,)
    int64; mRowTokens (M,) int32; num_experts E (B = E + 1 <= MAX_BUCKETS); k slots per token."""

    @cute.jit
    def __call__(self, mIds: cute.Tensor, mCtaCounts: cute.Tensor, mOffsets: cute.Tensor, mCounts: cute.Tensor,
                 mSlotRows: cute.Tensor, mRowSlots: cute.Tensor, mRowTokens: cute.Tensor, num_experts: Int32,
                 k: Int32, stream):
        ctas = cute.size(mCtaCounts, mode=[0])
        block = (WARP * WARPS, 1, 1)
        self.count_kernel(mIds, mCtaCounts, num_experts).launch(grid=(ctas, 1, 1), block=block, stream=stream)
        self.scan_kernel(mCtaCounts, mOffsets, mCounts, num_experts).launch(
            grid=(1, 1, 1), block=(MAX_BUCKETS, 1, 1), stream=stream)
        self.place_kernel(mIds, mCtaCounts, mOffsets, mSlotRows, mRowSlots, mRowTokens, num_experts, k).launch(
            grid=(ctas, 1, 1), block=block, stream=stream)

    @cute.jit
    def _slot(self, i):
        """Slot of this lane in batch ``i`` of its warp."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        return bidx * SLOTS_PER_CTA + warp * SLOTS_PER_WARP + i * WARP + tidx % WARP

    @cute.jit
    def _buckets(self, mIds: cute.Tensor, num_experts: Int32):
        """(BATCHES,) int32: this lane's bucket in each batch; -1 past the last slot."""
        keys = cute.make_rmem_tensor(cute.make_layout(BATCHES), Int32)
        num_slots = cute.size(mIds, mode=[0])
        for i in cutlass.range_constexpr(BATCHES):
            slot = self._slot(i)
            key = Int32(-1)
            if slot < num_slots:
                key = num_experts
                expert = mIds[slot]
                if expert >= 0 and expert < num_experts:
                    key = Int32(expert)
            keys[i] = key
        return keys

    @cute.jit
    def _warp_counts(self, keys: cute.Tensor, num_experts: Int32):
        """(WARPS, MAX_BUCKETS) int32 shared counts, row w holding warp w's slots per bucket."""
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        sCounts = smem.allocate_tensor(Int32, cute.make_layout((WARPS, MAX_BUCKETS), stride=(MAX_BUCKETS, 1)), 16)
        for b in range(tidx, num_experts + 1, WARP * WARPS):
            for w in cutlass.range_constexpr(WARPS):
                sCounts[w, b] = Int32(0)
        cute.arch.sync_threads()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        for i in cutlass.range_constexpr(BATCHES):
            key = keys[i]
            peers = cute.arch.match_sync(FULL_MASK, key)
            if key >= 0 and (peers & cute.arch.lanemask_lt()) == 0:
                sCounts[warp, key] = sCounts[warp, key] + Int32(cute.arch.popc(peers))
            cute.arch.sync_warp()
        cute.arch.sync_threads()
        return sCounts

    @cute.kernel
    def count_kernel(self, mIds: cute.Tensor, mCtaCounts: cute.Tensor, num_experts: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        sCounts = self._warp_counts(self._buckets(mIds, num_experts), num_experts)
        for b in range(tidx, num_experts + 1, WARP * WARPS):
            total = Int32(0)
            for w in cutlass.range_constexpr(WARPS):
                total = total + sCounts[w, b]
            mCtaCounts[bidx, b] = total

    @cute.kernel
    def scan_kernel(self, mCtaCounts: cute.Tensor, mOffsets: cute.Tensor, mCounts: cute.Tensor, num_experts: Int32):
        b, _, _ = cute.arch.thread_idx()
        lane, warp = b % WARP, b // WARP
        ctas = cute.size(mCtaCounts, mode=[0])
        total = Int32(0)
        if b <= num_experts:  # CTA c's count becomes the count of the CTAs before it
            window = cute.make_rmem_tensor(cute.make_layout(SCAN_UNROLL), Int32)
            for c0 in range(0, ctas, SCAN_UNROLL):
                for i in cutlass.range_constexpr(SCAN_UNROLL):
                    if c0 + i < ctas:
                        window[i] = mCtaCounts[c0 + i, b]
                for i in cutlass.range_constexpr(SCAN_UNROLL):
                    if c0 + i < ctas:
                        mCtaCounts[c0 + i, b] = total
                        total = total + window[i]
        inclusive = total  # over the buckets: within the warp, then the warps before
        for step in cutlass.range_constexpr(5):
            other = cute.arch.shuffle_sync_up(inclusive, 1 << step)
            if lane >= (1 << step):
                inclusive = inclusive + other
        smem = cutlass.memory.SmemAllocator()
        sWarps = smem.allocate_tensor(Int32, cute.make_layout(MAX_BUCKETS // WARP), 16)
        if lane == WARP - 1:
            sWarps[warp] = inclusive
        cute.arch.sync_threads()
        if warp == 0:
            warp_total = sWarps[lane]
            for step in cutlass.range_constexpr(5):
                other = cute.arch.shuffle_sync_up(warp_total, 1 << step)
                if lane >= (1 << step):
                    warp_total = warp_total + other
            sWarps[lane] = warp_total
        cute.arch.sync_threads()
        first_row = inclusive - total
        if warp > 0:
            first_row = first_row + sWarps[warp - 1]
        if b <= num_experts:
            mOffsets[b] = first_row
        if b < num_experts:
            mCounts[b] = total

    @cute.kernel
    def place_kernel(self, mIds: cute.Tensor, mCtaCounts: cute.Tensor, mOffsets: cute.Tensor, mSlotRows: cute.Tensor,
                     mRowSlots: cute.Tensor, mRowTokens: cute.Tensor, num_experts: Int32, k: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        keys = self._buckets(mIds, num_experts)
        sCounts = self._warp_counts(keys, num_experts)
        for b in range(tidx, num_experts + 1, WARP * WARPS):  # counts -> each warp's first row per bucket
            row = mOffsets[b] + mCtaCounts[bidx, b]
            for w in cutlass.range_constexpr(WARPS):
                count = sCounts[w, b]
                sCounts[w, b] = row
                row = row + count
        cute.arch.sync_threads()
        for i in cutlass.range_constexpr(BATCHES):
            key = keys[i]
            peers = cute.arch.match_sync(FULL_MASK, key)
            below = peers & cute.arch.lanemask_lt()
            if key >= 0:
                slot = self._slot(i)
                row = sCounts[warp, key] + Int32(cute.arch.popc(below))
                mSlotRows[slot] = row
                mRowSlots[row] = Int64(slot)
                mRowTokens[row] = slot // k
            cute.arch.sync_warp()
            if key >= 0 and below == 0:
                sCounts[warp, key] = sCounts[warp, key] + Int32(cute.arch.popc(peers))
            cute.arch.sync_warp()
