"""Lifecycle of a run: checkpoints (model, optimizer, RNG through the engine; step, data cursor and prompt
history as the trainer's "extra"), resume, and the clean stop on SIGINT / SIGTERM / SIGUSR1 or a job-script
request (finish the step, save, exit)."""
from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from megatron_dppo import distributed as D
from megatron_dppo.config import Config
from megatron_dppo.launch import stop_requested

if TYPE_CHECKING:
    from megatron_dppo.run import Run


def save(run: Run) -> Path:
    from megatron_dppo.megatron.checkpoint import save_checkpoint

    extra = {"rl_step": run.rl_step, "sft_step": run.sft_step, "sampler": run.sampler.state_dict(),
             "history": run.history.state_dict(), "config": run.cfg.to_dict()}
    return save_checkpoint(run.engine, run.cfg.checkpoint_dir, extra, keep_last=run.cfg.checkpoint.keep_last)


def find_resume_checkpoint(cfg: Config) -> Path | None:
    """The checkpoint to resume from, per checkpoint.resume (auto | never | must)."""
    from megatron_dppo.megatron.checkpoint import latest_checkpoint

    found = latest_checkpoint(cfg.checkpoint_dir) if Path(cfg.checkpoint_dir).exists() else None
    if cfg.checkpoint.resume == "must" and found is None:
        raise ValueError(f"checkpoint.resume=must but there is no checkpoint under {cfg.checkpoint_dir}")
    if cfg.checkpoint.resume == "never" and found is not None:
        raise ValueError(f"checkpoint.resume=never but {found} exists; use another train.output_dir / "
                         "checkpoint.dir, delete it, or set checkpoint.resume=auto")
    return found


def restore(run: Run, path: Path) -> None:
    from megatron_dppo.megatron.checkpoint import load_checkpoint

    extra = load_checkpoint(run.engine, path)
    run.rl_step, run.sft_step = int(extra["rl_step"]), int(extra["sft_step"])
    run.sampler.load_state_dict(extra["sampler"])
    run.history.load_state_dict(extra["history"])
    if D.is_main():
        print(f"resumed from {path} (warm-start step {run.sft_step}, RL step {run.rl_step})", flush=True)


# ==============================================================================================================
# Clean stop on SIGINT / SIGTERM / SIGUSR1: finish the current step, save, exit
# ==============================================================================================================
class StopSignals:
    """First signal: stop after the current step with a checkpoint. A second SIGINT aborts immediately."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")

    def __init__(self):
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopSignals":
        import threading
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
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

