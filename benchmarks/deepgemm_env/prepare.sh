#!/usr/bin/env bash
# prepare.sh — (re)build .dgcarry/ (git-ignored) in the project checkout: DeepGEMM's source at a pinned
# commit with the CUTLASS and fmt headers its submodules pin, as one xz archive (~1.3 MB), plus
# bootstrap.sh. The GPU machine cannot download, so the sources come from local git checkouts:
#     bash benchmarks/deepgemm_env/prepare.sh DEEPGEMM_GIT CUTLASS_GIT FMT_GIT
# each a clone (or bare repository) that holds the commit below.
set -euo pipefail
[ -d .git ] || { echo "run this from the project root (the folder holding .git)" >&2; exit 2; }
[ $# -eq 3 ] || { echo "usage: $0 DEEPGEMM_GIT CUTLASS_GIT FMT_GIT" >&2; exit 2; }
deepgemm=54e2261  # DeepGEMM 2.6.1; its third-party/ submodules pin the two below
cutlass=f3fde58372d33e9a5650ba7b80fc48b3b49d40c8
fmt=553ec11ec06fbe0beebfbb45f9dc3c9eabd83d28
here=$(cd "$(dirname "$0")" && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
git -C "$1" archive --prefix=DeepGEMM/ "$deepgemm" | tar -x -C "$tmp"
rm -rf "$tmp/DeepGEMM/third-party/tilelang_ops"
mkdir -p "$tmp/DeepGEMM/third-party/cutlass/include" "$tmp/DeepGEMM/third-party/fmt/include"
git -C "$2" archive "$cutlass:include" | tar -x -C "$tmp/DeepGEMM/third-party/cutlass/include"
git -C "$3" archive "$fmt:include" | tar -x -C "$tmp/DeepGEMM/third-party/fmt/include"
rm -rf .dgcarry && mkdir -p .dgcarry
tar -C "$tmp" -cf - DeepGEMM | xz -9 -T1 > .dgcarry/deepgemm.tar.xz
cp "$here/bootstrap.sh" .dgcarry/bootstrap.sh
du -sh .dgcarry
