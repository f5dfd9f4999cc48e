"""The sm90 GEMM kernels keep their WGMMAs batched in the machine code (CPU, CUTE_DSL_ARCH=sm_90a).

ptxas serializes every WGMMA of a kernel (each one its own commit group, waited on before the
next is issued) when it cannot prove the code around them warpgroup-uniform: a thread-dependent
loop before the warp specialization or a branch in an epilogue was enough (ptxas info C7520),
and the weight gradient ran 3-13% slower for it on an H100. The configurations below are compiled
in one subprocess that keeps their cubins; the disassembly must show WGMMAs issued without their
own commit group (HGMMA / QGMMA without gsb0), in every loop of the kernel. The largest MoE row
mover is checked there too (no local memory).
"""

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl not installed"
)

COMPILE = {  # name: Python that compiles one configuration (torch as torch, bf16 = torch.bfloat16)
    "wgrad dW tile 256 pair": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad as c;"
                              "c(bf16, 256, False, 2, False)",
    "wgrad main_grad tile 128": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad as c;"
                                "c(bf16, 128, True, 1, False)",
    "dgrad + dScaledSwiGLU tile 128": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_dgrad_dact as c;"
                                      "c(bf16, 128, 'scaled_swiglu', False, 2, False)",
    "dgrad + dSwiGLU tile 256, epilogue warps": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                " compile_grouped_dgrad_dact as c; c(bf16, 256, 'swiglu', False, 2, True)",
    "forward + SwiGLU tile 256": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm as c;"
                                 "c(bf16, 256, 'swiglu', False, False, 2)",
    "wgrad dW tile 192 pair": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad as c;"
                              "c(bf16, 192, False, 2, False)",
    "forward + SwiGLU tile 192 ping-pong": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                          " compile_grouped_gemm as c; c(bf16, 192, 'swiglu', False, False, 2,"
                                          " pingpong=True)",
    "dgrad + dScaledSwiGLU tile 192 ping-pong": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                               " compile_grouped_dgrad_dact as c;"
                                               " c(bf16, 192, 'scaled_swiglu', False, 2, False, pingpong=True)",
    "forward + SwiGLU gathered rows tile 256 pair": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                    " compile_grouped_gemm_gathered as c;"
                                                    " c(bf16, 256, 'swiglu', False, False, 2)",
    "forward + ScaledSwiGLU gathered rows tile 192 ping-pong": "from te_fused_ops.backends.sm90.kernels.grouped_gemm"
                                                               " import compile_grouped_gemm_gathered as c;"
                                                               " c(bf16, 192, 'scaled_swiglu', False, False, 2,"
                                                               " pingpong=True)",
    "forward + SwiGLU tile 192 ping-pong + bias": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                 " compile_grouped_gemm as c; c(bf16, 192, 'swiglu', True, False, 2,"
                                                 " pingpong=True)",
    "forward gathered rows tile 128 + bias": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                             " compile_grouped_gemm_gathered as c; c(bf16, 128, None, True, False, 1)",
    "wgrad dW gathered rows tile 256 pair": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import"
                                            " compile_grouped_wgrad_gathered as c; c(bf16, 256, False)",
    "wgrad dW gathered rows tile 192 pair": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import"
                                            " compile_grouped_wgrad_gathered as c; c(bf16, 192, False)",
    "wgrad dW gathered dy rows tile 256 pair": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import"
                                               " compile_grouped_wgrad_gathered as c; c(bf16, 256, False, 'dy')",
    "dgrad + dScaledSwiGLU gathered dy rows tile 256 pair": "from te_fused_ops.backends.sm90.kernels.grouped_gemm"
                                                            " import compile_grouped_dgrad_dact as c;"
                                                            " c(bf16, 256, 'scaled_swiglu', False, 2, False,"
                                                            " gathered=True)",
    "dgrad + dScaledSwiGLU gathered dy rows tile 192 ping-pong": "from te_fused_ops.backends.sm90.kernels.grouped_gemm"
                                                                " import compile_grouped_dgrad_dact as c;"
                                                                " c(bf16, 192, 'scaled_swiglu', False, 2, False,"
                                                                " pingpong=True, gathered=True)",
    "dgrad + dScaledSwiGLU gathered dy rows tile 192 ping-pong, act kept": "from te_fused_ops.backends.sm90.kernels"
                                                                          ".grouped_gemm import"
                                                                          " compile_grouped_dgrad_dact as c;"
                                                                          " c(bf16, 192, 'scaled_swiglu', False, 2,"
                                                                          " False, pingpong=True, gathered=True,"
                                                                          " emit_act=False)",
    "FP8 wgrad dW pair": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad as c;"
                         "c(bf16, 128, False, 2, False, True)",
    "FP8 wgrad dW pair, overlapped promotion": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import"
                                               " compile_grouped_wgrad as c;"
                                               " c(bf16, 128, False, 2, False, True, overlap_promotion=True)",
    "FP8 wgrad dW pair tile 192": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad as c;"
                                  " c(bf16, 192, False, 2, False, True)",
    "FP8 wgrad dW pair tile 256, half products": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import"
                                                  " compile_grouped_wgrad as c; c(bf16, 256, False, 2, False, True)",
    "FP8 forward + SwiGLU, overlapped promotion": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                  " compile_grouped_gemm_fp8 as c;"
                                                  " c(bf16, 'swiglu', False, False, 2, 128, overlap_promotion=True)",
    "FP8 forward + SwiGLU": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm_fp8 as c;"
                            "c(bf16, 'swiglu', False, False, 2, 128)",
    "FP8 forward tile 192, a k-loop per split": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                 " compile_grouped_gemm_fp8 as c; c(bf16, None, False, False, 2, 192)",
    "FP8 forward + SwiGLU tile 256, half products": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                    " compile_grouped_gemm_fp8 as c; c(bf16, 'swiglu', False, False, 2,"
                                                    " 256)",
    "FP8 forward + SwiGLU tile 256, up box split": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                   " compile_grouped_gemm_fp8 as c; c(bf16, 'swiglu', False, False, 2,"
                                                   " 256, up_box_split=True)",
    "FP8 forward + ScaledSwiGLU + act cast with columns": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                          " compile_grouped_gemm_act_quant_fp8 as c;"
                                                          " c(bf16, 'scaled_swiglu', False, False, 2, True)",
    "FP8 dgrad + dScaledSwiGLU tile 256, half products": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                         " compile_grouped_dgrad_dact_fp8 as c;"
                                                         " c(bf16, 'scaled_swiglu', False, 2, False, 256)",
    "FP8 dgrad + dScaledSwiGLU tile 256, act emitted": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                                       " compile_grouped_dgrad_dact_fp8 as c;"
                                                       " c(bf16, 'scaled_swiglu', False, 2, False, 256, emit_act=True)",
}


