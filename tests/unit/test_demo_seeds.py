"""benchmarks/demo_seeds.py (the demo over seeds): its summary of a run's metrics, and the README's table of what the
demo shows is the one its recorded runs give (docs/benchmarks/demo_seeds.json), not one trajectory."""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from benchmarks import demo_seeds  # noqa: E402


def _records(rewards, evals, nll=(4.0, 1.0)):
    out = [{"phase": "sft", "step": i, "sft/nll": x} for i, x in enumerate(nll)]
    out += [{"phase": "rl", "step": i, "reward/mean": x, "time/step_cpu": 0.5} for i, x in enumerate(rewards)]
    out += [{"phase": "eval", "step": s, "eval/arith/pass@1": x, "eval/arith/pass@4": 1.0} for s, x in evals]
    return out


def test_summary_is_first_and_last_ten_steps_and_first_and_last_evaluation():
    rewards = [0.1] * 10 + [0.5] * 10 + [0.3] * 10
    row = demo_seeds.summarize(_records(rewards[::-1], [(29, 0.4), (-1, 0.1), (9, 0.9)]))  # order does not matter
    assert row["ht_first10"] == pytest.approx(0.3) and row["ht_last10"] == pytest.approx(0.1)
    assert row["eval_first"] == 0.1 and row["eval_last"] == 0.4 and row["eval_rise"] == pytest.approx(0.3)
    assert row["rl_cpu_s"] == pytest.approx(15.0) and row["sft_nll_last"] == 1.0
    with pytest.raises(ValueError, match=">= 20 RL steps"):
        demo_seeds.summarize(_records([0.1] * 19, [(-1, 0.1), (18, 0.2)]))


def test_the_readme_states_the_recorded_spread_over_seeds():
    report = json.loads((REPO / "docs" / "benchmarks" / "demo_seeds.json").read_text())
    stats = demo_seeds.spread(report["rows"])
    section = (REPO / "README.md").read_text().split("## What the demo shows")[1].split("\n## ")[0]
    assert f"Over {len(report['rows'])} seeds" in section and len(report["rows"]) >= 5
    ht, ev = (stats[c] for c in ("ht_rise", "eval_rise"))
    assert f"{stats['ht_first10']['mean']:.2f} -> {stats['ht_last10']['mean']:.2f}" in section
    assert f"rise +{ht['min']:.2f} - +{ht['max']:.2f}, in every seed" in section and ht["min"] > 0
    assert f"{stats['eval_first']['mean']:.2f} -> {stats['eval_last']['mean']:.2f}" in section
    assert f"rise +{ev['min']:.2f} - +{ev['max']:.2f}, in every seed" in section and ev["min"] > 0
    # the demo the table describes is the shipped one: its seed among them, its evaluation size as recorded
    import yaml

    cfg = yaml.safe_load((REPO / "examples" / "quickstart.yaml").read_text())
    assert cfg["train"]["seed"] in [r["seed"] for r in report["rows"]]
    assert re.search(rf"from {cfg['eval']['max_prompts'] * cfg['eval']['samples']} fresh samples", section)
