"""Name -> function registries: how algorithms, losses and rewards are chosen by a config string.

A registry is a decorator (``register``) and a lookup (``get``) over one dict. Registering the
same name twice is allowed only for the same function (a module imported again); a second,
different function under a taken name is a programming error and raises ``ValueError``. An
unknown name raises ``KeyError`` with one line naming the value and every registered name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """``kind`` names what is registered in messages (``"advantage"``, ``"reward"``)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._fns: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def deco(fn: F) -> F:
            if name in self._fns and self._fns[name] is not fn:
                raise ValueError(f"{self.kind} {name!r} is already registered (to "
                                 f"{self._fns[name].__module__}.{self._fns[name].__qualname__})")
            self._fns[name] = fn
            return fn
        return deco

    def get(self, name: str, *, hint: str = "") -> F:
        """The function registered as ``name``; ``hint`` is appended to the unknown-name line."""
        if name not in self._fns:
            raise KeyError(f"unknown {self.kind} {name!r}; registered: {self.names()}{hint}")
        return self._fns[name]

    def names(self) -> list[str]:
        return sorted(self._fns)

    def __contains__(self, name: object) -> bool:
        return name in self._fns