def _nvdisasm():
    found = shutil.which("nvdisasm")
    if found:
        return found
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else ():
        for candidate in glob.glob(os.path.join(root, "cu1*", "bin", "nvdisasm")):
            return candidate
    return None


_COMPILE_ALL = """
import glob, json, os, shutil, sys
import torch
bf16 = torch.bfloat16
dump = os.environ["CUTE_DSL_DUMP_DIR"]
for index, code in enumerate(json.loads(sys.argv[1])):
    exec(code)
    kept = os.path.join(dump, str(index))
    os.makedirs(kept)
    for cubin in glob.glob(os.path.join(dump, "*.cubin")):
        shutil.move(cubin, kept)
"""

ROW_MOVERS = {  # the largest configuration of each row-mover kernel
    "row mover": "from te_fused_ops.backends.sm90.kernels.moe_rows import compile_scatter_rows as s; s(bf16, True, True, False)",
    "cast row mover": "from te_fused_ops.backends.sm90.kernels.moe_rows import compile_scatter_cast_rows as s; "
                      "s(bf16, False, False)",
    "routing": "from te_fused_ops.backends.sm90.kernels.route import compile_route as r; r(torch.int64, False)",
    "slots to rows": "from te_fused_ops.backends.sm90.kernels.slot_values import compile_slots_to_rows as c; "
                     "c(bf16, False)",
    "rows to slots": "from te_fused_ops.backends.sm90.kernels.slot_values import compile_rows_to_slots as c; "
                     "c(bf16, False)",
}

