#!/usr/bin/env bash
# Issue #33: our NVFP4 decode / chunked prefill vs upstream's (vLLM 0.33 -> FlashInfer 0.7.2.post1)
# on the lent H100/H200, one stage per call (each <= 10 min). Carry .fikit/a (made by
# `bash evals/fi_kit.sh`: FlashInfer with its modules prebuilt for sm_90a); where those cannot
# load, carry .fikit/jit too and FlashInfer compiles them with the host's nvcc (minutes each).
# vLLM's FA3 FP8/BF16 columns appear where vLLM 0.26 imports from /tmp/site (the bundle parts
# that evals/gpu_session.sh installs on the same warm machine); without it our prefill attends
# with FlashInfer's FA3 (the results' ours_attn says which).
#   bash evals/gpu_fi.sh check|jit|decode|decode256|prefill|all
# Writes $OUT/upstream_nvfp4_<stage>_<gpu>.json and .png (OUT default evals/results).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-evals/results}
mkdir -p "$OUT"
for part in .fikit/a .fikit/jit; do
  [ -f $part/install ] && { bash $part/install /tmp/fikit || exit 1; }
done
rm -rf /tmp/ours
pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/ours . ./evals 2>&1 | grep -v WARNING
SITE=""
[ -d /tmp/site/vllm ] && SITE=:/tmp/site
export PYTHONPATH=/tmp/fikit:/tmp/ours$SITE PYTHONUNBUFFERED=1 FLASHINFER_WORKSPACE_BASE=/tmp/fiws
# JIT only: FA3's CUTLASS headers include curand_kernel.h (.fikit/jit brings it where CUDA lacks it)
[ -f /usr/local/cuda/include/curand_kernel.h ] || export CPATH=/tmp/fikit/curand${CPATH:+:$CPATH}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | grep -oiE 'H100|H200' | head -1 \
      | tr A-Z a-z)
GPU=${GPU:-gpu}
bench() {  # bench NAME ARGS...: one run, its table last
  local name=$1; shift
  timeout 540 python3 -P -m evals.bench_upstream_nvfp4 --out "$OUT/upstream_nvfp4_${name}_${GPU}.json" \
    "$@" 2>&1 | grep -vE "Warning|warn\(" | tail -70
}
case "${1:?stage: check|jit|decode|decode256|prefill|all}" in
  # imports, which modules load prebuilt, and every check at one small shape (~1 min)
  check)     python3 -P -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__, \
flashinfer.__file__); from evals.bench_upstream_nvfp4 import fi_module_status as s; \
print(s((128, 256)))"
             bench check --batch 1 4 --ctx 8192 --prefix 8192 --budget-s 120 ;;
  # only where the prebuilt modules do not load (check says "jit"): compile the D=128 ones
  # into /tmp/fiws, kept while the machine stays warm (carry .fikit/jit; ~1-2 min a module)
  jit)       MAX_JOBS=${MAX_JOBS:-18} timeout 540 python3 -P -c "import time
from evals.bench_upstream_nvfp4 import fi_module_specs
for s in fi_module_specs((128,)):
    t = time.time(); s.build_and_load(); print(f'{time.time() - t:6.0f} s  {s.name}', flush=True)" ;;
  decode)    bench decode128 --dims 128 --no-prefill ;;                # ~4 min
  decode256) bench decode256 --dims 256 --no-prefill ;;                # ~4 min
  prefill)   bench prefill --no-decode --prefix 8192 32768 ;;          # ~1 min
  all)       bench all --dims 128 --budget-s 300 ;;                    # decode D=128 + prefill
  *) echo "unknown stage $1"; exit 2 ;;
esac
