"""The prompt level of issue 34 on a trained policy's real gradients, for ``gradient_fidelity.py --real
--prompt-level`` and ``prompt_diagnosis.py``.

The training run (``_real_gradients``: GRPO on the quickstart, audit trail on) recorded every group it generated:
``read_visits`` gives, per RL step, the prompt ids, their G rewards and completion lengths. The pure modules are
driven from that record: ``posterior_before(visits, step)`` is the ``PromptPosterior`` the run would hold at
``step`` had it updated one from each step's rewards (the history score's state, replaced), and ``calibration``
scores its one-step-ahead P(mixed) over every revisit of the run.

At one checkpoint (``R.Ctx``: its batch's Gram matrix of per-sequence gradients) each method is a weight vector per
draw, W [K, N], with the completions it generated and trained per draw; ``arm`` builds it from a prompt keep
probability, an optional screen (the first k of each real group; completions are i.i.d., so they are a fair
screen) and the completion level's optimal keep (``DPPOPruner``, ``keep="optimal"``, on the full group's |A|).
``solve_cost`` finds the completion rate at which the mean modelled step cost (``algo.step_cost``) equals a target.
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch

from benchmarks import _real_gradients as R
from benchmarks.common import read_metrics

MAX_WEIGHT = 20.0  # the posterior's weight cap (pi >= 0.05)
HISTORY_FLOOR = 0.3  # today's dppo-optimal keep_floor (the library default)
SCREEN_K = 2


# ----------------------------------------------------------------------------------------------------------
# The run's record
# ----------------------------------------------------------------------------------------------------------
def read_visits(audit: Path) -> dict[int, tuple[list, torch.Tensor, torch.Tensor]]:
    """RL step -> (prompt ids, rewards [n, G], completion lengths [n, G]) of the groups generated at that step."""
    rows: dict[int, list] = {}
    with open(audit) as f:
        for line in f:
            rec = json.loads(line)
            if rec.get("rewards") is not None:
                rows.setdefault(int(rec["step"]), []).append((rec["prompt_id"], rec["rewards"], rec["lengths"]))
    return {s: ([r[0] for r in v], torch.tensor([r[1] for r in v], dtype=torch.float64),
                torch.tensor([r[2] for r in v], dtype=torch.float64)) for s, v in sorted(rows.items())}


def posterior_before(visits: dict, step: int, group_size: int, **kw):
    """A PromptPosterior updated with every recorded step before ``step``."""
    from megatron_dppo.algo.prompt_posterior import PromptPosterior
    post = PromptPosterior(group_size, **kw)
    for s, (ids, rewards, lengths) in visits.items():
        if s >= step:
            break
        post.update(ids, rewards, s, lengths)
    return post


def calibration(visits: dict, group_size: int, first_step: int = 1, bins: int = 5) -> dict:
    """P(the next group is mixed) predicted before each revisit vs what it was, over the whole run: the
    posterior's predictive, the last visit's own outcome (today's h_q > 0) and the running base rate."""
    from megatron_dppo.algo.prompt_posterior import PromptPosterior
    post = PromptPosterior(group_size)
    last: dict = {}
    pred, last_mixed, base, obs, last_constant = [], [], [], [], []
    n_mixed = n_groups = 0
    discounts = {}
    for s, (ids, rewards, lengths) in visits.items():
        mixed = ((rewards.min(1).values != rewards.max(1).values)).double()
        if s >= first_step:
            seen = [i in post for i in ids]
            p = post.mixed_probability(ids, s)
            for j, pid in enumerate(ids):
                if seen[j]:
                    pred.append(float(p[j]))
                    last_mixed.append(float(last[pid]))
                    base.append(n_mixed / max(1, n_groups))
                    obs.append(float(mixed[j]))
                    last_constant.append(last[pid] == 0.0)
        post.update(ids, rewards, s, lengths)
        for pid, m in zip(ids, mixed.tolist()):
            last[pid] = m
        n_mixed += int(mixed.sum())
        n_groups += len(ids)
        if s % 25 == 0:
            discounts[s] = post.discount()
    P, O, H, Bs = (torch.tensor(x, dtype=torch.float64) for x in (pred, obs, last_mixed, base))
    lc = torch.tensor(last_constant)
    brier = lambda q: float(((q - O) ** 2).mean())  # noqa: E731
    eps = 1e-12
    loglik = lambda q: float((O * q.clamp(eps, 1 - eps).log() + (1 - O) * (1 - q).clamp(eps, 1 - eps).log()).mean())  # noqa: E731
    edges = torch.quantile(P, torch.linspace(0, 1, bins + 1, dtype=torch.float64))
    table = []
    for b in range(bins):
        m = (P >= edges[b]) & ((P <= edges[b + 1]) if b == bins - 1 else (P < edges[b + 1]))
        if bool(m.any()):
            table.append({"predicted": float(P[m].mean()), "observed": float(O[m].mean()), "n": int(m.sum())})
    return {"revisits": len(obs), "observed_mixed": float(O.mean()), "predicted_mixed": float(P.mean()),
            "brier": {"posterior": brier(P), "last_visit": brier(H), "base_rate": brier(Bs)},
            "loglik_per_revisit": {"posterior": loglik(P), "base_rate": loglik(Bs)},
            "after_constant_visit": {"n": int(lc.sum()), "observed_mixed": float(O[lc].mean()),
                                     "posterior_predicted": float(P[lc].mean())},
            "reliability": table, "discount_by_step": discounts, "final": post.stats()}


# ----------------------------------------------------------------------------------------------------------
# One checkpoint: proxies and arms
# ----------------------------------------------------------------------------------------------------------
@dataclasses.dataclass
class Prompts:
    """Per-prompt quantities of one checkpoint's batch."""

    gq: torch.Tensor  # [B] |g_q| (true, this step)
    h: torch.Tensor  # [B] history score h_q (NaN unseen)
    alpha: torch.Tensor  # [B] posterior Beta parameters at this step
    beta: torch.Tensor
    gamma: float  # fitted exponent of |A| in |g_i|

    def posterior_score(self, G: int, gamma: float, estimator: str = "grpo") -> torch.Tensor:
        from megatron_dppo.algo.gradient_energy import energy_curve, expected_energy
        return expected_energy(self.alpha, self.beta, energy_curve(G, estimator, gamma)).sqrt()

    def screen_score(self, rewards: torch.Tensor, gamma: float, k: int = SCREEN_K,
                     estimator: str = "grpo") -> torch.Tensor:
        from megatron_dppo.algo.gradient_energy import energy_curve
        from megatron_dppo.algo.screening import continuation_scores
        G = rewards.shape[1]
        return continuation_scores(rewards[:, :k], self.alpha, self.beta, energy_curve(G, estimator, gamma))


def prompt_norms(M: torch.Tensor, B: int, G: int) -> torch.Tensor:
    return M.view(B, G, B, G).diagonal(dim1=0, dim2=2).sum((0, 1)).clamp(min=0).sqrt()


def prompts_of(ctx: R.Ctx, visits: dict, gamma: float) -> Prompts:
    post = posterior_before(visits, ctx.step, ctx.G)
    alpha, beta = post.beta_parameters(ctx.ids, ctx.step)
    return Prompts(gq=prompt_norms(ctx.M, ctx.B, ctx.G), h=ctx.h, alpha=alpha, beta=beta, gamma=gamma)


@dataclasses.dataclass
class Draws:
    W: torch.Tensor  # [K, N]
    generated: torch.Tensor  # [K] completions generated
    trained: torch.Tensor  # [K] completions trained (weight > 0)


def arm(ctx: R.Ctx, pi_q: torch.Tensor, r_o: float, name: str, screen: torch.Tensor | None = None,
        continue_fraction: float = 1.0, completion: str = "optimal", scale: float = 1.0) -> Draws:
    """Prompt keep pi_q [B] or [K, B] (bernoulli), an optional screen (continuation scores [B], the first SCREEN_K
    completions), then the completion level at rate r_o over the generated completions: "optimal" (|A| / pi),
    "oracle" (true |g_i| / pi, floor 0) or "uniform" (the paper's candidate rule). ``scale``: a factor of every
    inclusion probability decided before (a simple random sample of the prompts, in the allocation study)."""
    from megatron_dppo.algo.optimal_keep import water_fill
    from megatron_dppo.algo.pruning import DPPOPruner
    from megatron_dppo.algo.screening import continuation_probabilities, decide_continuation

    K, B, G = ctx.K, ctx.B, ctx.G
    kept = torch.rand(K, B, generator=ctx.gen(f"{name}/prompts"), dtype=torch.float64) < pi_q
    if screen is not None:
        pi_c = continuation_probabilities(screen.expand(K, B), kept, continue_fraction, MAX_WEIGHT)
        decision = decide_continuation(pi_c, kept, version=ctx.step, generator=ctx.gen(f"{name}/continue"))
        rows, prob = decision.keep, pi_q * torch.where(kept, pi_c, torch.ones_like(pi_c))
        generated = kept.sum(1) * SCREEN_K + rows.sum(1) * (G - SCREEN_K)
    else:
        rows, prob = kept, pi_q.expand(K, B)
        generated = kept.sum(1) * G
    prob = torch.where(rows, prob, torch.ones_like(prob))
    A = ctx.A.expand(K, B, G)
    if r_o == 0.0:
        pc = torch.ones(K, B, G, dtype=torch.float64)
        keep = rows.unsqueeze(-1).expand(K, B, G)
    elif completion == "oracle":
        s = ctx.norms.view(B, G).expand(K, B, G) / prob.unsqueeze(-1)
        s = torch.where(rows.unsqueeze(-1), s, torch.zeros_like(s))
        budget = (1.0 - r_o) * rows.sum(1).double() * G
        pc = water_fill(s.flatten(1), budget, floor=0.0).view(K, B, G)
        keep = (torch.rand(K, B, G, generator=ctx.gen(f"{name}/completions"), dtype=torch.float64) < pc) \
            & rows.unsqueeze(-1)
    else:
        pruner = DPPOPruner(0.0, r_o, keep=completion, keep_floor=HISTORY_FLOOR) if completion == "optimal" \
            else DPPOPruner(0.0, r_o)
        kw = dict(lengths=ctx.L.expand(K, B, G), prompt_prob=prob, generated=rows) if completion == "optimal" else {}
        res = pruner.select_completions(A.clone(), ctx.gen(f"{name}/completions"), **kw)
        pc, keep = res.keep_prob, res.keep & rows.unsqueeze(-1)
    W = torch.where(keep, 1.0 / (scale * prob.unsqueeze(-1) * pc).clamp(min=1e-300), torch.zeros_like(pc))
    return Draws(W.reshape(K, -1), generated.double(), (W > 0).reshape(K, -1).sum(1).double())


def paper_rule(ctx: R.Ctx, r_q: float, r_o: float, name: str) -> Draws:
    """The paper's candidate rule at both levels (dppo-uniform)."""
    from megatron_dppo.algo.pruning import DPPOPruner
    p = DPPOPruner(r_q, r_o).select_prompts(ctx.h.expand(ctx.K, ctx.B).clone(), ctx.gen(f"{name}/prompts"))
    pi = p.keep_prob[0]
    return arm(ctx, pi, r_o, name, completion="uniform")


def history_keep(ctx: R.Ctx, r_q: float) -> torch.Tensor:
    """Today's dppo-optimal prompt level: water-filling on h_q, floor 0.3, unseen prompts pi = 1."""
    from megatron_dppo.algo.optimal_keep import water_fill
    if r_q == 0:
        return torch.ones(ctx.B, dtype=torch.float64)
    unseen = torch.isnan(ctx.h)
    return water_fill(torch.nan_to_num(ctx.h, nan=0.0), (1 - r_q) * ctx.B, floor=HISTORY_FLOOR, forced=unseen)


def water(scores: torch.Tensor, r_q: float, floor: float) -> torch.Tensor:
    from megatron_dppo.algo.optimal_keep import water_fill
    if r_q == 0:
        return torch.ones_like(scores, dtype=torch.float64)
    return water_fill(scores.double(), (1 - r_q) * scores.numel(), floor=floor)


def cost_fraction(cost, d: Draws, B: int, G: int) -> float:
    return float(torch.tensor([cost.seconds(g, t) for g, t in zip(d.generated.tolist(), d.trained.tolist())])
                 .mean()) / cost.seconds(B * G, B * G)


def solve_cost(ctx: R.Ctx, make, cost, target: float, iters: int, hi: float = 0.999, tol: float = 0.01):
    """The completion rate r_o whose mean modelled cost fraction is ``target`` for ``make(r_o) -> Draws`` (cost
    falls as r_o grows). Returns (r_o, Draws, info); info["reached"] False when the target lies outside
    [cost(hi), cost(0)] or in a gap (the optimal rule jumps at r_o = 0+: every A = 0 completion goes at once)."""
    cache: dict[float, tuple[float, Draws]] = {}

    def c(r: float) -> float:
        if r not in cache:
            d = make(r)
            cache[r] = (cost_fraction(cost, d, ctx.B, ctx.G), d)
        return cache[r][0]

    lo_r, hi_r = 0.0, hi
    if c(lo_r) <= target + tol:
        return lo_r, cache[lo_r][1], {"reached": abs(c(lo_r) - target) <= tol, "cost": c(lo_r)}
    if c(hi_r) > target + tol:
        return None, None, {"reached": False, "range": [c(hi_r), c(lo_r)]}
    for _ in range(iters):
        mid = 0.5 * (lo_r + hi_r)
        lo_r, hi_r = (mid, hi_r) if c(mid) > target else (lo_r, mid)
    best = hi_r  # cost <= target side
    return best, cache[best][1], {"reached": abs(c(best) - target) <= tol, "cost": c(best)}


def spearman_table(ctx: R.Ctx, P: Prompts) -> dict:
    """Spearman of each prompt proxy with this step's |g_q|, over all prompts and over the seen ones."""
    from megatron_dppo.algo.gradient_energy import group_energy
    seen = ~torch.isnan(ctx.h)
    proxies = {"history h_q": torch.nan_to_num(ctx.h, nan=-1.0),
               "posterior gamma=1": P.posterior_score(ctx.G, 1.0),
               f"posterior gamma={P.gamma:.2f} (fitted)": P.posterior_score(ctx.G, P.gamma),
               f"screen k={SCREEN_K} + posterior (fitted gamma)": P.screen_score(ctx.rewards, P.gamma),
               "this group's own energy (after generation)": group_energy(ctx.rewards, "grpo", P.gamma).sqrt()}
    out = {}
    for name, s in proxies.items():
        out[name] = {"all": R.spearman(P.gq, s),
                     "seen": R.spearman(P.gq[seen], s[seen]) if int(seen.sum()) > 2 else math.nan}
    return out


# ----------------------------------------------------------------------------------------------------------
# The study at one checkpoint
# ----------------------------------------------------------------------------------------------------------
R_Q_GRID = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5)
SCREEN_R_Q = (0.0, 0.1, 0.2, 0.3)  # prompt rates of the screening arm (its continued fraction is solved)
FREE = 1e-9  # a completion rate that drops exactly the A = 0 completions (free without KL) and nothing else
PROMPT_FRACTION = 0.7


