"""Reward models end to end (issue 33), through the CLI: ``megatron-dppo rm train`` makes the reward model from the
arithmetic task, then ``megatron-dppo train`` scores with it.

* Separate placement: the rollout worker scores (the trainer holds no reward model) and, at max_staleness 0, the run
  equals the colocated one in every record (reward-model scores, agreement metrics, the reward-spread prompt history
  DPPO prunes with);
* a reward model that fails (a diverged one: NaN weights) stops the run at its first batch with one error line
  naming the model and the batch, exit status 1;
* (slow) a deliberately length-biased reward model trips the reward-hacking alarm;
* (slow) GRPO on a learned reward model alone raises the rule's accuracy on the quickstart task.
"""
from __future__ import annotations

import json
import subprocess

import pytest
from _e2e_helpers import PY, REPO, env, read_metrics, run_cli, stable_metrics, tiny_config, write_config

SEPARATE = ("rollout.placement=separate", "train.max_staleness=0")


def rm_train(config, out, *args, timeout=900):
    """``megatron-dppo rm train`` for the run ``config`` describes; returns its record."""
    proc = subprocess.run([PY, "-m", "megatron_dppo.cli", "rm", "train", "--config", str(config), "--out", str(out),
                           *args], cwd=REPO, env=env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "held-out" in proc.stdout
    return json.loads((out / "reward_model.json").read_text())


def _rl(records):
    return [r for r in records if r.get("phase") == "rl"]


def test_reward_model_on_the_rollout_workers_equals_colocated(tmp_path):
    tiny = write_config(tmp_path / "tiny.yaml", tiny_config(tmp_path / "unused", eval={"every": 0}))
    rm = tmp_path / "rm"
    rm_train(tiny, rm, "--steps", "30", "--num-pairs", "200", "--heldout", "20", "--hidden", "32")
    runs = {}
    for name, extra, nproc in (("sync", (), 1), ("sep", SEPARATE, 2)):
        out = tmp_path / name
        cfg = write_config(tmp_path / f"{name}.yaml", tiny_config(out, eval={"every": 0}))
        run_cli(cfg, f"reward.model.path={rm}", "train.steps=3", *extra, nproc=nproc)
        runs[name] = read_metrics(out)
    a, b = _rl(runs["sync"]), _rl(runs["sep"])
    assert len(a) == len(b) == 3
    assert all("reward/model_mean" in r and "reward/rule_model_tau_groups" in r for r in b)
    strip = [{k: v for k, v in r.items() if not k.startswith("async/")} for r in stable_metrics(runs["sep"])]
    assert stable_metrics(runs["sync"]) == strip
    assert any(r["prune/prompt_kept_fraction"] < 1.0 for r in a)  # DPPO pruned on the reward-spread history
    assert json.loads((tmp_path / "sep" / "rollout_worker.json").read_text())["batches"]  # the worker drew them


def test_a_failing_reward_model_stops_the_run_with_one_error(tmp_path):
    from safetensors.torch import load_file, save_file

    tiny = write_config(tmp_path / "tiny.yaml", tiny_config(tmp_path / "run", eval={"every": 0}))
    rm = tmp_path / "rm"
    rm_train(tiny, rm, "--steps", "5", "--num-pairs", "50", "--heldout", "5", "--hidden", "32")
    weights = load_file(rm / "model.safetensors")
    weights["score.weight"].fill_(float("nan"))  # a diverged reward model
    save_file(weights, rm / "model.safetensors", metadata={"format": "pt"})
    proc = run_cli(tiny, f"reward.model.path={rm}", check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert str(rm) in errors[0] and "non-finite score nan" in errors[0] and "step 0" in errors[0]
    assert "arith-train-" in errors[0]  # the batch's prompts
    assert not _rl(read_metrics(tmp_path / "run"))  # no step was trained on it


QUICK = ("train.sft_steps=100", "eval.max_prompts=100", "eval.every=0", "checkpoint.every=0", "logging.plot=false",
         "logging.progress_bar=false", "logging.tensorboard=false", "algo.pruner=none")


@pytest.mark.slow
def test_a_length_biased_reward_model_trips_the_agreement_alarm(tmp_path):
    config = REPO / "examples" / "quickstart.yaml"
    rm = tmp_path / "rm_longer"
    record = rm_train(config, rm, "--prefer", "longer", "--steps", "300")
    assert record["heldout_accuracy"] > 0.95  # it learned what it was taught: longer is better
    proc = run_cli(config, f"train.output_dir={tmp_path / 'run'}", f"reward.model.path={rm}", "train.steps=6", *QUICK)
    rl = _rl(read_metrics(tmp_path / "run"))
    taus = [r["reward/rule_model_tau"] for r in rl if "reward/rule_model_tau" in r]
    assert taus and sum(taus) / len(taus) < 0  # it prefers what the rule rejects
    assert any(r.get("reward/agreement_alarm") == 1.0 for r in rl)
    assert "reward-hacking alarm" in proc.stderr


@pytest.mark.slow
def test_grpo_on_a_learned_reward_model_alone_raises_rule_accuracy(tmp_path):
    config = REPO / "examples" / "quickstart.yaml"
    rm = tmp_path / "rm"
    record = rm_train(config, rm)
    assert record["heldout_accuracy"] > 0.85
    run_cli(config, f"train.output_dir={tmp_path / 'run'}", f"reward.model.path={rm}", "train.steps=45",
            "optim.lr=1e-3", *QUICK, timeout=3000)
    rl = _rl(read_metrics(tmp_path / "run"))
    rule = [r["reward/rule_mean"] for r in rl]
    first, last = sum(rule[:15]) / 15, sum(rule[-15:]) / 15
    # measured: 0.20 -> 0.31 (GRPO on the rule itself: 0.21 -> 0.31); a 15-step mean's standard error is ~0.013
    assert last > first + 0.05, (first, last)  # the rule's accuracy rose, though only the model was trained on
    taus = [r["reward/rule_model_tau"] for r in rl if "reward/rule_model_tau" in r]
    assert sum(taus) / len(taus) > 0.3 and not any(r.get("reward/agreement_alarm") for r in rl)


@pytest.mark.slow
def test_the_megatron_reward_model_scores_a_run_as_the_hf_one(tmp_path):
    """reward.model.engine=megatron under parallel.tp=2 (the classifier sharded like the policy, its two TP ranks
    one data-parallel replica) scores the first batch as engine=hf does (the same policy, prompts and seeds)."""
    tiny = write_config(tmp_path / "tiny.yaml", tiny_config(tmp_path / "unused", eval={"every": 0}))
    rm = tmp_path / "rm"  # (parallel.tp=2 pads the policy's vocabulary to 128 rows: the model's embedding too)
    rm_train(tiny, rm, "--steps", "30", "--num-pairs", "200", "--heldout", "20", "--hidden", "32", "parallel.tp=2")
    first = {}
    for engine in ("hf", "megatron"):
        out = tmp_path / engine
        cfg = write_config(tmp_path / f"{engine}.yaml", tiny_config(out, eval={"every": 0}))
        run_cli(cfg, f"reward.model.path={rm}", f"reward.model.engine={engine}", "parallel.tp=2", "train.steps=1",
                nproc=2)
        first[engine] = _rl(read_metrics(out))[0]
    for key in ("reward/model_mean", "reward/rule_mean", "reward/rule_model_tau"):
        assert first["megatron"][key] == pytest.approx(first["hf"][key], abs=1e-4), key
