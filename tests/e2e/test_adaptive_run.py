"""``algo.pruner=adaptive`` in a real run: groups of unequal size are generated, packed and trained.

From the audit trail of a tiny run (B = 8 prompts x G = 4 slots): every generated prompt has n_q in [2, 4]
completions in its chosen slots, the sizes differ within a step, the advantages are rloo over the generated
completions only (the placeholders take no part), each trained sequence carries the weight G/(n_q pi_q), and every
step trains (the variable-size groups pack and go through the engine's update).
"""
from __future__ import annotations

import json

import pytest
import torch
from _e2e_helpers import read_metrics, run_cli, tiny_config, write_config

from megatron_dppo.algo.advantages import compute_advantages

ADAPTIVE = {"pruner": "adaptive", "adaptive_budget": 0.6, "adaptive_generation_share": 0.5, "adaptive_signal": 1.0,
            "posterior_max_weight": 4.0}  # signal 1: sizes 2-4 here (at the default 0.3 this run gives one size)


def test_variable_size_groups_are_generated_packed_and_trained(tmp_path):
    out = tmp_path / "adaptive"
    cfg = tiny_config(out, algo=ADAPTIVE, loss={"preset": "grpo", "kl_coef": 0.0, "advantage_estimator": "rloo"},
                      reward={"fn": "tests.e2e._rewards:solved_or_parity", "isolation": "inline"},
                      train={"steps": 4}, eval={"every": 0}, checkpoint={"every": 0}, logging={"audit_log": True})
    run_cli(write_config(tmp_path / "adaptive.yaml", cfg))
    records = [json.loads(line) for line in (out / "audit.jsonl").read_text().splitlines()]
    rl = [r for r in read_metrics(out) if r["phase"] == "rl"]
    assert len(rl) == 4 and all(r["tokens/trained_sequences"] > 0 for r in rl)
    sizes_seen = set()
    for step in range(4):
        drawn = [r for r in records if r["step"] == step]
        assert len(drawn) == 8 and all(r["prompt_prob"] >= 0.25 - 1e-9 for r in drawn)
        sizes = []
        for r in (r for r in drawn if r["prompt_kept"]):
            generated = torch.tensor(r["generated"])
            n = int(generated.sum())
            assert 2 <= n <= 4
            sizes.append(n)
            rewards = torch.tensor(r["rewards"])[generated]
            expected = compute_advantages(rewards.unsqueeze(0), "rloo", eps=0.0)[0]
            assert torch.allclose(torch.tensor(r["advantages"])[generated], expected, atol=1e-6)
            assert not any(a for a, g in zip(r["advantages"], r["generated"]) if not g)  # placeholders: A = 0
            assert r["keep"] == r["generated"]  # every generated completion trains, no placeholder does
            for w, g in zip(r["weight"], r["generated"]):
                assert w == pytest.approx(4 / (n * r["prompt_prob"]) if g else 0.0, rel=1e-5)
        sizes_seen |= set(sizes)
        assert rl[step]["adaptive/expected_samples"] <= 0.6 * 8 * 4 + 1e-6  # the budget (no filter: 1 a completion)
    assert len(sizes_seen) > 1, "every group had the same size: nothing variable was exercised"
