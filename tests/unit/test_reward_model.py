"""Reward models (issue 33): what the reward model reads, how it is scored, and what happens when it fails.

Properties: a classifier's score does not depend on the other inputs of its batch, their order or the padding
(fp32, <= 1e-5), and transformers' own pooling is the wrong token where pad == EOS (why the engine pools itself);
the policy's ids and the chat re-render agree on completions that stopped (and differ, as documented, on a
truncated one); a judge's probability of yes is exactly the log-odds of a direct forward pass; group mode makes a
completion's score depend on its siblings; a failing, hanging or non-finite reward model never scores 0 silently.
"""
from __future__ import annotations

import math
import time

import pytest
import torch
from _reward_models import TASK, arithmetic_tokenizer, judge_tokenizer, random_classifier, random_judge

from megatron_dppo.data import PromptFormatter
from megatron_dppo.rewards.hf_model import HFRewardEngine, load_tokenizer
from megatron_dppo.rewards.model import JudgeOptions, RewardModel, RewardModelError, parse_verdict, yes_probability
from megatron_dppo.rewards.model_inputs import InputBuilder, Sample, resolve_template, same_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return arithmetic_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, tok):
    return random_classifier(tmp_path_factory.mktemp("rm"), tok)


@pytest.fixture(scope="module")
def judge(tmp_path_factory):
    folder = tmp_path_factory.mktemp("judge")
    return random_judge(folder, judge_tokenizer(folder / "tok"))


def samples(tok, n=12, template="raw", seed=0, stop=True):
    """Arithmetic prompts with answers of several lengths, as the policy would hand them over."""
    fmt = PromptFormatter(tok, template=template)
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        record = TASK.record(i)
        answer = str(int(record.gold) + int(torch.randint(-3, 4, (1,), generator=g))) * int(1 + i % 3)
        ids = list(tok(answer, add_special_tokens=False)["input_ids"]) + ([tok.eos_token_id] if stop else [])
        out.append(Sample(fmt.encode(record.prompt), ids, record.prompt, answer))
    return out


# ----------------------------------------------------------------------------------------------------------------
# Batch invariance
# ----------------------------------------------------------------------------------------------------------------
def test_classifier_scores_do_not_depend_on_batch_order_or_padding(classifier, tok):
    rm = RewardModel(HFRewardEngine(classifier, batch_size=64), tok, tok)
    batch = samples(tok, 12)
    alone = torch.tensor([rm.score([[s]]).scores[0][0] for s in batch], dtype=torch.float64)
    together = torch.tensor(rm.score([batch]).scores[0], dtype=torch.float64)
    perm = torch.randperm(len(batch), generator=torch.Generator().manual_seed(1)).tolist()
    shuffled = torch.tensor(rm.score([[batch[i] for i in perm]]).scores[0], dtype=torch.float64)
    # padding: the same inputs next to much longer ones (every input padded by >= 20 tokens)
    long = [Sample(s.prompt_ids, list(s.completion_ids) * 8, s.prompt_text, s.completion_text * 8) for s in batch]
    padded = torch.tensor(rm.score([batch + long]).scores[0][:len(batch)], dtype=torch.float64)
    small = RewardModel(HFRewardEngine(classifier, batch_size=5), tok, tok)
    chunked = torch.tensor(small.score([batch[:7], batch[7:]]).scores[0] + small.score([batch[7:]]).scores[0],
                           dtype=torch.float64)
    assert alone.std() > 1e-3  # the inputs do score differently
    for other in (together, padded, chunked):
        assert (other - alone).abs().max() <= 1e-5
    assert (shuffled - together[perm]).abs().max() <= 1e-5


