#!/usr/bin/env bash
# prepare.sh — (re)build .quackcarry/ (git-ignored) in the project checkout: CuTe DSL 4.7.1 (CUDA 13
# build, compiler library repacked to xz as ../shared/device/prepare-carry.sh does), apache-tvm-ffi,
# torch-c-dlpack-ext, quack-kernels 0.6.5 and what it needs beyond the GPU image (einops,
# cloudpickle), plus bootstrap.sh. From the project root:  bash benchmarks/quack_env/prepare.sh
# Caches under ~/.cache/te-fused-ops-device/{4.7.1,quack-0.6.5}; the first repack takes ~5 minutes.
set -euo pipefail
[ -d .git ] || { echo "run this from the project root (the folder holding .git)" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
root=${XDG_CACHE_HOME:-$HOME/.cache}/te-fused-ops-device
dsl=$root/4.7.1 extra=$root/quack-0.6.5
mkdir -p "$dsl/wheels" "$extra/wheels"
plat=(--only-binary=:all: --python-version 3.12 --implementation cp
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
fetch() {  # fetch DIR NAME==VERSION unless a matching wheel is there
  local dir=$1 spec=$2 stem
  stem=$(echo "${spec%%==*}" | tr '-' '_')
  if ! ls "$dir/${stem}"-* >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$dir" "$spec" 2>&1 | grep -v WARNING || true
  fi
  ls "$dir/${stem}"-* >/dev/null 2>&1 || { echo "could not download $spec" >&2; exit 1; }
}
for spec in nvidia-cutlass-dsl==4.7.1 nvidia-cutlass-dsl-libs-base==4.7.1 nvidia-cutlass-dsl-libs-core==4.7.1 \
            nvidia-cutlass-dsl-libs-cu13==4.7.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5; do
  fetch "$dsl/wheels" "$spec"
done
for spec in quack-kernels==0.6.5 einops==0.8.2 cloudpickle==3.1.3; do fetch "$extra/wheels" "$spec"; done
packed=$dsl/libs-cu13.tar.xz
if [ ! -s "$packed" ]; then
  echo "repacking the CUDA 13 compiler libraries (one time, about 5 minutes)..."
  tmp=$(mktemp -d)
  (cd "$tmp" && unzip -q "$dsl"/wheels/nvidia_cutlass_dsl_libs_cu13-*.whl)
  tar -C "$tmp" -cf - . | xz --lzma2=preset=9e,dict=256MiB -T1 > "$packed.part"
  mv "$packed.part" "$packed"
  rm -rf "$tmp"
fi
rm -rf .quackcarry && mkdir -p .quackcarry
for w in "$dsl"/wheels/*.whl "$extra"/wheels/*.whl; do
  case "$w" in *libs_cu13*) continue ;; esac
  ln "$w" .quackcarry/ 2>/dev/null || cp "$w" .quackcarry/
done
ln "$packed" .quackcarry/ 2>/dev/null || cp "$packed" .quackcarry/
cp "$here/bootstrap.sh" .quackcarry/
grep -qx '/.quackcarry/' .git/info/exclude 2>/dev/null || echo '/.quackcarry/' >> .git/info/exclude
echo ".quackcarry is $(du -sm .quackcarry | cut -f1) MiB (with the working tree at most 64 MiB)."
echo 'device run: carry [".quackcarry"], command: source .quackcarry/bootstrap.sh && python3 benchmarks/bench_quack_step.py ...'
