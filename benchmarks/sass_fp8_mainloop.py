"""The block-scaled FP8 forward's mainloop in machine code, on a CPU (no GPU needed).

Compiles this library's FP8 grouped GEMM (plain output) for sm_90a at the given tile widths and,
with ``--deepgemm``, DeepGEMM's sm90 1D2D m-grouped kernel (nvcc, its template at the given
configuration), disassembles both (nvdisasm) and counts the innermost loop that holds the WGMMAs:
instructions per scale block (128 of K), split into the issue phase (WARPGROUP.ARRIVE up to the
wait) and the promotion phase (the wait up to the next ARRIVE: a warpgroup's tensor work is done
and its FMAs and bookkeeping run), and the opcodes.

    CUTE_DSL_ARCH=sm_90a python benchmarks/sass_fp8_mainloop.py [--tiles 128,192,256] \\
        [--deepgemm DEEPGEMM_DIR --cutlass CUTLASS_DIR --deepgemm-config 4096,7168,32,192,4]

``--deepgemm-config`` N,K,groups,BLOCK_N,stages (BLOCK_M and BLOCK_K 128, a 2-CTA cluster multicasting
B): the default is what DeepGEMM 2.6.1's heuristic picks for dsv3-ep8's FC1 on 132 SMs.
"""

import argparse
import collections
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile

