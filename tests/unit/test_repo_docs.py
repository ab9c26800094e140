"""The repository owns its documentation: no tracked file cites a design note that lives outside the repository
(the old ALGORITHMS / ARCHITECTURE / FIELD notes, a shared docs folder), every ``docs/<name>.md`` a file cites
exists, and every relative link in the markdown files resolves to a file of the checkout."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# spelled in pieces so that this file does not match itself
OUTSIDE = [n + ".md" for n in ("ALGORITHMS", "ARCHITECTURE", "FIELD")] + ["shared/" + "docs"]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".sbatch", ".txt", ".ini", ".cfg", ".toml", ""}


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: cannot list the tracked files")
    files = [REPO / line for line in out.splitlines() if line]
    return [f for f in files if f.suffix in TEXT_SUFFIXES and f.is_file()]


def test_no_reference_to_documents_outside_the_repository():
    hits = []
    for path in tracked_text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for lineno, line in enumerate(text.splitlines(), 1):
            hits += [f"{path.relative_to(REPO)}:{lineno}: {name}" for name in OUTSIDE if name in line]
    assert not hits, "references to documents outside the repository:\n" + "\n".join(hits)


def test_cited_repository_docs_exist():
    cited = set()
    for path in tracked_text_files():
        cited |= set(re.findall(r"\bdocs/[\w./-]+?\.md\b", path.read_text(encoding="utf-8", errors="replace")))
    assert {"docs/algorithms.md", "docs/architecture.md"} <= cited  # the code does cite them
    missing = sorted(c for c in cited if not (REPO / c).is_file())
    assert not missing, f"cited but not in the repository: {missing}"


def test_relative_markdown_links_resolve():
    broken = []
    for path in tracked_text_files():
        if path.suffix != ".md":
            continue
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            if not (path.parent / target.split("#")[0]).exists():
                broken.append(f"{path.relative_to(REPO)}: {target}")
    assert not broken, "broken relative links:\n" + "\n".join(broken)
