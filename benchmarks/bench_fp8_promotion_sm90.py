"""What the FP8 promotion costs: FC1 + SwiGLU (`grouped_gemm_fp8_sm90`, tile 256, bf16 outputs)
with the block step of the mainloop swapped for probe variants, each compiled in this process.

  halves     the kernel as the library builds it: each 128-deep block's product in two 128-column
             halves into one 64-register product, wait and promote per half
  nofma      the same WGMMAs and waits, the promotion's FMAs left out (wrong sums: timing only)
  onedrain   both halves' WGMMAs straight into the accumulator, one wait a block, no promotion
             (wrong sums: timing only)
  quarters   four 64-column quarters into two 32-register products, quarter q promoted while
             quarter q + 1's WGMMAs run: one wait a block, the same sums
  rsquart    quarters with the block's A read into registers once (ldmatrix), RS WGMMAs
  turnsissue the two MMA warpgroups take turns at each half's WGMMAs (named barriers, as the
             ping-pong mainloops take turns at whole tiles), a turn passed on once its WGMMAs are
             issued: a half's WGMMAs queue behind the other warpgroup's and its promotion runs
             while they execute
  turnsdone  the same, the turn passed on once its WGMMAs have completed
  <v>_y      variant v with DeepGEMM's FFMA interleave applied to the cubin: the operand-b reuse
             flag and the yield bit cleared on the register-only FFMAs that carry both
  <v>_y2     the same on every other such FFMA
  <v>_r      the opposite: operand b's reuse flag (and no yield) on every FFMA followed by one
             reading the same b register

The variants that keep the sums are checked against float64 of the quantized operands and bit for
bit against ``halves`` (outputs NaN-poisoned first); then all are timed in rotated order
(`common.rotated_medians`). The probe variants are not library code: they replace methods of
`Sm90Mainloop` while they compile and put them back after.

    python benchmarks/bench_fp8_promotion_sm90.py [--check-only] [variants] [shapes]
    (defaults: halves,nofma,onedrain,quarters,rsquart  dsv3-ep8,mixtral-8x7b,qwen3-30b-a3b)

``--check-only`` launches each variant once (its check) and times nothing: the run to profile,
e.g. ``ncu --kernel-name regex:GroupedGemm --launch-count 5 --section SpeedOfLight ...``.
"""

import math
import os
import struct
import sys

from common import require_sm90

if __name__ == "__main__":
    require_sm90(__file__)

import cutlass
import cutlass.cute as cute
import torch
from common import model_shape, rotated_medians, skewed_splits, sustained_ms
from cutlass import const_expr

import te_fused_ops.backends.sm90.kernels.mainloop_sm90 as mainloop
from te_fused_ops.backends.sm90.kernels import grouped_gemm as gg
from te_fused_ops.backends.sm90.kernels.grouped_act_sm90 import GroupedGemmActFp8Sm90
from te_fused_ops.backends.sm90.kernels.named_barriers_sm90 import MMA_TURN
from te_fused_ops.quantization import quantize, quantize_weight
from te_fused_ops.splits import split_offsets

ACCUMULATE = cute.nvgpu.warpgroup.Field.ACCUMULATE
LIBRARY = {n: mainloop.Sm90Mainloop.__dict__[n] for n in ("_fp8_k_tile_halves", "_half_tiled_mma", "_mma_fragments")}
EXACT = ("halves", "quarters", "rsquart", "turnsissue", "turnsdone")
REUSE_B_AND_YIELD = 0x0800200000000000  # bits 59 and 45 of an instruction's high 64-bit word
FFMA_RRR = 0x223  # opcode bits of a register-only FFMA


@cute.jit
def halves_without_fma(self, ab_pipe, read_state, tiled_mma, acc, fp8_args, tile, k, held, n_box, m_total):
    acc_block, tCrA, tCrB, scales, tCcAcc = fp8_args
    ahead = held
    for h in cutlass.range_constexpr(2):
        tiled_mma.set(ACCUMULATE, False)
        cute.nvgpu.warpgroup.fence()
        mainloop.mma_block(tiled_mma, acc_block, tCrA, tCrB[h], read_state.index)
        cute.nvgpu.warpgroup.commit_group()
        if const_expr(h == 0):
            ahead = self._block_scales(scales, tile, tCcAcc, k + 1, n_box, m_total)
        cute.nvgpu.warpgroup.wait_group(0)
        if const_expr(h == 1):
            ab_pipe.consumer_release(read_state)
        acc[h * 64] = acc[h * 64] + acc_block[0] * held[0][0]  # keeps the product live
    return ahead