def prompt_only(ctx: R.Ctx, P: Prompts) -> list[dict]:
    """Every method at PROMPT_FRACTION of the prompts generated and nothing pruned after generation."""
    from megatron_dppo.algo.prompt_posterior import keep_probabilities
    r = 1.0 - PROMPT_FRACTION
    seen = ~torch.isnan(ctx.h)
    cand = seen & ((ctx.h == 0) | (ctx.h < torch.nan_to_num(ctx.h, nan=0.0)[seen].mean())) if bool(seen.any()) \
        else torch.zeros(ctx.B, dtype=torch.bool)
    paper_rate = r * ctx.B / max(1, int(cand.sum()))
    pis = {"uniform (every prompt kept with 0.7)": torch.full((ctx.B,), PROMPT_FRACTION, dtype=torch.float64),
           "today's optimal (h_q, floor 0.3)": history_keep(ctx, r),
           "posterior, gamma 1": keep_probabilities(P.posterior_score(ctx.G, 1.0), r, MAX_WEIGHT),
           "posterior, fitted gamma": keep_probabilities(P.posterior_score(ctx.G, P.gamma), r, MAX_WEIGHT),
           "oracle (water-filling on the true \\|g_q\\|)": water(P.gq, r, 0.0)}
    if paper_rate < 1.0:
        pis["paper's candidate rule"] = torch.where(cand, 1.0 - paper_rate, 1.0).double()
    rows = []
    for name, pi in pis.items():
        d = arm(ctx, pi, 0.0, f"prompt-only/{name}")
        rows.append({"rl_step": ctx.step, "table": "prompt_only", "method": name, **R.mc_stats(ctx, d.W),
                     "generated": float(d.generated.mean()) / ctx.N, "sum_pi": float(pi.sum()) / ctx.B})
    return rows


