#!/usr/bin/env bash
# A larger layout: Qwen2.5-32B-Instruct on MATH, 4 nodes x 8 GPUs, TP=8 (within a node, over NVLink) -> DP=4, with
# the DistributedOptimizer sharding Adam state over the 4 replicas. Keep TP inside a node, then grow DP across
# nodes. (PP > 1 works for training, but the colocated vLLM rollout engine is per TP group and the trainer refuses
# rollout.engine=vllm with parallel.pp > 1.) To convert the HF weights to a Megatron checkpoint first (a job the
# training job waits for), set MEGATRON_CKPT=<folder>.
#   hf download Qwen/Qwen2.5-32B-Instruct --local-dir /shared/models/Qwen2.5-32B-Instruct   # once, login node
#   HF_MODEL=/shared/models/Qwen2.5-32B-Instruct slurm/recipes/qwen2.5-32b-math-tp8.sh [key=value ...]
# Any setting of slurm/submit.sh may be overridden from the environment.
set -euo pipefail
export NODES="${NODES:-4}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}" TP="${TP:-8}" PP="${PP:-1}"
export CONFIG="${CONFIG:-examples/qwen2.5-32b-math.yaml}"
exec "$(dirname "$0")/../submit.sh" "$@"
