"""E4M3 block quantization ("fp8_blockwise"), per-tensor quantization ("fp8_current") and the
inverse: 1 x 128 blocks of activations, 128 x 128 of weights.

Quantize, for each block of ``block_rows`` x 128 elements of x (G, R, C), bf16/fp16:

    amax      = max |x| over the block's finite values (NaN and +-Inf count as 0)
    scale_inv = amax / 448 (IEEE division), rounded up to a power of two with power_2_scales;
                1 where that is 0
    data      = E4M3(x / scale_inv), round to nearest even, saturating to +-448 (NaN stays NaN);
                the division is a multiplication by the block's reciprocal and one exact-residual
                correction (power-of-two scales: two exact multiplications), `e4m3_scaled`

Dequantize, for data (G, R, C) E4M3 and 1 x 128 multipliers scale_inv (G, R, ceil(C / 128)):

    out = (float32(data) * scale_inv) clamped to out's finite range (NaN stays NaN), rounded to nearest even

With one scale for the whole tensor (Float8CurrentScaling) ``amax`` is the tensor's: `TensorAmaxSm90`
writes one partial amax per CTA, and each CTA of the cast reduces those parts before it casts, so
the two launches need no zeroed buffer, atomics or host sync; the scale is written to every block
of the multiplier grid the FP8 GEMM reads.

All bit for bit what `te_fused_ops.quantization` computes in torch (Float8BlockScaling,
Float8CurrentScaling; `QuantizedTensor.dequantize`). C is a multiple of 8. `e4m3_scale_inv` and `e4m3_scaled` are the
per-block and per-value steps, shared with the GEMM epilogues that quantize.

Work split: a warp covers rows of one 128-column block two at a time, lanes 0-15 the even and
16-31 the odd ones; lane l holds 8 consecutive columns (one 16-byte access). Blocks at the right
/ bottom edge are partial (a block never crosses from one group g into the next). Grid-stride
over work items.
"""

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, const_expr
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

from .group_tile_scheduler import scan_group_blocks
from .ptx_sm90 import ptx_value

WARP = 32
WARPS = 8
COLS = 128
VEC = 8  # elements per lane per row
E4M3_MAX = 448.0
TINY_SCALE, TINY_SCALE_P2 = 2.0**-60, 2.0**-100  # scale_inv below these: m2 != 1 (`e4m3_scale_inv`)
BLOCK_CTAS_PER_SM = 3  # 128 x 128 items: the CTAs resident on an SM (register cap), the launch's grid


