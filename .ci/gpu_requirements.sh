#!/usr/bin/env bash
# CI: requirements/gpu.txt with requirements/gpu-te.txt (Transformer Engine's wheels; its torch binding is a source
# distribution that scripts/install_gpu.sh compiles) must resolve as one consistent set for CPython 3.12 on
# manylinux x86_64. Metadata only:
# `pip install --dry-run` with lazily fetched wheel metadata (HTTP range requests), nothing is installed or
# downloaded in full. Fails (exit 1) when pip cannot resolve the set. About 2-3 minutes.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="${PIP:-.venv/bin/python -m pip}"
if [[ $# -gt 0 ]]; then REQS=("$@"); else REQS=(requirements/gpu.txt requirements/gpu-te.txt); fi
reqs=()
for req in "${REQS[@]}"; do reqs+=(-r "$req"); done
platforms=()
# every glibc tag from 2.35 down to 2.17 (NCCL wheels are manylinux_2_18, torch manylinux_2_28)
for v in $(seq 35 -1 17); do platforms+=(--platform "manylinux_2_${v}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform linux_x86_64)
target="$(mktemp -d)"
trap 'rm -rf "$target"' EXIT
start=$SECONDS
log="$target/pip.log"
status=0
# shellcheck disable=SC2086
PIP_CONSTRAINT="" $PIP install --quiet --dry-run --ignore-installed --only-binary=:all: --use-feature=fast-deps \
    --python-version 3.12 --implementation cp "${platforms[@]}" --target "$target/site" \
    "${reqs[@]}" >"$log" 2>&1 || status=$?
if [[ $status -ne 0 ]]; then
    grep -v "^WARNING: Location\|fast-deps\|lazily downloaded" "$log" >&2 || true
    echo "[ci] ${REQS[*]} do not resolve as a consistent set (pip exit $status)" >&2
    exit 1
fi
echo "[ci] ${REQS[*]} resolve for cp312 manylinux x86_64 ($((SECONDS - start)) s)"
