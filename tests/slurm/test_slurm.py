"""The real sbatch scripts on a real Slurm cluster of two fake nodes (n1, n2); see .ci/slurm_cluster.sh.

The three checks the issue asks for run the REAL trainer (``megatron-dppo train``, the scripts' default DPPO_CMD)
with a tiny CPU config (gloo): 2 nodes x 2 ranks completes with a checkpoint; a failing rank fails the job within a
minute; a preempted job checkpoints, requeues itself and resumes to the same final step. The other launch modes
(one srun task per GPU, MPI, refused separate worlds) run the stand-in
``python -m megatron_dppo.distributed.launch_check`` (gloo, CPU, seconds): it discovers the launch, all-reduces,
takes checkpointed steps and writes
``out/rank-<r>.json``. Jobs ask for 2 (fake) GPUs per node, so every run is 2 nodes x 2 ranks.
"""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "e2e"))
from _e2e_helpers import tiny_config, write_config  # noqa: E402

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

TRAIN = str(REPO / "slurm" / "train.sbatch")
TRAIN_MPI = str(REPO / "slurm" / "train_mpi.sbatch")
TWO_BY_TWO = ["--nodes=2", "--gpus-per-node=2"]
CHECK = "python -m megatron_dppo.distributed.launch_check"  # the stand-in program (DPPO_CMD)


def tiny_trainer_config(tmp_path: Path, steps: int, sft_steps: int = 1) -> tuple[Path, Path]:
    """(config file, train.output_dir) of a seconds-per-step run: the e2e tests' 2-layer Qwen2 from scratch,
    ``steps`` RL steps after ``sft_steps`` warm-start steps, no evaluation, a checkpoint after every step. The
    output directory is in the test's tmp dir: both fake nodes are this host, so both see it."""
    out = tmp_path / "run"
    cfg = tiny_config(out, train={"steps": steps, "sft_steps": sft_steps}, eval={"every": 0},
                      checkpoint={"every": 1, "keep_last": 100},
                      reward={"fn": "tests.slurm._rewards:parity_or_fail", "isolation": "inline"})
    return write_config(tmp_path / "tiny.yaml", cfg), out


def trainer_env(slurm, **extra: str):
    """The job environment of a real-trainer job: the repo on PYTHONPATH for the test reward function."""
    return slurm.job_env(PYTHONPATH=str(REPO), TOKENIZERS_PARALLELISM="false", **extra)


def rl_steps(out: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r.get("phase") == "rl"]


def assert_four_ranks_took_part(tmp_path: Path, job, ckpt: Path, runs: int = 1) -> None:
    """The trainer saw one world of 4 (rank 0's banner), torchrun ran 2 agents (one per node) x 2 ranks, each rank
    with its own log, and every rank wrote its own shard of the checkpoint (torch_dist: ``__<rank>_<i>.distcp``)."""
    logs = job.logs()
    assert re.search(r"world 4 \(tp 1, pp 1, dp 4\)", logs), logs[-3000:]
    run_dir = tmp_path / "logs" / f"{job.name}-{job.job_id}"
    assert sorted(p.name for p in run_dir.glob("node-*.out")) == ["node-0.out", "node-1.out"]  # srun's %n
    agents = [p for p in run_dir.glob("ranks/*/attempt_0") if p.is_dir()]  # one per torchrun agent and run
    assert len(agents) == 2 * runs, agents
    assert all(sorted(q.parent.name for q in a.glob("*/stdout.log")) == ["0", "1"] for a in agents)  # local ranks
    writers = {int(p.name.split("_")[2]) for p in ckpt.glob("__*_*.distcp")}
    assert writers == {0, 1, 2, 3}, sorted(p.name for p in ckpt.iterdir())
    assert json.loads((ckpt / "megatron_dppo.json").read_text())["layout"]["world_size"] == 4


def assert_two_by_two(outputs: dict[int, dict], launcher: str) -> None:
    """Ranks 0..3 each wrote a record; one world of 4, two ranks on each of n1 and n2, the all-reduce right."""
    assert sorted(outputs) == [0, 1, 2, 3], outputs.keys()
    assert {o["world_size"] for o in outputs.values()} == {4}
    assert all(o["allreduce_ok"] and o["allreduce"] == 10.0 for o in outputs.values())
    assert {o["launcher"] for o in outputs.values()} == {launcher}
    assert Counter(o["slurm_node"] for o in outputs.values()) == {"n1": 2, "n2": 2}
    assert outputs[0]["nodes"] == [outputs[r]["slurm_node"] for r in range(4)]  # all_gather agrees
    assert sorted((o["slurm_node"], o["local_rank"]) for o in outputs.values()) == [
        ("n1", 0), ("n1", 1), ("n2", 0), ("n2", 1)]
    assert {o["local_world_size"] for o in outputs.values()} == {2}


