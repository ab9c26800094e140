"""Gradient fidelity of pruning on the Megatron engine: mean pruned gradient over K draws vs the full batch.

A real decoder (tiny Qwen2, random init, ``--model``) and real rollouts (``benchmarks/_engine.py``: GSM8K token
ids and lengths scaled by ``--scale``, seeded rewards, B prompts x G completions). Old and reference log-probs
are the current log-probs plus a smooth per-(sequence, position) offset (0.3 and 0.2 nats), so PPO/GSPO
clipping is active and the KL term (k3, beta = ``--kl``) is non-zero: the hardest case for unbiasedness.

For each loss preset (``LOSS_PRESETS``: grpo = seq_mean_token_mean, dapo = token_mean, dr_grpo =
seq_mean_token_sum_norm, gspo = sequence ratio) and each pruner:

* ``full``: every sequence, weight 1, D of the full batch -> g (one engine gradient, ``audit.step_gradient``).
* ``dppo <mode>``: ``DPPOPruner(r_q, r_o, mode)``, prompt AND completion level, weights 1/(pi_q pi_{i|q}),
  the full-batch D (token_mean with prompt pruning: the Horvitz-Thompson D, consistent, not exactly unbiased).
* ``cppo <scope>``: ``CPPOPruner(P, scope)``, weight 1, D over the kept units (the authors' mean).

Each pruner is drawn K times (seeded generators); every draw's gradient g_k is a full engine forward+backward on
the packed kept sequences. Reported: cosine(mean_k g_k, g); rel. error |mean_k g_k - g| / |g|; its Monte-Carlo
standard error ``se = sqrt(tr S / K) / |g|`` (S = sample covariance of the g_k); ``z = rel / se`` (about 1
when unbiased: E|mean - g|^2 = tr Var / K; >> 1 = bias); the mean single-draw cosine; the empirical total
variance tr S vs the docs/algorithms.md "Pruning / DPPO / Variance" formula (bernoulli mode, draw-independent D):

    tr Var = sum_q [ (1/pi_q - 1) |g_q|^2 + sum_i (1/pi_{i|q} - 1) |g_qi|^2 / pi_q ],  g_q = sum_i g_qi,

with the per-unit gradients g_qi computed one sequence at a time on the engine (weight 1, full D).
``ratio`` = empirical / formula; its own sampling error is about sqrt(2/(K-1)).

Run: ``.venv/bin/python benchmarks/gradient_fidelity.py [--quick] [--out results.json]``

``--real``: a TRAINED policy and its own rollouts instead (docs/benchmarks/gradient_fidelity_real.md)
------------------------------------------------------------------------------------------------------
The CPU quickstart (examples/quickstart.yaml) trained with GRPO; at each checkpoint (RL steps ``--steps``) the
step's real batch (B prompts x G completions from the rollout engine, real rewards and advantages, the prompts'
restored history) and the gradient g_i of each sequence's loss term (``benchmarks/_real_gradients.py``). Only the
Gram matrix M = U U^T [N, N] is kept; for a weight vector w [N] (0 = pruned, else the method's weight), the pruned
gradient is U^T w, so with e = w - 1 its squared error is e^T M e and its cosine to g = U^T 1 is
w^T M 1 / sqrt(w^T M w 1^T M 1). Every method is drawn K times (``--draws``) at a rate solved by bisection with
common random numbers so that its Monte-Carlo mean kept fraction (trained completions / B*G) equals each target
``--fractions``; reported: relative MSE E|ghat - g|^2/|g|^2 with its MC standard error, the squared-bias part
|E ghat - g|^2/|g|^2 (from the mean of w; for an unbiased method it is noise of size MSE/K), the mean single-draw
cosine, the kept fraction. Conditional on each checkpoint's rollout (fixed); on-policy (ratio 1), kl_coef 0 as
the quickstart, so a completion with A = 0 has an exactly zero term. Plus: the fit log|g_i| ~ log|A_i| +
alpha log L_i (grpo and, at one checkpoint, dapo), and a keep_floor x length_exponent sweep of dppo-optimal.

    .venv/bin/python benchmarks/gradient_fidelity.py --real [--work-dir runs/gradient_fidelity_real] \
        [--out docs/benchmarks/gradient_fidelity_real.json] [--markdown docs/benchmarks/gradient_fidelity_real.md]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # `python benchmarks/gradient_fidelity.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import torch

from benchmarks import _engine as E
from benchmarks import _prompt_level as PL
from benchmarks import _real_gradients as R
from benchmarks import common as C


def perturb(batch, scale: float, phase: float) -> torch.Tensor:
    """Layout-independent offset per (sample id, position) (same function as the engine tests)."""
    sid = torch.where(batch.seq_index >= 0, batch.sample_ids[batch.seq_index.clamp(min=0)],
                      torch.zeros_like(batch.seq_index))
    return scale * torch.sin(1.7 * batch.position_ids.double() + 0.9 * sid.double() + phase).float()


def prepare(engine, mbs, kl: bool) -> list:
    lps = engine.compute_logprobs(mbs, "policy")
    for b, lp in zip(mbs, lps):
        b.old_logprobs = lp + perturb(b, 0.3, 0.0)
        b.ref_logprobs = (lp + perturb(b, 0.2, 1.0)) if kl else None
    return mbs


def denominator(kind: str, agg: str, r: E.Rollouts, keep, prompt_prob, L_max: int) -> float:
    from megatron_dppo.algo.losses import loss_denominator

    lengths = r.completion_lengths.double()
    if kind == "cppo":
        kept = lengths[keep].view(-1, 1)
        return loss_denominator(agg, int(keep.sum()), 1, kept, None, L_max)
    if kind == "dppo" and agg == "token_mean" and prompt_prob is not None:
        rows = keep.any(dim=1)
        # HT estimate over the kept prompts (their completions are all known here; pruned prompts' are not)
        return loss_denominator(agg, r.B, r.G, lengths[rows], prompt_prob[rows], L_max)
    return loss_denominator(agg, r.B, r.G, lengths, None, L_max)


def draw(kind: str, mode: str, args, r: E.Rollouts, k: int):
    """(keep [B,G], weight [B,G], prompt keep prob [B] or None, completion keep prob [B,G] or None)."""
    from megatron_dppo.algo.pruning import CPPOPruner, DPPOPruner, combine, make_generator

    if kind == "full":
        return torch.ones(r.B, r.G, dtype=torch.bool), torch.ones(r.B, r.G), None, None
    if kind == "cppo":
        res = CPPOPruner(args.cppo_rate, mode).select_completions(r.advantages, make_generator(args.seed, k, "c"))
        return res.keep, res.weight, None, None
    pruner = DPPOPruner(args.r_q, args.r_o, mode)
    p = pruner.select_prompts(r.history, make_generator(args.seed, k, "prompts"))
    c = pruner.select_completions(r.advantages, make_generator(args.seed, k, "completions"))
    total = combine(p, c)
    return total.keep, total.weight, p.probabilities().double(), c.probabilities().double()


def gradient(engine, r, keep, weight, agg, D, capacity, kl):
    from megatron_dppo.train.audit import step_gradient

    mbs, _ = E.micro_batches(r, keep, weight, agg, capacity)
    return step_gradient(engine, prepare(engine, mbs, kl), D)


def run(args) -> dict:
    from megatron_dppo.algo.advantages import compute_advantages
    from megatron_dppo.algo.losses import LOSS_PRESETS, LossConfig

    C.quiet()
    torch.set_num_threads(args.threads)
    questions = E.load_gsm8k(limit=args.questions, seed=args.seed)
    arch = E.bench_arch(args.model)
    base = E.make_rollouts(questions, args.prompts, args.group, arch.vocab_size, seed=args.seed, scale=args.scale,
                           max_completion=args.max_completion)
    L_max = args.max_completion
    kl = args.kl > 0
    results = []
    with E.engine_world(arch, LossConfig(kl_coef=args.kl, kl_estimator="k3").resolved(), seed=args.seed) as engine:
        for loss_name in args.losses:
            preset = LOSS_PRESETS[loss_name]
            estimator = preset.advantage_estimator
            cfg = dataclasses.replace(preset, kl_coef=args.kl, kl_estimator="k3")
            engine.loss_cfg = cfg
            agg = cfg.aggregation
            r = dataclasses.replace(base, advantages=compute_advantages(base.rewards, estimator))
            D_full = denominator("full", agg, r, None, None, L_max)
            g = gradient(engine, r, *draw("full", "", args, r, 0)[:2], agg, D_full, args.capacity, kl)
            g_norm = float(g.norm())
            # per-unit gradients (weight 1, full D) for the variance formula
            units = torch.zeros(r.B, r.G, g.numel(), dtype=torch.float64)
            if args.formula:
                for q in range(r.B):
                    for i in range(r.G):
                        keep = torch.zeros(r.B, r.G, dtype=torch.bool)
                        keep[q, i] = True
                        units[q, i] = gradient(engine, r, keep, torch.ones(r.B, r.G), agg, D_full, args.capacity,
                                               kl).double()
                lin_err = float((units.sum(dim=(0, 1)) - g.double()).norm()) / g_norm
            else:
                lin_err = float("nan")
            pruners = [("dppo", m) for m in args.modes] + [("cppo", s) for s in args.cppo_scopes]
            for kind, mode in pruners:
                grads, kept, probs = [], [], None
                for k in range(args.draws):
                    keep, weight, pq, pc = draw(kind, mode, args, r, k)
                    D = denominator(kind, agg, r, keep, pq, L_max)
                    grads.append(gradient(engine, r, keep, weight, agg, D, args.capacity, kl).double())
                    kept.append(float(keep.float().mean()))
                    probs = (pq, pc)
                G_ = torch.stack(grads)
                mean = G_.mean(0)
                diff = mean - g.double()
                trS = float(((G_ - mean) ** 2).sum(1).sum() / (args.draws - 1))
                rel = float(diff.norm()) / g_norm
                se = math.sqrt(trS / args.draws) / g_norm
                cos = float(mean @ g.double()) / (float(mean.norm()) * g_norm)
                single = float(torch.stack([(x @ g.double()) / (x.norm() * g_norm) for x in G_]).mean())
                formula = float("nan")
                if args.formula and kind == "dppo" and mode == "bernoulli" and agg != "token_mean":
                    pq, pc = probs
                    gq = units.sum(1)  # [B, P]
                    var_c = ((1 / pc - 1).unsqueeze(-1) * units ** 2).sum(dim=(1, 2))  # [B]
                    formula = float(((1 / pq - 1) * (gq ** 2).sum(1) + var_c / pq).sum())
                results.append({"loss": loss_name, "aggregation": agg, "pruner": f"{kind} {mode}", "kind": kind,
                                "mode": mode, "kept_fraction": sum(kept) / len(kept), "cosine_mean": cos,
                                "rel_error": rel, "se": se, "z": rel / se if se > 0 else float("nan"),
                                "single_draw_cosine": single, "trace_var": trS, "trace_var_formula": formula,
                                "var_ratio": trS / formula if formula == formula and formula > 0 else float("nan"),
                                "full_grad_norm": g_norm, "per_unit_linearity_error": lin_err})
                print(f"{loss_name} {kind} {mode}: rel {rel:.4f} se {se:.4f}", file=sys.stderr, flush=True)
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": C.machine(), "arch": arch.__dict__,
            "workload": {"sequences": base.B * base.G, "tokens": sum(base.lengths),
                         "zero_variance_groups": base.meta["zero_variance_groups"]},
            "results": results}


def markdown(rep: dict) -> str:
    c, a, w = rep["config"], rep["arch"], rep["workload"]
    lines = [f"qwen2 hidden {a['hidden_size']} x {a['num_layers']} layers (random init); B={c['prompts']} x "
             f"G={c['group']} GSM8K rollouts ({w['tokens']} tokens, {100 * w['zero_variance_groups']:.0f}% "
             f"zero-variance groups); K={c['draws']} draws; DPPO r_q={c['r_q']} r_o={c['r_o']}; CPPO P="
             f"{c['cppo_rate']}; clipping on (old log-probs offset 0.3), KL k3 beta={c['kl']}.", "",
             "| loss | pruner | kept | cos(mean, full) | rel. error | MC s.e. | z = rel/se | single-draw cos | "
             "tr Var (empirical) | tr Var (formula) | emp/formula |", "|---" * 11 + "|"]
    for r in rep["results"]:
        f = lambda x, spec=".3g": "n/a" if x != x else format(x, spec)  # noqa: E731
        lines.append(f"| {r['loss']} | {r['pruner']} | {r['kept_fraction']:.2f} | {r['cosine_mean']:.4f} | "
                     f"{r['rel_error']:.4f} | {r['se']:.4f} | {r['z']:.2f} | {r['single_draw_cosine']:.3f} | "
                     f"{f(r['trace_var'])} | {f(r['trace_var_formula'])} | {f(r['var_ratio'], '.2f')} |")
    lin = {r["loss"]: r["per_unit_linearity_error"] for r in rep["results"]}
    lines += ["", "Sum of per-unit gradients vs full gradient (linearity of the packed engine, rel.): "
              + ", ".join(f"{k} {v:.1e}" for k, v in lin.items())]
    return "\n".join(lines)


# ==========================================================================================================
# --real: a trained policy's per-sequence gradients; every method at an equal expected kept fraction
# ==========================================================================================================
def real_methods(args) -> list[tuple[str, object, float]]:
    """(name, weights(ctx, rate), largest rate) of the methods solved for each kept fraction."""
    from functools import partial
    top = 0.999
    out = [("grpo-subsample", R.w_subsample, top),
           ("dppo-uniform", partial(R.w_dppo, keep="uniform"), top),
           ("dppo-uniform-completion-only", partial(R.w_dppo, keep="uniform", completion_only=True), top),
           ("dppo-uniform+zvf", partial(R.w_dppo, keep="uniform", zvf=True), top),
           ("dppo-optimal bernoulli", partial(R.w_dppo, keep="optimal", floor=args.keep_floor,
                                              alpha=args.length_exponent), top),
           ("dppo-optimal fixed_size", partial(R.w_dppo, keep="optimal", mode="fixed_size", floor=args.keep_floor,
                                               alpha=args.length_exponent), top),
           ("dppo-optimal-completion-only", partial(R.w_dppo, keep="optimal", completion_only=True,
                                                    floor=args.keep_floor, alpha=args.length_exponent), top),
           ("cppo group", R.w_cppo, 1.0 - 1.0 / args.group),
           ("proxy A^2 (completion-only)", partial(R.w_proxy, gamma=2.0, floor=args.keep_floor), top),
           ("oracle-norm (completion-only)", R.w_oracle, top)]
    return out


def analyse(ctx: R.Ctx, args) -> list[dict]:
    """Every method at every target fraction, the deterministic rows and the dppo-optimal sweep at one checkpoint."""
    from functools import partial
    rows = []

    def add(method, target, rate, W, info, **extra):
        row = {"rl_step": ctx.step, "method": method, "target": target, "rate": rate, **info, **extra}
        if W is not None:
            row.update(R.mc_stats(ctx, W))
        rows.append(row)
        if W is not None:
            print(f"  step {ctx.step} {method} f={target}: kept {row['kept']:.3f} rel.MSE {row['rel_mse']:.4g}",
                  file=sys.stderr, flush=True)

    for f in args.fractions:
        for name, fn, r_hi in real_methods(args):
            rate, W, info = R.solve_rate(ctx, fn, f, r_hi, args.bisect)
            extra = {"rel_var_formula": R.uniform_exact(ctx, rate)} if name == "dppo-uniform" and rate is not None \
                else {}
            add(name, f, rate, W, info, **extra)
    add("dapo-filter", None, None, R.w_zvf(ctx), {"reached": True})
    add("dppo-uniform-0.5+zvf", None, 0.5, R.w_dppo(ctx, 0.5, zvf=True), {"reached": True})
    for floor in args.sweep_floors:
        for alpha in args.sweep_exponents:
            fn = partial(R.w_dppo, keep="optimal", floor=floor, alpha=alpha)
            rate, W, info = R.solve_rate(ctx, fn, args.sweep_fraction, 0.999, args.bisect)
            add("sweep dppo-optimal bernoulli", args.sweep_fraction, rate, W, info, keep_floor=floor,
                length_exponent=alpha)
    for floor_q in args.split_prompt_floors:
        for floor in args.split_completion_floors:
            fn = partial(R.w_dppo, keep="optimal", floor=floor, floor_q=floor_q)
            rate, W, info = R.solve_rate(ctx, fn, args.sweep_fraction, 0.999, args.bisect)
            add("split-floor dppo-optimal bernoulli", args.sweep_fraction, rate, W, info, keep_floor_prompt=floor_q,
                keep_floor=floor)
    return rows


def run_real(args) -> dict:
    C.quiet()
    torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    paths, train_info = R.ensure_checkpoints(args.work_dir, args.steps)
    run = R.open_run(args.work_dir)
    summaries, rows = [], []
    prompt_level = None
    if args.prompt_level:
        visits = PL.read_visits(args.work_dir / "train" / "audit.jsonl")
        costs = PL.costs_of(args.work_dir, args.group, args.generation_share)
        prompt_level = {"calibration": PL.calibration(visits, args.group), "targets": args.cost_fractions,
                        "costs": {k: {**dataclasses.asdict(v), "generation_share": v.generation_share()}
                                  for k, v in costs.items()}, "checkpoints": []}
    try:
        for step in args.steps:
            cache = args.work_dir / "analysis" / f"rl_step{step}_B{args.prompts}_G{args.group}.pt"
            data = R.StepData(**torch.load(cache, weights_only=False)) if cache.is_file() and not args.recompute \
                else None
            if data is None or (step == args.dapo_step and data.dapo is None) or (args.coords and data.coords is None):
                print(f"checkpoint RL step {step}: rollout and per-sequence gradients", file=sys.stderr, flush=True)
                data = R.collect(run, paths[step], args.prompts, args.group, dapo=step == args.dapo_step,
                                 coord_count=args.coords)
                torch.save(dataclasses.asdict(data), cache)
            ctx = R.Ctx(M=data.gram, A=data.advantages, L=data.lengths, h=data.history, rewards=data.rewards,
                      norms=data.norms, K=args.draws, seed=args.seed, step=step, ids=data.prompt_ids)
            zero_var = (data.rewards == data.rewards[:, :1]).all(1)
            s = {"rl_step": step, "checkpoint": str(paths[step]), "reward_mean": float(data.rewards.mean()),
                 "zero_variance_groups": float(zero_var.double().mean()),
                 "nonzero_advantage_units": float((data.advantages != 0).double().mean()),
                 "prompts_seen": float((~torch.isnan(data.history)).double().mean()),
                 "completion_length_mean": float(data.lengths.mean()), "full_grad_norm": data.full_norm,
                 "gram_full_norm": float(data.gram.sum().sqrt()), "linearity_rel_error": data.linearity,
                 "zero_advantage_max_norm": data.zero_adv_max_norm, "params": data.params, "seconds": data.seconds,
                 "fit_grpo": R.fit_alpha(data.norms, data.advantages, data.lengths, data.logprob),
                 "prompt_proxy": R.prompt_proxy(data.gram, data.history, args.group)}
            if data.dapo is not None:
                s["dapo"] = {"linearity_rel_error": data.dapo["linearity"], "full_grad_norm": data.dapo["full_norm"],
                             "seconds": data.dapo["seconds"],
                             "fit": R.fit_alpha(data.dapo["norms"], data.advantages, data.lengths, data.logprob)}
            t0 = time.perf_counter()
            if not args.prompt_level_only:
                rows += analyse(ctx, args)
            s["seconds"] = {**s["seconds"], "methods": time.perf_counter() - t0}
            if prompt_level is not None:
                t0 = time.perf_counter()
                gamma = s["fit_grpo"]["coef_log_abs_A"]
                prompt_level["checkpoints"].append({"rl_step": step, **PL.study(
                    ctx, visits, gamma, costs, args.cost_fractions, args.cost_bisect)})
                s["seconds"]["prompt_level"] = time.perf_counter() - t0
            summaries.append(s)
    finally:
        from megatron_dppo.run.setup import teardown
        teardown(run)
    def git(*a):
        return subprocess.run(["git", *a], cwd=C.REPO, capture_output=True, text=True).stdout.strip()
    return {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "machine": C.machine(), "git": {"commit": git("rev-parse", "HEAD"),
                                            "library_changes": git("status", "--short", "megatron_dppo")},
            "training": train_info, "checkpoints": summaries, "results": rows, "prompt_level": prompt_level,
            "seconds": time.perf_counter() - t_start}


EXACT = 1e-8  # relative MSE below this is float round-off of an exact estimate (every A != 0 unit kept, pi = 1)


def _cell(r: dict | None, key: str = "rel_mse", se: bool = True) -> str:
    if r is None:
        return "n/a"
    if r.get("rel_mse") is None:
        lo, hi = r["range"]
        return f"unreachable [{lo:.2f}, {hi:.2f}]"
    text = "0 (exact)" if r[key] < EXACT else f"{r[key]:.3g}" + (f" ± {r['se']:.2g}" if se and r["se"] > 0 else "")
    return text if r["reached"] else f"{text} (kept {r['kept']:.2f})*"


def _ratio(u: dict | None, o: dict | None) -> str:
    if not u or not o or u.get("rel_mse") is None or o.get("rel_mse") is None:
        return "n/a"
    star = "" if o["reached"] and u["reached"] else "*"
    if o["rel_mse"] < EXACT:
        return ("both exact" if u["rel_mse"] < EXACT else "inf (optimal exact)") + star
    ratio = u["rel_mse"] / o["rel_mse"]
    err = ratio * math.hypot(u["se"] / u["rel_mse"] if u["rel_mse"] else 0.0, o["se"] / o["rel_mse"])
    return f"{ratio:.2f} ± {err:.2f}{star}"



def _sweep_row(find, method: str, fraction: float, steps, labels, default: dict, **keys) -> str:
    """One row of a sweep table: the method's relative MSE at each checkpoint and the geometric mean over the
    checkpoints of its ratio to the main table's setting (``default``; checkpoints where that is exact left out)."""
    cells, logs = [], []
    for s in steps:
        r = find(method, fraction, s, **keys)
        d = find("sweep dppo-optimal bernoulli", fraction, s, **default)
        cells.append(_cell(r))
        if r and d and r.get("rel_mse") is not None and d.get("rel_mse") is not None and d["rel_mse"] >= EXACT:
            logs.append(math.log(max(r["rel_mse"], EXACT) / d["rel_mse"]))
    gm = f"{math.exp(sum(logs) / len(logs)):.3f}" if logs else "n/a"
    return "| " + " | ".join(str(x) for x in labels) + " | " + " | ".join(cells) + f" | {gm} |"

