"""Compile and render a model directory's chat template in a bounded jinja2 sandbox.

A chat template is code from a downloaded model directory. jinja2's immutable sandbox already
keeps it from reaching Python internals or mutating its inputs; this module also bounds the work
a template can make the data pipeline do:

* integers: a ``**`` or ``*`` whose result would exceed ``MAX_INT_BITS`` bits (``7**(10**6)``,
  or squaring in a loop) raises instead of computing;
* strings and sequences: ``*``, ``+`` and ``~`` results, and the rendered output, are capped at
  ``MAX_TEMPLATE_CHARS`` (``'a'*10**7``, doubling in a loop); so are integer arguments to calls
  and filters (``''.ljust(10**9)``, ``center(10**9)``) and widths in format strings
  (``'%999999999d'``), which would allocate before any result could be checked.

Over-budget templates raise ``jinja2.sandbox.SecurityError``. Loops that build nothing are not
bounded here (the sandbox caps each ``range`` at 100,000 items). The environment options match
transformers', so templates within budget render exactly as they do there.
"""

from __future__ import annotations

import datetime
import functools
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

# A rendered prompt, or any string or sequence a template builds, in characters (items): far
# above any real chat prompt (about a million tokens), far below what stalls the pipeline.
MAX_TEMPLATE_CHARS = 4_000_000
MAX_INT_BITS = 4096  # a template computes token counts and indices, never large numbers

_DIGITS = re.compile(r"\d+")


def _check_length(n: int) -> None:
    if n > MAX_TEMPLATE_CHARS:
        raise SecurityError(f"chat template builds a value of {n} items, over "
                            f"MAX_TEMPLATE_CHARS = {MAX_TEMPLATE_CHARS}")


def _check_size(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple)):
        _check_length(len(value))
    return value


def _check_int(n: Any, what: str) -> None:
    if isinstance(n, int) and abs(n) > MAX_TEMPLATE_CHARS:
        raise SecurityError(f"chat template passes {what} = {n}, over MAX_TEMPLATE_CHARS = "
                            f"{MAX_TEMPLATE_CHARS}")


def _check_format(spec: Any) -> None:
    """Refuse a format string whose widths or precisions would allocate too much."""
    if isinstance(spec, str):
        for digits in _DIGITS.findall(spec):
            if len(digits) > len(str(MAX_TEMPLATE_CHARS)) or int(digits) > MAX_TEMPLATE_CHARS:
                raise SecurityError(f"chat template format string has a width {digits}, over "
                                    f"MAX_TEMPLATE_CHARS = {MAX_TEMPLATE_CHARS}")


def _check_args(args: Iterable[Any], kwargs: dict[str, Any]) -> None:
    for value in [*args, *kwargs.values()]:
        if not isinstance(value, bool):
            _check_int(value, "an argument")


def _int_bits(left: Any, right: Any, op: str) -> int:
    """Bits of ``left op right`` for two ints (0 when not both ints)."""
    if not (isinstance(left, int) and isinstance(right, int)):
        return 0
    if op == "**":
        return 0 if right <= 0 or abs(left) <= 1 else left.bit_length() * right
    return left.bit_length() + right.bit_length()


def _bounded_filter(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    # A filter marked pass_context (or environment, eval_context) gets that first, then its value.
    value_at = 0 if getattr(fn, "jinja_pass_arg", None) is None else 1

    @functools.wraps(fn)  # keeps the pass_* marker, which jinja2 reads off the function
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        _check_args(args[value_at + 1:], kwargs)
        if name == "format" and len(args) > value_at:
            _check_format(args[value_at])
        return _check_size(fn(*args, **kwargs))
    return wrapper


class _BoundedCodeGenerator(CodeGenerator):
    """``a ~ b`` compiles to a join jinja2 does not let a sandbox intercept; wrap it."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        self.write("environment.checked_size(")
        super().visit_Concat(node, frame)
        self.write(")")


class BoundedSandbox(ImmutableSandboxedEnvironment):
    """``ImmutableSandboxedEnvironment`` with the bounds in the module docstring."""

    code_generator_class = _BoundedCodeGenerator
    intercepted_binops = frozenset({"**", "*", "+", "%"})

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.filters = {name: _bounded_filter(fn, name) for name, fn in self.filters.items()}

    @staticmethod
    def checked_size(value: Any) -> Any:
        return _check_size(value)

    def call_binop(self, context: Any, op: str, left: Any, right: Any) -> Any:
        if (bits := _int_bits(left, right, op)) > MAX_INT_BITS:
            raise SecurityError(f"chat template computes an integer {op} of about {bits} bits, "
                                f"over MAX_INT_BITS = {MAX_INT_BITS}")
        if op == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    _check_length(len(seq) * n)
        if op == "%" and isinstance(left, str):
            _check_format(left)
        return _check_size(self.binop_table[op](left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _check_args(args, kwargs)
        return _check_size(super().call(__context, __obj, *args, **kwargs))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is not None:
            _check_format(value.__self__)
        return wrapped


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class _Generation(Extension):
    """``{% generation %}...{% endgeneration %}``, which transformers' templates use to mark the
    assistant's tokens: rendered as its body (the loss mask is built here otherwise)."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Callable[[], str]) -> str:
        return caller()


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    # Llama 3.x templates date their system header with it, as transformers renders them.
    return datetime.datetime.now().strftime(fmt)


def compile_template(source: str) -> Any:
    """A ``jinja2.Template`` for ``source`` in the bounded sandbox, with transformers'
    extensions, filters and globals (the generation tag, ``tojson``, ``strftime_now``,
    ``raise_exception``)."""
    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = _bounded_filter(_tojson, "tojson")
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render(template: Any, **variables: Any) -> str:
    """Render ``template``, stopping once the output passes ``MAX_TEMPLATE_CHARS``;
    ``tools`` and ``documents`` are None unless given, as transformers passes them."""
    parts, size = [], 0
    for chunk in template.generate(**{"tools": None, "documents": None, **variables}):
        size += len(chunk)
        if size > MAX_TEMPLATE_CHARS:
            raise SecurityError(f"chat template output passes MAX_TEMPLATE_CHARS = "
                                f"{MAX_TEMPLATE_CHARS} characters")
        parts.append(chunk)
    return "".join(parts)


__all__ = ["MAX_INT_BITS", "MAX_TEMPLATE_CHARS", "BoundedSandbox", "compile_template", "render"]
