"""``algo.dppo_keep=optimal`` in a real run (docs/algorithms.md, "Variance-optimal keep probabilities"), checked
from the audit trail: with no KL term a completion with A = 0 is never trained (its gradient is exactly zero), every
trained completion's weight is 1/(pi_q pi_i) with pi_i = clip(c |A| / pi_q, pi_min, 1) for one c per step, prompts
whose last group had one reward for all come back with probability pi_min at least, and the step line shows the
predicted relative variance next to the audit's measured cosine."""
from __future__ import annotations

import json

from _e2e_helpers import read_metrics, run_cli, tiny_config, write_config


def test_optimal_run_never_trains_zero_advantage_completions_and_reports_its_cost(tmp_path):
    out = tmp_path / "optimal"
    cfg = tiny_config(out, algo={"pruner": "dppo", "dppo_keep": "optimal", "r_q": 0.5, "r_o": 0.5, "keep_floor": 0.2},
                      reward={"fn": "tests.e2e._rewards:solved_or_parity", "isolation": "inline"},
                      train={"steps": 6, "sft_steps": 0}, eval={"every": 0}, checkpoint={"every": 0},
                      logging={"audit_log": True, "audit_every": 2, "print_every": 3})
    proc = run_cli(write_config(tmp_path / "optimal.yaml", cfg))
    rl = {r["step"]: r for r in read_metrics(out) if r["phase"] == "rl"}
    audit: dict[int, list[dict]] = {}
    for line in (out / "audit.jsonl").read_text().splitlines():
        rec = json.loads(line)
        audit.setdefault(rec["step"], []).append(rec)

    zero_advantage_seen = floored_prompts = 0
    for step, prompts in audit.items():
        generated = [p for p in prompts if p["prompt_kept"]]
        for p in generated:
            pi_q = 1.0 / p["prompt_weight"]
            assert pi_q >= 0.2 - 1e-6  # every seen prompt keeps at least the floor
            floored_prompts += abs(pi_q - 0.2) < 1e-6
            for a, keep, w in zip(p["advantages"], p["keep"], p["weight"]):
                if a == 0:
                    zero_advantage_seen += 1
                    assert not keep, (step, p["prompt_id"])  # exactly zero gradient: pruned for free
                elif keep:
                    pi_i = 1.0 / (w * pi_q)
                    assert 0.2 - 1e-5 <= pi_i <= 1.0 + 1e-5
        # one c per step: pi_i / (|A| / pi_q) is the same for every completion strictly between its bounds
        ratios = [(1.0 / (w / p["prompt_weight"])) / (abs(a) * p["prompt_weight"])
                  for p in generated for a, keep, w in zip(p["advantages"], p["keep"], p["weight"])
                  if keep and a != 0 and 0.2 + 1e-4 < 1.0 / (w / p["prompt_weight"]) < 1.0 - 1e-4]
        if len(ratios) > 1:
            assert max(ratios) - min(ratios) < 1e-4 * max(ratios), (step, ratios)
    assert zero_advantage_seen > 0 and floored_prompts > 0  # the test saw both cases

    assert all("prune/completion_predicted_rel_var" in r for r in rl.values())
    assert "audit/cosine" in rl[0] and "audit/cosine" in rl[2]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert any("predicted rel. var" in line and "audit cos" in line for line in lines), lines
