#!/usr/bin/env bash
# Submit a training run on Slurm; optionally convert the HF checkpoint to a Megatron one first, the training job
# waiting for the conversion (--dependency=afterok; a failed conversion cancels the training job).
#
#   HF_MODEL=/shared/models/Qwen3-4B CONFIG=examples/my.yaml NODES=2 GPUS_PER_NODE=8 TP=2 \
#       slurm/submit.sh [key=value trainer overrides...]
#
# Run it from the directory the jobs should run in (usually the repository root): logs/ is created there.
# The recipes in slurm/recipes/ set these for the papers' settings. Settings (environment):
#   HF_MODEL          local Hugging Face model folder (required; compute nodes rarely reach the hub:
#                     `hf download Qwen/Qwen3-4B --local-dir /shared/models/Qwen3-4B` on a login node first)
#   CONFIG            trainer YAML (required)
#   NODES, GPUS_PER_NODE  the layout (default 1 x 8);  TP, PP  tensor / pipeline parallel sizes (default 1)
#   EP, ETP           expert / expert-tensor parallel sizes of a Mixture-of-Experts model (default 1; passed to
#                     the trainer as parallel.ep / parallel.etp when set)
#   MEGATRON_CKPT     convert HF_MODEL into this folder first, at TP/PP, unless it exists (default: no conversion;
#                     the trainer streams HF weights into its TP/PP shards itself)
#   MEGATRON_CKPT_KEY trainer key that receives MEGATRON_CKPT (default: none)
#   JOB_NAME          (default dppo-<basename of CONFIG>);  TRAIN_SCRIPT (default slurm/train.sbatch)
#   DPPO_CONVERT_CMD  the converter (default: python <this checkout>/tools/convert_hf_to_megatron.py)
#   DRY_RUN=1         print the sbatch commands instead of submitting
# Slurm's own variables pick the site: SBATCH_PARTITION, SBATCH_ACCOUNT, SBATCH_QOS, SBATCH_TIMELIMIT, ...
# Trainer overrides set here: model.path=HF_MODEL parallel.tp=TP parallel.pp=PP [parallel.ep=EP parallel.etp=ETP],
# then yours (they win).
set -euo pipefail
SLURM_DIR="$(cd "$(dirname "$0")" && pwd)"
REPO="$(dirname "$SLURM_DIR")"
# The conversion job runs in the submit directory; point it at this checkout's converter.
export DPPO_CONVERT_CMD="${DPPO_CONVERT_CMD:-python $REPO/tools/convert_hf_to_megatron.py}"

NODES="${NODES:-1}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
TP="${TP:-1}"
PP="${PP:-1}"
EP="${EP:-1}"
ETP="${ETP:-1}"
: "${CONFIG:?set CONFIG to the trainer YAML}"
: "${HF_MODEL:?set HF_MODEL to a local Hugging Face model folder (hf download <id> --local-dir <folder>)}"
JOB_NAME="${JOB_NAME:-dppo-$(basename "${CONFIG%.*}")}"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-$SLURM_DIR/train.sbatch}"

WORLD=$((NODES * GPUS_PER_NODE))
if ((WORLD % (TP * PP) != 0)); then
    echo "submit.sh: $NODES node(s) x $GPUS_PER_NODE GPUs = $WORLD is not a multiple of TP*PP = $((TP * PP))" >&2
    exit 2
fi
if ((WORLD % (ETP * EP * PP) != 0)); then
    echo "submit.sh: $WORLD GPUs is not a multiple of ETP*EP*PP = $((ETP * EP * PP)) (the expert layout must tile" \
        "every pipeline stage)" >&2
    exit 2
fi
if [[ "${DRY_RUN:-0}" != 1 && ! -f "$HF_MODEL/config.json" ]]; then
    echo "submit.sh: HF_MODEL=$HF_MODEL is not a local Hugging Face model folder (no config.json); download" \
        "it on a login node first: hf download <org/name> --local-dir <folder>" >&2
    exit 2
fi

run() {
    if [[ "${DRY_RUN:-0}" == 1 ]]; then
        printf '%q ' "$@" >&2
        printf '\n' >&2
        echo 0 # a fake job id
    else
        "$@"
    fi
}

[[ "${DRY_RUN:-0}" == 1 ]] || mkdir -p logs # Slurm does not create --output directories
DEPENDENCY=()
OVERRIDES=("model.path=$HF_MODEL" "parallel.tp=$TP" "parallel.pp=$PP")
if ((EP != 1 || ETP != 1)); then
    OVERRIDES+=("parallel.ep=$EP" "parallel.etp=$ETP")
fi
if [[ -n "${MEGATRON_CKPT:-}" ]]; then
    if [[ ! -e "$MEGATRON_CKPT" ]]; then
        conv_id="$(run sbatch --parsable --job-name="$JOB_NAME-convert" "$SLURM_DIR/convert.sbatch" \
            "$HF_MODEL" "$MEGATRON_CKPT" --tp "$TP" --pp "$PP")"
        DEPENDENCY=(--dependency="afterok:${conv_id%%;*}" --kill-on-invalid-dep=yes)
        echo "conversion job ${conv_id%%;*}: $HF_MODEL -> $MEGATRON_CKPT (TP=$TP PP=$PP)" >&2
    fi
    [[ -z "${MEGATRON_CKPT_KEY:-}" ]] || OVERRIDES+=("$MEGATRON_CKPT_KEY=$MEGATRON_CKPT")
fi
train_id="$(run sbatch --parsable "${DEPENDENCY[@]}" --job-name="$JOB_NAME" --nodes="$NODES" \
    --gpus-per-node="$GPUS_PER_NODE" "$TRAIN_SCRIPT" --config "$CONFIG" "${OVERRIDES[@]}" "$@")"
echo "training job ${train_id%%;*}: $NODES x $GPUS_PER_NODE GPUs, TP=$TP PP=$PP EP=$EP ETP=$ETP" \
    "(DP=$((WORLD / TP / PP))), logs in logs/" >&2
echo "${train_id%%;*}"
