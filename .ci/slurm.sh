#!/usr/bin/env bash
# CI stage: a real two-node Slurm cluster on this host, the slurm tests against it, teardown (always).
#   .ci/slurm.sh [extra pytest args]
# Needs root (apt-get, mknod, munged); makes the project venv (.venv) when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-.venv/bin/python}"
[[ -x "$PYTHON" ]] || make venv
start=$SECONDS
trap '.ci/slurm_cluster.sh stop; echo "[slurm.sh] total $((SECONDS - start)) s"' EXIT
.ci/slurm_cluster.sh start
echo "[slurm.sh] cluster up after $((SECONDS - start)) s"
# shellcheck disable=SC1091
source "${DPPO_SLURM_ROOT:-/tmp/dppo-slurm}/env.sh"
# The cluster tests plus the cluster-free shell checks (shellcheck, recipe dry runs). `.ci/slurm.sh -m slurm`
# runs every cluster test, adding the real HF -> Megatron conversion job and the stand-in (launch_check) requeue
# tests, incl. the SIGTERM fallback (~1.5 min more).
"$PYTHON" -m pytest -q -m "not slow" tests/slurm tests/unit/test_launch.py "$@"
