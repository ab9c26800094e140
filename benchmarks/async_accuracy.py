"""Accuracy at equal steps under staleness: the CPU quickstart trained with 1 trainer + 1 rollout worker at
``train.max_staleness`` 0, 1, 2, without (``loss.rollout_correction=none``, the stale samples trained as if
on-policy) and with the decoupled objective (``tis``), a few seeds (docs/benchmarks.md, section 10;
docs/async.md).

Each arm trains ``--steps`` RL steps after the quickstart's warm start, then the final checkpoint is evaluated
with ``megatron-dppo eval`` (colocated, the quickstart's eval settings: fresh samples of the training facts,
``eval.samples`` each). Reported per arm and seed: pass@1 at the end, the train reward of the last 10 steps
(Horvitz-Thompson, ``reward/mean``), the mean staleness actually seen and the behaviour-vs-proximal KL
(``rollout/kl_k1``, logged when the correction is on). Staleness 0 with and without the correction differ only in
the correction of the engine/trainer numerics (the extra old-log-prob pass).

Extra ``key=value`` arguments are config overrides for every arm (as in ``async_overlap.py``), e.g.
``optim.lr=3e-3`` for a policy that moves more per version (the quickstart's 5e-4 moves it little: KL(behav ||
prox) ~2-4e-3 per token).

Run: ``.venv/bin/python benchmarks/async_accuracy.py [--seeds 1,2] [--steps 60] [--arms k0-none,k1-none,...]
[--out results.json] [optim.lr=3e-3 ...]``
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if not __package__:  # `python benchmarks/async_accuracy.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, cli, read_metrics, run

ARMS = ["k0-none", "k0-tis", "k1-none", "k1-tis", "k2-none", "k2-tis"]


ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def run_arm(arm: str, seed: int, steps: int, root: Path, overrides: list[str] = ()) -> dict:
    k, correction = int(arm[1]), arm.split("-")[1]
    out = root / f"{arm}-s{seed}"
    config = str(REPO / "examples" / "quickstart.yaml")
    common = [f"train.steps={steps}", f"train.seed={seed}", f"train.output_dir={out}", "logging.plot=false",
              "logging.tensorboard=false", f"loss.rollout_correction={correction}", *overrides]
    run(cli("train", "--config", config, *common, "rollout.placement=separate", f"train.max_staleness={k}",
            "eval.every=0", "checkpoint.every=0", nproc=2), root / f"{arm}-s{seed}-train.log", env=ENV)
    run(cli("eval", "--config", config, *common), root / f"{arm}-s{seed}-eval.log", env=ENV)
    rl = read_metrics(out, "rl")
    ev = json.loads((out / "eval.json").read_text())
    pass1 = [v for key, v in ev.items() if key.endswith("pass@1")]
    return {"arm": arm, "seed": seed, "pass@1": pass1[0] if pass1 else float("nan"),
            "reward_last10": statistics.mean(r["reward/mean"] for r in rl[-10:]),
            "staleness_mean": statistics.mean(r.get("async/staleness", 0.0) for r in rl),
            "kl_k1_mean": statistics.mean(r.get("rollout/kl_k1", float("nan")) for r in rl),
            "corrected_fraction_mean": statistics.mean(r.get("rollout/is_corrected_fraction", float("nan"))
                                                       for r in rl)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="1,2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("overrides", nargs="*", help="extra key=value overrides for every arm")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory(prefix="async_accuracy_") as tmp:
        for seed in [int(s) for s in args.seeds.split(",")]:
            for arm in args.arms.split(","):
                results.append({**run_arm(arm, seed, args.steps, Path(tmp), args.overrides),
                                "overrides": args.overrides})
                r = results[-1]
                print(f"{arm:8s} seed {seed}: pass@1 {r['pass@1']:.3f} | train reward (last 10) "
                      f"{r['reward_last10']:.3f} | staleness {r['staleness_mean']:.2f} | KL(behav||prox) "
                      f"{r['kl_k1_mean']:.2e} | corrected {r['corrected_fraction_mean']:.3f}", flush=True)
                if args.out:
                    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
