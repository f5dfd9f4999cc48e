"""The WGMMA steps of the sm90 grouped GEMM core's mainloop (`grouped_gemm_sm90`, both schedules).

(The k-loops around them stay in the kernel body: the DSL carries pipeline states through a
dynamic loop only when the loop body itself advances them.)
"""

import cutlass
import cutlass.cute as cute


@cute.jit
def mma_stage(tiled_mma, acc, tCrA, tCrB, stage):
    """acc += the (tile_m, tile_n) product of the k-tile held in pipeline stage ``stage``."""
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, acc, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], acc)


@cute.jit
def mma_block(tiled_mma, acc_block, tCrA, tCrB, stage):
    """acc_block = the product of the k-tile (one FP8 scale block) in stage ``stage``; the
    caller turns ACCUMULATE off first, in its loop body (so the MMA stays loop-carried)."""
    for kb in cutlass.range_constexpr(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, acc_block, tCrA[(None, None, kb, stage)], tCrB[(None, None, kb, stage)], acc_block)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
