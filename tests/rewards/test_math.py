"""Math reward: hand-written cases for extraction, equivalence and false-positive traps."""

from __future__ import annotations

import pytest

from meshrl.rewards import get
from meshrl.rewards.extract import last_boxed, last_number
from meshrl.rewards.math_answer import is_equiv, to_sympy

# (completion, ground truth, expected reward)
EQUIVALENT = [
    ("\\boxed{3.1415926536}", "\\pi"),  # a decimal within a relative 1e-9 of an irrational
    ("\\boxed{46}", "46"),
    ("The answer is \\boxed{ 46 }.", "46"),
    ("\\boxed{-7}", "-7"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{1}{2}}", "0.5"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac34"),
    ("\\boxed{\\tfrac{3}{4}}", "0.75"),
    ("\\boxed{3/4}", "\\frac{3}{4}"),
    ("\\boxed{-\\frac{2}{3}}", "-2/3"),
    ("\\boxed{\\frac{-2}{3}}", "-\\frac{2}{3}"),
    ("\\boxed{1,000}", "1000"),
    ("\\boxed{1,234,567}", "1234567"),
    ("\\boxed{1000}", "1,000"),
    ("\\boxed{50\\%}", "50"),
    ("\\boxed{50}", "50\\%"),
    ("\\boxed{25%}", "25"),
    ("\\boxed{\\$18}", "18"),
    ("\\boxed{$18.00}", "18"),
    ("\\boxed{\\text{5 cm}}", "5"),
    ("\\boxed{5 \\text{ meters}}", "5"),
    ("\\boxed{12 apples}", "12"),
    ("\\boxed{9 \\mathrm{cm}^2}", "9"),
    ("\\boxed{90^\\circ}", "90"),
    ("\\boxed{90^{\\circ}}", "90"),
    ("\\boxed{x = 5}", "5"),
    ("\\boxed{5}", "x=5"),
    ("\\boxed{2.50}", "2.5"),
    ("\\boxed{.5}", "0.5"),
    ("\\boxed{3.0}", "3"),
    ("\\boxed{\\left( 1, 2 \\right)}", "(1,2)"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("\\boxed{2, -3}", "-3, 2"),
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2"),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}"),
    ("\\boxed{\\sqrt{2}/2}", "\\frac{\\sqrt{2}}{2}"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{\\sqrt2}{2}"),
    ("\\boxed{x^2+2x+1}", "(x+1)^2"),
    ("\\boxed{2(x+1)}", "2x+2"),
    ("\\boxed{(a+b)(a-b)}", "a^2-b^2"),
    ("\\boxed{10^{2}}", "100"),
    ("\\boxed{2^{10}}", "1024"),
    ("\\boxed{3 \\cdot 4}", "12"),
    ("\\boxed{6 \\times 7}", "42"),
    ("\\boxed{\\frac{\\frac{1}{2}}{2}}", "1/4"),
    ("\\boxed{\\sqrt[3]{27}}", "3"),
    ("\\boxed{\\text{B}}", "B"),
    ("\\boxed{b}", "B"),
    ("\\boxed{\\textbf{(C)}}", "(C)"),
    ("So we get 46.", "46"),
    ("so the total is 1,250 dollars", "1250"),
    ("The result: -12", "-12"),
    ("first 3 then 4 so finally 7", "7"),
    ("It costs $3.50 in total.", "3.5"),
    ("we get 3/4", "0.75"),
    ("\\fbox{12}", "12"),
    ("first \\boxed{3} then corrected: \\boxed{4}", "4"),
    ("Nested \\boxed{\\frac{1}{\\sqrt{4}}}", "1/2"),
    ("\\boxed{46}", "Adding gives 12+34=46, so the answer is $\\boxed{46}$."),
    ("\\boxed{72}", "Natalia sold 48/2 = 24 clips in May.\n#### 72"),
    ("\\boxed{\\pi}", "\\pi"),
    ("\\boxed{-0}", "0"),
    ("\\boxed{46", "46"),  # an unclosed box is no box; the last number is the answer
    ("\\boxed{5cm}", "5"),  # a known unit written against the number
    ("\\boxed{3hrs}", "3"),
    ("\\boxed{6 x y}", "6xy"),
    ("\\boxed{\u22123}", "-3"),  # the typographic minus
    ("\\boxed{(1, 234)}", "(1,234)"),  # a pair, not one thousand two hundred and thirty-four
]

