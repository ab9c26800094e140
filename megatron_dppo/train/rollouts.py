"""Rollouts: G completions per prompt from the rollout engine, sharded over ranks and gathered on all, and their
rewards. The primitives of the rollout side, used by the step (``draw.py``), DAPO's refill rounds (``dapo.py``)
and evaluation (``evaluation.py``); each takes the :class:`~megatron_dppo.run.state.RolloutSide` or less.

With an ``env`` section a completion is a multi-turn EPISODE (``rollout.episodes.generate_episodes``: assistant
turns and the environment's observations in one token stream with a loss mask); everything downstream reads it
through the same :class:`Rollout` (the stream as the completion, the last assistant turn as the text the reward
scores, the trained tokens as its length). Without one, nothing here differs from a single-turn run.

Sampling seeds come from (seed, step, tag, shard), environment seeds from (seed, step, tag, "env", shard), so a
resumed run regenerates exactly what a straight run would have; rewards are scored on shards and gathered, so
every rank holds the same rewards.

With a reward model (``reward.model.path``) ``score`` also scores every group with it (``score_model``: sharded by
group over the reward model's engines, inside ``scoring_window``, the memory handover), and the training reward is
``reward.model.weight * model + reward.model.rule_weight * rule``; both parts stay on the rollout for the metrics.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from megatron_dppo.algo.overlong import overlong_penalty
from megatron_dppo.data import Prompt
from megatron_dppo.distributed import collectives as D
from megatron_dppo.rewards.model import RewardModelError
from megatron_dppo.rewards.model_inputs import Sample
from megatron_dppo.rewards.scoring import TIMED_OUT
from megatron_dppo.run.build import rollout_tensor_parallel
from megatron_dppo.run.state import RolloutSide

if TYPE_CHECKING:
    from megatron_dppo.rollout.episodes import Episode


@dataclass
class Rollout:
    """The G completions of every kept prompt, identical on every rank after the gather. A multi-turn episode
    (``episodes`` set) is one completion: its token stream after the prompt, assistant and observation tokens."""

    prompts: list[Prompt]
    completions: list[list[list[int]]]  # [Bk][G] token ids (stop token included; episodes: the whole stream)
    texts: list[list[str]]  # [Bk][G] decoded completions (episodes: the last assistant turn, what the reward scores)
    behaviour_logprobs: list[list[list[float]]]  # [Bk][G] log-probs of the sampled distribution (rollout/base.py),
    #                                              one per TRAINED token (episodes: the sampled tokens, in order)
    truncated: list[list[bool]]  # [Bk][G] finish_reason == "length"
    rewards: torch.Tensor | None = None  # [Bk, G] float32 (episodes: reward.fn of the text + the env's reward)
    reward_failures: int = 0  # samples scored 0 because the reward function failed (all ranks)
    reward_timeouts: int = 0  # of which timed out (reward.timeout_s or reward.step_budget_s)
    rule_rewards: torch.Tensor | None = None  # [Bk, G] the rule reward (reward.fn) alone, set by ``score``
    model_rewards: torch.Tensor | None = None  # [Bk, G] the reward model's scores, when it is set
    reward_model_seconds: float = 0.0  # scoring time of the reward model (the slowest shard)
    reward_model_failed: int = 0  # groups scored 0 because the reward model failed (reward.model.on_error=zero)
    reward_model_unparsed: int = 0  # judge verdicts without a score (reward.model.unparsed_score)
    episodes: list[list[Episode]] | None = None  # [Bk][G] the multi-turn episodes (env); None = single-turn
    token_versions: list[list[list[int]]] | None = None  # [Bk][G] partial rollouts (rollout.max_interruptions):
    #                                    the weight version that sampled each token; None = the batch's one version
    mask_offpolicy: bool = False  # rollout.mask_offpolicy: loss_masks trains only each sample's last version
    slots: torch.Tensor | None = None  # [Bk, G] bool: the slots generated (algo.pruner=adaptive: n_q of G; the
    #                                    others are empty placeholders, reward 0, in no statistic); None = all G

    @property
    def group_size(self) -> int:
        return len(self.completions[0]) if self.completions else 0

    @property
    def loss_masks(self) -> list[list[list[int]]] | None:
        """[Bk][G] per-token 0/1 masks of the completions (1 = sampled, trained; 0 = observation); None for
        single-turn completions (every token trained)."""
        if self.mask_offpolicy and self.token_versions is not None:
            from megatron_dppo.rollout.partial import offpolicy_mask
            return [[offpolicy_mask(v) for v in versions] for versions in self.token_versions]
        return None if self.episodes is None else [[e.loss_mask for e in eps] for eps in self.episodes]

    @property
    def finish_reasons(self) -> list[list[str]] | None:
        """[Bk][G] each episode's finish reason (env.protocol.FINISH_REASONS); None for single-turn completions."""
        return None if self.episodes is None else [[e.finish_reason for e in eps] for eps in self.episodes]

    def env_rewards(self) -> torch.Tensor | None:
        """[Bk, G] float32 sum of each episode's environment step rewards; None for single-turn completions."""
        if self.episodes is None:
            return None
        return torch.tensor([[e.reward for e in eps] for eps in self.episodes], dtype=torch.float32) \
            .view(len(self.episodes), self.group_size or 1)

    def lengths(self) -> torch.Tensor:
        """[Bk, G] TRAINED tokens of each completion (float64): its length, or an episode's sampled tokens. What
        every token count of the loss uses (token weights, denominators, the overlong penalty)."""
        if self.episodes is not None:
            return torch.tensor([[e.num_trained for e in eps] for eps in self.episodes], dtype=torch.float64) \
                .view(len(self.episodes), self.group_size or 1)
        return torch.tensor([[len(c) for c in comps] for comps in self.completions], dtype=torch.float64)

    def prompt_ids(self, row: int, i: int) -> list[int]:
        """The prompt completion ``i`` of row ``row`` was sampled from: the data set's prompt, or an episode's own
        (re-rendered with the messages its environment's ``reset`` returned; the G episodes of one prompt may
        differ). Every sequence the trainer and the reward model build starts with it."""
        if self.episodes is not None:
            return list(self.episodes[row][i].prompt_ids)
        return list(self.prompts[row].token_ids)

    def total_tokens(self) -> torch.Tensor:
        """[Bk, G] every token of each sequence (float64): its prompt (``prompt_ids``) + completion (an episode's
        whole stream). What a sequence costs to pack and train: the cost of the cost-aware keep rule
        (algo.dppo_keep_cost=tokens)."""
        return torch.tensor([[len(self.prompt_ids(row, i)) + len(c) for i, c in enumerate(comps)]
                             for row, comps in enumerate(self.completions)], dtype=torch.float64) \
            .view(len(self.prompts), self.group_size or 1)

    def finished(self, group_size: int) -> torch.Tensor:
        """[Bk, G] bool: the completions that ended before their token bound (the ones overlong.filter trains and
        counts in the denominators)."""
        return ~torch.tensor(self.truncated, dtype=torch.bool).view(-1, group_size)