def preempt_after_first_checkpoint(slurm, job, latest: Path, first_s: float = 180, rest_s: float = 220) -> None:
    """Wait for the job's first checkpoint (``latest`` appears, within ``first_s``), send SIGUSR1 to its batch shell
    (what --signal=B:USR1@<s> does before the time limit), and check that it then requeued once and completed
    (within ``rest_s``)."""
    deadline = time.monotonic() + first_s
    while not latest.exists():
        assert time.monotonic() < deadline and slurm.state(job) not in slurm.TERMINAL, slurm.describe(job)
        time.sleep(0.2)
    slurm.run("scancel", "--signal=USR1", "--batch", str(job.job_id))
    state, _ = slurm.wait(job, timeout=rest_s)
    assert state == "COMPLETED", slurm.describe(job)
    assert slurm.show(job)["Restarts"] == "1"


def test_trainer_on_two_nodes_two_ranks_completes_with_checkpoint(slurm, tmp_path):
    """The real trainer (the script's default DPPO_CMD) through srun + torchrun: 2 nodes x 2 ranks, gloo."""
    steps = 2
    config, out = tiny_trainer_config(tmp_path, steps=steps)
    job = slurm.submit(tmp_path, [TRAIN, "--config", str(config)], name="t-train", sbatch_args=TWO_BY_TWO,
                       env=trainer_env(slurm))
    state, seconds = slurm.wait(job, timeout=200)
    assert state == "COMPLETED", slurm.describe(job)
    assert rl_steps(out) == list(range(steps))
    latest = (out / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{1 + steps:08d}", latest  # 1 warm-start + 2 RL optimizer steps
    assert_four_ranks_took_part(tmp_path, job, out / "checkpoints" / latest)
    assert "megatron-dppo train --config" in job.batch_log.read_text()  # the default program
    assert "done with status 0" in job.batch_log.read_text()
    print(f"2x2 trainer job: {seconds:.0f} s")


def test_one_srun_task_per_gpu(slurm, tmp_path):
    job = slurm.submit(tmp_path, [TRAIN, "--out", "out"], name="t-srun", sbatch_args=TWO_BY_TWO,
                       env=slurm.job_env(DPPO_LAUNCH="srun", DPPO_CMD=CHECK))
    state, _ = slurm.wait(job, timeout=150)
    assert state == "COMPLETED", slurm.describe(job)
    outputs = job.outputs()
    assert_two_by_two(outputs, "slurm")
    assert {o["master"] for o in outputs.values()} == {f"n1:{20000 + job.job_id % 20000}"}  # from the job id
    assert sorted(p.name for p in (tmp_path / "logs" / f"t-srun-{job.job_id}").iterdir()) == [
        f"rank-{r}.out" for r in range(4)]


def test_a_failing_rank_fails_the_job_within_a_minute(slurm, tmp_path):
    """Rank 2 of the real trainer dies (exit 3) in the first RL step, the other three then wait in a collective:
    torchrun on n2 ends, srun --kill-on-bad-exit=1 ends n1's step, and the job is FAILED, not hung."""
    config, out = tiny_trainer_config(tmp_path, steps=1000, sft_steps=0)
    job = slurm.submit(tmp_path, [TRAIN, "--config", str(config)], name="t-fail", sbatch_args=TWO_BY_TWO,
                       env=trainer_env(slurm, DPPO_TEST_FAIL_RANK="2"))
    slurm.wait(job, timeout=60, until={"RUNNING"} | slurm.TERMINAL)
    state, seconds = slurm.wait(job, timeout=90)
    assert state == "FAILED", slurm.describe(job)
    assert seconds < 60, f"FAILED only {seconds:.0f} s after it started running"
    assert slurm.show(job)["ExitCode"] != "0:0"
    assert "rank 2 failing on purpose" in job.logs(), slurm.describe(job)
    assert not (out / "metrics.jsonl").exists() or rl_steps(out) == []  # nobody went on training
    print(f"failing-rank job: FAILED {seconds:.0f} s after it started running")


def test_preempted_trainer_checkpoints_requeues_and_resumes(slurm, tmp_path):
    """SIGUSR1 to the batch shell (what --signal=B:USR1@<s> does before the time limit): the trap creates
    $DPPO_STOP_FILE, the trainer's ranks agree on it at the next step boundary, checkpoint and exit 0; the job
    requeues itself, resumes from that checkpoint and ends at the same final step as a straight run."""
    steps = 6
    config, out = tiny_trainer_config(tmp_path, steps=steps)
    job = slurm.submit(tmp_path, [TRAIN, "--config", str(config)], name="t-requeue", sbatch_args=TWO_BY_TWO,
                       env=trainer_env(slurm, DPPO_STOP_GRACE="90"))
    latest = out / "checkpoints" / "latest"
    preempt_after_first_checkpoint(slurm, job, latest)
    log = job.batch_log.read_text()
    assert "requeueing job" in log and "restart 1" in log and "SIGTERM" not in log
    logs = job.logs()
    stopped = set(re.findall(r"stopped by the job script's stop request; checkpoint (\S+);", logs))
    resumed = set(re.findall(r"resumed from (\S+) \(warm-start step 1, RL step (\d+)\)", logs))
    assert len(stopped) == 1 and len(resumed) == 1, (stopped, resumed, logs[-3000:])  # rank 0, tee'd twice
    (resumed_from, resumed_step), = resumed
    assert resumed_from == stopped.pop() and 1 <= int(resumed_step) < steps  # resumed mid-way where it stopped ...
    assert rl_steps(out) == list(range(steps))  # ... and every RL step is logged once, as in a straight run
    assert latest.read_text().strip() == f"step_{1 + steps:08d}"  # same final step as an uninterrupted run
    assert_four_ranks_took_part(tmp_path, job, out / "checkpoints" / latest.read_text().strip(), runs=2)


def test_async_job_trainer_node_and_rollout_node_preempted_and_resumed(slurm, tmp_path):
    """Asynchronous RL in one job (docs/async.md): n1's two ranks train, n2's two are the rollout workers
    (rollout.workers=2, the job's last ranks), max_staleness 1. SIGUSR1 to the batch shell mid-run: the trainers
    agree on the stop file at a step boundary, checkpoint and send the workers their stop message (the workers
    ignore the signals), the job exits 0, requeues itself and resumes to the same final step; every batch within
    the staleness bound, the first resumed batch generated again from the restored weights."""
    steps = 6
    out = tmp_path / "run"
    cfg = tiny_config(out, train={"steps": steps, "sft_steps": 1, "max_staleness": 1}, eval={"every": 0},
                      checkpoint={"every": 1, "keep_last": 100}, rollout={"placement": "separate", "workers": 2},
                      reward={"fn": "tests.slurm._rewards:parity_or_fail", "isolation": "inline"})
    config = write_config(tmp_path / "async.yaml", cfg)
    job = slurm.submit(tmp_path, [TRAIN, "--config", str(config)], name="t-async", sbatch_args=TWO_BY_TWO,
                       env=trainer_env(slurm, DPPO_STOP_GRACE="90"))
    latest = out / "checkpoints" / "latest"
    preempt_after_first_checkpoint(slurm, job, latest)
    logs = job.logs()
    assert re.search(r"world 2 \(tp 1, pp 1, dp 2\)", logs), logs[-3000:]  # the trainers' world: n1's ranks
    resumed = set(re.findall(r"resumed from \S+ \(warm-start step 1, RL step (\d+)\)", logs))
    assert len(resumed) == 1, (resumed, logs[-3000:])
    resumed_step = int(resumed.pop())
    assert 1 <= resumed_step < steps
    records = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("phase") == "rl"]
    assert [r["step"] for r in records] == list(range(steps))  # every RL step logged once, as in a straight run
    staleness = [r["async/staleness"] for r in records]
    assert all(0 <= s <= 1 for s in staleness) and staleness[resumed_step] == 0, staleness
    assert latest.read_text().strip() == f"step_{1 + steps:08d}"
    ckpt = out / "checkpoints" / latest.read_text().strip()
    assert {int(p.name.split("_")[2]) for p in ckpt.glob("__*_*.distcp")} == {0, 1}  # only the trainers save
    worker = json.loads((out / "rollout_worker.json").read_text())  # the resumed run's worker record
    assert [b["step"] for b in worker["batches"]] == list(range(resumed_step, steps))


