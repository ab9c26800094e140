"""A study runner that survives a stop: the runs of a study resume from their checkpoints when it is restarted.

    jobs = [Job("grpo_s1", config, ["algo.pruner=none", "train.seed=1"], work / "grpo_s1",
                done=cpu_budget_reached(900.0)), ...]
    failed = run_jobs(jobs, parallel=1, state=work / "study_state.json")

Each job is one ``megatron-dppo train`` process in its own ``train.output_dir`` with ``checkpoint.resume=auto``:
started the first time, it trains from scratch; started again after any stop, the trainer takes the newest
checkpoint of that folder (and drops the metric lines logged after it), so the run continues where its last
checkpoint left it, as a straight run would have (the trainer's resume guarantee). Nothing is ever deleted.

When is a job finished? ``done(records)``, a predicate on the run's ``metrics.jsonl`` records, checked before a job
starts and every ``poll_s`` while it runs; without one, when the run logged ``train.steps`` RL steps. A job whose
predicate becomes true while it runs is sent SIGTERM: the trainer finishes its step, writes a checkpoint and
exits. ``cpu_budget_reached(B)`` is the predicate of an equal-CPU-budget study: the run's RL steps have used B
process-CPU seconds (``time/step_cpu``, summed from the metrics, so the count survives restarts) and an evaluation
was logged at or after that point.

Stopping the study: SIGINT / SIGTERM / SIGHUP to the runner is passed on to every running job as SIGTERM; the jobs
checkpoint and exit, the runner writes its state and exits with 128 + signal. Running the same command again
resumes every unfinished job from its checkpoint and skips the finished ones. A SIGKILL of everything loses at
most the steps since each job's last checkpoint (``checkpoint.every``).

The state file (``state``) records per job its status and each process segment: start, end, exit code, wall and
CPU seconds (``wait4`` user + system of the trainer process and its children), so the cost of a study split over
several sittings adds up.

A study longer than one sitting on a machine whose disk does not last (a fresh checkout each time) keeps its
finished runs in the repository: ``archive_finished`` writes each finished run's metrics (gzipped JSON lines, the
whole record, nothing dropped) and its state entry into an archive folder, and ``restore_archived`` writes them
back into an empty output folder, where the job then counts as finished by the same rule and a report reads it as
if it had run there. Unfinished runs are not archived (their checkpoints are far too large): they start again.
"""
from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

if not __package__:  # `python benchmarks/study_runner.py`: the repository joins sys.path (benchmarks: a package)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import REPO, cli, read_metrics, run_pool
from megatron_dppo.distributed.launch import free_port

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def rl_steps(records: list[dict]) -> int:
    return sum(r.get("phase") == "rl" for r in records)


def cumulative_cpu(records: list[dict]) -> list[tuple[int, float]]:
    """(RL step, cumulative ``time/step_cpu`` after it) for every logged RL step, in step order."""
    total, out = 0.0, []
    for r in sorted((r for r in records if r.get("phase") == "rl"), key=lambda r: r["step"]):
        total += float(r.get("time/step_cpu", math.nan))
        out.append((int(r["step"]), total))
    return out


def cpu_budget_reached(budget_s: float) -> Callable[[list[dict]], bool]:
    """Finished when the RL steps used ``budget_s`` CPU seconds and an evaluation was logged at or after the step
    that crossed it (so the accuracy at the budget can be read off without extrapolating)."""
    def done(records: list[dict]) -> bool:
        crossed = next((step for step, cpu in cumulative_cpu(records) if cpu >= budget_s), None)
        return crossed is not None and any(r.get("phase") == "eval" and r["step"] >= crossed for r in records)
    done.budget_s = budget_s  # (for the state file)
    return done


@dataclass
class Job:
    """One training run of a study: ``megatron-dppo train --config config overrides`` in ``output_dir``."""

    name: str
    config: Path
    overrides: list[str]
    output_dir: Path
    done: Optional[Callable[[list[dict]], bool]] = None
    steps: Optional[int] = None  # train.steps, for the default done rule (read from the config when None)
    env: dict = field(default_factory=dict)

    def finished(self) -> bool:
        records = read_metrics(self.output_dir)
        if self.done is not None:
            return self.done(records)
        return rl_steps(records) >= self._steps()

    def _steps(self) -> int:
        if self.steps is None:
            from megatron_dppo.config import load_config

            self.steps = load_config(self.config, self.overrides).train.steps
        return self.steps

    def command(self) -> list[str]:
        return cli("train", "--config", str(self.config), *self.overrides, f"train.output_dir={self.output_dir}",
                   "checkpoint.resume=auto")