def test_transformers_own_pooling_reads_the_wrong_token_when_pad_is_eos(tmp_path, tok):
    """Why the engine pools at each input's length: *ForSequenceClassification pools at the last token that is not
    pad_token_id, which is the token BEFORE the EOS when a tokenizer pads with its EOS (TRL sets pad = eos when a
    tokenizer has none). The engine's score is the head at the EOS itself."""
    from transformers import AutoModelForSequenceClassification

    folder = random_classifier(tmp_path / "rm", tok, pad_token_id=tok.eos_token_id)
    s = samples(tok, 1)[0]
    ids = list(s.prompt_ids) + list(s.completion_ids)  # ends with EOS
    ours = HFRewardEngine(folder).classify([ids])[0]
    model = AutoModelForSequenceClassification.from_pretrained(folder, local_files_only=True).eval()
    with torch.no_grad():
        pooled_by_hf = model(torch.tensor([ids])).logits[0, 0]
        before_eos = model(torch.tensor([ids[:-1]])).logits[0, 0]
    assert float(pooled_by_hf) == pytest.approx(float(before_eos), abs=1e-5)  # HF skipped the EOS
    assert abs(float(ours) - float(pooled_by_hf)) > 1e-3


# ----------------------------------------------------------------------------------------------------------------
# Token reuse vs re-render
# ----------------------------------------------------------------------------------------------------------------
def test_token_reuse_and_chat_rerender_agree_on_stopped_completions(classifier, tok):
    batch = samples(tok, 10, template="chat")
    reuse, chat = InputBuilder("tokens", tok), InputBuilder("chat", tok)
    assert [reuse.classifier_input(s) for s in batch] == [chat.classifier_input(s) for s in batch]
    engine = HFRewardEngine(classifier)
    a = RewardModel(engine, tok, tok, template="tokens").score([batch]).scores[0]
    b = RewardModel(engine, tok, tok, template="chat").score([batch]).scores[0]
    assert a == pytest.approx(b, abs=1e-6)
    # a completion cut by max_new_tokens has no end of turn; the chat re-render adds one (documented)
    cut = samples(tok, 3, template="chat", stop=False)
    assert all(chat.classifier_input(s) == reuse.classifier_input(s) + [tok.eos_token_id] for s in cut)


def test_template_auto_reuses_ids_only_for_the_same_tokenizer(tmp_path, tok):
    other = judge_tokenizer(tmp_path / "other")  # another vocabulary (the judge's words as pieces)
    tok.save_pretrained(tmp_path / "same")
    same = load_tokenizer(tmp_path / "same")  # the same tokenizer, another object
    assert same_tokenizer(tok, same) and not same_tokenizer(tok, other)
    assert resolve_template("auto", same, tok) == "tokens"
    assert resolve_template("auto", other, tok) == "chat"  # (it has a chat template)
    other.chat_template = None
    assert resolve_template("auto", other, tok) == "text"
    with pytest.raises(ValueError, match="differs from the policy"):
        resolve_template("tokens", other, tok)


def test_an_input_past_the_reward_model_vocabulary_is_named(tok):
    builder = InputBuilder("tokens", tok, vocab_size=20)
    with pytest.raises(ValueError, match="past the reward model's 20 embedding rows"):
        builder.classifier_input(Sample([1, 2], [40], "", ""))