@cute.jit
def halves_into_acc(self, ab_pipe, read_state, tiled_mma, acc, fp8_args, tile, k, held, n_box, m_total):
    acc_block, tCrA, tCrB, scales, tCcAcc = fp8_args
    cute.nvgpu.warpgroup.fence()
    for h in cutlass.range_constexpr(2):
        half = cute.make_tensor(acc.iterator + h * cute.size(acc_block), acc_block.layout)
        tiled_mma.set(ACCUMULATE, True)
        mainloop.mma_block(tiled_mma, half, tCrA, tCrB[h], read_state.index)
    cute.nvgpu.warpgroup.commit_group()
    ahead = self._block_scales(scales, tile, tCcAcc, k + 1, n_box, m_total)
    cute.nvgpu.warpgroup.wait_group(0)
    ab_pipe.consumer_release(read_state)
    return ahead


def quarter_tiled_mma(self, a_in_registers):
    import cutlass.utils.hopper_helpers as sm90_utils

    source = cute.nvgpu.warpgroup.OperandSource
    return sm90_utils.make_trivial_tiled_mma(
        self.ab_dtype, self.ab_dtype, self.a_layout.sm90_mma_major_mode(), self.b_layout.sm90_mma_major_mode(),
        self.acc_dtype, (self.mma_atoms, 1, 1), tiler_mn=(64, self.tile_n // 4),
        a_source=source.RMEM if a_in_registers else source.SMEM,
    )


def quarter_fragments(a_in_registers):
    """`_mma_fragments` of the quarter variants: fp8_args = ((two quarter products), A operand,
    the four quarters' B views, scales, acc coordinates); A operand: the shared-memory view, or
    (register fragment, ldmatrix copy, its source view, its destination view)."""

    def fragments(self, tiled_mma, mma_tidx, smem_tensors, scales):
        thr_mma = tiled_mma.get_slice(mma_tidx)
        acc = cute.make_rmem_tensor(thr_mma.partition_shape_C((self.tile_m, self.tile_n)), self.acc_dtype)
        qmma = quarter_tiled_mma(self, a_in_registers)
        thr_q = qmma.get_slice(mma_tidx)
        quarter = self.tile_n // 4
        if a_in_registers:
            frag = qmma.make_fragment_A(thr_q.partition_A(smem_tensors.sA)[(None, None, None, 0)])
            copy = cute.make_tiled_copy_A(
                cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), self.ab_dtype), qmma)
            thr_copy = copy.get_slice(mma_tidx)
            a_operand = (frag, copy, thr_copy.partition_S(smem_tensors.sA), thr_copy.retile(frag))
        else:
            a_operand = qmma.make_fragment_A(thr_q.partition_A(smem_tensors.sA))
        stages = cute.size(smem_tensors.sB, mode=[2])
        tCrB = tuple(
            qmma.make_fragment_B(thr_q.partition_B(cute.local_tile(smem_tensors.sB, (quarter, self.tile_k, stages),
                                                                   (q, 0, 0))))
            for q in range(4)
        )
        shape = thr_q.partition_shape_C((self.tile_m, quarter))
        products = (cute.make_rmem_tensor(shape, self.acc_dtype), cute.make_rmem_tensor(shape, self.acc_dtype))
        tCcAcc = thr_mma.partition_C(cute.make_identity_tensor((self.tile_m, self.tile_n)))
        return acc, frag if a_in_registers else a_operand, tCrB, (products, a_operand, tCrB, scales, tCcAcc)

    return fragments