WITHOUT_PROBS = {  # the SwiGLU twins of ScaledSwiGLU dActivations in `COMPILE` (`PROBS_TWINS`)
    "dgrad + dSwiGLU tile 128": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_dgrad_dact"
                                " as c; c(bf16, 128, 'swiglu', False, 2, False)",
    "dgrad + dSwiGLU gathered dy rows tile 192 ping-pong": "from te_fused_ops.backends.sm90.kernels.grouped_gemm"
                                                           " import compile_grouped_dgrad_dact as c;"
                                                           " c(bf16, 192, 'swiglu', False, 2, False, pingpong=True,"
                                                           " gathered=True)",
}
PROBS_TWINS = {"dgrad + dScaledSwiGLU tile 128": "dgrad + dSwiGLU tile 128",
               "dgrad + dScaledSwiGLU gathered dy rows tile 192 ping-pong":
                   "dgrad + dSwiGLU gathered dy rows tile 192 ping-pong"}

CASTS = {  # the E4M3 casts whose per-value instructions bound their speed
    "weight cast": "from te_fused_ops.backends.sm90.kernels.block_quantize import compile_block_quantize as c;"
                   " c(bf16, 128, None, False, False, True)",
    "row cast": "from te_fused_ops.backends.sm90.kernels.block_quantize import compile_block_quantize as c;"
                " c(bf16, 1, None, False, False, False)",
}


