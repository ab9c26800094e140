"""``algo.dppo_keep=posterior`` and ``train.cpu_budget_s`` in real runs.

* Every prompt-level decision of a run is the prompt posterior's (``algo.prompt_posterior``) built from the run's
  own generated groups: rebuilt from the audit trail (raw rewards of every generated group, dated by the step),
  its keep probabilities equal the ones the trainer drew with, to float precision, at every step.
* DP2 (2 processes): a crash right after a checkpoint, then resume == the straight run, bit for bit (metrics,
  audit trail, every tensor): the posterior is checkpointed and restored on every rank.
* A CPU budget stops the RL phase where its CPU seconds run out, evaluates the last step and at the crossings of
  eval.every_cpu_s, agrees across 2 ranks, and survives a resume (the seconds spent are in the checkpoint).
"""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from _e2e_helpers import (
    checkpoint_tensors,
    latest_checkpoint,
    read_metrics,
    run_cli,
    stable_metrics,
    tiny_config,
    write_config,
)

from megatron_dppo.algo.prompt_posterior import PromptPosterior, keep_probabilities

POSTERIOR = {"pruner": "dppo", "dppo_keep": "posterior", "r_q": 0.5, "r_o": 0.5, "posterior_max_weight": 4.0}


def _audit(out) -> dict[int, list[dict]]:
    steps: dict[int, list[dict]] = {}
    for line in (out / "audit.jsonl").read_text().splitlines():
        rec = json.loads(line)
        steps.setdefault(rec["step"], []).append(rec)
    return steps


def test_every_prompt_decision_is_the_posterior_of_the_generated_groups(tmp_path):
    out = tmp_path / "posterior"
    cfg = tiny_config(out, algo=POSTERIOR, reward={"fn": "tests.e2e._rewards:solved_or_parity", "isolation": "inline"},
                      train={"steps": 8}, eval={"every": 0}, checkpoint={"every": 0},
                      logging={"audit_log": True})
    run_cli(write_config(tmp_path / "posterior.yaml", cfg))
    audit, rl = _audit(out), {r["step"]: r for r in read_metrics(out) if r["phase"] == "rl"}
    assert sorted(audit) == list(range(8))

    posterior = PromptPosterior(4, estimator="grpo", gamma=1.0)  # the run's: G = 4, std-GRPO, gamma 1
    seen, spread = set(), 0
    for step in range(8):
        drawn = audit[step]
        pi = torch.tensor([p["prompt_prob"] for p in drawn], dtype=torch.float64)
        expected = keep_probabilities(posterior.scores([p["prompt_id"] for p in drawn], step), 0.5, 4.0)
        assert torch.allclose(pi, expected, rtol=0, atol=1e-12), (step, pi, expected)
        assert abs(float(pi.sum()) - 0.5 * len(drawn)) < 1e-9 and float(pi.min()) >= 0.25 - 1e-12
        spread += float(pi.max() - pi.min()) > 0.05
        generated = [p for p in drawn if p["prompt_kept"]]
        for p in generated:
            assert p["prompt_weight"] == pytest.approx(1.0 / p["prompt_prob"], rel=1e-6)
            for a, keep in zip(p["advantages"], p["keep"]):
                assert not (a == 0 and keep)  # the completion level is the optimal rule's: A = 0 is free
        posterior.update([p["prompt_id"] for p in generated], torch.tensor([p["rewards"] for p in generated]),
                         step, lengths=torch.tensor([p["lengths"] for p in generated], dtype=torch.float64))
        seen |= {p["prompt_id"] for p in generated}
        assert rl[step]["posterior/prompts"] == len(seen) == rl[step]["history/prompts_seen"]
        assert rl[step]["posterior/discount"] == posterior.discount()
    assert spread >= 2  # the posterior did tell prompts apart (constant groups come back less often)