class StudyState:
    """The state file: per job, its status and its process segments (thread-safe, rewritten atomically)."""

    def __init__(self, path: Optional[Path]):
        self.path, self.lock = path, threading.Lock()
        self.data = json.loads(path.read_text()) if path is not None and path.is_file() else {"jobs": {}}

    def update(self, name: str, **fields) -> None:
        with self.lock:
            job = self.data["jobs"].setdefault(name, {"segments": []})
            segment = fields.pop("segment", None)
            if segment is not None:
                job["segments"].append(segment)
            job.update(fields)
            job["cpu_s_total"] = sum(s.get("cpu_s", 0.0) for s in job["segments"])
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1))
        os.replace(tmp, self.path)


class JobFailed(RuntimeError):
    """A job's process exited before the job was finished (the message says how)."""


def _reason(err: Exception) -> str:
    return str(err) if isinstance(err, JobFailed) else f"{type(err).__name__}: {err}"


class Runner:
    """Runs jobs ``parallel`` at a time; see the module docstring."""

    def __init__(self, jobs: list[Job], parallel: int = 1, state: Optional[Path] = None, poll_s: float = 5.0,
                 timeout_s: Optional[float] = None, log: Callable[[str], None] = print):
        self.jobs, self.parallel, self.poll_s, self.timeout_s = list(jobs), parallel, poll_s, timeout_s
        self.state, self.log = StudyState(state), log
        self.stop_signal: Optional[int] = None
        self.procs: dict[str, subprocess.Popen] = {}
        self.lock = threading.Lock()

    # -- signals: passed on to the jobs as SIGTERM (they checkpoint and exit)
    def _on_signal(self, signum, _frame) -> None:
        if self.stop_signal is None:
            self.log(f"[{time.strftime('%H:%M:%S')}] {signal.Signals(signum).name}: stopping every running job at "
                     "its next step boundary (each writes a checkpoint); run the same command again to resume")
        self.stop_signal = signum
        with self.lock:
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)

    def run(self) -> list[tuple[str, str]]:
        """Run every unfinished job; returns the (job name, reason) of those that failed. With a stop signal the
        jobs are stopped and the runner exits with 128 + signal (``SystemExit``)."""
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS} \
            if threading.current_thread() is threading.main_thread() else {}
        try:
            failed = run_pool(self.jobs, self._worker, self.parallel, stop=lambda: self.stop_signal is not None,
                              report=self._report)
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
        if self.stop_signal is not None:
            raise SystemExit(128 + self.stop_signal)
        return [(job.name, _reason(err)) for job, err in failed]

    def _worker(self, job: Job) -> None:
        reason = self._run_job(job)
        if reason is not None:
            raise JobFailed(reason)

    def _report(self, job: Job, err: Exception) -> None:
        self.state.update(job.name, status="failed", reason=_reason(err))
        self.log(f"[{time.strftime('%H:%M:%S')}] FAILED {job.name}: {_reason(err)}")

    def _run_job(self, job: Job) -> Optional[str]:
        """None when the job finished (or the study was stopped), else why it failed."""
        if job.finished():
            self.state.update(job.name, status="finished")
            return None
        resumed = (job.output_dir / "checkpoints" / "latest").is_file()
        self.log(f"[{time.strftime('%H:%M:%S')}] {'resuming' if resumed else 'starting'} {job.name} "
                 f"({rl_steps(read_metrics(job.output_dir))} RL steps logged)")
        job.output_dir.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", MASTER_PORT=str(free_port()), **job.env)
        env.pop("RANK", None), env.pop("WORLD_SIZE", None)
        t0, started = time.perf_counter(), time.strftime("%Y-%m-%dT%H:%M:%S")
        with open(job.output_dir.parent / f"{job.name}.log", "a") as log:
            log.write(f"=== {started} {'resume' if resumed else 'start'}: {' '.join(job.command())}\n")
            log.flush()
            with self.lock:
                if self.stop_signal is not None:
                    return None
                proc = subprocess.Popen(job.command(), cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        start_new_session=True)  # a terminal's Ctrl-C reaches it only through us
                self.procs[job.name] = proc
            self.state.update(job.name, status="running")
            stopped_done = False
            while True:
                pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
                if pid:
                    break
                if not stopped_done and job.finished():  # the budget is reached: stop it with a checkpoint
                    proc.send_signal(signal.SIGTERM)
                    stopped_done = True
                if self.timeout_s is not None and time.perf_counter() - t0 > self.timeout_s:
                    proc.send_signal(signal.SIGTERM)
                time.sleep(self.poll_s)
        with self.lock:
            self.procs.pop(job.name, None)
        code = os.waitstatus_to_exitcode(status)
        segment = {"start": started, "end": time.strftime("%Y-%m-%dT%H:%M:%S"), "exit": code, "resumed": resumed,
                   "wall_s": time.perf_counter() - t0, "cpu_s": usage.ru_utime + usage.ru_stime,
                   "rl_steps_logged": rl_steps(read_metrics(job.output_dir))}
        if job.finished():
            self.state.update(job.name, status="finished", segment=segment)
            self.log(f"[{time.strftime('%H:%M:%S')}] finished {job.name} ({segment['rl_steps_logged']} RL steps)")
            return None
        if self.stop_signal is not None:
            self.state.update(job.name, status="stopped", segment=segment)
            return None
        self.state.update(job.name, status="failed", segment=segment)
        return f"exit {code} before it was finished; log {job.output_dir.parent / f'{job.name}.log'}"


