# bootstrap.sh — source this first on the GPU machine to run quack (quack-kernels 0.6.5 on CuTe DSL 4.7.1):
#     source .quackcarry/bootstrap.sh && python3 benchmarks/bench_quack_step.py --out $OUT
# Installs the carried wheels into /tmp/quackenv/site-packages once per machine (beside /tmp/tfo, the
# CuTe DSL 4.8.1 env of .devcarry), drops /tmp/tfo from PYTHONPATH and puts this env and the project
# root on it. quack's kernel and autotune caches go to /tmp/quackenv/cache (kept while the machine is
# warm). To keep autotune results for a fresh machine, save them at the end of a run with
#     (cd /tmp/quackenv/cache && find . -name '*.autotune.json' | tar -czf $OUT/quack-autotune.tar.gz -T -)
# and put that file into .quackcarry/: this script then restores them.
# The image already has torch, triton, numpy, cuda-bindings and protobuf.
_q_site=/tmp/quackenv/site-packages
if [ ! -f "$_q_site/.ready" ]; then
  if [ ! -f .quackcarry/libs-cu13.tar.xz ]; then
    echo "bootstrap: .quackcarry/ is missing: build it with benchmarks/quack_env/prepare.sh and pass carry=[\".quackcarry\"]" >&2
    return 1 2>/dev/null || exit 1
  fi
  rm -rf "$_q_site" && mkdir -p "$_q_site"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --target "$_q_site" .quackcarry/*.whl || { return 1 2>/dev/null || exit 1; }
  tar -C "$_q_site" -xJf .quackcarry/libs-cu13.tar.xz || { return 1 2>/dev/null || exit 1; }
  touch "$_q_site/.ready"
fi
if [ -f .quackcarry/quack-autotune.tar.gz ] && [ ! -f /tmp/quackenv/cache/.restored ]; then
  mkdir -p /tmp/quackenv/cache && tar -C /tmp/quackenv/cache -xzf .quackcarry/quack-autotune.tar.gz \
    && touch /tmp/quackenv/cache/.restored && echo "bootstrap: restored quack autotune results"
fi
_q_pp=""
IFS=: read -ra _q_parts <<< "${PYTHONPATH:-}"
for _q_p in "${_q_parts[@]}"; do
  case "$_q_p" in /tmp/tfo/*|"") ;; *) _q_pp="${_q_pp:+$_q_pp:}$_q_p" ;; esac
done
export PYTHONPATH="$PWD:$_q_site:$_q_site/nvidia_cutlass_dsl/dsl_packages${_q_pp:+:$_q_pp}"
unset _q_pp _q_parts _q_p
export CUTE_DSL_CACHE_DIR=/tmp/quackenv/cute-cache QUACK_CACHE_DIR=/tmp/quackenv/cache PYTHONUNBUFFERED=1
export QUACK_COMPILE_WORKERS=${QUACK_COMPILE_WORKERS:-12}
python3 -c "import torch, cutlass, quack; print('gpu:', torch.cuda.get_device_name(), '| torch', torch.__version__, '| cutlass-dsl', cutlass.__version__, '| quack', quack.__version__)"