@pytest.mark.multiproc
@pytest.mark.parametrize("screen", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_posterior_dp2_resume_equals_straight_run(tmp_path, screen):
    straight = tmp_path / "straight"
    algo = {**POSTERIOR, "screen_k": 2, "screen_continue_fraction": 0.6} if screen else POSTERIOR
    sections = {"parallel": {"tp": 1}, "algo": algo, "logging": {"audit_log": True}}
    proc = run_cli(write_config(tmp_path / "run.yaml", tiny_config(straight, **sections)), nproc=2)
    assert "world 2 (tp 1, pp 1, dp 2)" in proc.stdout
    records = read_metrics(straight)
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    # the first visits see the prior only (equal scores: every pi = 1 - r_q); from step 2 on prompts come back
    # and the posterior tells them apart
    audit = _audit(straight)
    if not screen:
        assert all(p["prompt_prob"] == 0.5 for s in (0, 1) for p in audit[s])
    assert len({round(p["prompt_prob"], 9) for s in (2, 3) for p in audit[s]}) > 1

    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000006")
    (resumed / "checkpoints" / "latest").write_text("step_00000004\n")
    proc = run_cli(write_config(tmp_path / "resumed.yaml", tiny_config(resumed, **sections)), nproc=2)
    assert "resumed from" in proc.stdout and "RL step 2" in proc.stdout
    assert stable_metrics(read_metrics(resumed)) == stable_metrics(records)
    assert (resumed / "audit.jsonl").read_text() == (straight / "audit.jsonl").read_text()
    a, b = checkpoint_tensors(latest_checkpoint(straight)), checkpoint_tensors(latest_checkpoint(resumed))
    assert sorted(a) == sorted(b) and not [k for k in a if not torch.equal(a[k], b[k])]


def _check_budget(out, budget: float, every: float) -> list[dict]:
    """The RL steps of ``out`` stop at the first that spends ``budget`` CPU seconds; evaluations before the first
    step, at each step that crosses a multiple of ``every``, and after the last."""
    records = read_metrics(out)
    rl = [r for r in records if r["phase"] == "rl"]
    assert [r["step"] for r in rl] == list(range(len(rl)))
    cum = [0.0]
    for r in rl:
        cum.append(cum[-1] + r["time/step_cpu"])
    assert cum[-2] < budget <= cum[-1], cum
    due = [-1] + [i for i in range(len(rl)) if math.floor(cum[i + 1] / every) > math.floor(cum[i] / every)]
    if due[-1] != len(rl) - 1:
        due.append(len(rl) - 1)
    assert [r["step"] for r in records if r["phase"] == "eval"] == due
    return rl


def test_a_step_is_charged_its_whole_cpu_time_reward_workers_included(tmp_path):
    """time/step_cpu (what train.cpu_budget_s charges) is the whole step's CPU time: the work outside the timed
    phases (advantages, batch building, the gradient audit) and the CPU of child processes, here the persistent
    workers of a process-isolated reward that spins 50 ms per sample. It used to be the timed phases only."""
    out = tmp_path / "run"
    sections = {"reward": {"fn": "tests.e2e._rewards:burns_cpu", "isolation": "process"},
                "train": {"steps": 2, "sft_steps": 0}, "eval": {"every": 0}, "checkpoint": {"every": 0},
                "logging": {"audit_every": 1}}
    run_cli(write_config(tmp_path / "run.yaml", tiny_config(out, **sections)))
    first = [r for r in read_metrics(out) if r["phase"] == "rl"][0]
    phases = sum(v for k, v in first.items() if k.startswith("time_cpu/"))
    # step 0 scores all 8 x 4 completions (no prompt history yet): >= 1.6 CPU s in the reward worker
    assert first["time/step_cpu"] - phases >= 1.5, (first["time/step_cpu"], phases)


@pytest.mark.multiproc
def test_cpu_budget_stops_the_run_evaluates_at_equal_compute_and_resumes(tmp_path):
    out, budget, every = tmp_path / "budget", 1.5, 0.6
    sections = {"parallel": {"tp": 1}, "train": {"steps": 60, "cpu_budget_s": budget},
                "eval": {"every": 0, "every_cpu_s": every}, "checkpoint": {"every": 3}}
    config = write_config(tmp_path / "budget.yaml", tiny_config(out, **sections))
    run_cli(config, nproc=2)  # the ranks agree when to stop (time/step_cpu is summed over them), or this hangs
    rl = _check_budget(out, budget, every)
    assert 3 < len(rl) < 60

    # the same command again: nothing left to do
    proc = run_cli(config, nproc=2)
    assert "already spent train.cpu_budget_s" in proc.stdout
    assert len([r for r in read_metrics(out) if r["phase"] == "rl"]) == len(rl)

    # a crash after the first RL checkpoint (2 warm-start steps + 3 RL steps): the resumed run counts the CPU
    # seconds spent before it
    resumed = tmp_path / "resumed"
    shutil.copytree(out, resumed)
    for ckpt in (resumed / "checkpoints").glob("step_*"):
        if ckpt.name != "step_00000005":
            shutil.rmtree(ckpt)
    (resumed / "checkpoints" / "latest").write_text("step_00000005\n")
    proc = run_cli(write_config(tmp_path / "resumed.yaml", tiny_config(resumed, **sections)), nproc=2)
    assert "RL step 3" in proc.stdout
    _check_budget(resumed, budget, every)


def test_screening_run_continues_by_the_rule_and_weights_by_both_coins(tmp_path):
    """algo.screen_k=2 of G=4: every prompt kept at the prompt level gets a screen of 2; the continuation
    probabilities are the rule's (``algo.screening``) on the posterior rebuilt from the audit trail (full groups,
    then the screens that were not continued) and the screens; a continued prompt trains its whole group (the
    screen first) with the weight 1/(pi_q pi_c); token_mean is refused."""
    from megatron_dppo.algo.screening import continuation_probabilities, continuation_scores

    out = tmp_path / "screen"
    algo = {**POSTERIOR, "screen_k": 2, "screen_continue_fraction": 0.5}
    cfg = tiny_config(out, algo=algo, reward={"fn": "tests.e2e._rewards:solved_or_parity", "isolation": "inline"},
                      train={"steps": 6}, eval={"every": 0}, checkpoint={"every": 0}, logging={"audit_log": True})
    run_cli(write_config(tmp_path / "screen.yaml", cfg))
    audit, rl = _audit(out), {r["step"]: r for r in read_metrics(out) if r["phase"] == "rl"}
    posterior = PromptPosterior(4, estimator="grpo", gamma=1.0)
    continued_total = stopped_total = 0
    for step in range(6):
        drawn = audit[step]
        ids = [p["prompt_id"] for p in drawn]
        pi_q = keep_probabilities(posterior.scores(ids, step), 0.5, 4.0)
        screened = [i for i, p in enumerate(drawn) if "screen_rewards" in p]
        assert screened and all(len(drawn[i]["screen_rewards"]) == 2 for i in screened)
        alpha, beta = posterior.beta_parameters([ids[i] for i in screened], step)
        screen = torch.tensor([drawn[i]["screen_rewards"] for i in screened], dtype=torch.float64)
        pi_c = continuation_probabilities(continuation_scores(screen, alpha, beta, posterior.curve),
                                          torch.ones(len(screened), dtype=torch.bool), 0.5, 4.0)
        assert torch.allclose(torch.tensor([drawn[i]["continue_prob"] for i in screened], dtype=torch.float64),
                              pi_c, rtol=0, atol=1e-12)
        assert abs(float(pi_c.sum()) - 0.5 * len(screened)) < 1e-9 and float(pi_c.min()) >= 0.25 - 1e-12
        for j, i in enumerate(screened):
            p = drawn[i]
            assert p["prompt_prob"] == pytest.approx(float(pi_q[i] * pi_c[j]), abs=1e-12)
            if p["prompt_kept"]:  # continued: the full group, the screen first
                assert len(p["rewards"]) == 4 and p["rewards"][:2] == p["screen_rewards"]
                assert p["prompt_weight"] == pytest.approx(1.0 / p["prompt_prob"], rel=1e-6)
        for i, p in enumerate(drawn):
            if i not in screened:  # pruned at the prompt level: never screened
                assert not p["prompt_kept"] and p["prompt_prob"] == pytest.approx(float(pi_q[i]), abs=1e-12)
        full = [p for p in drawn if p["prompt_kept"]]
        stopped = [drawn[i] for i in screened if not drawn[i]["prompt_kept"]]
        continued_total, stopped_total = continued_total + len(full), stopped_total + len(stopped)
        if full:
            posterior.update([p["prompt_id"] for p in full], torch.tensor([p["rewards"] for p in full]), step,
                             lengths=torch.tensor([p["lengths"] for p in full], dtype=torch.float64))
        if stopped:
            posterior.update([p["prompt_id"] for p in stopped], torch.tensor([p["screen_rewards"] for p in stopped]),
                             step, lengths=torch.tensor([p["screen_lengths"] for p in stopped], dtype=torch.float64))
        assert rl[step]["screen/screened"] == len(screened) and rl[step]["screen/continued"] == len(full)
    assert continued_total > 0 and stopped_total > 0

    refused = run_cli(write_config(tmp_path / "tm.yaml", tiny_config(tmp_path / "tm", algo=algo, loss={
        "preset": "grpo", "kl_coef": 0.0, "aggregation": "token_mean"})), check=False)
    assert refused.returncode != 0 and "algo.screen_k=2" in refused.stderr and "token_mean" in refused.stderr


def test_cost_budget_plans_the_rates_of_each_step(tmp_path):
    """algo.cost_budget=0.5: after 3 steps at the configured rates, every step logs a plan at the budget and runs
    at its rates (the completion level alone where generation is cheap, as on this CPU run)."""
    out = tmp_path / "plan"
    cfg = tiny_config(out, algo={**POSTERIOR, "cost_budget": 0.5}, train={"steps": 6}, eval={"every": 0},
                      checkpoint={"every": 0}, logging={"audit_log": True})
    run_cli(write_config(tmp_path / "plan.yaml", cfg))
    rl = [r for r in read_metrics(out) if r["phase"] == "rl"]
    assert not any("plan/r_q" in r for r in rl[:3]) and all("plan/r_q" in r for r in rl[3:])
    audit = _audit(out)
    for r in rl[3:]:
        assert r["plan/cost_fraction"] <= 0.5 + 1e-9 and 0.0 <= r["plan/r_q"] < 1.0 and 0.0 <= r["plan/r_o"] < 1.0
        if r["plan/generation_share"] <= 1 / 3:
            assert r["plan/r_q"] == 0.0
        pi = [p["prompt_prob"] for p in audit[r["step"]]]
        assert sum(pi) == pytest.approx((1 - r["plan/r_q"]) * len(pi), abs=1e-9)  # the step ran at the plan
