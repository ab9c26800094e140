"""The device check's harness: the shared state of a run (``Check``), the guarded stage runner that rewrites the
JSON report after every stage, and small helpers the stages share.

A stage that takes the process down is not lost: before a stage runs, the report already records it as
``crashed`` (the process died inside it: a signal such as the time limit's, a CUDA abort, a segfault), and the
stage's result replaces that entry when it returns. SIGTERM (``timeout``) and Ctrl-C are recorded the same way,
with the signal, and stop the run."""
from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

REPORT = "gpu_check.json"
LOG_CHARS = 6000  # a device run returns only a few small files: logs are tails
DIED = ("the process ended during this stage without a Python exception (a signal such as the time limit's "
        "SIGTERM/SIGKILL, a CUDA abort, a segfault, the OOM killer); the output tail says more")


SHARED_COMPUTE_MODES = ("Default", "[N/A]", None)  # GPU compute modes that admit several processes (None: unknown)


class Stop(BaseException):
    """The run is being stopped from outside (SIGTERM from the time limit): record the stage, run nothing more."""


class Skip(Exception):
    """A stage that cannot run here (reason in the message)."""


class Check:
    """The state the stages share: ``out`` holds only the report and short logs (what comes back from a device
    run); ``work`` is the scratch folder for run folders and checkpoints (removed by ``gpu_check.main``)."""

    def __init__(self, cpu_smoke: bool, out: Path, work: Path, dtype: str | None = None):
        self.cpu_smoke = cpu_smoke
        self.out = out
        self.work = work
        self.dtype_name = dtype or ("float32" if cpu_smoke else "bfloat16")
        self.report: dict = {"stages": {}, "cpu_smoke": cpu_smoke, "dtype": self.dtype_name}
        self.peak_flops = None
        self.parallel_ready = False
        self.compute_mode = None  # the GPU's (environment stage; None on the CPU or when unknown)

    # ------------------------------------------------------------------------------------------------------
    def run(self, name: str, fn) -> bool:
        t0 = time.perf_counter()
        self.report["stages"][name] = {"status": "crashed", "error": DIED}  # replaced when the stage returns
        self.write()
        entry: dict = {}
        try:
            entry.update(fn() or {})
            entry["status"] = "pass"
        except Skip as reason:
            entry["status"], entry["reason"] = "skip", str(reason)
        except Exception as err:  # noqa: BLE001 - every failure is recorded, the next stage runs
            entry["status"], entry["error"] = "fail", f"{type(err).__name__}: {err}"
            entry["traceback"] = traceback.format_exc(limit=8)[-3000:]
        except BaseException as err:  # Stop (SIGTERM), KeyboardInterrupt, SystemExit: record, then stop the run
            entry.update(status="crashed", error=f"{type(err).__name__}: {err}",
                         traceback=traceback.format_exc(limit=8)[-3000:],
                         seconds=round(time.perf_counter() - t0, 2))
            self.report["stages"][name] = entry
            self.write()
            raise
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        self.report["stages"][name] = entry
        self.write()
        shown = {k: v for k, v in entry.items() if k not in ("traceback",)}
        print(f"[{name}] {json.dumps(shown, default=str)}", flush=True)
        if entry["status"] == "fail":
            print(entry["traceback"], flush=True)
        return entry["status"] != "fail"

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / REPORT).write_text(json.dumps(self.report, indent=1, default=str))

    def write_log(self, name: str, text: str) -> str:
        """A short log next to the report (its last ``LOG_CHARS`` characters); returns its file name."""
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / f"{name}.log"
        path.write_text(text[-LOG_CHARS:])
        return path.name

    @property
    def device(self):
        import torch

        return torch.device("cpu") if self.cpu_smoke else torch.device("cuda", torch.cuda.current_device())

    @property
    def dtype(self):
        import torch

        return getattr(torch, self.dtype_name)

    def need_parallel(self) -> None:
        if not self.parallel_ready:
            raise Skip("the dist stage did not set up the process group")

    def need_shared_gpu(self, what: str) -> None:
        """Skip a stage that runs more processes on the GPU than this one when the compute mode forbids it."""
        if self.compute_mode not in SHARED_COMPUTE_MODES:
            raise Skip(f"the GPU's compute mode is {self.compute_mode}: {what} on it next to this process; "
                       "nvidia-smi -c DEFAULT allows that")


def require(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()
