"""Tools a model may call: a registry of JSON-schema described tools and the one entry point,
``await tools.acall(name, arguments)``, that checks the arguments and runs the tool in the
sandbox (``rewards/sandbox.py``). Every failure (unknown tool, bad arguments, a tool that
raises, loops, floods its output or dies) comes back as a ``ToolOutput`` with ``ok=False`` and
a one-line error text for the model; nothing raises into the episode.

Built-ins: ``calculator`` (exact arithmetic, ``rewards/safe_arith.py``) and ``python`` (a
program run in a fresh sandboxed process; what it prints is the answer; standard library only).
The argument schemas follow JSON Schema for the keywords listed in ``SCHEMA_KEYWORDS``; a tool
spec uses no other, so a check here is never silently weaker than the schema a model is shown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from meshrl.rewards.sandbox import SandboxLimits, ToolOutput, ToolSandbox

SCHEMA_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties", "enum",
                             "maxLength", "minimum", "maximum", "description", "items"})
_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,),
                                       "number": (int, float), "boolean": (bool,),
                                       "object": (dict,), "array": (list,), "null": (type(None),)}


@dataclasses.dataclass(frozen=True)
class ToolSpec:
    """A tool as a model sees it (``name``, ``description``, ``parameters``: a JSON schema of
    an object) and how it runs (``fresh``: a new process per call)."""

    name: str
    description: str
    parameters: dict[str, Any]
    fresh: bool = True

    def __post_init__(self) -> None:
        bad = _unknown_keywords(self.parameters)
        if bad:
            raise ValueError(f"tool {self.name!r}: schema keywords {sorted(bad)} are not "
                             f"checked here: use only {sorted(SCHEMA_KEYWORDS)}")

    def as_openai(self) -> dict[str, Any]:
        """The ``tools=[...]`` entry chat templates render (OpenAI function format)."""
        return {"type": "function", "function": {"name": self.name,
                                                 "description": self.description,
                                                 "parameters": self.parameters}}


def _unknown_keywords(schema: Any) -> set[str]:
    if not isinstance(schema, dict):
        return set()
    bad = set(schema) - SCHEMA_KEYWORDS
    for sub in (schema.get("properties") or {}).values():
        bad |= _unknown_keywords(sub)
    return bad | _unknown_keywords(schema.get("items"))


def schema_errors(schema: dict[str, Any], value: Any, where: str = "arguments") -> list[str]:
    """What is wrong with ``value`` under ``schema`` (empty: it conforms)."""
    kind = schema.get("type")
    if kind is not None:
        ok = isinstance(value, _TYPES[kind]) and not (
            kind in ("integer", "number") and isinstance(value, bool))
        if not ok:
            return [f"{where} must be of type {kind}, got {type(value).__name__}"]
    errors: list[str] = []
    if "enum" in schema and value not in schema["enum"]:
        errors.append(f"{where} must be one of {schema['enum']}, got {value!r}")
    if "maxLength" in schema and isinstance(value, str) and len(value) > schema["maxLength"]:
        errors.append(f"{where} is longer than {schema['maxLength']} characters")
    for bound, bad in (("minimum", lambda v, b: v < b), ("maximum", lambda v, b: v > b)):
        if bound in schema and isinstance(value, (int, float)) and bad(value, schema[bound]):
            errors.append(f"{where} must be {bound} {schema[bound]}, got {value}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        errors += [f"{where} is missing {k!r}" for k in schema.get("required", ())
                   if k not in value]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(props[k], v, f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                errors.append(f"{where} has an unknown field {k!r}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errors += schema_errors(schema["items"], v, f"{where}[{i}]")
    return errors


CALCULATOR = ToolSpec(
    "calculator", "Evaluate an arithmetic expression exactly: integers, + - * / ** and "
    "parentheses.",
    {"type": "object", "properties": {"expression": {
        "type": "string", "description": "for example (12 + 7) * 3", "maxLength": 200}},
     "required": ["expression"], "additionalProperties": False}, fresh=False)

PYTHON = ToolSpec(
    "python", "Run a Python program (standard library only, no network, files only in its "
    "working directory); returns what it prints.",
    {"type": "object", "properties": {"code": {
        "type": "string", "description": "the program", "maxLength": 8000}},
     "required": ["code"], "additionalProperties": False})

BUILTIN_TOOLS: dict[str, ToolSpec] = {t.name: t for t in (CALCULATOR, PYTHON)}


class Tools:
    """The tools an episode may call, and their sandbox. Use as an async context manager or
    ``await tools.aclose()``."""

    def __init__(self, names: Sequence[str], limits: SandboxLimits = SandboxLimits()) -> None:
        unknown = [n for n in names if n not in BUILTIN_TOOLS]
        if unknown:
            raise ValueError(f"tools {unknown}: unknown; built-in tools are "
                             f"{sorted(BUILTIN_TOOLS)}")
        self.specs = {n: BUILTIN_TOOLS[n] for n in names}
        self.sandbox = ToolSandbox(limits)
        # Calls that never reach the sandbox: an unknown tool or arguments off its schema
        # (``invalid``), text that is no call (``malformed``, counted by the environment).
        self.counters = {"invalid": 0, "malformed": 0}

    async def acall(self, name: str, arguments: Any) -> ToolOutput:
        spec = self.specs.get(name)
        if spec is None:
            self.counters["invalid"] += 1
            return ToolOutput(False, f"error: unknown tool {name!r}; available: "
                                     f"{', '.join(self.specs) or 'none'}", "invalid")
        errors = schema_errors(spec.parameters, arguments)
        if errors:
            self.counters["invalid"] += 1
            return ToolOutput(False, f"error: {name}: {'; '.join(errors)}", "invalid")
        return await self.sandbox.arun(name, arguments, fresh=spec.fresh)

    def metrics(self) -> dict[str, float]:
        return self.sandbox.metrics() | {f"tools/{k}": float(v) for k, v in self.counters.items()}

    async def aclose(self) -> None:
        await self.sandbox.aclose()

    async def __aenter__(self) -> Tools:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.aclose()
