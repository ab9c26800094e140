"""Pure statistics of the preregistered time-to-accuracy study (benchmarks/time_to_accuracy.py). No torch, no
scipy (not in requirements/cpu.txt): the Student-t distribution is computed from the regularized incomplete beta
function. Every function here is deterministic and unit-tested (tests/unit/test_time_to_accuracy.py).

Curves
------
A run's accuracy curve is its evaluations ``(t_i, acc_i)``, ``t_0 = 0`` being the pre-RL evaluation and ``t_i``
the run's cumulative RL time (CPU or wall seconds, evaluation excluded) when evaluation ``i`` was taken.
* Smoothing: the 3-evaluation running mean (evaluation i and the two before it; the first points average what
  exists, so the smoothed pre-RL point is the pre-RL accuracy itself).
* Between evaluations the smoothed curve is linear in time; after the run's last evaluation it is held at the
  last value (what a user who stopped there has).
* Gain = smoothed accuracy - the run's own pre-RL accuracy.

The endpoint functions at the end (summarize_run, compare, analyse) turn runs read by the benchmark into the
preregistered endpoints; see benchmarks/time_to_accuracy.py for their definitions.
"""
from __future__ import annotations

import math
import statistics
from typing import Iterable, Sequence

NAN = float("nan")


# ----------------------------------------------------------------------------------------------------------
# Student t
# ----------------------------------------------------------------------------------------------------------
def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    tiny, eps = 1e-300, 3e-16
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def t_sf(t: float, df: float) -> float:
    """P(T > t) for Student's t with ``df`` degrees of freedom."""
    if math.isnan(t) or df <= 0:
        return NAN
    if math.isinf(t):
        return 0.0 if t > 0 else 1.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return tail if t >= 0 else 1.0 - tail


def t_cdf(t: float, df: float) -> float:
    return 1.0 - t_sf(t, df)


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|)."""
    return NAN if math.isnan(t) or df <= 0 else min(1.0, 2.0 * t_sf(abs(t), df))


def t_quantile(p: float, df: float) -> float:
    """The ``p`` quantile of Student's t (bisection on :func:`t_cdf`; |error| < 1e-10)."""
    if not 0.0 < p < 1.0 or df <= 0:
        return NAN
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-10:
            break
    return 0.5 * (lo + hi)


# ----------------------------------------------------------------------------------------------------------
# Intervals and tests over seeds
# ----------------------------------------------------------------------------------------------------------
def _finite(xs: Iterable[float | None]) -> list[float]:
    return [float(x) for x in xs if x is not None and not math.isnan(x)]


def paired_test(diffs: Sequence[float], null: float = 0.0, alternative: str = "two-sided",
                level: float = 0.95) -> dict:
    """Student-t analysis of paired differences (one per seed): mean, the two-sided ``level`` CI, and the p-value
    of H0: mean = ``null`` (``two-sided``) or H0: mean <= ``null`` against H1: mean > ``null`` (``greater``)."""
    xs = _finite(diffs)
    n = len(xs)
    out = {"n": n, "mean": statistics.fmean(xs) if xs else NAN, "lo": NAN, "hi": NAN, "sd": NAN, "t": NAN,
           "df": n - 1, "p": NAN, "null": null, "alternative": alternative}
    if n < 2:
        return out
    sd = statistics.stdev(xs)
    se = sd / math.sqrt(n)
    q = t_quantile(0.5 + level / 2.0, n - 1)
    out.update(sd=sd, lo=out["mean"] - q * se, hi=out["mean"] + q * se)
    if se == 0.0:
        t = 0.0 if out["mean"] == null else math.copysign(math.inf, out["mean"] - null)
    else:
        t = (out["mean"] - null) / se
    out["t"] = t
    if alternative == "two-sided":
        out["p"] = 1.0 if t == 0.0 and se == 0.0 else t_two_sided_p(t, n - 1)
    elif alternative == "greater":
        out["p"] = t_sf(t, n - 1)
    else:
        raise ValueError(f"alternative {alternative!r}: two-sided | greater")
    return out


def mean_ci(xs: Sequence[float], level: float = 0.95) -> dict:
    """Mean and the two-sided Student-t CI of independent values (the mean over seeds)."""
    return paired_test(xs, 0.0, "two-sided", level)


