"""Held-out evaluation of a policy through the sampler the rollouts use: greedy accuracy and
the greedy completions' mean verifier score (temperature 0, one completion per prompt) and, when ``n > 1``, pass@1 and pass@k from ``n``
sampled completions per prompt (the unbiased estimator of Chen et al. 2021). A completion is
correct when the verifier, the first reward of ``reward.names``, scores it > 0.5. Every
generated token must come from the version being evaluated: a mismatch is an error, never a
silently mixed number."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from meshrl.inference.sampler import Completion, Request
from meshrl.utils.aio import gather_or_cancel
from meshrl.workflows.episode import reward_fields


class EvalVersionError(RuntimeError):
    """An evaluation completion carries tokens of a weight version other than the one evaluated."""


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``c`` correct of ``n`` samples: 1 - C(n - c, k) / C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def check_versions(outs: Sequence[Completion], version: int) -> None:
    bad = sorted({v for o in outs for v in o.versions if v != version})
    if bad:
        raise EvalVersionError(f"evaluation of version {version} got tokens of versions {bad}; "
                               f"weights changed during evaluation")


async def _scores(reward_pool: Any, examples: Sequence[dict], outs: Sequence[Completion],
                  decode: Any, per_example: int) -> np.ndarray:
    """Verifier scores ``[len(examples), per_example]`` (correct: > 0.5). Examples are scored in
    one call per set of reward fields: rows may carry optional fields the others lack, and a
    reward sees each row's own fields, as in the rollouts."""
    items = [ex for ex in examples for _ in range(per_example)]
    completions = [decode(o.tokens) for o in outs]
    by_keys: dict[tuple[str, ...], list[int]] = {}
    for i, ex in enumerate(items):
        by_keys.setdefault(tuple(sorted(reward_fields(ex))), []).append(i)
    scores = np.zeros(len(items), np.float64)
    for keys, rows in by_keys.items():
        comps = await asyncio.to_thread(
            reward_pool.score_components, [items[i]["prompt"] for i in rows],
            [completions[i] for i in rows], **{k: [items[i][k] for i in rows] for k in keys})
        scores[rows] = np.asarray(comps[reward_pool.names[0]], np.float64)
    return scores.reshape(len(examples), per_example)


async def aevaluate(engine: Any, reward_pool: Any, examples: Sequence[dict], *, version: int,
                    decode: Any, stop_ids: tuple[int, ...], max_new_tokens: int, n: int = 1,
                    temperature: float = 1.0, seed: int = 0) -> dict[str, float]:
    """Greedy accuracy (and pass@1 / pass@n from ``n`` samples when ``n > 1``) on ``examples``
    at the engine's current weights, which must be ``version`` throughout."""
    if not examples:
        return {}
    if engine.version != version:
        raise EvalVersionError(f"engine holds version {engine.version}, evaluating {version}")

    def request(ex: dict, i: int, temp: float) -> Request:
        return Request(list(ex["prompt_ids"]), max_new_tokens=max_new_tokens, temperature=temp,
                       stop_ids=stop_ids, seed=(seed * 1_000_003 + i) & 0x7FFFFFFF,
                       id=("eval", i))

    greedy = await gather_or_cancel(*(engine.agenerate(request(ex, i, 0.0))
                                    for i, ex in enumerate(examples)))
    check_versions(greedy, version)
    scores = await _scores(reward_pool, examples, greedy, decode, 1)
    out = {"eval/greedy_accuracy": float((scores > 0.5).mean()),
           "eval/reward_mean": float(scores.mean()), "eval/examples": float(len(examples)),
           "eval/completion_len": float(np.mean([len(o.tokens) for o in greedy]))}
    if n > 1:
        sampled = await gather_or_cancel(*(
            engine.agenerate(request(ex, i * n + j, temperature))
            for i, ex in enumerate(examples) for j in range(n)))
        check_versions(sampled, version)
        c = await _scores(reward_pool, examples, sampled, decode, n) > 0.5
        counts = c.sum(-1)
        out["eval/pass_at_1"] = float(np.mean([pass_at_k(n, int(x), 1) for x in counts]))
        out[f"eval/pass_at_{n}"] = float(np.mean([pass_at_k(n, int(x), n) for x in counts]))
    return out
