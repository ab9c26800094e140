"""Exact speculative decoding in the HF engine (rollout/speculative.py).

The key property: with prompt-lookup drafts, completions have exactly the distribution of plain sampling. A
chi-square homogeneity test compares the completion frequencies of many seeded draws with and without speculation,
on a tiny model whose drafts are often right (a near-Markov chain that continues the prompt's counting pattern with
probability 0.75, so most drafts are accepted), and the same test must reject a lenient acceptance rule (accept a
draft when the target gives it probability > 0.5: the rule some "relaxed" verifiers use). The behaviour log-probs
are the target's: equal to a teacher-forced forward on the produced tokens (on a full-strength random model, so
that a wrongly rolled-back KV cache would show)."""
import math
from collections import Counter

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from _sampling_reference import teacher_forced  # isort: skip
from megatron_dppo.rollout import HFRolloutEngine, SamplingParams
from megatron_dppo.rollout.speculative import PromptLookupDecoding, hf_speculative, vllm_speculative_config

EOS, VOCAB, HIDDEN = 3, 16, 32
CYCLE = list(range(4, VOCAB))  # the counting pattern: 4, 5, ..., 15, 4, 5, ...
FOLLOW = 0.75  # probability that the chain continues the pattern


def counting_model(context: float = 0.1, seed: int = 0, follow: float = FOLLOW, hidden: int = HIDDEN, heads: int = 4):
    """A tiny Llama that is nearly a Markov chain: token x -> the next token of CYCLE with probability 0.75, any
    other non-special token or EOS otherwise. Embeddings are one-hot, the output layer holds the log transition
    matrix; the attention and MLP outputs are scaled by ``context`` (not 0: the distribution still depends on the
    whole history, through the KV cache). ``hidden``, ``heads``: vLLM's CPU attention needs a head size of 64."""
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 2),
                         max_position_embeddings=128, eos_token_id=EOS, pad_token_id=0, bos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    transition = torch.full((VOCAB, VOCAB), 1e-6)
    for i, x in enumerate(CYCLE):
        others = [y for y in CYCLE + [EOS] if y != CYCLE[(i + 1) % len(CYCLE)]]
        transition[x, others] = (1 - follow) / len(others)
        transition[x, CYCLE[(i + 1) % len(CYCLE)]] = follow
    transition[:4, CYCLE] = 1.0 / len(CYCLE)
    transition = transition / transition.sum(1, keepdim=True)
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :VOCAB] = torch.eye(VOCAB)
        model.lm_head.weight.zero_()
        model.lm_head.weight[:, :VOCAB] = transition.log().T / math.sqrt(hidden)  # RMSNorm(one-hot) = sqrt(H) e_x
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(context)
            layer.mlp.down_proj.weight.mul_(context)
    return model


def random_model(seed=0):
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, eos_token_id=EOS,
                         pad_token_id=0, bos_token_id=2)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


class ThresholdAcceptance(PromptLookupDecoding):
    """The control: a lenient verifier that accepts a draft token whenever the target gives it probability > 0.5,
    without comparing it with the target's sample (biased: it keeps a 0.75-probability draft every time)."""

    def accepted(self, samples, drafts, draft_len, draft_probs):
        valid = torch.arange(drafts.shape[1])[None, :] < draft_len[:, None]
        return ((draft_probs > 0.5) & valid).long().cumprod(dim=1).sum(dim=1)


def completion_counts(engine, prompt, n, sampling):
    return Counter(tuple(c.token_ids) for c in engine.generate([prompt], n=n, sampling=sampling)[0].completions)


