"""A trainer stand-in for the hostile-code tests: calls the sandbox once and prints the result as JSON.

Usage: python _sandbox_caller.py ISOLATION CODE_FILE [JSON keyword arguments of run_python]
Runs in its own process so that code which kills its parent kills this process, not the test run. Imports only
the standard library and megatron_dppo.env.sandbox (also under a system interpreter, as an unprivileged user).
"""
import dataclasses
import json
import sys

from megatron_dppo.env.sandbox import run_python

with open(sys.argv[2], encoding="utf-8") as f:
    code = f.read()
kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
result = run_python(code, isolation=sys.argv[1], **kwargs)
print(json.dumps(dataclasses.asdict(result)), flush=True)