def generate(side: RolloutSide, prompts: list[Prompt], n: int, step: int, temperature: float,
             tag: str = "generate") -> Rollout:
    """n completions per prompt (with an ``env`` section: n episodes); each rank generates a contiguous shard with
    a seed from (seed, step, tag, shard)."""
    from megatron_dppo.rollout import SamplingParams

    cfg = side.cfg

    def generate_shard(shard: list[Prompt], shard_index: int) -> list[tuple]:
        sampling = SamplingParams(temperature=temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                                  max_new_tokens=cfg.rollout.max_new_tokens,
                                  seed=D.derive_seed(cfg.train.seed, step, tag, shard_index) % (1 << 31))
        if side.env_factory is not None:
            env_seed = D.derive_seed(cfg.train.seed, step, tag, "env", shard_index) % (1 << 31)
            return generate_episodes_shard(side, shard, n, sampling, env_seed)
        groups = side.engine.generate([p.token_ids for p in shard], n, sampling)
        out = []
        for group in groups:
            comps = group.completions
            out.append(([c.token_ids for c in comps],
                        [side.tokenizer.decode(strip_stop(c.token_ids, side.eos_ids), skip_special_tokens=True)
                         for c in comps],
                        [c.logprobs for c in comps],
                        [c.finish_reason == "length" for c in comps], None,
                        [getattr(c, "versions", None) for c in comps]))
        return out

    shard_index, num_shards = generation_shards(cfg)
    with generation_window(side):  # wakes the rollout engine (GPU memory handover), sleeps it afterwards
        results = D.map_sharded(generate_shard, prompts, shard_index, num_shards)
    episodes = [r[4] for r in results] if side.env_factory is not None else None
    versions = [r[5] for r in results] if results and len(results[0]) > 5 and results[0][5][0] is not None else None
    return Rollout(prompts=list(prompts), completions=[r[0] for r in results], texts=[r[1] for r in results],
                   behaviour_logprobs=[r[2] for r in results], truncated=[r[3] for r in results], episodes=episodes,
                   token_versions=versions, mask_offpolicy=cfg.rollout.mask_offpolicy and versions is not None)