def homogeneity_p_value(a: Counter, b: Counter, min_expected: float = 5.0) -> float:
    """p-value of Pearson's chi-square test that two samples come from one distribution (2 x C table; categories
    whose expected count is below ``min_expected`` in either sample are pooled into one)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = set(a) | set(b)
    cells, pooled = [], [0, 0]
    for key in keys:
        total = a[key] + b[key]
        if total * min(na, nb) / (na + nb) < min_expected:
            pooled[0] += a[key]
            pooled[1] += b[key]
        else:
            cells.append((a[key], b[key]))
    if sum(pooled):
        cells.append(tuple(pooled))
    chi2 = 0.0
    for x, y in cells:
        total = x + y
        ex, ey = total * na / (na + nb), total * nb / (na + nb)
        chi2 += (x - ex) ** 2 / ex + (y - ey) ** 2 / ey
    dof = len(cells) - 1
    if dof == 0:
        return 1.0  # one category: nothing to tell apart
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(chi2 / 2, dtype=torch.float64)))


PROMPT = [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 4, 5, 6]  # the pattern twice: prompt lookup drafts 7, 8, 9
DRAWS = 4000
ALPHA = 1e-3  # the test's false-alarm rate; the control must fall far below it


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (1.2, 6, 0.95)])
def test_speculation_keeps_the_sampled_distribution_and_a_lenient_rule_is_caught(temperature, top_k, top_p):
    model = counting_model()
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=4, seed=11)
    plain = completion_counts(HFRolloutEngine(model, max_batch_size=DRAWS), PROMPT, DRAWS, sampling)
    exact = PromptLookupDecoding(num_draft_tokens=3, ngram_min=1, ngram_max=2)
    spec = completion_counts(HFRolloutEngine(model, max_batch_size=DRAWS, speculative=exact), PROMPT, DRAWS,
                             SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=4,
                                            seed=12))
    assert exact.stats.acceptance_rate > 0.5, exact.stats  # drafts are often right: the test has teeth
    assert exact.stats.accepted > DRAWS  # more than one token per completion came without a forward of its own
    lenient = ThresholdAcceptance(num_draft_tokens=3, ngram_min=1, ngram_max=2)
    biased = completion_counts(HFRolloutEngine(model, max_batch_size=DRAWS, speculative=lenient), PROMPT, DRAWS,
                               SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=4,
                                              seed=13))
    assert homogeneity_p_value(spec, plain) > ALPHA
    assert homogeneity_p_value(biased, plain) < 1e-9


def test_two_plain_samples_pass_the_homogeneity_test_and_different_models_fail_it():
    """The statistic itself: calibrated on two plain samples, powerful against a slightly different chain (the
    pattern continued with probability 0.7 instead of 0.75)."""
    sampling = SamplingParams(max_new_tokens=4, seed=1)
    a = completion_counts(HFRolloutEngine(counting_model(), max_batch_size=DRAWS), PROMPT, DRAWS, sampling)
    b = completion_counts(HFRolloutEngine(counting_model(), max_batch_size=DRAWS), PROMPT, DRAWS,
                          SamplingParams(max_new_tokens=4, seed=2))
    other = completion_counts(HFRolloutEngine(counting_model(follow=0.7), max_batch_size=DRAWS), PROMPT, DRAWS,
                              SamplingParams(max_new_tokens=4, seed=3))
    assert homogeneity_p_value(a, b) > ALPHA
    assert homogeneity_p_value(a, other) < 1e-9


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, -1, 1.0), (0.7, 12, 0.9)])
def test_behaviour_logprobs_are_the_target_models_teacher_forced(temperature, top_k, top_p):
    """Every emitted token's log-prob equals a teacher-forced forward of the target over the produced tokens, over
    prompts of different lengths (left padding), shared prefills and rows leaving the batch at different rounds."""
    model = random_model()
    prompts = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7], [9, 10, 9, 10, 9], [11]]
    speculative = PromptLookupDecoding(num_draft_tokens=4, ngram_min=1, ngram_max=3)
    engine = HFRolloutEngine(model, max_batch_size=8, speculative=speculative)
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, seed=5)
    worst, lengths = 0.0, set()
    for group in engine.generate(prompts, n=6, sampling=sampling):
        for c in group.completions:
            reference = teacher_forced(model, group.prompt_token_ids, c.token_ids, temperature, max(top_k, 0), top_p)
            worst = max(worst, (reference - torch.tensor(c.logprobs)).abs().max().item())
            lengths.add(len(c.token_ids))
            assert c.finish_reason == ("stop" if c.token_ids[-1] == EOS else "length")
            assert EOS not in c.token_ids[:-1] and len(c.token_ids) <= 16
    assert speculative.stats.accepted > 0 and speculative.stats.proposed > speculative.stats.accepted
    assert len(lengths) > 1  # rows finished at different rounds
    assert worst < 1e-5, worst


def test_the_kv_cache_is_rolled_back_per_row():
    """Rows accepting different numbers of drafts in one round: their later log-probs still equal a teacher-forced
    forward (a cache that kept a rejected draft position would shift every later logit)."""
    model = counting_model(context=1.0)  # full-strength attention: the history matters
    speculative = PromptLookupDecoding(num_draft_tokens=3, ngram_min=1, ngram_max=2)
    engine = HFRolloutEngine(model, max_batch_size=64, speculative=speculative, share_prompt_prefill=False)
    groups = engine.generate([PROMPT, PROMPT[3:]], n=16, sampling=SamplingParams(max_new_tokens=12, seed=3))
    for group in groups:
        for c in group.completions:
            reference = teacher_forced(model, group.prompt_token_ids, c.token_ids)
            assert torch.allclose(reference, torch.tensor(c.logprobs), atol=1e-5)
    assert 0 < speculative.stats.accepted < speculative.stats.proposed


def test_prompt_lookup_drafts_continue_the_latest_match_of_the_longest_ngram():
    lookup = PromptLookupDecoding(num_draft_tokens=3, ngram_min=1, ngram_max=2)
    assert lookup.draft([1, 2, 9, 1, 2, 7, 8, 2], 3) == [7, 8, 2]  # "2": latest earlier occurrence is at index 4
    assert lookup.draft([1, 2, 9, 5, 1, 2, 7, 1, 2], 3) == [7, 1, 2]  # "1 2" matched, the latest one first
    assert lookup.draft([1, 2, 3], 3) == []  # nothing repeats
    assert lookup.draft([4, 5, 4, 5, 6, 4], 5) == [5, 6, 4]  # at most num_draft_tokens
    assert lookup.draft([4, 5, 4], 1) == [5] and lookup.draft([4, 5, 4], 0) == []


def test_options_are_checked_and_methods_refused_by_name():
    assert hf_speculative("none", 4, 1, 3) is None
    assert isinstance(hf_speculative("ngram", 4, 1, 3), PromptLookupDecoding)
    with pytest.raises(ValueError, match="method='suffix' is invalid with rollout.engine=hf"):
        hf_speculative("suffix", 4, 1, 3)
    with pytest.raises(ValueError, match="ngram_min"):
        PromptLookupDecoding(4, 3, 2)
    assert vllm_speculative_config("ngram", 5, 2, 4) == {"method": "ngram", "num_speculative_tokens": 5,
                                                          "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    with pytest.raises(ValueError, match="method='mtp' needs a model with multi-token-prediction layers"):
        vllm_speculative_config("mtp", 4, 1, 3, {"model_type": "llama"})
    assert vllm_speculative_config("mtp", 2, 1, 3, {"num_nextn_predict_layers": 1})["method"] == "mtp"
    with pytest.raises(ValueError, match="method='eagle' needs a trained EAGLE draft model"):
        vllm_speculative_config("eagle", 4, 1, 3)


def test_the_config_section_loads_from_yaml_and_command_line_overrides(tmp_path):
    import yaml

    from megatron_dppo.config import load_config
    from megatron_dppo.config.speculative import SPECULATIVE_METHODS as CONFIG_METHODS
    from megatron_dppo.rollout.speculative import SPECULATIVE_METHODS

    assert CONFIG_METHODS == SPECULATIVE_METHODS
    repo = __import__("pathlib").Path(__file__).resolve().parents[2]
    data = yaml.safe_load((repo / "examples" / "quickstart.yaml").read_text())
    data.setdefault("rollout", {})["speculative"] = {"method": "ngram", "num_draft_tokens": 6}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    spec = load_config(path, ["rollout.speculative.ngram_max=5"]).rollout.speculative
    assert (spec.method, spec.num_draft_tokens, spec.ngram_min, spec.ngram_max) == ("ngram", 6, 1, 5)
    assert load_config(repo / "examples" / "quickstart.yaml").rollout.speculative.method == "none"
    with pytest.raises(ValueError, match="rollout.speculative.method='suffix' is invalid: expected none or ngram with "
                                         "rollout.engine=hf"):
        load_config(path, ["rollout.speculative.method=suffix"])
    with pytest.raises(ValueError, match="rollout.speculative.ngram_max=0 is invalid"):
        load_config(path, ["rollout.speculative.ngram_max=0"])
    with pytest.raises(ValueError, match="rollout.speculative.num_draft_tokens=0 is invalid"):
        load_config(path, ["rollout.speculative.num_draft_tokens=0"])


def test_vllm_methods_are_refused_on_cpu_and_suffix_without_arctic_inference():
    import importlib.util

    from megatron_dppo.rollout.speculative import VLLM_CPU_NOT_EXACT

    for method in ("ngram", "suffix", "mtp", "eagle"):
        with pytest.raises(ValueError, match="not exact on CPU") as err:
            vllm_speculative_config(method, 4, 1, 3, {"num_nextn_predict_layers": 1}, on_cpu=True)
        assert VLLM_CPU_NOT_EXACT in str(err.value)
    assert vllm_speculative_config("none", 4, 1, 3, on_cpu=True) is None
    if importlib.util.find_spec("arctic_inference") is None:
        with pytest.raises(ValueError, match="method='suffix' needs the arctic-inference package"):
            vllm_speculative_config("suffix", 4, 1, 3)
