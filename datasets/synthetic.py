"""Synthetic verifiable tasks, generated deterministically from a seed.

Example ``i`` of stream ``s`` depends only on ``(seed, s, i)``, so the training set (stream 0) and
the held-out set (stream 1) are reproducible on every host without shipping data around.
"""

from __future__ import annotations

import numpy as np

TRAIN_STREAM, EVAL_STREAM = 0, 1

COUNTDOWN_TEMPLATE = (
    "Using the numbers {numbers}, create an equation that equals {target}. You can use "
    "+, -, * and / and each number at most once. Show your reasoning in <think> </think> and "
    "give the final equation in <answer> </answer>, for example <answer>(1 + 2) * 3</answer>.")


def _rng(seed: int, stream: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFF, stream, index])


def _operand(rng: np.random.Generator, digits: int) -> int:
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(lo, 10 ** digits))


def arithmetic_example(seed: int, stream: int, index: int, digits: int,
                       ops: tuple[str, ...] = ("+",)) -> dict:
    """``"12+34="`` -> ``"46"``; ``digits`` sets the operand width (the difficulty knob)."""
    rng = _rng(seed, stream, index)
    a, b = _operand(rng, digits), _operand(rng, digits)
    op = ops[int(rng.integers(len(ops)))]
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return {"prompt": f"{a}{op}{b}=", "answer": str(value)}


def countdown_example(seed: int, stream: int, index: int, difficulty: int) -> dict:
    """Reach ``target`` from ``difficulty + 1`` numbers; the answer is one solution using all of
    them (``+ - *`` only, so every intermediate value is a positive integer)."""
    rng = _rng(seed, stream, index)
    count = difficulty + 1
    high = min(99, 10 * difficulty)
    numbers = [int(x) for x in rng.integers(1, high + 1, size=count)]
    order = [int(i) for i in rng.permutation(count)]
    value, expr = numbers[order[0]], str(numbers[order[0]])
    for k, i in enumerate(order[1:]):
        n = numbers[i]
        op = "+-*"[int(rng.integers(3))]
        if op == "-" and value - n <= 0:
            op = "+"
        if op == "*" and value * n > 10_000:  # keep targets in a readable range
            op = "+"
        value = {"+": value + n, "-": value - n, "*": value * n}[op]
        inner = expr if k == 0 else f"({expr})"
        expr = f"{inner} {op} {n}"
    return {"prompt": COUNTDOWN_TEMPLATE.format(numbers=numbers, target=value),
            "answer": expr, "numbers": numbers, "target": value}


def generate(source: str, seed: int, stream: int, count: int, difficulty: int,
             ops: tuple[str, ...] = ("+",), start: int = 0) -> list[dict]:
    """``count`` examples of ``source`` ('arithmetic' | 'countdown') from ``start``."""
    out = []
    for i in range(start, start + count):
        if source == "arithmetic":
            ex = arithmetic_example(seed, stream, i, difficulty, ops)
        elif source == "countdown":
            ex = countdown_example(seed, stream, i, difficulty)
        else:
            raise ValueError(f"data.source = {source!r}: not a synthetic task")
        ex["origin"] = f"{source}[stream={stream}, index={i}]"
        out.append(ex)
    return out
