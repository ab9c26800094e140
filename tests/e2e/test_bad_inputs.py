"""Bad input: each case fails with one clear line (``error: ...``, exit status 2) naming what is wrong, before
anything in the output directory is written or overwritten (a previous run's metrics, config and checkpoints
survive). A reward function that raises or returns NaN costs its samples a zero and a warning, never the run."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _e2e_helpers import (
    PY,
    REPO,
    TINY_MODEL,
    damaged_parquet,
    env,
    free_port,
    make_read_only,
    read_metrics,
    run_cli,
    tiny_config,
    write_config,
)

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
    # hostile inputs that used to end in a traceback, or in an error that did not name the culprit
    "output_dir_is_file": ["train.output_dir:", "metrics.jsonl' exists and is not a directory"],
    "checkpoint_dir_is_file": ["checkpoint directory", "checkpoints' exists and is not a directory"],
    "output_dir_not_writable": ["train.output_dir:", "is not writable"],
    "config_is_directory": ["config file", "is a directory, not a YAML file"],
    "reward_raises_on_import": ["reward 'dppo_raising_reward:score'", "raised RuntimeError: refuses to load",
                                "dppo_raising_reward.py:1"],
    "reward_syntax_error": ["reward 'dppo_syntax_reward:score'", "dppo_syntax_reward.py:1: syntax error"],
    "reward_timeout_inf": ["reward.timeout_s=inf is invalid", "finite"],
    "reward_weight_not_number": ["reward.fn.arithmetic='heavy' is invalid", "a finite number"],
    "yaml_not_utf8": ["not_utf8.yaml': line 2 is not valid UTF-8", "byte 0xe9"],
    "jsonl_not_utf8": ["latin1.jsonl:2: not valid UTF-8", "byte 0xe9 at byte offset"],
    "damaged_parquet": ["damaged.parquet: not a readable parquet file", "Couldn't deserialize thrift"],
    "enormous_line": ["prompt 'huge:1' is at least", "context length is 32 tokens"],
    "weights_do_not_fit": ["model.path", "HF checkpoint does not match the qwen2 architecture"],
    # reward.model.path: each used to fail late or without naming the file (a JSON error, an OSError traceback,
    # "the reward model's input is empty" at step 0)
    "reward_model_config_not_json": ["reward.model.path: ", "rm_not_json/config.json: not valid JSON (Expecting "
                                     "value at line 1 column 16)"],
    "reward_model_no_weights": ["reward.model.path ", "rm_no_weights' has no weights (none of model.safetensors",
                                "copy the model's weight files"],
    "reward_model_no_tokenizer": ["reward.model.path ", "rm_no_tokenizer' has no tokenizer",
                                  "copy the reward model's tokenizer files"],
    # rm train --pairs: each used to name no file or line, or end in a traceback
    "pairs_malformed_line": ["pairs_bad.jsonl:2: invalid JSON"],
    "pairs_empty_file": ["pairs_empty.jsonl: no preference pairs (the file is empty)", "at least 2"],
    "pairs_line_is_a_number": ["pairs_number.jsonl:2: expected a JSON object per line, got int"],
    "pairs_not_utf8": ["pairs_latin1.jsonl:2: not valid UTF-8", "byte 0xe9"],
    "pairs_missing_field": ["pairs_nofield.jsonl:1: missing field(s) rejected (the row has: chosen, prompt)"],
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
    (data / "latin1.jsonl").write_bytes(b'{"question": "What is 2 plus 3?", "answer": "5"}\n'
                                        b'{"question": "Caf\xe9 au lait?", "answer": "5"}\n')
    (data / "huge.jsonl").write_text(json.dumps({"question": "12 plus 3 " * 500_000, "answer": "5"}) + "\n")
    modules = tmp / "modules"
    modules.mkdir()
    (modules / "dppo_raising_reward.py").write_text("raise RuntimeError('refuses to load')\n")
    (modules / "dppo_syntax_reward.py").write_text("def score(completion, gold:\n    return 1.0\n")
    sys.path.insert(0, str(REPO / "tests" / "convert"))
    from _hf_models import save_hf_model

    hf_model = save_hf_model("qwen2_tied", tmp / "hf_model")
    with_chat, without_chat = _tokenizer(tmp / "tok_chat", True), _tokenizer(tmp / "tok_plain", False)
    reward_models = {}  # a reward model folder with one part missing or damaged
    for name in ("rm_not_json", "rm_no_weights", "rm_no_tokenizer"):
        folder = shutil.copytree(hf_model, tmp / name)
        for f in Path(with_chat).iterdir():  # a real tokenizer, as `rm train` writes beside the model
            shutil.copy(f, folder / f.name)
        reward_models[name] = str(folder)
    (tmp / "rm_not_json" / "config.json").write_text('{"model_type": qwen2}\n')
    (tmp / "rm_no_weights" / "model.safetensors").unlink()
    for f in Path(with_chat).iterdir():
        (tmp / "rm_no_tokenizer" / f.name).unlink(missing_ok=True)
    pair = json.dumps({"prompt": "7+5=", "chosen": "12", "rejected": "13"}) + "\n"
    (data / "pairs_bad.jsonl").write_text(pair + '{"prompt": "7+5=", "chosen": \n' + pair)
    (data / "pairs_empty.jsonl").write_text("")
    (data / "pairs_number.jsonl").write_text(pair + "42\n" + pair)
    (data / "pairs_latin1.jsonl").write_bytes(pair.encode()
                                              + b'{"prompt": "Caf\xe9", "chosen": "1", "rejected": "2"}\n')
    (data / "pairs_nofield.jsonl").write_text(json.dumps({"prompt": "7+5=", "chosen": "12"}) + "\n" + pair)

    def files_case(name, train_file, tokenizer=with_chat, template="plain"):
        out = tmp / name / "run"
        cfg = tiny_config(out, data={"task": "files", "train_files": [str(train_file)], "template": template},
                          model={"hf_config": dict(TINY_MODEL), "tokenizer": tokenizer},
                          eval={"every": 0}, train={"sft_steps": 0})
        for key in ("arithmetic_train_size", "arithmetic_max_operand"):  # a file that reads its prompts from files
            del cfg["data"][key]                                           # does not tune the arithmetic generator
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
        "output_dir_is_file": (tiny_config(tmp / "output_dir_is_file" / "run" / "metrics.jsonl"), []),
        "checkpoint_dir_is_file": (tiny_config(tmp / "checkpoint_dir_is_file" / "run"), []),
        "output_dir_not_writable": (tiny_config(tmp / "output_dir_not_writable" / "run"), []),
        "config_is_directory": (tiny_config(tmp / "config_is_directory" / "run"), []),
        "reward_raises_on_import": (tiny_config(tmp / "reward_raises_on_import" / "run",
                                                reward={"fn": "dppo_raising_reward:score",
                                                        "isolation": "process"}), []),
        "reward_syntax_error": (tiny_config(tmp / "reward_syntax_error" / "run",
                                            reward={"fn": "dppo_syntax_reward:score", "isolation": "process"}), []),
        "reward_timeout_inf": (tiny_config(tmp / "reward_timeout_inf" / "run"), ["reward.timeout_s=inf"]),
        "reward_weight_not_number": (tiny_config(tmp / "reward_weight_not_number" / "run",
                                                 reward={"fn": {"arithmetic": "heavy", "format": 0.1}}), []),
        "yaml_not_utf8": (tiny_config(tmp / "yaml_not_utf8" / "run"), []),
        "jsonl_not_utf8": (files_case("jsonl_not_utf8", data / "latin1.jsonl"), []),
        "damaged_parquet": (files_case("damaged_parquet", damaged_parquet(data / "damaged.parquet")), []),
        "enormous_line": (files_case("enormous_line", data / "huge.jsonl"), []),
        "weights_do_not_fit": (tiny_config(tmp / "weights_do_not_fit" / "run",
                                           model={"path": str(hf_model), "tokenizer": with_chat,
                                                  "hf_config": {"intermediate_size": 100}}), []),
    }
    for name in ("reward_model_config_not_json", "reward_model_no_weights", "reward_model_no_tokenizer"):
        folder = reward_models["rm_" + name.removeprefix("reward_model_").replace("config_", "")]
        configs[name] = (tiny_config(tmp / name / "run", model={"tokenizer": with_chat},
                                     reward={"model": {"path": folder}}), [])
    pairs = {"pairs_malformed_line": "pairs_bad", "pairs_empty_file": "pairs_empty",
             "pairs_line_is_a_number": "pairs_number", "pairs_not_utf8": "pairs_latin1",
             "pairs_missing_field": "pairs_nofield"}
    for name in pairs:
        configs[name] = (tiny_config(tmp / name / "run"), [])
    argv, before = {}, {}
    for name, (cfg, overrides) in configs.items():
        out = tmp / name / "run"
        # a previous run's outputs that must survive the failed start
        (out / "checkpoints" / "step_00000003").mkdir(parents=True)
        (out / "checkpoints" / "step_00000003" / "metadata.json").write_text("{}")
        (out / "checkpoints" / "latest").write_text("step_00000003\n")
        (out / "metrics.jsonl").write_text('{"step": 0, "phase": "rl", "reward/mean": 0.5}\n')
        (out / "config.yaml").write_text("previous: run\n")
        (out / "rollout_model").mkdir()
        (out / "rollout_model" / "config.json").write_text('{"previous": "run"}\n')
        config = write_config(tmp / f"{name}.yaml", cfg)
        argv[name] = ["train", "--config", str(config), *overrides]
    for name, stem in pairs.items():  # rm train, its folder inside the previous run's (nothing may be written)
        argv[name] = ["rm", "train", "--config", argv[name][2], "--out", str(tmp / name / "run" / "rm"),
                      "--pairs", str(data / f"{stem}.jsonl"), "--steps", "2"]
    shutil.rmtree(tmp / "checkpoint_dir_is_file" / "run" / "checkpoints")
    (tmp / "checkpoint_dir_is_file" / "run" / "checkpoints").write_text("a file where the checkpoints go\n")
    argv["config_is_directory"][2] = str(tmp / "config_is_directory")
    latin1 = tmp / "yaml_not_utf8.yaml"  # saved by an editor in Latin-1: the bad byte is on line 2
    latin1.write_bytes(b"# the tiny run\n# Jos\xe9's settings\n" + latin1.read_bytes())
    before = {name: _fingerprint(tmp / name / "run") for name in configs}
    undo = make_read_only(tmp / "output_dir_not_writable" / "run")
    (tmp / "cases.json").write_text(json.dumps(argv))
    try:
        proc = subprocess.run([PY, str(REPO / "tests" / "e2e" / "_cli_cases.py"), str(tmp / "cases.json"),
                               str(tmp / "results.json")], cwd=REPO,
                              env=env(MASTER_PORT=str(free_port()), PYTHONPATH=f"{modules}{os.pathsep}{REPO}"),
                              capture_output=True, text=True, timeout=600)
    finally:
        undo()
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


@pytest.mark.slow
def test_hanging_reward_function_costs_a_bounded_time_and_is_counted(tmp_path):
    """A reward that hangs on about half the samples (2 steps x 32 samples; reward.timeout_s=30, 2 workers:
    without a budget each step would score for ~8 minutes). With reward.step_budget_s=3 each step scores for
    ~3 s, the hung samples score 0 and reward/timeouts counts them."""
    import time

    out = tmp_path / "run"
    cfg = tiny_config(out, reward={"fn": "tests.e2e._rewards:hangs", "isolation": "process", "timeout_s": 30,
                                   "num_workers": 2, "step_budget_s": 3},
                      train={"steps": 2, "sft_steps": 0}, eval={"every": 0}, checkpoint={"every": 0})
    start = time.perf_counter()
    run_cli(write_config(tmp_path / "run.yaml", cfg))
    elapsed = time.perf_counter() - start
    rl = [r for r in read_metrics(out) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1]
    for r in rl:
        assert r["reward/timeouts"] >= 1 and r["reward/failed"] == r["reward/timeouts"]
        assert r["time/reward"] < 3 + 10, r["time/reward"]  # the budget, plus (re)starting the reward workers
        # a hung sample scores 0, the others 1: the mean is the fraction of samples that did not time out
        assert r["reward/mean"] == pytest.approx(1 - r["reward/timeouts"] / 32)
    print(f"\nhanging reward: {elapsed:.0f} s for 2 steps, timeouts {[r['reward/timeouts'] for r in rl]}, "
          f"scoring {[round(r['time/reward'], 1) for r in rl]} s")


@pytest.mark.parametrize("output_dir", ["/proc/dppo-no-such/run", "/proc/self/run"])
def test_output_dir_on_a_pseudo_file_system_is_one_error_line(tmp_path, output_dir):
    """/proc accepts no new folders, not even from root (for whom os.access says yes): one `error:` line naming
    train.output_dir and exit 2, not the FileNotFoundError traceback of the first mkdir."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("no /proc on this system")
    cfg = tiny_config(tmp_path / "unused", train={"output_dir": output_dir})
    proc = run_cli(write_config(tmp_path / "run.yaml", cfg), check=False, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith("error: train.output_dir: ") and repr(output_dir) in lines[0], lines[0]