@pytest.mark.slow
@pytest.mark.parametrize("launch, stop_by", [("torchrun", "stop-file"), ("srun", "sigterm")])
def test_preempted_stand_in_checkpoints_requeues_and_resumes(slurm, tmp_path, launch, stop_by):
    """SIGUSR1 to the batch shell (what --signal=B:USR1@<s> does before the time limit): the ranks checkpoint and
    stop, the job requeues itself and resumes from that checkpoint. stop-file: the program polls $DPPO_STOP_FILE
    (the normal path); sigterm: a program that ignores it is terminated after DPPO_STOP_GRACE seconds, and the
    requeued job resumes from its latest checkpoint (the work since then is redone)."""
    steps = 8
    extra = ["--ignore-stop-file"] if stop_by == "sigterm" else []
    job = slurm.submit(tmp_path, [TRAIN, "--out", "out", "--steps", str(steps), "--ckpt", "ckpt",
                                  "--step-seconds", "0.3", *extra], name="t-requeue", sbatch_args=TWO_BY_TWO,
                       env=slurm.job_env(DPPO_LAUNCH=launch, DPPO_STOP_GRACE="2" if stop_by == "sigterm" else "90",
                                         DPPO_CMD=CHECK))
    preempt_after_first_checkpoint(slurm, job, tmp_path / "ckpt" / "latest", first_s=120, rest_s=180)
    outputs = job.outputs()
    assert_two_by_two(outputs, {"torchrun": "torchrun", "srun": "slurm"}[launch])
    for out in outputs.values():
        first = out["earlier_runs"][-1]
        assert first["restart_count"] == 0 and out["restart_count"] == 1, out
        if stop_by == "stop-file":
            assert first["preempted"], out  # stopped on request at a step boundary, not killed
            assert out["resumed_from"] == first["last_step"] >= 1  # resumed exactly where it checkpointed
        else:  # SIGTERM ends the step (SIGKILL after KillWait): resumed from the latest checkpoint written
            assert out["resumed_from"] >= 1, out
        assert out["finished"] and out["last_step"] == steps
        assert out["total"] == steps * (steps + 1) / 2  # same result as an uninterrupted run
    log = job.batch_log.read_text()
    assert "requeueing job" in log and "restart 1" in log
    assert ("SIGTERM" in log) == (stop_by == "sigterm")