@cute.jit
def promote_quarter(self, acc, product, multipliers, q: cutlass.Constexpr[int]):
    """acc's values of quarter q += product scaled per row by its half's W block multiplier."""
    rows, boxes = multipliers
    h = q // 2
    w_block = boxes[h][0] if const_expr(self.b_boxes == 2) else boxes[0][h]
    scale = [rows[r] * w_block for r in range(2)]
    size = cute.size(product)
    for v in cutlass.range_constexpr(size):
        acc[v + q * size] = acc[v + q * size] + product[v] * scale[v // 2 % 2]


def quarter_block(a_in_registers):
    @cute.jit
    def block(self, ab_pipe, read_state, tiled_mma, acc, fp8_args, tile, k, held, n_box, m_total):
        products, a_operand, tCrB, scales, tCcAcc = fp8_args
        ahead = held
        if const_expr(a_in_registers):
            frag, copy, source, destination = a_operand
            cute.copy(copy, source[(None, None, None, read_state.index)], destination)
        for q in cutlass.range_constexpr(4):
            tiled_mma.set(ACCUMULATE, False)
            cute.nvgpu.warpgroup.fence()
            if const_expr(a_in_registers):
                for kb in cutlass.range_constexpr(cute.size(a_operand[0], mode=[2])):
                    cute.gemm(tiled_mma, products[q % 2], a_operand[0][(None, None, kb)],
                              tCrB[q][(None, None, kb, read_state.index)], products[q % 2])
                    tiled_mma.set(ACCUMULATE, True)
            else:
                mainloop.mma_block(tiled_mma, products[q % 2], a_operand, tCrB[q], read_state.index)
            cute.nvgpu.warpgroup.commit_group()
            if const_expr(q == 0):
                ahead = self._block_scales(scales, tile, tCcAcc, k + 1, n_box, m_total)
            if const_expr(q > 0):
                cute.nvgpu.warpgroup.wait_group(1)
                promote_quarter(self, acc, products[(q - 1) % 2], held, q - 1)
        cute.nvgpu.warpgroup.wait_group(0)
        ab_pipe.consumer_release(read_state)
        promote_quarter(self, acc, products[1], held, 3)
        return ahead

    return block


def halves_in_turns(pass_on_issue):
    @cute.jit
    def block(self, ab_pipe, read_state, tiled_mma, acc, fp8_args, tile, k, held, n_box, m_total):
        acc_block, tCrA, tCrB, scales, tCcAcc = fp8_args
        mma_wg = cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128 - 1)
        ahead = held
        for h in cutlass.range_constexpr(2):
            cute.arch.barrier(barrier_id=MMA_TURN + mma_wg, number_of_threads=256)
            tiled_mma.set(ACCUMULATE, False)
            cute.nvgpu.warpgroup.fence()
            mainloop.mma_block(tiled_mma, acc_block, tCrA, tCrB[h], read_state.index)
            cute.nvgpu.warpgroup.commit_group()
            if const_expr(pass_on_issue):
                cute.arch.barrier_arrive(barrier_id=MMA_TURN + 1 - mma_wg, number_of_threads=256)
            if const_expr(h == 0):
                ahead = self._block_scales(scales, tile, tCcAcc, k + 1, n_box, m_total)
            cute.nvgpu.warpgroup.wait_group(0)
            if const_expr(not pass_on_issue):
                cute.arch.barrier_arrive(barrier_id=MMA_TURN + 1 - mma_wg, number_of_threads=256)
            if const_expr(h == 1):
                ab_pipe.consumer_release(read_state)
            self._promote_half(acc, acc_block, held, h)
        return ahead

    return block