def markdown_real(rep: dict) -> str:
    c, ck, res = rep["config"], rep["checkpoints"], rep["results"]
    steps = [s["rl_step"] for s in ck]
    find = lambda m, f, s, **kw: next((r for r in res if r["method"] == m and r["target"] == f  # noqa: E731
                                       and r["rl_step"] == s and all(r.get(k) == v for k, v in kw.items())), None)
    out = [f"Quickstart policy (examples/quickstart.yaml, 1.6M-param Qwen2, single-digit arithmetic) trained with "
           f"GRPO (algo.pruner=none); checkpoints at RL steps {steps}. Per checkpoint the step's own batch: "
           f"B={c['prompts']} prompts x G={c['group']} completions (temperature 1), rewards, full-group advantages, "
           f"history restored from the checkpoint. Per-sequence gradients g_i of the grpo loss (seq_mean_token_mean,"
           f" full-batch D, ratio 1, kl_coef 0) through the Megatron engine; K={c['draws']} draws per method and "
           f"rate, rates solved (bisection, common random numbers) for an equal MC mean kept fraction f. Held "
           f"fixed: each checkpoint's rollout (all variances are conditional on it). Total run time "
           f"{rep['seconds'] / 60:.1f} min (training included when it ran), library at commit "
           f"{rep['git']['commit'][:10]}{' + uncommitted changes' if rep['git']['library_changes'] else ''}.", "",
           "| RL step | reward mean | zero-variance groups | A != 0 completions | prompts seen before | mean L "
           "(tokens) | \\|g\\| | linearity \\|sum g_i - g\\|/\\|g\\| | max \\|g_i\\| at A = 0 | s per sequence "
           "gradient |", "|---" * 10 + "|"]
    for s in ck:
        out.append(f"| {s['rl_step']} | {s['reward_mean']:.3f} | {s['zero_variance_groups']:.2f} | "
                   f"{s['nonzero_advantage_units']:.2f} | {s['prompts_seen']:.2f} | "
                   f"{s['completion_length_mean']:.2f} | "
                   f"{s['full_grad_norm']:.3g} | {s['linearity_rel_error']:.1e} | {s['zero_advantage_max_norm']:.1g} | "
                   f"{s['seconds']['per_sequence_each']:.3f} |")
    out += ["", "Does the proxy rank the gradients? OLS of log\\|g_i\\| over the A != 0 completions on [1, log\\|A\\|, "
            "log L] (alpha = the log L coefficient), then with per-prompt intercepts, then with log pi(o) (the "
            "completion's log-probability); Spearman rank correlations; prompt level: h_q (last visit) vs this "
            "step's \\|g_q\\| = \\|sum_i g_qi\\|.", "",
            "| RL step | alpha ± s.e. | coef log\\|A\\| | R^2 | R^2 (\\|A\\| only) | R^2 (+ prompt intercepts) | "
            "coef log pi(o) | R^2 (+ log pi(o)) | Spearman(\\|g_i\\|, \\|A_i\\|) | Spearman(\\|g_q\\|, h_q) | "
            "h_q = 0 prompts now with g_q != 0 | their share of sum \\|g_q\\|^2 |", "|---" * 12 + "|"]
    for s in ck:
        a, p = s["fit_grpo"], s["prompt_proxy"]
        nan = float("nan")
        out.append(f"| {s['rl_step']} | {a['alpha']:.2f} ± {a['alpha_se']:.2f} | {a['coef_log_abs_A']:.2f} | "
                   f"{a['r2']:.2f} | {a['r2_abs_A_only']:.2f} | {a['r2_with_prompt_intercepts']:.2f} | "
                   f"{a.get('coef_log_pi', nan):.2f} | {a.get('r2_with_log_pi', nan):.2f} | "
                   f"{a['spearman_abs_A']:.2f} | {p.get('spearman_h_gq', nan):.2f} | "
                   + (f"{p['h_zero_now_informative']} of {p['h_zero']} | "
                      f"{p['share_of_sum_gq2_with_h_zero']:.2f} |" if "h_zero" in p else "n/a (no history) | n/a |"))
    for s in ck:
        if "dapo" in s:
            a = s["dapo"]["fit"]
            out += ["", f"dapo preset (token_mean) at RL step {s['rl_step']}: alpha = {a['alpha']:.2f} ± "
                    f"{a['alpha_se']:.2f}, coef log\\|A\\| = {a['coef_log_abs_A']:.2f}, R^2 = {a['r2']:.2f} "
                    f"(\\|A\\| only "
                    f"{a['r2_abs_A_only']:.2f}); linearity {s['dapo']['linearity_rel_error']:.1e}."]
    names = [m for m, *_ in real_methods(argparse.Namespace(**{**c, "work_dir": None}))]
    for f in c["fractions"]:
        out += ["", f"### Relative MSE E\\|ghat - g\\|^2 / \\|g\\|^2 at kept fraction f = {f} (± MC s.e.)", "",
                "| method | " + " | ".join(f"step {s}" for s in steps) + " |", "|---" * (len(steps) + 1) + "|"]
        for m in names:
            out.append(f"| {m} | " + " | ".join(_cell(find(m, f, s)) for s in steps) + " |")
        for lbl, m in (("uniform / optimal bernoulli", "dppo-optimal bernoulli"),
                       ("uniform / optimal fixed_size", "dppo-optimal fixed_size"),
                       ("uniform / optimal completion-only", "dppo-optimal-completion-only"),
                       ("uniform completion-only / optimal completion-only", "dppo-optimal-completion-only"),
                       ("uniform+zvf / optimal completion-only", "dppo-optimal-completion-only")):
            u = {"uniform completion-only": "dppo-uniform-completion-only",
                 "uniform+zvf": "dppo-uniform+zvf"}.get(lbl.split(" / ")[0], "dppo-uniform")
            out.append(f"| **{lbl}** | " + " | ".join(_ratio(find(u, f, s), find(m, f, s)) for s in steps) + " |")
    out += ["", "### Fixed-rule rows (own kept fraction)", "",
            "| method | " + " | ".join(f"step {s}: kept / rel. MSE / bias^2 / cos" for s in steps) + " |",
            "|---" * (len(steps) + 1) + "|"]
    for m in ("dapo-filter", "dppo-uniform-0.5+zvf"):
        cells = []
        for s in steps:
            r = find(m, None, s)
            cells.append(f"{r['kept']:.2f} / {r['rel_mse']:.3g} / {r['bias2']:.2g} / {r['cosine']:.3f}")
        out.append(f"| {m} | " + " | ".join(cells) + " |")
    out += ["", "### Every row: kept fraction, squared bias, mean single-draw cosine", "",
            "| f | method | " + " | ".join(f"step {s}: kept / bias^2 / cos" for s in steps) + " |",
            "|---" * (len(steps) + 2) + "|"]
    for f in c["fractions"]:
        for m in names:
            cells = []
            for s in steps:
                r = find(m, f, s)
                cells.append("unreachable" if r is None or r.get("rel_mse") is None else
                             f"{r['kept']:.3f} / {r['bias2']:.2g} / {r['cosine']:.3f}")
            out.append(f"| {f} | {m} | " + " | ".join(cells) + " |")
    uni = [r for r in res if r["method"] == "dppo-uniform" and "rel_var_formula" in r and r["rel_mse"]]
    if uni:
        dev = max(abs(r["rel_mse"] / r["rel_var_formula"] - 1) for r in uni)
        z = max(abs(r["rel_mse"] - r["rel_var_formula"]) / r["se"] for r in uni)
        out += ["", f"Check: dppo-uniform's MC relative MSE vs the docs/algorithms.md variance formula (exact for "
                f"it): largest \\|MC/formula - 1\\| = {dev:.3f}, largest \\|MC - formula\\| / s.e. = {z:.1f} "
                f"over {len(uni)} rows."]
    sf = c["sweep_fraction"]
    out += ["", f"### dppo-optimal (bernoulli) sweep at f = {sf}: relative MSE", "",
            "| keep_floor | length_exponent | " + " | ".join(f"step {s}" for s in steps) + " | geo-mean vs default |",
            "|---" * (len(steps) + 3) + "|"]
    default = {"keep_floor": c["keep_floor"], "length_exponent": c["length_exponent"]}
    for floor in c["sweep_floors"]:
        for alpha in c["sweep_exponents"]:
            out.append(_sweep_row(find, "sweep dppo-optimal bernoulli", sf, steps, (floor, alpha), default,
                                  keep_floor=floor, length_exponent=alpha))
    out += ["", f"### dppo-optimal (bernoulli) at f = {sf} with the prompt level's floor apart (two pruners; not a "
            f"library option): relative MSE", "",
            "| prompt keep_floor | completion keep_floor | " + " | ".join(f"step {s}" for s in steps) +
            " | geo-mean vs default |", "|---" * (len(steps) + 3) + "|"]
    for floor_q in c["split_prompt_floors"]:
        for floor in c["split_completion_floors"]:
            out.append(_sweep_row(find, "split-floor dppo-optimal bernoulli", sf, steps, (floor_q, floor), default,
                                  keep_floor_prompt=floor_q, keep_floor=floor))
    out += ["", "Methods: grpo-subsample = each prompt with all G completions kept with prob f, weight 1/f (a "
            "smaller GRPO batch); dppo-* = DPPOPruner with r_q = r_o = r (completion-only: r_q = 0), uniform = the "
            f"paper's candidate rule, optimal = keep='optimal' (keep_floor {c['keep_floor']}, length_exponent "
            f"{c['length_exponent']}), weights 1/(pi_q pi_i|q); cppo group = CPPOPruner(P, 'group'), top-\\|A\\| "
            "(random ties), weight N/n_kept (its kept-count denominator); oracle-norm = completion-level "
            "water-filling on the TRUE \\|g_i\\| (floor 0; not implementable, the bound for any proxy); "
            "dapo-filter = zero-variance groups dropped, weight 1, full D (exact for the policy-gradient term); "
            "dppo-uniform+zvf = uniform (r solved for f) plus that filter; dppo-uniform-0.5+zvf = the same at r = 0.5; "
            "proxy A^2 = exploratory, not in the library: completion-level water-filling on \\|A\\|^2 (floor "
            "as optimal's). GRPO-full is the reference (MSE 0).",
            "", f"bias^2 is computed from the mean of the K weight vectors: for an unbiased method it is MC noise "
            f"of expected size MSE/K (K = {c['draws']}).",
            "", "\\* not at the target: the method's kept fraction cannot equal f (a step or a gap in kept(rate)); "
            "shown at the nearest rate that keeps <= f, with its kept fraction. dppo-optimal gives A = 0 "
            "completions pi = 0, so for r > 0 it keeps at most the A != 0 share; its kept fraction jumps to 1 at "
            "r = 0. 'unreachable [a, b]': f outside the kept fractions the method can give. Ratios: ± by the delta "
            "method (draws treated as independent across methods). geo-mean vs default: geometric mean over the "
            "checkpoints of rel. MSE / that of keep_floor 0.1, length_exponent 0 (checkpoints where the default is "
            "exact left out). '0 (exact)': relative MSE < 1e-8 (every A != 0 completion kept with pi = 1)."]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes for a shared 2-core CPU")
    ap.add_argument("--model", default="tiny", choices=["tiny", "small", "medium"])
    ap.add_argument("--prompts", type=int, default=None, help="B (default 8; --real: 64, the quickstart's)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--draws", type=int, default=None, help="K (default 32; --real: 400)")
    ap.add_argument("--losses", nargs="+", default=["grpo", "dapo", "dr_grpo", "gspo"])
    ap.add_argument("--modes", nargs="+", default=["bernoulli", "fixed_size", "deterministic"])
    ap.add_argument("--cppo-scopes", nargs="+", default=["group", "batch"])
    ap.add_argument("--r-q", type=float, default=0.5)
    ap.add_argument("--r-o", type=float, default=0.5)
    ap.add_argument("--cppo-rate", type=float, default=0.5)
    ap.add_argument("--kl", type=float, default=0.05)
    ap.add_argument("--no-formula", dest="formula", action="store_false",
                    help="skip the per-unit gradients (variance formula)")
    ap.add_argument("--capacity", type=int, default=1024)
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--max-completion", type=int, default=64)
    ap.add_argument("--questions", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    real = ap.add_argument_group("--real: a trained quickstart policy (module docstring)")
    real.add_argument("--real", action="store_true", help="the trained-policy benchmark instead of the synthetic one")
    real.add_argument("--work-dir", type=Path, default=C.REPO / "runs" / "gradient_fidelity_real",
                      help="checkpoints (trained once, reused) and per-checkpoint Gram caches")
    real.add_argument("--steps", type=int, nargs="+", default=[0, 50, 100, 150], help="RL steps of the checkpoints")
    real.add_argument("--fractions", type=float, nargs="+", default=[0.3, 0.5, 0.7], help="target kept fractions")
    real.add_argument("--bisect", type=int, default=20, help="bisection steps of each rate")
    from megatron_dppo.config import AlgoConfig
    real.add_argument("--keep-floor", type=float, default=AlgoConfig.keep_floor,
                      help="dppo-optimal keep_floor of the main table (default: the library's; the recorded run in "
                           "docs/benchmarks used 0.1, the default before this sweep moved it to 0.3)")
    real.add_argument("--length-exponent", type=float, default=AlgoConfig.keep_length_exponent,
                      help="dppo-optimal alpha of the main table (default: the library's)")
    real.add_argument("--sweep-fraction", type=float, default=0.5)
    real.add_argument("--sweep-floors", type=float, nargs="+", default=[0.02, 0.05, 0.1, 0.2, 0.3, 0.5])
    real.add_argument("--sweep-exponents", type=float, nargs="+", default=[-0.5, 0.0, 0.5, 1.0])
    real.add_argument("--split-prompt-floors", type=float, nargs="+", default=[0.1, 0.3, 0.5],
                      help="dppo-optimal with the prompt level's floor apart from the completion level's")
    real.add_argument("--split-completion-floors", type=float, nargs="+", default=[0.02, 0.1])
    real.add_argument("--dapo-step", type=int, default=100, help="checkpoint whose dapo-preset gradients are fitted")
    real.add_argument("--recompute", action="store_true", help="ignore the cached rollouts and Gram matrices")
    real.add_argument("--markdown", type=Path, default=None, help="also write the markdown tables here")
    real.add_argument("--prompt-level", action="store_true",
                      help="the prompt-level study (issue 34): posterior, screening, equal modelled step cost, "
                           "calibration and Spearman of the prompt proxies (benchmarks/_prompt_level.py)")
    real.add_argument("--prompt-level-only", action="store_true", help="--prompt-level without the tables above")
    real.add_argument("--cost-fractions", type=float, nargs="+", default=[0.5, 0.7],
                      help="modelled step-cost targets (x the unpruned step) of the prompt-level study")
    real.add_argument("--generation-share", type=float, default=0.8,
                      help="the modelled generation-dominated regime's share of generation in the step")
    real.add_argument("--cost-bisect", type=int, default=12, help="bisection steps of each cost target")
    real.add_argument("--coords", type=int, default=0,
                      help="also keep every per-sequence gradient on this many random coordinates (for "
                           "benchmarks/prompt_diagnosis.py's Adam model); recomputes caches without them")
    args = ap.parse_args(argv)
    if args.real:
        args.prompts, args.draws = args.prompts or 64, args.draws or 400
        args.prompt_level = args.prompt_level or args.prompt_level_only
        rep = run_real(args)
        text = PL.markdown(rep) if args.prompt_level_only else markdown_real(rep) + (
            "\n\n" + PL.markdown(rep) if args.prompt_level else "")
        print(text)
        if args.markdown is not None:
            args.markdown.parent.mkdir(parents=True, exist_ok=True)
            args.markdown.write_text("# Gradient fidelity on a trained policy (`benchmarks/gradient_fidelity.py "
                                     "--real`)\n\n" + text + "\n")
        C.write_json(args.out, rep, digits=4 if args.prompt_level_only else None)
        return
    args.prompts, args.draws = args.prompts or 8, args.draws or 32
    if args.quick:
        args.prompts, args.group, args.draws, args.losses = 6, 6, 16, ["grpo", "dr_grpo", "gspo"]
    rep = run(args)
    print(markdown(rep))
    C.write_json(args.out, rep)


if __name__ == "__main__":
    main()
