#!/usr/bin/env bash
# One short, prepared GPU check of the Megatron engine on a single GPU (written for one H200; a few minutes).
# Prints: TE THD fused attention vs our SDPA twin (max |diff| of logits / log-probs on one packed batch), then a
# GRPO train step of a ~1.1B Llama-like model (random init, no downloads) with tokens/s and MFU.
# CI never runs it. Usage: bash scripts/gpu_check.sh [--quick] [--json figures.json]
# Python: $PYTHON, else .venv/bin/python when it can import torch with CUDA, else python3.
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
    if [[ -n "${PYTHON:-}" ]]; then echo "$PYTHON"; return; fi
    for candidate in .venv/bin/python python3 python; do
        if command -v "$candidate" >/dev/null 2>&1 &&
           "$candidate" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
            echo "$candidate"; return
        fi
    done
    echo python3
}

PY="$(pick_python)"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec timeout "${GPU_CHECK_TIMEOUT:-900}" "$PY" scripts/gpu_check.py "$@"
