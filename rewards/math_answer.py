"""Math reward: the completion's final answer equals the ground truth.

Range {0.0, 1.0}. The final answer is the last ``\\boxed{...}`` (nested braces allowed; an empty
box scores 0), else the last number, in the completion's last ``extract.MAX_ANSWER_CHARS``
characters. The ground truth (``answer`` field) may be a bare answer, a MATH solution (its last
``\\boxed{}`` is used) or a GSM8K solution (text after ``####``). Equivalence, in order:
normalised strings; exact numbers (integers, decimals, fractions, ``\\frac``/``\\dfrac``,
percentages, thousands separators, ``\\text{}``, ``$``, units, negatives); tuples element-wise;
then symbolic equality of small expressions with sympy, built by a whitelisting ``ast`` walk
(model text is never evaluated), bounded in length and nodes.

Work is bounded whatever the model writes: only the completion's tail is parsed, every regex
here is linear, and the sympy build keeps a budget over the whole expression tree: the total
degree (``((x+y)^{12})^{12}`` is degree 144 though each exponent is small), the monomials its
expansion can have, and the bits of exact numbers, each checked before a power is taken.
"""

from __future__ import annotations

import ast
import itertools
import math
import re
from fractions import Fraction
from typing import Any

from meshrl.rewards.extract import answer_tail, last_boxed, last_number, score_final_answers
from meshrl.rewards.registry import register

MAX_CHARS = 300
MAX_NODES = 200
MAX_EXPONENT = 100  # per power, symbol-free base
MAX_SYMBOLIC_EXPONENT = 12  # per power, symbolic base
# Budgets over the whole tree (sympy.expand of the largest allowed case takes well under 1 s):
MAX_DEGREE = 24  # total degree; pi and irrational roots count as variables
MAX_MONOMIALS = 1000  # C(degree + variables, variables): the terms an expansion can have
MAX_BITS = 65536  # numerator/denominator bits of an exact number, checked before a power

_TEXT_CMD = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mbox|operatorname)\s*"
                       r"\{([^{}]*)\}")
# A unit is a word of 2+ letters after a space ("5 cm", "12 apples"), or a known unit written
# against the number ("5cm"): letters written against a number may be variables ("6xy" is a
# product, "2x" too). Two letters, then any letters: "{2,}" followed by a class that also takes
# letters would backtrack quadratically on a long letter run that ends in a non-match.
_ATTACHED_UNITS = ("mm|cm|dm|km|mg|kg|lbs?|oz|ft|yd|mi|ml|mL|hrs?|mins?|secs?|mph|kph|am|pm|"
                   "cents|dollars|days|hours|minutes|seconds|weeks|months|years|meters|miles")
_UNITS = re.compile(r"^([-+]?[\d.,/]*\d)(?:\s+[a-zA-Z]{2}|(?:" + _ATTACHED_UNITS
                    + r")(?![a-zA-Z]))[a-zA-Z.\s]*(?:\^\{?[23]\}?)?$")
# A tuple or interval: commas between its numbers separate elements, not thousands.
_BRACKETED = re.compile(r"^[(\[].*[)\]]$")
_NUM = re.compile(r"^[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?$")


def normalize(text: str) -> str:
    """Canonical string for an answer; only surface notation is removed, never content."""
    s = text.strip().replace("\u2212", "-")
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle"):
        s = s.replace(token, "")
    s = s.replace("\\$", "").replace("$", "").replace("\\ ", " ").replace("~", " ")
    for _ in range(3):  # \text{} may nest inside \textbf{}
        s = _TEXT_CMD.sub(r"\1", s)
    for token in ("^{\\circ}", "^\\circ", "°", "\\%", "%", "\\degree"):
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"\\frac\s*(\d)\s*(\d)", r"\\frac{\1}{\2}", s)  # \frac12
    s = re.sub(r"^[a-zA-Z]\s*=\s*(?!.*=)", "", s.strip())  # "x = 5" -> "5"
    if not _BRACKETED.match(s):
        s = re.sub(r"\b\d{1,3}(?:,\d{3})+(?![\d])", lambda m: m.group().replace(",", ""), s)
    s = s.strip().rstrip(".").strip()
    unit = _UNITS.match(s)
    if unit:
        s = unit.group(1).rstrip(".")
    if s.startswith("{") and s.endswith("}") and _balanced(s[1:-1]):
        s = s[1:-1]
    return re.sub(r"\s+", "", s)


def _balanced(s: str) -> bool:
    depth = 0
    for ch in s:
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth < 0:
            return False
    return depth == 0


