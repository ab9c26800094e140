"""Adaptive group sizes offline, on real gradients (docs/benchmarks.md, "Adaptive group sizes"): the allocation's
gradient error at an equal modelled cost against uniform G, the DAPO filter and completion-level DPPO.

Data: ``_real_gradients`` (as ``gradient_fidelity.py --real``, section 11): the CPU quickstart trained with GRPO
(audit trail on), and at each checkpoint its next step's real batch (B = 64 prompts x G = 8) with the gradient g_i
of every sequence's loss term. On policy without a KL term g_i = A_i s_i (A the run's std-GRPO advantage, s_i the
sequence's score term with the loss's normalisation), so the Gram matrix of the score terms is
S_ij = M_ij / (A_i A_j) for every completion of a group with mixed rewards (a constant group has zero gradient
under every estimator here). Every method is then a coefficient vector c [N] (its estimate is sum_i c_i s_i),
drawn K times:

- the reference: the full batch's rloo gradient, c_i = A^rloo_i / G;
- ``uniform n``: every prompt n completions (a uniformly random n-subset of its 8: real completions are i.i.d.),
  rloo over them, c_i = A^rloo_sub_i / n; n randomised per prompt between floor and ceil to meet the cost;
- ``filter``: a fraction phi of the prompts (each kept with phi, weight 1/phi), all 8, groups with one reward for
  all not trained (they cost generation only): the DAPO filter at the cost, by fewer prompts;
- ``completion-level DPPO + filter``: every prompt's 8 generated, the completion level's optimal keep on |A^rloo|
  (``DPPOPruner``, r_q = 0) and the filter; unreachable below the generation share;
- ``allocation (signal s) + filter``: ``algo.allocation.allocate`` from the prompt posterior the run would hold
  at that step (``_prompt_level.posterior_before``, rebuilt from the audit trail), the rloo energy curve and the
  step cost, n_q <= 8; each prompt generated with pi_q, its n_q a random subset of its 8, weight 1/pi_q.

Every subset estimate is unbiased for the reference (rloo is a U-statistic: its mean over the n-subsets of a
group is the group's rloo), so the error is the added variance. Cost = c_gen x generated + c_train x trained
completions (the fixed part left out), as a fraction of the uniform step (all 8 generated and trained), measured
on the draws' realised counts; each method's knob is solved by bisection (common random numbers) so that its
mean realised cost equals the target. Costs: the run's own phase timers (CPU, generation share about 0.26) and a
modelled regime with generation 0.8 of the same total (section 11's). Also: the fitted signal-to-noise ratio of
the model (``fit_signal``).

    .venv/bin/python benchmarks/adaptive_fidelity.py --work-dir runs/adaptive_real --steps 20 40 60 80 100 \
        --draws 50 --bisect 7 --signals 0.3 1.0 --out docs/benchmarks/adaptive_fidelity.json

(trains the quickstart and collects the missing batches first: about 100 RL steps and 35 s per checkpoint)
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from benchmarks import _prompt_level as PL
from benchmarks import _real_gradients as R
from benchmarks import common as C

MAX_WEIGHT = 20.0


@dataclasses.dataclass
class Batch:
    """One checkpoint's batch: score Gram S [N, N], rewards [B, G], the reference coefficients, posterior."""

    S: torch.Tensor
    rewards: torch.Tensor
    mixed: torch.Tensor  # [B] bool
    ref: torch.Tensor  # [N]
    alpha: torch.Tensor
    beta: torch.Tensor
    step: int

    @property
    def B(self) -> int:
        return self.rewards.shape[0]

    @property
    def G(self) -> int:
        return self.rewards.shape[1]


def rloo(r: torch.Tensor) -> torch.Tensor:
    """rloo advantages of the last dim (any size >= 2), exact 0 on constant groups."""
    n = r.shape[-1]
    return r - (r.sum(-1, keepdim=True) - r) / (n - 1)


