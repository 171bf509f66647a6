"""Reward registry: ``register(name)`` decorates a reward, ``get(name)`` resolves it.

A reward is ``fn(prompts: list[str], completions: list[str], **fields) -> list[float]`` where
every field is a list aligned with ``completions`` (e.g. ``answer=[...]``). Rewards must accept
and ignore unknown fields, because examples carry every column of their source row.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from meshrl.utils.registry import Registry

RewardFn = Callable[..., list[float]]

_REWARDS: Registry[RewardFn] = Registry("reward")
_FORMATS: dict[str, str] = {}


def register(name: str, answer_format: str = "") -> Callable[[RewardFn], RewardFn]:
    """``answer_format``: what a completion must look like to score, in a few words; a run
    whose groups all score alike names it (``answer_format``)."""
    def deco(fn: RewardFn) -> RewardFn:
        _REWARDS.register(name)(fn)
        _FORMATS[name] = answer_format
        return fn
    return deco


def answer_format(name: str) -> str:
    """The answer format ``name`` parses: its registered description, else the function's
    ``answer_format`` attribute or first docstring line (``module:function`` rewards)."""
    if _FORMATS.get(name):
        return _FORMATS[name]
    try:
        fn = get(name)
    except (KeyError, ImportError):
        return "unknown"
    text = getattr(fn, "answer_format", "") or (fn.__doc__ or "").strip().split("\n")[0]
    return text or "not described (add an answer_format to its registration)"


def get(name: str) -> RewardFn:
    """A registered name, or ``"package.module:function"`` for rewards outside meshrl.rewards
    (the module is imported, in the reward worker too; config names only, never model text)."""
    if ":" in name:
        module, _, attr = name.partition(":")
        fn = getattr(importlib.import_module(module), attr, None)
        if not callable(fn):
            raise KeyError(f"reward {name!r}: {module} has no callable {attr!r}")
        return fn
    return _REWARDS.get(name, hint=" (or use 'package.module:function')")


def names() -> list[str]:
    return _REWARDS.names()