DEEPGEMM_KERNEL = """#include <deep_gemm/impls/sm90_fp8_gemm_1d2d.cuh>
using namespace deep_gemm;
static void instantiate() {{
    auto kernel = reinterpret_cast<void*>(&sm90_fp8_gemm_1d2d_impl<
        cute::UMMA::Major::K, 0, {n}, {k}, {groups}, 128, {block_n}, 128, 128, 128, 128, {stages}, 128, 256, 2, false,
        132, GemmType::MGroupedContiguous, cutlass::bfloat16_t, epilogue::transform::EpilogueIdentity>);
}}
"""
OPCODE = re.compile(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def nvdisasm() -> str:
    """The nvdisasm on PATH, else the one the nvidia-cuda-nvdisasm wheel installs."""
    found = shutil.which("nvdisasm")
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec and not found else ():
        found = next(iter(glob.glob(os.path.join(root, "cu1*", "bin", "nvdisasm"))), None) or found
    if found is None:
        sys.exit("sass_fp8_mainloop.py: nvdisasm not found (install the test extra: nvidia-cuda-nvdisasm)")
    return found


def innermost_gmma_loop(sass: str) -> list:
    """Opcodes of the smallest loop (a backward branch to a label) that holds a GMMA."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"\s*(\.L_x_\d+):", line))}
    loops = [lines[labels[label]:i + 1] for i, line in enumerate(lines) if "BRA" in line
             for label in re.findall(r"(\.L_x_\d+)", line) if labels.get(label, i) < i]
    body = min((loop for loop in loops if any("GMMA" in line for line in loop)), key=len)
    return [m.group(1) for line in body if (m := OPCODE.match(line))]


def phases(ops: list) -> list:
    """(issue, promotion, FFMAs in the promotion) instructions of each WGMMA batch in the loop."""
    start = ops.index("WARPGROUP.ARRIVE")
    batches, phase = [], "issue"
    for op in ops[start:] + ops[:start]:
        if op == "WARPGROUP.ARRIVE" and phase == "promotion":
            phase = "issue"
        if op == "WARPGROUP.ARRIVE" and phase == "issue" and (not batches or batches[-1][1]):
            batches.append([0, 0, 0])
        if op.startswith("WARPGROUP.DEPBAR"):
            phase = "promotion"
        batches[-1][0 if phase == "issue" else 1] += 1
        batches[-1][2] += phase == "promotion" and op.startswith("FFMA")
    return batches


def report(label: str, sass: str, blocks_per_iteration: int) -> str:
    ops = innermost_gmma_loop(sass)
    batches = phases(ops)
    per_block = [sum(b[i] for b in batches) / blocks_per_iteration for i in range(3)]
    top = ", ".join(f"{op} {n / blocks_per_iteration:g}" for op, n in collections.Counter(
        op.split(".")[0] for op in ops).most_common(12))
    return (f"| {label} | {len(ops) / blocks_per_iteration:g} | {per_block[0]:g} | {per_block[1]:g} | "
            f"{per_block[2]:g} | {top} |")


def ours(tile: int) -> str:
    """SASS of the library's FP8 forward (plain bf16 output, 2-CTA cluster) at ``tile``."""
    import torch

    from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm_fp8

    dump = os.environ["CUTE_DSL_DUMP_DIR"]
    compile_grouped_gemm_fp8(torch.bfloat16, None, False, cluster_m=2, tile_n=tile)
    cubin = max(glob.glob(os.path.join(dump, "**", "*.cubin"), recursive=True), key=os.path.getmtime)
    return subprocess.run([nvdisasm(), "-c", cubin], check=True, capture_output=True, text=True).stdout


def deepgemm(root: str, cutlass: str, config: str, work: str) -> str:
    n, k, groups, block_n, stages = (int(v) for v in config.split(","))
    source, cubin = os.path.join(work, "deepgemm.cu"), os.path.join(work, "deepgemm.cubin")
    with open(source, "w") as f:
        f.write(DEEPGEMM_KERNEL.format(n=n, k=k, groups=groups, block_n=block_n, stages=stages))
    # DeepGEMM's own JIT flags (csrc/jit/compiler.hpp)
    subprocess.run(["nvcc", "-std=c++20", "--diag-suppress=39,161,174,177,186,940",
                    "--ptxas-options=--register-usage-level=10", "-I", os.path.join(root, "deep_gemm", "include"),
                    "-I", os.path.join(cutlass, "include"), "--gpu-architecture=sm_90a",
                    "--compiler-options=-fPIC,-O3,-fconcepts,-Wno-deprecated-declarations,-Wno-abi", "-O3",
                    "--expt-relaxed-constexpr", "--expt-extended-lambda", "-cubin", "-o", cubin, source], check=True)
    return subprocess.run([nvdisasm(), "-c", cubin], check=True, capture_output=True, text=True).stdout


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiles", default="128,192,256", help="this library's FP8 tile widths")
    parser.add_argument("--deepgemm", default=None, help="a DeepGEMM source tree (deep_gemm/include inside)")
    parser.add_argument("--cutlass", default=None, help="the CUTLASS tree DeepGEMM pins (include/ inside)")
    parser.add_argument("--deepgemm-config", default="4096,7168,32,192,4", help="N,K,groups,BLOCK_N,stages")
    args = parser.parse_args()
    if os.environ.get("CUTE_DSL_ARCH") != "sm_90a":
        sys.exit("sass_fp8_mainloop.py: set CUTE_DSL_ARCH=sm_90a (the kernels are compiled for Hopper here)")
    rows = []
    with tempfile.TemporaryDirectory() as work:
        # compiled here, not loaded from a kernel cache, so the DSL leaves the cubins
        os.environ.update(CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=work, CUTE_DSL_DISABLE_FILE_CACHING="1",
                          TE_FUSED_OPS_KERNEL_CACHE="0")
        for tile in (int(t) for t in args.tiles.split(",")):
            rows.append(report(f"ours, tile 128x{tile}", ours(tile), 1))
        if args.deepgemm:
            sass = deepgemm(args.deepgemm, args.cutlass or os.path.join(args.deepgemm, "third-party", "cutlass"),
                            args.deepgemm_config, work)
            blocks = sum(op.startswith("WARPGROUP.ARRIVE") for op in innermost_gmma_loop(sass))
            block_n = args.deepgemm_config.split(",")[3]
            rows.append(report(f"DeepGEMM, tile 128x{block_n} (loop unrolled x{blocks})", sass, blocks))
    print("FP8 forward mainloop, sm_90a machine code: instructions per scale block and warp\n\n"
          "| kernel | all | issue phase | promotion phase | FFMAs | opcodes per block |\n|---|---|---|---|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