def run_jobs(jobs: list[Job], parallel: int = 1, state: Optional[Path] = None, poll_s: float = 5.0,
             timeout_s: Optional[float] = None) -> list[tuple[str, str]]:
    """Run the unfinished jobs (module docstring); returns the failed ones as (name, reason)."""
    return Runner(jobs, parallel, state, poll_s, timeout_s).run()


# ----------------------------------------------------------------------------------------------------------
# Finished runs kept in the repository (module docstring)
# ----------------------------------------------------------------------------------------------------------
def _archived_metrics(archive: Path, job: Job) -> Path:
    return archive / f"{job.name}.metrics.jsonl.gz"


def archive_finished(jobs: list[Job], archive: Path, state: Optional[Path] = None) -> list[str]:
    """Write every finished job's ``metrics.jsonl`` to ``<archive>/<name>.metrics.jsonl.gz`` (byte-identical once
    unzipped; the gzip carries no time stamp, so an unchanged run leaves an unchanged file) and its entry of the
    ``state`` file to ``<archive>/study_state.json``; returns the names of the jobs archived."""
    done = [job for job in jobs if job.finished()]
    if not done:
        return []
    archive.mkdir(parents=True, exist_ok=True)
    for job in done:
        data = gzip.compress((job.output_dir / "metrics.jsonl").read_bytes(), mtime=0)
        target = _archived_metrics(archive, job)
        if not target.is_file() or target.read_bytes() != data:
            target.write_bytes(data)
    if state is not None and state.is_file():
        kept = StudyState(archive / "study_state.json")
        entries = StudyState(state).data["jobs"]
        for job in done:
            if job.name in entries:
                kept.data["jobs"][job.name] = entries[job.name]
        kept._write()
    return [job.name for job in done]


def restore_archived(jobs: list[Job], archive: Path) -> list[str]:
    """Write the archived metrics back into each job's output folder that has none; returns the names restored.
    An archived run is a finished one: a restored job that does not count as finished (the study's rule changed
    since it was archived) is an error, not a run to continue from a checkpoint it does not have."""
    restored = []
    for job in jobs:
        source = _archived_metrics(archive, job)
        if not source.is_file() or (job.output_dir / "metrics.jsonl").is_file():
            continue
        job.output_dir.mkdir(parents=True, exist_ok=True)
        (job.output_dir / "metrics.jsonl").write_bytes(gzip.decompress(source.read_bytes()))
        if not job.finished():
            raise SystemExit(f"{source} does not hold a finished run of {job.name} under this study's rule; "
                             f"remove it (and {job.output_dir}) to run the job again")
        restored.append(job.name)
    return restored


# ----------------------------------------------------------------------------------------------------------
# Preregistered studies: the protocol is written to a file and committed before any run
# ----------------------------------------------------------------------------------------------------------
def write_prereg(path: Path, protocol: dict) -> None:
    """Write ``protocol`` to ``path`` (once: a preregistration with another protocol is never rewritten)."""
    if path.is_file() and json.loads(path.read_text()) != protocol:
        sys.exit(f"{path} exists with another protocol: a preregistration is not rewritten")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(protocol, indent=1) + "\n")
    print(f"wrote {path}: commit it before the runs")