def load_batch(data: R.StepData, visits: dict) -> Batch:
    A, M = data.advantages.double(), data.gram.double()
    a = A.flatten()
    nz = a != 0
    S = torch.zeros_like(M)
    S[nz.unsqueeze(1) & nz.unsqueeze(0)] = (M / torch.outer(torch.where(nz, a, 1.0), torch.where(nz, a, 1.0)))[
        nz.unsqueeze(1) & nz.unsqueeze(0)]
    r = data.rewards.double()
    mixed = (r != r[:, :1]).any(1)
    ref = (rloo(r) / r.shape[1]).flatten()
    post = PL.posterior_before(visits, data.rl_step, r.shape[1])
    alpha, beta = post.beta_parameters(data.prompt_ids, data.rl_step)
    return Batch(S=S, rewards=r, mixed=mixed, ref=ref, alpha=alpha, beta=beta, step=data.rl_step)


def fit_signal(b: Batch) -> dict:
    """The model's S_q / N_q(2) over the batch: from |g_q(G)|^2 and the mean over pairs of |g_q(2)|^2 (both
    estimable exactly from the batch), v = (E|g(2)|^2 - |g(G)|^2) / (1 - 1/(G-1)), S = |g(G)|^2 - v/(G-1)."""
    G = b.G
    full, pairs = 0.0, 0.0
    for q in range(b.B):
        if not b.mixed[q]:
            continue
        idx = slice(q * G, (q + 1) * G)
        Sq, c = b.S[idx, idx], b.ref[idx]
        full += float(c @ Sq @ c)
        r = b.rewards[q]
        tot, cnt = 0.0, 0
        for i in range(G):
            for j in range(i + 1, G):
                d = float(r[i] - r[j])
                tot += 0.25 * d * d * float(Sq[i, i] + Sq[j, j] - 2 * Sq[i, j])
                cnt += 1
        pairs += tot / cnt
    v = (pairs - full) / (1 - 1 / (G - 1))
    s = full - v / (G - 1)
    return {"signal": s / v if v > 0 else float("nan"), "full_sq": full, "pair_sq": pairs}


def subset_coefficients(b: Batch, sizes: torch.Tensor, weight: torch.Tensor, gen: torch.Generator):
    """c [N] of one draw: prompt q (size n_q > 0) with a random n_q-subset, rloo over it, times weight_q / n_q;
    and the draw's (generated, trained with the filter) completion counts."""
    G = b.G
    order = torch.rand(b.B, G, generator=gen).argsort(-1)
    chosen = torch.arange(G).expand(b.B, G) < sizes[:, None]
    slots = torch.zeros(b.B, G, dtype=torch.bool).scatter(-1, order, chosen)
    c = torch.zeros(b.B, G, dtype=torch.float64)
    trained = 0
    for n in sorted(set(sizes.tolist()) - {0}):
        rows = (sizes == n).nonzero().flatten()
        r = b.rewards[rows][slots[rows]].view(len(rows), n)
        adv = rloo(r)
        block = torch.zeros(len(rows), G, dtype=torch.float64)
        block[slots[rows]] = (adv * (weight[rows, None] / n)).flatten()
        c[rows] = block
        trained += int(((r != r[:, :1]).any(1)).sum()) * n
    return c.flatten(), int(sizes.sum()), trained


def stats(b: Batch, coefs: list[torch.Tensor], costs: list[float]) -> dict:
    E = torch.stack(coefs) - b.ref
    ref2 = float(b.ref @ b.S @ b.ref)
    err = ((E @ b.S) * E).sum(1) / ref2
    K = len(coefs)
    return {"rel_mse": float(err.mean()), "se": float(err.std()) / math.sqrt(K), "cost": sum(costs) / K}


