"""A tiny name -> function registry, so that a new advantage estimator, policy loss or KL estimator is one function
(and a new pruning rule one class: ``pruner.PRUNERS``).

    ESTIMATORS = Registry("advantage estimator")

    @ESTIMATORS.register("my_estimator")
    def my_estimator(rewards, eps): ...

    ESTIMATORS.get("my_estimator")        # the function
    ESTIMATORS.get("typo")                # ValueError: unknown advantage estimator 'typo'; valid: ...
"""

from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Named functions (or classes) of one kind. Lookups of unknown names raise ValueError listing the valid names."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, F] = {}

    def register(self, name: str, *, overwrite: bool = False) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; re-registering a name is an error unless ``overwrite``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: F) -> F:
            if name in self._entries and not overwrite:
                raise ValueError(f"{self.kind} {name!r} is already registered; pass overwrite=True to replace it")
            self._entries[name] = fn
            return fn

        return decorator

    def unregister(self, name: str) -> None:
        """Remove ``name`` (used by tests that register temporary entries)."""
        self.check(name)
        del self._entries[name]

    def check(self, name: str) -> str:
        """Return ``name`` if registered, else raise ValueError naming it and the valid names."""
        if name not in self._entries:
            raise ValueError(f"unknown {self.kind} {name!r}; valid: {', '.join(sorted(self._entries))}")
        return name

    def get(self, name: str) -> F:
        return self._entries[self.check(name)]

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {self.names()})"
