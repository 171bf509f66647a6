"""The sweep vocabulary, as XManager's ``hyper`` module spells it: ``sweep``, ``fixed``,
``product`` and ``zipit`` build the trials of a sweep as a list of override dicts.

  hyper.product([hyper.sweep("trainer.learning_rate", [1e-3, 3e-4]),
                 hyper.zipit([hyper.sweep("trainer.seed", [0, 1]),
                              hyper.sweep("sampler.temperature", [0.7, 1.0])])])

``product`` and ``zipit`` take the axes as one list (XManager, big_vision, scenic) or one
argument each. A key is ``section.field``; ``config.section.field``, the form big_vision and
scenic sweep files use, means the same key. Every mistake raises ``SweepError`` with the rule.
"""

from __future__ import annotations

import builtins
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

Overrides = dict[str, Any]
_PREFIX = "config."  # big_vision / scenic keys name the --config flag too


class SweepError(ValueError):
    """A sweep file, or one of its trials, that cannot run; the message names the file."""


def sweep(name: str, values: Sequence[Any]) -> list[Overrides]:
    """``[{name: v} for v in values]``: one axis of a sweep (``name`` is ``section.field``)."""
    if not isinstance(name, str) or "." not in name:
        raise SweepError(f"sweep({name!r}, ...): the name must be a 'section.field' string")
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise SweepError(f"sweep({name!r}, {values!r:.60}): values must be a non-empty list")
    return [{key_name(name): v} for v in values]


def key_name(name: str) -> str:
    """``section.field`` for ``config.section.field`` (the form that names the flag too)."""
    if name.startswith(_PREFIX) and "." in name[len(_PREFIX):]:
        return name[len(_PREFIX):]
    return name


def fixed(name: str, value: Any) -> list[Overrides]:
    """An axis of one value: ``product([fixed("trainer.steps", 2), ...])`` sets it everywhere."""
    return sweep(name, [value])


def _axes(how: str, args: tuple[Any, ...]) -> list[list[Overrides]]:
    """The axes of ``product``/``zipit``: ``f([a, b])`` (one list of axes) or ``f(a, b)``."""
    # One list holding no dict is the list of axes; an axis is a list of dicts.
    if len(args) == 1 and isinstance(args[0], (list, tuple)) and not any(
            isinstance(a, Mapping) for a in args[0]):
        args = tuple(args[0])
    for i, axis in enumerate(args):
        if not isinstance(axis, (list, tuple)) or not all(isinstance(d, Mapping) for d in axis):
            raise SweepError(f"{how}: axis {i} = {axis!r:.60}: each axis must be a list of "
                             f"dicts as sweep() returns; pass the axes as one list, "
                             f"{how}([sweep(...), sweep(...)])")
    return [list(axis) for axis in args]


def _merge(parts: Sequence[Mapping[str, Any]], how: str) -> Overrides:
    out: Overrides = {}
    for part in parts:
        twice = sorted(set(out) & set(part))
        if twice:
            raise SweepError(f"{how}: key {twice[0]!r} appears in more than one axis")
        out.update(part)
    return out


def product(*axes: Any) -> list[Overrides]:
    """Every combination of one dict from each axis (the first axis varies slowest)."""
    return [_merge(combo, "product") for combo in itertools.product(*_axes("product", axes))]


def zipit(*axes: Any) -> list[Overrides]:
    """The i-th dicts of all axes merged; the axes must have one length."""
    lists = _axes("zipit", axes)
    lengths = [len(a) for a in lists]
    if len(set(lengths)) > 1:
        raise SweepError(f"zipit: the axes have different lengths {lengths}")
    return [_merge(parts, "zipit") for parts in builtins.zip(*lists)]


zip = zipit  # shadows the builtin: the name sweep files used before ``zipit``
