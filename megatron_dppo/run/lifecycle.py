"""Lifecycle of a run: checkpoints (model, optimizer, RNG through the engine; step, data cursor and prompt
history as the trainer's "extra"), resume, the clean stop on SIGINT / SIGTERM / SIGHUP / SIGUSR1 or a job-script
request (finish the step, save, exit), and the lock that keeps two runs out of one output folder."""
from __future__ import annotations

import errno
import fcntl
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dppo.config import Config
from megatron_dppo.distributed import collectives as D
from megatron_dppo.distributed.launch import stop_requested

if TYPE_CHECKING:
    from megatron_dppo.run.state import Run


def save(run: Run) -> Path:
    from megatron_dppo.megatron.checkpoint import save_checkpoint

    side = run.rollout_side
    extra = {"rl_step": run.rl_step, "sft_step": run.sft_step, "rl_cpu_s": run.rl_cpu_s,
             "sampler": side.sampler.state_dict(),
             "history": side.pruner.state_dict(), "config": run.cfg.to_dict()}
    if run.link is not None:  # train.staleness_mode=fixed: the batches in flight, so that a resume is exact
        extra["in_flight"] = run.link.in_flight(run.rl_step, run.cfg.train.steps)
    return save_checkpoint(run.train_side.engine, run.cfg.checkpoint_dir, extra,
                           keep_last=run.cfg.checkpoint.keep_last)


def find_resume_checkpoint(cfg: Config) -> Path | None:
    """Collective: the checkpoint to resume from, per checkpoint.resume (auto | never | must): the newest one
    that verifies against its manifest (``checkpoint.verify``); an interrupted save is repaired first, and a
    damaged or unnamed latest checkpoint is skipped with a warning (``megatron.checkpoint_files``)."""
    from megatron_dppo.megatron.checkpoint import find_resume_checkpoint as find

    found = find(cfg.checkpoint_dir, cfg.checkpoint.verify)
    if cfg.checkpoint.resume == "must" and found is None:
        raise ValueError(f"checkpoint.resume=must but there is no checkpoint under {cfg.checkpoint_dir}")
    if cfg.checkpoint.resume == "never" and found is not None:
        raise ValueError(f"checkpoint.resume=never but {found} exists; use another train.output_dir / "
                         "checkpoint.dir, delete it, or set checkpoint.resume=auto")
    return found


def restore(run: Run, path: Path) -> None:
    from megatron_dppo.megatron.checkpoint import load_checkpoint

    extra = load_checkpoint(run.train_side.engine, path, verify=None)  # find_resume_checkpoint has just verified it
    run.rl_step, run.sft_step = int(extra["rl_step"]), int(extra["sft_step"])
    run.rl_cpu_s = float(extra.get("rl_cpu_s", 0.0))  # (absent in checkpoints of earlier versions)
    run.rollout_side.sampler.load_state_dict(extra["sampler"])
    restore_prompt_state(run.rollout_side.pruner, extra["history"])
    if run.link is not None:
        run.link.resume_at(run.rl_step, extra.get("in_flight"))
    if D.is_main():
        print(f"resumed from {path} (warm-start step {run.sft_step}, RL step {run.rl_step})", flush=True)


def restore_prompt_state(pruner, saved: dict) -> None:
    """Load the checkpoint's per-prompt state ``saved`` into the ``pruner`` (``algo.pruner.Pruner``: a history or
    a posterior inside it, named by its ``state_format``).
    A state of the other kind (``algo.dppo_keep`` or ``algo.history_score`` changed, e.g. a warm start, or a run
    continued with ``dppo_keep=posterior`` or with a reward model) is not carried over: the run starts a fresh one,
    with a warning when the saved one held prompts (the keep probabilities are recorded with each batch, so the
    estimate stays unbiased)."""
    if isinstance(saved, dict) and saved.get("format") == pruner.state_format:
        pruner.load_state_dict(saved)
        return
    held = len(saved.get("ids", [])) if isinstance(saved, dict) else 0
    if held and D.is_main():
        import warnings

        warnings.warn(f"the checkpoint's prompt state is a {saved.get('format')!r} of {held} prompts; this run keeps "
                      f"a {pruner.state_format!r} (algo.dppo_keep, algo.history_score) and starts it fresh",
                      stacklevel=2)


