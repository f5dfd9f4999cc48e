# bootstrap.sh — source this on the GPU machine after .devcarry/bootstrap.sh to import deep_gemm:
#     source .devcarry/bootstrap.sh && source .dgcarry/bootstrap.sh && python3 benchmarks/bench_fp8_deepgemm.py --out $OUT
# Unpacks .dgcarry/deepgemm.tar.xz into /tmp/dgenv and builds DeepGEMM's extension there with the
# machine's nvcc and torch (about two minutes, once per machine), then puts it on PYTHONPATH. Its
# kernels compile at their first call (NVCC, cached in /tmp/dgenv/jit-cache while the machine is warm).
_dg_root=/tmp/dgenv/DeepGEMM
if [ ! -f /tmp/dgenv/.ready ]; then
  if [ ! -f .dgcarry/deepgemm.tar.xz ]; then
    echo "bootstrap: .dgcarry/ is missing: build it with benchmarks/deepgemm_env/prepare.sh and pass carry=[\".dgcarry\"]" >&2
    return 1 2>/dev/null || exit 1
  fi
  rm -rf /tmp/dgenv && mkdir -p /tmp/dgenv && tar -C /tmp/dgenv -xJf .dgcarry/deepgemm.tar.xz \
    || { return 1 2>/dev/null || exit 1; }
  ln -sfn "$_dg_root/third-party/cutlass/include/cutlass" "$_dg_root/deep_gemm/include/cutlass"
  ln -sfn "$_dg_root/third-party/cutlass/include/cute" "$_dg_root/deep_gemm/include/cute"
  (cd "$_dg_root" && MAX_JOBS=16 python3 - <<'PY'
import os

import torch
from setuptools import setup
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension

flags = ["-std=c++17", "-O3", "-fPIC", "-Wno-psabi", "-Wno-deprecated-declarations",
         f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}"]
# absolute (the compiler runs in a build folder), the pinned CUTLASS ahead of the toolkit's folders
includes = [os.path.abspath(d) for d in ("deep_gemm/include", "third-party/cutlass/include", "third-party/fmt/include")]
includes += [f"{CUDA_HOME}/include", f"{CUDA_HOME}/include/cccl"]
setup(name="deep_gemm", script_args=["build_ext", "--inplace"], cmdclass={"build_ext": BuildExtension},
      ext_modules=[CUDAExtension("deep_gemm._C", ["csrc/python_api.cpp"], include_dirs=includes,
                                 libraries=["cudart", "nvrtc"], library_dirs=[f"{CUDA_HOME}/lib64"],
                                 extra_compile_args=flags)])
PY
  ) > /tmp/dgenv/build.log 2>&1 || { grep -m8 -A3 "error" /tmp/dgenv/build.log | cut -c1-400; return 1 2>/dev/null || exit 1; }
  touch /tmp/dgenv/.ready
fi
# the compiler's libstdc++ first: with the older one the Python environment loads, the extension's
# std::regex crashed (a segfault in its include parser at the first JIT call)
export LD_PRELOAD="$(g++ -print-file-name=libstdc++.so.6)${LD_PRELOAD:+:$LD_PRELOAD}"
export PYTHONPATH="$_dg_root${PYTHONPATH:+:$PYTHONPATH}" DG_JIT_CACHE_DIR=/tmp/dgenv/jit-cache
unset _dg_root
python3 -c "import deep_gemm; print('deep_gemm', deep_gemm.__version__)"