@cute.jit
def first_turn_to_warpgroup_0():
    """Warpgroup 1 arrives at warpgroup 0's turn barrier once, before either takes a turn."""
    if cute.arch.make_warp_uniform(cute.arch.thread_idx()[0] // 128 - 1) == 1:
        cute.arch.barrier_arrive(barrier_id=MMA_TURN, number_of_threads=256)


def fragments_then_first_turn(self, tiled_mma, mma_tidx, smem_tensors, scales):
    made = LIBRARY["_mma_fragments"](self, tiled_mma, mma_tidx, smem_tensors, scales)
    first_turn_to_warpgroup_0()
    return made


def use_variant(variant):
    """Put ``variant``'s methods on `Sm90Mainloop` (``halves``: the library's own)."""
    for name, fn in LIBRARY.items():
        setattr(mainloop.Sm90Mainloop, name, fn)
    if variant == "nofma":
        mainloop.Sm90Mainloop._fp8_k_tile_halves = halves_without_fma
    elif variant == "onedrain":
        mainloop.Sm90Mainloop._fp8_k_tile_halves = halves_into_acc
    elif variant in ("quarters", "rsquart"):
        registers = variant == "rsquart"
        mainloop.Sm90Mainloop._fp8_k_tile_halves = quarter_block(registers)
        mainloop.Sm90Mainloop._half_tiled_mma = lambda self: quarter_tiled_mma(self, registers)
        mainloop.Sm90Mainloop._mma_fragments = quarter_fragments(registers)
    elif variant in ("turnsissue", "turnsdone"):
        mainloop.Sm90Mainloop._fp8_k_tile_halves = halves_in_turns(variant == "turnsissue")
        mainloop.Sm90Mainloop._mma_fragments = fragments_then_first_turn
    elif variant != "halves":
        raise ValueError(f"unknown variant {variant!r}")


def elf_sections(buf, start):
    """(name, offset in buf, size) of the sections of the ELF64 image at ``buf[start:]``, and the
    offset in buf where the image ends."""
    phoff, shoff = struct.unpack_from("<QQ", buf, start + 0x20)
    phentsize, phnum, shentsize, shnum, shstrndx = struct.unpack_from("<HHHHH", buf, start + 0x36)
    heads = [struct.unpack_from("<IIQQQQ", buf, start + shoff + i * shentsize) for i in range(shnum)]
    names = start + heads[shstrndx][4]
    sections = []
    end = max(start + shoff + shnum * shentsize, start + phoff + phnum * phentsize)
    for i in range(phnum):
        _kind, _flags, offset, _vaddr, _paddr, filesz = struct.unpack_from("<IIQQQQ", buf, start + phoff + i * phentsize)
        end = max(end, start + offset + filesz)
    for name, kind, _flags, _addr, offset, size in heads:
        sections.append((bytes(buf[names + name: buf.index(b"\0", names + name)]).decode(), start + offset, size))
        if kind != 8:  # SHT_NOBITS occupies no bytes
            end = max(end, start + offset + size)
    return sections, end


def text_sections(buf):
    """(offset, size) in ``buf`` of the code sections of each cubin embedded in it."""
    start = 1
    while (start := buf.find(b"\x7fELF", start)) >= 0:
        sections, end = elf_sections(buf, start)
        yield from ((offset, size) for name, offset, size in sections if name.startswith(".text."))
        start = end


def ffma_words(buf, at):
    """(low, high) 64-bit words of the instruction at ``at`` if it is a register-only FFMA, else None."""
    low = int.from_bytes(buf[at:at + 8], "little")
    return (low, int.from_bytes(buf[at + 8:at + 16], "little")) if low & 0xFFF == FFMA_RRR else None


def interleave_ffma(obj: bytes, every: int) -> bytes:
    """The object file ``obj`` with the reuse flag of operand b and the yield bit cleared on
    every ``every``-th register-only FFMA that carries both, in each cubin embedded in it."""
    buf = bytearray(obj)
    flipped = seen_all = 0
    for offset, size in list(text_sections(buf)):
        seen = 0
        for at in range(offset, offset + size, 16):
            words = ffma_words(buf, at)
            if words and words[1] & REUSE_B_AND_YIELD == REUSE_B_AND_YIELD:
                if seen % every == 0:
                    buf[at + 8:at + 16] = (words[1] ^ REUSE_B_AND_YIELD).to_bytes(8, "little")
                    flipped += 1
                seen += 1
        seen_all += seen
    print(f"FFMA interleave: {flipped} of {seen_all} FFMAs with reuse and yield changed", flush=True)
    return bytes(buf)


def chain_reuse(obj: bytes) -> bytes:
    """The object file ``obj`` with operand b's reuse flag (and the no-yield bit that ptxas sets
    with it) on every register-only FFMA followed by one that reads the same b register: the
    opposite of `interleave_ffma`, each run of a multiplier's FFMAs reading it from the register
    file once."""
    buf = bytearray(obj)
    added = 0
    for offset, size in list(text_sections(buf)):
        for at in range(offset, offset + size - 16, 16):
            this, following = ffma_words(buf, at), ffma_words(buf, at + 16)
            if this and following and (this[0] >> 32) & 0xFF == (following[0] >> 32) & 0xFF \
                    and not this[1] & REUSE_B_AND_YIELD:
                buf[at + 8:at + 16] = (this[1] | REUSE_B_AND_YIELD).to_bytes(8, "little")
                added += 1
    print(f"FFMA reuse chains: reuse set on {added} more FFMAs", flush=True)
    return bytes(buf)


def compile_variant(variant, cluster_m, tvm_ffi):
    """The launcher of FC1 + SwiGLU at tile 256 with ``variant``'s block step."""
    base, _, patch = variant.partition("_")
    if patch:
        fn = compile_variant(base, cluster_m, tvm_ffi)
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"fp8_promotion_{variant}.o")
        if tvm_ffi:
            fn.export_to_c(path, function_name="probe")
            with open(path, "rb") as f:
                obj = f.read()
        else:
            obj = fn.dump_to_object("probe")
        with open(path, "wb") as f:
            f.write(chain_reuse(obj) if patch == "r" else interleave_ffma(obj, {"y": 1, "y2": 2}[patch]))
        return getattr(cute.runtime.load_module(path, enable_tvm_ffi=tvm_ffi), "probe")
    use_variant(base)
    try:
        m, g = cute.sym_int(), cute.sym_int()
        k, n = cute.sym_int(divisibility=16), cute.sym_int(divisibility=gg.FP8_GLU_N_MULTIPLE)
        dt = cutlass.BFloat16
        fakes = (*gg._fp8_operand_fakes(m, k, g, n), gg.fake_tensor(dt, (m, n)),
                 gg.fake_tensor(dt, (m, cute.sym_int(divisibility=8))), None, None, None)
        return gg._compile(GroupedGemmActFp8Sm90(dt, "swiglu", False, cluster_m, 256), fakes, tvm_ffi)
    finally:
        use_variant("halves")


