"""Multi-turn episodes through the whole trainer (the ``env`` section; docs/environments.md), through the CLI on the
tiny arithmetic run (a from-scratch 2-layer Qwen2 whose turns end at ``</s>`` about one time in five, so episodes
have one to three turns):

* ``noop`` with ``max_turns=1`` equals the single-turn run: every non-timing metric of every RL step and every
  evaluation is the same (the episode run only adds its env/* family);
* episodes train (observation tokens in the stream, loss-masked: tokens/trained_share < 1), the console line and
  the audit log report each episode's turns and finish reason, and a run killed with SIGKILL while its environments
  step (a turn in flight) resumes from its last checkpoint to exactly the straight run's metrics: nothing lost,
  nothing changed;
* environments and tools that hang or crash end only their episode (a hung ``step`` past env.step_timeout_s, a
  raising ``step`` or ``reset``: finish reason env_error) or become observations (the real python sandbox running
  an endless loop or aborting: tool_timeouts, tool_errors), and the run finishes every step;
* an environment whose ``reset`` returns messages (different ones for the G episodes of a prompt) trains on the
  prompt each episode was sampled from: the trainer's log-probs equal the engine's;
* separate placement: the rollout worker runs the episodes, and a fixed-staleness run resumed from a mid-run
  checkpoint (its in-flight batches of episodes saved with it) equals the straight run.

Each run takes 15-60 s on a shared 2-core machine."""
from __future__ import annotations

import json
import shutil

from _e2e_helpers import TINY_MODEL, read_metrics, run_cli, stable_metrics, tiny_config, write_config

ENV_FAMILY = ("env/", "tokens/trained_share", "tokens/episode_mean", "time/episode_")
TALK = {"name": "tests.e2e._envs:Talk", "max_turns": 3, "max_tokens": 24, "kwargs": {"turns": 3, "per_turn": 0.5}}


def _rl(records):
    return [r for r in records if r.get("phase") == "rl"]


def _without_env_family(records):
    return [{k: v for k, v in r.items() if not k.startswith(ENV_FAMILY)} for r in stable_metrics(records)]


def test_noop_one_turn_equals_the_single_turn_run(tmp_path):
    single, episodes = tmp_path / "single", tmp_path / "noop"
    run_cli(write_config(tmp_path / "a.yaml", tiny_config(single)))
    # env.max_tokens = rollout.max_new_tokens: the same bound on the sequence, so the same prompts fit
    run_cli(write_config(tmp_path / "b.yaml", tiny_config(episodes, env={"name": "noop", "max_turns": 1,
                                                                         "max_tokens": 4})))
    a, b = read_metrics(single), read_metrics(episodes)
    assert [r.get("phase") for r in a] == [r.get("phase") for r in b]
    assert _without_env_family(b) == stable_metrics(a)  # losses, grad norms, rewards, kept fractions, evaluations
    assert all(r["env/turns_mean"] == 1.0 and r["tokens/trained_share"] == 1.0 for r in _rl(b))
    assert not any(k.startswith("env/") for r in a for k in r)