def equal_cost(ctx: R.Ctx, P: Prompts, regime: str, cost, target: float, iters: int) -> list[dict]:
    """Every arm at the modelled cost fraction ``target`` (module docstring); for the two-level arms each r_q
    of R_Q_GRID, r_o solved; the planner's r_q for the posterior."""
    from megatron_dppo.algo.prompt_posterior import keep_probabilities
    from megatron_dppo.algo.step_cost import plan_rates, variance_curve
    B, G = ctx.B, ctx.G
    post_s = P.posterior_score(G, P.gamma)
    screen_s = P.screen_score(ctx.rewards, P.gamma)
    ones = torch.ones(B, dtype=torch.float64)
    rows = []

    def add(method, r_q, knob, d, info, **extra):
        row = {"rl_step": ctx.step, "table": "equal_cost", "regime": regime, "target": target, "method": method,
               "r_q": r_q, "knob": knob, **info, **extra}
        if d is not None:
            row.update(R.mc_stats(ctx, d.W), generated=float(d.generated.mean()) / ctx.N)
        rows.append(row)

    knob, d, info = solve_cost(ctx, lambda r: arm(ctx, ones * (1 - r), 0.0, "subsample"), cost, target, iters)
    add("uniform: fewer prompts, all trained", None, knob, d, info)
    knob, d, info = solve_cost(ctx, lambda r: paper_rule(ctx, r, r, "paper"), cost, target, iters)
    add("paper's rule (r_q = r_o)", None, knob, d, info)
    knob, d, info = solve_cost(ctx, lambda r: arm(ctx, ones, r, "completion-only"), cost, target, iters)
    add("completion-only optimal", 0.0, knob, d, info)
    post1 = P.posterior_score(G, 1.0)
    for r_q in R_Q_GRID[1:]:
        for method, pi, completion in (("today's optimal (h_q)", history_keep(ctx, r_q), "optimal"),
                                       ("posterior + completion optimal",
                                        keep_probabilities(post_s, r_q, MAX_WEIGHT), "optimal"),
                                       ("posterior gamma 1 + completion optimal",
                                        keep_probabilities(post1, r_q, MAX_WEIGHT), "optimal"),
                                       ("oracle (true norms, both levels)", water(P.gq, r_q, 0.0), "oracle")):
            knob, d, info = solve_cost(ctx, lambda r, pi=pi, c=completion, m=method:
                                       arm(ctx, pi, r, f"{m}/{r_q}", completion=c), cost, target, iters)
            add(method, r_q, knob, d, info)
    knob, d, info = solve_cost(ctx, lambda r: arm(ctx, ones, r, "oracle/0", completion="oracle"), cost, target,
                               iters)
    add("oracle (true norms, both levels)", 0.0, knob, d, info)
    for r_q in SCREEN_R_Q:  # the continued fraction 1 - x solved for the cost; A = 0 completions dropped
        pi = keep_probabilities(post_s, r_q, MAX_WEIGHT)
        knob, d, info = solve_cost(ctx, lambda x, pi=pi: arm(ctx, pi, FREE, f"screen/{r_q}", screen=screen_s,
                                                             continue_fraction=1.0 - x), cost, target, iters)
        add("posterior + screen k=2 (continued fraction solved)", r_q, knob, d, info,
            continue_fraction=None if knob is None else round(1.0 - knob, 3))
    # the planner (algo.step_cost.plan_rates) on the proxies the run would have: posterior scores, |A|
    plan = plan_rates(cost, B, G, target, variance_curve(post_s, 1.0 / MAX_WEIGHT),
                      variance_curve(ctx.A.abs().flatten(), 0.3), max_rate=0.95, grid=40)
    pi = keep_probabilities(post_s, plan.r_q, MAX_WEIGHT)
    knob, d, info = solve_cost(ctx, lambda r: arm(ctx, pi, r, "planner"), cost, target, iters)
    add("posterior, planner's r_q", plan.r_q, knob, d, info, planned_r_o=plan.r_o,
        planned_rel_var=plan.predicted_rel_var)
    return rows