def main(variants, shapes, check_only=False):
    tvm_ffi = gg.tvm_ffi_available()
    compiled, rows = {}, []
    for name in shapes:
        m, h, i, e = model_shape(name)
        torch.manual_seed(0)
        offsets = split_offsets(skewed_splits(m, e, 0, align=8).cuda(), m)
        x = torch.randn(m, h, device="cuda")
        w = torch.randn(e, 2 * i, h, device="cuda") / math.sqrt(h)
        w *= (4.0 ** (torch.arange(2 * i, device="cuda") // 128 % 3))[:, None]  # W blocks 1x / 4x / 16x apart
        qx, qw = quantize(x, "fp8_blockwise"), quantize_weight(w, "fp8_blockwise")
        _, cluster_m, clusters, _ = gg._launch_config(gg._FP8, m, 2 * i, e, x.get_device(), 128, None, None)
        constants = gg.activation_constants(gg._FP8, {})
        bounds = offsets.tolist()
        x64, w64 = qx.dequantize(torch.float32).double(), qw.dequantize(torch.float32).double()
        outputs, calls = {}, {}
        for v in variants:
            key = (v, cluster_m)
            if key not in compiled:
                compiled[key] = compile_variant(v, cluster_m, tvm_ffi)
            pre = torch.full((m, 2 * i), float("nan"), dtype=torch.bfloat16, device="cuda")
            act = torch.full((m, i), float("nan"), dtype=torch.bfloat16, device="cuda")
            tensors = (qx.rowwise_data, qx.rowwise_scale_inv, qw.rowwise_data, qw.rowwise_scale_inv, offsets, pre,
                       act, None, None, None)
            calls[v] = (lambda fn=compiled[key], tensors=tensors:
                        gg._run(fn, tvm_ffi, None, None, tensors, constants, clusters))
            calls[v]()
            torch.cuda.synchronize()
            outputs[v] = pre
            if v.partition("_")[0] in EXACT:
                assert not torch.isnan(pre[: bounds[-1]]).any(), f"{name} {v}: rows left unwritten"
                num = den = 0.0
                for group in (0, e // 2, e - 1):
                    s, end = bounds[group], bounds[group + 1]
                    if end > s:
                        ref = x64[s:end] @ w64[group].T
                        num += (pre[s:end].double() - ref).norm().item() ** 2
                        den += ref.norm().item() ** 2
                err = math.sqrt(num / den)
                same = torch.equal(pre.view(torch.int16), outputs["halves"].view(torch.int16)) if "halves" in outputs \
                    else None
                print(f"{name} {v}: relative error {err:.2e}, bit-equal to halves: {same}", flush=True)
                assert err < 1e-2 and same is not False, f"{name} {v}: wrong sums"
        if check_only:
            continue
        us = rotated_medians(calls, lambda fn: sustained_ms(fn, 0.3, 0.3) * 1e3)
        flops = 2 * bounds[-1] * 2 * i * h
        rows.append((name, {v: (t, flops / t / 1e6) for v, t in us.items()}))
        print(name, {v: round(t, 1) for v, t in us.items()}, flush=True)
    if check_only:
        return
    print(f"\n{torch.cuda.get_device_name()}, FC1 + SwiGLU at tile 256, us (TFLOPS)\n")
    print("| shape | " + " | ".join(variants) + " |")
    print("|---|" + "---|" * len(variants))
    for name, row in rows:
        print(f"| {name} | " + " | ".join(f"{row[v][0]:.1f} ({row[v][1]:.0f})" for v in variants) + " |")


if __name__ == "__main__":
    if {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit(print(__doc__))
    args = [a for a in sys.argv[1:] if a != "--check-only"]
    main((args[0] if args else "halves,nofma,onedrain,quarters,rsquart").split(","),
         (args[1] if len(args) > 1 else "dsv3-ep8,mixtral-8x7b,qwen3-30b-a3b").split(","),
         check_only="--check-only" in sys.argv[1:])
