#!/usr/bin/env bash
# Qwen2.5-1.5B-Instruct on GSM8K (paper setting): 1 node x 8 GPUs, TP=1 PP=1 (DP=8).
#   hf download Qwen/Qwen2.5-1.5B-Instruct --local-dir /shared/models/Qwen2.5-1.5B-Instruct   # once, login node
#   HF_MODEL=/shared/models/Qwen2.5-1.5B-Instruct slurm/recipes/qwen2.5-1.5b-gsm8k.sh [key=value overrides...]
# Any setting of slurm/submit.sh may be overridden from the environment (NODES, TP, MEGATRON_CKPT, ...).
set -euo pipefail
export NODES="${NODES:-1}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}" TP="${TP:-1}" PP="${PP:-1}"
export CONFIG="${CONFIG:-examples/qwen2.5-1.5b-gsm8k.yaml}"
exec "$(dirname "$0")/../submit.sh" "$@"