def best_rows(rows: list[dict]) -> list[dict]:
    """Per (checkpoint, regime, target, method): the r_q (and continue fraction) with the least error."""
    out: dict = {}
    for r in rows:
        if r.get("table") != "equal_cost" or r.get("rel_mse") is None:
            continue
        key = (r["rl_step"], r["regime"], r["target"], r["method"])
        if key not in out or r["rel_mse"] < out[key]["rel_mse"]:
            out[key] = r
    return list(out.values())


# ----------------------------------------------------------------------------------------------------------
# Run and report
# ----------------------------------------------------------------------------------------------------------
def costs_of(work: Path, group_size: int, generation_share: float) -> dict:
    """The CPU run's StepCost from its own phase timers, and a generation-dominated regime with the same
    per-step total and generation share ``generation_share`` (modelled, not measured)."""
    from megatron_dppo.algo.step_cost import StepCost, fit_step_cost
    cpu = fit_step_cost(read_metrics(work / "train", "rl"), group_size)
    total = cpu.generate + cpu.train
    gen = StepCost(generate=generation_share * total, train=(1 - generation_share) * total, fixed=cpu.fixed)
    return {"cpu (measured)": cpu, f"generation {generation_share:.0%} (modelled)": gen}


def study(ctx: R.Ctx, visits: dict, gamma: float, costs: dict, targets, iters: int) -> dict:
    P = prompts_of(ctx, visits, gamma)
    rows = prompt_only(ctx, P)
    for regime, cost in costs.items():
        for target in targets:
            rows += equal_cost(ctx, P, regime, cost, target, iters)
    return {"rows": rows, "spearman": spearman_table(ctx, P), "gamma": gamma}


