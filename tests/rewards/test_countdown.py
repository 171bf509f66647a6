"""Countdown reward and its safe arithmetic parser (hand-written cases + property tests)."""

from __future__ import annotations

import sys
import time
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from meshrl.datasets.synthetic import countdown_example
from meshrl.rewards import get
from meshrl.rewards.safe_arith import UnsafeExpressionError, evaluate

NUMS, TARGET = [3, 5, 2, 7], 16


def _wrap(equation: str) -> str:
    return f"<think>let me try</think><answer>{equation}</answer>"


CASES = [
    ("(3 + 5) * 2", 1.0),
    ("(5 + 3) * 2", 1.0),
    ("2 * (3 + 5)", 1.0),
    ("(3+5)*2", 1.0),
    ("3 * 7 - 5", 1.0),
    ("7 * 2 + 5 - 3", 1.0),
    ("(7 - 5) * (3 + 5)", 0.0),  # 5 used twice
    ("(3 + 5) * 2 = 16", 1.0),
    ("(7 + 5 + 2 + 3) - 1", 0.0),  # 1 is not a given number
    ("7 * 2 + 2", 0.0),  # 2 used twice
    ("16", 0.0),  # not a given number
    ("3 + 5 + 2 + 7", 0.0),  # = 17
    ("(3 + 5) * 2 = 17", 0.0),  # wrong claimed result
    ("(3 + 5) * 2 = 15", 0.0),
    ("(3 + 5) / 2 * 4", 0.0),  # 4 not given
    ("7 / 2 * 5 - 3 + 2", 0.0),  # 16.5
    ("(7 * 5 - 3) / 2", 1.0),  # exact division: 32 / 2
    ("7 * (5 - 3) + 2", 1.0),
    ("3 ** 2 + 7", 0.0),  # ** is not allowed in countdown
    ("2 ^ 3 + 7 + 3 - 2", 0.0),
    ("3 + 5 *", 0.0),
    ("", 0.0),
    ("(3 + 5) × 2", 1.0),
    ("3.0 * 5 + 1", 0.0),
    ("__import__('os').system('true')", 0.0),
    ("[3, 5][0] * 2 + 10", 0.0),
    ("sum([3, 5, 2, 7]) - 1", 0.0),
    ("True + 15", 0.0),
    ("(3 + 5) * 2 / 0", 0.0),
    ("-3 + 7 * 2 + 5", 1.0),
]


@pytest.mark.parametrize(("equation", "expected"), CASES)
def test_countdown_scores_equation_in_answer_tag(equation: str, expected: float):
    reward = get("countdown")(["q"], [_wrap(equation)], numbers=[NUMS], target=[TARGET])
    assert reward == [expected]


@pytest.mark.parametrize(("completion", "expected"), [
    ("(3 + 5) * 2", 0.0),  # no answer tag
    ("<answer>(3 + 5) * 2</answer> but really <answer>3 + 5</answer>", 0.0),  # last tag counts
    ("<answer>3 + 5</answer> fixed: <answer>(3 + 5) * 2</answer>", 1.0),
    ("<answer>(3 + 5) * 2", 0.0),  # unclosed tag
    ("<think>(3 + 5) * 2 = 16</think>", 0.0),  # right equation in the wrong place
    ("<answer>\n(3 + 5) * 2\n</answer>", 1.0),
])
def test_countdown_uses_only_the_last_answer_tag(completion: str, expected: float):
    assert get("countdown")(["q"], [completion], numbers=[NUMS], target=[TARGET]) == [expected]


@pytest.mark.parametrize("equation", ["(3 + 5) * 2", "(3 + 5) * 2 = 16"])
def test_countdown_reads_string_fields_from_files_as_numbers(equation: str):
    reward = get("countdown")(["q"], [_wrap(equation)], numbers=[[str(n) for n in NUMS]],
                              target=[str(TARGET)])
    assert reward == [1.0]


def test_countdown_accepts_the_generated_solution_of_synthetic_examples():
    examples = [countdown_example(0, 0, i, difficulty=3) for i in range(50)]
    rewards = get("countdown")(["q"] * 50, [_wrap(ex["answer"]) for ex in examples],
                               numbers=[ex["numbers"] for ex in examples],
                               target=[ex["target"] for ex in examples])
    assert rewards == [1.0] * 50


@pytest.mark.parametrize("text", ["9**9**9", "9**99", "10**1000", "2**(2**(2**(2**2)))",
                                  "99999999**16*99999999**16", "(" * 200 + "1" + ")" * 200])
def test_safe_arith_rejects_huge_powers_quickly(text: str):
    start = time.monotonic()
    with pytest.raises(UnsafeExpressionError):
        evaluate(text, allow_pow=True)
    assert time.monotonic() - start < 0.1


def test_safe_arith_small_powers_are_exact():
    assert evaluate("2**10 - 3/4", allow_pow=True) == (Fraction(4093, 4), [2, 10, 3, 4])


_ATOMS = st.sampled_from(["9", "99", "0", "-1", "x", "__import__('os')", "open", "()", "[]",
                          "'s'", "1.5", "True", "lambda: 0", "print", "exec", "eval", "a.b"])
_OPS = st.sampled_from(["+", "-", "*", "/", "**", "%", "//", "(", ")", ",", ".", " ", "=",
                        "<<", "@", "[", "]", ":", ";", "\n"])
_EXPRS = st.lists(st.one_of(_ATOMS, _OPS), max_size=40).map("".join)


class _ExecWatch:
    """Records 'exec'-type audit events (code objects run, imports, processes, files)."""

    events: list[str] = []
    active = False
    installed = False

    @classmethod
    def hook(cls, event: str, args: tuple) -> None:
        if cls.active and event in ("exec", "import", "open", "os.system", "subprocess.Popen",
                                    "builtins.input"):
            cls.events.append(event)


@pytest.fixture(scope="module")
def exec_watch() -> type[_ExecWatch]:
    if not _ExecWatch.installed:  # audit hooks cannot be removed; the hook is inert when idle
        sys.addaudithook(_ExecWatch.hook)
        _ExecWatch.installed = True
    _ExecWatch.active = True
    exec("1 + 1")  # the watch must see real execution, or the property below proves nothing
    _ExecWatch.active = False
    assert "exec" in _ExecWatch.events
    _ExecWatch.events.clear()
    return _ExecWatch


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(text=st.one_of(_EXPRS, st.text(max_size=60)))
def test_safe_arith_never_executes_text_and_returns_quickly(exec_watch, text: str):
    exec_watch.events.clear()
    exec_watch.active = True
    start = time.monotonic()
    try:
        value, literals = evaluate(text, allow_pow=True)
    except UnsafeExpressionError:
        value = None
    finally:
        exec_watch.active = False
    assert time.monotonic() - start < 0.5
    assert exec_watch.events == []
    if value is not None:
        assert isinstance(value, Fraction) and all(type(n) is int for n in literals)
        assert max(value.numerator.bit_length(), value.denominator.bit_length()) <= 256


@settings(max_examples=100, deadline=None)
@given(base=st.integers(2, 10**6), exp=st.integers(17, 10**9))
def test_safe_arith_rejects_every_large_exponent(base: int, exp: int):
    with pytest.raises(UnsafeExpressionError):
        evaluate(f"{base}**{exp}", allow_pow=True)
