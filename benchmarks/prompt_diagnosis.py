"""Why does a pruned step learn less? Four measurements on a trained policy's real per-sequence gradients, before
any tuning of the prompt level (issue 34; docs/benchmarks.md, "Why the prompt level loses").

The quickstart policy trained with GRPO and its checkpoints, batches and per-sequence gradients are those of
``gradient_fidelity.py --real`` (``benchmarks/_real_gradients.py``, the same cache; run that first with
``--coords 16384``). Each method is drawn K times at an equal MODELLED step cost (``algo.step_cost``, coefficients
from the training run's own phase timers) and measured through the Gram matrix and through the gradients on a
random subset of coordinates:

1. The variance the 1/pi weights add: the relative MSE, its exact prompt-level part
   sum_q (1/pi_q - 1) |g_q|^2 / |g|^2 and the rest (the completion level), the prompt-level part by weight
   bucket of 1/pi_q, the largest weight and the effective sample size.
2. Adam: with its second moment in steady state, v_j = E[ghat_j^2], coordinate j's expected step is
   E[ghat_j] / sqrt(v_j), and pruning noise raises v_j. With g the batch gradient (E[ghat] = g for every unbiased
   method) and p_j^2 the pruning variance of coordinate j over the draws, v_j = g_j^2 + p_j^2 (g_j^2 stands for
   the unpruned step's own second moment), and the expected step along g is sum_j g_j^2 / sqrt(g_j^2 + p_j^2);
   reported as the ratio to the unpruned step's sum_j |g_j|: the factor by which Adam shortens the useful step
   at a fixed learning rate. (SGD's expected step is unchanged by any unbiased pruning: its ratio is 1.) A model
   of Adam: momentum, epsilon and the actual optimizer state are left out. The batch's signal fraction
   |mu|^2 / |g|^2 = 1 - tr S / |g|^2 (S below) says how much of g itself is the task's gradient and how much the
   draw of its 64 prompts.
3. The effective batch at a fixed learning rate: B_eff = B tr S / (tr S + tr P) (S: sampling covariance of the
   batch gradient, P: the pruning covariance), against the kappa B prompts an unpruned step of the same cost
   kappa would draw. B_eff > kappa B: pruning beats a smaller batch at that cost.
4. Allocation: draw more prompts and prune harder, at the same cost? B_d of the checkpoint's 64 prompts drawn at
   random (a simple random sample, weight 64 / B_d), then the method inside, at the cost target relative to the
   64-prompt step; the error against the 64-prompt gradient (the population here).

    .venv/bin/python benchmarks/prompt_diagnosis.py [--steps 50 100 150] [--draws 200] \\
        [--out docs/benchmarks/prompt_diagnosis.json --markdown docs/benchmarks/prompt_diagnosis.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/prompt_diagnosis.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from benchmarks import _prompt_level as PL
from benchmarks import _real_gradients as R
from benchmarks import common as C

BUCKETS = (1.0, 1.5, 3.0, 10.0, math.inf)  # weight buckets of 1/pi_q


def load(args, step: int):
    cache = args.work_dir / "analysis" / f"rl_step{step}_B{args.prompts}_G{args.group}.pt"
    if not cache.is_file():
        sys.exit(f"{cache} is missing: run benchmarks/gradient_fidelity.py --real --coords {args.coords} first")
    data = R.StepData(**torch.load(cache, weights_only=False))
    if data.coords is None:
        sys.exit(f"{cache} has no coordinate subset: rerun gradient_fidelity.py --real --coords {args.coords}")
    return data


def methods(ctx: R.Ctx, P: PL.Prompts, r_qs: list[float]):
    """name -> (make(knob) -> Draws, prompt keep pi_q [B] or None): the one-level methods, and the two-level ones
    at each prompt rate of ``r_qs``."""
    from megatron_dppo.algo.prompt_posterior import keep_probabilities
    ones = torch.ones(ctx.B, dtype=torch.float64)
    out = {"uniform: fewer prompts": (lambda r: PL.arm(ctx, ones * (1 - r), 0.0, "sub"), None, None),
           "completion-only optimal": (lambda r: PL.arm(ctx, ones, r, "co"), ones, None)}
    h = torch.nan_to_num(ctx.h, nan=float(torch.nan_to_num(ctx.h, nan=0.0).max()))  # unseen: kept with 1
    for r_q in r_qs:
        s_post, s_post1 = P.posterior_score(ctx.G, P.gamma), P.posterior_score(ctx.G, 1.0)
        post = keep_probabilities(s_post, r_q, PL.MAX_WEIGHT)
        post1 = keep_probabilities(s_post1, r_q, PL.MAX_WEIGHT)
        hist = PL.history_keep(ctx, r_q)
        orac = PL.water(P.gq, r_q, 0.0)
        out.update({
            f"today's optimal (h_q), r_q {r_q}": (lambda r, pi=hist: PL.arm(ctx, pi, r, "hist"), hist, h),
            f"posterior (fitted gamma), r_q {r_q}": (lambda r, pi=post: PL.arm(ctx, pi, r, "post"), post, s_post),
            f"posterior (gamma 1), r_q {r_q}": (lambda r, pi=post1: PL.arm(ctx, pi, r, "post1"), post1, s_post1),
            f"oracle both levels, r_q {r_q}": (lambda r, pi=orac: PL.arm(ctx, pi, r, "orac", completion="oracle"),
                                                orac, None)})
    return out


def sampling_variance(M: torch.Tensor, B: int, G: int) -> float:
    """tr Cov of the batch gradient g = sum_q g_q with its prompts as i.i.d. draws: B/(B-1) sum_q |g_q - g/B|^2."""
    Mq = M.view(B, G, B, G).sum((1, 3))  # [B, B] <g_q, g_r>
    g2 = float(Mq.sum())
    dev = Mq.diagonal() - 2 * Mq.sum(1) / B + g2 / B**2
    return float(dev.sum()) * B / (B - 1)


def adam_ratio(U: torch.Tensor, W: torch.Tensor, B: int, G: int) -> dict:
    """The steady-state Adam model of the module docstring on the coordinates U [N, S]."""
    U = U.double()
    g = U.sum(0)
    gq = U.view(B, G, -1).sum(1)
    s2 = (gq - g / B).pow(2).sum(0) * B / (B - 1)
    p2 = (W.double() @ U).var(0, correction=1)
    useful = float((g * g / (g * g + p2).sqrt().clamp(min=1e-30)).sum()) / float(g.abs().sum())
    return {"useful_ratio": useful, "pruning_to_sampling": float(p2.sum() / s2.sum())}


def diagnose(ctx: R.Ctx, P: PL.Prompts, U: torch.Tensor, cost, target: float, iters: int,
             r_qs: list[float]) -> list[dict]:
    rows = []
    g2 = float(ctx.M.sum())
    trS = sampling_variance(ctx.M, ctx.B, ctx.G)
    for name, (make, pi_q, proxy) in methods(ctx, P, r_qs).items():
        knob, d, info = PL.solve_cost(ctx, make, cost, target, iters)
        row = {"rl_step": ctx.step, "target": target, "method": name, **info}
        if d is None:
            rows.append(row)
            continue
        st = R.mc_stats(ctx, d.W)
        row.update(st)
        # 1. the prompt level's exact part and its weight buckets
        if pi_q is not None:
            part = torch.where(pi_q > 0, (1 / pi_q.clamp(min=1e-300) - 1) * P.gq**2 / g2, 0.0)
            row["prompt_part"] = float(part.sum())
            w = 1 / pi_q.clamp(min=1e-300)
            row["prompt_part_by_weight"] = {f"[{lo:g}, {hi:g})": float(part[(w >= lo) & (w < hi)].sum())
                                            for lo, hi in zip(BUCKETS[:-1], BUCKETS[1:])}
            row["prompt_part_h_zero"] = float(part[ctx.h == 0].sum())
            if proxy is not None:  # the decision's own forecast of its prompt-level variance, and what it was
                from megatron_dppo.algo.optimal_keep import predicted_relative_variance
                row["prompt_predicted"] = predicted_relative_variance(pi_q, proxy)
                row["prompt_realised"] = predicted_relative_variance(pi_q, P.gq)
        else:  # fewer prompts: each kept with 1 - knob
            row["prompt_part"] = float((1 / (1 - knob) - 1) * (P.gq**2).sum() / g2)
        Wk = d.W[d.W > 0]
        row["max_weight"] = float(Wk.max())
        row["ess_fraction"] = float(((d.W.sum(1) ** 2) / (d.W ** 2).sum(1).clamp(min=1e-30)).mean()) / ctx.N
        # 2. Adam
        a = adam_ratio(U, d.W, ctx.B, ctx.G)
        row["adam_useful_ratio"] = a["useful_ratio"]
        row["pruning_to_sampling_coords"] = a["pruning_to_sampling"]
        # 3. effective batch at a fixed learning rate
        trP = st["rel_mse"] * g2
        row["b_eff"] = ctx.B * trS / (trS + trP)
        row["b_same_cost"] = target * ctx.B
        rows.append(row)
    top = float((P.gq**2).max() / (P.gq**2).sum())
    rows.append({"rl_step": ctx.step, "target": target, "method": "(batch)", "sampling_rel_var": trS / g2,
                 "signal_fraction": 1 - trS / g2, "top_prompt_share": top})
    return rows


def allocation(ctx: R.Ctx, P: PL.Prompts, cost, target: float, iters: int, drawn: list[int]) -> list[dict]:
    """Draw B_d of the B prompts (simple random sample per draw), prune inside at the cost target (relative to the
    B-prompt step); error against the B-prompt gradient."""
    from megatron_dppo.algo.optimal_keep import water_fill
    rows = []
    K, B = ctx.K, ctx.B
    post_s = P.posterior_score(ctx.G, P.gamma)
    for b_d in drawn:
        order = torch.rand(K, B, generator=ctx.gen(f"alloc/{b_d}"), dtype=torch.float64).argsort(1)
        mask = torch.zeros(K, B, dtype=torch.bool).scatter(1, order[:, :b_d], True)
        scale = b_d / B
        sub_target = target / scale  # the cost inside the drawn batch, relative to its own unpruned cost
        if sub_target > 1.0 + 1e-9:
            continue
        for r_q in (0.0, 0.2, 0.4, 0.6):
            if r_q == 0.0:
                pi = mask.double()
            else:
                s = torch.where(mask, post_s.expand(K, B), torch.zeros(K, B, dtype=torch.float64))
                floor = torch.where(mask, 1.0 / PL.MAX_WEIGHT, 0.0).double()
                pi = water_fill(s, torch.full((K,), (1 - r_q) * b_d, dtype=torch.float64), floor=floor)
            sub = dataclasses.replace(ctx)
            knob, d, info = PL.solve_cost(sub, lambda r, pi=pi: PL.arm(ctx, pi, r, f"alloc/{b_d}/{r_q}", scale=scale),
                                          cost, target, iters)
            row = {"rl_step": ctx.step, "target": target, "drawn": b_d, "r_q": r_q, "r_o": knob, **info}
            if d is not None:
                row.update(R.mc_stats(ctx, d.W))
            rows.append(row)
    return rows


def run(args) -> dict:
    C.quiet()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    visits = PL.read_visits(args.work_dir / "train" / "audit.jsonl")
    costs = PL.costs_of(args.work_dir, args.group, args.generation_share)
    rows, alloc = [], []
    for step in args.steps:
        data = load(args, step)
        ctx = R.Ctx(M=data.gram, A=data.advantages, L=data.lengths, h=data.history, rewards=data.rewards,
                    norms=data.norms, K=args.draws, seed=args.seed, step=step, ids=data.prompt_ids)
        gamma = R.fit_alpha(data.norms, data.advantages, data.lengths)["coef_log_abs_A"]
        P = PL.prompts_of(ctx, visits, gamma)
        for regime, cost in costs.items():
            for target in args.cost_fractions:
                for row in diagnose(ctx, P, data.coords, cost, target, args.cost_bisect, args.r_q):
                    rows.append({"regime": regime, **row})
                print(f"step {step} {regime} {target}: done", file=sys.stderr, flush=True)
            alloc += [{"regime": regime, **r} for r in
                      allocation(ctx, P, cost, args.allocation_target, args.cost_bisect, args.drawn)]
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": C.machine(), "costs": {k: {**dataclasses.asdict(v), "generation_share": v.generation_share()}
                                              for k, v in costs.items()},
            "rows": rows, "allocation": alloc, "seconds": time.perf_counter() - t0}


def markdown(rep: dict) -> str:
    c = rep["config"]
    steps = c["steps"]
    out = [f"Checkpoints {steps} of the quickstart GRPO run; K = {c['draws']} draws per method; equal modelled step "
           f"cost (prompt rate r_q = {c['r_q']} for the two-level methods, r_o solved). Costs: "
           + "; ".join(f"{k}: generation share {v['generation_share']:.2f}" for k, v in rep["costs"].items()) + ".",
           ""]
    batch = {(r["rl_step"]): r for r in rep["rows"] if r["method"] == "(batch)"}
    out += ["| step | sampling variance of the 64-prompt gradient / \\|g\\|^2 | signal fraction 1 - that | "
            "largest prompt's share of sum \\|g_q\\|^2 |", "|---|---|---|---|"]
    out += [f"| {s} | {batch[s]['sampling_rel_var']:.2f} | {batch[s]['signal_fraction']:.2f} | "
            f"{batch[s]['top_prompt_share']:.2f} |" for s in steps if s in batch]
    out.append("")
    out += summary(rep)
    out += ["Every checkpoint's rows (and the allocation study's) are in the JSON report."]
    return "\n".join(out)


def _heavy(r: dict) -> float:
    return sum(v for k, v in r.get("prompt_part_by_weight", {}).items() if float(k[1:].split(",")[0]) >= 3)


def summary(rep: dict) -> list[str]:
    """Means over the checkpoints: per regime, cost and method, and the allocation study."""
    from collections import defaultdict
    nan = float("nan")
    groups = defaultdict(list)
    for r in rep["rows"]:
        if r["method"] != "(batch)" and r.get("rel_mse") is not None:
            groups[(r["regime"], r["target"], r["method"])].append(r)
    mean = lambda v, key: sum(x.get(key, nan) for x in v) / len(v)  # noqa: E731
    out = ["### Means over the checkpoints", "",
           "| regime | cost | method | checkpoints (at the cost) | rel. MSE | prompt part | of which weight >= 3 | "
           "prompt level predicted / realised | Adam useful-step ratio | B_eff | kappa B |", "|---" * 11 + "|"]
    for (regime, target, method), v in groups.items():
        pred = [x for x in v if "prompt_predicted" in x]
        pr = (f"{mean(pred, 'prompt_predicted'):.3f} / {mean(pred, 'prompt_realised'):.3f}" if pred else "-")
        out.append(f"| {regime} | {target} | {method} | {len(v)} ({sum(bool(x.get('reached')) for x in v)}) | "
                   f"{mean(v, 'rel_mse'):.3g} | {mean(v, 'prompt_part'):.3g} | "
                   f"{sum(_heavy(x) for x in v) / len(v):.3g} | {pr} | {mean(v, 'adam_useful_ratio'):.3f} | "
                   f"{mean(v, 'b_eff'):.1f} | {v[0]['b_same_cost']:.1f} |")
    alloc = defaultdict(list)
    for r in rep["allocation"]:
        if r.get("rel_mse") is not None:
            alloc[(r["regime"], r["drawn"], r["r_q"])].append(r)
    out += ["", f"Allocation, means over the checkpoints (cost {rep['config']['allocation_target']} of the 64-prompt "
            "step; error against the 64-prompt gradient):", "",
            "| regime | prompts drawn | r_q | checkpoints (at the cost) | mean cost | mean r_o | rel. MSE |",
            "|---" * 7 + "|"]
    for (regime, drawn, r_q), v in sorted(alloc.items()):
        out.append(f"| {regime} | {drawn} | {r_q} | {len(v)} ({sum(bool(x.get('reached')) for x in v)}) | "
                   f"{mean(v, 'cost'):.2f} | {mean(v, 'r_o'):.2f} | {mean(v, 'rel_mse'):.3g} |")
    return out + [""]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work-dir", type=Path, default=C.REPO / "runs" / "gradient_fidelity_real")
    ap.add_argument("--steps", type=int, nargs="+", default=[50, 100, 150])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--draws", type=int, default=200)
    ap.add_argument("--coords", type=int, default=16384, help="(the cache's coordinate subset; for messages)")
    ap.add_argument("--cost-fractions", type=float, nargs="+", default=[0.5, 0.7])
    ap.add_argument("--generation-share", type=float, default=0.8)
    ap.add_argument("--cost-bisect", type=int, default=12)
    ap.add_argument("--r-q", type=float, nargs="+", default=[0.3, 0.5], help="prompt rates of the two-level methods")
    ap.add_argument("--allocation-target", type=float, default=0.5)
    ap.add_argument("--drawn", type=int, nargs="+", default=[32, 40, 48, 56, 64])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--markdown", type=Path, default=None)
    ap.add_argument("--from-results", type=Path, default=None, help="re-render a saved report (no computation)")
    args = ap.parse_args(argv)
    rep = json.loads(args.from_results.read_text()) if args.from_results else run(args)
    text = markdown(rep)
    print(text)
    if args.markdown is not None:
        args.markdown.write_text("# Why the prompt level loses (`benchmarks/prompt_diagnosis.py`)\n\n" + text + "\n")
    C.write_json(args.out, rep, digits=4)


if __name__ == "__main__":
    main()