def to_number(s: str) -> Fraction | None:
    """Exact value of a plain number, ``a/b``, ``\\frac{a}{b}`` or ``-\\frac{a}{b}``."""
    m = re.fullmatch(r"([-+]?)\\frac\{([-+]?\d+(?:\.\d+)?)\}\{([-+]?\d+(?:\.\d+)?)\}", s)
    if m:
        den = Fraction(m.group(3))
        if den == 0:
            return None
        value = Fraction(m.group(2)) / den
        return -value if m.group(1) == "-" else value
    if _NUM.match(s):
        num, _, den = s.partition("/")
        if num.endswith("."):
            num = num[:-1]
        if den and int(den) == 0:
            return None
        return Fraction(num) / (Fraction(den) if den else 1)
    return None


def _brace_group(s: str, i: int) -> tuple[str, int]:
    """The ``{...}`` group (or single character) at ``s[i]``; returns (content, next index)."""
    while i < len(s) and s[i] == " ":
        i += 1
    if i >= len(s):
        raise ValueError("missing argument")
    if s[i] != "{":
        return s[i], i + 1
    depth = 0
    for j in range(i, len(s)):
        depth += {"{": 1, "}": -1}.get(s[j], 0)
        if depth == 0:
            return s[i + 1:j], j + 1
    raise ValueError("unbalanced braces")


def latex_to_python(s: str) -> str:
    """Rewrite a small LaTeX expression into Python syntax (text only; nothing runs)."""
    out, i = [], 0
    while i < len(s):
        if s.startswith("\\frac", i):
            num, i = _brace_group(s, i + 5)
            den, i = _brace_group(s, i)
            out.append(f"(({latex_to_python(num)})/({latex_to_python(den)}))")
        elif s.startswith("\\sqrt", i):
            i += 5
            root = None
            if i < len(s) and s[i] == "[":
                end = s.index("]", i)
                root, i = s[i + 1:end], end + 1
            arg, i = _brace_group(s, i)
            arg = latex_to_python(arg)
            out.append(f"sqrt({arg})" if root is None else
                       f"(({arg})**(1/({latex_to_python(root)})))")
        else:
            out.append(s[i])
            i += 1
    text = "".join(out)
    for latex, py in (("\\cdot", "*"), ("\\times", "*"), ("\\div", "/"), ("\\pi", " pi "),
                      ("^", "**"), ("{", "("), ("}", ")")):
        text = text.replace(latex, py)
    if "\\" in text:
        raise ValueError("unsupported LaTeX command")
    # Implicit multiplication: 2x, 2(x+1), (a)(b), x y -> explicit *.
    tokens = re.findall(r"\d+\.?\d*|\.\d+|[A-Za-z]+|\*\*|\S", text)
    joined: list[str] = []
    for tok in tokens:
        if joined and (re.match(r"[\w.)]", joined[-1][-1]) and joined[-1] != "sqrt"
                       and (re.match(r"[\w(.]", tok[0]))):
            joined.append("*")
        joined.append(tok)
    return " ".join(joined)


class _OverBudgetError(ValueError):
    """The expression is outside the work budget (see the module docstring)."""


def _check_budget(degree: float, variables: int) -> float:
    if degree > MAX_DEGREE or math.comb(math.ceil(degree) + variables, variables) > MAX_MONOMIALS:
        raise _OverBudgetError(f"degree {degree} in {variables} variables")
    return degree


def _bits(value: Any) -> int:
    """Bits of an exact rational's numerator or denominator (0 for anything else)."""
    if not value.is_Rational:
        return 0
    return max(int(value.p).bit_length(), int(value.q).bit_length())


def _variables(tree: ast.AST) -> int:
    """Distinct variables an expansion can see: names, plus one for pi and irrational roots."""
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    return len(names - {"pi", "sqrt"}) + bool(names & {"pi", "sqrt"})


def _build(node: ast.AST, variables: int) -> tuple[Any, float]:
    """(sympy value, total degree) of a whitelisted node; raises ValueError otherwise."""
    import sympy

    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return sympy.Rational(str(node.value)), 0.0
    if isinstance(node, ast.Name):
        if node.id == "pi":
            return sympy.pi, 1.0
        if len(node.id) == 1:
            return sympy.Symbol(node.id), 1.0
        raise ValueError(f"name {node.id!r}")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value, degree = _build(node.operand, variables)
        return (-value if isinstance(node.op, ast.USub) else value), degree
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "sqrt" and len(node.args) == 1 and not node.keywords):
        arg, degree = _build(node.args[0], variables)
        value = sympy.sqrt(arg)
        return value, 0.0 if value.is_Rational else max(degree / 2, 1.0)
    if isinstance(node, ast.BinOp):
        (left, dl), (right, dr) = _build(node.left, variables), _build(node.right, variables)
        if isinstance(node.op, ast.Add):
            return left + right, max(dl, dr)
        if isinstance(node.op, ast.Sub):
            return left - right, max(dl, dr)
        if isinstance(node.op, ast.Mult):
            return left * right, _check_budget(dl + dr, variables)
        if isinstance(node.op, ast.Div):
            return left / right, _check_budget(dl + dr, variables)
        if isinstance(node.op, ast.Pow):
            return _power(left, dl, right, variables)
    raise ValueError(type(node).__name__)