NOT_EQUIVALENT = [
    ("\\boxed{47}", "46"),
    ("\\boxed{4}6", "46"),
    ("The answer is 46, no wait \\boxed{45}", "46"),
    ("\\boxed{46} is wrong; it is 47", "47"),  # the box decides, not the last number
    ("46 is the answer, double-checking gives 47", "46"),  # right number in the wrong place
    ("\\boxed{}", "46"),
    ("\\boxed{ }", "0"),
    ("no numbers here", "46"),
    ("", "46"),
    ("\\boxed{123}", "12"),
    ("\\boxed{12}", "123"),
    ("\\boxed{1}", "1/2"),
    ("\\boxed{0.33}", "1/3"),
    ("\\boxed{0.5}", "5"),
    ("\\boxed{-5}", "5"),
    ("\\boxed{5}", "-5"),
    ("\\boxed{x^2}", "x^2+1"),
    ("\\boxed{2x}", "2y"),
    ("\\boxed{(1,2)}", "[1,2]"),
    ("\\boxed{(2,1)}", "(1,2)"),
    ("\\boxed{1, 2}", "1, 2, 3"),
    ("\\boxed{2}", "2, 3"),
    ("\\boxed{\\sqrt{2}}", "1.41"),
    ("\\boxed{1000}", "100"),
    # Exact values differ however small the difference (not within an absolute tolerance).
    ("\\boxed{0}", "10^{-10}"),
    ("\\boxed{0}", "\\frac{1}{2^{40}}"),
    ("\\boxed{\\frac{1}{3^{20}}}", "\\frac{1}{3^{21}}"),
    ("\\boxed{\\frac{10^{20} + 1}{3}}", "\\frac{10^{20}}{3}"),  # within a relative 1e-9
    ("\\boxed{1,00}", "100"),
    ("\\boxed{A}", "B"),
    ("\\boxed{5 m}", "5"),  # one letter could be a variable, so it is not dropped as a unit
    ("\\boxed{6}", "6xy"),  # letters against a number are a product, not a unit
    ("\\boxed{12}", "12ab^2"),
    ("\\boxed{\u22123}", "3"),
    ("\\boxed{1234}", "(1,234)"),
    ("\\boxed{x^{1000}}", "x"),
    ("\\boxed{2^{10}}", "1000"),
    ("\\boxed{\\frac{1}{0}}", "1"),
    ("\\boxed{__import__('os')}", "0"),
]


@pytest.mark.parametrize(("completion", "answer"), EQUIVALENT)
def test_math_reward_accepts_equivalent_final_answer(completion: str, answer: str):
    assert get("math")(["q"], [completion], answer=[answer]) == [1.0]


@pytest.mark.parametrize(("completion", "answer"), NOT_EQUIVALENT)
def test_math_reward_rejects_wrong_or_misplaced_answer(completion: str, answer: str):
    assert get("math")(["q"], [completion], answer=[answer]) == [0.0]


@pytest.mark.parametrize(("text", "boxed"), [
    ("\\boxed{a{b}c}", "a{b}c"),
    ("x \\boxed{1} y \\boxed{\\frac{2}{3}}", "\\frac{2}{3}"),
    ("\\boxed {7}", "7"),
    ("no box", None),
    ("\\boxed{unclosed", None),
])
def test_last_boxed_handles_nesting_and_absence(text: str, boxed: str | None):
    assert last_boxed(text) == boxed


@pytest.mark.parametrize(("text", "number"), [
    ("a 1,234 b", "1,234"), ("costs -3.5.", "-3.5"), ("3/4 cup", "3/4"), ("none", None),
])
def test_last_number_keeps_separators_signs_and_fractions(text: str, number: str | None):
    assert last_number(text) == number


@pytest.mark.parametrize("text", [
    "__import__('os').system('true')", "open('x')", "x.__class__", "[1,2][0]", "lambda: 1",
    "x**(10**9)", "a" * 400, "sqrt(x, y)", "(1).real", "x if y else z", "'abc'", "{1: 2}",
])
def test_symbolic_parser_rejects_anything_but_small_arithmetic(text: str):
    assert to_sympy(text) is None


@pytest.mark.parametrize(("a", "b"), [("0.5", "\\frac{1}{2}"), ("1,000", "1000"),
                                      ("(x+1)^2", "x^2+2x+1"), ("46", "47"), ("2x", "2y")])
def test_is_equiv_is_symmetric(a: str, b: str):
    assert is_equiv(a, b) == is_equiv(b, a)