def draws(b: Batch, method: str, knob: float, cost, K: int, seed: int, alloc_signal: float = 1.0) -> dict:
    """K draws of ``method`` at ``knob``: (coefficient vectors, realised cost fractions)."""
    gen = torch.Generator().manual_seed(seed * 1000 + b.step)
    full = b.B * b.G * (cost.generate + cost.train)
    coefs, costs = [], []
    for _ in range(K):
        if method == "uniform":  # knob: the mean group size
            lo = math.floor(knob)
            sizes = lo + (torch.rand(b.B, generator=gen) < knob - lo).long()
            c, g, _ = subset_coefficients(b, sizes, torch.ones(b.B, dtype=torch.float64), gen)
            cst = g * (cost.generate + cost.train)
        elif method == "filter":  # knob: the fraction of prompts
            keep = torch.rand(b.B, generator=gen, dtype=torch.float64) < knob
            c = (b.ref.view(b.B, b.G) * (keep / knob)[:, None]).flatten()
            cst = int(keep.sum()) * b.G * cost.generate + int((keep & b.mixed).sum()) * b.G * cost.train
        elif method == "completion":  # knob: r_o of the completion level's optimal keep (+ filter)
            from megatron_dppo.algo.pruning import DPPOPruner
            A = rloo(b.rewards)
            res = DPPOPruner(0.0, knob, keep="optimal", keep_floor=0.3).select_completions(A.float(), gen)
            kept = res.keep & b.mixed[:, None]
            c = torch.where(kept, b.ref.view(b.B, b.G) / res.keep_prob.double(), torch.zeros_like(A)).flatten()
            cst = b.B * b.G * cost.generate + int(kept.sum()) * cost.train
        else:  # allocation: knob = the budget fraction
            from megatron_dppo.algo.allocation import allocate, draw_allocation
            if not hasattr(b, "_alloc") or b._alloc[0] != (knob, alloc_signal, cost):
                a = allocate(b.alpha, b.beta, budget=knob * full, gen_cost=cost.generate, train_cost=cost.train,
                             n_min=2, n_max=b.G, max_weight=MAX_WEIGHT, signal=alloc_signal, filtered=True)
                b._alloc = ((knob, alloc_signal, cost), a)
            a = b._alloc[1]
            keep = draw_allocation(a.prob, gen)
            sizes = torch.where(keep, a.sizes, torch.zeros_like(a.sizes))
            c, g, t = subset_coefficients(b, sizes, 1.0 / a.prob, gen)
            cst = g * cost.generate + t * cost.train
        coefs.append(c)
        costs.append(cst / full)
    return stats(b, coefs, costs)


def solve(b: Batch, method: str, target: float, cost, K: int, seed: int, lo: float, hi: float, iters: int,
          **kw) -> dict:
    """The knob whose mean realised cost is ``target`` (cost increases with the knob, except r_o: decreasing)."""
    decreasing = method == "completion"
    f = {}

    def at(x):
        if x not in f:
            f[x] = draws(b, method, x, cost, K, seed, **kw)
        return f[x]

    ends = sorted((at(lo)["cost"], at(hi)["cost"]))
    if not ends[0] - 0.01 <= target <= ends[1] + 0.01:
        return {"reached": False, "range": ends}
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        above = at(mid)["cost"] > target
        if above != decreasing:
            hi = mid
        else:
            lo = mid
    best = min((lo, hi), key=lambda x: abs(at(x)["cost"] - target))
    return {"reached": abs(at(best)["cost"] - target) <= 0.02, "knob": best, **at(best)}


