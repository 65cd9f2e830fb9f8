#!/usr/bin/env bash
# One stage per call of the lent H200 (each call <= 10 min), after the bundle parts are
# unpacked into /tmp/site (p1, p2, p3 in three calls: `bash .gpu/pK/install-bundle`).
#   bash evals/gpu_session.sh tests|decode|tune|e2e|serve|fidelity|profile
# Writes under $OUT (or evals/results when OUT is unset).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-evals/results}
rm -rf /tmp/ours
pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/ours . 2>&1 | grep -v WARNING
export PYTHONPATH=/tmp/ours:/tmp/site PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
case "${1:?stage}" in
  tests)    timeout 560 python3 -m pytest -q -x tests/test_kernels.py tests/test_backend.py \
                tests/test_format.py 2>&1 | tail -15 ;;
  decode)   timeout 560 python3 evals/bench_decode.py --budget-s 420 \
                --out "$OUT/decode_h200.json" 2>&1 | grep -v Warning | tail -40 ;;
  tune)     timeout 560 python3 evals/bench_decode.py --tune --out "$OUT/decode_tune_h200.json" \
                2>&1 | grep best ;;
  e2e)      timeout 560 python3 evals/bench_e2e.py --inputs 8192 32768 \
                --out "$OUT/e2e_h200.json" 2>&1 | grep -E "CUSTOM|NVFP4 KV cache|tok/s|error" ;;
  serve)    timeout 560 python3 evals/serve_smoke.py --requests 64 --concurrency 16 \
                --out "$OUT/serve_smoke_h200.json" 2>&1 | tail -30 ;;
  fidelity) timeout 560 python3 evals/fidelity.py --texts 96 --chunk 64 --dtypes auto fp8 nvfp4 \
                --out "$OUT/fidelity_smollm2_h200.json" 2>&1 | grep "^|" ;;
  profile)  timeout 560 ncu --kernel-name regex:_decode_kernel --launch-skip 3 --launch-count 1 \
                --section SpeedOfLight --section Occupancy --section WarpStateStats \
                --section InstructionStats python3 evals/profile_decode.py --skip-fa3 2>&1 \
                | grep -vE "^==PROF==|^\s*$" | tail -60 ;;
esac
