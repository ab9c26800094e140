"""The headline training reward cannot flatter a pruned run (docs/algorithms.md, "Metrics"): ``reward/mean`` of a
DPPO run is the Horvitz-Thompson estimate over ALL drawn prompts, recomputed here from the audit trail (a
generated prompt's mean reward weighted 1/pi_q, a pruned prompt 0, over B); the raw mean over generated
completions is ``reward/mean_generated``. With r_q = 0 nothing is pruned at the prompt level and the two are the
plain mean over the B x G completions."""
from __future__ import annotations

import json

import pytest
from _e2e_helpers import read_metrics, run_cli, tiny_config, write_config


def _run(tmp_path, name, r_q):
    out = tmp_path / name
    cfg = tiny_config(out, algo={"pruner": "dppo", "r_q": r_q, "r_o": 0.5},
                      reward={"fn": "tests.e2e._rewards:solved_or_parity", "isolation": "inline"},
                      train={"steps": 6, "sft_steps": 0}, eval={"every": 0}, checkpoint={"every": 0},
                      logging={"audit_log": True})
    run_cli(write_config(tmp_path / f"{name}.yaml", cfg))
    rl = {r["step"]: r for r in read_metrics(out) if r["phase"] == "rl"}
    audit: dict[int, list[dict]] = {}
    for line in (out / "audit.jsonl").read_text().splitlines():
        rec = json.loads(line)
        audit.setdefault(rec["step"], []).append(rec)
    return rl, audit


def _means(prompts: list[dict]) -> tuple[float, float]:
    """(Horvitz-Thompson mean over the drawn prompts, raw mean over the generated completions)."""
    generated = [p for p in prompts if p["prompt_kept"]]
    ht = sum(p["prompt_weight"] * sum(p["rewards"]) / len(p["rewards"]) for p in generated) / len(prompts)
    raw = sum(sum(p["rewards"]) for p in generated) / sum(len(p["rewards"]) for p in generated)
    return ht, raw


def test_dppo_headline_reward_is_the_horvitz_thompson_estimate(tmp_path):
    rl, audit = _run(tmp_path, "dppo", r_q=0.5)
    pruned_steps = 0
    for step, prompts in audit.items():
        ht, raw = _means(prompts)
        assert rl[step]["reward/mean"] == pytest.approx(ht, abs=1e-9)
        assert rl[step]["reward/mean_generated"] == pytest.approx(raw, abs=1e-6)  # a float32 mean
        if not all(p["prompt_kept"] for p in prompts):
            pruned_steps += 1
            assert rl[step]["prune/prompt_kept_fraction"] < 1.0
            assert all(p["prompt_weight"] == pytest.approx(2.0) or p["prompt_weight"] == 1.0
                       for p in prompts if p["prompt_kept"])
    # the property was exercised: prompts were pruned, and there the estimate differs from the raw mean
    assert pruned_steps >= 2, "no prompt-level pruning happened; the test proves nothing"
    assert any(abs(rl[s]["reward/mean"] - rl[s]["reward/mean_generated"]) > 1e-6 for s in audit)


def test_no_prompt_pruning_gives_the_plain_mean(tmp_path):
    rl, audit = _run(tmp_path, "dppo_rq0", r_q=0.0)
    for step, prompts in audit.items():
        assert all(p["prompt_kept"] and p["prompt_weight"] == 1.0 for p in prompts)
        rewards = [r for p in prompts for r in p["rewards"]]
        assert len(rewards) == 8 * 4  # B x G: every drawn completion was generated
        assert rl[step]["reward/mean"] == pytest.approx(sum(rewards) / len(rewards), abs=1e-12)
        assert rl[step]["reward/mean"] == pytest.approx(rl[step]["reward/mean_generated"], abs=1e-6)
