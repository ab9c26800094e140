"""The shell side, without a cluster: shellcheck, and what the recipes would submit (DRY_RUN=1)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = sorted([*REPO.glob("slurm/*.sbatch"), *REPO.glob("slurm/*.sh"), *REPO.glob("slurm/recipes/*.sh"),
                  *REPO.glob(".ci/*.sh"), REPO / ".ci" / "run"])
RECIPES = sorted(REPO.glob("slurm/recipes/*.sh"))


@pytest.mark.skipif(shutil.which("shellcheck") is None,
                    reason="shellcheck is not installed (apt-get install shellcheck)")
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_shellcheck(script):
    out = subprocess.run(["shellcheck", "-x", "--shell=bash", str(script)], capture_output=True, text=True,
                         cwd=script.parent, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_there_is_something_to_check():
    names = {p.name for p in SCRIPTS}
    assert {"train.sbatch", "train_mpi.sbatch", "convert.sbatch", "submit.sh", "slurm_cluster.sh", "slurm.sh"} <= names
    assert len(RECIPES) >= 3


def dry_run(recipe: Path, tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess:
    settings = {"NODES", "GPUS_PER_NODE", "TP", "PP", "EP", "ETP", "CONFIG", "HF_MODEL", "MEGATRON_CKPT",
                "MEGATRON_CKPT_KEY", "WORKERS", "ROLLOUT_TP", "ENGINE", "STALENESS"}
    full_env = {key: value for key, value in os.environ.items() if key not in settings}
    full_env.update({"DRY_RUN": "1", **env})
    return subprocess.run([str(recipe), *args], capture_output=True, text=True, cwd=tmp_path, env=full_env,
                          timeout=30)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_submits_training_with_the_layout(recipe, tmp_path):
    out = dry_run(recipe, tmp_path, "trainer.seed=3", HF_MODEL="/models/m")
    assert out.returncode == 0, out.stderr
    train = out.stderr.splitlines()[0]
    assert "convert.sbatch" not in out.stderr and "--dependency" not in train  # no conversion unless asked
    nodes = int(re.search(r"--nodes=(\d+)", train).group(1))
    gpus = int(re.search(r"--gpus-per-node=(\d+)", train).group(1))
    tp = int(re.search(r"parallel\.tp=(\d+)", train).group(1))
    pp = int(re.search(r"parallel\.pp=(\d+)", train).group(1))
    assert (nodes * gpus) % (tp * pp) == 0 and gpus % tp == 0  # TP stays inside a node
    assert "train.sbatch --config examples/" in train and "model.path=/models/m" in train
    assert train.rstrip().endswith("trainer.seed=3")  # user overrides come last, so they win
    assert not (tmp_path / "logs").exists()  # a dry run creates nothing


def test_conversion_first_when_asked(tmp_path):
    out = dry_run(RECIPES[0], tmp_path, HF_MODEL="/models/m", MEGATRON_CKPT="mcore", TP="2", PP="2",
                  MEGATRON_CKPT_KEY="model.init_checkpoint")
    assert out.returncode == 0, out.stderr
    convert, _, train, _ = out.stderr.splitlines()
    assert convert.rstrip().endswith("convert.sbatch /models/m mcore --tp 2 --pp 2")
    assert "--dependency=afterok:0 --kill-on-invalid-dep=yes" in train and "model.init_checkpoint=mcore" in train
    (tmp_path / "mcore").mkdir()  # already converted: no second conversion
    out = dry_run(RECIPES[0], tmp_path, HF_MODEL="/models/m", MEGATRON_CKPT="mcore")
    assert "convert.sbatch" not in out.stderr and "--dependency" not in out.stderr


def test_missing_hf_folder_is_refused_before_submitting(tmp_path):
    out = dry_run(RECIPES[0], tmp_path, HF_MODEL="Qwen/Qwen3-4B", DRY_RUN="0")
    assert out.returncode == 2 and "hf download" in out.stderr
    assert not (tmp_path / "logs").exists()


def test_moe_recipe_lays_experts_inside_a_node(tmp_path):
    """The Qwen3-30B-A3B recipe: EP spans one node's GPUs, the trainer gets parallel.ep/etp, and the config file
    it names loads and validates with that layout (tp, sp, ep, etp)."""
    from megatron_dppo.config import load_config

    out = dry_run(REPO / "slurm/recipes/qwen3-30b-a3b-math.sh", tmp_path, HF_MODEL="/models/m")
    assert out.returncode == 0, out.stderr
    train = out.stderr.splitlines()[0]
    gpus = int(re.search(r"--gpus-per-node=(\d+)", train).group(1))
    ep = int(re.search(r"parallel\.ep=(\d+)", train).group(1))
    assert ep == gpus and "parallel.etp=1" in train
    cfg = load_config(REPO / "examples/qwen3-30b-a3b-math.yaml", [f"parallel.ep={ep}"], validate=False)
    cfg.parallel.validate()
    assert (cfg.parallel.tp, cfg.parallel.sp, cfg.parallel.ep, cfg.parallel.etp) == (2, True, 8, 1)
    assert cfg.model.moe_routing_replay and cfg.model.moe_aux_loss_coeff == 0.0
    out = dry_run(REPO / "slurm/recipes/qwen3-30b-a3b-math.sh", tmp_path, HF_MODEL="/models/m", EP="3")
    assert out.returncode == 2 and "ETP*EP*PP" in out.stderr  # 3 expert ranks cannot tile 16 GPUs


@pytest.mark.parametrize("rollout_tp", [None, "2"])
def test_async_recipe_with_vllm_makes_the_workers_independent_engines(tmp_path, rollout_tp):
    """ENGINE=vllm: the node of 8 rollout workers is 8 engines of TP 1 by default (a 1.5B model's 12 heads do not
    split over 8 ranks), ROLLOUT_TP=2 makes it 4 engines of TP 2."""
    extra = {} if rollout_tp is None else {"ROLLOUT_TP": rollout_tp}
    out = dry_run(REPO / "slurm/recipes/qwen2.5-1.5b-gsm8k-async.sh", tmp_path, HF_MODEL="/models/m",
                  ENGINE="vllm", **extra)
    assert out.returncode == 0, out.stderr
    train = out.stderr.splitlines()[0]
    for override in ("rollout.placement=separate", "rollout.engine=vllm", "rollout.workers=8",
                     f"rollout.tp={rollout_tp or 1}"):
        assert f" {override} " in train, train


def test_impossible_layout_is_refused(tmp_path):
    out = dry_run(RECIPES[0], tmp_path, HF_MODEL="/models/m", NODES="1", GPUS_PER_NODE="8", TP="3")
    assert out.returncode == 2 and "not a multiple of TP*PP" in out.stderr


@pytest.mark.parametrize("args, nproc", [(["--tp", "2", "--pp", "2"], 4), (["--tp", "2", "--ep", "8"], 8),
                                         (["--tp=4", "--ep=2", "--etp=2", "--pp=2"], 8),
                                         (["--ep", "3", "--tp", "2"], 6)])
def test_convert_job_starts_enough_converter_processes(tmp_path, args, nproc):
    """convert.sbatch runs the converter on lcm(tp, ep*etp)*pp processes (what convert_hf_to_megatron needs for the
    layout). torchrun is a recording stand-in here: it prints the process count it was asked for."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "torchrun").write_text('#!/bin/bash\necho "torchrun $*"\n')
    (fake / "torchrun").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "SLURM_JOB_ID": "1", "DPPO_CONVERT_CMD": "true"}
    env.pop("DPPO_CONVERT_NPROC", None)
    out = subprocess.run(["bash", str(REPO / "slurm/convert.sbatch"), "/models/m", "out", *args], capture_output=True,
                         text=True, env=env, cwd=tmp_path, timeout=30)
    assert out.returncode == 0, out.stderr
    assert f"--nproc-per-node={nproc} " in out.stdout
