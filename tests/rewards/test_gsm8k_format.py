"""GSM8K and format rewards: hand-written cases including false-positive traps."""

from __future__ import annotations

import pytest

from meshrl.rewards import get, names

GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nShe sold 48+24 = <<48+24=72>>72.\n#### 72"
GOLD_BIG = "She earns 1,000 + 250 = 1,250 dollars.\n#### 1,250"

GSM8K_CASES = [
    ("She sold 72 clips in total.\n#### 72", GOLD, 1.0),
    ("#### 72", GOLD, 1.0),
    ("####72", GOLD, 1.0),
    ("#### $72", GOLD, 1.0),
    ("#### 72.00", GOLD, 1.0),
    ("#### 72 clips", GOLD, 1.0),
    ("The answer is \\boxed{72}.", GOLD, 1.0),
    ("48 + 24 = 72", GOLD, 1.0),
    ("so 72", "72", 1.0),
    ("#### 1250", GOLD_BIG, 1.0),
    ("#### 1,250", GOLD_BIG, 1.0),
    ("total 1,250 dollars", GOLD_BIG, 1.0),
    ("#### -3", "#### -3", 1.0),
    ("#### 0.5", "#### .5", 1.0),
    ("first #### 70 then corrected\n#### 72", GOLD, 1.0),
    ("#### 72\nI double-checked: 48 + 24 = 72", GOLD, 1.0),
    # Markdown headings mark no answer: the box, else the last number, decides.
    ("#### Step 1: Clips in May\n48/2 = 24\n#### Step 2: Total\n\\boxed{72}", GOLD, 1.0),
    ("#### Solution\n48 + 24 = 72\n#### Final Answer\nShe sold 72 clips.", GOLD, 1.0),
    ("#### \u22123", "#### -3", 1.0),  # the typographic minus
    # Traps: the right number somewhere, but not as the final answer.
    ("#### 24", GOLD, 0.0),
    ("72 clips? No: #### 70", GOLD, 0.0),
    ("48/2 = 24, 48 + 24 = 72, minus 2 is 70", GOLD, 0.0),
    ("\\boxed{70} (72 was my first guess)", GOLD, 0.0),
    ("#### 720", GOLD, 0.0),
    ("#### 7", GOLD, 0.0),
    ("#### 72.5", GOLD, 0.0),
    ("#### -72", GOLD, 0.0),
    ("", GOLD, 0.0),
    ("I don't know", GOLD, 0.0),
    ("#### 125", GOLD_BIG, 0.0),
    ("#### 1,25", GOLD_BIG, 0.0),
    ("#### 12,500", GOLD_BIG, 0.0),
    ("#### 3", "#### -3", 0.0),
    ("#### \u22123", "#### 3", 0.0),
    ("#### Step 2: 72 clips\nso the total is 70", GOLD, 0.0),
    ("\\boxed{}", GOLD, 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "expected"), GSM8K_CASES)
def test_gsm8k_reward_scores_final_answer_only(completion: str, answer: str, expected: float):
    assert get("gsm8k")(["q"], [completion], answer=[answer]) == [expected]


FORMAT_CASES = [
    ("<think>12+34 is 46</think><answer>46</answer>", 1.0),
    ("<think>\nstep one\nstep two\n</think>\n<answer>\n46\n</answer>\n", 1.0),
    ("  <think>a</think> <answer>b</answer>  ", 1.0),
    ("<think>a < b and c > d</think><answer>x</answer>", 1.0),
    ("<think>multi\n\nline</think><answer>(1 + 2) * 3</answer>", 1.0),
    ("<answer>46</answer>", 0.0),
    ("<think>a</think>", 0.0),
    ("<think></think><answer>46</answer>", 0.0),
    ("<think>a</think><answer></answer>", 0.0),
    ("<think>a</think><answer>  </answer>", 0.0),
    ("<think>a</think>stray<answer>b</answer>", 0.0),
    ("<think>a</think><answer>b</answer> trailing text", 0.0),
    ("preamble <think>a</think><answer>b</answer>", 0.0),
    ("<think>a</think><answer>b</answer><answer>c</answer>", 0.0),
    ("<think>a<think>b</think><answer>c</answer>", 0.0),
    ("<answer>b</answer><think>a</think>", 0.0),
    ("<think>a</think><answer>b", 0.0),
    ("<THINK>a</THINK><ANSWER>b</ANSWER>", 0.0),
]


@pytest.mark.parametrize(("completion", "expected"), FORMAT_CASES)
def test_format_reward_checks_the_default_template(completion: str, expected: float):
    assert get("format")(["q"], [completion]) == [expected]


@pytest.mark.parametrize(("completion", "expected"), [
    ("Reasoning here. #### 42", 1.0),
    ("#### 42", 0.0),
    ("Reasoning here.", 0.0),
])
def test_format_reward_follows_a_configured_template(completion: str, expected: float):
    assert get("format")(["q"], [completion], format_template=["... #### ..."]) == [expected]


def test_a_long_run_of_blanks_in_a_slot_scores_within_the_pool_timeout(make_pool):
    # A backtracking slot took seconds on this (quadratic in the run's length): a timeout, 0.
    pool = make_pool(["format"], timeout_s=2.0, num_workers=1)
    completion = "<think>a" + " " * 64_000 + "b</think><answer>5</answer>"

    assert pool.score(["p"], [completion]) == [1.0]
    assert pool.counters["timeouts"] == 0


def test_builtin_rewards_are_registered_and_unknown_names_fail():
    assert {"math", "gsm8k", "countdown", "format"} <= set(names())
    with pytest.raises(KeyError, match="unknown reward"):
        get("nope")
    assert get("meshrl.tests.rewards.helpers:returns_nan")(["p"], ["c"])[0] != 0.0
