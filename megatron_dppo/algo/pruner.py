"""The pruner interface: what an RL step asks of any pruning rule, the rules that implement it, and ``PRUNERS``.

A step (``train.draw``, ``train.stages``) talks to its pruner through :class:`Pruner` only, never by its type:

    prompts_to_draw()                       how many prompts to draw (CPPO allocation draws more)
    select_prompts(ids, version, gen)       keep and pi_q of each drawn prompt, before generation
    select_completions(adv, gen, ...)       keep and pi_{i|q} of each completion of the kept prompts
    kept_denominator                        True: the loss averages over the kept completions (a biased baseline's
                                            choice); False: the full-batch denominator D with the prompts' pi_q
    completion_slots()                      which of the G completion slots each drawn prompt of the last
                                            select_prompts generates ([B, G] bool; None: all G of every kept one)
    observe(groups)                         the generated groups (rewards, advantages, tokens) into its state
    state_dict() / load_state_dict(state)   its per-prompt state, for checkpoints and the rollout workers
    state_format                            the format its state_dict carries (a checkpoint of another is not loaded)
    metrics()                               what it reports each step (at least ``REQUIRED_METRICS``)
    unbiased                                E[keep * weight] = 1 for every unit at both levels

Each rule owns its per-prompt state: the history of ``algo.history_score`` (every rule records it, so that a run
resumed under DPPO starts with it), or DPPO's prompt posterior (``algo.dppo_keep=posterior``).

Adding a rule: one class implementing the methods above, registered with ``@PRUNERS.register("name")``, with a
``from_config(algo, context)`` classmethod reading its options from the ``algo`` section (config/algo.py). The
contract test (tests/unit/test_pruner_contract.py) then checks it unchanged: unbiasedness at both levels (or, for
a rule registered with ``unbiased = False``, that the same check detects its bias), resume equality through
state_dict / load_state_dict, and the required metrics. :class:`PODS` and :class:`Adaptive` (at the end) are such
rules, added this way.

Plain torch: nothing here imports Megatron, the config package or torch.distributed. The caller draws on one rank
with a generator from ``pruning.make_generator`` and broadcasts the result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor

from ._checks import check_rate, floor_with_tolerance
from .allocation import Allocation, allocate, check_estimator, draw_allocation
from .prompt_history import PromptHistory, make_history
from .prompt_posterior import PromptPosterior
from .pruning import CPPOPruner, DPPOPruner, PruneResult, keep_all
from .registry import Registry

REQUIRED_METRICS = ("history/prompts_seen",)


@dataclass(frozen=True)
class PrunerContext:
    """What a rule may need of the run besides its ``algo`` options."""

    group_size: int  # G completions per kept prompt
    prompts_per_step: int  # B prompts of an update batch
    estimator: str = "grpo"  # advantage estimator (shapes the prompt posterior's energy curve)
    zero_advantage_gradient: bool = False  # the loss has a term whose gradient does not vanish at A = 0 (KL)
    reward_model: bool = False  # a reward model scores (continuous rewards: algo.history_score=auto -> reward_std)
    aggregation: str = "seq_mean_token_mean"  # the loss aggregation (adaptive group sizes need a fixed denominator)
    filtered: bool = False  # algo.drop_zero_variance_groups: groups with one reward for all are not trained


@dataclass
class Groups:
    """Groups a step generated, as the pruner observes them (every rank observes the same groups)."""

    ids: Sequence  # prompt ids, one per row
    rewards: Tensor  # [n, g] raw training rewards
    lengths: Tensor  # [n, g] trained tokens of each completion
    version: int  # optimizer step of the weights that generated them
    advantages: Tensor | None = None  # [n, G] full-group advantages; None for screens (k < G, not a full group)
    tokens: Tensor | None = None  # [n, G] every token of each sequence (prompt + completion): what it costs


@runtime_checkable
class Pruner(Protocol):
    """What the step asks of any pruning rule (module docstring)."""

    unbiased: bool
    kept_denominator: bool

    def prompts_to_draw(self) -> int: ...

    def select_prompts(self, ids: Sequence, version: int, generator: torch.Generator) -> PruneResult: ...

    def select_completions(self, advantages: Tensor, generator: torch.Generator, *, prompt_prob: Tensor,
                           lengths: Tensor, tokens: Tensor) -> PruneResult: ...

    def completion_slots(self) -> Tensor | None: ...

    def observe(self, groups: Groups) -> None: ...

    @property
    def state_format(self) -> str: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...

    def metrics(self) -> dict[str, float]: ...


PRUNERS: Registry[Any] = Registry("pruner")


def history_of(algo: Any, context: PrunerContext) -> PromptHistory:
    """The prompt history of ``algo.history_score`` (auto: the reward spread when a reward model scores, whose
    continuous scores leave mean |A| without scale; else mean |A|) and ``algo.history_ema``."""
    score = algo.history_score
    if score == "auto":
        score = "reward_std" if context.reward_model else "mean_abs_adv"
    return make_history(score, algo.history_ema)


class _HistoryKeeper:
    """The per-prompt state every rule carries: observe, checkpoint, report (a base for the rules below)."""

    unbiased = True
    kept_denominator = False
    record_costs = False  # the history keeps each group's mean tokens (the cost-aware keep rule reads them)

    def __init__(self, state: PromptHistory | PromptPosterior, context: PrunerContext) -> None:
        self.state = state
        self.context = context

    def prompts_to_draw(self) -> int:
        return self.context.prompts_per_step

    def select_prompts(self, ids: Sequence, version: int, generator: torch.Generator) -> PruneResult:
        return keep_all(len(ids))

    def completion_slots(self) -> Tensor | None:
        return None  # every kept prompt generates its G completions

    def observe(self, groups: Groups) -> None:
        if len(groups.ids):
            self.state.observe(groups, record_costs=self.record_costs)

    @property
    def state_format(self) -> str:
        return self.state.FORMAT

    def state_dict(self) -> dict:
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.state.load_state_dict(state)

    def metrics(self) -> dict[str, float]:
        return {"history/prompts_seen": float(len(self.state)), **self.state.stats()}


@PRUNERS.register("none")
class KeepAll(_HistoryKeeper):
    """algo.pruner=none: every prompt and completion kept with probability 1 (weight 1): the plain GRPO family."""

    @classmethod
    def from_config(cls, algo: Any, context: PrunerContext) -> "KeepAll":
        return cls(history_of(algo, context), context)

    def select_completions(self, advantages: Tensor, generator: torch.Generator, *, prompt_prob: Tensor,
                           lengths: Tensor, tokens: Tensor) -> PruneResult:
        return keep_all(tuple(advantages.shape))


@PRUNERS.register("cppo")
class CPPO(_HistoryKeeper):
    """algo.pruner=cppo: the top-|A| completions, weight 1, the loss averaged over the kept ones (its authors'
    choice); with ``algo.cppo_allocation`` B/(1-P) prompts drawn and pruned back to B*G. Biased by design."""

    unbiased = False
    kept_denominator = True

    def __init__(self, rule: CPPOPruner, state: PromptHistory, context: PrunerContext) -> None:
        super().__init__(state, context)
        self.rule = rule

    @classmethod
    def from_config(cls, algo: Any, context: PrunerContext) -> "CPPO":
        return cls(CPPOPruner(algo.cppo_rate, algo.cppo_scope, algo.cppo_allocation), history_of(algo, context),
                   context)

    def prompts_to_draw(self) -> int:
        if self.rule.allocation:
            return self.rule.prompts_to_draw(self.context.prompts_per_step, self.context.group_size)
        return self.context.prompts_per_step

    def select_completions(self, advantages: Tensor, generator: torch.Generator, *, prompt_prob: Tensor,
                           lengths: Tensor, tokens: Tensor) -> PruneResult:
        if self.rule.allocation:
            return self.rule.select_allocated(advantages, self.context.prompts_per_step, generator)
        return self.rule.select_completions(advantages, generator)


@PRUNERS.register("dppo")
class DPPO(_HistoryKeeper):
    """algo.pruner=dppo: unbiased hierarchical pruning with 1/P weights (``pruning.DPPOPruner``: the rule of
    ``algo.dppo_keep``, ``algo.mode``, the rates). Its per-prompt state is the history (uniform, optimal) or the
    prompt posterior (posterior), read at the version of the weights that generate."""

    def __init__(self, rule: DPPOPruner, state: PromptHistory | PromptPosterior, context: PrunerContext) -> None:
        super().__init__(state, context)
        self.rule = rule
        self.unbiased = rule.mode != "deterministic"
        self.record_costs = rule.keep_cost == "tokens"

    @classmethod
    def from_config(cls, algo: Any, context: PrunerContext) -> "DPPO":
        rule = DPPOPruner(algo.r_q, algo.r_o, algo.mode, keep=algo.dppo_keep,
                          length_exponent=algo.keep_length_exponent, keep_floor=algo.keep_floor,
                          zero_advantage_gradient=context.zero_advantage_gradient, keep_cost=algo.dppo_keep_cost,
                          max_weight=algo.posterior_max_weight)
        if algo.dppo_keep == "posterior":
            state = PromptPosterior(context.group_size, estimator=context.estimator, gamma=algo.posterior_gamma,
                                    rewards=algo.posterior_rewards)
        else:
            state = history_of(algo, context)
        return cls(rule, state, context)

    def __repr__(self) -> str:
        return f"DPPO({self.rule!r}, state={type(self.state).__name__})"

    def set_rates(self, r_q: float, r_o: float) -> None:
        """The rates of the next decisions (algo.cost_budget: the planner's, each step)."""
        self.rule.r_q, self.rule.r_o = r_q, r_o

    def scores(self, ids: Sequence, version: int) -> Tensor:
        """The prompt-level scores of ``ids`` at the weights of ``version`` (NaN: a prompt the history has not
        seen; the posterior scores every prompt)."""
        return self.state.scores(ids, version)

    def select_prompts(self, ids: Sequence, version: int, generator: torch.Generator) -> PruneResult:
        costs = None  # cost-aware keep rule: G episodes of the prompt's last mean cost (NaN = unseen: the mean)
        if self.rule.keep_cost == "tokens":
            costs = self.context.group_size * self.state.costs(ids)
        return self.rule.select_prompts(self.scores(ids, version), generator, costs=costs)

    def select_completions(self, advantages: Tensor, generator: torch.Generator, *, prompt_prob: Tensor,
                           lengths: Tensor, tokens: Tensor) -> PruneResult:
        costs = tokens if self.rule.keep_cost == "tokens" else None
        return self.rule.select_completions(advantages, generator, lengths=lengths, costs=costs,
                                            prompt_prob=prompt_prob)


def build_pruner(name: str, algo: Any, context: PrunerContext) -> Pruner:
    """The pruner ``name`` (``algo.pruner``) with its options from the ``algo`` section: one registry lookup."""
    return PRUNERS.get(name).from_config(algo, context)


@PRUNERS.register("pods")
class PODS(_HistoryKeeper):
    """algo.pruner=pods: max-variance down-sampling (PODS, Xu et al. 2025, "Not All Rollouts are Useful"), an
    explicitly BIASED baseline. Of each group's G completions it keeps the m = floor(G * (1 - algo.pods_rate))
    whose rewards have the largest variance: the k highest and the m - k lowest, k chosen per group (ties: the
    smaller k). The advantages are monotone in the rewards within a group (grpo, dr_grpo, rloo: an affine map), so
    the subset is chosen on them. Weight 1, and the loss averages over the kept completions, as the paper trains
    on the m it keeps. The kept set is a function of the rewards, not a draw: E[keep * weight] != 1."""

    unbiased = False
    kept_denominator = True

    def __init__(self, rate: float, state: PromptHistory, context: PrunerContext) -> None:
        super().__init__(state, context)
        self.rate = check_rate("algo.pods_rate", rate)
        self.kept = floor_with_tolerance(context.group_size * (1.0 - self.rate))
        if self.kept < 2:
            raise ValueError(f"algo.pods_rate={rate} keeps floor({context.group_size} * (1 - {rate})) = "
                             f"{self.kept} completions per group; max-variance down-sampling needs at least 2")

    @classmethod
    def from_config(cls, algo: Any, context: PrunerContext) -> "PODS":
        return cls(algo.pods_rate, history_of(algo, context), context)

    def select_completions(self, advantages: Tensor, generator: torch.Generator, *, prompt_prob: Tensor,
                           lengths: Tensor, tokens: Tensor) -> PruneResult:
        a = advantages.detach().double().cpu()
        g, m = a.shape[-1], min(self.kept, a.shape[-1])
        order = torch.sort(a, dim=-1, stable=True).indices  # ascending
        best_keep, best_var = None, None
        for k in range(m + 1):  # the k highest and the m - k lowest
            chosen = torch.cat([order[..., : m - k], order[..., g - k:]], dim=-1)
            keep = torch.zeros(a.shape, dtype=torch.bool).scatter(-1, chosen, True)
            var = a.gather(-1, chosen).var(dim=-1, unbiased=False)
            if best_keep is None:
                best_keep, best_var = keep, var
            else:
                better = (var > best_var + 1e-12).unsqueeze(-1)
                best_keep = torch.where(better, keep, best_keep)
                best_var = torch.where(better.squeeze(-1), var, best_var)
        ones = torch.ones(a.shape, dtype=torch.float64)
        return PruneResult(keep=best_keep.to(advantages.device), weight=best_keep.float().to(advantages.device),
                           keep_prob=ones.to(advantages.device))


@PRUNERS.register("adaptive")
class Adaptive(_HistoryKeeper):
    """algo.pruner=adaptive: adaptive group sizes (``algo.allocation``; docs/algorithms.md, "Adaptive group sizes").
    Before generation, each drawn prompt gets a size n_q in [algo.adaptive_min_size, G] and a probability pi_q >=
    1/algo.posterior_max_weight of being generated, chosen from the prompt posterior (read with the rloo energy
    curve) for the least predicted variance at an expected modelled cost of algo.adaptive_budget x the uniform
    step's (B prompts x G completions; algo.adaptive_generation_share of a completion's cost is generation, and
    with algo.drop_zero_variance_groups a group with one reward for all costs no training). The n_q completions fill
    a uniformly random n_q-subset of the prompt's G slots (``completion_slots``), so each slot is generated with
    probability pi_q n_q / G and trained with the weight 1/pi_q at the prompt level times G/n_q at the completion
    level. Needs the rloo estimator (whose per-prompt expectation does not depend on n) and a loss denominator that
    does not depend on the draw (not token_mean)."""

    def __init__(self, state: PromptPosterior, context: PrunerContext, *, budget: float, min_size: int,
                 signal: float, generation_share: float, max_weight: float, mode: str) -> None:
        super().__init__(state, context)
        if context.estimator != "rloo":
            check_estimator(context.estimator)  # grpo: refused with its reason
            raise ValueError(f"algo.pruner=adaptive needs loss.advantage_estimator=rloo, got {context.estimator!r} "
                             f"(dr_grpo's expectation is (n-1)/n of rloo's: with variable n it is rloo after the "
                             f"factor n/(n-1), so use rloo)")
        if context.aggregation == "token_mean":
            raise ValueError("algo.pruner=adaptive needs a loss denominator that does not depend on the draw; "
                             "token_mean's counts the tokens generated (valid: seq_mean_token_mean, "
                             "seq_mean_token_sum, seq_mean_token_sum_norm)")
        if not 0.0 < budget <= 1.0:
            raise ValueError(f"algo.adaptive_budget must be in (0, 1], got {budget!r}")
        if not 0.0 <= generation_share <= 1.0:
            raise ValueError(f"algo.adaptive_generation_share must be in [0, 1], got {generation_share!r}")
        if not 2 <= min_size <= context.group_size:
            raise ValueError(f"algo.adaptive_min_size must be in [2, train.group_size = {context.group_size}], got "
                             f"{min_size!r}")
        if mode not in ("bernoulli", "fixed_size"):
            raise ValueError(f"algo.mode={mode!r}: algo.pruner=adaptive draws bernoulli or fixed_size")
        self.budget, self.min_size, self.signal = budget, min_size, signal
        self.generation_share, self.max_weight, self.mode = generation_share, max_weight, mode
        self.last: Allocation | None = None
        self._slots: Tensor | None = None

    @classmethod
    def from_config(cls, algo: Any, context: PrunerContext) -> "Adaptive":
        state = PromptPosterior(context.group_size, estimator="rloo", gamma=algo.posterior_gamma, rewards="binary")
        return cls(state, context, budget=algo.adaptive_budget, min_size=algo.adaptive_min_size,
                   signal=algo.adaptive_signal, generation_share=algo.adaptive_generation_share,
                   max_weight=algo.posterior_max_weight, mode=algo.mode)

    def allocation(self, ids: Sequence, version: int) -> Allocation:
        """(n_q, pi_q) of each of ``ids`` at the weights of ``version``."""
        alpha, beta = self.state.beta_parameters(ids, version)
        G, rho = self.context.group_size, self.generation_share
        return allocate(alpha, beta, budget=self.budget * len(ids) * G, gen_cost=rho, train_cost=1.0 - rho,
                        n_min=self.min_size, n_max=G, max_weight=self.max_weight, signal=self.signal,
                        gamma=self.state.gamma, filtered=self.context.filtered)

    def select_prompts(self, ids: Sequence, version: int, generator: torch.Generator) -> PruneResult:
        alloc = self.last = self.allocation(ids, version)
        keep = draw_allocation(alloc.prob, generator, self.mode)
        G = self.context.group_size
        order = torch.rand(len(ids), G, generator=generator, dtype=torch.float64).argsort(-1)
        chosen = torch.arange(G).expand(len(ids), G) < alloc.sizes[:, None]  # the first n_q of a random order
        self._slots = torch.zeros(len(ids), G, dtype=torch.bool).scatter(-1, order, chosen) & keep[:, None]
        weight = torch.where(keep, 1.0 / alloc.prob, torch.zeros_like(alloc.prob))
        return PruneResult(keep=keep, weight=weight.float(), keep_prob=alloc.prob, candidate=alloc.prob < 1.0,
                           score=alloc.sizes.double() * alloc.prob)

    def completion_slots(self) -> Tensor | None:
        return self._slots

    def select_completions(self, advantages: Tensor, generator: torch.Generator, *, prompt_prob: Tensor,
                           lengths: Tensor, tokens: Tensor) -> PruneResult:
        """The slots the kept prompts generated, each weighted G/n_q (its inclusion probability n_q/G given the
        prompt was generated)."""
        if self._slots is None:
            raise ValueError("algo.pruner=adaptive: select_completions before select_prompts (no allocation)")
        slots = self._slots[self._slots.any(-1)].to(advantages.device)
        if slots.shape != advantages.shape:
            raise ValueError(f"algo.pruner=adaptive: {tuple(advantages.shape)} advantages for the {slots.shape[0]} "
                             f"prompts of the last allocation")
        n = slots.sum(-1, keepdim=True).double()
        prob = (n / slots.shape[-1]).expand(slots.shape)
        return PruneResult(keep=slots, weight=torch.where(slots, 1.0 / prob, 0.0).float(), keep_prob=prob.clone(),
                           candidate=slots.clone())

    def metrics(self) -> dict[str, float]:
        out = super().metrics()
        if self.last is not None:
            out.update({"adaptive/expected_samples": self.last.expected_samples,
                        "adaptive/mean_size": float(self.last.sizes.double().mean()),
                        "adaptive/min_prob": float(self.last.prob.min())})
        return out
