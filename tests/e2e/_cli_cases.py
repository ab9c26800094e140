"""Run several ``megatron-dppo`` command lines in ONE process (they fail early, so the import cost is paid once).

    python tests/e2e/_cli_cases.py cases.json results.json
cases.json: {"name": ["train", "--config", ...], ...}; results.json: {"name": {"rc": int, "stderr": str}}.
"""
import contextlib
import io
import json
import sys


def main(cases_path: str, results_path: str) -> None:
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[2]))  # reward import paths
    from megatron_dppo import cli

    results = {}
    for name, argv in json.load(open(cases_path)).items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = cli.main(argv)
            except SystemExit as exit_:
                rc = exit_.code
            except Exception as exc:  # noqa: BLE001 - a crash is a test failure, reported with its type
                rc, err = -1, io.StringIO(f"UNCAUGHT {type(exc).__name__}: {exc}")
        results[name] = {"rc": rc, "stderr": err.getvalue()}
    json.dump(results, open(results_path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
