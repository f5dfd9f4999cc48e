"""Hopper (sm_90a) sync-free grouped weight gradient over the token dimension: the varlen-K
schedule of the grouped GEMM core (`grouped_gemm_sm90`).

    dW[g]         = dy[s:e].T @ x[s:e]      s, e = offsets[g], offsets[g+1] clamped to [0, M]
    main_grad[g] += dW[g]                   (opt-in fp32 accumulation)

dy (M, N) and x (M, K) row-major, read in place (groups may start at any row); dW / main_grad
(G, N, K) row-major. Per group this is a GEMM whose K dim is the group's tokens: A = dy_g^T
(N x tokens) and B = x_g^T (K x tokens), both MN-major, fed to 16-bit WGMMA from MN-major
swizzled shared-memory layouts through "ragged" token views that end at the group's last row
(the TMA unit zero-fills the rest of the last k-tile). Every group owns the same
ceil(N/128) * ceil(K/tile_n) output tiles, visited largest group first (ranked by k-tile count in
shared memory at start, for G <= SORT_MAX_G, else in index order), so the tiles of a wave cost
about the same and the last waves are the cheap ones; every other wave is dealt to the clusters in
reverse (`_next_tile_id`), so no cluster takes the dearest tile of each wave; an empty group's
tiles store zeros. With cluster_m=2 a pair of CTAs takes vertically adjacent m-tiles of one group
and n-tile (hence the same k-loop) and multicasts the shared x tile.

dW in ``dtype``: the core's ``defer_stores`` (a tile's output is stored under the next tile's
first WGMMAs). ``accumulate``: an fp32 epilogue with one C-tile load, main_grad + acc, stored back.

Block-scaled FP8 (``ab_dtype`` E4M3, the weight gradient of the DeepSeek-V3 recipe): the operands
are per-group column-wise copies of dy and x, E4M3 with 1 x 128 token blocks that never straddle
groups, in the block-padded layout of `BlockColumnQuantizeSm90`: dy^T (N, 128 * blocks) and x^T
(K, 128 * blocks), block b in columns [128 b, 128 b + 128), zeros past a group's last token,
group g's blocks from block_start[g] = sum over h < g of ceil(rows_h / 128); multipliers
(blocks, N) and (blocks, K). FP8 WGMMA reads K-major operands only, and a TMA box must start on a
16-byte boundary: the padding puts every k-tile (one block) on a 128-byte one and makes the
operands' tails zero, so no load is clipped. Each k-tile's product is promoted into the
accumulator scaled per (row, column) by the two blocks' multipliers, which the producer loads by
TMA into the stage next to the operands; group boundaries and block starts come from one warp's
prefix scan over the offsets at kernel start (`scan_group_blocks`, G <= SORT_MAX_G).
"""

import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr

from .group_tile_scheduler import RASTER_BAND, Tile
from .grouped_gemm_sm90 import GroupedGemmSm90
from .varlen_sm90 import ragged_tokens


def output_by_group(mOut: cute.Tensor) -> cute.Tensor:
    """The (N, K, G) view of dW / main_grad (G, N, K) that the core's varlen-K stores tile."""
    return cute.make_tensor(
        mOut.iterator,
        cute.make_layout(
            (cute.size(mOut, mode=[1]), cute.size(mOut, mode=[2]), cute.size(mOut, mode=[0])),
            stride=(mOut.stride[1], 1, mOut.stride[0]),
        ),
    )


def transposed_output_by_group(mOut: cute.Tensor) -> cute.Tensor:
    """The (K, N, G) view of dW (G, N, K), K contiguous: where the product dW^T = x_g^T dy_g is
    stored (`d_major` "m")."""
    return cute.make_tensor(
        mOut.iterator,
        cute.make_layout(
            (cute.size(mOut, mode=[2]), cute.size(mOut, mode=[1]), cute.size(mOut, mode=[0])),
            stride=(1, mOut.stride[1], mOut.stride[0]),
        ),
    )


