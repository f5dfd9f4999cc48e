"""The sm90 GEMM kernels keep their WGMMAs batched in the machine code (CPU, CUTE_DSL_ARCH=sm_90a).

ptxas serializes every WGMMA of a kernel (each one its own commit group, waited on before the
next is issued) when it cannot prove the code around them warpgroup-uniform: a thread-dependent
loop before the warp specialization or a branch in an epilogue was enough (ptxas info C7520),
and the weight gradient ran 3-13% slower for it on an H100. Each configuration below is compiled
in a subprocess that keeps its cubin; the disassembly must show WGMMAs issued without their own
commit group (HGMMA / QGMMA without gsb0).
"""

import glob
import importlib.util
import os
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
    "FP8 wgrad dW pair": "from te_fused_ops.backends.sm90.kernels.grouped_wgrad import compile_grouped_wgrad as c;"
                         "c(bf16, 128, False, 2, False, True)",
    "FP8 forward + SwiGLU": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import compile_grouped_gemm_fp8 as c;"
                            "c(bf16, 'swiglu', False, False, 2, 128)",
    "FP8 dgrad + dSwiGLU, d_pre cast": "from te_fused_ops.backends.sm90.kernels.grouped_gemm import"
                                       " compile_grouped_dgrad_dact_quant_fp8 as c; c(bf16, 'swiglu', False, 2, False)",
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


@pytest.mark.parametrize("name", list(COMPILE))
def test_wgmmas_are_batched(name, tmp_path):
    nvdisasm = _nvdisasm()
    assert nvdisasm, "nvdisasm not found: install the test extra (nvidia-cuda-nvdisasm)"
    env = dict(os.environ, CUTE_DSL_ARCH="sm_90a", CUTE_DSL_KEEP="cubin", CUTE_DSL_DUMP_DIR=str(tmp_path),
               CUTE_DSL_DISABLE_FILE_CACHING="1")
    code = f"import torch; bf16 = torch.bfloat16; {COMPILE[name]}"
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, timeout=600)
    cubins = glob.glob(str(tmp_path / "*.cubin"))
    assert cubins, f"{name}: no cubin kept"
    sass = "".join(subprocess.run([nvdisasm, "-c", f], check=True, capture_output=True, text=True).stdout
                   for f in cubins)
    wgmmas = [line for line in sass.splitlines() if "GMMA." in line]
    assert wgmmas, f"{name}: no WGMMA in the machine code"
    assert any("gsb0" not in line for line in wgmmas), (
        f"{name}: every one of its {len(wgmmas)} WGMMAs is its own commit group (serialized by ptxas)")