def generate_slots(side: RolloutSide, prompts: list[Prompt], slots: torch.Tensor, step: int, timer) -> Rollout:
    """Adaptive group sizes: for each of ``prompts`` the completions of its ``slots`` [Bk, G] (n_q of them), generated
    and scored with the prompts of the same n_q together (sampling seeds from (seed, step, "generate/n<n>",
    shard)), laid out in a [Bk][G] rollout whose other slots are empty placeholders (reward 0, not counted:
    ``Rollout.slots``)."""
    G = slots.shape[1]
    sizes = slots.sum(1)
    completions = [[[] for _ in range(G)] for _ in prompts]
    texts = [["" for _ in range(G)] for _ in prompts]
    logprobs = [[[] for _ in range(G)] for _ in prompts]
    truncated = [[False] * G for _ in prompts]
    rewards, rule = torch.zeros(len(prompts), G), torch.zeros(len(prompts), G)
    failures = timeouts = 0
    for n in sorted(set(sizes.tolist()) - {0}):
        rows = (sizes == n).nonzero().flatten().tolist()
        with timer("generate"):
            part = generate(side, [prompts[r] for r in rows], n, step, temperature=side.cfg.rollout.temperature,
                            tag=f"generate/n{n}")
        with timer("reward"):
            part.rewards = score(side, part, step, tag=f"reward/n{n}")
        failures, timeouts = failures + part.reward_failures, timeouts + part.reward_timeouts
        for j, row in enumerate(rows):
            for k, i in enumerate(slots[row].nonzero().flatten().tolist()):
                completions[row][i], texts[row][i] = part.completions[j][k], part.texts[j][k]
                logprobs[row][i], truncated[row][i] = part.behaviour_logprobs[j][k], part.truncated[j][k]
            rewards[row, slots[row]] = part.rewards[j].float()
            rule[row, slots[row]] = part.rule_rewards[j].float()
    return Rollout(prompts=list(prompts), completions=completions, texts=texts, behaviour_logprobs=logprobs,
                   truncated=truncated, rewards=rewards, reward_failures=failures, reward_timeouts=timeouts,
                   rule_rewards=rule, slots=slots.clone())


