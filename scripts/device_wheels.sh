#!/usr/bin/env bash
# Download the wheels the lent GPU machine lacks into .whl/ (git-ignored) and print their total size.
# The device (one H200: Python 3.12, torch 2.11.0+cu130, transformers 5.17, no network) has torch, transformers,
# safetensors, sentencepiece, numpy, pyyaml, psutil, tqdm, matplotlib, tensorboard and sympy; it lacks
# megatron-core and the math grader (math-verify -> latex2sympy2_extended -> antlr4-python3-runtime).
# Transformer Engine (~190 MB + a compiled torch binding) and vLLM (~250 MB + ~60 deps) cannot travel within the
# 64 MiB carry limit: the device check runs without them (attention backend varlen, HF rollout engine).
#
#   bash scripts/device_wheels.sh            # here, once (needs PyPI); then run scripts/gpu_check.sh on the device
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${DEST:-.whl}"
WHEELS=(
    megatron-core==0.16.1          # cp312 manylinux wheel (~2.6 MB); requires torch, numpy, packaging (present)
    math-verify==0.9.0
    latex2sympy2_extended==1.11.0
    antlr4-python3-runtime==4.13.2  # latex2sympy2_extended needs >=4.9.3,<=4.13.2
)
mkdir -p "$DEST"
PYTHON="${PYTHON:-python3}"
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$DEST" "${WHEELS[@]}"
ls -l "$DEST"/*.whl
bytes=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
limit=$((64 * 1024 * 1024))
echo "device wheels: $(ls "$DEST"/*.whl | wc -l) files, $bytes bytes ($((bytes / 1024)) KiB) in $DEST (carry limit 64 MiB)"
if (( bytes > limit / 2 )); then
    echo "device wheels take more than half of the 64 MiB carry limit" >&2
    exit 1
fi