@pytest.mark.parametrize("mpi_launch", ["srun", "mpirun"])
def test_mpi_launch(slurm, tmp_path, mpi_launch):
    if mpi_launch == "mpirun" and shutil.which("mpirun") is None:
        pytest.skip("mpirun is not installed")
    has_mpi4py = importlib.util.find_spec("mpi4py") is not None
    job = slurm.submit(tmp_path, [TRAIN_MPI, "--out", "out", *(["--mpi"] if has_mpi4py else [])],
                       name=f"t-mpi-{mpi_launch}", sbatch_args=[*TWO_BY_TWO, "--ntasks-per-node=2"],
                       env=slurm.job_env(DPPO_MPI_LAUNCH=mpi_launch, DPPO_CMD=CHECK))
    state, _ = slurm.wait(job, timeout=150)
    assert state == "COMPLETED", slurm.describe(job)
    outputs = job.outputs()
    assert_two_by_two(outputs, "mpi")
    if has_mpi4py:  # MPI itself agrees: one world of 4, not 4 singletons
        assert all(o["mpi_world"] == [rank, 4] for rank, o in outputs.items())


def test_separate_worlds_are_refused(slurm, tmp_path):
    """Two launches that would train N separate models die at start-up with the launcher's explanation."""
    check = "python -m megatron_dppo.distributed.launch_check --out out"
    standalone = slurm.submit(tmp_path,
                              ["--wrap", f"srun torchrun --standalone --nproc-per-node=1 --no-python {check}"],
                              name="t-standalone", sbatch_args=["--nodes=2", "--ntasks-per-node=1"])
    batch_step = slurm.submit(tmp_path, ["--wrap", check], name="t-batchstep", sbatch_args=["--nodes=1", "--ntasks=2"])
    for job, message in [(standalone, "every agent built its own world"), (batch_step, "separate worlds")]:
        state, _ = slurm.wait(job, timeout=90)
        assert state == "FAILED", slurm.describe(job)
        assert message in job.logs(), slurm.describe(job)
    assert not (tmp_path / "out").exists()  # refused before any rank initialized torch.distributed


