#!/usr/bin/env bash
# Qwen3-4B on MATH (examples/qwen3-4b-math.yaml: the DPPO paper's model and task, our hyper-parameters): 1 node x 8
# GPUs, TP=2 PP=1 (DP=4), the layout the YAML describes; NODES=2 doubles DP to 8.
#   hf download Qwen/Qwen3-4B --local-dir /shared/models/Qwen3-4B   # once, on a login node
#   HF_MODEL=/shared/models/Qwen3-4B slurm/recipes/qwen3-4b-math.sh [key=value overrides...]
# Any setting of slurm/submit.sh may be overridden from the environment (NODES, TP, MEGATRON_CKPT, ...).
set -euo pipefail
export NODES="${NODES:-1}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}" TP="${TP:-2}" PP="${PP:-1}"
export CONFIG="${CONFIG:-examples/qwen3-4b-math.yaml}"
exec "$(dirname "$0")/../submit.sh" "$@"
