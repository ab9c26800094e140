#!/usr/bin/env bash
# Install the GPU stack into the current Python environment, Transformer Engine all or nothing.
#
#   python3.12 -m venv .venv && . .venv/bin/activate
#   bash scripts/install_gpu.sh               # requirements/gpu.txt, Transformer Engine (~20 min compile), this package
#   bash scripts/install_gpu.sh --te-only     # only Transformer Engine, into an environment with the GPU set
#   bash scripts/install_gpu.sh --no-te       # without Transformer Engine (model.attention_backend=auto: varlen)
#   --require-te                              # exit 1 when Transformer Engine could not be installed
#
# Python: $PYTHON, else `python` on PATH (the active environment). The TE build's output: $INSTALL_GPU_LOG
# (default ${TMPDIR:-/tmp}/megatron-dppo-install-te.log).
#
# Why a script. Transformer Engine (TE) comes in three PyPI pieces of one version (requirements/gpu-te.txt pins it):
# transformer-engine (the Python package; extra core_cu13 pulls the core library transformer-engine-cu13, built
# for CUDA 13 like torch 2.13's wheels) and transformer-engine-torch (the torch binding, a source distribution).
# Half of them is worse than none: the core library alone fails at import ("Could not find `transformer-engine`"),
# and Megatron-Core, which catches only ImportError around its TE imports, then cannot be imported at all. So:
# - the binding compiles against the installed torch: --no-build-isolation (otherwise pip builds it in an
#   isolated environment with another torch). That needs setuptools, wheel (TE's setup.py imports
#   wheel.bdist_wheel) and packaging in the environment; ninja makes the compile parallel.
# - the compile needs nvcc and the CUDA headers: a CUDA toolkit ($CUDA_HOME, or nvcc on PATH), else pip's
#   nvcc (cuda-toolkit[nvcc] at the version torch was built with). cuDNN and NCCL headers come from torch's own
#   pip packages (nvidia-cudnn-cu13, nvidia-nccl-cu13), put on CPLUS_INCLUDE_PATH.
# - NVTE_PYTORCH_FORCE_BUILD=TRUE: TE's setup.py otherwise first downloads a prebuilt binding from GitHub with
#   urllib and no timeout (it hangs where there is no internet; none exists for torch 2.13 anyway).
# - the result is verified (import transformer_engine.pytorch, transformer_engine_torch, megatron.core). On any
#   failure every TE piece is uninstalled again and `import megatron.core` is checked without TE: the environment
#   then trains with model.attention_backend=auto (torch's varlen kernels).
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-python}"
MODE=all
REQUIRE_TE=0
for arg in "$@"; do
    case "$arg" in
        --te-only) MODE=te-only ;;
        --no-te) MODE=no-te ;;
        --require-te) REQUIRE_TE=1 ;;
        -h|--help) sed -n '2,30p' "$0"; exit 0 ;;
        *) echo "install_gpu.sh: unknown argument '$arg' (--te-only, --no-te, --require-te)" >&2; exit 2 ;;
    esac
done
LOG="${INSTALL_GPU_LOG:-${TMPDIR:-/tmp}/megatron-dppo-install-te.log}"
TE_PIECES=(transformer-engine transformer-engine-torch transformer-engine-cu13 transformer-engine-cu12)

say() { echo "[install_gpu] $*"; }
pip_() { "$PY" -m pip "$@"; }

if ! "$PY" -c "import sys; sys.exit(sys.prefix == sys.base_prefix)"; then
    say "warning: $PY is not in a virtual environment; installing into $("$PY" -c 'import sys; print(sys.prefix)')"
fi

# ---------------------------------------------------------------------------------------------- the GPU set
if [[ $MODE != te-only ]]; then
    say "requirements/gpu.txt"
    pip_ install -r requirements/gpu.txt || { say "pip could not install requirements/gpu.txt" >&2; exit 1; }
fi

# ---------------------------------------------------------------------------------------------- Transformer Engine
te_spec() {  # transformer-engine[core_cuNN]==X.Y.Z, the pin of requirements/gpu-te.txt
    sed -n 's/^\(transformer-engine\[core_cu[0-9]*\]==[0-9][0-9.]*\).*/\1/p' requirements/gpu-te.txt | head -1
}

site_nvidia_dirs() {  # folders under the environment's nvidia/ pip packages that hold header $1 (or binary $1)
    "$PY" - "$1" <<'EOF'
import pathlib, sys, sysconfig
roots = {pathlib.Path(sysconfig.get_paths()[k]) / "nvidia" for k in ("purelib", "platlib")}
found = sorted({str(p.parent) for root in roots if root.is_dir() for p in root.rglob(sys.argv[1])})
print("\n".join(found))
EOF
}

