"""Typed, self-documenting dataclass fields and their validation.

A field carries its doc and an optional constraint ``(text, predicate)`` in its metadata; the
``Section`` base checks types (Literal choices included) and constraints at construction, so a
bad value never gets past ``__init__``. Errors name the dotted field path, the value and the rule.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, Literal

from meshrl.utils.errors import UserError


class ConfigError(UserError, ValueError):
    """A config value breaks the schema; the message names the field, value and constraint."""


Constraint = tuple[str, Callable[[Any], bool]]


def at_least(lo: float) -> Constraint:
    return (f"must be >= {lo}", lambda v: v >= lo)


def greater_than(lo: float) -> Constraint:
    return (f"must be > {lo}", lambda v: v > lo)


def in_unit_interval() -> Constraint:
    """[0, 1): a decay rate (Adam's betas, momentum); 1 would never forget and divide 0 by 0
    in Adam's bias correction."""
    return ("must be in [0, 1)", lambda v: 0 <= v < 1)


one_of_or_fill: Constraint = ("must be >= 1, or -1 to fill with the remaining devices",
                              lambda v: v >= 1 or v == -1)


def field(default: Any, doc: str, constraint: Constraint | None = None) -> Any:
    kwargs: dict[str, Any] = {"metadata": {"doc": doc, "constraint": constraint}}
    if isinstance(default, (list, dict, set)):
        raise TypeError("mutable defaults are not allowed in the frozen schema; use a tuple")
    return dataclasses.field(default=default, **kwargs)


def closest(name: str, options: Sequence[str]) -> str:
    match = difflib.get_close_matches(name, list(options), n=1, cutoff=0.0)
    return match[0] if match else ""


def unknown_key_error(path: str, key: str, options: Sequence[str]) -> ConfigError:
    hint = closest(key, options)
    where = f"{path}.{key}" if path else key
    return ConfigError(f"unknown config key '{where}'; did you mean '{hint}'? "
                       f"(valid keys: {', '.join(sorted(options))})")


def _coerce(path: str, value: Any, tp: Any) -> Any:
    """Return ``value`` as type ``tp`` or raise ConfigError naming ``path``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{path} = {value!r}: must be one of {list(choices)}")
        return value
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(value.value if isinstance(value, enum.Enum) else value)
        except ValueError:
            raise ConfigError(f"{path} = {value!r}: must be one of "
                              f"{[m.value for m in tp]}") from None
    if origin is tuple:
        (elem, _) = typing.get_args(tp)
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{path} = {value!r}: must be a sequence of {elem.__name__}")
        return tuple(_coerce(f"{path}[{i}]", v, elem) for i, v in enumerate(value))
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{path} = {value!r}: must be a bool")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path} = {value!r}: must be an int")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{path} = {value!r}: must be a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} = {value!r}: must be a string")
        return value
    raise TypeError(f"{path}: unsupported schema type {tp!r}")


class Section:
    """Base of every config section: type and constraint checks at construction."""

    _section: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            path = f"{self._section}.{f.name}"
            value = _coerce(path, getattr(self, f.name), hints[f.name])
            object.__setattr__(self, f.name, value)
            constraint = f.metadata.get("constraint")
            if constraint is not None and not constraint[1](value):
                raise ConfigError(f"{path} = {value!r}: {constraint[0]}")
        self.validate()

    def validate(self) -> None:
        """Cross-field checks; override in sections that need them."""

    @classmethod
    def from_mapping(cls, values: dict[str, Any]) -> Section:
        names = [f.name for f in dataclasses.fields(cls)]  # type: ignore[arg-type]
        for key in values:
            if key not in names:
                raise unknown_key_error(cls._section, key, names)
        return cls(**values)


def describe_type(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(c) for c in typing.get_args(tp))
    if origin is tuple:
        return f"tuple[{typing.get_args(tp)[0].__name__}, ...]"
    if isinstance(tp, types.GenericAlias):
        return str(tp)
    return getattr(tp, "__name__", str(tp))
