"""Partial rollouts on the HF engine (rollout/partial.py): a new weight version arriving mid-generation interrupts
the running samples at a token boundary and they continue under it; every token's version and behaviour log-prob
equal a teacher-forced forward of the model of that version."""
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from _sampling_reference import teacher_forced  # isort: skip
from megatron_dppo.rollout import HFRolloutEngine, SamplingParams
from megatron_dppo.rollout.partial import INTERRUPTED, PartialCompletion, generate_partial, offpolicy_mask
from megatron_dppo.rollout.speculative import PromptLookupDecoding

EOS = 3
PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]


def tiny_model(seed):
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         eos_token_id=EOS, pad_token_id=0, bos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
        model.get_output_embeddings().weight[EOS] = 0.0  # EOS logit 0: most samples run long enough to interrupt
    return model


class VersionsArriving:
    """A weight source whose version v + 1 "arrives" after every ``every`` questions (one per sampled token)."""

    def __init__(self, engine, models, every):
        self.engine, self.models, self.every = engine, models, every
        self.asked, self.loaded = 0, 0

    def newer(self):
        self.asked += 1
        return self.loaded + 1 < len(self.models) and self.asked >= self.every * (self.loaded + 1)

    def load_newer(self):
        self.loaded += 1
        self.engine.load_weights(iter(self.models[self.loaded].state_dict().items()))
        return self.loaded


def run(max_interruptions, every=4, temperature=1.0, top_k=0, max_batch_size=16, speculative=None):
    models = [tiny_model(seed) for seed in range(3)]
    engine = HFRolloutEngine(tiny_model(0), max_batch_size=max_batch_size, speculative=speculative)
    source = VersionsArriving(engine, models, every)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, max_new_tokens=16, seed=7)
    groups, version = generate_partial(engine, PROMPTS, 3, sampling, 0, source, max_interruptions)
    return models, groups, version


@pytest.mark.parametrize("temperature, top_k, speculative", [
    (1.0, 0, None), (0.8, 10, None),
    # exact speculative decoding asks the interrupt after every verification round instead of every token
    (1.0, 0, PromptLookupDecoding(num_draft_tokens=3, ngram_min=1, ngram_max=2))])
def test_every_token_has_the_version_and_logprob_of_the_policy_that_sampled_it(temperature, top_k, speculative):
    models, groups, version = run(max_interruptions=2, every=2 if speculative else 4, temperature=temperature,
                                  top_k=top_k, speculative=speculative)
    assert version == 2
    spans = set()
    for group in groups:
        assert len(group.completions) == 3
        for c in group.completions:
            assert isinstance(c, PartialCompletion) and c.finish_reason in ("stop", "length")
            assert c.versions == sorted(c.versions)  # a sample only moves to newer versions
            spans.add(tuple(sorted(set(c.versions))))
            for v in set(c.versions):
                at = torch.tensor([u == v for u in c.versions])
                # each token's log-prob under the policy of ITS version, teacher-forced over the whole prefix
                reference = teacher_forced(models[v], group.prompt_token_ids, c.token_ids, temperature, top_k)
                assert torch.allclose(torch.tensor(c.logprobs)[at], reference[at], atol=1e-5), (v, c.versions)
                if v > 0:  # control: the tokens of v are not those of the version before (a stale tag would fail)
                    before = teacher_forced(models[v - 1], group.prompt_token_ids, c.token_ids, temperature, top_k)
                    assert (before[at] - reference[at]).abs().max() > 1e-2
    assert (0, 1, 2) in spans  # some samples were interrupted twice and ran under three versions


def test_max_interruptions_bounds_the_versions_of_a_sample():
    _, groups, version = run(max_interruptions=1)
    completions = [c for g in groups for c in g.completions]
    assert version == 1 and max(c.interruptions for c in completions) == 1
    assert {v for c in completions for v in c.versions} == {0, 1}
    assert all(c.interruptions == len(set(c.versions)) - 1 for c in completions if len(c.token_ids) > 4)


def test_without_a_new_version_the_samples_are_those_of_plain_generation():
    """max_interruptions 0 (or no version arriving): one generate call, exactly the engine's own samples."""
    _, groups, version = run(max_interruptions=0)
    plain = HFRolloutEngine(tiny_model(0), max_batch_size=16).generate(
        PROMPTS, 3, SamplingParams(max_new_tokens=16, seed=7))
    assert version == 0
    for g, p in zip(groups, plain):
        for c, q in zip(g.completions, p.completions):
            assert c.token_ids == q.token_ids and c.logprobs == q.logprobs and set(c.versions) <= {0}


def test_the_engine_stops_running_rows_at_a_token_boundary():
    engine = HFRolloutEngine(tiny_model(0), max_batch_size=4)
    asked = []

    def interrupt():
        asked.append(1)
        return len(asked) >= 5

    groups = engine.generate(PROMPTS, 2, SamplingParams(max_new_tokens=16, seed=3), interrupt=interrupt)
    completions = [c for g in groups for c in g.completions]
    assert {c.finish_reason for c in completions} <= {"stop", INTERRUPTED}
    assert INTERRUPTED in {c.finish_reason for c in completions}
    first_chunk = [c for g in groups[:2] for c in g.completions][:4]  # max_batch_size 4: the first call's rows
    assert all(len(c.token_ids) <= 5 for c in first_chunk)


def test_offpolicy_mask_keeps_the_last_segment():
    assert offpolicy_mask([0, 0, 1, 1, 2]) == [0, 0, 0, 0, 1]
    assert offpolicy_mask([4, 4]) == [1, 1]


def test_speculative_rows_stopped_by_an_interrupt_are_not_read_as_stopped_when_pad_is_eos():
    """Speculation ends rows after different numbers of tokens, so an interrupted row is padded; with the pad id
    equal to EOS (common), the padding must not read as a sampled EOS (finish "stop", a log-prob of 0)."""
    engine = HFRolloutEngine(tiny_model(0), max_batch_size=16, pad_token_id=EOS,
                             speculative=PromptLookupDecoding(num_draft_tokens=3, ngram_min=1, ngram_max=2))
    asked = []

    def interrupt():
        asked.append(1)
        return len(asked) >= 3

    groups = engine.generate(PROMPTS, 4, SamplingParams(max_new_tokens=16, seed=3), interrupt=interrupt)
    completions = [c for g in groups for c in g.completions]
    assert len({len(c.token_ids) for c in completions}) > 1  # unequal lengths: the case with padding
    assert INTERRUPTED in {c.finish_reason for c in completions}
    for c in completions:
        assert all(lp < 0 for lp in c.logprobs)  # every token was sampled (a pad would carry log-prob 0)
        assert (c.finish_reason == "stop") == (bool(c.token_ids) and c.token_ids[-1] == EOS)
