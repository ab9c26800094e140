"""Over-provisioning with abort (rollout.overprovision, train/overprovision.py) on the HF engine, a rollout worker's
draws simulated step by step with the weights of a lagging version:

* no drawn prompt is dropped or shipped twice, every batch holds exactly the step's N prompts, each with the
  decision it was drawn with; groups that did not finish in time were carried and continued under newer weights;
* every token's version lies within the staleness bound of the step that trains it, the batch is stamped with
  its oldest, and each token's behaviour log-prob is that of its version's policy (teacher-forced);
* the pending prompts are part of the sampler's state: a worker restored from it draws exactly the batches the
  uninterrupted one draws (resume loses nothing);
* the configurations it cannot serve are refused with the reason."""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from _sampling_reference import teacher_forced  # isort: skip
from transformers import AutoModelForCausalLM, LlamaConfig

from megatron_dppo.config import load_config
from megatron_dppo.data import ArithmeticTask, Prompt, train_sentencepiece_tokenizer
from megatron_dppo.rollout import HFRolloutEngine
from megatron_dppo.run.metrics import PhaseTimer

QUICKSTART = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
K, N, G, STEPS = 2, 4, 2, 5
OPTIONS = ["rollout.placement=separate", f"train.max_staleness={K}", "rollout.overprovision=0.5",
           "rollout.interrupt_chunk_tokens=2", "rollout.max_new_tokens=20", f"train.group_size={G}",
           f"train.prompts_per_step={N}", "algo.pruner=dppo", "algo.r_q=0.5", "algo.r_o=0"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models and many small generate calls: one intra-op thread is faster (and robust on shared cores)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    task = ArithmeticTask(min_terms=2, max_terms=2, max_operand=9, operators="+-", seed=1234)
    return train_sentencepiece_tokenizer(task.corpus(512), tmp_path_factory.mktemp("tok"), vocab_size=64)


def policy(seed: int, eos: int):
    """A random tiny Llama whose EOS is likely enough that completion lengths spread from 1 to the limit."""
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=eos, pad_token_id=0, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        head = model.get_output_embeddings().weight
        head.mul_(4.0)
        head[eos] = 0.0
        model.model.norm.weight.fill_(1.0)
    # the EOS logit is 0 and the others spread around 0: P(EOS) per token ~ a few percent to ~20 %
    return model


def worker_side(tokenizer, options=()):
    from megatron_dppo.rewards import RewardScorer
    from megatron_dppo.rollout.handover import MemoryHandover
    from megatron_dppo.run.build import build_loss, build_pruner
    from megatron_dppo.run.setup import prompt_sampler
    from megatron_dppo.run.state import RolloutSide

    cfg = load_config(QUICKSTART, [*OPTIONS, *options])
    task = ArithmeticTask(min_terms=2, max_terms=2, max_operand=9, operators="+-", seed=7)
    prompts = [Prompt(id=r.id, token_ids=tokenizer.encode(r.prompt), gold=r.gold, text=r.prompt)
               for r in task.records(40)]
    loss_cfg, estimator = build_loss(cfg)
    engine = HFRolloutEngine(policy(0, tokenizer.eos_token_id), max_batch_size=64)
    return RolloutSide(cfg=cfg, tokenizer=tokenizer, engine=engine, handover=MemoryHandover(engine, lambda: iter(())),
                       eos_ids=[tokenizer.eos_token_id], scorer=RewardScorer("arithmetic"), train_prompts=prompts,
                       sampler=prompt_sampler(cfg, len(prompts)), pruner=build_pruner(cfg, loss_cfg, estimator))


def draw_steps(side, models, steps, start=0):
    """The worker's loop without the wire: batch t from version max(0, t - 1) (the worker one step behind the
    trainer), the prompt state updated from every shipped batch as the trainer does."""
    from megatron_dppo.train.draw import update_prompt_state
    from megatron_dppo.train.overprovision import draw_overprovisioned

    batches = []
    for t in range(start, start + steps):
        version = max(0, t - 1)
        side.engine.load_weights(iter(models[version].state_dict().items()))
        drawn = draw_overprovisioned(side, t, PhaseTimer(), version)
        rewards = drawn.rollout.rewards
        if drawn.kept:
            update_prompt_state(side, drawn.rollout, rewards, rewards - rewards.mean(1, keepdim=True), drawn.version)
        batches.append(drawn)
    return batches


def test_no_prompt_is_dropped_every_batch_has_N_and_tokens_stay_within_the_bound(tokenizer):
    models = [policy(seed, tokenizer.eos_token_id) for seed in range(STEPS)]
    side = worker_side(tokenizer)
    drawn_order = list(side.sampler.sampler.__class__(len(side.train_prompts), seed=side.cfg.train.seed,
                                                       shuffle=side.cfg.data.shuffle).take(200))
    batches = draw_steps(side, models, STEPS)
    shipped = [p.id for b in batches for p in b.prompts]
    pending = [side.train_prompts[p.index].id for p in side.sampler.pending]
    assert all(len(b.prompts) == N for b in batches)
    assert len(set(shipped)) == len(shipped) == N * STEPS  # (40 prompts: no epoch wraps in 5 x 4 + 2 draws)
    drawn = [side.train_prompts[i].id for i in drawn_order[:len(shipped) + len(pending)]]
    assert sorted(shipped + pending) == sorted(drawn)  # every drawn prompt shipped once or still pending
    assert len(pending) <= math.ceil(N * 0.5)
    carried = sum(b.metrics["async/carried_prompts"] for b in batches)
    assert carried > 0  # groups that had not finished were carried to a later batch
    for t, b in enumerate(batches):
        assert torch.equal(b.prompt_cut.weight[b.prompt_cut.keep].double(),
                           1 / b.prompt_cut.keep_prob[b.prompt_cut.keep])  # each with its drawn 1/pi_q
        versions = [v for g in b.rollout.token_versions for c in g for v in c]
        if not versions:
            continue
        assert t - K <= min(versions) <= max(versions) <= t and b.version == min(versions)
        for prompt, group, logprobs, vs in zip(b.kept, b.rollout.completions, b.rollout.behaviour_logprobs,
                                               b.rollout.token_versions):
            for tokens, lp, v in zip(group, logprobs, vs):
                assert len(tokens) == len(lp) == len(v) >= 1 and v == sorted(v)
                for version in set(v):
                    at = torch.tensor([u == version for u in v])
                    ref = teacher_forced(models[version], prompt.token_ids, tokens, 1.0, 0)
                    assert torch.allclose(torch.tensor(lp)[at], ref[at], atol=1e-5)


def test_rows_stopped_when_enough_continue_later_under_newer_weights_with_their_logprobs():
    """``continue_rows``: stopped after the first chunk (enough), continued by a second call under version 1;
    every token keeps the version and behaviour log-prob of the policy that sampled it."""
    from megatron_dppo.rollout import SamplingParams
    from megatron_dppo.rollout.partial import PartialRow, continue_rows

    models = [policy(seed, 3) for seed in range(2)]
    engine = HFRolloutEngine(policy(0, 3), max_batch_size=64)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    groups = [[PartialRow(q, list(p)) for _ in range(3)] for q, p in enumerate(prompts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)
    version, taken = continue_rows(engine, groups, sampling, 0, 4, enough=lambda: True)
    assert (version, taken) == (0, 0) and not any(r.tokens for g in groups for r in g)  # enough before a chunk
    calls = []
    continue_rows(engine, groups, sampling, 0, 4, enough=lambda: calls.append(1) or len(calls) > 1)
    assert all(r.tokens and len(r.tokens) <= 4 for g in groups for r in g)
    running = [r for g in groups for r in g if r.finish is None]
    assert running, "every row ended in the first chunk: nothing to continue"
    engine.load_weights(iter(models[1].state_dict().items()))
    continue_rows(engine, groups, dataclasses.replace(sampling, seed=4), 1, 4, enough=lambda: False)
    assert all(r.finish is not None for g in groups for r in g)
    for r in (r for g in groups for r in g):
        assert r.versions == sorted(r.versions) and r.interruptions == int(len(set(r.versions)) > 1)
        for version in set(r.versions):
            at = torch.tensor([u == version for u in r.versions])
            ref = teacher_forced(models[version], prompts[r.prompt], r.tokens, 1.0, 0)
            assert torch.allclose(torch.tensor(r.logprobs)[at], ref[at], atol=1e-5)
            if version == 1:  # control: under version 0 these tokens have other log-probs
                old = teacher_forced(models[0], prompts[r.prompt], r.tokens, 1.0, 0)
                assert (old[at] - ref[at]).abs().max() > 1e-2
    assert any(len(set(r.versions)) == 2 for r in running)


def test_a_worker_restored_from_the_sampler_state_draws_what_the_uninterrupted_one_draws(tokenizer):
    from megatron_dppo.run.setup import prompt_sampler

    models = [policy(seed, tokenizer.eos_token_id) for seed in range(STEPS)]
    straight = worker_side(tokenizer)
    first = draw_steps(straight, models, 3)
    assert len(first) == 3
    state, history = straight.sampler.state_dict(), straight.pruner.state_dict()
    assert state["pending"], "nothing was pending at the cut: the test would not test the restore"
    later = draw_steps(straight, models, 3, start=3)

    restored = worker_side(tokenizer)
    restored.sampler = prompt_sampler(restored.cfg, len(restored.train_prompts))
    restored.sampler.load_state_dict(state)
    restored.pruner.load_state_dict(history)
    again = draw_steps(restored, models, 3, start=3)
    for a, b in zip(later, again):
        assert [p.id for p in a.prompts] == [p.id for p in b.prompts]
        assert a.rollout.completions == b.rollout.completions
        assert a.rollout.token_versions == b.rollout.token_versions and a.version == b.version
        assert torch.equal(a.prompt_cut.keep_prob, b.prompt_cut.keep_prob)


def test_a_plain_sampler_refuses_a_state_with_pending_prompts(tokenizer):
    from megatron_dppo.data import PromptSampler

    side = worker_side(tokenizer)
    draw_steps(side, [policy(0, tokenizer.eos_token_id)], 1)
    state = side.sampler.state_dict()
    assert state["pending"]
    with pytest.raises(ValueError, match="resume with rollout.overprovision > 0"):
        PromptSampler(len(side.train_prompts), seed=side.cfg.train.seed).load_state_dict(state)


@pytest.mark.parametrize("options, message", [
    (["train.max_staleness=1"], "train.max_staleness"),
    (["rollout.placement=colocated", "train.max_staleness=0"], "rollout.overprovision"),
    (["rollout.workers=2"], "rollout.workers"),
    (["algo.screen_k=2"], "algo.screen_k"),
    (["rollout.overprovision=1.5"], "in \\[0, 1\\]"),
    (["train.staleness_mode=fixed"], "train.staleness_mode")])
def test_configurations_it_cannot_serve_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        load_config(QUICKSTART, [*OPTIONS, *options])