def ratio_test(nums: Sequence[float], dens: Sequence[float], level: float = 0.95) -> dict:
    """Paired ratios num/den (one per seed): geometric mean, ``level`` CI and the two-sided p of H0: ratio = 1,
    all from the t analysis of the log ratios. Pairs with a non-positive or missing member are left out (``n``
    counts those used)."""
    logs = [math.log(a / b) for a, b in zip(nums, dens)
            if a is not None and b is not None and a > 0 and b > 0 and math.isfinite(a) and math.isfinite(b)]
    r = paired_test(logs, 0.0, "two-sided", level)
    return {"n": r["n"], "geo_mean": math.exp(r["mean"]) if r["n"] else NAN,
            "lo": math.exp(r["lo"]) if not math.isnan(r["lo"]) else NAN,
            "hi": math.exp(r["hi"]) if not math.isnan(r["hi"]) else NAN, "t": r["t"], "df": r["df"], "p": r["p"],
            "log_ratios": logs}


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm step-down adjusted p-values: sorted ascending p_(1..m), adj_(i) = max_{j<=i} min(1, (m-j+1) p_(j)).
    Reject H_(i) iff adj_(i) < alpha (strong family-wise error control at alpha). NaN p-values (a missing
    hypothesis) are not counted in m and stay NaN."""
    items = sorted((p, k) for k, p in pvalues.items() if p is not None and not math.isnan(p))
    m, running, out = len(items), 0.0, {k: NAN for k in pvalues}
    for i, (p, k) in enumerate(items):
        running = max(running, min(1.0, (m - i) * p))
        out[k] = running
    return out


# ----------------------------------------------------------------------------------------------------------
# Curves
# ----------------------------------------------------------------------------------------------------------
def running_mean(ys: Sequence[float], window: int = 3) -> list[float]:
    """Mean of each value and the ``window - 1`` before it (the first points average what exists)."""
    return [statistics.fmean(ys[max(0, i - window + 1):i + 1]) for i in range(len(ys))]


def interp(ts: Sequence[float], ys: Sequence[float], t: float) -> float:
    """The piecewise-linear curve through (ts, ys) at ``t``; held at the first / last value outside [ts[0], ts[-1]]."""
    if not ts:
        return NAN
    if t <= ts[0]:
        return ys[0]
    for i in range(1, len(ts)):
        if t <= ts[i]:
            span = ts[i] - ts[i - 1]
            if span <= 0:
                return ys[i]
            return ys[i - 1] + (ys[i] - ys[i - 1]) * (t - ts[i - 1]) / span
    return ys[-1]


def first_crossing(ts: Sequence[float], ys: Sequence[float], target: float) -> float | None:
    """The first time the piecewise-linear curve reaches ``target`` (>=), or None if it never does."""
    tol = 1e-12
    if ys and ys[0] >= target - tol:
        return ts[0]
    for i in range(1, len(ts)):
        if ys[i] >= target - tol:
            if ys[i] == ys[i - 1]:
                return ts[i]
            frac = (target - ys[i - 1]) / (ys[i] - ys[i - 1])
            return ts[i - 1] + min(1.0, max(0.0, frac)) * (ts[i] - ts[i - 1])
    return None


def time_to_target(ts: Sequence[float], ys: Sequence[float], target: float, total: float) -> tuple[float, bool]:
    """(time, censored): the first time the curve reaches ``target``; a curve that never does is CENSORED at the
    run's total time ``total`` (counted at that time, flagged True)."""
    hit = first_crossing(ts, ys, target)
    return (total, True) if hit is None else (hit, False)


def area_mean(ts: Sequence[float], ys: Sequence[float], horizon: float) -> float:
    """(1 / horizon) * integral over [0, horizon] of the piecewise-linear curve (held at its last value after
    ts[-1] and at its first before ts[0]): the curve's mean height up to ``horizon``."""
    if horizon <= 0 or not ts:
        return NAN
    knots = sorted({0.0, horizon, *(t for t in ts if 0.0 < t < horizon)})
    area = 0.0
    for a, b in zip(knots, knots[1:]):
        area += 0.5 * (interp(ts, ys, a) + interp(ts, ys, b)) * (b - a)
    return area / horizon


def gain_curve(times: Sequence[float], accuracy: Sequence[float], window: int = 3) -> dict:
    """A run's smoothed curve: ``smoothed`` accuracy (running mean), ``gain`` = smoothed - pre-RL accuracy."""
    smoothed = running_mean(accuracy, window)
    pre = accuracy[0]
    return {"t": list(times), "raw": list(accuracy), "smoothed": smoothed, "pre": pre,
            "gain": [s - pre for s in smoothed], "final": smoothed[-1], "final_gain": smoothed[-1] - pre}


def interval_means(values: Sequence[float], bounds: Sequence[int]) -> list[float]:
    """Mean of ``values`` (one per RL step, step 0 first) over each interval of steps (bounds[i-1], bounds[i]]
    counted in steps done, i.e. the values of steps bounds[i-1] .. bounds[i]-1."""
    out = []
    for a, b in zip(bounds, bounds[1:]):
        chunk = _finite(values[max(a, 0):b])
        out.append(statistics.fmean(chunk) if chunk else NAN)
    return out