def _power(base: Any, degree: float, exponent: Any, variables: int) -> tuple[Any, float]:
    """``base ** exponent`` for a small numeric exponent, within the tree's budgets."""
    # x**(10**9) would stall expansion, and even (a+b+c)**100 expands to thousands of terms,
    # so symbolic bases get a smaller per-power cap; the budgets bound nested powers.
    limit = MAX_SYMBOLIC_EXPONENT if base.free_symbols else MAX_EXPONENT
    if not exponent.is_number or abs(exponent) > limit:
        raise ValueError("exponent")
    size = float(abs(exponent))
    if _bits(base) * size > MAX_BITS:
        raise _OverBudgetError("number too large")
    return base ** exponent, _check_budget(degree * size, variables)


def to_sympy(s: str) -> Any:
    """A sympy expression for ``s`` built by walking a whitelisted syntax tree, or None."""
    if len(s) > MAX_CHARS:
        return None
    try:
        tree = ast.parse(latex_to_python(s), mode="eval")
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        return None
    try:
        return _build(tree.body, _variables(tree))[0]
    except (ValueError, TypeError, ZeroDivisionError, RecursionError):
        return None


def _symbolic_equal(a: str, b: str) -> bool:
    import sympy

    x, y = to_sympy(a), to_sympy(b)
    if x is None or y is None:
        return False
    try:
        diff = sympy.expand(x - y)
        if diff == 0:
            return True
        if not diff.free_symbols:
            if diff.is_Rational:  # exact, and not 0: 1/3^20 is not 1/3^21, 0 is not 10^-10
                return False
            # Irrational or decimal: equal to a relative 1e-9 (3.1415926536 is pi).
            value = complex(sympy.N(diff, 30))
            scale = max(abs(complex(sympy.N(x, 30))), abs(complex(sympy.N(y, 30))))
            return abs(value) <= 1e-9 * scale
        return sympy.count_ops(diff) < 60 and sympy.simplify(diff) == 0
    except (TypeError, ValueError, ZeroDivisionError, OverflowError):
        return False


def _split_top_level(s: str) -> list[str]:
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    parts.append(s[start:])
    return parts


def _unwrap(s: str) -> str:
    """``s`` without one outer pair of () or [] brackets enclosing all of it."""
    if len(s) >= 2 and s[0] in "([" and s[-1] in ")]":
        depth = 0
        for i, ch in enumerate(s):
            depth += 1 if ch in "([" else -1 if ch in ")]" else 0
            if depth == 0 and i < len(s) - 1:
                return s
        return s[1:-1]
    return s


def is_equiv(pred: str, gold: str) -> bool:
    """Whether two final answers are the same value (see the module docstring)."""
    p, g = normalize(pred), normalize(gold)
    if not p or not g:
        return False
    if p == g or p.lower() == g.lower():
        return True
    pn, gn = to_number(p), to_number(g)
    if pn is not None and gn is not None:
        return pn == gn
    p_parts, g_parts = _split_top_level(_unwrap(p)), _split_top_level(_unwrap(g))
    if len(g_parts) > 1 or len(p_parts) > 1:
        if len(p_parts) != len(g_parts) or len(g_parts) > 6:
            return False
        if _unwrap(p) != p or _unwrap(g) != g:
            # Tuples and intervals are ordered and their brackets matter: (1,2) is not [1,2].
            return (p[0], p[-1]) == (g[0], g[-1]) and all(
                is_equiv(a, b) for a, b in zip(p_parts, g_parts))
        # A bare list of solutions ("2, -3") is unordered. Each pair is compared once (36
        # comparisons at most), not once per permutation (up to 720 x 6 sympy calls).
        same = [[is_equiv(a, b) for b in g_parts] for a in p_parts]
        return any(all(same[i][j] for j, i in enumerate(perm))
                   for perm in itertools.permutations(range(len(p_parts))))
    return _symbolic_equal(p, g)


def gold_answer(answer: str) -> str:
    """The final answer inside a ground-truth field (MATH solution, GSM8K solution or bare)."""
    boxed = last_boxed(answer)
    if boxed is not None:
        return boxed
    if "####" in answer:
        return answer.rsplit("####", 1)[1].strip()
    return answer


def final_answer(completion: str) -> str | None:
    tail = answer_tail(completion)
    boxed = last_boxed(tail)
    return boxed if boxed is not None else last_number(tail)


@register("math", answer_format="\\boxed{ANSWER} (else the last number), equivalent to the "
                                "answer field")
def math_reward(prompts: list[str], completions: list[str], *, answer: list[str],
                **_: Any) -> list[float]:
    return score_final_answers(completions, answer, final_answer, gold_answer, is_equiv)