def read_prereg(path: Path) -> dict:
    """The committed protocol (exits with what to do when there is none)."""
    if not path.is_file():
        sys.exit(f"no protocol at {path}: run with --write-prereg and commit it first")
    return json.loads(path.read_text())


def run_preregistered(protocol: dict, script_protocol: dict, jobs: list[Job], work: Path,
                      archive: Optional[Path] = None) -> int:
    """Run ``jobs`` (resumable, ``protocol["parallel"]`` at a time) if the committed ``protocol`` is the script's;
    returns the exit status (1 if a job failed). With an ``archive``, the runs archived there are restored first
    and every finished run is archived when the runner ends, stopped or not."""
    if protocol != script_protocol:
        sys.exit("the committed protocol differs from this script's PROTOCOL: the protocol is fixed before the runs")
    state = work / "study_state.json"
    if archive is not None:
        restored = restore_archived(jobs, archive)
        if restored:
            print(f"restored from {archive}: {', '.join(restored)}")
    try:
        failed = run_jobs(jobs, parallel=protocol["parallel"], state=state)
    finally:
        if archive is not None:
            kept = archive_finished(jobs, archive, state)
            print(f"archived in {archive}: {len(kept)} finished runs (commit them)")
    for name, why in failed:
        print(f"FAILED {name}: {why}")
    return 1 if failed else 0


def study_arguments(doc: str, work: Path, prereg: Path, archive: Optional[Path] = None) -> argparse.ArgumentParser:
    """The options of every preregistered study script: ``--work`` (its runs), ``--prereg`` (the committed
    protocol), ``--write-prereg``, ``--report`` (``--out``: where the report goes), ``--extra`` (overrides for every
    run that leave the protocol unchanged), ``--archive`` (default ``archive``) and ``--archive-only``. A script adds
    its own before parsing."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--work", type=Path, default=work)
    ap.add_argument("--prereg", type=Path, default=prereg)
    ap.add_argument("--write-prereg", action="store_true", help="write the protocol to --prereg (before the runs)")
    ap.add_argument("--report", action="store_true", help="analyse the finished runs")
    ap.add_argument("--out", type=Path, default=None, help="--report: the JSON (default <work>/report.json)")
    ap.add_argument("--extra", nargs="*", default=[], help="overrides for every run that do not change the "
                                                            "protocol (e.g. model.gguf_cache=<folder>)")
    ap.add_argument("--archive", type=Path, default=archive,
                    help="folder in the repository that keeps the finished runs across sittings (restored into "
                         "--work before the runs and before --report, written when the runner ends)")
    ap.add_argument("--archive-only", action="store_true",
                    help="archive the finished runs of --work into --archive and exit (nothing runs)")
    return ap


def run_study(args: argparse.Namespace, script_protocol: dict, make_jobs: Callable[[Path, dict, list], list[Job]],
              report: Callable[[dict, Path], None]) -> int:
    """What ``study_arguments``' options ask: write the preregistration, or (from the committed protocol) write the
    report to ``--out`` with ``report(protocol, out)``, or run the jobs ``make_jobs(work, protocol, extra)``."""
    if args.write_prereg:
        write_prereg(args.prereg, script_protocol)
        return 0
    protocol = read_prereg(args.prereg)
    jobs = make_jobs(args.work, protocol, args.extra)
    if args.archive_only:
        if args.archive is None:
            sys.exit("--archive-only needs --archive <folder>")
        print(f"archived in {args.archive}: "
              f"{', '.join(archive_finished(jobs, args.archive, args.work / 'study_state.json')) or 'nothing'}")
        return 0
    if args.report:
        if args.archive is not None:
            restore_archived(jobs, args.archive)
        unfinished = [job.name for job in jobs if not job.finished()]
        if unfinished:
            sys.exit(f"{len(unfinished)} of {len(jobs)} runs are not finished ({', '.join(unfinished)}): the "
                     "preregistered analysis reads every run; run the study to its end first")
        report(protocol, args.out or args.work / "report.json")
        return 0
    return run_preregistered(protocol, script_protocol, jobs, args.work, args.archive)
