"""Model text built to burn reward workers' time is scored well within the per-pair timeout, in
real worker processes: nested powers, long letter runs after a number, and thousands of
unbalanced boxes or answer tags."""

from __future__ import annotations

import time

import pytest

from meshrl.rewards import RewardPool

H = "meshrl.tests.rewards.helpers:"
TIMEOUT_S = 20.0  # a pair that needs this long has gone quadratic (or worse)

HOSTILE = [
    # The per-power cap allows 12 at each level; the degree is 12^4 = 20,736.
    ("math", "\\boxed{((((x+y)^{12})^{12})^{12})^{12}}", "x"),
    ("math", "\\boxed{((((x+y)**12)**12)**12)**12}", "x"),
    ("math", "\\boxed{" + "(a+b+c+d)" * 30 + "}", "x"),  # degree 30 by multiplication
    ("math", "\\boxed{(((2^{100})^{100})^{100})^{100}}", "2"),  # 10^8-bit integer
    ("math", "\\boxed{((1+\\sqrt{2})^{100})^{100}}", "2"),
    ("math", "\\boxed{x+1, x+2, x+3, x+4, x+5, x+7}", "x+6, x+5, x+4, x+3, x+2, x+1"),
    ("math", "\\boxed{" * 300_000, "5"),
    ("gsm8k", "\\boxed{" * 300_000, "5"),
    ("countdown", "<answer>" * 300_000, ""),
    # Parsers run on the whole text, not the reward's tail: linear whatever the length.
    (H + "normalizes", "5 " + "a" * 200_000 + "1", ""),
    (H + "extracts_boxed", "\\boxed{" * 300_000, ""),
]


@pytest.fixture(scope="module")
def pools():
    made: dict[str, RewardPool] = {}

    def get(name: str) -> RewardPool:
        if name not in made:
            made[name] = RewardPool([name], timeout_s=TIMEOUT_S, num_workers=1)
            fields = {"numbers": [[1]], "target": [1]} if name == "countdown" else {}
            made[name].score(["p"], ["1"], answer=["1"], **fields)  # start the worker
        return made[name]

    yield get
    for pool in made.values():
        pool.close()


@pytest.mark.parametrize(("reward", "completion", "answer"), HOSTILE,
                         ids=[f"{r.split(':')[-1]}-{i}" for i, (r, _, _) in enumerate(HOSTILE)])
def test_hostile_completion_is_scored_zero_well_within_the_timeout(pools, reward: str,
                                                                   completion: str, answer: str):
    pool = pools(reward)
    fields = {"numbers": [[1, 2]], "target": [3]} if reward == "countdown" else {}
    before = dict(pool.counters)
    start = time.monotonic()
    rewards = pool.score(["p"], [completion], answer=[answer], **fields)
    elapsed = time.monotonic() - start
    assert pool.counters["timeouts"] == before["timeouts"]
    assert pool.counters["errors"] == before["errors"]
    assert elapsed < TIMEOUT_S / 4, elapsed
    expected = 1.0 if reward.endswith("normalizes") else 0.0
    assert rewards == [expected]


def test_answer_at_the_end_of_a_very_long_completion_is_still_found():
    from meshrl.rewards import get

    completion = "filler " * 100_000 + "so the answer is \\boxed{42}"
    assert get("math")(["q"], [completion], answer=["42"]) == [1.0]
    assert get("countdown")(["q"], ["x" * 500_000 + "<answer>1+2</answer>"], numbers=[[1, 2]],
                            target=[3]) == [1.0]
