#!/usr/bin/env bash
# Mixture-of-Experts: Qwen3-30B-A3B on MATH, 2 nodes x 8 GPUs (NODES=4 for 4), TP=2 with sequence parallelism,
# EP=8 (the experts of each layer over the 8 GPUs of a node, so the token all-to-all stays on NVLink), ETP=1,
# DP = 16 / 2 = 8 and expert data parallel 16 / 8 = 2. The memory arithmetic is in examples/qwen3-30b-a3b-math.yaml.
#   hf download Qwen/Qwen3-30B-A3B --local-dir /shared/models/Qwen3-30B-A3B   # once, login node
#   HF_MODEL=/shared/models/Qwen3-30B-A3B slurm/recipes/qwen3-30b-a3b-math.sh [key=value ...]
# Any setting of slurm/submit.sh may be overridden from the environment (NODES, TP, EP, ETP, MEGATRON_CKPT, ...).
set -euo pipefail
export NODES="${NODES:-2}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}" TP="${TP:-2}" PP="${PP:-1}" EP="${EP:-8}" ETP="${ETP:-1}"
export CONFIG="${CONFIG:-examples/qwen3-30b-a3b-math.yaml}"
exec "$(dirname "$0")/../submit.sh" "$@"