@pytest.fixture(scope="module")
def machine_code(tmp_path_factory):
    """name -> the SASS of its kernels: every configuration of `COMPILE`, `ROW_MOVERS`, `WITHOUT_PROBS` and `CASTS`,
    compiled in two subprocesses at once (one import of the compiler each, every other
    configuration) that keep the cubins."""
    nvdisasm = _nvdisasm()
    assert nvdisasm, "nvdisasm not found: install the test extra (nvidia-cuda-nvdisasm)"
    names = [*COMPILE, *ROW_MOVERS, *WITHOUT_PROBS, *CASTS]
    codes = [*COMPILE.values(), *ROW_MOVERS.values(), *WITHOUT_PROBS.values(), *CASTS.values()]
    dumps = [tmp_path_factory.mktemp("cubins") for _ in range(2)]
    runs = [subprocess.Popen([sys.executable, "-c", _COMPILE_ALL, json.dumps(codes[part::2])],
                             env=dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin",
                                      CUTE_DSL_DUMP_DIR=str(dump), CUTE_DSL_DISABLE_FILE_CACHING="1"),
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            for part, dump in enumerate(dumps)]
    for run in runs:
        _, err = run.communicate(timeout=1200)
        assert run.returncode == 0, err.decode()[-2000:]
    sass = {}
    for index, name in enumerate(names):
        cubins = sorted(glob.glob(str(dumps[index % 2] / str(index // 2) / "*.cubin")))
        sass[name] = [subprocess.run([nvdisasm, "-c", f], check=True, capture_output=True, text=True).stdout
                      for f in cubins]
    return sass


@pytest.mark.parametrize("name", [name for name in COMPILE if name.startswith("FP8")])
def test_fp8_kernels_keep_registers(name, machine_code):
    """The FP8 kernels hold the accumulator and the block products (tile 256: a half) without
    local memory."""
    for sass in machine_code[name]:
        assert "LDL" not in sass and "STL" not in sass, f"{name}: local memory"


# gathering kernels that spill as much as their kernel on the copy (the ping-pong dActivation's
# whole 192-wide accumulators at 240 registers), and that kernel
SPILLS_AS = {"dgrad + dScaledSwiGLU gathered dy rows tile 192 ping-pong": "dgrad + dScaledSwiGLU tile 192 ping-pong",
             "dgrad + dScaledSwiGLU gathered dy rows tile 192 ping-pong, act kept":
                 "dgrad + dScaledSwiGLU tile 192 ping-pong"}


@pytest.mark.parametrize("name", [name for name in COMPILE if "gathered" in name])
def test_gathered_rows_load_by_cp_async(name, machine_code):
    """The gathering producer warps load their operand with 16-byte cp.async that bypass L1 and
    arrive on the stage's barrier when they land, and nothing spills (`SPILLS_AS`: no more than the
    kernel on the copy)."""
    copy = machine_code[SPILLS_AS[name]] if name in SPILLS_AS else None
    for i, sass in enumerate(machine_code[name]):
        assert "LDGSTS.E.BYPASS.128" in sass, f"{name}: no 16-byte cp.async"
        assert "ARRIVES.LDGSTSBAR" in sass, f"{name}: no cp.async arrival on an mbarrier"
        allowed = (0, 0) if copy is None else (copy[i].count("LDL"), copy[i].count("STL"))
        assert sass.count("LDL") <= allowed[0] and sass.count("STL") <= allowed[1], f"{name}: local memory"


@pytest.mark.parametrize("name", list(COMPILE))
def test_wgmmas_are_batched(name, machine_code):
    """No WGMMA loop serialized: batched code ends each commit group with one gsb0 WGMMA, so at most
    two come in a row (a one-WGMMA group, then the next group's last); a serialized loop (a k-loop
    whose k-tiles branched between two products did that) gives every WGMMA of it its own."""
    assert machine_code[name], f"{name}: no cubin kept"
    for sass in machine_code[name]:
        wgmmas = [line for line in sass.splitlines() if "GMMA." in line]
        assert wgmmas, f"{name}: no WGMMA in the machine code"
        run = longest = 0
        for line in wgmmas:
            run = run + 1 if "gsb0" in line else 0
            longest = max(longest, run)
        assert longest <= 2, f"{name}: {longest} WGMMAs in a row each their own commit group (serialized by ptxas)"


@pytest.mark.parametrize("name", list(ROW_MOVERS))
def test_row_mover_keeps_registers(name, machine_code):
    """The largest row movers (scatter with scale and dot; the scatter that casts), the routing
    kernel and the slot-value kernels use no local memory (an rmem tensor made per slot inside the
    unrolled slot loop once spilled: it ran at a third of its speed on an H100). The other
    configurations compile and run in the GPU tests."""
    assert len(machine_code[name]) == 1
    for sass in machine_code[name]:
        assert "LDL" not in sass and "STL" not in sass, f"{name}: local memory"
        if name == "cast row mover":  # 8 E4M3 bytes a lane a store
            assert "STG.E.64" in sass, f"{name}: no 64-bit stores"


@pytest.mark.parametrize("name", list(PROBS_TWINS))
def test_probs_are_read_once_a_row(name, machine_code):
    """The ScaledSwiGLU dActivation reads its rows' probs once a tile, a load per row of the thread
    (`epilogue_cast_sm90.load_row_values`): at most 8 global loads more than its SwiGLU twin. A
    load per value (64-192 more; ptxas merged none) made the kernel 11% slower on an H100."""
    twin = machine_code[PROBS_TWINS[name]]
    assert len(machine_code[name]) == len(twin) == 1
    loads = [len(re.findall(r"\bLDG\.E", sass)) for sass in (machine_code[name][0], twin[0])]
    assert loads[0] - loads[1] <= 8, f"{name}: {loads[0]} global loads against its SwiGLU twin's {loads[1]}"


@pytest.mark.parametrize("name", ["forward + SwiGLU tile 192 ping-pong + bias"])
def test_bias_is_read_once_a_column(name, machine_code):
    """The forward epilogue reads the bias of a thread's columns once a 32-column chunk
    (`epilogue_cast_sm90.load_column_values`: 8 columns of 2 boxes, 3 chunks of the tile), not once
    a value (192 loads more than the kernel without a bias, 4 of its values spilled)."""
    twin = machine_code[name.removesuffix(" + bias")]
    assert len(machine_code[name]) == len(twin) == 1
    loads = [len(re.findall(r"\bLDG\.E", sass)) for sass in (machine_code[name][0], twin[0])]
    assert loads[0] - loads[1] <= 48, f"{name}: {loads[0]} global loads against {loads[1]} without a bias"


@pytest.mark.parametrize("name", list(CASTS))
def test_casts_take_the_amax_on_packed_pairs(name, machine_code):
    """The casts run at the rate they issue instructions: each block's amax is taken on the packed
    16-bit pairs (a packed compare with +Inf, a packed integer max; a float32 chain of compares
    and selects per value made the weight cast 20% slower on an H200) and nothing spills (the
    weight cast holds 64 values a thread under a register cap of 3 CTAs per SM)."""
    assert len(machine_code[name]) == 1
    for sass in machine_code[name]:
        assert "HSET2.BF16_V2" in sass and "VIMNMX" in sass and "U16x2" in sass, f"{name}: amax not on packed pairs"
        assert "LDL" not in sass and "STL" not in sass, f"{name}: local memory"
