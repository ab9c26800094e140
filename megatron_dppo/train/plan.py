"""``algo.cost_budget``: each RL step's pruning rates planned at a fraction of the unpruned step's modelled cost
(docs/algorithms.md, "Step cost and budgets").

Before step t, rank 0 fits the step cost (``algo.step_cost.fit_step_cost``: seconds per generated and per trained
completion from the phase timers of the last ``WINDOW`` steps) and plans (r_q, r_o) with ``plan_step``: the least
predicted relative variance at the budget, the prompt proxies being the posterior's scores of the last drawn batch
at the current weights and the completion proxies |A| of the last step's groups; where generation is at most a
third of the step's variable cost, r_q = 0. The plan is broadcast and set on the pruner, which both levels share.
The first ``WARMUP`` steps run at algo.r_q / algo.r_o, whose timers the first fit reads. The timers are wall
clock, so a planned run is not reproducible bit for bit, and a resumed run measures again from its first steps.
"""
from __future__ import annotations

from collections import deque

import torch

from megatron_dppo.algo.step_cost import GENERATION_PHASES, TRAINING_PHASES, fit_step_cost, plan_step, variance_curve
from megatron_dppo.distributed import collectives as D
from megatron_dppo.run.state import RolloutSide

WINDOW, WARMUP = 20, 3
KEYS = ("prune/prompt_kept", "prune/total_kept", "time/step", *GENERATION_PHASES, *TRAINING_PHASES)


class RatePlanner:
    """The recent steps' timers and proxies, and the plan for the next step (module docstring)."""

    def __init__(self, budget: float):
        self.budget = budget
        self.records: deque = deque(maxlen=WINDOW)
        self.prompt_ids: list = []
        self.abs_advantages: torch.Tensor | None = None

    def observe(self, metrics: dict[str, float], prompt_ids: list, advantages: torch.Tensor) -> None:
        """After a step: its timers and kept counts, its drawn prompts, its advantages."""
        self.records.append({k: metrics[k] for k in KEYS if k in metrics})
        self.prompt_ids = list(prompt_ids)
        if advantages.numel():
            self.abs_advantages = advantages.detach().abs().double().flatten()

    def apply(self, side: RolloutSide, version: int) -> dict[str, float]:
        """Plan the next step on rank 0, broadcast, set it on ``side.pruner``; returns the plan/* metrics."""
        plan = None
        if D.is_main() and len(self.records) >= WARMUP and self.abs_advantages is not None and self.prompt_ids:
            cfg = side.cfg
            cost = fit_step_cost(self.records, cfg.train.group_size)
            scores = side.pruner.scores(self.prompt_ids, version)  # (algo.cost_budget needs algo.pruner=dppo)
            p = plan_step(cost, cfg.train.prompts_per_step, cfg.train.group_size, self.budget,
                          variance_curve(scores, 1.0 / cfg.algo.posterior_max_weight),
                          variance_curve(self.abs_advantages, cfg.algo.keep_floor))
            plan = {"plan/r_q": p.r_q, "plan/r_o": p.r_o, "plan/cost_fraction": p.cost_fraction,
                    "plan/predicted_rel_var": p.predicted_rel_var, "plan/generation_share": cost.generation_share()}
        plan = D.broadcast_object(plan)
        if plan is None:
            return {}
        side.pruner.set_rates(plan["plan/r_q"], plan["plan/r_o"])
        return plan
