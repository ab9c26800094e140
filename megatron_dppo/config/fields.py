"""The two helpers every config section is written with: ``opt`` (a field with its documentation) and ``_check``
(a range or choice check whose error names the key, the bad value and what would be valid). In a module of their
own so that sections defined outside ``config.py`` (``config_dapo.py``) use them without an import circle."""
from __future__ import annotations

from dataclasses import field
from typing import Any


def opt(default: Any, help: str) -> Any:  # noqa: A002 - "help" reads best at the call sites
    """A dataclass field with its documentation attached (``metadata["help"]``)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help})
    return field(default=default, metadata={"help": help})


def _check(ok: bool, key: str, value: Any, valid: str) -> None:
    if not ok:
        raise ValueError(f"{key}={value!r} is invalid: expected {valid}")
