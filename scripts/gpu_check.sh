#!/usr/bin/env bash
# Staged device check of the GPU path (scripts/gpu_check.py): installs the carried wheels, then runs every stage
# guarded, writing $OUT/gpu_check.json after each. <= 6 minutes on one H200. $OUT receives only the report and
# short logs; run folders and checkpoints go to a temporary folder that is removed at the end.
#
# Device call (the `run` tool of a session lent an H200), after `bash scripts/device_wheels.sh` here:
#     command:   bash scripts/gpu_check.sh
#     carry:     [".whl"]
#     timeout_s: 420
# Locally: bash scripts/gpu_check.sh --cpu-smoke   (the same stages, small, fp32, on the CPU; part of pytest)
#
# Python: $PYTHON, else .venv/bin/python when it runs, else python3.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]] && .venv/bin/python -c "import torch" >/dev/null 2>&1; then PY=.venv/bin/python; else PY=python3; fi
fi
command -v nvidia-smi >/dev/null 2>&1 &&
    nvidia-smi --query-gpu=name,memory.total,driver_version,compute_mode --format=csv,noheader 2>/dev/null || true

# Wheels the device lacks (megatron-core, math-verify, ...) travel in .whl/ (scripts/device_wheels.sh).
SITE="${GPU_CHECK_SITE:-/tmp/dppo-site}"
if compgen -G ".whl/*.whl" >/dev/null && ! "$PY" -c "import megatron.core" >/dev/null 2>&1; then
    echo "gpu_check.sh: installing $(ls .whl/*.whl | wc -l) carried wheels into $SITE"
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl ||
        echo "gpu_check.sh: wheel install failed; stages needing megatron-core will fail" >&2
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# deterministic cuBLAS for the checkpoint stage's resumed step (read once, when CUDA starts)
export CUBLAS_WORKSPACE_CONFIG="${CUBLAS_WORKSPACE_CONFIG:-:4096:8}"
export PYTHONWARNINGS="${PYTHONWARNINGS:-ignore}"
exec timeout "${GPU_CHECK_TIMEOUT:-400}" "$PY" scripts/gpu_check.py "$@"
