"""Fast checks of the trainer's plumbing: pass@k, the metrics sink's resume truncation, sharding helpers, seeds,
loss presets with overrides, and the stop-signal handler."""
from __future__ import annotations

import itertools
import math
import os
import signal

import pytest

from megatron_dppo.config import load_config
from megatron_dppo.distributed import collectives as D
from megatron_dppo.run.metrics import MetricsSink, pass_at_k, read_jsonl


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 2, 2), (5, 3, 2), (6, 1, 4), (6, 6, 3), (3, 1, 3)])
def test_pass_at_k_is_the_probability_that_k_of_n_samples_contain_a_correct_one(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    brute = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert math.isclose(pass_at_k(n, c, k), brute, rel_tol=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    with pytest.raises(ValueError, match="n=2, c=3"):
        pass_at_k(2, 3, 1)
    with pytest.raises(ValueError, match="k=3"):
        pass_at_k(2, 1, 3)


def test_metrics_sink_resume_keeps_exactly_the_records_before_the_resume_point(tmp_path):
    sink = MetricsSink(tmp_path, enabled=True, tensorboard=False)
    sink.open()
    for s in range(3):
        sink.log(s, {"sft/nll": 1.0 / (s + 1)}, phase="sft")
    sink.log(-1, {"eval/x/pass@1": 0.25}, phase="eval")  # before the first RL step
    for s in range(4):
        sink.log(s, {"reward/mean": s / 10})
        if s % 2:
            sink.log(s, {"eval/x/pass@1": 0.5}, phase="eval")
    sink.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "phase": "rl", "rew')  # a line torn by a crash
    resumed = MetricsSink(tmp_path, enabled=True, tensorboard=False)
    resumed.open(resume_key=(1, 2))  # resume at RL step 2
    resumed.close()
    kept = [(r["phase"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")]
    assert kept == [("sft", 0), ("sft", 1), ("sft", 2), ("eval", -1), ("rl", 0), ("rl", 1), ("eval", 1)]
    at_rl0 = MetricsSink(tmp_path, enabled=True, tensorboard=False)
    at_rl0.open(resume_key=(1, 0))  # resumed right after the warm start: the step -1 evaluation runs again
    at_rl0.close()
    assert [(r["phase"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [("sft", 0), ("sft", 1),
                                                                                         ("sft", 2)]
    during_sft = MetricsSink(tmp_path, enabled=True, tensorboard=False)
    during_sft.open(resume_key=(0, 1))
    during_sft.close()
    assert [(r["phase"], r["step"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [("sft", 0)]
    fresh = MetricsSink(tmp_path, enabled=True, tensorboard=False)
    fresh.open()
    fresh.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def test_disabled_sink_writes_nothing(tmp_path):
    sink = MetricsSink(tmp_path / "x", enabled=False)
    sink.open()
    sink.log(0, {"a": 1.0})
    sink.close()
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("n,shards", [(0, 3), (1, 2), (7, 3), (8, 4), (10, 1)])
def test_shard_bounds_cover_everything_once_in_order(n, shards):
    bounds = [D.shard_bounds(n, shards, i) for i in range(shards)]
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
    sizes = [b - a for a, b in bounds]
    assert max(sizes) - min(sizes) <= 1


def test_map_sharded_single_process_keeps_order_and_checks_counts():
    assert D.map_sharded(lambda xs, i: [x * 2 for x in xs], [1, 2, 3]) == [2, 4, 6]
    with pytest.raises(ValueError, match="returned 1 results for 3 items"):
        D.map_sharded(lambda xs, i: [0], [1, 2, 3])


def test_decision_seeds_are_stable_and_distinct():
    assert D.derive_seed(1, 2, "prompts") == D.derive_seed(1, 2, "prompts")
    seeds = {D.derive_seed(s, t, tag) for s in (1, 2) for t in range(5) for tag in ("prompts", "completions")}
    assert len(seeds) == 20


def test_loss_preset_with_overrides():
    from megatron_dppo.run.build import build_loss

    cfg = load_config(None, ["data.task=arithmetic", "model.hf_config.model_type=qwen2", "loss.preset=dapo",
                             "loss.eps_high=0.3", "loss.advantage_estimator=rloo"])
    loss, estimator = build_loss(cfg)
    assert loss.aggregation == "token_mean" and loss.eps_high == 0.3 and loss.eps_low == 0.2
    assert estimator == "rloo"
    loss, estimator = build_loss(load_config(None, ["data.task=arithmetic", "model.hf_config.model_type=qwen2",
                                                    "loss.preset=dr_grpo"]))
    assert loss.aggregation == "seq_mean_token_sum_norm" and estimator == "dr_grpo"


def test_stop_signals_set_a_flag_and_restore_the_handlers():
    from megatron_dppo.run.lifecycle import StopSignals

    previous = signal.getsignal(signal.SIGUSR1)
    with StopSignals() as stop:
        assert stop.poll() is None
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.poll() == signal.SIGUSR1 and stop.received == signal.SIGUSR1
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_a_job_script_stop_file_stops_with_code_zero(tmp_path, monkeypatch):
    """slurm/train.sbatch asks for a checkpoint-and-stop by creating $DPPO_STOP_FILE (no signal to the ranks)."""
    from megatron_dppo.run.lifecycle import STOP_REQUESTED, StopSignals

    stop_file = tmp_path / "stop"
    monkeypatch.setenv("DPPO_STOP_FILE", str(stop_file))
    with StopSignals() as stop:
        assert stop.poll() is None
        stop_file.touch()
        assert stop.poll() == STOP_REQUESTED == 0 and stop.received is None


def test_phase_timer_counts_cpu_seconds_of_work_not_of_waiting():
    """time/step_cpu's source: a busy phase costs about its wall time in CPU seconds, a sleeping one about none."""
    import time

    from megatron_dppo.run.metrics import PhaseTimer

    timer = PhaseTimer()
    with timer("sleep"):
        time.sleep(0.3)
    assert timer.cpu_seconds < 0.1
    with timer("busy"):  # spin until this process has used 0.25 CPU s (however loaded the machine is)
        start = time.process_time()  # read after the timer's own start, so the timer sees at least these 0.25 s
        while time.process_time() - start < 0.25:
            pass
    # (process_time counts every thread of the process, so the busy phase's wall time is not a bound on it)
    assert timer.cpu_seconds >= 0.25
    m = timer.as_metrics()
    assert m["time/step"] >= 0.3
    # per phase too: the busy phase holds the CPU seconds, the sleeping one almost none, and they add up
    assert m["time_cpu/busy"] >= 0.25 and m["time_cpu/sleep"] < 0.1
    assert abs(m["time_cpu/busy"] + m["time_cpu/sleep"] - timer.cpu_seconds) < 1e-9


def test_a_step_cpu_clock_counts_untimed_work_and_child_processes():
    """What train.cpu_budget_s charges (``step_cpu_seconds``): this process's CPU outside any phase, a child that
    ended and a child still alive (a persistent reward worker, a tool's sandbox) all count."""
    import subprocess
    import sys
    import time

    from megatron_dppo.run.metrics import PhaseTimer

    spin = "import time\ns = time.process_time()\nwhile time.process_time() - s < 0.3: pass\n"
    timer = PhaseTimer()
    start = time.process_time()
    while time.process_time() - start < 0.2:  # outside any phase
        pass
    subprocess.run([sys.executable, "-c", spin], check=True)  # a child that ends (and is waited for)
    live = subprocess.Popen([sys.executable, "-c", spin + "print('done', flush=True)\ntime.sleep(60)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert live.stdout.readline().strip() == "done"  # it spent its 0.3 s and lives on
        assert timer.cpu_seconds == 0.0 and timer.step_cpu_seconds() >= 0.2 + 0.3 + 0.3
    finally:
        live.kill()
        live.wait()


def test_the_time_per_phase_panel_stacks_the_phases_not_their_totals():
    """time/step_cpu (the CPU seconds of the whole step) was stacked on top of the phases it sums, so every bar of
    the dashboard's time panel was about twice the step; the panel stacks the phases only."""
    from megatron_dppo.run.metrics import phase_keys

    records = [{"step": s, "phase": "rl", "time/step": 1.0, "time/step_cpu": 1.9, "time/generate": 0.3,
                "time/reward": 0.1, "time/train": 0.5, "time/weight_sync": 0.05} for s in range(3)]
    phases = phase_keys(records)
    assert phases == ["time/generate", "time/reward", "time/train", "time/weight_sync"]
    assert all(sum(r[k] for k in phases) <= r["time/step"] for r in records)


def test_a_checkpoint_prompt_state_of_the_other_kind_starts_a_fresh_one():
    """A warm start (or a run before algo.dppo_keep=posterior) saved a PromptHistory: the posterior run starts a
    fresh posterior from it (warning only when the saved state held prompts); the same kind is restored exactly."""
    import torch

    from megatron_dppo.algo.prompt_history import PromptHistory
    from megatron_dppo.algo.prompt_posterior import PromptPosterior
    from megatron_dppo.algo.pruner import DPPO, KeepAll, PrunerContext
    from megatron_dppo.algo.pruning import DPPOPruner
    from megatron_dppo.run.lifecycle import restore_prompt_state

    context = PrunerContext(group_size=4, prompts_per_step=2)
    posterior = DPPO(DPPOPruner(0.5, 0.5, keep="posterior"), PromptPosterior(4), context)
    restore_prompt_state(posterior, PromptHistory().state_dict())  # a warm start's: empty, silent
    assert len(posterior.state) == 0
    history = PromptHistory()
    history.update([1, 2], torch.tensor([[1.0, -1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))
    with pytest.warns(UserWarning, match="starts it fresh"):
        restore_prompt_state(posterior, history.state_dict())
    assert len(posterior.state) == 0
    posterior.state.update([1, 2], torch.tensor([[1.0, 0.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]), step=3)
    again = DPPO(DPPOPruner(0.5, 0.5, keep="posterior"), PromptPosterior(4), context)
    restore_prompt_state(again, posterior.state_dict())
    assert again.state_dict() == posterior.state_dict()
    restored_history = KeepAll(PromptHistory(), context)
    restore_prompt_state(restored_history, history.state_dict())
    assert restored_history.state_dict() == history.state_dict()
