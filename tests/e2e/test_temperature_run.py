"""A whole run at rollout.temperature = 0.7 (docs/algorithms.md, "Temperature and truncated sampling"): the rollout
engine samples from the tempered policy and the trainer computes the tempered policy, so the weight-sync health check
rollout/logprob_abs_diff stays at float32 noise on every RL step (before, the trainer computed temperature-1
log-probs and compared them with the engine's temperature-1 ones: a policy nobody sampled from). The warm start
trains the NLL of the gold answers at temperature 1 whatever rollout.temperature is: its metrics equal a run at
rollout.temperature = 1 bit for bit."""
from __future__ import annotations

from _e2e_helpers import read_metrics, run_cli, tiny_config, write_config

FLOAT32_NOISE = 1e-5


def _run(tmp_path, name, temperature, steps):
    out = tmp_path / name
    cfg = tiny_config(out, rollout={"max_new_tokens": 4, "temperature": temperature},
                      train={"steps": steps, "sft_steps": 2}, eval={"every": 0}, checkpoint={"every": 0})
    run_cli(write_config(tmp_path / f"{name}.yaml", cfg))
    records = read_metrics(out)
    return [r for r in records if r["phase"] == "sft"], [r for r in records if r["phase"] == "rl"]


def test_tempered_run_matches_its_engine_and_warm_starts_at_temperature_one(tmp_path):
    sft, rl = _run(tmp_path, "t07", 0.7, steps=3)
    sft_t1, _ = _run(tmp_path, "t1", 1.0, steps=0)
    assert len(rl) == 3 and all(r["train/grad_norm"] > 0 for r in rl)
    diffs = [r["rollout/logprob_abs_diff"] for r in rl]
    assert max(diffs) < FLOAT32_NOISE, diffs
    assert len(sft) == len(sft_t1) == 2
    for a, b in zip(sft, sft_t1):
        for key in ("sft/nll", "sft/grad_norm"):
            assert a[key] == b[key], (key, a[key], b[key])
