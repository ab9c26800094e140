"""The pruning section of the run configuration (``algo.*``): which pruner, its rates and keep rule, the prompt
state it reads (history or posterior), screening and the per-step planner. Every option is documented here, once,
in its ``help``; the algorithms are in docs/algorithms.md, "Pruning". The rules that span sections are in
``Config.validate`` and ``UNUSED_WHEN`` (root.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Optional

from megatron_dppo.config.fields import _check, opt


@dataclass
class AlgoConfig:
    """Pruning (docs/algorithms.md, "Pruning")."""

    pruner: Literal["none", "cppo", "dppo", "pods", "adaptive"] = opt(
        "dppo", "none = plain GRPO family; cppo = keep the largest-|A| completions (biased baseline); dppo = unbiased "
                "hierarchical pruning with 1/P reweighting; pods = keep each group's max-reward-variance subset "
                "(biased baseline); adaptive = unbiased adaptive group sizes (n_q completions per prompt, chosen "
                "before generation from the prompt posterior at a cost budget: algo.adaptive_*). The rules are "
                "algo/pruner.py's PRUNERS.")
    r_q: float = opt(0.5, "DPPO prompt-level pruning rate in [0, 1): candidate prompts (history score 0 or below "
                          "the batch mean) are skipped with probability r_q, survivors weighted 1/(1-r_q).")
    r_o: float = opt(0.5, "DPPO completion-level pruning rate in [0, 1): candidate completions (A == 0 or |A| "
                          "below the group mean) are dropped with probability r_o, survivors weighted 1/(1-r_o).")
    mode: Literal["bernoulli", "fixed_size", "deterministic"] = opt(
        "bernoulli", "DPPO draw: bernoulli (independent, unbiased), fixed_size (exactly floor(r*|candidates|), "
                     "exact-probability weights), deterministic (lowest scores first; biased, ablation only).")
    dppo_keep: Literal["uniform", "optimal", "posterior"] = opt(
        "uniform", "DPPO keep probabilities: uniform = the paper's rule (candidates kept with 1 - r, the rest with 1); "
                   "optimal = variance-optimal pi = clip(c * s, keep_floor, 1) per unit at the same expected budget "
                   "(r_q / r_o = expected fraction of drawn prompts / generated completions pruned), s = the "
                   "prompt's history score, resp. |A| * L^keep_length_exponent / pi_q; completions with A = 0 get "
                   "pi = 0 when loss.kl_coef == 0 (their gradient is exactly zero). docs/algorithms.md, "
                   "\"Variance-optimal keep probabilities\". posterior = the prompt level reads the prompt "
                   "posterior (a discounted Beta per prompt, updated from every generated group's raw training "
                   "rewards: calibrated, and a score s_q > 0 for seen and unseen prompts) and water-fills it with "
                   "pi_q >= 1/algo.posterior_max_weight; the completion level is optimal's. docs/algorithms.md, "
                   "\"Prompt posterior\".")
    dppo_keep_cost: Literal["none", "tokens"] = opt(
        "none", "dppo_keep=optimal: none = every unit costs the same; tokens = cost-aware keep probabilities pi = "
                "clip(t * s / sqrt(c), keep_floor, 1) at a fixed expected cost (r_q / r_o = expected share of the "
                "tokens saved), c = each episode's tokens (prompt + sampled + observation) at completion level, G x "
                "the prompt's last mean episode tokens at prompt level (multi-turn episodes, whose costs differ "
                "tenfold). docs/environments.md, \"Cost-aware keep rule\".")
    keep_floor: float = opt(0.3, "dppo_keep=optimal: the least keep probability pi_min of every unit that can carry "
                                 "gradient (every seen prompt; completions with A != 0, and all of them with a KL "
                                 "term). In (0, 1]; > 0 is what keeps the prompt level unbiased when a prompt's "
                                 "signal changes. 0.3: the lowest gradient variance of 0.02-0.5 on real quickstart "
                                 "gradients (the prompt history is stale); docs/benchmarks.md, \"Variance-optimal "
                                 "pruning\".")
    keep_length_exponent: float = opt(0.0, "dppo_keep=optimal: alpha in the completion proxy |A| * L^alpha for a "
                                           "completion's gradient norm (L = completion tokens). 0: alpha in "
                                           "[-0.5, 1] changed the measured variance by <= 4% on the quickstart "
                                           "(1-5-token completions, where alpha is poorly determined); measure it "
                                           "for long completions. docs/benchmarks.md, \"Variance-optimal pruning\".")
    history_ema: Optional[float] = opt(None, "DPPO prompt history (dppo_keep uniform or optimal): EMA factor for "
                                             "the mean-|A| score across visits; null = the last visit's score.")
    history_score: Literal["auto", "mean_abs_adv", "reward_std"] = opt(
        "auto", "DPPO prompt history score h_q: mean_abs_adv = mean |A| of the prompt's last group (the paper's); "
                "reward_std = the standard deviation of the group's raw training rewards, which keeps its scale "
                "when std-normalized advantages lose it (continuous reward-model scores); auto = reward_std when "
                "reward.model.path is set, else mean_abs_adv. docs/reward_models.md, \"Pruning under continuous "
                "rewards\".")
    posterior_max_weight: float = opt(20.0, "dppo_keep=posterior: the largest prompt weight 1/pi_q (every prompt is "
                                            "kept with at least 1/max_weight). A cap on the weight, not what keeps "
                                            "the estimate unbiased (every posterior score is > 0); 20 as measured in "
                                            "docs/benchmarks.md, \"The prompt level at equal modelled cost\".")
    posterior_gamma: float = opt(1.0, "dppo_keep=posterior: exponent of |A| in a completion's gradient norm that "
                                      "shapes the prompt's expected group energy (docs/algorithms.md, \"Gradient "
                                      "energy of a group\"). 1: the measured best at the prompt level (the proxy "
                                      "is then sqrt(P(mixed group)) under std-GRPO); fitted values (1-2) ranked "
                                      "prompts worse.")
    posterior_rewards: Literal["auto", "binary", "continuous"] = opt(
        "auto", "dppo_keep=posterior: what the posterior reads. auto: the Beta state while every training reward "
                "is 0 or 1, the energy of the raw rewards for good after the first other value (a reward model, an "
                "overlong penalty); binary: refuse other rewards; continuous: the energy state from the start.")
    screen_k: int = opt(0, "dppo_keep=posterior: screening. Every prompt kept at the prompt level first gets k "
                           "completions (the screen); from the screens and the posterior, each screened prompt's "
                           "other G - k are generated with probability pi_c >= 1/posterior_max_weight, and only "
                           "continued groups are trained, weighted 1/(pi_q pi_c): exactly unbiased for the full-G "
                           "step (docs/algorithms.md, \"Screening\"). 1 <= k < train.group_size; 0 = off. Needs "
                           "binary rewards, no overlong penalty and a loss aggregation whose denominator does not "
                           "depend on the draw (not token_mean). It pays where generation dominates the step; on "
                           "the CPU quickstart it had 2.5x the completion level's gradient error at equal cost "
                           "(docs/benchmarks.md, \"The prompt level at equal modelled cost\").")
    screen_continue_fraction: float = opt(0.5, "algo.screen_k > 0: the expected fraction of screened prompts "
                                               "continued (pi_c water-filled on the continuation scores to it); "
                                               "in (0, 1], 1 continues every screen.")
    cost_budget: Optional[float] = opt(None, "dppo_keep=posterior: plan r_q and r_o every step at this fraction "
                                             "of the unpruned step's modelled cost, in (0, 1]: the cost per "
                                             "generated and per trained completion fitted to the phase timers of "
                                             "the last 20 steps, the rates of least predicted variance chosen at "
                                             "the budget, r_q = 0 where generation is at most a third of the step "
                                             "(train/plan.py; docs/algorithms.md, \"Step cost and budgets\"). The "
                                             "first 3 steps run at algo.r_q / algo.r_o. Wall-clock timers: not "
                                             "reproducible bit for bit. rollout.placement=colocated, no screening. "
                                             "null = the fixed rates.")
    cppo_rate: float = opt(0.5, "CPPO pruning rate P in [0, 1).")
    cppo_scope: Literal["group", "batch"] = opt("group", "CPPO: keep floor(G(1-P)) per prompt (group) or "
                                                         "floor(N(1-P)) over the batch (batch).")
    cppo_allocation: bool = opt(False, "CPPO dynamic completion allocation: draw B/(1-P) prompts, prune back to "
                                       "B*G completions.")
    pods_rate: float = opt(0.5, "PODS max-variance down-sampling rate in [0, 1): keep floor(G * (1 - rate)) of each "
                                "group's completions (at least 2), the highest- and lowest-reward ones whose rewards "
                                "vary most; weight 1, loss averaged over the kept ones (biased baseline).")
    adaptive_budget: float = opt(0.5, "algo.pruner=adaptive: the expected modelled cost of a step as a fraction "
                                      "of the uniform step's (train.prompts_per_step prompts x train.group_size "
                                      "completions, all generated and trained), in (0, 1]. docs/algorithms.md, "
                                      "\"Adaptive group sizes\".")
    adaptive_min_size: int = opt(2, "algo.pruner=adaptive: the smallest group generated (>= 2: the leave-one-out "
                                    "baseline needs one other completion); the largest is train.group_size.")
    adaptive_signal: float = opt(0.3, "algo.pruner=adaptive: the squared norm of a prompt's expected gradient as a "
                                      "multiple of one completion's noise (a model, >= 0): what skipping a prompt "
                                      "costs in variance. 0 prefers few prompts with large groups; large values "
                                      "prefer every prompt at small groups. 0.3: fitted on the quickstart's real "
                                      "gradients (0.09-0.60 over 5 checkpoints, mean 0.28; "
                                      "benchmarks/adaptive_fidelity.py).")
    adaptive_generation_share: float = opt(0.3, "algo.pruner=adaptive: generation's share of a completion's cost "
                                                "(generated and trained), in [0, 1]; 0.26 measured on the CPU "
                                                "quickstart, 0.7-0.9 on GPU RL (docs/benchmarks.md).")
    drop_zero_variance_groups: bool = opt(False, "Deterministically drop groups whose rewards are all equal (DAPO "
                                                 "dynamic-sampling filter; exact when loss.kl_coef == 0).")

    def validate(self) -> None:
        _check(0 <= self.r_q < 1, "algo.r_q", self.r_q, "a rate in [0, 1)")
        _check(0 <= self.r_o < 1, "algo.r_o", self.r_o, "a rate in [0, 1)")
        _check(0 <= self.cppo_rate < 1, "algo.cppo_rate", self.cppo_rate, "a rate in [0, 1)")
        _check(0 <= self.pods_rate < 1, "algo.pods_rate", self.pods_rate, "a rate in [0, 1)")
        _check(self.history_ema is None or 0 < self.history_ema <= 1, "algo.history_ema", self.history_ema,
               "null or in (0, 1]")
        _check(0 < self.keep_floor <= 1, "algo.keep_floor", self.keep_floor,
               "in (0, 1] (a floor of 0 would never revisit a prompt whose last group had one reward for all)")
        _check(math.isfinite(self.keep_length_exponent), "algo.keep_length_exponent", self.keep_length_exponent,
               "a finite number")
        _check(not (self.dppo_keep != "uniform" and self.mode == "deterministic"), "algo.mode", self.mode,
               f"bernoulli or fixed_size with algo.dppo_keep={self.dppo_keep} (deterministic has no keep "
               "probabilities)")
        _check(self.dppo_keep_cost == "none" or self.dppo_keep == "optimal", "algo.dppo_keep_cost",
               self.dppo_keep_cost, "none unless algo.dppo_keep=optimal (the cost shapes the optimal rule)")
        _check(math.isfinite(self.posterior_max_weight) and self.posterior_max_weight >= 1,
               "algo.posterior_max_weight", self.posterior_max_weight, "a finite number >= 1")
        _check(math.isfinite(self.posterior_gamma) and self.posterior_gamma >= 0, "algo.posterior_gamma",
               self.posterior_gamma, "a finite number >= 0")
        _check(self.screen_k >= 0, "algo.screen_k", self.screen_k, "an integer >= 0 (0 = no screening)")
        _check(0 < self.adaptive_budget <= 1, "algo.adaptive_budget", self.adaptive_budget, "in (0, 1]")
        _check(self.adaptive_min_size >= 2, "algo.adaptive_min_size", self.adaptive_min_size, "an integer >= 2")
        _check(math.isfinite(self.adaptive_signal) and self.adaptive_signal >= 0, "algo.adaptive_signal",
               self.adaptive_signal, "a finite number >= 0")
        _check(0 <= self.adaptive_generation_share <= 1, "algo.adaptive_generation_share",
               self.adaptive_generation_share, "in [0, 1]")
        _check(self.screen_k == 0 or self.pruner == "none" or (self.pruner == "dppo" and self.dppo_keep == "posterior"),
               "algo.screen_k", self.screen_k, "0 unless algo.pruner=dppo with algo.dppo_keep=posterior (the "
               "continuation scores come from the prompt posterior; algo.pruner=none turns screening off)")
        _check(self.screen_k == 0 or self.posterior_rewards != "continuous", "algo.screen_k", self.screen_k,
               "0 with algo.posterior_rewards=continuous (the continuation rule needs binary rewards)")
        _check(0 < self.screen_continue_fraction <= 1, "algo.screen_continue_fraction", self.screen_continue_fraction,
               "in (0, 1]")
        _check(self.cost_budget is None or 0 < self.cost_budget <= 1, "algo.cost_budget", self.cost_budget,
               "null or a cost fraction in (0, 1]")
        _check(self.cost_budget is None or self.pruner == "none" or (
            self.pruner == "dppo" and self.dppo_keep == "posterior" and self.screen_k == 0), "algo.cost_budget",
            self.cost_budget, "null unless algo.pruner=dppo, algo.dppo_keep=posterior and algo.screen_k=0 (the "
            "planner reads the posterior's scores and plans the two rates, not screens; algo.pruner=none turns it off)")

    @property
    def screens(self) -> int:
        """k of the screens this configuration generates (algo.screen_k under algo.pruner=dppo; else 0)."""
        return self.screen_k if self.pruner == "dppo" else 0

    @property
    def planned(self) -> bool:
        """Whether each step's rates are planned (algo.cost_budget under algo.pruner=dppo)."""
        return self.cost_budget is not None and self.pruner == "dppo"
