"""Parse the tool calls in one model turn's text.

Two formats, chosen by name (``PARSERS``):

* ``hermes`` (Hermes, Qwen2.5/Qwen3): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (a ``</tool_call>`` inside a JSON
  string does not close it); the text around the calls is the turn's content.
* ``llama3`` (Llama 3.1-3.3 JSON tool calling): the turn, optionally after ``<|python_tag|>``,
  is one JSON object ``{"name": ..., "parameters": {...}}`` or several separated by ``;``; a turn
  that does not start with ``{`` (after the tag) is plain content. Llama 3.2's pythonic form
  ``[fn(a=1, b="x"), ...]`` is accepted too, literal arguments only (never evaluated); other
  bracketed text (``[2, 5)``, ``[1, 2]``) is content.

A call that cannot be parsed (bad JSON, no name, arguments not an object, an unclosed tag) is
not dropped: it becomes a ``ToolCallError`` the episode answers with an error observation, so
the model is told what it got wrong and the episode goes on.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
from collections.abc import Callable
from typing import Any

MAX_CALLS_PER_TURN = 8  # more are errors: a turn cannot fan out without bound


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCallError:
    """A call the model tried to make and got wrong; ``message`` says how."""

    message: str
    raw: str


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    content: str  # the turn's text less its calls
    calls: tuple[ToolCall | ToolCallError, ...]


def _call_from_json(raw: str, args_key: str) -> ToolCall | ToolCallError:
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as e:
        return ToolCallError(f"not valid JSON ({e.msg} at character {e.pos})", raw)
    except RecursionError:  # model text nested past the parser's depth
        return ToolCallError("not valid JSON (nested too deep)", raw)
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCallError('a call must be a JSON object with a string "name"', raw)
    args = obj.get(args_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models emit the arguments as a JSON string
        try:
            args = json.loads(args)
        except (json.JSONDecodeError, RecursionError):
            pass
    if not isinstance(args, dict):
        return ToolCallError(f'"{args_key}" must be a JSON object', raw)
    return ToolCall(obj["name"], args)


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def _hermes_close(text: str, body_start: int) -> int:
    """Where the call opened at ``body_start`` closes (-1: never): after its JSON when the
    body reads as JSON up to a ``</tool_call>`` (a string in it may hold one), else the first
    ``</tool_call>``."""
    offset = len(text) - len(text[body_start:].lstrip())
    try:
        _, end = json.JSONDecoder().raw_decode(text, offset)
    except (ValueError, RecursionError):
        return text.find(_CLOSE, body_start)
    after = len(text) - len(text[end:].lstrip())
    return after if text.startswith(_CLOSE, after) else text.find(_CLOSE, body_start)


def parse_hermes(text: str) -> ParsedTurn:
    calls: list[ToolCall | ToolCallError] = []
    content, pos = [], 0
    while (start := text.find(_OPEN, pos)) >= 0:
        content.append(text[pos:start])
        close = _hermes_close(text, start + len(_OPEN))
        if close < 0:
            calls.append(ToolCallError(f"{_OPEN} is not closed by {_CLOSE}", text[start:]))
            pos = len(text)
            break
        calls.append(_call_from_json(text[start + len(_OPEN):close].strip(), "arguments"))
        pos = close + len(_CLOSE)
    content.append(text[pos:])
    return ParsedTurn("".join(content).strip(), tuple(_capped(calls)))


_PYTHON_TAG = "<|python_tag|>"
# A pythonic call list opens with ``[name(``: other bracketed text (an interval ``[2, 5)``, a
# list answer) is content, as in vLLM's pythonic parser.
_PYTHONIC_START = re.compile(r"\[\s*[A-Za-z_]\w*\(")


def _split_json_objects(text: str) -> list[str]:
    """``{...}; {...}`` -> the objects' texts (braces inside strings do not count)."""
    parts, depth, start, in_str, esc = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
            continue
        if ch == '"':
            in_str = True
        elif ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                parts.append(text[start:i + 1].strip().lstrip(";").strip())
                start = i + 1
    tail = text[start:].strip().lstrip(";").strip()
    return parts + ([tail] if tail else [])


def _unparse(node: ast.AST) -> str:
    try:
        return ast.unparse(node)[:200]
    except RecursionError:
        return "(nested too deep)"


def _pythonic(text: str) -> list[ToolCall | ToolCallError]:
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as e:
        return [ToolCallError(f"not a list of calls ({e.msg})", text)]
    except (RecursionError, MemoryError, ValueError):  # nested too deep; a NUL byte
        return [ToolCallError("not a list of calls (cannot be parsed)", text[:200])]
    items = tree.body.elts if isinstance(tree.body, ast.List) else [tree.body]
    calls: list[ToolCall | ToolCallError] = []
    for item in items:
        if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Name) and not item.args):
            calls.append(ToolCallError("each call must be name(key=value, ...)",
                                       _unparse(item)))
            continue
        names = [k.arg for k in item.keywords]
        if None in names or len(set(names)) < len(names):
            calls.append(ToolCallError("arguments must be distinct key=value pairs (no **)",
                                       _unparse(item)))
            continue
        try:
            args = {k.arg: ast.literal_eval(k.value) for k in item.keywords}
        except (ValueError, TypeError, RecursionError, MemoryError):  # {[1]: 2}: unhashable
            calls.append(ToolCallError("arguments must be literals", _unparse(item)))
            continue
        calls.append(ToolCall(item.func.id, args))
    return calls


def parse_llama3(text: str) -> ParsedTurn:
    body = text.strip()
    tagged = body.startswith(_PYTHON_TAG)
    body = body[len(_PYTHON_TAG):].strip() if tagged else body
    if body.startswith("{"):
        return ParsedTurn("", tuple(_capped([_call_from_json(p, "parameters")
                                             for p in _split_json_objects(body)])))
    if _PYTHONIC_START.match(body) and body.endswith("]"):
        return ParsedTurn("", tuple(_capped(_pythonic(body))))
    if tagged:
        return ParsedTurn("", (ToolCallError("<|python_tag|> must be followed by a JSON call",
                                             body),))
    return ParsedTurn(text.strip(), ())


def _capped(calls: list[ToolCall | ToolCallError]) -> list[ToolCall | ToolCallError]:
    if len(calls) <= MAX_CALLS_PER_TURN:
        return calls
    return calls[:MAX_CALLS_PER_TURN] + [ToolCallError(
        f"at most {MAX_CALLS_PER_TURN} tool calls per turn; the rest were not run", "")]


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes,
                                                   "llama3": parse_llama3}


def get_parser(name: str) -> Callable[[str], ParsedTurn]:
    if name not in PARSERS:
        raise ValueError(f"tool-call format {name!r}: unknown; known: {sorted(PARSERS)}")
    return PARSERS[name]