class GroupedWgradSm90(GroupedGemmSm90):
    """Grouped dW = dy_g^T @ x_g for sm_90a (see the module docstring).

    Compile-time configuration: ``dtype`` of dy and x (cutlass.BFloat16 / Float16), ``tile_n``
    (128, 192 or 256, along K of dW; tile_m = 128 along N, tile_k = 64 tokens), ``ab_dtype`` (None:
    ``dtype``; cutlass.Float8E4M3FN: block-scaled FP8 operands, module docstring, dW in ``dtype``;
    tile_n 128, 192 or 256 (256: the block's product in two halves), tile_k 128), ``accumulate``
    (fp32 main_grad += dW instead of writing dW in ``dtype``), ``cluster_m`` (1, or 2: CTA pairs
    multicast the x tile), ``sort_groups`` (visit
    groups largest first), ``ab_stages`` / ``epi_slots`` (None: fill shared memory), ``c_stages``
    (accumulate: main_grad chunks loaded ahead), ``raster_band`` (`banded_tile`), ``pingpong``
    (each MMA warpgroup on tiles of its own, dW in ``dtype``; the core's docstring),
    ``overlap_promotion`` (FP8: two block products in flight, each block promoted under the next
    one's WGMMAs; the stores are not deferred then, nor past FP8 tile 128). The persistent grid
    size is a launch argument.
    """

    varlen_k = True
    epi_stores = ((0, 0),)

    def __init__(
        self, dtype, tile_n, accumulate, cluster_m=1, sort_groups=True, ab_stages=None,
        epi_slots=None, raster_band=RASTER_BAND, ab_dtype=None, c_stages=2, pingpong=False, overlap_promotion=False,
        gather_a=False, d_major="n",
    ):
        self.accumulate = accumulate
        self.sort_groups = sort_groups
        self.epi_loads = ((0, 0),) if accumulate else ()
        fp8 = ab_dtype is not None and ab_dtype.width == 8
        super().__init__(
            Float32 if accumulate else dtype, tile_n, b_major="k" if fp8 else "mn", cluster_m=cluster_m,
            ab_stages=ab_stages, epi_slots=epi_slots, ab_dtype=dtype if ab_dtype is None else ab_dtype,
            c_stages=c_stages, raster_band=raster_band, a_major="k" if fp8 else "mn",
            # FP8 past tile 128 or overlapped: no registers for the previous tile's outputs
            defer_stores=not (accumulate or pingpong or overlap_promotion or (fp8 and tile_n != 128)),
            pingpong=pingpong,
            overlap_promotion=overlap_promotion,
            gather_a=gather_a,
            d_major=d_major,
        )

    @cute.jit
    def __call__(
        self,
        mDy: cute.Tensor,  # (M, N); FP8: dy^T (N, 128 * blocks)
        mX: cute.Tensor,  # (M, K); FP8: x^T (K, 128 * blocks)
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mOut: cute.Tensor,  # (G, N, K): dW in dtype, or fp32 main_grad (accumulate)
        mScaleDy,  # FP8: (blocks, N) float32 multipliers of dy^T's token blocks; else None
        mScaleX,  # FP8: (blocks, K) of x^T's; else None
        num_tokens,  # FP8: M, the rows the offsets index (Int32); else None
        max_ctas: Int32,  # persistent grid size (SMs left free by the caller's margin)
        stream,
    ):
        m_total = num_tokens
        mA, mB, scales = mDy, mX, (mScaleDy, mScaleX)
        if const_expr(not self.block_scaled):
            m_total = cute.size(mDy, mode=[0])
            mA, mB, scales = ragged_tokens(mDy), ragged_tokens(mX), None
        mD = output_by_group(mOut)
        self.launch(mA, mB, mOffsets, (mD,), (mD,) if const_expr(self.accumulate) else (), (),
                    max_ctas // self.cluster_m, stream, scales, m_total)

    @cute.jit
    def epi_visit(self, params, tile: Tile, step, chunk, n_box, rAcc, rIn, rOut, tRS_cD, state):
        """dW = acc; accumulate: main_grad + acc."""
        if const_expr(self.accumulate):
            rOut[0].store(rAcc[0].load() + rIn[0].load())
        else:
            rOut[0].store(rAcc[0].load())


class GroupedWgradGatheredSm90(GroupedWgradSm90):
    """`GroupedWgradSm90` with one operand's rows read by index (the core's ``gather_a``, 128
    columns of the gathered operand a tile; the other operand by TMA as B, tile_n 128, 192 or 256,
    multicast over a CTA pair with ``cluster_m`` 2, the two CTAs gathering adjacent column blocks).

    ``gathered`` "x": dW[g] = dy[s:e].T @ x[index[s:e]], the permute of FC1's input folded into
    its weight gradient's loads, as the product dW^T = x_g^T dy_g, each tile stored transposed
    (``d_major`` "m"); dy (M, N), x (T, K). "dy": dW[g] = dy[index[s:e]].T @ x[s:e], the combine's
    backward folded into FC2's weight gradient (each expert row of its gradient a copy of its
    token's), stored as computed; dy (T, N), x (M, K). Widths multiples of 8; index (M,) int32,
    ids outside [0, T) clamped; dW in ``dtype``."""

    def __init__(self, dtype, tile_n, cluster_m=2, gathered="x", **opts):
        if gathered not in ("x", "dy"):
            raise ValueError(f"GroupedWgradGatheredSm90: gathered must be 'x' or 'dy', got {gathered!r}")
        self.gathered = gathered
        super().__init__(dtype, tile_n, False, cluster_m=cluster_m, gather_a=True,
                         d_major="m" if gathered == "x" else "n", **opts)

    @cute.jit
    def __call__(
        self,
        mDy: cute.Tensor,  # (M, N); gathered "dy": (T, N)
        mX: cute.Tensor,  # (T, K); gathered "dy": (M, K)
        mIndex: cute.Tensor,  # (M,) int32
        mOffsets: cute.Tensor,  # (G + 1,) int32
        mOut: cute.Tensor,  # (G, N, K)
        max_ctas: Int32,
        stream,
    ):
        if const_expr(self.gathered == "x"):
            self.launch(ragged_tokens(mX), ragged_tokens(mDy), mOffsets, (transposed_output_by_group(mOut),), (), (),
                        max_ctas // self.cluster_m, stream, None, cute.size(mDy, mode=[0]), gather=(mX, mIndex))
        else:
            self.launch(ragged_tokens(mDy), ragged_tokens(mX), mOffsets, (output_by_group(mOut),), (), (),
                        max_ctas // self.cluster_m, stream, None, cute.size(mX, mode=[0]), gather=(mDy, mIndex))