def _fmt(r: dict | None) -> str:
    if r is None or r.get("rel_mse") is None:
        return "unreachable" if r is not None else "n/a"
    text = f"{r['rel_mse']:.3g}" if r["rel_mse"] >= 1e-8 else "0 (exact)"
    return text if r.get("reached", True) else f"{text} (cost {r['cost']:.2f})*"


def markdown(rep: dict) -> str:
    pl = rep["prompt_level"]
    steps = [c["rl_step"] for c in pl["checkpoints"]]
    rows = [r for c in pl["checkpoints"] for r in c["rows"]]
    cal = pl["calibration"]
    costs = pl["costs"]
    out = ["## The prompt level (issue 34): posterior, screening, equal modelled step cost", "",
           "Modelled step cost = fixed + c_gen x generated + c_train x trained completions (algo.step_cost); "
           "coefficients of the CPU run from its own phase timers: " +
           "; ".join(f"{k}: c_gen {v['generate']:.2e} s, c_train {v['train']:.2e} s, fixed {v['fixed']:.3f} s, "
                     f"generation share {v['generation_share']:.2f}" for k, v in costs.items()) + ".", "",
           f"### Calibration of P(next group mixed) over every revisit of the run ({cal['revisits']} revisits)", "",
           f"Observed mixed share {cal['observed_mixed']:.3f}, posterior's mean prediction "
           f"{cal['predicted_mixed']:.3f}. Brier: posterior {cal['brier']['posterior']:.4f}, last visit's own "
           f"outcome (today's h_q > 0) {cal['brier']['last_visit']:.4f}, running base rate "
           f"{cal['brier']['base_rate']:.4f}. Log-likelihood per revisit: posterior "
           f"{cal['loglik_per_revisit']['posterior']:.4f}, base rate {cal['loglik_per_revisit']['base_rate']:.4f}. "
           f"After a constant visit ({cal['after_constant_visit']['n']} revisits): observed mixed "
           f"{cal['after_constant_visit']['observed_mixed']:.3f}, posterior predicted "
           f"{cal['after_constant_visit']['posterior_predicted']:.3f}. Discount chosen by step: "
           + ", ".join(f"{k}: {v:g}" for k, v in cal["discount_by_step"].items()) + ".", "",
           "| predicted P(mixed), bin mean | observed | revisits |", "|---|---|---|"]
    out += [f"| {b['predicted']:.3f} | {b['observed']:.3f} | {b['n']} |" for b in cal["reliability"]]
    out += ["", "### Spearman of each prompt proxy with this step's \\|g_q\\| (over the 64 prompts; every prompt "
            "of these checkpoints was seen before)", "",
            "| proxy | " + " | ".join(f"step {s}" for s in steps) + " | mean |", "|---" * (len(steps) + 2) + "|"]
    names = list(pl["checkpoints"][0]["spearman"])
    for i, _ in enumerate(names):
        vals = [list(c["spearman"].values())[i]["all"] for c in pl["checkpoints"]]
        label = re.sub(r"gamma=[\d.]+ \(fitted\)", "fitted gamma", names[i])
        out.append(f"| {label} | " + " | ".join(f"{v:.2f}" for v in vals) + f" | {sum(vals) / len(vals):.2f} |")
    out += ["", "Fitted gamma (coefficient of log\\|A\\| in log\\|g_i\\|) per checkpoint: "
            + ", ".join(f"step {c['rl_step']}: {c['gamma']:.2f}" for c in pl["checkpoints"]) + ".", "",
            f"### The prompt level alone at {PROMPT_FRACTION:.0%} of the prompts generated (nothing pruned after "
            f"generation): relative MSE", "",
            "| method | " + " | ".join(f"step {s}" for s in steps) + " | mean | mean / uniform's | geo-mean ratio "
            "to uniform |", "|---" * (len(steps) + 4) + "|"]
    methods = list(dict.fromkeys(r["method"] for r in rows if r["table"] == "prompt_only"))
    for m in methods:
        cells, logs, vals, uvals = [], [], [], []
        for s in steps:
            r = next((x for x in rows if x["table"] == "prompt_only" and x["method"] == m and x["rl_step"] == s),
                     None)
            u = next(x for x in rows if x["table"] == "prompt_only" and x["rl_step"] == s)
            cells.append(_fmt(r))
            if r is not None:
                vals.append(r["rel_mse"])
                uvals.append(u["rel_mse"])
            if r is not None and u["rel_mse"] > 0 and r["rel_mse"] > 0:
                logs.append(math.log(r["rel_mse"] / u["rel_mse"]))
        gm = f"{math.exp(sum(logs) / len(logs)):.2f}" if logs else "n/a"
        mean = sum(vals) / len(vals) if len(vals) == len(steps) else math.nan
        ratio = sum(vals) / sum(uvals) if len(vals) == len(steps) else math.nan
        out.append(f"| {m} | " + " | ".join(cells) + f" | {mean:.3g} | {ratio:.2f} | {gm} |")
    best = best_rows(rows)
    out += summary(rows, best, steps, costs, pl["targets"])
    for regime in costs:
        for target in pl["targets"]:
            out += ["", f"### Equal modelled step cost {target} x the unpruned step, regime {regime}: relative MSE "
                    "(best r_q of the grid, in brackets)", "",
                    "| method | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
            for m in dict.fromkeys(r["method"] for r in rows if r["table"] == "equal_cost"):
                cells = []
                for s in steps:
                    r = next((x for x in best if x["rl_step"] == s and x["regime"] == regime
                              and x["target"] == target and x["method"] == m), None)
                    if r is None:
                        r = next((x for x in rows if x.get("regime") == regime and x.get("target") == target
                                  and x["method"] == m and x["rl_step"] == s), None)
                    extra = ""
                    if r is not None and r.get("r_q") is not None:
                        extra = f" [r_q {r['r_q']:.2f}" + (f", cont. {r['continue_fraction']}"
                                                           if "continue_fraction" in r else "") + "]"
                    cells.append(_fmt(r) + extra)
                out.append(f"| {m} | " + " | ".join(cells) + " |")
    out += ["", "\\* not at the target cost: the nearest reachable (the optimal completion rule drops every A = 0 "
            "completion as soon as r_o > 0, a jump in cost). Relative MSE = E\\|ghat - g\\|^2 / \\|g\\|^2 over "
            "the draws, conditional on the checkpoint's rollout."]
    return "\n".join(out)


def _geo(values: list[float]) -> float:
    v = [max(x, 1e-8) for x in values]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else math.nan


def summary(rows: list[dict], best: list[dict], steps: list[int], costs: dict, targets) -> list[str]:
    """Per regime and target, over the checkpoints: each method at ONE setting for all checkpoints (its r_q and
    continue fraction with the least geometric-mean error), mean relative MSE (the expected variance, tails
    included), median, and the geometric mean of the ratio to completion-only optimal and to uniform."""
    out = ["", "### Summary over the checkpoints (each method at one setting for all of them: the grid point with "
           "the least geometric-mean error; the planner at its own r_q per checkpoint)", "",
           "| regime | cost | method | setting | mean rel. MSE | median | geo-mean ratio to completion-only "
           "optimal | geo-mean ratio to uniform (fewer prompts) | checkpoints at the target |", "|---" * 9 + "|"]
    for regime in costs:
        for target in targets:
            sel = [r for r in rows if r.get("table") == "equal_cost" and r["regime"] == regime
                   and r["target"] == target]
            configs: dict = {}
            for r in sel:
                fixed = r["method"] == "posterior, planner's r_q" or r.get("r_q") is None
                key = (r["method"], None if fixed else (r["r_q"], None))
                configs.setdefault(key, {})[r["rl_step"]] = r
            def per_step(method):
                return next((v for (m, _), v in configs.items() if m == method), {})
            ref_c, ref_u = per_step("completion-only optimal"), per_step("uniform: fewer prompts, all trained")
            chosen: dict = {}
            for (m, setting), per in configs.items():
                if any(per[s].get("rel_mse") is None for s in per) or len(per) < len(steps):
                    continue
                g = _geo([per[s]["rel_mse"] for s in steps])
                if m not in chosen or g < chosen[m][0]:
                    chosen[m] = (g, setting, per)
            for m, (_, setting, per) in chosen.items():
                vals = [per[s]["rel_mse"] for s in steps]
                rc = [per[s]["rel_mse"] / ref_c[s]["rel_mse"] for s in steps if s in ref_c
                      and (ref_c[s].get("rel_mse") or 0) > 1e-8]
                ru = [per[s]["rel_mse"] / ref_u[s]["rel_mse"] for s in steps if s in ref_u
                      and (ref_u[s].get("rel_mse") or 0) > 1e-8]
                reached = sum(bool(per[s].get("reached", True)) for s in steps)
                label = "-" if setting is None else f"r_q {setting[0]}" + (
                    f", cont. {setting[1]}" if setting[1] is not None else "")
                med = sorted(vals)[len(vals) // 2]
                out.append(f"| {regime} | {target} | {m} | {label} | {sum(vals) / len(vals):.3g} | {med:.3g} | "
                           f"{_geo(rc):.2f} | {_geo(ru):.2f} | {reached} of {len(vals)} |")
    return out
