#!/usr/bin/env bash
# A larger layout: Qwen2.5-32B-Instruct on MATH, 4 nodes x 8 GPUs, TP=8 (within a node, over NVLink) x PP=2
# (across nodes) -> DP=2. Keep TP inside a node; grow PP, then DP, across nodes. To convert the HF weights to a
# Megatron checkpoint at TP=8 PP=2 first (a CPU job the training job waits for), set MEGATRON_CKPT=<folder>.
#   hf download Qwen/Qwen2.5-32B-Instruct --local-dir /shared/models/Qwen2.5-32B-Instruct   # once, login node
#   HF_MODEL=/shared/models/Qwen2.5-32B-Instruct slurm/recipes/qwen2.5-32b-math-tp8pp2.sh [key=value ...]
# Any setting of slurm/submit.sh may be overridden from the environment.
set -euo pipefail
export NODES="${NODES:-4}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}" TP="${TP:-8}" PP="${PP:-2}"
export CONFIG="${CONFIG:-examples/qwen2.5-32b-math.yaml}"
exec "$(dirname "$0")/../submit.sh" "$@"
