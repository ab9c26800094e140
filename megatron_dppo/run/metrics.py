"""Metrics plumbing of the trainer: phase timers, the sinks (JSONL, TensorBoard, W&B), pass@k, the reward plot.

Rank 0 writes; other ranks get a sink that drops everything. ``metrics.jsonl`` holds one JSON object per step
(``{"step": s, "phase": "rl"|"sft"|"eval", ...}``); on resume the lines at or after the resumed position are
dropped, so a resumed run's file equals a straight run's file (apart from the wall-clock ``time/*`` fields);
whenever a line is dropped the original file is kept as ``metrics.jsonl.<UTC time>.bak`` (``rewrite_jsonl``).
"""
from __future__ import annotations

import json
import math
import os
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator


def process_tree_cpu() -> float:
    """CPU seconds (user + system) used so far by this process (every thread), by its child processes that ended
    (and were waited for) and by its live descendants (e.g. the persistent workers of a process-isolated reward,
    a tool's sandbox). A child that ends between two reads moves from the live to the ended count: read in this
    order, it is never counted twice (at worst once later). The python tool's calls under bubblewrap are reaped
    inside their own pid namespace, never by this process, so their ended CPU comes from their control groups
    (``env.sandbox.cpu_seconds_total``)."""
    import resource

    import psutil

    from megatron_dppo.env.sandbox import cpu_seconds_total

    sandboxes = cpu_seconds_total()
    ended = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() + ended.ru_utime + ended.ru_stime + sandboxes
    for child in psutil.Process().children(recursive=True):
        try:
            t = child.cpu_times()
        except psutil.Error:  # ended meanwhile (counted once it is waited for) or not ours to read
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


class PhaseTimer:
    """Wall-clock seconds per named phase of one step: ``with timer("generate"): ...``; and the process CPU
    seconds (user + system, every thread of this process: ``time.process_time``) spent inside the same phases.

    ``time/step`` is the sum of the phases' wall clock; ``cpu_seconds`` the sum of their CPU time on this rank;
    ``time_cpu/<phase>`` is each phase's CPU time on this rank. ``step_cpu_seconds()`` is the CPU time of the whole
    step on this rank since the timer was made, phases or not, child processes included (``process_tree_cpu``):
    the trainer sums it over ranks into ``time/step_cpu``, what ``train.cpu_budget_s`` charges. CPU seconds are what
    a loaded, shared machine does not inflate much: they count the work, not the waiting for a core.
    """

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.cpu_seconds = 0.0
        self._tree_start = process_tree_cpu()

    def step_cpu_seconds(self) -> float:
        """CPU seconds of this process and its children since the timer was made (module docstring)."""
        return process_tree_cpu() - self._tree_start

    @contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start, cpu_start = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start
            cpu = time.process_time() - cpu_start
            self.cpu[phase] = self.cpu.get(phase, 0.0) + cpu
            self.cpu_seconds += cpu

    def as_metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = sum(self.seconds.values())
        out.update({f"time_cpu/{k}": v for k, v in self.cpu.items()})
        return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples with ``c`` correct (Chen et al. 2021): 1 - C(n-c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def _scalar(v: Any) -> float | None:
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


class MetricsSink:
    """JSONL + TensorBoard (+ W&B) writer. ``enabled=False`` (non-zero ranks) makes every call a no-op.

    Records are keyed by phase: ``(0, sft_step)`` for the warm start, ``(1, step)`` for RL and eval records.
    ``open(resume_key)`` keeps the JSONL records before ``resume_key`` (None = a fresh run: empty file), and
    TensorBoard drops events at or after ``tb_purge_step`` (global step = warm-start steps + RL step).
    """

    def __init__(self, output_dir: str | Path, *, enabled: bool, jsonl: bool = True, tensorboard: bool = True,
                 wandb: str = "off", wandb_project: str = "megatron-dppo", run_config: dict | None = None) -> None:
        self.enabled = enabled
        self.dir = Path(output_dir)
        self.jsonl_path = self.dir / "metrics.jsonl"
        self._want = {"jsonl": jsonl, "tensorboard": tensorboard, "wandb": wandb}
        self._project, self._run_config = wandb_project, run_config
        self._jsonl = None
        self._tb = None
        self._wandb = None

    def open(self, resume_key: tuple[int, int] | None = None, tb_purge_step: int | None = None) -> None:
        if not self.enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        if self._want["jsonl"]:
            self._truncate_jsonl(resume_key)
            self._jsonl = open(self.jsonl_path, "a", encoding="utf-8")
        if self._want["tensorboard"]:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=tb_purge_step)
            except ImportError as err:  # tensorboard is a core dependency; warn rather than die mid-run
                warnings.warn(f"TensorBoard disabled: {err}")
        if self._want["wandb"] != "off":
            self._wandb = _start_wandb(self._want["wandb"], self._project, str(self.dir), self._run_config)

    def _truncate_jsonl(self, resume_key: tuple[int, int] | None) -> None:
        """Keep only the records before ``resume_key`` (None = fresh run: start an empty file); see
        :func:`rewrite_jsonl` (a copy of the file is kept whenever a line is dropped)."""
        rewrite_jsonl(self.jsonl_path, lambda rec: resume_key is not None and record_key(rec) < tuple(resume_key))

    def log(self, step: int, metrics: dict[str, Any], phase: str = "rl", global_step: int | None = None) -> None:
        if not self.enabled:
            return
        if self._jsonl is not None:
            rec = {"step": step, "phase": phase}
            rec.update({k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool)) or v is None})
            self._jsonl.write(json.dumps(rec) + "\n")
            self._jsonl.flush()
        scalars = {k: f for k, v in metrics.items() if (f := _scalar(v)) is not None}
        gstep = step if global_step is None else global_step
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k if "/" in k else f"{phase}/{k}", v, gstep)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=gstep)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def record_key(rec: dict) -> tuple[int, int]:
    """Order of records: warm-start steps (0, step) before RL/eval steps (1, step). The evaluation before the
    first RL step (step -1) belongs to RL step 0: a run resumed at RL step 0 runs it again."""
    if rec.get("phase") == "sft":
        return (0, int(rec.get("step", 0)))
    return (1, max(0, int(rec.get("step", 0))))


