"""Bad input: each case fails with one clear line (``error: ...``, exit status 2) naming what is wrong, before
anything in the output directory is written or overwritten (a previous run's metrics, config and checkpoints
survive). A reward function that raises or returns NaN costs its samples a zero and a warning, never the run."""
from __future__ import annotations

import hashlib
import json
import subprocess

import pytest

from _e2e_helpers import PY, REPO, TINY_MODEL, env, free_port, read_metrics, run_cli, tiny_config, write_config

CASES = {
    # name: (expected fragments of the error message, how to build the case)
    "unknown_key": ["unknown config key 'algo.rq'", "did you mean algo.r_q"],
    "bad_value": ["algo.pruner='dpp' is invalid", "'none', 'cppo', 'dppo'"],
    "missing_data_file": ["data.train_files: file", "missing.jsonl' does not exist"],
    "malformed_jsonl_row": ["bad.jsonl:2: invalid JSON"],
    "missing_field": ["nofield.jsonl:1: missing field 'question'", "the row has: answer, text"],
    "empty_dataset": ["empty.jsonl: the dataset is empty"],
    "prompt_too_long": ["prompt 'long:1' is", "tokens long but the context length is 32 tokens",
                        "4 are reserved for the completion"],
    "no_chat_template": ["has no chat template", "'plain'"],
}


def _tokenizer(path, chat_template):
    from megatron_dppo.data import train_sentencepiece_tokenizer
    from megatron_dppo.data.tokenizer import DEFAULT_CHAT_TEMPLATE

    corpus = ["What is 2 plus 3? The answer is 5.", "How many apples? 12", "Question: Answer:"] * 20
    train_sentencepiece_tokenizer(corpus, path, chat_template=DEFAULT_CHAT_TEMPLATE if chat_template else None)
    return str(path)


def _fingerprint(directory):
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_inputs")
    data = tmp / "data"
    data.mkdir()
    (data / "bad.jsonl").write_text('{"question": "What is 2 plus 3?", "answer": "5"}\n{"question": "oops", \n')
    (data / "nofield.jsonl").write_text('{"text": "What is 2 plus 3?", "answer": "5"}\n')
    (data / "empty.jsonl").write_text("\n")
    (data / "long.jsonl").write_text(json.dumps({"question": "What is 2 plus 3? " * 20, "answer": "5"}) + "\n")
    (data / "good.jsonl").write_text(json.dumps({"question": "What is 2 plus 3?", "answer": "5"}) + "\n")
    with_chat, without_chat = _tokenizer(tmp / "tok_chat", True), _tokenizer(tmp / "tok_plain", False)

    def files_case(name, train_file, tokenizer=with_chat, template="plain"):
        out = tmp / name / "run"
        cfg = tiny_config(out, data={"task": "files", "train_files": [str(train_file)], "template": template},
                          model={"hf_config": dict(TINY_MODEL), "tokenizer": tokenizer},
                          eval={"every": 0}, train={"sft_steps": 0})
        return cfg

    configs = {
        "unknown_key": (tiny_config(tmp / "unknown_key" / "run"), ["algo.rq=0.5"]),
        "bad_value": (tiny_config(tmp / "bad_value" / "run"), ["algo.pruner=dpp"]),
        "missing_data_file": (files_case("missing_data_file", data / "missing.jsonl"), []),
        "malformed_jsonl_row": (files_case("malformed_jsonl_row", data / "bad.jsonl"), []),
        "missing_field": (files_case("missing_field", data / "nofield.jsonl"), []),
        "empty_dataset": (files_case("empty_dataset", data / "empty.jsonl"), []),
        "prompt_too_long": (files_case("prompt_too_long", data / "long.jsonl"), []),
        "no_chat_template": (files_case("no_chat_template", data / "good.jsonl", without_chat, "chat"), []),
    }
    argv, before = {}, {}
    for name, (cfg, overrides) in configs.items():
        out = tmp / name / "run"
        # a previous run's outputs that must survive the failed start
        (out / "checkpoints" / "step_00000003").mkdir(parents=True)
        (out / "checkpoints" / "step_00000003" / "metadata.json").write_text("{}")
        (out / "checkpoints" / "latest").write_text("step_00000003\n")
        (out / "metrics.jsonl").write_text('{"step": 0, "phase": "rl", "reward/mean": 0.5}\n')
        (out / "config.yaml").write_text("previous: run\n")
        before[name] = _fingerprint(out)
        argv[name] = ["train", "--config", str(write_config(tmp / f"{name}.yaml", cfg)), *overrides]
    (tmp / "cases.json").write_text(json.dumps(argv))
    proc = subprocess.run([PY, str(REPO / "tests" / "e2e" / "_cli_cases.py"), str(tmp / "cases.json"),
                           str(tmp / "results.json")], cwd=REPO, env=env(MASTER_PORT=str(free_port())),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads((tmp / "results.json").read_text())
    for name in configs:
        out[name]["unchanged"] = _fingerprint(tmp / name / "run") == before[name]
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_fails_clearly_and_loses_nothing(results, case):
    result = results[case]
    lines = [line for line in result["stderr"].splitlines() if line.startswith("error: ")]
    assert result["rc"] == 2, result["stderr"][-3000:]
    assert len(lines) == 1, result["stderr"][-3000:]
    for fragment in CASES[case]:
        assert fragment in lines[0], (fragment, lines[0])
    assert "Traceback" not in result["stderr"]
    assert result["unchanged"], f"{case}: the failed start modified the previous run's outputs"


def test_failing_reward_function_costs_samples_not_the_run(tmp_path):
    out = tmp_path / "run"
    cfg = tiny_config(out, reward={"fn": "tests.e2e._rewards:flaky", "isolation": "inline"},
                      train={"steps": 2, "sft_steps": 0}, eval={"every": 0}, checkpoint={"every": 0})
    proc = run_cli(write_config(tmp_path / "run.yaml", cfg))
    rl = [r for r in read_metrics(out) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    assert "flaky reward refuses" in proc.stderr and "non-finite reward nan" in proc.stderr
    assert all(0.0 <= r["reward/mean"] < 1.0 for r in rl)  # failed samples scored 0, the rest 1
    assert (out / "checkpoints" / "latest").is_file()