# ==============================================================================================================
# Clean stop on SIGINT / SIGTERM / SIGHUP / SIGUSR1: finish the current step, save, exit
# ==============================================================================================================
class StopSignals:
    """First signal: stop after the current step with a checkpoint. A second SIGINT aborts immediately.

    SIGHUP (the terminal or ssh session went away) is a stop like SIGTERM: the run ends with a checkpoint
    rather than being killed mid-step; ``nohup`` sets it to ignored, which the handler does not override."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1")

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        import threading
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None and not (sig == signal.SIGHUP and signal.getsignal(sig) == signal.SIG_IGN):
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        self.received = signum
        if D.is_main():
            print(f"\n{signal.Signals(signum).name} received: stopping after this step and saving a checkpoint "
                  "(Ctrl-C again to abort without saving)", file=sys.stderr, flush=True)

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def poll(self) -> int | None:
        """Collective, at a step boundary: None to go on, else the stop code AGREED by every rank: the largest
        signal number any rank received, or ``STOP_REQUESTED`` (0) when the job script asked for a stop through
        ``$DPPO_STOP_FILE`` (``launch.stop_requested``; Slurm preemption). Ranks leave the loop on this shared
        answer, never on their local flag, so a signal that reached only some ranks cannot hang the others."""
        local = self.received if self.received is not None else (STOP_REQUESTED if stop_requested() else -1)
        code = D.max_over_ranks(local)
        return None if code < 0 else code


STOP_REQUESTED = 0  # stop code of a job-script request (no signal): the CLI exits 0 after the checkpoint


# ==============================================================================================================
# One run per output folder
# ==============================================================================================================
LOCK_FILE = ".lock"


class OutputLock:
    """An exclusive lock on ``<output_dir>/.lock``, held by rank 0 for the whole run.

    ``flock`` is released by the kernel when the holder exits, however it exits (SIGKILL, OOM), so a crashed run
    never leaves a stale lock. The file names the holder (pid, host, start time) for the error of a second run.
    Linux NFS clients implement ``flock`` with POSIX byte-range locks, which the server arbitrates between hosts.
    A process that holds the lock already (a set-up that failed after taking it, then a new run in the same
    Python process) takes it again: only other processes are kept out.
    """

    _held: dict[str, "OutputLock"] = {}  # realpath of the lock file -> this process's lock on it

    def __init__(self, output_dir: str | os.PathLike):
        self.path = Path(output_dir) / LOCK_FILE
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock or raise ``ValueError`` naming the run that holds it."""
        mine = OutputLock._held.pop(os.path.realpath(self.path), None)
        if mine is not None:
            mine.release()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            holder = os.pread(fd, 4096, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            if err.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                raise ValueError(f"{self.path.parent} is in use by another run ({holder}); wait for it to finish, "
                                 "stop it, or use another train.output_dir") from None
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}, started "
                      f"{time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}\n".encode(), 0)
        self._fd = fd
        OutputLock._held[os.path.realpath(self.path)] = self

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the lock; the file stays (harmless)
            self._fd = None
            if OutputLock._held.get(os.path.realpath(self.path)) is self:
                del OutputLock._held[os.path.realpath(self.path)]


def lock_output_dir(output_dir: str | os.PathLike) -> OutputLock | None:
    """Collective: rank 0 takes the output folder's lock; every rank raises the same error when it is taken."""
    lock, error = None, None
    if D.is_main():
        lock = OutputLock(output_dir)
        try:
            lock.acquire()
        except ValueError as err:
            lock, error = None, str(err)
        except OSError as err:  # e.g. a read-only folder: the same answer on every rank, not a hang
            lock, error = None, f"cannot lock {lock.path}: {err.strerror or err}"
    error = D.broadcast_object(error)
    if error is not None:
        raise ValueError(error)
    return lock
