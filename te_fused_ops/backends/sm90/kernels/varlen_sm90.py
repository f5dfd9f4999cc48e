"""Varlen views for the sm90 grouped GEMM core: TMA coordinate views whose row (varlen-M) or token
(varlen-K) extent ends at one group's last row, so the TMA unit clips (stores) or zero-fills (loads)
past it without per-group descriptors.

Two extra modes with strides that wrap around the 64-bit address space carry the group's start and
length: element (BIG - length + r, ..., BIG, start + length) sits at row start + r.
"""

import cutlass.cute as cute
from cutlass import Int32, Int64

BIG = 2**30
HUGE = 2**31 - 1


def ragged_rows(t: cute.Tensor) -> cute.Tensor:
    """(rows, cols) row-major tensor -> (BIG, cols, HUGE, HUGE) view for ragged TMA stores.

    Element (BIG - length + r, c, BIG, start + length) sits at offset
    (start + r) * ld + c + BIG * 2**34 = (start + r) * ld + c (mod 2**64): rows r >= length are
    out of bounds of mode 0 and clipped by the TMA unit."""
    ld = t.stride[0]
    layout = cute.make_layout(
        (BIG, t.shape[1], HUGE, HUGE), stride=(ld, 1, Int64(2**34) - ld, ld)
    )
    return cute.make_tensor(t.iterator, layout)


def segment_view(mD_ragged: cute.Tensor, start: Int32, length: Int32) -> cute.Tensor:
    """Coordinate tensor whose rows 0..length-1 are rows start..start+length-1 of the output."""
    return cute.domain_offset(
        (BIG - length, None), mD_ragged[(None, None, BIG, start + length)]
    )


def ragged_tokens(t: cute.Tensor) -> cute.Tensor:
    """(tokens, C) row-major -> (C, BIG, HUGE, HUGE) view whose token mode can be clipped.

    Element (c, BIG - length + r, BIG, start + length) sits at offset
    c + (start + r) * ld + BIG * 2**34 = c + (start + r) * ld (mod 2**64); tokens r >= length
    fall outside mode 1 and the TMA unit zero-fills them."""
    ld = t.stride[0]
    layout = cute.make_layout((t.shape[1], BIG, HUGE, HUGE), stride=(1, ld, Int64(2**34) - ld, ld))
    return cute.make_tensor(t.iterator, layout)


def group_tokens(mRagged: cute.Tensor, start: Int32, length: Int32) -> cute.Tensor:
    """(C, tokens) coordinate view of one group of a `ragged_tokens` view: token r < length is
    row start + r."""
    return cute.domain_offset((None, BIG - length), mRagged[(None, None, BIG, start + length)])


def rows_by_block(t: cute.Tensor) -> cute.Tensor:
    """(blocks, C) row-major multipliers -> the (C, blocks) view the scale TMA tiles (tile, 1)."""
    return cute.make_tensor(t.iterator, cute.make_layout((t.shape[1], t.shape[0]), stride=(1, t.stride[0])))



def group_token_view(mTokens: cute.Tensor, start: Int32, length: Int32, block0: Int32, block_padded: bool, tile_k: int):
    """Varlen-K: TMA coordinate view of one group's tokens. ``block_padded`` (FP8): (rows, tokens)
    of the block-padded copy from the group's first block ``block0``; else the `ragged_tokens` view
    clipped at its last token."""
    if block_padded:
        return cute.domain_offset((0, block0 * tile_k), mTokens)
    return group_tokens(mTokens, start, length)


def output_view(mD: cute.Tensor, varlen_k: bool, seg: Int32, start: Int32, length: Int32) -> cute.Tensor:
    """The (rows, cols) coordinate view of an output that a tile of segment ``seg`` (rows [start,
    start + length)) writes: the ragged rows of the segment (``ragged_rows`` view); varlen-K, group
    seg's (N, K_out) slice of the (N, K_out, G) output."""
    if varlen_k:
        return mD[(None, None, seg)]
    return segment_view(mD, start, length)


def input_view(mC: cute.Tensor, varlen_k: bool, seg: Int32, start: Int32) -> cute.Tensor:
    """The (rows, cols) coordinate view of a C-tile input for a tile of segment ``seg`` from row
    ``start``; varlen-K, group seg's (N, K_out) slice."""
    if varlen_k:
        return mC[(None, None, seg)]
    return cute.domain_offset((start, None), mC)
