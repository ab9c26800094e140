"""Tool calls written as tags in the assistant's text: ``<calc>12*34</calc>``, ``<python>print(1)</python>``.

Tags are the format a small model learns from a handful of traces, and they need no JSON. The content between an
opening and the next closing tag is one call; an opening tag without its closing tag (a turn cut mid-call) is no
call. Calls are returned in order of appearance.
"""
from __future__ import annotations

import re


def find_calls(text: str, tag: str) -> list[str]:
    """The contents of every ``<tag>...</tag>`` in ``text`` (stripped of surrounding whitespace)."""
    if not re.fullmatch(r"[A-Za-z_][\w-]*", tag):
        raise ValueError(f"tool tag {tag!r} must be a plain name (letters, digits, '_', '-')")
    pattern = re.compile(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", re.DOTALL)
    return [m.group(1).strip() for m in pattern.finditer(text)]
