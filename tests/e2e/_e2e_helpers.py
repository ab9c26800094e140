"""Shared pieces of the end-to-end tests: a tiny run config, CLI launchers, checkpoint and metric comparison."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
PY = sys.executable

# Metrics that measure wall-clock time or throughput: never compared between runs.
VOLATILE_PREFIXES = ("time/", "time_cpu/", "throughput/")
VOLATILE_SUFFIXES = ("/seconds",)

TINY_MODEL = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32,
    "tie_word_embeddings": True, "rope_theta": 10000.0,
}


def tiny_config(output_dir: Path, **sections) -> dict:
    """A seconds-per-step arithmetic run: 2-layer Qwen2 from scratch, B=8 prompts x G=4, 16 training prompts (so
    prompts come back every 2 steps and DPPO's prompt level has a history to prune on), and a reward that varies
    within every group (``_rewards.parity``) so every step has non-zero advantages."""
    cfg = {
        "model": {"hf_config": dict(TINY_MODEL), "tokenizer": "train-sentencepiece"},
        "data": {"task": "arithmetic", "template": "raw", "arithmetic_train_size": 16, "arithmetic_max_operand": 9},
        "reward": {"fn": "tests.e2e._rewards:parity", "isolation": "inline"},
        "rollout": {"max_new_tokens": 4},
        "algo": {"pruner": "dppo", "r_q": 0.5, "r_o": 0.5},
        "loss": {"preset": "grpo", "kl_coef": 0.0},
        "optim": {"lr": 1.0e-3},
        "packing": {"capacity": 64, "window": 16},
        "train": {"steps": 4, "prompts_per_step": 8, "group_size": 4, "seed": 7, "sft_steps": 2,
                  "sft_batch_size": 16, "sft_lr": 3.0e-3, "cpu_threads": 1, "output_dir": str(output_dir)},
        "eval": {"every": 2, "max_prompts": 8, "samples": 2, "pass_k": 2},
        "checkpoint": {"every": 2, "keep_last": 10},
        "logging": {"tensorboard": False, "progress_bar": False, "print_every": 1, "plot": False},
    }
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def damaged_parquet(path: Path) -> Path:
    """A parquet file of prompts whose footer (the thrift metadata) is overwritten: pyarrow then fails with
    "Couldn't deserialize thrift", as on a file damaged in transfer."""
    import struct

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"question": ["What is 2 plus 3?"] * 3, "answer": ["5"] * 3}), path)
    data = bytearray(path.read_bytes())
    footer = struct.unpack("<I", data[-8:-4])[0]
    data[-8 - footer:-8] = b"\xff" * footer
    path.write_bytes(bytes(data))
    return path


def write_config(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def env(**extra) -> dict:
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"})
    e.pop("RANK", None), e.pop("WORLD_SIZE", None), e.pop("MASTER_PORT", None)
    e.update(extra)
    return e


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(config: Path, *overrides: str, nproc: int = 1, timeout: float = 600, check: bool = True,
            extra_env: dict | None = None) -> subprocess.CompletedProcess:
    """``megatron-dppo train --config config overrides`` in fresh processes (torchrun when nproc > 1), with
    ``extra_env`` added to the environment."""
    if nproc == 1:
        cmd = [PY, "-m", "megatron_dppo.cli", "train", "--config", str(config), *overrides]
        extra = {"MASTER_PORT": str(free_port())}
    else:
        cmd = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-addr=127.0.0.1",
               f"--master-port={free_port()}", "-m", "megatron_dppo.cli", "train", "--config", str(config),
               *overrides]
        extra = {}
    proc = subprocess.run(cmd, cwd=REPO, env=env(**extra, **(extra_env or {})), capture_output=True, text=True,
                          timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
                             f"--- stderr\n{proc.stderr[-6000:]}")
    return proc


def read_metrics(output_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def stable_metrics(records: list[dict]) -> list[dict]:
    """Records without the wall-clock fields (those differ between any two runs)."""
    return [{k: v for k, v in r.items() if not k.startswith(VOLATILE_PREFIXES) and not k.endswith(VOLATILE_SUFFIXES)}
            for r in records]


def checkpoint_tensors(ckpt_dir: Path) -> dict:
    """Every tensor of a Megatron (torch_dist) checkpoint, read without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = ckpt_dir.parent / f".{ckpt_dir.name}.pt"
    dcp_to_torch_save(str(ckpt_dir), str(out))
    state = torch.load(out, weights_only=False)
    out.unlink()
    return {k: v for k, v in _flatten(state).items() if isinstance(v, torch.Tensor)}


def _flatten(obj, prefix: str = "") -> dict:
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix.rstrip("."): obj}


def latest_checkpoint(output_dir: Path) -> Path:
    root = output_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def tiny_base(folder: Path, seed: int = 0, model: dict | None = None) -> Path:
    """A pretrained stand-in for LoRA runs: the TINY_MODEL architecture (or ``model``) with random weights as a
    Hugging Face folder (config.json + safetensors), its vocabulary covering the trained sentencepiece tokenizer
    (512)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {k: v for k, v in (model or TINY_MODEL).items() if k != "model_type"}
    config = AutoConfig.for_model("qwen2", vocab_size=512, **fields)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return folder


def make_read_only(directory: Path):
    """No one may write into ``directory``: chmod for a normal user; root ignores permission bits, so the
    immutable attribute (chattr +i), which binds root too (the test is skipped where neither works). Returns the
    undo function."""
    import shutil

    import pytest

    if os.geteuid() != 0:
        directory.chmod(0o555)
        return lambda: directory.chmod(0o755)
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(directory)]).returncode != 0:
        pytest.skip("running as root without chattr +i: no directory is unwritable for this process")
    return lambda: subprocess.run(["chattr", "-i", str(directory)], check=True)