# ----------------------------------------------------------------------------------------------------------------
# Judges
# ----------------------------------------------------------------------------------------------------------------
def test_judge_probability_of_yes_is_the_log_odds_of_a_direct_forward(judge):
    from transformers import AutoModelForCausalLM

    jtok = load_tokenizer(judge)
    rm = RewardModel(HFRewardEngine(judge, "judge", batch_size=3), jtok, kind="judge")
    batch = [Sample([], [], TASK.record(i).prompt, a) for i, a in enumerate(["3", "17", "", "42", "5"])]
    scores = rm.score([batch]).scores[0]
    model = AutoModelForCausalLM.from_pretrained(judge, local_files_only=True).eval()
    yes, no = jtok.convert_tokens_to_ids("yes"), jtok.convert_tokens_to_ids("no")
    for s, score in zip(batch, scores):
        question = f"Question: {s.prompt_text}\nAnswer: {s.completion_text}\nIs the answer correct? Reply yes or no."
        text = jtok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                        add_generation_prompt=True)
        ids = torch.tensor([jtok(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, -1].double(), dim=-1)
        assert math.log(score / (1 - score)) == pytest.approx(float(logp[yes] - logp[no]), abs=1e-5)
    assert max(scores) - min(scores) > 1e-3


def test_group_mode_shows_the_judge_the_whole_group(judge):
    jtok = load_tokenizer(judge)
    engine = HFRewardEngine(judge, "judge")
    group = [Sample([], [], "2+3=", a) for a in ["5", "6", "7"]]
    changed = group[:2] + [Sample([], [], "2+3=", "9")]
    grouped = RewardModel(engine, jtok, kind="judge", judge=JudgeOptions(group=True))
    single = RewardModel(engine, jtok, kind="judge")
    assert grouped.score([group]).scores[0][0] != pytest.approx(grouped.score([changed]).scores[0][0], abs=1e-6)
    assert single.score([group]).scores[0][0] == pytest.approx(single.score([changed]).scores[0][0], abs=1e-6)
    with pytest.raises(ValueError, match="index"):
        JudgeOptions(group=True, template="{prompt} {completion}")


def test_sampled_verdicts_are_parsed_seeded_and_counted_when_unparsable(judge):
    assert parse_verdict("Score: 3, no wait, 7.5") == 7.5 and parse_verdict("no number") is None
    jtok = load_tokenizer(judge)
    rm = RewardModel(HFRewardEngine(judge, "judge"), jtok, kind="judge",
                     judge=JudgeOptions(mode="verdict", max_new_tokens=6, unparsed_score=-1.0))
    batch = [[Sample([], [], "2+3=", a) for a in ["5", "6", "7", "8"]]]
    first, again = rm.score(batch, seed=3), rm.score(batch, seed=3)
    assert first.scores == again.scores  # the seed fixes the verdicts
    flat = first.scores[0]
    assert first.unparsed == sum(s == -1.0 for s in flat)  # a random judge writes few numbers: counted, scored -1


def test_judge_tokens_must_be_single_tokens(judge):
    jtok = load_tokenizer(judge)
    with pytest.raises(ValueError, match="one token each"):
        RewardModel(HFRewardEngine(judge, "judge"), jtok, kind="judge", judge=JudgeOptions(tokens=("yes!?", "no")))
    assert yes_probability(torch.tensor([[0.0, 0.0], [-1.0, -3.0]])).tolist() == pytest.approx(
        [0.5, 1 / (1 + math.exp(-2.0))])


# ----------------------------------------------------------------------------------------------------------------
# Failures
# ----------------------------------------------------------------------------------------------------------------
class FailingEngine(HFRewardEngine):
    """The real HF engine, made to raise, hang or return NaN on purpose (fault injection)."""

    def __init__(self, path, fault):
        super().__init__(path)
        self.fault = fault

    def classify(self, inputs):
        if self.fault == "raise":
            raise RuntimeError("CUDA error: device-side assert triggered")
        if self.fault == "hang":
            time.sleep(30)
        scores = super().classify(inputs)
        if self.fault == "nan":
            scores[1] = float("nan")
        return scores


@pytest.mark.parametrize("fault, message", [("raise", "RuntimeError: CUDA error"),
                                            ("nan", "non-finite score nan for completion 1"),
                                            ("hang", "longer than reward.model.timeout_s=1s")])
def test_a_failing_reward_model_returns_its_error_never_zeros(classifier, tok, fault, message):
    rm = RewardModel(FailingEngine(classifier, fault), tok, tok, name="my-rm", timeout_s=1.0)
    start = time.perf_counter()
    result = rm.score([samples(tok, 4)], label="step 7, 1 prompts p1")
    assert result.scores is None and message in result.error
    assert "'my-rm'" in result.error and "step 7, 1 prompts p1" in result.error
    assert time.perf_counter() - start < 10  # the hang was abandoned at the timeout


def _side(tmp_path, tok, classifier, engine=None, **model_options):
    from megatron_dppo.config import load_config
    from megatron_dppo.rewards import RewardScorer
    from megatron_dppo.rollout.handover import MemoryHandover
    from megatron_dppo.run.state import RolloutSide

    options = [f"reward.model.{k}={v}" for k, v in {"path": str(classifier), **model_options}.items()]
    cfg = load_config("examples/quickstart.yaml", [f"train.output_dir={tmp_path}", *options])
    rm = RewardModel(engine or HFRewardEngine(classifier), tok, tok, name=str(classifier))
    return RolloutSide(cfg=cfg, tokenizer=tok, engine=None, handover=MemoryHandover(None, lambda: iter(())),
                       eos_ids=[tok.eos_token_id], scorer=RewardScorer("arithmetic"), train_prompts=[], sampler=None,
                       pruner=None, reward_model=rm)


def _rollout(tok, n_prompts=3, G=4):
    from megatron_dppo.data import Prompt
    from megatron_dppo.train.rollouts import Rollout

    prompts, comps, texts = [], [], []
    for i in range(n_prompts):
        r = TASK.record(i)
        prompts.append(Prompt(r.id, list(tok(r.prompt)["input_ids"]), r.gold, r.prompt))
        answers = [r.gold if j == 0 else str(int(r.gold) + j) for j in range(G)]
        texts.append(answers)
        comps.append([list(tok(a, add_special_tokens=False)["input_ids"]) + [tok.eos_token_id] for a in answers])
    return Rollout(prompts=prompts, completions=comps, texts=texts, behaviour_logprobs=[[None] * G] * n_prompts,
                   truncated=[[False] * G] * n_prompts)


def test_training_reward_combines_model_and_rule_by_their_weights(tmp_path, tok, classifier):
    from megatron_dppo.train.rollouts import score

    side = _side(tmp_path, tok, classifier, weight=0.5, rule_weight=2.0)
    rollout = _rollout(tok)
    rewards = score(side, rollout, step=0)
    assert rollout.rule_rewards[:, 0].tolist() == [1.0, 1.0, 1.0] and rollout.rule_rewards[:, 1:].sum() == 0
    assert torch.allclose(rewards, 0.5 * rollout.model_rewards + 2.0 * rollout.rule_rewards)
    direct = side.reward_model.score([[Sample(p.token_ids, c, p.text, t) for c, t in zip(cs, ts)] for p, cs, ts in
                                      zip(rollout.prompts, rollout.completions, rollout.texts)]).scores
    assert torch.allclose(rollout.model_rewards, torch.tensor(direct))
    # episodes: the environment's step rewards add unweighted, beside the weighted model and rule (they were scaled
    # by rule_weight as part of the rule reward, and dropped at the default rule_weight 0)
    for rule_weight in (2.0, 0.0):
        side = _side(tmp_path, tok, classifier, weight=0.5, rule_weight=rule_weight)
        rollout = _rollout(tok)
        env = torch.tensor([[0.25, -0.5, 0.0, 1.0]] * 3)
        rollout.env_rewards = lambda: env
        rewards = score(side, rollout, step=0)
        assert rollout.rule_rewards[:, 0].tolist() == [1.0, 1.0, 1.0] and rollout.rule_rewards[:, 1:].sum() == 0
        assert torch.allclose(rewards, 0.5 * rollout.model_rewards + rule_weight * rollout.rule_rewards + env)


def test_a_failing_reward_model_stops_the_run_naming_model_and_batch(tmp_path, tok, classifier):
    from megatron_dppo.train.rollouts import score

    side = _side(tmp_path, tok, classifier, engine=FailingEngine(classifier, "raise"))
    with pytest.raises(RewardModelError) as err:
        score(side, _rollout(tok), step=5)
    text = str(err.value)
    assert str(classifier) in text and "step 5" in text and "arith-train-0" in text and "CUDA error" in text
    zero = _side(tmp_path, tok, classifier, engine=FailingEngine(classifier, "raise"), on_error="zero")
    rollout = _rollout(tok)
    rewards = score(zero, rollout, step=5)
    assert rewards.abs().sum() == 0 and rollout.reward_model_failed == 3