def test_episodes_train_and_a_kill9_mid_episode_resumes_to_the_straight_run(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    cfg = dict(env=TALK, logging={"tensorboard": False, "progress_bar": False, "print_every": 1, "plot": False,
                                  "audit_log": True})
    proc = run_cli(write_config(tmp_path / "a.yaml", tiny_config(straight, **cfg)))
    assert "| turns " in proc.stdout and "| finish " in proc.stdout and "episode p50" in proc.stdout  # the console
    records = _rl(read_metrics(straight))
    assert len(records) == 4
    assert max(r["env/turns_mean"] for r in records) > 1.0  # some episodes went on after an observation
    assert min(r["tokens/trained_share"] for r in records) < 1.0  # observation tokens are in the streams, untrained
    assert all(r["tokens/trained_completion"] <= r["tokens/trained_sequences"] for r in records)
    audit = [json.loads(line) for line in (straight / "audit.jsonl").read_text().splitlines()]
    kept = [a for a in audit if a["prompt_kept"]]
    assert kept and all(len(a["turns"]) == len(a["finish_reasons"]) == len(a["rewards"]) for a in kept)
    assert {f for a in kept for f in a["finish_reasons"]} <= {"stop", "length", "max_turns", "context", "env_error"}
    assert any(t > 1 for a in kept for t in a["turns"])
    assert all(tr <= n for a in kept for tr, n in zip(a["trained"], a["lengths"]))

    config = write_config(tmp_path / "b.yaml", tiny_config(killed, **cfg))
    latest = killed / "checkpoints" / "latest"  # written after RL step 1: the kill comes in step 2, mid-episode
    first = run_cli(config, check=False, extra_env={"DPPO_TEST_KILL_WHEN": str(latest)})
    assert first.returncode == -9, first.stdout[-2000:] + first.stderr[-2000:]
    assert "SIGKILL mid-episode" in first.stdout
    assert len(_rl(read_metrics(killed))) == 2
    resumed = run_cli(config)
    assert "resuming" in resumed.stdout
    assert stable_metrics(read_metrics(killed)) == stable_metrics(read_metrics(straight))


def test_episodes_train_on_the_prompt_their_reset_messages_made(tmp_path):
    """An environment whose reset returns messages (each episode its own): the trainer's sequences start with the
    episode's re-rendered prompt, the one the engine sampled every turn from. The trainer's log-probs of the sampled
    tokens then equal the engine's to float32 noise (rollout/logprob_abs_diff); trained on the data set's prompt
    instead (the context the policy never saw) they differ by whole nats.

    Evaluation scores the rule alone: with a rule that is never satisfied, pass@1 is 0 although the environment
    rewards every turn with text (0.5 each: shaping counted as correctness would pass nearly every sample)."""
    out = tmp_path / "briefed"
    env = dict(TALK, name="tests.e2e._envs:Briefed", max_tokens=16)
    cfg = tiny_config(out, env=env, data={"template": "chat"}, train={"steps": 2}, rollout={"max_new_tokens": 8},
                      eval={"reward": "tests.e2e._rewards:never"},
                      model={"hf_config": dict(TINY_MODEL, max_position_embeddings=64)})
    run_cli(write_config(tmp_path / "a.yaml", cfg))
    records = _rl(read_metrics(out))
    assert len(records) == 2 and all(r["env/turns_mean"] >= 1.0 for r in records)
    assert all(r["rollout/logprob_abs_diff"] < 1e-4 for r in records), [r["rollout/logprob_abs_diff"] for r in records]
    assert all(r["env/reward_mean"] > 0 for r in records)  # the environment did reward turns
    evals = [r for r in read_metrics(out) if r.get("phase") == "eval"]
    scores = {k: v for r in evals for k, v in r.items() if k.endswith(("/pass@1", "/pass@2", "/reward_mean"))}
    assert evals and scores and all(v == 0.0 for v in scores.values()), scores


def test_hanging_and_crashing_tools_and_environments_do_not_stop_the_run(tmp_path):
    out = tmp_path / "run"
    env = {"name": "tests.e2e._envs:Faulty", "max_turns": 3, "max_tokens": 24, "step_timeout_s": 3.0,
           "kwargs": {"hang_s": 60.0, "tool_timeout_s": 1.0}}
    run_cli(write_config(tmp_path / "c.yaml", tiny_config(out, env=env, train={"steps": 4})), timeout=900)
    records = _rl(read_metrics(out))
    assert [r["step"] for r in records] == [0, 1, 2, 3]  # every step ran
    assert sum(r["env/finish_env_error"] for r in records) > 0  # hung, raising steps and resets: their episodes
    assert sum(r["env/tool_timeouts"] for r in records) > 0  # the sandbox's endless loop, killed at its timeout
    assert sum(r["env/tool_errors"] for r in records) > 0  # the sandbox's aborted process
    assert all(r["train/update_ok"] == 1.0 for r in records if "train/update_ok" in r)


def test_separate_placement_runs_episodes_on_the_worker_and_fixed_mode_resumes_exactly(tmp_path):
    fixed = ("rollout.placement=separate", "train.max_staleness=1", "train.staleness_mode=fixed")
    straight, resumed = tmp_path / "a", tmp_path / "c"
    cfg = dict(env=TALK, train={"steps": 4}, eval={"every": 2, "reward": "tests.e2e._rewards:parity"})
    run_cli(write_config(tmp_path / "a.yaml", tiny_config(straight, **cfg)), *fixed, nproc=2)
    a = read_metrics(straight)
    assert all("env/turns_mean" in r for r in _rl(a))  # the episodes came from the worker, with their metrics
    assert max(r["env/turns_mean"] for r in _rl(a)) > 1.0

    name = f"step_{2 + 2:08d}"  # RL step 2 (after 2 warm-start steps): the batch of step 2 is in flight then
    shutil.copytree(straight / "checkpoints" / name, resumed / "checkpoints" / name)
    (resumed / "checkpoints" / "latest").write_text(name)
    proc = run_cli(write_config(tmp_path / "c.yaml", tiny_config(resumed, **cfg)), *fixed, nproc=2)
    assert "RL step 2)" in proc.stdout + proc.stderr
    later = [r for r in a if r.get("phase") in ("rl", "eval") and r["step"] >= 2]
    c = [r for r in read_metrics(resumed) if r.get("phase") in ("rl", "eval")]
    strip = lambda rs: [{k: v for k, v in r.items() if not k.startswith("async/")} for r in stable_metrics(rs)]  # noqa: E731
    assert strip(c) == strip(later)


def test_the_calculator_example_path_runs(tmp_path):
    """examples/calculator_multiplication.yaml at the tiny model's scale: the tokenizer learns the traces (the call
    tags whole), the warm start trains on masked tool-use traces, RL episodes call the real calculator, evaluation
    runs episodes too; and the same config without the env section (the no-tool arm) runs."""
    import yaml
    from _e2e_helpers import REPO, TINY_MODEL

    example = yaml.safe_load((REPO / "examples" / "calculator_multiplication.yaml").read_text())
    small = {"model": {"hf_config": dict(TINY_MODEL, max_position_embeddings=64)},
             "data": {"arithmetic_train_size": 32, "arithmetic_max_operand": 99},
             "train": {"steps": 2, "prompts_per_step": 4, "group_size": 4, "sft_steps": 3, "sft_batch_size": 8,
                       "output_dir": str(tmp_path / "tool")},
             "eval": {"every": 2, "max_prompts": 4, "samples": 2},
             "logging": {"tensorboard": False, "progress_bar": False, "plot": False, "print_every": 1}}
    for section, values in small.items():
        example.setdefault(section, {}).update(values)
    run_cli(write_config(tmp_path / "tool.yaml", example))
    records = read_metrics(tmp_path / "tool")
    sft = [r for r in records if r.get("phase") == "sft"]
    assert len(sft) == 3 and all(r["sft/nll"] > 0 for r in sft)
    rl = _rl(records)
    assert [r["step"] for r in rl] == [0, 1] and all("env/tool_calls_mean" in r for r in rl)
    assert any(r.get("phase") == "eval" for r in records)
    tok = (tmp_path / "tool" / "tokenizer" / "tokenizer.json").read_text()
    assert "<calc>" in tok and "<|tool|>" in tok
    run_cli(write_config(tmp_path / "plain.yaml", example), "env=null", "data.arithmetic_warm_start=answer",
            "rollout.max_new_tokens=8", f"train.output_dir={tmp_path / 'plain'}")
    assert not any(k.startswith("env/") for r in read_metrics(tmp_path / "plain") for k in r)


def test_a_python_tool_run_without_bubblewrap_stops_before_step_0_with_one_line(tmp_path):
    """No silent fallback to the unsafe mode: a machine without bubblewrap (here: hidden from PATH) refuses the
    python tool at start-up, naming the missing piece and the explicit opt-in; with the opt-in the run trains."""
    cfg = tiny_config(tmp_path / "run", env={"name": "python", "max_turns": 2, "max_tokens": 8, "kwargs": {}})
    config = write_config(tmp_path / "python.yaml", cfg)
    refused = run_cli(config, check=False, extra_env={"PATH": str(tmp_path / "empty-bin")})
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr[-3000:]
    assert "bubblewrap is not installed" in lines[0] and "env.kwargs.isolation=none" in lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    run_cli(config, "env.kwargs={isolation: none}", extra_env={"PATH": str(tmp_path / "empty-bin")})
    assert len(_rl(read_metrics(tmp_path / "run"))) == 4