# ----------------------------------------------------------------------------------------------------------
# Endpoints (preregistered g*, T*, margin; paired per seed)
# ----------------------------------------------------------------------------------------------------------
def summarize_run(run: dict, prereg: dict) -> dict:
    """The run's smoothed curve and its values for every endpoint (preregistered g*, T* only)."""
    c = gain_curve(run["t"], run["acc"])
    g_star, t_star = prereg["g_star"], prereg["T_star"]
    t_g, censored = time_to_target(c["t"], c["gain"], g_star, run["total"])
    steps_g = first_crossing(run["eval_steps"], c["gain"], g_star)
    return {"pre": c["pre"], "final": c["final"], "final_gain": c["final_gain"], "final_raw": run["acc"][-1],
            "total": run["total"], "total_cpu": run["total_cpu"], "total_wall": run["total_wall"],
            "steps": run["steps"], "time_to_g": t_g, "censored": censored, "steps_to_g": steps_g,
            "gain_at_T": interp(c["t"], c["gain"], t_star), "ended_before_T": run["total"] < t_star,
            "auc_T": area_mean(c["t"], c["gain"], t_star), "curve": c}


def compare(summ: dict, arm: str, base: str, seeds: list[int], margin: float) -> dict:
    """Endpoints 1-3 and the AUC for ``arm`` against ``base``, paired over the seeds where both finished."""
    both = [s for s in seeds if (s, arm) in summ and (s, base) in summ]
    a = [summ[(s, arm)] for s in both]
    b = [summ[(s, base)] for s in both]
    e3 = paired_test([x["final"] - y["final"] for x, y in zip(a, b)], null=-margin, alternative="greater")
    e3["noninferior_ci"] = bool(e3["lo"] > -margin) if not math.isnan(e3["lo"]) else None
    return {"seeds": both,
            "e1": {**ratio_test([x["time_to_g"] for x in a], [y["time_to_g"] for y in b]),
                   "censored_arm": [s for s, x in zip(both, a) if x["censored"]],
                   "censored_base": [s for s, y in zip(both, b) if y["censored"]]},
            "e2": paired_test([x["gain_at_T"] - y["gain_at_T"] for x, y in zip(a, b)]),
            "e3": e3,
            "total_time_ratio": ratio_test([x["total"] for x in a], [y["total"] for y in b]),
            "auc": paired_test([x["auc_T"] - y["auc_T"] for x, y in zip(a, b)])}


def censoring_check(arm_runs: Sequence[dict], base_runs: Sequence[dict]) -> dict:
    """Post-hoc (not preregistered): what endpoint 1 rests on once censoring is read as *unknown*.

    Endpoint 1 counts a run that never reaches g* at its total time. When every arm runs the same number of
    steps, a cheaper arm is censored earlier, so a pair in which *neither* run reached g* contributes the ratio
    of the total times: the cost of a step, not learning. Here each seed's pair (dicts with ``time_to_g``,
    ``censored``, ``total``) is classified the way Gehan's test scores censored pairs:

    * ``both``: both reached g*; the time ratio is a real time-to-accuracy ratio.
    * ``arm_first`` / ``base_first``: one reached g* at t, the other was still running at t without having
      reached it (censored at c >= t): the order is known.
    * ``indeterminate``: one reached g* at t, the other stopped at c < t without reaching it: it might have
      reached g* between c and t had it run longer.
    * ``neither``: no run reached g*; nothing is known about the order.

    Returns the seed counts per class, the known order (wins of the arm, of the base) and the paired ratio
    over the ``both`` seeds (geometric mean, CI)."""
    classes = {"both": [], "arm_first": [], "base_first": [], "indeterminate": [], "neither": []}
    nums, dens = [], []
    for a, b in zip(arm_runs, base_runs):
        seed = a.get("seed")
        if not a["censored"] and not b["censored"]:
            classes["both"].append(seed)
            nums.append(a["time_to_g"])
            dens.append(b["time_to_g"])
            if a["time_to_g"] < b["time_to_g"]:
                classes.setdefault("_arm_wins_both", []).append(seed)
        elif a["censored"] and b["censored"]:
            classes["neither"].append(seed)
        elif not a["censored"]:  # arm reached at t, base censored at its total
            classes["arm_first" if b["total"] >= a["time_to_g"] else "indeterminate"].append(seed)
        else:
            classes["base_first" if a["total"] >= b["time_to_g"] else "indeterminate"].append(seed)
    wins_both = classes.pop("_arm_wins_both", [])
    return {**classes, "arm_wins": len(wins_both) + len(classes["arm_first"]),
            "base_wins": len(classes["both"]) - len(wins_both) + len(classes["base_first"]),
            "ratio_both": ratio_test(nums, dens)}