def generate_episodes_shard(side: RolloutSide, shard: list[Prompt], n: int, sampling, env_seed: int) -> list[tuple]:
    """n multi-turn episodes per prompt of ``shard`` (``rollout.episodes.generate_episodes``; turn 1 is the
    single-turn call with ``sampling``, rollout.max_new_tokens bounds each turn), as the per-prompt tuples of
    ``generate``: the streams, the last assistant turns, the sampled tokens' behaviour log-probs, finish reason
    ``length``, the episodes."""
    from megatron_dppo.env import Task
    from megatron_dppo.rollout.episodes import generate_episodes

    tasks = [Task(id=str(p.id), text=p.text, gold=p.gold, messages=tuple(p.messages)) for p in shard]
    groups = generate_episodes(side.engine, tasks, [p.token_ids for p in shard], n, sampling, side.cfg.env,
                               side.env_factory, side.chat, env_seed=env_seed, stop_token_ids=side.eos_ids)
    out = []
    for episodes in groups:
        out.append(([e.token_ids for e in episodes], [e.final_text for e in episodes],
                    [[lp for lp, m in zip(e.logprobs, e.loss_mask) if m] for e in episodes],
                    [e.finish_reason == "length" for e in episodes], episodes))
    return out


def score(side: RolloutSide, rollout: Rollout, step: int, tag: str = "reward") -> torch.Tensor:
    """The rewards [Bk, G] of ``rollout``: the rule reward (``score_rule``) and, with a reward model, its scores
    (``score_model``) combined as reward.model.weight * model + reward.model.rule_weight * rule (module
    docstring); an episode's environment step rewards add to either, unweighted (the reward model and the rule judge
    the last answer; the environment's rewards are for the steps). ``tag`` keeps the seeds of sampled judge verdicts
    apart between the scorings of a step."""
    rule = score_rule(side.scorer, rollout, side.cfg.train.group_size)
    rollout.rule_rewards = rule  # what counts as solved (reward/pass_rate), whatever else the training reward adds
    env = rollout.env_rewards()
    if side.reward_model is None:
        return rule if env is None else rule + env
    m = side.cfg.reward.model
    with scoring_window(side):
        model = score_model(side, rollout, step, tag)
    rollout.model_rewards = model
    combined = m.weight * model + m.rule_weight * rule if m.rule_weight else m.weight * model
    return combined if env is None else combined + env


def score_rule(scorer: Any, rollout: Rollout, group_size: int) -> torch.Tensor:
    """Rule rewards [Bk, G]: each rank scores a shard of the completions, results gathered on all ranks; a sample
    whose reward function failed scores 0 and is counted in ``rollout.reward_failures`` (and ``reward_timeouts``). An
    episode's rule reward is reward.fn of its last assistant turn alone (its environment's step rewards are part of
    the training reward, ``score``, never of correctness: evaluation and reward/pass_rate read this)."""
    items = [(text, p.gold, f"{p.id}#{i}") for p, texts in zip(rollout.prompts, rollout.texts)
             for i, text in enumerate(texts)]

    def score_shard(shard: list[tuple], _index: int) -> list[tuple[float, str | None]]:
        result = scorer.score([t for t, _, _ in shard], [g for _, g, _ in shard], ids=[i for _, _, i in shard])
        return list(zip(result.rewards, result.errors))

    scored = D.map_sharded(score_shard, items)
    errors = [e for _, e in scored if e is not None]
    rollout.reward_failures = len(errors)
    rollout.reward_timeouts = sum(e.startswith(TIMED_OUT) for e in errors)
    flat = [r for r, _ in scored]
    if not rollout.prompts:
        return torch.zeros(0, group_size)
    return torch.tensor(flat, dtype=torch.float32).view(len(rollout.prompts), rollout.group_size or 1)


def filter_rewards(cfg, rollout: Rollout) -> torch.Tensor:
    """The rewards [Bk, G] whose spread decides whether a group has "one reward for all" (DAPO's dynamic sampling,
    algo.drop_zero_variance_groups): the task reward, or with dynamic_sampling.filter_metric=training the reward
    the advantages see (``training_rewards``)."""
    return training_rewards(cfg, rollout) if cfg.dynamic_sampling.filter_metric == "training" else rollout.rewards


