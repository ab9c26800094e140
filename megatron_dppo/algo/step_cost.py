"""A step's modelled cost and the pruning rates it implies (docs/algorithms.md, "Step cost and budgets").

    cost = fixed + c_gen * (completions generated) + c_train * (completions trained)

The coefficients are measured from the run's own phase timers (``fit_step_cost``: generation = the generate and
reward phases, training = pack, log-probs and update; the rest is the fixed part) as ratio estimates, seconds per
completion. With prompt keep probabilities summing to (1 - r_q) B and a completion level that keeps (1 - r_o) of
what was generated, a step costs, relative to the unpruned one (rho = the generation share of the unpruned step's
variable cost, fixed part aside):

    cost(r_q, r_o) / cost(0, 0) = (1 - r_q) (rho + (1 - rho)(1 - r_o))

Pruning a prompt saves its generation and its training; pruning a completion saves its training only, but decides
with the group's rewards in hand. ``plan_rates`` picks (r_q, r_o) at a cost budget by the least predicted relative
variance, modelled as V = V_q(r_q) + (1 + V_q(r_q)) V_o(r_o) (exact when the completion level's variance is spread
over the prompts as their energies are): V_q from the prompt proxies (the posterior's scores), V_o from the
completion proxies of recent steps (``variance_curve``). Plain Python and torch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import torch
from torch import Tensor

from .optimal_keep import predicted_relative_variance, water_fill

GENERATION_PHASES = ("time/generate", "time/reward")
TRAINING_PHASES = ("time/pack", "time/logprob", "time/train")


@dataclass(frozen=True)
class StepCost:
    """Seconds per generated completion, per trained completion, and per step (fixed)."""

    generate: float
    train: float
    fixed: float = 0.0

    def __post_init__(self) -> None:
        for name in ("generate", "train", "fixed"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"StepCost.{name} must be a finite number >= 0 (seconds), got {v!r}")
        if self.generate + self.train <= 0:
            raise ValueError("StepCost needs generate + train > 0 (a step whose cost does not depend on what it "
                             "generates or trains has nothing to prune for)")

    def seconds(self, generated: float, trained: float) -> float:
        return self.fixed + self.generate * generated + self.train * trained

    def generation_share(self) -> float:
        """rho: generation's share of an unpruned step's variable cost (generated = trained)."""
        return self.generate / (self.generate + self.train)

    def fraction(self, prompts: int, group_size: int, prompt_keep: float, completion_keep: float,
                 screen: int = 0, continue_fraction: float = 1.0) -> float:
        """Modelled cost relative to the unpruned step: a fraction ``prompt_keep`` of the B prompts generated,
        ``completion_keep`` of the generated completions trained; with a screen of k, every kept prompt generates
        k and a fraction ``continue_fraction`` of them the other G - k (only continued groups are trained)."""
        B, G = prompts, group_size
        if screen:
            generated = prompt_keep * B * (screen + (G - screen) * continue_fraction)
            trained = completion_keep * prompt_keep * B * G * continue_fraction
        else:
            generated = prompt_keep * B * G
            trained = completion_keep * generated
        return self.seconds(generated, trained) / self.seconds(B * G, B * G)


def fit_step_cost(records: Iterable[Mapping[str, float]], group_size: int,
                  generated_key: str = "prune/prompt_kept", trained_key: str = "prune/total_kept",
                  generation_phases: tuple[str, ...] = GENERATION_PHASES,
                  training_phases: tuple[str, ...] = TRAINING_PHASES) -> StepCost:
    """StepCost from per-step metric records (metrics.jsonl lines of RL steps): c_gen = sum of the generation
    phases' seconds / sum of completions generated (``generated_key`` prompts x G), c_train likewise over the
    training phases and the trained completions, fixed = mean of the remaining seconds of ``time/step``."""
    gen_s, train_s, rest_s, generated, trained, n = [], [], [], [], [], 0
    for rec in records:
        if generated_key not in rec or trained_key not in rec or "time/step" not in rec:
            continue
        g = math.fsum(float(rec.get(k, 0.0)) for k in generation_phases)
        t = math.fsum(float(rec.get(k, 0.0)) for k in training_phases)
        gen_s.append(g)
        train_s.append(t)
        rest_s.append(max(0.0, float(rec["time/step"]) - g - t))
        generated.append(float(rec[generated_key]) * group_size)
        trained.append(float(rec[trained_key]))
        n += 1
    if n == 0:
        raise ValueError(f"fit_step_cost found no record with {generated_key!r}, {trained_key!r} and 'time/step'")
    total_gen, total_train = math.fsum(generated), math.fsum(trained)
    if total_gen <= 0 or total_train <= 0:
        raise ValueError(f"fit_step_cost needs steps that generated and trained something (generated "
                         f"{total_gen}, trained {total_train})")
    return StepCost(generate=math.fsum(gen_s) / total_gen, train=math.fsum(train_s) / total_train,
                    fixed=math.fsum(rest_s) / n)


def variance_curve(scores: Tensor, floor: float) -> Callable[[float], float]:
    """r -> the predicted relative variance sum (1 - pi)/pi s^2 / sum s^2 of water-filled keep probabilities
    pi = clip(c s, floor on s > 0, 1) at the budget (1 - r) N (``optimal_keep``); units with s = 0 cost nothing."""
    s = scores.double().flatten()
    lo = torch.where(s > 0, float(floor), 0.0).double()

    def curve(rate: float) -> float:
        if rate <= 0.0:
            return 0.0
        pi = water_fill(s, (1.0 - rate) * s.numel(), floor=lo)
        if bool((pi[s > 0] <= 0).any()):
            return math.inf
        v = predicted_relative_variance(pi, s)
        return 0.0 if math.isnan(v) else v

    return curve


@dataclass(frozen=True)
class Plan:
    r_q: float
    r_o: float
    cost_fraction: float
    predicted_rel_var: float


def plan_rates(cost: StepCost, prompts: int, group_size: int, budget: float,
               prompt_variance: Callable[[float], float], completion_variance: Callable[[float], float],
               max_rate: float = 0.95, grid: int = 96) -> Plan:
    """The (r_q, r_o) of least predicted relative variance whose modelled cost is at most ``budget`` x the
    unpruned step's (module docstring). r_q runs over a grid of ``grid`` points in [0, max_rate]; for each, r_o is
    the least rate that meets the budget (0 if r_q alone does). Ties: the smaller r_q. ValueError when even both
    rates at ``max_rate`` cost more than the budget."""
    if not (isinstance(budget, (int, float)) and 0.0 < budget <= 1.0):
        raise ValueError(f"budget must be a cost fraction in (0, 1], got {budget!r}")
    if not 0.0 <= max_rate < 1.0:
        raise ValueError(f"max_rate must be in [0, 1), got {max_rate!r}")
    B, G = prompts, group_size
    full = cost.seconds(B * G, B * G)
    best: Plan | None = None
    for j in range(grid + 1):
        r_q = max_rate * j / grid
        generated = (1.0 - r_q) * B * G
        if cost.train > 0:
            trained = (budget * full - cost.fixed - cost.generate * generated) / cost.train
            r_o = max(0.0, 1.0 - trained / generated)
        else:
            r_o = 0.0
        if r_o > max_rate + 1e-12:
            continue
        fraction = cost.seconds(generated, (1.0 - r_o) * generated) / full
        if fraction > budget + 1e-9:
            continue
        v_q = prompt_variance(r_q)
        v = v_q + (1.0 + v_q) * completion_variance(r_o)
        if best is None or v < best.predicted_rel_var - 1e-12:
            best = Plan(r_q, r_o, fraction, v)
    if best is None:
        lowest = cost.seconds((1 - max_rate) * B * G, (1 - max_rate) ** 2 * B * G) / full
        raise ValueError(f"budget {budget} is below the least modelled cost {lowest:.3f} reachable with both rates "
                         f"at max_rate {max_rate}")
    return best


COMPLETION_FIRST_SHARE = 1.0 / 3.0  # generation share at or below which the prompt level is left out


def plan_step(cost: StepCost, prompts: int, group_size: int, budget: float,
              prompt_variance: Callable[[float], float], completion_variance: Callable[[float], float],
              completion_first_share: float = COMPLETION_FIRST_SHARE, max_rate: float = 0.95,
              grid: int = 48) -> Plan:
    """``plan_rates`` with the measured bias toward the completion level: where generation is at most
    ``completion_first_share`` of an unpruned step's variable cost and the completion level alone can meet the
    budget, r_q = 0 and r_o is the least rate that meets it (on real gradients of the CPU quickstart, generation
    share 0.26, the planner's own choice of r_q 0.05-0.24 cost 18% in error at half cost; docs/benchmarks.md,
    "The prompt level at equal modelled cost"). Otherwise ``plan_rates``."""
    if cost.generation_share() <= completion_first_share and cost.train > 0:
        N = prompts * group_size
        full = cost.seconds(N, N)
        r_o = max(0.0, 1.0 - (budget * full - cost.fixed - cost.generate * N) / (cost.train * N))
        if r_o <= max_rate:
            return Plan(0.0, r_o, cost.seconds(N, (1.0 - r_o) * N) / full, completion_variance(r_o))
    return plan_rates(cost, prompts, group_size, budget, prompt_variance, completion_variance, max_rate, grid)