def _conversion_env(slurm, tmp_path: Path, fail: bool, **extra: str) -> dict[str, str]:
    """slurm/submit.sh settings with a converter stub: `convert HF_DIR OUT_DIR --tp 1 --pp 1`."""
    stub = tmp_path / "convert_stub.sh"
    stub.write_text("#!/bin/bash\n# stands in for tools/convert_hf_to_megatron.py HF_DIR OUT_DIR --tp TP --pp PP\n"
                    + ("exit 1\n" if fail else 'sleep 1; mkdir -p "$2"; date +%s.%N > "$2/converted"\n'))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    return slurm.job_env(CONFIG="examples/tiny.yaml", HF_MODEL=str(tmp_path / "hf"), MEGATRON_CKPT="mcore",
                         NODES="2", GPUS_PER_NODE="2", DPPO_LAUNCH="srun", DPPO_CONVERT_CMD=f"bash {stub}", **extra)


def test_training_waits_for_the_conversion(slurm, tmp_path):
    """slurm/submit.sh (what the recipes call): conversion job, then training with --dependency=afterok.

    The "training" here is a shell stub (the launch itself is tested above): each rank records when it ran.
    """
    train_stub = tmp_path / "train_stub.sh"
    train_stub.write_text('#!/bin/bash\n# args: --config C overrides... --out DIR\nmkdir -p "${@: -1}"\n'
                          'date +%s.%N > "${@: -1}/rank-$SLURM_PROCID.json"\n')
    env = _conversion_env(slurm, tmp_path, fail=False, DPPO_CMD=f"bash {train_stub}")
    out = slurm.run(str(REPO / "slurm" / "submit.sh"), "--out", "out", cwd=tmp_path, env=env)
    train_id = int(out.stdout.strip())
    conv_id = int(next(line.split()[2].rstrip(":") for line in out.stderr.splitlines()
                       if line.startswith("conversion job")))
    assert slurm.show(train_id)["Dependency"].startswith(f"afterok:{conv_id}")
    state, _ = slurm.wait(train_id, timeout=150)
    assert state == "COMPLETED", slurm.describe(train_id) + out.stderr
    assert slurm.state(conv_id) == "COMPLETED"
    converted_at = float((tmp_path / "mcore" / "converted").read_text())
    ran_at = {int(p.stem.split("-")[1]): float(p.read_text()) for p in (tmp_path / "out").glob("rank-*.json")}
    assert sorted(ran_at) == [0, 1, 2, 3]
    assert min(ran_at.values()) > converted_at  # every rank started after the conversion had finished


def test_a_failed_conversion_cancels_the_training_job(slurm, tmp_path):
    env = _conversion_env(slurm, tmp_path, fail=True)
    out = slurm.run(str(REPO / "slurm" / "submit.sh"), "--out", "out", cwd=tmp_path, env=env)
    train_id = int(out.stdout.strip())
    state, _ = slurm.wait(train_id, timeout=60)
    assert state == "CANCELLED", slurm.describe(train_id)
    assert not (tmp_path / "out").exists()  # it never ran


@pytest.mark.slow
def test_real_conversion_job_at_tp2(slurm, tmp_path):
    """slurm/convert.sbatch with the real converter: a tiny random Qwen2 HF folder -> Megatron checkpoint at TP=2
    (two converter processes under torchrun), then a training job that waited for it (afterok) reads it."""
    pytest.importorskip("transformers")
    script = ("import sys, torch\nfrom transformers import Qwen2Config, Qwen2ForCausalLM\ntorch.manual_seed(0)\n"
              "Qwen2ForCausalLM(Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, "
              "num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, "
              "tie_word_embeddings=True)).save_pretrained(sys.argv[1])\n")
    (tmp_path / "make_hf.py").write_text(script)
    slurm.run(sys.executable, str(tmp_path / "make_hf.py"), str(tmp_path / "hf"), env=slurm.job_env(), timeout=300)
    env = slurm.job_env(CONFIG="examples/tiny.yaml", HF_MODEL=str(tmp_path / "hf"), MEGATRON_CKPT="mcore",
                        NODES="2", GPUS_PER_NODE="2", TP="2", DPPO_LAUNCH="srun",
                        DPPO_CMD="python -m megatron_dppo.distributed.launch_check")
    out = slurm.run(str(REPO / "slurm" / "submit.sh"), "--out", "out", cwd=tmp_path, env=env)
    train_id = int(out.stdout.strip())
    state, _ = slurm.wait(train_id, timeout=400)
    assert state == "COMPLETED", slurm.describe(train_id) + out.stderr
    assert "--nproc-per-node=2" in next((tmp_path / "logs").glob("*convert*.out")).read_text()
    assert (tmp_path / "mcore" / "model" / "metadata.json").is_file()
    assert len(list((tmp_path / "mcore" / "model").glob("*.distcp"))) >= 2  # written by 2 TP ranks
    assert len(list((tmp_path / "out").glob("rank-*.json"))) == 4