def _start_wandb(mode: str, project: str, directory: str, run_config: dict | None):
    try:
        import wandb  # noqa: PLC0415 - optional dependency
    except ImportError:
        if mode == "on":
            raise ValueError("logging.wandb=on but the wandb package is not installed (pip install wandb, or set "
                             "logging.wandb=auto|off)") from None
        return None
    if mode == "auto" and not (os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE")):
        return None
    return wandb.init(project=project, dir=directory, config=run_config)


def _parse_line(line: bytes) -> dict | None:
    """One JSONL record, or None for a line a crash tore (not UTF-8, not JSON, not an object with a step)."""
    try:
        rec = json.loads(line.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(rec, dict):
        return None
    try:
        record_key(rec)
    except (TypeError, ValueError):
        return None
    return rec


def keep_copy(path: Path) -> Path:
    """Copy ``path`` to ``<path>.<UTC time>.bak`` (a fresh name) and return the copy."""
    import shutil

    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    backup, n = path.with_name(f"{path.name}.{stamp}.bak"), 1
    while backup.exists():
        backup, n = path.with_name(f"{path.name}.{stamp}-{n}.bak"), n + 1
    shutil.copy2(path, backup)
    return backup


def rewrite_jsonl(path: str | Path, keep) -> tuple[int, int, Path | None]:
    """Rewrite the JSONL file ``path`` with the records for which ``keep(record)`` is true (on resume: the steps
    before the resumed position). Recorded data is never lost: when any line is dropped (later steps than the
    resume point, e.g. after a crash or a lost ``latest`` pointer, or lines torn by a crash), the original file
    is first copied to ``<path>.<UTC time>.bak`` and a warning names the copy. Torn lines (a non-UTF-8 byte,
    half a JSON object) are skipped, never fatal. The file is replaced atomically. Returns (records dropped,
    torn lines skipped, the copy or None)."""
    path = Path(path)
    if not path.exists():
        path.write_text("", encoding="utf-8")
        return 0, 0, None
    kept, dropped, torn = [], 0, 0
    for line in path.read_bytes().splitlines():
        if not line.strip():
            continue
        rec = _parse_line(line)
        if rec is None:
            torn += 1
        elif keep(rec):
            kept.append(line.decode("utf-8"))
        else:
            dropped += 1
    backup = keep_copy(path) if dropped or torn else None
    if backup is not None:
        what = [f"{dropped} record(s) of later steps than the resume point"] if dropped else []
        what += [f"{torn} unreadable line(s) (torn by a crash)"] if torn else []
        warnings.warn(f"{path}: dropped {' and '.join(what)}; the original file is kept as {backup}",
                      stacklevel=2)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text("".join(k + "\n" for k in kept), encoding="utf-8")
    os.replace(tmp, path)
    return dropped, torn, backup


def read_jsonl(path: str | Path) -> list[dict]:
    """The records of a JSONL file; lines torn by a crash are skipped with a warning."""
    path = Path(path)
    if not path.exists():
        return []
    lines = [line for line in path.read_bytes().splitlines() if line.strip()]
    records = [rec for line in lines if (rec := _parse_line(line)) is not None]
    if len(records) < len(lines):
        warnings.warn(f"{path}: skipped {len(lines) - len(records)} unreadable line(s) (torn by a crash)",
                      stacklevel=2)
    return records


STEP_TOTALS = ("time/step", "time/step_cpu")  # totals over a step's phases (wall clock; CPU seconds of all ranks)


def phase_keys(records: list[dict]) -> list[str]:
    """The time/* keys of the phases of a step (generate, reward, train, ...), without the totals that sum them
    (``STEP_TOTALS``): the bars of the time-per-phase panel stack to at most the step's time."""
    return sorted({k for r in records for k in r if k.startswith("time/") and k not in STEP_TOTALS})


def plot_reward_curve(metrics_path: str | Path, png_path: str | Path) -> Path | None:
    """Six panels from ``metrics.jsonl``: reward (before/after pruning, eval pass@1), kept fraction per level,
    effective sample size, the warm-start NLL, packing density, and time per phase. Returns the PNG path (None
    when there is nothing to plot)."""
    records = read_jsonl(metrics_path)
    rl = [r for r in records if r.get("phase") == "rl"]
    ev = [r for r in records if r.get("phase") == "eval"]
    sft = [r for r in records if r.get("phase") == "sft"]
    if not rl and not ev and not sft:
        return None
    import matplotlib  # noqa: PLC0415 - only needed at the end of a run
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    def series(recs, key):
        pts = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
        return [p[0] for p in pts], [p[1] for p in pts]

    def lines(ax, recs, keys, **kw):
        for key, label in keys:
            xs, ys = series(recs, key)
            if xs:
                ax.plot(xs, ys, label=label, **kw)

    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5))
    ax = axes[0][0]
    lines(ax, rl, [("reward/mean", "train reward, all drawn prompts (1/pi estimate)")])
    lines(ax, rl, [("reward/mean_generated", "train reward, generated prompts only (biased up by pruning)"),
                   ("reward/mean_kept", "train reward, trained sequences only (biased)")], alpha=0.45)
    evk = sorted({k for r in ev for k in r if k.startswith("eval/") and ("pass@" in k)})
    lines(ax, ev, [(k, k[5:]) for k in evk], marker="o")
    ax.set_title("reward"), ax.set_xlabel("RL step"), ax.grid(alpha=0.3)
    ax.legend(fontsize=7)

    ax = axes[0][1]
    lines(ax, rl, [("prune/prompt_kept_fraction", "prompts kept (of drawn)"),
                   ("prune/completion_kept_fraction", "completions kept (of generated)"),
                   ("prune/total_kept_fraction", "sequences trained / B*G")])
    ax.set_ylim(0, 1.05), ax.set_title("kept fraction per level"), ax.set_xlabel("RL step"), ax.grid(alpha=0.3)
    ax.legend(fontsize=7)

    ax = axes[0][2]
    lines(ax, rl, [("prune/total_ess", "ESS (sum w)^2 / sum w^2"), ("prune/total_kept", "sequences trained")])
    ax.set_title("effective sample size"), ax.set_xlabel("RL step"), ax.grid(alpha=0.3), ax.legend(fontsize=7)

    ax = axes[1][0]
    lines(ax, sft, [("sft/nll", "warm-start NLL per completion token")])
    ax.set_title("supervised warm start"), ax.set_xlabel("warm-start step"), ax.grid(alpha=0.3)
    if sft:
        ax.legend(fontsize=7)

    ax = axes[1][1]
    lines(ax, rl, [("packing/density", "valid-token density")])
    ax.set_ylim(0, 1.05), ax.set_title("packing density"), ax.set_xlabel("RL step"), ax.grid(alpha=0.3)

    ax = axes[1][2]
    phases = phase_keys(rl)
    if rl and phases:
        steps = [r["step"] for r in rl]
        bottom = [0.0] * len(rl)
        for key in phases:
            vals = [float(r.get(key, 0.0)) for r in rl]
            ax.bar(steps, vals, bottom=bottom, label=key[5:], width=0.9)
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.legend(fontsize=7)
    ax.set_title("time per phase (s)"), ax.set_xlabel("RL step")
    fig.tight_layout()
    png_path = Path(png_path)
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path