find_nvcc() {  # sets CUDA_HOME to a toolkit with bin/nvcc; installs pip's nvcc when there is none
    if [[ -n "${CUDA_HOME:-}" && -x "$CUDA_HOME/bin/nvcc" ]]; then return 0; fi
    local nvcc
    nvcc="$(command -v nvcc || true)"
    if [[ -z $nvcc ]]; then
        nvcc="$(site_nvidia_dirs nvcc | head -1)"
        [[ -n $nvcc ]] && nvcc="$nvcc/nvcc"
    fi
    if [[ -z $nvcc ]]; then
        local toolkit
        toolkit="$("$PY" -c "import importlib.metadata as m; print(m.version('cuda-toolkit'))" 2>/dev/null)"
        if [[ -z $toolkit ]]; then
            say "no nvcc: set CUDA_HOME to a CUDA toolkit, or put nvcc on PATH"
            return 1
        fi
        say "no nvcc found: installing pip's, cuda-toolkit[nvcc]==$toolkit (torch's CUDA)"
        pip_ install "cuda-toolkit[nvcc]==$toolkit" || return 1
        nvcc="$(site_nvidia_dirs nvcc | head -1)/nvcc"
        [[ -x $nvcc ]] || { say "cuda-toolkit[nvcc]==$toolkit installed no nvcc"; return 1; }
    fi
    CUDA_HOME="$(cd "$(dirname "$nvcc")/.." && pwd)"
    export CUDA_HOME
}

build_te() {  # install every TE piece; 0 only when all import
    local spec="$1" cuda tools=()
    cuda="$("$PY" -c "import torch; print(torch.version.cuda or 'none')" 2>/dev/null || echo "no torch")"
    say "torch CUDA: $cuda; Transformer Engine: $spec + its torch binding (compiled here)"
    [[ $spec == *"core_cu${cuda%%.*}]"* ]] || say "warning: $spec is not built for torch's CUDA $cuda"
    "$PY" -c "import setuptools, wheel.bdist_wheel, packaging" 2>/dev/null || tools+=(setuptools wheel packaging)
    if [[ ${#tools[@]} -gt 0 ]]; then
        pip_ install "${tools[@]}" || { say "could not install the build tools ${tools[*]}"; return 1; }
    fi
    if ! command -v ninja >/dev/null && ! "$PY" -c "import ninja" 2>/dev/null; then
        pip_ install ninja || say "warning: no ninja; the compile runs serially (slow)"
    fi
    find_nvcc || return 1
    export PATH="$CUDA_HOME/bin:$PATH"
    local header dirs
    for header in cudnn.h nccl.h; do
        dirs="$(site_nvidia_dirs "$header" | paste -sd: -)"
        if [[ -n $dirs ]]; then
            CPLUS_INCLUDE_PATH="$dirs${CPLUS_INCLUDE_PATH:+:$CPLUS_INCLUDE_PATH}"
        elif [[ ! -f "$CUDA_HOME/include/$header" ]]; then
            say "warning: $header found neither in the environment's nvidia packages nor in $CUDA_HOME/include"
        fi
    done
    export CPLUS_INCLUDE_PATH="${CPLUS_INCLUDE_PATH:-}"
    export NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS="${MAX_JOBS:-$(nproc 2>/dev/null || echo 4)}"
    say "CUDA_HOME=$CUDA_HOME CPLUS_INCLUDE_PATH=$CPLUS_INCLUDE_PATH MAX_JOBS=$MAX_JOBS; log: $LOG"
    pip_ install --no-build-isolation "${spec/\]/,pytorch]}" 2>&1 | tee "$LOG"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || { say "the Transformer Engine build failed (the end of $LOG says why)"; return 1; }
    "$PY" -c "import transformer_engine.pytorch, transformer_engine_torch, megatron.core" 2>&1 | tail -5 | tee -a "$LOG"
    [[ ${PIPESTATUS[0]} -eq 0 ]] || { say "Transformer Engine was installed but does not import"; return 1; }
}

remove_te() {
    local installed=()
    for piece in "${TE_PIECES[@]}"; do
        pip_ show -q "$piece" >/dev/null 2>&1 && installed+=("$piece")
    done
    if [[ ${#installed[@]} -gt 0 ]]; then
        say "uninstalling every Transformer Engine piece: ${installed[*]}"
        pip_ uninstall -y "${installed[@]}" >/dev/null
    fi
}

TE_STATUS=skipped
if [[ $MODE != no-te ]]; then
    spec="$(te_spec)"
    if [[ -z $spec ]]; then
        say "requirements/gpu-te.txt has no transformer-engine[core_cuNN]==VERSION line" >&2
        exit 1
    fi
    if build_te "$spec"; then
        TE_STATUS=installed
        say "Transformer Engine installed and imports ($spec + transformer-engine-torch)"
    else
        TE_STATUS=failed
        remove_te
        if ! "$PY" -c "import megatron.core" 2>/dev/null; then
            say "error: import megatron.core fails even without Transformer Engine ($PY -c 'import megatron.core')" >&2
            exit 1
        fi
        say "Transformer Engine was NOT installed (the end of $LOG says why); every piece was removed and"
        say "import megatron.core works without it: model.attention_backend=auto takes torch's varlen kernels"
    fi
fi

# ---------------------------------------------------------------------------------------------- this package
if [[ $MODE == all || $MODE == no-te ]]; then
    pip_ install --no-deps -e . || { say "pip could not install this package" >&2; exit 1; }
fi
if [[ $TE_STATUS == failed && $REQUIRE_TE == 1 ]]; then
    exit 1
fi
exit 0