def score_model(side: RolloutSide, rollout: Rollout, step: int, tag: str = "reward") -> torch.Tensor:
    """The reward model's scores [Bk, G]: whole groups sharded over its engines (``engine.shard()``: every rank, or
    the Megatron engine's data-parallel replicas), gathered on all ranks. A failing shard stops the run on every
    rank with one ``RewardModelError`` naming the model and the groups (reward.model.on_error=stop), or scores its
    groups 0 and counts them in ``rollout.reward_model_failed`` (on_error=zero)."""
    rm, cfg = side.reward_model, side.cfg
    groups = reward_model_samples(rollout)
    shard_index, num_shards = rm.engine.shard()

    def score_shard(shard: list[list[Sample]], index: int) -> list[tuple]:
        start, _ = D.shard_bounds(len(groups), num_shards, index)
        ids = [p.id for p in rollout.prompts[start:start + len(shard)]]
        label = f"step {step}, {len(ids)} prompts {', '.join(map(str, ids[:4]))}{', ...' if len(ids) > 4 else ''}"
        result = rm.score(shard, seed=D.derive_seed(cfg.train.seed, step, tag, index) % (1 << 31), label=label)
        extra = (result.seconds, result.unparsed)
        if result.scores is None:
            return [(None, result.error, *extra)] + [(None, result.error, 0.0, 0)] * (len(shard) - 1)
        return [(result.scores[0], None, *extra)] + [(g, None, 0.0, 0) for g in result.scores[1:]]

    scored = D.map_sharded(score_shard, groups, shard_index, num_shards)
    errors = list(dict.fromkeys(e for _, e, _, _ in scored if e is not None))
    if errors and cfg.reward.model.on_error == "stop":
        more = f" (and {len(errors) - 1} more failing shards)" if len(errors) > 1 else ""
        raise RewardModelError(f"{errors[0]}{more}; the run stops (reward.model.on_error=stop: a reward model "
                               "that fails is not scored 0 silently; on_error=zero scores its groups 0 instead)")
    G = rollout.group_size or side.cfg.train.group_size
    rollout.reward_model_failed = sum(g is None for g, _, _, _ in scored)
    rollout.reward_model_seconds = max((s for _, _, s, _ in scored), default=0.0)
    rollout.reward_model_unparsed = sum(u for _, _, _, u in scored)
    rows = [g if g is not None else [0.0] * G for g, _, _, _ in scored]
    return torch.tensor(rows, dtype=torch.float32).view(len(rollout.prompts), G) if rows else torch.zeros(0, G)


def counted_episodes(cfg, rollout: Rollout) -> torch.Tensor | None:
    """[Bk, G] bool: the completions that count in their group's advantage statistics, the loss and the prompt
    state; None when all do (single-turn completions, or env.errors=score). With env.errors=exclude (the default)
    an episode that ended with env_error does not: its environment failed, not the policy (verl's and TRL's tool
    loops do not score infrastructure errors as task failures either). The loss denominator still counts it as a
    unit of the drawn batch, like any unit with no loss term (docs/environments.md, "Environment errors"). Under
    adaptive group sizes (``Rollout.slots``) only the generated slots count."""
    counted = rollout.slots  # adaptive group sizes: only the generated slots count (their placeholders never do)
    if rollout.episodes is not None and cfg.env is not None and cfg.env.errors == "exclude":
        ok = torch.tensor([[e.finish_reason != "env_error" for e in eps] for eps in rollout.episodes],
                          dtype=torch.bool).view(len(rollout.episodes), rollout.group_size or 1)
        counted = ok if counted is None else counted & ok
    return None if counted is None or bool(counted.all()) else counted


def counted_groups(counted: torch.Tensor | None, num_rows: int):
    """(rows, pick) per number n >= 2 of counted members: ``pick(t)`` is ``t`` [Bk, G] restricted to those rows and
    their counted members, [len(rows), n]. All rows with everything counted when ``counted`` is None; a row with
    fewer than 2 counted members is in none (nothing to compare: the prompt state keeps what it had)."""
    if counted is None:
        return [(list(range(num_rows)), lambda t: t)] if num_rows else []
    sizes = counted.sum(dim=1)
    out = []
    for n in sorted(set(sizes.tolist()) - {0, 1}):
        rows = (sizes == n).nonzero().flatten()
        out.append((rows.tolist(), lambda t, rows=rows, n=n: t[rows][counted[rows]].view(len(rows), n)))
    return out


