"""Fault-injection driver (tests only): run ``megatron_dppo.cli`` with SIGKILL sent to this process at a named
point of the NTH checkpoint save. Usage: ``python _kill_at.py POINT NTH train --config ...``.

Points (in the order of a save's commit, ``megatron.checkpoint._commit``):
  manifest  the shards are written, the manifest (completeness mark) is not
  aside     a checkpoint of the same step existed and was just moved aside, the new one not renamed yet
  rename    the manifest is written, the directory not yet renamed to its final name
  latest    the directory is renamed, the ``latest`` pointer not yet updated
  sigterm   not a kill: SIGTERM to this process as the save starts (a scheduler's signal during a checkpoint step)
Every save prints ``[kill_at] save N: step_XXXXXXXX``.
"""
from __future__ import annotations

import os
import signal
import sys
from pathlib import Path


def main() -> int:
    point, nth, argv = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    # the import path `python -m megatron_dppo.cli` gives: the working folder first, not this script's folder
    # (user reward modules such as tests.e2e._rewards are imported from it)
    sys.path[0] = os.getcwd()
    from megatron_dppo import cli
    from megatron_dppo.megatron import checkpoint as C

    saves = {"n": 0}
    real_save = C.save_checkpoint

    def counting_save(engine, *args, **kwargs):
        saves["n"] += 1
        print(f"[kill_at] save {saves['n']}: {C.checkpoint_name(engine.step)}", flush=True)
        if point == "sigterm" and saves["n"] == nth:  # a scheduler's SIGTERM arriving during this save
            os.kill(os.getpid(), signal.SIGTERM)
        return real_save(engine, *args, **kwargs)

    def die():
        if saves["n"] == nth:
            print(f"[kill_at] SIGKILL at {point} of save {nth}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    C.save_checkpoint = counting_save
    import megatron_dppo.run.lifecycle  # noqa: F401 - imports save_checkpoint lazily from the module: patched above

    if point == "manifest":
        real = C.write_manifest
        C.write_manifest = lambda *a, **k: (die(), real(*a, **k))[1]
    elif point == "latest":
        real = C._write_latest
        C._write_latest = lambda *a, **k: (die(), real(*a, **k))[1]
    elif point in ("rename", "aside"):
        real_rename = Path.rename

        def rename(self, target):
            moving_tmp = self.name.startswith(".tmp-step_") and not Path(target).name.startswith(".tmp")
            if point == "rename" and moving_tmp:
                die()
            result = real_rename(self, target)
            if point == "aside" and Path(target).name.startswith(".tmp-old-"):
                die()
            return result

        Path.rename = rename
    elif point != "sigterm":
        raise SystemExit(f"unknown point {point!r}")
    return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
