"""A small Bradley-Terry reward model trained on preference pairs (``megatron-dppo rm train``).

Each pair is two token sequences, the reward model's inputs for the chosen and the rejected completion of one
prompt (built by ``model_inputs.InputBuilder``, so training sees exactly what scoring will). The model is a
transformers ``*ForSequenceClassification`` with one label, trained with the Bradley-Terry loss

    L = -mean log sigmoid(r(chosen) - r(rejected)),

the objective of TRL's ``RewardTrainer``, OpenRLHF and NeMo-RL's RM training, with AdamW. The score r is read at
the last token of the input, as ``hf_model.HFRewardEngine`` reads it. The result is an ordinary HF folder
(config.json with ``architectures: [...ForSequenceClassification]``, safetensors, the tokenizer) and
``reward_model.json`` (what it was trained on, its held-out pairwise accuracy).

Sized for a CPU: a 2-layer Qwen2 of width 64, 2000 steps of 64 pairs on 4000 arithmetic pairs, about 45 seconds of
one core (``cpu_seconds`` in reward_model.json). Telling a correct answer from a near miss (off by one or two) is
what takes the steps: at 300 steps the model ranks the gold answer above gold +- 2 only 59% of the time (it learns
the answer's parity first), at 2000 97% (docs/reward_models.md). The tool is for examples, tests and small tasks,
not a replacement for a reward-model trainer at scale.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from megatron_dppo.rewards.hf_model import last_token_scores

Pair = tuple[list[int], list[int]]  # (chosen input ids, rejected input ids)


@dataclass
class BTConfig:
    """The reward model's size and its training."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    steps: int = 2000
    batch_size: int = 64
    lr: float = 2e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    seed: int = 0


def small_classifier_config(vocab_size: int, max_positions: int, tokenizer: Any, bt: BTConfig) -> dict:
    """config.json of a small Qwen2 sequence classifier with one label. ``vocab_size``: the policy's embedding
    rows (it may sample any of them, including rows past the tokenizer's last token)."""
    return dict(model_type="qwen2", architectures=["Qwen2ForSequenceClassification"], num_labels=1,
                vocab_size=vocab_size, hidden_size=bt.hidden_size, intermediate_size=bt.intermediate_size,
                num_hidden_layers=bt.num_layers, num_attention_heads=bt.num_heads,
                num_key_value_heads=bt.num_kv_heads, max_position_embeddings=max_positions, rope_theta=10000.0,
                rms_norm_eps=1e-6, tie_word_embeddings=False,
                pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id)


def pairwise_accuracy(model: Any, pairs: Sequence[Pair], batch_size: int = 256) -> float:
    """Fraction of pairs whose chosen input scores strictly higher than the rejected one."""
    if not pairs:
        return math.nan
    wins = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(pairs), batch_size):
            chunk = pairs[start:start + batch_size]
            scores = last_token_scores(model, [c for c, _ in chunk] + [r for _, r in chunk])
            wins += int((scores[:len(chunk)] > scores[len(chunk):]).sum())
    return wins / len(pairs)


def train_bradley_terry(pairs: Sequence[Pair], hf_config: dict, out_dir: str | Path, tokenizer: Any, *,
                        bt: BTConfig | None = None, heldout: Sequence[Pair] = (), meta: dict | None = None,
                        log_every: int = 0) -> dict:
    """Train a sequence classifier on ``pairs`` and save it with ``tokenizer`` to ``out_dir``; returns (and writes
    to ``reward_model.json``) the run's record: loss, train and held-out pairwise accuracy, seconds, ``meta``."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    bt = bt or BTConfig()
    if not pairs:
        raise ValueError("no preference pairs to train the reward model on")
    for name in ("steps", "batch_size"):
        if getattr(bt, name) < 1:
            raise ValueError(f"rm train: {name}={getattr(bt, name)} must be >= 1")
    start, cpu_start = time.perf_counter(), time.process_time()
    torch.manual_seed(bt.seed)
    config = AutoConfig.for_model(**{k: v for k, v in hf_config.items() if k != "architectures"})
    config.architectures = hf_config.get("architectures")
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=bt.lr, weight_decay=bt.weight_decay)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / max(1, bt.warmup_steps)))
    order = torch.Generator().manual_seed(bt.seed)
    losses = []
    model.train()
    for step in range(bt.steps):
        batch = [pairs[i] for i in torch.randint(len(pairs), (min(bt.batch_size, len(pairs)),), generator=order)]
        scores = last_token_scores(model, [c for c, _ in batch] + [r for _, r in batch])
        margin = scores[:len(batch)] - scores[len(batch):]
        loss = -torch.nn.functional.logsigmoid(margin).mean()
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        losses.append(float(loss.detach()))
        if log_every and (step + 1) % log_every == 0:
            print(f"rm train step {step + 1}/{bt.steps}: loss {sum(losses[-log_every:]) / log_every:.4f}", flush=True)
    record = {"pairs": len(pairs), "heldout_pairs": len(heldout), "final_loss": sum(losses[-20:]) / len(losses[-20:]),
              "train_accuracy": pairwise_accuracy(model, list(pairs)[:2000]),
              "heldout_accuracy": pairwise_accuracy(model, list(heldout)),
              "seconds": time.perf_counter() - start, "cpu_seconds": time.process_time() - cpu_start,
              "config": asdict(bt), **(meta or {})}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "reward_model.json").write_text(json.dumps(record, indent=1))
    return record