@dsl_user_op
def _bits(x: Float32, *, loc=None, ip=None) -> Int32:
    return Int32(llvm.bitcast(T.i32(), Float32(x).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def _from_bits(bits: Int32, *, loc=None, ip=None) -> Float32:
    return Float32(llvm.bitcast(T.f32(), Int32(bits).ir_value(loc=loc, ip=ip), loc=loc, ip=ip))


@dsl_user_op
def _fma(a: Float32, b: Float32, c: Float32, *, loc=None, ip=None) -> Float32:
    """a * b + c with one rounding (fma.rn.f32)."""
    return Float32(llvm.intr_fma(*(Float32(v).ir_value(loc=loc, ip=ip) for v in (a, b, c)), loc=loc, ip=ip))


@dsl_user_op
def e4m3_word(a: Float32, b: Float32, c: Float32, d: Float32, *, loc=None, ip=None) -> Int32:
    """E4M3(a) .. E4M3(d) packed into one word, a in the lowest byte (round to nearest even,
    saturating to +-448, NaN stays NaN: torch's cast): two cvt.rn.satfinite.e4m3x2.f32 and one
    move, where a vector conversion of four values shuffles the bytes with three PRMTs."""
    asm = ("{ .reg .b16 lo, hi;\n"
           "cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;\n"
           "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;\n"
           "mov.b32 $0, {lo, hi}; }")
    return Int32(ptx_value(T.i32(), [Float32(a), Float32(b), Float32(c), Float32(d)], asm, "=r,f,f,f,f",
                           loc=loc, ip=ip))


@dsl_user_op
def _prmt(a: Int32, b: Int32, selector: int, *, loc=None, ip=None) -> Int32:
    """prmt.b32: byte i of the result is byte ``selector``'s nibble i of the 8 bytes (b, a), a lowest."""
    return Int32(ptx_value(T.i32(), [Int32(a), Int32(b)], f"prmt.b32 $0, $1, $2, {selector:#x};", "=r,r,r",
                           loc=loc, ip=ip))


@dsl_user_op
def _e4m3_pair_to_f16x2(word: Int32, high: bool, *, loc=None, ip=None) -> Int32:
    """The two E4M3 bytes in the low (or ``high``) 16 bits of ``word`` as an f16x2 pair, exactly
    (one cvt.rn.f16x2.e4m3x2: the upper byte to the upper half)."""
    asm = ("{ .reg .b16 lo, hi;\n"
           "mov.b32 {lo, hi}, $1;\n"
           f"cvt.rn.f16x2.e4m3x2 $0, {'hi' if high else 'lo'}; }}")
    return Int32(ptx_value(T.i32(), [Int32(word)], asm, "=r,r", loc=loc, ip=ip))


@dsl_user_op
def _f16_half_to_f32(pair: Int32, high: bool, *, loc=None, ip=None) -> Float32:
    """The low (or ``high``) f16 half of ``pair`` as float32, exactly."""
    asm = ("{ .reg .b16 lo, hi;\n"
           "mov.b32 {lo, hi}, $1;\n"
           f"cvt.f32.f16 $0, {'hi' if high else 'lo'}; }}")
    return Float32(ptx_value(T.f32(), [Int32(pair)], asm, "=f,r", loc=loc, ip=ip))


@cute.jit
def _widened(t16: cute.Tensor, j: cutlass.Constexpr[int]) -> Float32:
    """float32(t16[j]) of the 16-bit register tensor t16 (an even size): for bf16 one instruction
    on the packed word (a shift for the low half, a mask for the high one, where the generic
    conversion moves the high half down first)."""
    result = Float32(0.0)
    if const_expr(t16.element_type == cutlass.BFloat16):
        word = cute.recast_tensor(t16, Int32)[j // 2]
        result = _from_bits(word << 16 if j % 2 == 0 else word & Int32(-65536))
    else:
        result = Float32(t16[j])
    return result


@cute.jit
def _dequantized(tBytes: cute.Tensor, multiplier: Float32, tOut: cute.Tensor):
    """tOut[j] = float32(tBytes[j]) * multiplier for the E4M3 register tensor tBytes (a multiple
    of 4 values) into float32 tOut: the bytes converted two at a time through f16 (exact), about
    1.5 instructions a value against 4 for one value at a time."""
    words = cute.recast_tensor(tBytes, Int32)
    for w in cutlass.range_constexpr(cute.size(words)):
        for h in cutlass.range_constexpr(2):
            pair = _e4m3_pair_to_f16x2(words[w], h == 1)
            for e in cutlass.range_constexpr(2):
                tOut[4 * w + 2 * h + e] = _f16_half_to_f32(pair, e == 1) * multiplier


@cute.jit
def _pow2_ceil(value: Float32) -> Float32:
    """The least power of two >= value (finite, >= 0; 0 stays 0), exactly, subnormals included:
    those are scaled by 2**24 first (exact), so only a normal float's exponent is rounded up."""
    tiny = value < Float32(2.0**-126)
    scaled = value
    if tiny:
        scaled = value * Float32(2.0**24)
    bits = _bits(scaled)
    if bits & Int32(0x7FFFFF) != Int32(0):
        bits = (bits & Int32(0x7F800000)) + Int32(0x800000)
    result = _from_bits(bits)
    if tiny:
        result = result * Float32(2.0**-24)
    return result


@cute.jit
def e4m3_scale_inv(amax: Float32, power_2_scales: cutlass.Constexpr[bool]):
    """(scale_inv, m1, m2) of a block with finite amax: scale_inv as the torch quantizer makes it
    (amax / 448, IEEE; rounded up to a power of two with ``power_2_scales``; 1 where 0) and the
    two multipliers `e4m3_scaled` divides with. Power-of-two scales: value * m1 * m2 ==
    value / scale_inv, both products exact (1 / scale_inv alone overflows below 2**-127). Float32
    scales: m2 = 2**64 below 2**-60, else 1 (value and scale_inv are multiplied by it, exactly),
    m1 = 1 / (scale_inv * m2), correctly rounded."""
    scale_inv = amax / Float32(E4M3_MAX)
    if const_expr(power_2_scales):
        scale_inv = _pow2_ceil(scale_inv)
    if scale_inv == Float32(0.0):
        scale_inv = Float32(1.0)
    m1, m2 = Float32(1.0), Float32(1.0)
    if const_expr(power_2_scales):
        # powers of two: these reciprocals are exact, and value * m1 is exact (scaled up, normal)
        if scale_inv < Float32(TINY_SCALE_P2):
            m1 = Float32(2.0**-24) / scale_inv
            m2 = Float32(2.0**24)
        else:
            m1 = Float32(1.0) / scale_inv
    else:
        if scale_inv < Float32(TINY_SCALE):
            m2 = Float32(2.0**64)
        m1 = Float32(1.0) / (scale_inv * m2)
    return scale_inv, m1, m2


@cute.jit
def e4m3_scaled(value: Float32, scale_inv: Float32, m1: Float32, m2: Float32,
                power_2_scales: cutlass.Constexpr[bool], above_amax: cutlass.Constexpr[bool] = False,
                plain: cutlass.Constexpr[bool] = False) -> Float32:
    """value / scale_inv in float32, correctly rounded (the value the E4M3 cast rounds).

    Float32 scales (Markstein): with v = value * m2, s = scale_inv * m2 and m1 = RN(1 / s), q = RN(v m1)
    is within an ulp of v / s, the residual r = v - s q is exact (one fma), and RN(q + r m1) is the
    correctly rounded quotient while v stays above 2**-102 (the 2**64 scaling of tiny blocks keeps
    it there for every quotient the E4M3 cast does not round to zero). Where r is 0 or NaN (exact
    quotients, signed zeros, +-Inf and NaN values) q itself is the quotient. ``above_amax``: finite
    values may exceed the amax the scale came from (a tensor scale whose amax skips padding rows),
    so q is clamped to +-2**126 first: past float32's range r stays finite (or +-Inf) and the
    result saturates to the same E4M3 value (below the amax the clamp changes nothing). A GPU test
    casts every (block amax, value) pair of bf16 and fp16 bit for bit the torch quantizer.

    ``plain`` (float32 scales): the caller knows that m2 is 1 and that value is not +-Inf (NaN
    may occur). Then three instructions give the same value: q, the residual turned, t = s q - v (= -r exactly),
    and RN(q - t m1), with no test of r. Where r is +-0, t is +0 and q - (+0) keeps q, its sign
    too; a NaN value gives NaN either way (only +-Inf needs the test: its r is NaN)."""
    result = Float32(0.0)
    if const_expr(power_2_scales):
        result = value * m1 * m2
    elif const_expr(plain):
        q = value * m1
        result = _fma(-_fma(scale_inv, q, -value), m1, q)
    else:
        v = value * m2
        q = v * m1
        q_finite = q
        if const_expr(above_amax):
            q_finite = cute.arch.fmax(cute.arch.fmin(q, Float32(2.0**126)), Float32(-(2.0**126)))  # NaN: +-2**126
        r = _fma(-(scale_inv * m2), q_finite, v)
        result = Float32(cutlass.select_(cute.math.absf(r) > Float32(0.0), _fma(r, m1, q_finite), q))
    return result


def _lane_split():
    """(warp index, row of the pair (0 or 1), first column of this lane within the block)."""
    tidx, _, _ = cute.arch.thread_idx()
    lane = tidx % WARP
    return cute.arch.make_warp_uniform(tidx // WARP), lane // (WARP // 2), lane % (WARP // 2) * VEC


def _row_kernel_indices(mX: cute.Tensor):
    """(thread, CTA, grid size, `_lane_split`, R, C) of a row kernel over mX (G, R, C)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    gdim, _, _ = cute.arch.grid_dim()
    warp, half, lane_col = _lane_split()
    return tidx, bidx, gdim, warp, half, lane_col, cute.size(mX, mode=[1]), cute.size(mX, mode=[2])


def _row_staging(segments: int, dtype, transposed_tile: bool = False):
    """(sMax: WARPS floats of shared memory for `_cta_max`, tXr (segments, VEC) of ``dtype`` and
    tAmax (segments,) float32 registers for `_load_rows`), and with ``transposed_tile`` the
    shared-memory tile of `BlockQuantizeSm90._store_transposed` (else None)."""
    smem = cutlass.memory.SmemAllocator()
    sMax = smem.allocate_tensor(Float32, cute.make_layout(WARPS), byte_alignment=16)
    tXr = cute.make_rmem_tensor(cute.make_layout((segments, VEC), stride=(VEC, 1)), dtype)
    tAmax = cute.make_rmem_tensor(cute.make_layout(segments), Float32)
    sT = None
    if transposed_tile:  # [column, 16-row chunk (swizzled), byte]
        layout = cute.make_layout((COLS, COLS // 16, 16), stride=(COLS, 16, 1))
        sT = smem.allocate_tensor(cutlass.Float8E4M3FN, layout, byte_alignment=128)
    return sMax, tXr, tAmax, sT


def _block_stage(dtype):
    """Shared memory of a 128 x 128 item's block as TMA writes it, (128, 128) row-major ``dtype``
    (a warp's two rows of 16-byte segments are 512 contiguous bytes: conflict-free reads), and
    the mbarrier its transaction completes on."""
    smem = cutlass.memory.SmemAllocator()
    sBlock = smem.allocate_tensor(dtype, cute.make_layout((COLS, COLS), stride=(COLS, 1)), byte_alignment=128)
    bar = smem.allocate_tensor(cutlass.Int64, cute.make_layout(1), byte_alignment=8)
    return sBlock, bar.iterator


def _row_item(item, row_items, col_blocks, item_rows: int, half, lane_col):
    """(g, first row of this half-warp, column block, first column of this lane) of warp item
    ``item`` over (G, row_items, col_blocks), items of ``item_rows`` rows x 128 columns."""
    g = item // (row_items * col_blocks)
    first_row = item // col_blocks % row_items * item_rows + half
    cb = item % col_blocks
    return g, first_row, cb, cb * COLS + lane_col


def _segment(mT: cute.Tensor, g, r, col):
    """The VEC elements of mT (G, R, C) at row (g, r), columns col..col+VEC-1 (col a multiple of VEC)."""
    return cute.local_tile(mT[g, r, None], (VEC,), (col // VEC,))


@cute.jit
def finite_abs(value: Float32) -> Float32:
    magnitude = cutlass.max(value, -value)
    result = Float32(0.0)
    if magnitude < Float32(float("inf")):  # false for NaN and Inf
        result = magnitude
    return result


@cute.jit
def _abs_max(value: Float32, amax: Float32, finite_only: cutlass.Constexpr[bool]) -> Float32:
    """max(amax, |value|): NaN ignored (one FMNMX, |value| an operand modifier); with
    ``finite_only`` +-Inf ignored too (a compare and a select more)."""
    result = amax
    if const_expr(finite_only):
        result = cutlass.max(amax, finite_abs(value))
    else:
        result = cute.arch.fmax(amax, cute.math.absf(value))
    return result


@dsl_user_op
def _finite_magnitudes(pair: Int32, ptx_type: str, inf_bits: int, *, loc=None, ip=None) -> Int32:
    """|value| of both 16-bit lanes of ``pair``, 0 where NaN or +-Inf: a sign mask, a packed float
    compare with +Inf (false for NaN and Inf) as a lane mask, an and. Magnitudes of one sign order
    as their bit patterns, so `_max_u16x2` of them is their float max."""
    asm = ("{ .reg .b32 m, k, inf;\n"
           f"mov.b32 inf, {inf_bits:#x};\n"
           "and.b32 m, $1, 0x7FFF7FFF;\n"
           f"set.lt.u32.{ptx_type} k, m, inf;\n"
           "and.b32 $0, m, k; }")
    return Int32(ptx_value(T.i32(), [Int32(pair)], asm, "=r,r", loc=loc, ip=ip))


@dsl_user_op
def _max_u16x2(a: Int32, b: Int32, *, loc=None, ip=None) -> Int32:
    """The unsigned max of each 16-bit lane of a and b."""
    return Int32(ptx_value(T.i32(), [Int32(a), Int32(b)], "max.u16x2 $0, $1, $2;", "=r,r,r", loc=loc, ip=ip))


def _pairs_format(dtype):
    """(PTX packed type, +Inf in both lanes) of 16-bit ``dtype``."""
    if dtype not in (cutlass.BFloat16, cutlass.Float16):
        raise TypeError(f"packed 16-bit values expected, not {dtype}")
    return ("bf16x2", 0x7F807F80) if dtype == cutlass.BFloat16 else ("f16x2", 0x7C007C00)


@cute.jit
def _magnitude_value(magnitude: Int32, dtype: cutlass.Constexpr) -> Float32:
    """The float32 value of a 16-bit ``dtype`` magnitude held in the low half of ``magnitude``."""
    word = cute.make_rmem_tensor(cute.make_layout(1), Int32)
    word[0] = magnitude
    return Float32(cute.recast_tensor(word, dtype)[0])


@cute.jit
def _pair_magnitudes(pair: Int32, dtype: cutlass.Constexpr, finite_only: cutlass.Constexpr[bool]) -> Int32:
    """|value| of both 16-bit ``dtype`` lanes of ``pair`` as bit patterns. ``finite_only``: NaN and
    +-Inf as 0 (`_finite_magnitudes`, 3 instructions); else the sign bits cleared (1 instruction),
    at or above +Inf's bits (`_non_finite_bits`) where a lane is NaN or Inf."""
    magnitudes = pair & Int32(0x7FFF7FFF)
    if const_expr(finite_only):
        ptx_type, inf_bits = _pairs_format(dtype)
        magnitudes = _finite_magnitudes(pair, ptx_type, inf_bits)
    return magnitudes


@cute.jit
def _magnitude_max(tX: cute.Tensor, finite_only: cutlass.Constexpr[bool] = True) -> Int32:
    """The largest magnitude of the 16-bit (bf16 / fp16) register tensor tX of an even size, as its
    bit pattern in the low half (magnitudes order as their bits, so warps can reduce it as an
    integer): `_pair_magnitudes` of the packed pairs and `_max_u16x2` (2 instructions a value
    against 6 on float32 values with ``finite_only``, 1 without), then the two lanes'."""
    words = cute.recast_tensor(tX, Int32)
    running = Int32(0)
    for i in cutlass.range_constexpr(cute.size(words)):
        running = _max_u16x2(running, _pair_magnitudes(words[i], tX.element_type, finite_only))
    return cutlass.max(running & Int32(0xFFFF), (running >> 16) & Int32(0xFFFF))


def _non_finite_bits(dtype) -> int:
    """+Inf's bit pattern in 16-bit ``dtype``: magnitudes at or above it are NaN or Inf."""
    return _pairs_format(dtype)[1] & 0xFFFF


@cute.jit
def packed_finite_abs_max(tX: cute.Tensor) -> Float32:
    """max |value| over the finite values (NaN and +-Inf count as 0) of the 16-bit register
    tensor tX of an even size (`_magnitude_max`, converted once)."""
    return _magnitude_value(_magnitude_max(tX), tX.element_type)


@cute.jit
def _load_rows(mX: cute.Tensor, g, first_row, row_end, col, cols, tXr: cute.Tensor, tAmax: cute.Tensor,
               segments: cutlass.Constexpr[int], with_amax: cutlass.Constexpr[bool]):
    """Rows first_row + 2k (k < segments) at the lane's columns into tXr[k, :] (zeros out of
    bounds); with ``with_amax`` their finite amax into tAmax[k] (`packed_finite_abs_max`)."""
    for k in cutlass.range_constexpr(segments):
        tXr[k, None].fill(0.0)
        if first_row + 2 * k < row_end and col < cols:
            tXr[k, None].store(_segment(mX, g, first_row + 2 * k, col).load())
    if const_expr(with_amax):
        for k in cutlass.range_constexpr(segments):
            tAmax[k] = packed_finite_abs_max(tXr[k, None])


@cute.jit
def _cta_max(value, sMax: cute.Tensor):
    """The max of ``value`` (NaN-free) over the CTA (every thread gets it), through sMax (WARPS floats)."""
    tidx, _, _ = cute.arch.thread_idx()
    for step in cutlass.range_constexpr(5):
        value = cute.arch.fmax(value, cute.arch.shuffle_sync_bfly(value, 1 << step))
    if tidx % WARP == 0:
        sMax[tidx // WARP] = value
    cute.arch.sync_threads()
    for w in cutlass.range_constexpr(WARPS):
        value = cute.arch.fmax(value, sMax[w])
    cute.arch.sync_threads()  # sMax may be rewritten next
    return value


ROW_SEGMENTS = 4  # 1 x 128 work items: 4 rows per half-warp, 8 per warp


class TensorAmaxSm90:
    """mX (G, R, C) -> mParts (P,) float32, P the grid: CTA p's max |x| over the finite values of
    the rows it visits (warp items of 8 rows x 128 columns, grid-stride). With mOffsets (G+1,)
    int32 (G == 1) only rows below clamp(max(mOffsets), 0, R) count: the grouped rows, not the
    padding. `BlockQuantizeSm90` with ``tensor_scale`` reduces the parts."""

    @cute.jit
    def __call__(self, mX: cute.Tensor, mOffsets, mParts: cute.Tensor, stream):
        self.kernel(mX, mOffsets, mParts).launch(
            grid=(cute.size(mParts), 1, 1), block=(WARP * WARPS, 1, 1), stream=stream
        )

    @cute.jit
    def _valid_rows(self, mOffsets: cute.Tensor, rows):
        """clamp(max(mOffsets), 0, rows), per warp."""
        tidx, _, _ = cute.arch.thread_idx()
        end = Int32(0)
        for j in cutlass.range(tidx % WARP, cute.size(mOffsets), WARP):
            end = cutlass.max(end, Int32(mOffsets[j]))
        for step in cutlass.range_constexpr(5):
            end = cutlass.max(end, cute.arch.shuffle_sync_bfly(end, 1 << step))
        return cutlass.min(end, rows)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mOffsets, mParts: cute.Tensor):
        tidx, bidx, gdim, warp, half, lane_col, rows, cols = _row_kernel_indices(mX)
        row_end = rows
        if const_expr(mOffsets is not None):
            row_end = self._valid_rows(mOffsets, rows)
        sMax, tXr, tAmax, _ = _row_staging(ROW_SEGMENTS, mX.element_type)
        col_blocks = (cols + COLS - 1) // COLS
        row_items = (row_end + 2 * ROW_SEGMENTS - 1) // (2 * ROW_SEGMENTS)
        num_items = cute.size(mX, mode=[0]) * row_items * col_blocks
        amax = Float32(0.0)
        item = bidx * WARPS + warp
        while item < num_items:
            g, first_row, _, col = _row_item(item, row_items, col_blocks, 2 * ROW_SEGMENTS, half, lane_col)
            _load_rows(mX, g, first_row, row_end, col, cols, tXr, tAmax, ROW_SEGMENTS, True)
            for k in cutlass.range_constexpr(ROW_SEGMENTS):
                amax = cute.arch.fmax(amax, tAmax[k])
            item = item + gdim * WARPS
        amax = _cta_max(amax, sMax)
        if tidx == 0:
            mParts[bidx] = amax


class BlockQuantizeSm90:
    """mX (G, R, C) -> mData (G, R, C) E4M3, mScaleInv (G, ceil(R / block_rows), ceil(C / 128))
    float32. ``block_rows``: 1 (activations, 1 x 128) or 128 (weights, 128 x 128).

    A lane holds all its row segments before reducing and casts from registers, so x is read
    once: 1 x 128 blocks, a warp item of 8 rows (4 per half-warp, one scale per row; the lane's
    16-byte loads all in flight); 128 x 128, a CTA item of one block (warp w rows 16w..16w+15, 8
    per lane), its amax across the warps through shared memory. A 128 x 128 block arrives by TMA
    into shared memory, and the CTA's next block is requested as soon as every thread has read
    this one, so its load runs under this block's casts and stores (one wave of CTAs).

    ``tensor_scale`` (fp8_current): one scale from the amax parts mAmaxParts (P,) of
    `TensorAmaxSm90`, reduced by every CTA first; the work is split as for 1 x 128 blocks (or
    128 x 128 ones with ``transposed``) and the scale is written to every block of mScaleInv.
    Otherwise mAmaxParts is None.

    ``transposed`` (128 x 128 blocks; R and C multiples of 16): also mDataT (G, C, R) E4M3, each
    group's data transposed (the FP8 data gradient's K-major weight), and mScaleInvT (G,
    ceil(C / 128), ceil(R / 128)), from the same registers (`_store_transposed`). Otherwise both
    are None."""

    def __init__(self, block_rows: int, power_2_scales: bool = False, tensor_scale: bool = False,
                 transposed: bool = False):
        if block_rows not in (1, 128):
            raise ValueError("block_rows must be 1 or 128")
        if tensor_scale and power_2_scales:
            raise ValueError("per-tensor scales are float32 (fp8_current), not powers of two")
        if transposed and block_rows != 128:
            raise ValueError("the transposed copy is made for 128 x 128 blocks")
        self.block_rows = block_rows
        self.power_2_scales = power_2_scales
        self.tensor_scale = tensor_scale
        self.transposed = transposed
        self.row_items = (block_rows == 1 or tensor_scale) and not transposed  # warp items of 8 rows
        self.segments = ROW_SEGMENTS if self.row_items else 128 // WARPS // 2  # row segments per lane

    @cute.jit
    def __call__(self, mX: cute.Tensor, mData: cute.Tensor, mScaleInv: cute.Tensor, mAmaxParts, mDataT,
                 mScaleInvT, max_ctas: cutlass.Int32, stream):
        # 128 x 128: registers capped for BLOCK_CTAS_PER_SM CTAs per SM, each with 49 KB of shared
        # memory (the block, the transposed staging tile); the carveout given so no device is queried
        occupancy = {} if self.row_items else dict(min_blocks_per_mp=BLOCK_CTAS_PER_SM, preferred_smem_carveout=100)
        block_load = None
        if const_expr(not self.row_items):  # x as (R, C, G), its 128 x 128 boxes by TMA
            view = cute.make_tensor(mX.iterator, cute.select(mX.layout, mode=[1, 2, 0]))
            block_load = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), view,
                cute.make_layout((COLS, COLS), stride=(COLS, 1)), (COLS, COLS),
            )
        self.kernel(mX, mData, mScaleInv, mAmaxParts, mDataT, mScaleInvT, block_load).launch(
            grid=(max_ctas, 1, 1), block=(WARP * WARPS, 1, 1), stream=stream, **occupancy
        )

    @cute.jit
    def _issue_block(self, block_load, sBlock: cute.Tensor, bar, item, num_items, row_blocks, col_blocks):
        """128 x 128 items, warp 0 (the TMA copy elects its lane from the whole warp): block
        ``item`` (if < num_items) of x into sBlock by TMA (zeros past R and C), its bytes expected
        on ``bar`` by lane 0."""
        tidx, _, _ = cute.arch.thread_idx()
        if tidx < WARP and item < num_items:
            tma, mX_boxes = block_load
            g = item // (row_blocks * col_blocks)
            gBlock = cute.local_tile(mX_boxes[None, None, g], (COLS, COLS), (item // col_blocks % row_blocks,
                                                                            item % col_blocks))
            sX, gX = cute.nvgpu.cpasync.tma_partition(tma, 0, cute.make_layout(1), cute.group_modes(sBlock, 0, 2),
                                                      cute.group_modes(gBlock, 0, 2))
            if tidx == 0:
                cute.arch.mbarrier_arrive_and_expect_tx(bar, cute.size_in_bytes(sBlock.element_type, sBlock.layout))
            cute.copy(tma, gX, sX, tma_bar_ptr=bar)

    @cute.jit
    def _store_cast(self, mData: cute.Tensor, g, row, row_end, col, cols, tXr_k: cute.Tensor, scales,
                    tQr_k: cute.Tensor):
        """The lane's VEC values of ``row`` cast into tQr_k (E4M3 registers) and stored."""
        values = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)
        for i in cutlass.range_constexpr(VEC):
            values[i] = e4m3_scaled(Float32(tXr_k[i]), *scales, self.power_2_scales, self.tensor_scale)
        tQr_k.store(values.load().to(cutlass.Float8E4M3FN))
        if row < row_end and col < cols:
            _segment(mData, g, row, col).store(tQr_k.load())

    @cute.jit
    def _store_transposed(self, mDataT: cute.Tensor, g, rb, cb, rows, cols, tQr: cute.Tensor, sT: cute.Tensor):
        """The block (rb, cb)'s cast bytes, transposed, into mDataT (G, C, R). Lanes l and l ^ 16
        of warp w hold columns 8 (l % 16) .. + 7 of the block's 16-row stripe 16 w .. 16 w + 15
        (tQr (8, VEC): its rows 2k + l // 16). They swap halves, so lane l keeps four of those
        columns for all 16 rows, transpose them 4 x 4 bytes at a time (`_prmt`) and write each
        column's 16 bytes into sT[column, chunk w ^ (column / 8 % 8)] (the XOR: the 8 lanes of a
        16-byte access hit 8 different bank groups); after a barrier the CTA stores sT's rows,
        8 lanes per 128-byte row of mDataT."""
        tidx, _, _ = cute.arch.thread_idx()
        warp, half, lane_col = _lane_split()
        words = cute.recast_tensor(tQr, Int32)  # (8, 2): columns 0-3 and 4-7 of row 2k + half
        lower = half == 0
        even, odd = [], []  # the stripe's rows 2k and 2k + 1, this lane's four columns
        for k in cutlass.range_constexpr(self.segments):
            got = Int32(cute.arch.shuffle_sync_bfly(Int32(cutlass.select_(lower, words[k, 1], words[k, 0])), offset=16))
            even.append(Int32(cutlass.select_(lower, words[k, 0], got)))
            odd.append(Int32(cutlass.select_(lower, got, words[k, 1])))
        tOut = cute.make_rmem_tensor(cute.make_layout((4, 4), stride=(4, 1)), Int32)  # [column, rows 4q .. 4q + 3]
        for q in cutlass.range_constexpr(4):
            low01 = _prmt(even[2 * q], odd[2 * q], 0x5140)  # bytes 0, 1 of rows 4q, 4q + 1 interleaved
            high01 = _prmt(even[2 * q], odd[2 * q], 0x7362)
            low23 = _prmt(even[2 * q + 1], odd[2 * q + 1], 0x5140)
            high23 = _prmt(even[2 * q + 1], odd[2 * q + 1], 0x7362)
            tOut[0, q] = _prmt(low01, low23, 0x5410)
            tOut[1, q] = _prmt(low01, low23, 0x7632)
            tOut[2, q] = _prmt(high01, high23, 0x5410)
            tOut[3, q] = _prmt(high01, high23, 0x7632)
        tOutBytes = cute.recast_tensor(tOut, cutlass.Float8E4M3FN)  # (4, 16)
        for j in cutlass.range_constexpr(4):
            column = lane_col + 4 * half + j
            sT[column, warp ^ (column // 8 % 8), None].store(tOutBytes[j, None].load())
        cute.arch.sync_threads()
        chunk = tidx % 8
        row = rb * COLS + 16 * chunk
        for i in cutlass.range_constexpr(COLS * 8 // (WARP * WARPS)):
            column = i * (WARP * WARPS // 8) + tidx // 8
            if row < rows and cb * COLS + column < cols:
                values = sT[column, chunk ^ (column // 8 % 8), None].load()
                cute.local_tile(mDataT[g, cb * COLS + column, None], (16,), (row // 16,)).store(values)

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mData: cute.Tensor, mScaleInv: cute.Tensor, mAmaxParts, mDataT, mScaleInvT,
               block_load):
        tidx, bidx, gdim, warp, half, lane_col, rows, cols = _row_kernel_indices(mX)
        col_blocks = cute.size(mScaleInv, mode=[2])
        sAmax, tXr, tAmax, sT = _row_staging(self.segments, mX.element_type, self.transposed)
        tQr = cute.make_rmem_tensor(cute.make_layout((self.segments, VEC), stride=(VEC, 1)), cutlass.Float8E4M3FN)
        with_amax = not self.tensor_scale

        if const_expr(self.tensor_scale):
            amax = Float32(0.0)
            for j in cutlass.range(tidx, cute.size(mAmaxParts), WARP * WARPS):
                amax = cute.arch.fmax(amax, mAmaxParts[j])
            tensor_scales = e4m3_scale_inv(_cta_max(amax, sAmax), False)
        if cutlass.const_expr(self.row_items):
            item_rows = 2 * self.segments
            row_items = (rows + item_rows - 1) // item_rows
            num_items = cute.size(mX, mode=[0]) * row_items * col_blocks
            item = bidx * WARPS + warp
            while item < num_items:
                g, first_row, cb, col = _row_item(item, row_items, col_blocks, item_rows, half, lane_col)
                _load_rows(mX, g, first_row, rows, col, cols, tXr, tAmax, self.segments, with_amax)
                for k in cutlass.range_constexpr(self.segments):
                    if const_expr(with_amax):
                        row_amax = tAmax[k]
                        for step in cutlass.range_constexpr(4):  # the half-warp holding the row
                            row_amax = cute.arch.fmax(row_amax, cute.arch.shuffle_sync_bfly(row_amax, 1 << step))
                        scales = e4m3_scale_inv(row_amax, self.power_2_scales)
                    else:
                        scales = tensor_scales
                    row = first_row + 2 * k
                    self._store_cast(mData, g, row, rows, col, cols, tXr[k, None], scales, tQr[k, None])
                    if row < rows and lane_col == 0 and row % self.block_rows == 0:
                        mScaleInv[g, row // self.block_rows, cb] = scales[0]
                item = item + gdim * WARPS
        else:
            row_blocks = cute.size(mScaleInv, mode=[1])
            num_items = cute.size(mX, mode=[0]) * row_blocks * col_blocks
            sBlock, bar = _block_stage(mX.element_type)
            if tidx == 0:
                cute.arch.mbarrier_init(bar, 1)
                cute.arch.mbarrier_init_fence()
            cute.arch.sync_threads()
            item = bidx
            self._issue_block(block_load, sBlock, bar, item, num_items, row_blocks, col_blocks)
            phase = Int32(0)
            while item < num_items:
                g = item // (row_blocks * col_blocks)
                rb = item // col_blocks % row_blocks
                cb = item % col_blocks
                col = cb * COLS + lane_col
                block_row = warp * 2 * self.segments + half
                first_row = rb * self.block_rows + block_row
                cute.arch.mbarrier_wait(bar, phase)
                phase = phase ^ 1
                for k in cutlass.range_constexpr(self.segments):
                    tXr[k, None].store(cute.local_tile(sBlock[block_row + 2 * k, None], (VEC,), (lane_col // VEC,)).load())
                if const_expr(with_amax):
                    block_amax = Float32(0.0)
                    for k in cutlass.range_constexpr(self.segments):
                        block_amax = cute.arch.fmax(block_amax, packed_finite_abs_max(tXr[k, None]))
                    scales = e4m3_scale_inv(_cta_max(block_amax, sAmax), self.power_2_scales)  # its barriers guard sT
                else:
                    scales = tensor_scales
                    cute.arch.sync_threads()  # sBlock read by every thread, the previous item's sT too
                # past the barrier every thread has read sBlock: it takes the next item's block
                self._issue_block(block_load, sBlock, bar, item + gdim, num_items, row_blocks, col_blocks)
                for k in cutlass.range_constexpr(self.segments):
                    self._store_cast(mData, g, first_row + 2 * k, rows, col, cols, tXr[k, None], scales, tQr[k, None])
                if const_expr(self.transposed):
                    self._store_transposed(mDataT, g, rb, cb, rows, cols, tQr, sT)
                if warp == 0 and half == 0 and lane_col == 0:
                    mScaleInv[g, rb, cb] = scales[0]
                    if const_expr(self.transposed):
                        mScaleInvT[g, cb, rb] = scales[0]
                item = item + gdim


class BlockDequantizeSm90:
    """mData (G, R, C) E4M3 and mScaleInv (G, R, ceil(C / 128)) float32 multipliers of its 1 x 128
    blocks -> mOut (G, R, C) bf16/fp16; ``out_max``: the largest finite value of mOut's type."""

    def __init__(self, out_max: float):
        self.out_max = out_max

    @cute.jit
    def __call__(self, mData: cute.Tensor, mScaleInv: cute.Tensor, mOut: cute.Tensor, max_ctas: cutlass.Int32, stream):
        self.kernel(mData, mScaleInv, mOut).launch(grid=(max_ctas, 1, 1), block=(WARP * WARPS, 1, 1), stream=stream)

    @cute.kernel
    def kernel(self, mData: cute.Tensor, mScaleInv: cute.Tensor, mOut: cute.Tensor):
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp, half, lane_col = _lane_split()
        rows = cute.size(mData, mode=[1])
        cols = cute.size(mData, mode=[2])
        col_blocks = cute.size(mScaleInv, mode=[2])
        row_items = (rows + 1) // 2
        num_items = cute.size(mData, mode=[0]) * row_items * col_blocks
        finite_max = Float32(self.out_max)
        values = cute.make_rmem_tensor(cute.make_layout(VEC), Float32)

        item = bidx * WARPS + warp
        while item < num_items:
            g, r, cb, col = _row_item(item, row_items, col_blocks, 2, half, lane_col)
            if r < rows and col < cols:
                scale_inv = mScaleInv[g, r, cb]
                values.store(_segment(mData, g, r, col).load().to(Float32))
                for i in cutlass.range_constexpr(VEC):
                    v = values[i] * scale_inv
                    if v > finite_max:  # false for NaN
                        v = finite_max
                    if v < -finite_max:
                        v = -finite_max
                    values[i] = v
                _segment(mOut, g, r, col).store(values.load().to(mOut.element_type))
            item = item + gdim * WARPS


COLUMN_SCAN_GROUPS = 512  # groups the column-wise casts scan into shared memory
ROW_PIECES = COLS // VEC  # `BlockColumnQuantizeSm90`: pieces of VEC columns in an item's token row
COLUMN_WARPS = ROW_PIECES  # its warps: warp w the item's piece w, columns 8w .. 8w + 7
LANE_TOKENS = COLS // WARP  # consecutive tokens a lane holds: its 4 bytes of each column-wise row
PIECE_COPIES = COLS * ROW_PIECES // (WARP * COLUMN_WARPS)  # a thread's cp.async pieces of an item
WARP_ROWS = COLS // COLUMN_WARPS  # its row-wise copy: warp w the item's token rows 8w .. 8w + 7
LANE_COLUMNS = COLS // WARP  # consecutive columns a lane holds of each of those rows


@cute.jit
def _locate_block(sScan: cute.Tensor, item, col_blocks, num_groups):
    """(block, column block, first row, the group's end row) of work item ``item`` of a column-wise
    cast (items: blocks x column blocks; sScan as `scan_group_blocks` fills it with second =
    COLUMN_SCAN_GROUPS + 1): the group holding the block is the last g whose first block is <= block
    (binary search)."""
    first_blocks = COLUMN_SCAN_GROUPS + 1
    block = item // col_blocks
    lo, hi = Int32(0), num_groups - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sScan[first_blocks + mid] <= block:
            lo = mid
        else:
            hi = mid - 1
    return block, item % col_blocks, sScan[lo] + (block - sScan[first_blocks + lo]) * COLS, sScan[lo + 1]


@cute.jit
def _publish_location(sLocation: cute.Tensor, slot, item, num_items, sScan: cute.Tensor, col_blocks, num_groups):
    """sLocation[slot, :] = `_locate_block` of ``item`` where it is < num_items (one thread
    searches where every thread would)."""
    if item < num_items:
        block, cb, first_row, row_end = _locate_block(sScan, item, col_blocks, num_groups)
        sLocation[slot, 0] = block
        sLocation[slot, 1] = cb
        sLocation[slot, 2] = first_row
        sLocation[slot, 3] = row_end


@cute.jit
def _share_multipliers(sScale: cute.Tensor, amax: Float32, power_2_scales: cutlass.Constexpr[bool]) -> Float32:
    """Lane s < 8 of each warp puts block s's multipliers (`e4m3_scale_inv` of the lane's ``amax``)
    into sScale[:, s, warp] (sScale (4, 8, warps) float32) for the whole warp, after the warp has
    read the previous ones; returns the lane's scale_inv."""
    tidx, _, _ = cute.arch.thread_idx()
    warp = cute.arch.make_warp_uniform(tidx // WARP)
    lane = cute.arch.lane_idx()
    scale_inv, m1, m2 = e4m3_scale_inv(amax, power_2_scales)
    cute.arch.sync_warp()  # the previous item's multipliers are read
    if lane < cute.size(sScale, mode=[1]):
        sScale[0, lane, warp] = scale_inv
        sScale[1, lane, warp] = m1
        sScale[2, lane, warp] = m2
    cute.arch.sync_warp()
    return scale_inv


@cute.jit
def _store_word(dst: cute.Tensor, word: Int32):
    """Four E4M3 bytes packed in ``word`` (`e4m3_word`) into dst (4,) E4M3, one 32-bit store."""
    tBytes = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Float8E4M3FN)
    cute.recast_tensor(tBytes, Int32)[0] = word
    dst.store(tBytes.load())


@cute.jit
def _warp_plain(scale_inv: Float32, finite: bool, power_2_scales: cutlass.Constexpr[bool]):
    """Whether the warp casts with `e4m3_scaled`'s ``plain`` form: every lane's scale_inv has
    m2 = 1 and ``finite`` (warp-uniform: no NaN or Inf among the values); one vote, so every lane
    of the warp calls it. False with power-of-two scales, whose exact multiplications keep one
    form (the plain one would save one of them, not worth a second copy of the cast under the
    register cap)."""
    plain = False
    if const_expr(not power_2_scales):
        plain = cute.arch.vote_all_sync(scale_inv >= Float32(TINY_SCALE)) and finite
    return plain


class BlockColumnQuantizeSm90:
    """Block-padded per-group column-wise E4M3 copy of x (M, C) for the FP8 weight gradient.

    Group g's rows [start_g, end_g) (offsets clamped to [0, M], made non-decreasing, group 0
    from row 0: `scan_group_blocks`) form ceil(rows_g / 128) blocks of 128 tokens from its first
    row, numbered from block_start[g] = the blocks of the groups before it. Block b's column c
    goes to mData[c, 128 b : 128 b + 128] (C, 128 * blocks) E4M3, zeros past the group's last
    token, with its multiplier mScaleInv[b, c] (blocks, C) float32; blocks past the groups' last
    are not written. Rows past offsets[G] are not read.

    Source: bf16/fp16 x, or with ``from_rows`` x's E4M3 row-wise copy and its 1 x 128
    multipliers mXScale (M, ceil(C / 128)), dequantized to float32 first (as
    `QuantizedTensor.dequantize` does before `add_columnwise` requantizes). Every value and
    multiplier bit for bit what the torch quantizer computes.

    Work item: one block x 128 columns, copied by cp.async into one of two shared-memory tiles
    while the CTA casts the item before it (the tile: 128 token rows of 16 pieces of 8 columns,
    piece p of row r stored at p ^ (r / 4 % 16), so both the copies and the reads below are free
    of bank conflicts). Warp w casts its columns 8w .. 8w + 7 over all 128 tokens, lane l tokens
    4l .. 4l + 3, so a column's amax is the warp's: the lane's maxima over its tokens (packed 16-bit
    magnitudes, or float32 maxima of the dequantized values, NaN ignored), then one `redux.sync`
    per column, recomputed without NaN and Inf where the warp's columns hold any (rare). Lane
    c < 8 makes column c's multipliers for the warp (through shared memory), and each lane casts
    its 4 bytes of each column and stores them as one word: a warp stores a column's 128 tokens as
    one 128-byte line. One CTA barrier an item, with or without ``rows``; thread 0 locates the
    CTA's items two ahead (a binary search over the groups) and shares them in shared memory.

    With ``rows`` (16-bit x) also x's row-wise 1 x 128 copy of the grouped rows from the same read:
    mRowData (M, C) E4M3 and mRowScale (M, ceil(C / 128)) float32, as `BlockQuantizeSm90`
    (block_rows 1) makes them. Warp w also casts the item's token rows 8w .. 8w + 7 from the same
    tile, lane l columns 4l .. 4l + 3, so a row's amax is one `redux.sync` too (the warp's 8 rows
    recomputed without NaN and Inf where they hold any), lane r < 8 makes
    row r's multipliers for the warp, and a warp stores a row's 128 bytes as one line.
    """

    def __init__(self, from_rows: bool, power_2_scales: bool = False, rows: bool = False):
        if from_rows and rows:
            raise ValueError("the row-wise copy is written from a 16-bit source only")
        self.from_rows = from_rows
        self.power_2_scales = power_2_scales
        self.rows = rows

    @cute.jit
    def __call__(self, mX: cute.Tensor, mXScale, mOffsets: cute.Tensor, mData: cute.Tensor, mScaleInv: cute.Tensor,
                 mRowData, mRowScale, max_ctas: cutlass.Int32, stream):
        self.kernel(mX, mXScale, mOffsets, mData, mScaleInv, mRowData, mRowScale).launch(
            grid=(max_ctas, 1, 1), block=(WARP * COLUMN_WARPS, 1, 1), stream=stream, min_blocks_per_mp=2,
            preferred_smem_carveout=100,  # two CTAs of two tiles; given, so no device is queried
        )

    @cute.jit
    def _issue_copies(self, mX: cute.Tensor, mXScale, sTile: cute.Tensor, sMult, first_row, row_end, cb, cols):
        """This thread's cp.async pieces of an item into sTile (COLS, ROW_PIECES, VEC) (zeros past the
        group's end or C) and, ``from_rows``, thread t < 128 row t's multiplier into sMult (COLS,)
        (1 past the group's end); one commit group."""
        tidx, _, _ = cute.arch.thread_idx()
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL
                                         if const_expr(mX.element_type.width == 16)
                                         else cute.nvgpu.cpasync.LoadCacheMode.ALWAYS),
            mX.element_type, num_bits_per_copy=VEC * mX.element_type.width,
        )
        for k in cutlass.range_constexpr(PIECE_COPIES):
            index = tidx + k * WARP * COLUMN_WARPS
            token = index // ROW_PIECES
            piece = index % ROW_PIECES
            dst = sTile[token, piece ^ (token // LANE_TOKENS % ROW_PIECES), None]
            col = cb * COLS + piece * VEC
            if first_row + token < row_end and col < cols:
                cute.copy(atom, cute.local_tile(mX[first_row + token, None], (VEC,), (col // VEC,)), dst)
            else:
                dst.fill(0.0)
        if const_expr(self.from_rows):
            if tidx < COLS:
                if first_row + tidx < row_end:
                    scale_atom = cute.make_copy_atom(cute.nvgpu.cpasync.CopyG2SOp(), Float32, num_bits_per_copy=32)
                    cute.copy(scale_atom, cute.local_tile(mXScale[first_row + tidx, None], (1,), (cb,)),
                              cute.local_tile(sMult, (1,), (tidx,)))
                else:
                    sMult[tidx] = Float32(1.0)
        cute.arch.cp_async_commit_group()

    @cute.jit
    def _column_magnitude_max(self, tX: cute.Tensor, column: Int32, finite_only: cutlass.Constexpr[bool]):
        """(the largest magnitude bits of this warp's column ``column`` (a lane's own, 0 .. 7) over
        the item, the largest of the warp's 8 columns), from tX (LANE_TOKENS, VEC) 16-bit; NaN and
        Inf count as 0 with ``finite_only`` (`_pair_magnitudes`)."""
        pairs = [Int32(0)] * (VEC // 2)  # the lane's column pairs' maxima
        for i in cutlass.range_constexpr(LANE_TOKENS):
            words = cute.recast_tensor(tX[i, None], Int32)
            for w in cutlass.range_constexpr(VEC // 2):
                pairs[w] = _max_u16x2(pairs[w], _pair_magnitudes(words[w], tX.element_type, finite_only))
        mine, top = Int32(0), Int32(0)
        for c in cutlass.range_constexpr(VEC):
            half = (pairs[c // 2] >> (16 * (c % 2))) & Int32(0xFFFF)
            amax = cute.arch.warp_redux_sync(half, "max")
            top = cutlass.max(top, amax)
            if column == c:
                mine = amax
        return mine, top

    @cute.jit
    def _column_amax_16bit(self, tX: cute.Tensor, column: Int32):
        """(the finite amax of this warp's column ``column`` over the item, whether the warp's
        columns are free of NaN and Inf (warp-uniform)) from tX (LANE_TOKENS, VEC) 16-bit: the
        magnitudes' max (one instruction a value), recomputed without NaN and Inf where one of the
        warp's columns holds any (rare)."""
        mine, top = self._column_magnitude_max(tX, column, False)
        finite = top < Int32(_non_finite_bits(tX.element_type))
        if top >= Int32(_non_finite_bits(tX.element_type)):
            mine, top = self._column_magnitude_max(tX, column, True)
        return _magnitude_value(mine, tX.element_type), finite

    @cute.jit
    def _column_float_max(self, tV: cute.Tensor, column: Int32, finite_only: cutlass.Constexpr[bool]):
        """(max |value| of this warp's column ``column`` over the item, the largest of the warp's 8
        columns) from the float32 values tV (LANE_TOKENS, VEC), NaN ignored (+-Inf too with
        ``finite_only``)."""
        mine, top = Float32(0.0), Float32(0.0)
        for c in cutlass.range_constexpr(VEC):
            lane_max = Float32(0.0)
            for i in cutlass.range_constexpr(LANE_TOKENS):
                lane_max = _abs_max(tV[i, c], lane_max, finite_only)
            amax = _from_bits(cute.arch.warp_redux_sync(_bits(lane_max), "max"))  # >= 0: bits order as floats
            top = cute.arch.fmax(top, amax)
            if column == c:
                mine = amax
        return mine, top

    @cute.jit
    def _column_amax_dequantized(self, tV: cute.Tensor, column: Int32):
        """The finite amax of this warp's column ``column`` over the item, from the dequantized
        float32 values tV (LANE_TOKENS, VEC); the warp's 8 columns recomputed without Inf where
        one holds any (warp-uniform, rare: one branch, not a predicated recompute per column)."""
        mine, top = self._column_float_max(tV, column, False)
        if top == Float32(float("inf")):
            mine, top = self._column_float_max(tV, column, True)
        return mine

    @cute.jit
    def _cast_rows(self, sTile: cute.Tensor, sRowScale: cute.Tensor, mRowData: cute.Tensor, mRowScale: cute.Tensor,
                   first_row, row_end, cb, cols):
        """The row-wise copy of this warp's token rows 8w .. 8w + 7 of the item in sTile (COLS,
        ROW_PIECES, VEC): lane l's columns 4l .. 4l + 3 of each, the row's finite amax by one
        `redux.sync`, lane r < 8 row r's multipliers for the warp (through sRowScale (4, WARP_ROWS,
        COLUMN_WARPS)), then one 4-byte store a lane a row."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        lane = cute.arch.lane_idx()
        dtype = sTile.element_type
        tR = cute.make_rmem_tensor(cute.make_layout((WARP_ROWS, LANE_COLUMNS), stride=(LANE_COLUMNS, 1)), dtype)
        mine, top = Int32(0), Int32(0)
        for r in cutlass.range_constexpr(WARP_ROWS):
            token = warp * WARP_ROWS + r
            piece = sTile[token, (lane // 2) ^ (token // LANE_TOKENS % ROW_PIECES), None]
            tR[r, None].store(cute.local_tile(piece, (LANE_COLUMNS,), (lane % 2,)).load())
            amax = cute.arch.warp_redux_sync(_magnitude_max(tR[r, None], False), "max")
            top = cutlass.max(top, amax)
            if lane % WARP_ROWS == r:
                mine = amax
        if top >= Int32(_non_finite_bits(dtype)):  # a NaN or Inf in the warp's rows (warp-uniform, rare)
            for r in cutlass.range_constexpr(WARP_ROWS):
                amax = cute.arch.warp_redux_sync(_magnitude_max(tR[r, None]), "max")
                if lane % WARP_ROWS == r:
                    mine = amax
        scale_inv = _share_multipliers(sRowScale, _magnitude_value(mine, dtype), self.power_2_scales)
        row_of_lane = first_row + warp * WARP_ROWS + lane
        if lane < WARP_ROWS and row_of_lane < row_end:
            mRowScale[row_of_lane, cb] = scale_inv
        plain = _warp_plain(scale_inv, top < Int32(_non_finite_bits(dtype)), self.power_2_scales)
        col = cb * COLS + lane * LANE_COLUMNS
        if col < cols:
            if plain:
                self._store_rows(mRowData, tR, sRowScale, first_row, row_end, col, True)
            else:
                self._store_rows(mRowData, tR, sRowScale, first_row, row_end, col, False)

    @cute.jit
    def _store_rows(self, mRowData: cute.Tensor, tR: cute.Tensor, sRowScale: cute.Tensor, first_row, row_end, col,
                    plain: cutlass.Constexpr[bool]):
        """This warp's rows of the item (tR, `_cast_rows`) cast by their multipliers in sRowScale,
        one word a lane a row (``plain``: `e4m3_scaled`'s plain form)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        for r in cutlass.range_constexpr(WARP_ROWS):
            row = first_row + warp * WARP_ROWS + r
            if row < row_end:
                r_scale_inv, r_m1, r_m2 = sRowScale[0, r, warp], sRowScale[1, r, warp], sRowScale[2, r, warp]
                scaled = [e4m3_scaled(_widened(tR[r, None], j), r_scale_inv, r_m1, r_m2, self.power_2_scales,
                                      plain=plain) for j in range(LANE_COLUMNS)]
                _store_word(cute.local_tile(mRowData[row, None], (LANE_COLUMNS,), (col // LANE_COLUMNS,)),
                            e4m3_word(*scaled))

    @cute.jit
    def _store_columns(self, mData: cute.Tensor, tV: cute.Tensor, sColScale: cute.Tensor, block, col,
                       plain: cutlass.Constexpr[bool]):
        """The lane's 4 tokens of each of the warp's 8 columns (tV) cast by the columns'
        multipliers in sColScale and stored as one word a column (``plain``: `e4m3_scaled`'s plain
        form)."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        lane = cute.arch.lane_idx()
        for c in cutlass.range_constexpr(VEC):
            c_scale_inv, c_m1, c_m2 = sColScale[0, c, warp], sColScale[1, c, warp], sColScale[2, c, warp]
            scaled = [e4m3_scaled(Float32(tV[i, c]) if const_expr(self.from_rows) else _widened(tV[i, None], c),
                                  c_scale_inv, c_m1, c_m2, self.power_2_scales, plain=plain)
                      for i in range(LANE_TOKENS)]
            _store_word(cute.local_tile(mData[col + c, None], (LANE_TOKENS,), (block * WARP + lane,)),
                        e4m3_word(*scaled))

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mXScale, mOffsets: cute.Tensor, mData: cute.Tensor, mScaleInv: cute.Tensor,
               mRowData, mRowScale):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        gdim, _, _ = cute.arch.grid_dim()
        warp = cute.arch.make_warp_uniform(tidx // WARP)
        lane = cute.arch.lane_idx()
        m_total = cute.size(mX, mode=[0])
        cols = cute.size(mX, mode=[1])
        num_groups = cute.size(mOffsets) - 1
        dtype = mX.element_type
        smem = cutlass.memory.SmemAllocator()
        sScan = smem.allocate_tensor(Int32, cute.make_layout(2 * (COLUMN_SCAN_GROUPS + 1)), byte_alignment=16)
        tile_layout = cute.make_layout((2, COLS, ROW_PIECES, VEC), stride=(COLS * COLS, COLS, VEC, 1))
        sTiles = smem.allocate_tensor(dtype, tile_layout, byte_alignment=128)
        sMults = None
        if const_expr(self.from_rows):
            sMults = smem.allocate_tensor(Float32, cute.make_layout((2, COLS), stride=(COLS, 1)), byte_alignment=16)
        # per warp, column c's (scale_inv, m1, m2) at [:, c, warp]
        sColScale = smem.allocate_tensor(Float32, cute.make_layout((4, VEC, COLUMN_WARPS)), byte_alignment=16)
        sRowScale = None
        if const_expr(self.rows):  # per warp, row r's (scale_inv, m1, m2) at [:, r, warp]
            sRowScale = smem.allocate_tensor(Float32, cute.make_layout((4, WARP_ROWS, COLUMN_WARPS)), byte_alignment=16)
        # the (block, column block, first row, group end) of this CTA's items n + 1 and n + 2 while it
        # casts item n (n + 1 at [(n + 1) % 2]): located by thread 0, read by all after the item's barrier
        sLocation = smem.allocate_tensor(Int32, cute.make_layout((2, 4), stride=(4, 1)), byte_alignment=16)
        if warp == 0:
            scan_group_blocks(sScan, COLUMN_SCAN_GROUPS + 1, mOffsets, num_groups, m_total, COLS)
        cute.arch.sync_threads()
        col_blocks = (cols + COLS - 1) // COLS
        num_items = sScan[COLUMN_SCAN_GROUPS + 1 + num_groups] * col_blocks
        if tidx == 0:
            for n in cutlass.range_constexpr(2):
                _publish_location(sLocation, n, bidx + n * gdim, num_items, sScan, col_blocks, num_groups)
        cute.arch.sync_threads()
        column = lane % VEC  # the column whose multipliers this lane makes
        tX = cute.make_rmem_tensor(cute.make_layout((LANE_TOKENS, VEC), stride=(VEC, 1)), dtype)
        tV = tX  # the values cast: 16-bit x converted where read, or x dequantized
        if const_expr(self.from_rows):
            tV = cute.make_rmem_tensor(cute.make_layout((LANE_TOKENS, VEC), stride=(VEC, 1)), Float32)
        item = bidx
        buffer = Int32(0)
        # the item's (block, column block, first row, group end), read from sLocation when its copies are issued
        block, cb, first_row, row_end = Int32(0), Int32(0), Int32(0), Int32(0)
        if item < num_items:
            block, cb, first_row, row_end = sLocation[0, 0], sLocation[0, 1], sLocation[0, 2], sLocation[0, 3]
            self._issue_copies(mX, mXScale, sTiles[0, None, None, None], sMults[0, None] if const_expr(self.from_rows)
                               else None, first_row, row_end, cb, cols)
        while item < num_items:
            cute.arch.cp_async_wait_group(0)
            cute.arch.sync_threads()  # the item's tile landed; the other tile is no longer read
            following = item + gdim
            f_block, f_cb, f_first_row, f_row_end = block, cb, first_row, row_end
            if following < num_items:
                f_block, f_cb = sLocation[1 - buffer, 0], sLocation[1 - buffer, 1]
                f_first_row, f_row_end = sLocation[1 - buffer, 2], sLocation[1 - buffer, 3]
                self._issue_copies(mX, mXScale, sTiles[1 - buffer, None, None, None],
                                   sMults[1 - buffer, None] if const_expr(self.from_rows) else None,
                                   f_first_row, f_row_end, f_cb, cols)
            if tidx == 0:  # this item's slot was last read before the barrier above
                _publish_location(sLocation, buffer, following + gdim, num_items, sScan, col_blocks, num_groups)
            if const_expr(self.rows):
                self._cast_rows(sTiles[buffer, None, None, None], sRowScale, mRowData, mRowScale, first_row, row_end,
                                cb, cols)
            col = cb * COLS + warp * VEC
            # ---- the lane's 4 tokens x 8 columns from the tile
            for i in cutlass.range_constexpr(LANE_TOKENS):
                tX[i, None].store(sTiles[buffer, lane * LANE_TOKENS + i, warp ^ (lane % ROW_PIECES), None].load())
            amax = Float32(0.0)
            finite = True  # dequantized E4M3 rows hold no Inf (NaN casts alike in either form)
            if const_expr(self.from_rows):
                for i in cutlass.range_constexpr(LANE_TOKENS):
                    _dequantized(tX[i, None], sMults[buffer, lane * LANE_TOKENS + i], tV[i, None])
                amax = self._column_amax_dequantized(tV, column)
            else:
                amax, finite = self._column_amax_16bit(tX, column)
            # ---- column multipliers, made by lanes 0..7 for the warp
            scale_inv = _share_multipliers(sColScale, amax, self.power_2_scales)
            if lane < VEC and col < cols:
                mScaleInv[block, col + column] = scale_inv
            plain = _warp_plain(scale_inv, finite, self.power_2_scales)
            # ---- the column-wise copy: 4 bytes of each column, one word a lane
            if col < cols:
                if plain:
                    self._store_columns(mData, tV, sColScale, block, col, True)
                else:
                    self._store_columns(mData, tV, sColScale, block, col, False)
            item = following
            buffer = 1 - buffer
            block, cb, first_row, row_end = f_block, f_cb, f_first_row, f_row_end