def run(args) -> dict:
    C.quiet()
    torch.set_num_threads(1)
    t0 = time.process_time()
    visits = PL.read_visits(args.work_dir / "train" / "audit.jsonl")
    costs = PL.costs_of(args.work_dir, args.group, args.generation_share)
    rows, fits = [], []
    for step in args.steps:
        cache = args.work_dir / "analysis" / f"rl_step{step}_B{args.prompts}_G{args.group}.pt"
        b = load_batch(R.StepData(**torch.load(cache, weights_only=False)), visits)
        fit = fit_signal(b)
        fits.append({"rl_step": step, **fit, "mixed_groups": float(b.mixed.double().mean())})
        print(f"step {step}: fitted signal {fit['signal']:.3f}, mixed {float(b.mixed.double().mean()):.2f}",
              file=sys.stderr, flush=True)
        for regime, cost in costs.items():
            for target in args.targets:
                def add(name, res):
                    rows.append({"rl_step": step, "regime": regime, "target": target, "method": name, **res})
                    if res.get("reached"):
                        print(f"  {regime} {target} {name}: rel.MSE {res['rel_mse']:.4f} (cost {res['cost']:.3f})",
                              file=sys.stderr, flush=True)
                add("uniform n", solve(b, "uniform", target, cost, args.draws, args.seed, 2.0, 8.0, args.bisect))
                add("filter (fewer prompts)", solve(b, "filter", target, cost, args.draws, args.seed, 0.02, 1.0,
                                                    args.bisect))
                add("completion-level DPPO + filter", solve(b, "completion", target, cost, args.draws, args.seed,
                                                            0.0, 0.999, args.bisect))
                for s in args.signals:
                    add(f"allocation (signal {s:g}) + filter", solve(b, "allocation", target, cost, args.draws,
                                                                      args.seed, 0.02, 1.0, args.bisect,
                                                                      alloc_signal=s))
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": C.machine(), "cpu_s": time.process_time() - t0,
            "costs": {k: {**dataclasses.asdict(v), "generation_share": v.generation_share()}
                      for k, v in costs.items()},
            "signal_fit": fits, "rows": rows, "summary": summary(rows)}


def summary(rows: list[dict]) -> list[dict]:
    """Per (regime, target, method): mean rel. MSE over the checkpoints where reached, and the geometric mean of
    the ratio to uniform n at the same checkpoint."""
    out = []
    keys = sorted({(r["regime"], r["target"], r["method"]) for r in rows})
    for regime, target, method in keys:
        mine = {r["rl_step"]: r for r in rows if (r["regime"], r["target"], r["method"]) == (regime, target, method)
                and r.get("reached")}
        uni = {r["rl_step"]: r for r in rows if (r["regime"], r["target"], r["method"]) == (regime, target,
                                                                                             "uniform n")}
        ratios = [mine[s]["rel_mse"] / uni[s]["rel_mse"] for s in mine if s in uni and uni[s].get("reached")
                  and uni[s]["rel_mse"] > 0 and mine[s]["rel_mse"] > 0]
        out.append({"regime": regime, "target": target, "method": method, "checkpoints": len(mine),
                    "mean_rel_mse": sum(r["rel_mse"] for r in mine.values()) / len(mine) if mine else float("nan"),
                    "geo_ratio_to_uniform": math.exp(sum(map(math.log, ratios)) / len(ratios)) if ratios
                    else float("nan")})
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work-dir", type=Path, default=C.REPO / "runs" / "adaptive_real")
    ap.add_argument("--steps", type=int, nargs="+", default=[20, 40, 60, 80, 100])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.7], help="cost fractions of the uniform step")
    ap.add_argument("--signals", type=float, nargs="+", default=[0.0, 0.3, 1.0, 3.0])
    ap.add_argument("--generation-share", type=float, default=0.8)
    ap.add_argument("--draws", type=int, default=100)
    ap.add_argument("--bisect", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    cached = lambda s: args.work_dir / "analysis" / f"rl_step{s}_B{args.prompts}_G{args.group}.pt"  # noqa: E731
    missing = [s for s in args.steps if not cached(s).is_file()]
    if missing:  # train the quickstart (GRPO, audit trail on) and collect the batches, as gradient_fidelity --real
        C.quiet()
        torch.set_num_threads(1)
        paths, _ = R.ensure_checkpoints(args.work_dir, args.steps)
        run_ = R.open_run(args.work_dir)
        for s in missing:
            print(f"checkpoint RL step {s}: rollout and per-sequence gradients", file=sys.stderr, flush=True)
            torch.save(dataclasses.asdict(R.collect(run_, paths[s], args.prompts, args.group)), cached(s))
    rep = run(args)
    C.write_json(args.out, rep, digits=6)
    for r in rep["summary"]:
        print(f"{r['regime']:>32} {r['target']:.1f} {r['method']:>36}: {r['mean_rel_mse']:.4f} "
              f"(geo x uniform {r['geo_ratio_to_uniform']:.2f}, {r['checkpoints']} ckpt)")


if __name__ == "__main__":
    main()
