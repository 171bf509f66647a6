"""A deterministic scripted engine, reward pool and environment for workflow tests.

The behaviour under test is the workflow and the staleness control, not the sampler, so the
engine only has to honour the ``SamplerClient`` protocol: real ``Request``/``Completion`` types, tokens
yielded over awaited latencies, and the weight version current when each token was produced.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, Sequence
from typing import Any

from meshrl.inference.sampler import Completion, Request
from meshrl.workflows import EnvStep


def decode(ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + t % 26) for t in ids)


class FakeEngine:
    """Token i of sample s is ``10 + s + i``; logprob under the sampled distribution
    ``-0.1 * (i + 1)`` (raw logprob 0.5 lower); version = the engine's
    version when the token is produced. ``tail_s(request)`` adds latency after the last token
    (a slow reply generated entirely at the old version)."""

    def __init__(self, *, tokens: int = 3, token_s: float = 0.0005, jitter_seed: int | None = None,
                 tail_s: Callable[[Request], float] | None = None) -> None:
        self.version = 0
        self.tokens, self.token_s, self.tail_s = tokens, token_s, tail_s
        self.rng = random.Random(jitter_seed) if jitter_seed is not None else None
        self.requests: list[Request] = []

    async def agenerate(self, request: Request) -> Completion:
        self.requests.append(request)
        _, sample, _ = request.id
        n = self.tokens if request.max_new_tokens is None else min(self.tokens,
                                                                  request.max_new_tokens)
        toks, lps, vers = [], [], []
        for i in range(n):
            delay = self.token_s * (self.rng.uniform(0.2, 3.0) if self.rng else 1.0)
            await asyncio.sleep(delay)
            toks.append(10 + sample + i)
            lps.append(-0.1 * (i + 1))
            vers.append(self.version)
        if self.tail_s is not None:
            await asyncio.sleep(self.tail_s(request))
        # The raw logprobs differ from the sampled ones, so recording the wrong field shows.
        return Completion(request, toks, lps, [x - 0.5 for x in lps], vers, "length")


class FakeRewards:
    """reward = 1.0 if the completion starts with the letter of ``item['answer']`` (sample 0
    starts with 'k', sample 1 with 'l', ...); records the fields it was given."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    async def ascore(self, prompts: Sequence[str], completions: Sequence[str],
                     **fields: Sequence[Any]) -> list[float]:
        await asyncio.sleep(0)
        self.calls.append({"prompts": list(prompts), "completions": list(completions), **fields})
        return [1.0 if c[:1] == a else 0.0
                for c, a in zip(completions, fields["answer"], strict=True)]


class ScriptedEnv:
    """Feedback ``[90 + turn, 91 + turn]`` after each turn; done after ``done_after`` turns with
    reward ``reward`` (None: let the reward pool score)."""

    def __init__(self, done_after: int, reward: float | None = 2.0, reject: bool = False) -> None:
        self.done_after, self.reward, self.reject = done_after, reward, reject
        self.seen: list[tuple[str, int]] = []

    async def astep(self, item: dict, completion_text: str, turn: int) -> EnvStep:
        await asyncio.sleep(0)
        self.seen.append((completion_text, turn))
        done = turn + 1 >= self.done_after
        return EnvStep(feedback_ids=[90 + turn, 91 + turn], done=done,
                       reward=self.reward if done else None, reject=self.reject)


def prompts(n: int, answer: str = "k") -> list[dict]:
    return [{"prompt": f"q{i}", "prompt_ids": [1, 2 + i % 3], "answer": answer, "id": i}
            for i in range(n)]