def error_metrics(cfg, rollout: Rollout) -> dict[str, float]:
    """With env.errors=exclude: env/errors_excluded (episodes left out) and env/groups_without_signal (groups left
    with fewer than 2 episodes: advantage 0). Empty otherwise."""
    counted = counted_episodes(cfg, rollout)
    if counted is None:
        return {}
    return {"env/errors_excluded": float((~counted).sum()),
            "env/groups_without_signal": float((counted.sum(dim=1) < 2).sum())}


def reward_model_samples(rollout: Rollout) -> list[list[Sample]]:
    """[Bk][G] what the reward model scores of each completion: its prompt and its answer, whatever the template
    (reward.model.template only decides how the pair is rendered, docs/reward_models.md). A single-turn
    completion: the prompt's ids and text, the completion's ids and decoded text. A multi-turn episode: the prompt
    it was sampled from (its ids, ``Rollout.prompt_ids``; its text, the question followed by the contents of the
    messages the environment's ``reset`` added, one paragraph each) and its LAST assistant turn (the sampled ids,
    stop token included, and their text): the answer, as the rule reward judges it; the turns before it and the
    observations are the environment's to reward (its step rewards)."""
    if rollout.episodes is None:
        return [[Sample(p.token_ids, ids, p.text or "", text) for ids, text in zip(comps, texts)]
                for p, comps, texts in zip(rollout.prompts, rollout.completions, rollout.texts)]
    return [[Sample(e.prompt_ids, e.final_ids,
                    "\n\n".join(t for t in [p.text or ""] + [m["content"] for m in e.reset_messages] if t),
                    e.final_text)
             for e in episodes] for p, episodes in zip(rollout.prompts, rollout.episodes)]


def training_rewards(cfg, rollout: Rollout) -> torch.Tensor:
    """The rewards the advantages see [Bk, G]: the task reward plus, with overlong.buffer > 0, DAPO's soft overlong
    penalty of each completion's length (docs/algorithms.md, "Overlong completions"). The task reward alone stays in
    ``rollout.rewards`` and in the reward/* metrics."""
    if not cfg.overlong.buffer or not rollout.prompts:
        return rollout.rewards
    return rollout.rewards + overlong_penalty(rollout.lengths().long(), cfg.trained_token_limit,
                                              cfg.overlong.buffer, cfg.overlong.penalty)


# ==============================================================================================================
# Where generation runs
# ==============================================================================================================
def generation_shards(cfg) -> tuple[int, int]:
    """Who generates what: the HF engine shards over every rank; vLLM over its engines, the TP groups of
    ``rollout_tensor_parallel`` consecutive ranks (same prompts per group): colocated, the trainer's TP groups;
    on separate rollout workers, ``rollout.workers / rollout.tp`` engines."""
    if cfg.rollout.engine == "vllm":
        tp = rollout_tensor_parallel(cfg)
        return D.rank() // tp, D.world_size() // tp
    return D.rank(), D.world_size()


@contextlib.contextmanager
def generation_window(side: RolloutSide):
    """Around every generation: (offload the training state,) wake the KV cache; afterwards the rollout engine
    sleeps (``rollout.sleep_between_steps``) and the training state returns."""
    side.handover.before_generation()
    try:
        yield
    finally:
        side.handover.after_generation(sleep=side.cfg.rollout.sleep_between_steps)


@contextlib.contextmanager
def scoring_window(side: RolloutSide):
    """Around reward-model scoring, as around generation: (offload the training state,) wake the reward model;
    afterwards it sleeps (``rollout.sleep_between_steps``) and the training state returns
    (``rollout.handover.MemoryHandover.before_scoring``)."""
    side.handover.before_scoring(side.reward_model.engine)
    try:
        yield
    finally:
        side.handover.after_scoring(side.reward_model.engine, sleep=side.cfg.rollout.sleep_between_steps)


def strip_stop(ids: list[int], stops: list[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in stops else ids
