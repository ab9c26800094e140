"""docs/algorithms.md invariant 1, end to end: DPPO with r_q = r_o = 0 produces exactly the weights of plain GRPO-family
training (pruner none) after a few steps with the same seeds: same samples, same advantages, weights 1, same
denominator, same updates, bit for bit."""
from __future__ import annotations

import pytest
import torch
from _e2e_helpers import checkpoint_tensors, latest_checkpoint, read_metrics, run_cli, tiny_config, write_config


def _run(tmp_path, name, preset, algo):
    out = tmp_path / name
    cfg = tiny_config(out, algo=algo, loss={"preset": preset, "kl_coef": 0.0},
                      train={"steps": 3, "sft_steps": 0}, eval={"every": 0}, checkpoint={"every": 0})
    run_cli(write_config(tmp_path / f"{name}.yaml", cfg))
    rl = [r for r in read_metrics(out) if r["phase"] == "rl"]
    return rl, checkpoint_tensors(latest_checkpoint(out))


@pytest.mark.parametrize("preset, keep", [("grpo", "uniform"), ("grpo", "optimal"),
                                          pytest.param("dapo", "uniform", marks=pytest.mark.slow),
                                          pytest.param("dr_grpo", "uniform", marks=pytest.mark.slow)])
def test_dppo_with_zero_rates_equals_no_pruning(tmp_path, preset, keep):
    base, w_base = _run(tmp_path, "none", preset, {"pruner": "none"})
    dppo, w_dppo = _run(tmp_path, "dppo0", preset, {"pruner": "dppo", "r_q": 0.0, "r_o": 0.0, "dppo_keep": keep})

    assert all(r["train/grad_norm"] > 0 for r in base)  # the runs really trained
    for a, b in zip(base, dppo):
        assert b["prune/total_kept_fraction"] == 1.0 and b["prune/total_ess"] == a["prune/total_ess"]
        for key in ("reward/mean", "loss/denominator", "train/loss", "train/grad_norm", "train/tokens"):
            assert a[key] == b[key], (key, a[key], b[key])
    assert sorted(w_base) == sorted(w_dppo)
    different = [k for k in w_base if not torch.equal(w_base[k], w_dppo[k])]
    assert not different, different
