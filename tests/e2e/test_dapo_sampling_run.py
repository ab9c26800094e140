"""DAPO's dynamic sampling with refill and overlong handling in real CLI runs (docs/algorithms.md, "Dynamic sampling
with refill", "Overlong completions"): every step trains exactly B groups with non-zero variance in the training
reward, drawn over several rounds; truncated completions are neither trained nor counted in D; a resumed run equals
the straight run (the sampler's position after the refill rounds is checkpointed); a task no round can fill stops at
dynamic_sampling.max_rounds with one warning per step and trains nothing."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from _e2e_helpers import read_metrics, run_cli, stable_metrics, tiny_config, write_config

B, G = 8, 4


def _cfg(out, **sections):
    base = dict(algo={"pruner": "none"}, reward={"fn": "tests.e2e._rewards:solved_or_parity", "isolation": "inline"},
                dynamic_sampling={"enable": True, "max_rounds": 4}, overlong={"buffer": 2, "filter": True},
                train={"steps": 4, "sft_steps": 0, "prompts_per_step": B, "group_size": G}, eval={"every": 0},
                checkpoint={"every": 2}, logging={"audit_log": True})
    for k, v in sections.items():
        base.setdefault(k, {}).update(v)
    return tiny_config(out, **base)


def test_refill_trains_b_groups_with_signal_and_resumes_exactly(tmp_path):
    straight = tmp_path / "straight"
    run_cli(write_config(tmp_path / "straight.yaml", _cfg(straight)))
    rl = [r for r in read_metrics(straight) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    for r in rl:
        assert r["dynamic_sampling/kept_groups"] == B and r["dynamic_sampling/exhausted"] == 0
        assert r["dynamic_sampling/prompts_drawn"] == B + r["dynamic_sampling/discarded_groups"]  # shortfall refill
        # the trained units are the batch's finished completions, and D counts exactly those (seq-mean-token-mean)
        assert r["loss/denominator"] == B * G - r["overlong/filtered"] == r["prune/total_kept"]
        assert r["overlong/penalty_mean"] < 0 and 0 < r["overlong/penalized_fraction"] <= 1
    assert sum(r["dynamic_sampling/rounds"] > 1 for r in rl) >= 2  # the task leaves groups with one reward for all
    # reward/* describe every generated group (all rounds), not the filtered batch
    assert any(r["reward/zero_variance_groups"] > 0 for r in rl)

    audit = [json.loads(line) for line in (straight / "audit.jsonl").read_text().splitlines()]
    for r in rl:
        groups = [a for a in audit if a["step"] == r["step"]]
        assert len(groups) == B  # the batch: the kept groups, as if drawn
        for a in groups:
            assert any(x != 0 for x in a["advantages"])  # non-zero variance of the training reward
            for keep, length in zip(a["keep"], a["lengths"]):
                assert keep or length == 4  # a completion shorter than max_new_tokens = 4 finished: trained
        assert sum(not k for a in groups for k in a["keep"]) == r["overlong/filtered"]  # the rest: truncated

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000004")
    (resumed / "checkpoints" / "latest").write_text("step_00000002\n")
    proc = run_cli(write_config(tmp_path / "resumed.yaml", _cfg(resumed)))
    assert "resumed from" in proc.stdout
    assert stable_metrics(read_metrics(resumed)) == stable_metrics(read_metrics(straight))


def test_refill_stops_at_max_rounds_with_a_warning(tmp_path):
    out = tmp_path / "run"
    cfg = _cfg(out, reward={"fn": "tests.e2e._rewards:constant"}, overlong={"buffer": 0, "filter": False},
               dynamic_sampling={"max_rounds": 3, "refill_prompts": 5}, train={"steps": 2}, checkpoint={"every": 0})
    proc = run_cli(write_config(tmp_path / "run.yaml", cfg))
    rl = [r for r in read_metrics(out) if r["phase"] == "rl"]
    for r in rl:
        assert r["dynamic_sampling/rounds"] == 3 and r["dynamic_sampling/exhausted"] == 1
        assert r["dynamic_sampling/prompts_drawn"] == B + 5 + 5 == r["dynamic_sampling/discarded_groups"]
        assert r["dynamic_sampling/kept_groups"] == 0 and r["train/skipped"] == 1
    warnings = [line for line in proc.stderr.splitlines() if "dynamic_sampling.max_rounds=3" in line]
    assert len(warnings) == 2 and "found 0 of 8 groups" in warnings[0], proc.stderr[-3000:]


@pytest.mark.multiproc
def test_refill_under_data_parallelism_every_rank_agrees(tmp_path):
    """DP2: both ranks run the same refill rounds (rank 0's rewards decide, broadcast; a rank that decided otherwise
    would hang in the next collective), and the checkpointed sampler position counts every round's prompts."""
    out = tmp_path / "dp2"
    proc = run_cli(write_config(tmp_path / "dp2.yaml", _cfg(out, train={"steps": 3}, checkpoint={"every": 0})),
                   nproc=2)
    assert "world 2 (tp 1, pp 1, dp 2)" in proc.stdout
    rl = [r for r in read_metrics(out) if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2]
    for r in rl:  # B groups, or fewer after max_rounds = 4 rounds (then trained on both ranks all the same)
        assert r["dynamic_sampling/kept_groups"] == B or r["dynamic_sampling/exhausted"] == 1
        assert r["loss/denominator"] == r["dynamic_sampling/kept_groups"] * G - r["overlong/filtered"]
    assert any(r["dynamic_sampling/kept_groups"] == B for r in rl) and any(r["dynamic_sampling/rounds"] > 1 for r in rl)
    (final,) = (out / "checkpoints").glob("step_*")  # the sampler position a resume starts from (rank 0 writes it)
    sampler = torch.load(final / "common.pt", weights_only=False)["extra"]["sampler"]
    drawn = sum(r["dynamic_sampling/prompts_drawn"] for r in rl)  # every round's prompts counted
    assert sampler["epoch"] * 16 + sampler["cursor"] == drawn > 3 * B
