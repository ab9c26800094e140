"""`megatron-dppo train` under torchrun with parallel.cp=2: the whole step (rollouts, rewards, pruning, packing,
old log-probs, update) matches the same run at cp=1 (dp=2 on the same 2 processes, so the rollouts are the same)."""
from __future__ import annotations

import pytest
from _e2e_helpers import read_metrics, run_cli, tiny_config, write_config

pytestmark = [pytest.mark.multiproc, pytest.mark.slow]

EXACT = ("reward/mean", "reward/std", "prune/completion_kept", "prune/prompt_kept", "train/tokens",
         "train/sequences", "train/clip_fraction", "loss/denominator")
CLOSE = ("train/loss", "train/grad_norm", "train/entropy", "train/ratio")


def test_cp2_run_matches_cp1(tmp_path):
    runs = {}
    for cp in (1, 2):
        out = tmp_path / f"cp{cp}"
        # no warm start: both runs start from the same initial weights; two RL steps (the second step's rollouts and
        # loss come from the weights the first update left, so they agree only if the update did)
        cfg = tiny_config(out, parallel={"cp": cp}, train={"steps": 2, "sft_steps": 0}, eval={"every": 0})
        proc = run_cli(write_config(tmp_path / f"cp{cp}.yaml", cfg), nproc=2)
        assert (", cp 2, dp 1)" if cp == 2 else "(tp 1, pp 1, dp 2)") in proc.stdout
        runs[cp] = [r for r in read_metrics(out) if r["phase"] == "rl"]
    assert [r["step"] for r in runs[2]] == [r["step"] for r in runs[1]] == [0, 1]
    for one, two in zip(runs[1], runs[2]):
        for key in EXACT:
            assert two[key] == one[key], key
        for key in CLOSE:
            assert two[key] == pytest.approx(one[key], rel=1e-5, abs=1e-9), key