def verdict(endpoint: str, res: dict, p: float, alpha: float) -> str:
    if p is None or math.isnan(p):
        return "n/a"
    if endpoint == "e3":
        return "non-inferior" if p < alpha / 2 else "not shown non-inferior"
    if p >= alpha:
        return "no difference shown"
    if endpoint == "e1":
        return "faster" if res["geo_mean"] < 1 else "slower"
    return "higher" if res["mean"] > 0 else "lower"


def _mean(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return statistics.fmean(xs) if xs else math.nan


def analyse(runs: dict, arms: list[str], seeds: list[int], prereg: dict, family: Sequence[str],
            alpha: float = 0.05) -> dict:
    """Every endpoint for every arm (``runs``: (seed, arm) -> the benchmark's read_run dict), with the
    preregistered g*, T*, margin; Holm over ``family`` (vs grpo), one family per endpoint 1-3."""
    summ = {k: summarize_run(r, prereg) for k, r in runs.items()}
    out = {"g_star": prereg["g_star"], "T_star": prereg["T_star"], "margin": prereg["margin"], "alpha": alpha,
           "family": list(family),
           "per_run": {f"{a}_s{s}": {"seed": s, "arm": a, **{k: v for k, v in x.items() if k != "curve"}}
                       for (s, a), x in summ.items()},
           "arms": {}, "vs": {}}
    for base in ("grpo", "dapo-filter"):
        if base in arms:
            out["vs"][base] = {a: compare(summ, a, base, seeds, prereg["margin"]) for a in arms if a != base}
    # Holm over the DPPO arms vs GRPO, one family per endpoint; the rest unadjusted
    for a, res in out["vs"].get("grpo", {}).items():
        for e in ("e1", "e2", "e3"):
            res[e]["p_holm"] = None
            res[e]["verdict"] = verdict(e, res[e], res[e]["p"], alpha) + ("" if a in family else " (unadjusted)")
    for e in ("e1", "e2", "e3"):
        pvals = {a: r[e]["p"] for a, r in out["vs"].get("grpo", {}).items() if a in family}
        for a, p in holm(pvals).items():
            res = out["vs"]["grpo"][a][e]
            res["p_holm"] = p
            res["verdict"] = verdict(e, res, p, alpha)
    for res in out["vs"].get("dapo-filter", {}).values():
        for e in ("e1", "e2", "e3"):
            res[e]["verdict"] = verdict(e, res[e], res[e]["p"], alpha) + " (unadjusted)"
    for a in arms:
        rs = [summ[(s, a)] for s in seeds if (s, a) in summ]
        raw = [runs[(s, a)] for s in seeds if (s, a) in runs]
        if not rs:
            continue
        bounds = raw[0]["eval_steps"]
        series = {k: [_mean(vals) for vals in zip(*(interval_means(r["series"][k], bounds) for r in raw))]
                  for k in raw[0]["series"]}
        horizon = min(r["total"] for r in rs)
        grid = [horizon * i / 60 for i in range(61)]
        out["arms"][a] = {
            "n": len(rs), "reached": sum(not r["censored"] for r in rs),
            "pre": mean_ci([r["pre"] for r in rs]), "final": mean_ci([r["final"] for r in rs]),
            "final_gain": mean_ci([r["final_gain"] for r in rs]), "total": mean_ci([r["total"] for r in rs]),
            "time_to_g": mean_ci([r["time_to_g"] for r in rs]),
            "gain_at_T": mean_ci([r["gain_at_T"] for r in rs]),
            "eval_steps": bounds,
            "gain_by_step": [mean_ci(list(col)) for col in zip(*(r["curve"]["gain"] for r in rs))],
            "gain_by_time": {"t": grid, "gain": [mean_ci([interp(r["curve"]["t"], r["curve"]["gain"], t)
                                                            for r in rs]) for t in grid]},
            "by_interval": series,
            "overall": {k: mean_ci([_mean(r["series"][k]) for r in raw]) for k in raw[0]["series"]}}
    return out


def wilson(k: float, n: int, z: float = 1.96) -> tuple[float, float]:
    """95% (z = 1.96) Wilson interval of a proportion k / n."""
    if n == 0:
        return (math.nan, math.nan)
    p = k / n
    centre, half = (p + z * z / (2 * n)) / (1 + z * z / n), z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (
        1 + z * z / n)
    return (max(0.0, centre - half), min(1.0, centre + half))
