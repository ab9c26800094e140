"""A half-installed Transformer Engine (planted on sys.path of a subprocess: the CPU machine has no TE) is named
with its fix by ``compat.check_transformer_engine`` when ``megatron_dppo.megatron`` is imported, instead of
crashing inside ``import megatron.core`` (whose TE imports catch only ImportError, or only ModuleNotFoundError in
``tensor_parallel/random.py``). A TE piece that is missing (ModuleNotFoundError) is harmless: Megatron-Core runs
without TE, and so does the engine."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# what TE 2.11's transformer_engine/common/__init__.py raises when only transformer-engine-cu13 is installed
NO_META_PACKAGE = 'raise AssertionError("Could not find `transformer-engine`.")\n'
# what transformer_engine/pytorch/__init__.py raises when the torch binding was never built
NO_BINDING = 'raise FileNotFoundError("Could not find shared object file for Transformer Engine torch lib.")\n'
# a library that does not load (Megatron-Core's tensor_parallel/random.py catches ModuleNotFoundError only)
NOT_LOADABLE = 'raise ImportError("libcudnn.so.9: cannot open shared object file")\n'


def _plant(site: Path, init: str, pytorch_init: str | None = None, dists=("transformer_engine_cu13",)) -> Path:
    package = site / "transformer_engine"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(init)
    if pytorch_init is not None:
        (package / "pytorch").mkdir()
        (package / "pytorch" / "__init__.py").write_text(pytorch_init)
    for name in dists:
        info = site / f"{name}-2.11.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 2.11.0\n")
    return site


def _import_engine(site: Path) -> subprocess.CompletedProcess:
    code = "import megatron_dppo.megatron.model, megatron.core; print('megatron.core imported')"
    env = dict(os.environ, PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("case", ["core_without_meta_package", "binding_missing", "not_loadable"])
def test_a_broken_transformer_engine_is_named_with_its_fix(tmp_path, case):
    if case == "core_without_meta_package":
        site = _plant(tmp_path / "site", NO_META_PACKAGE)
        reason, dists = "AssertionError: Could not find `transformer-engine`.", "transformer-engine-cu13 2.11.0"
        remove = "pip uninstall -y transformer-engine-cu13 "
    elif case == "not_loadable":
        site = _plant(tmp_path / "site", NOT_LOADABLE)
        reason, dists = "ImportError: libcudnn.so.9: cannot open shared object file", "transformer-engine-cu13 2.11.0"
        remove = "pip uninstall -y transformer-engine-cu13 "
    else:
        site = _plant(tmp_path / "site", "", NO_BINDING, dists=("transformer_engine", "transformer_engine_cu13"))
        reason = "FileNotFoundError: Could not find shared object file for Transformer Engine torch lib."
        dists = "transformer-engine 2.11.0, transformer-engine-cu13 2.11.0"
        remove = "pip uninstall -y transformer-engine transformer-engine-cu13 "
    proc = _import_engine(site)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("megatron_dppo.megatron.compat.BrokenTransformerEngine: Transformer Engine is installed "
                           f"but broken ({dists} at {site / 'transformer_engine'}): importing it raises {reason}"), last
    assert remove in last and "bash scripts/install_gpu.sh --te-only" in last
    assert "megatron/core" not in proc.stderr  # stopped before Megatron-Core was imported


def test_a_transformer_engine_without_its_torch_binding_module_is_treated_as_absent(tmp_path):
    site = _plant(tmp_path / "site", "import transformer_engine_torch\n")  # ModuleNotFoundError
    proc = _import_engine(site)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megatron.core imported" in proc.stdout
