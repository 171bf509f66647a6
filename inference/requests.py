"""What crosses the sampler's boundary (requests in, completions out), the record of one
scheduling round in flight, and the length buckets its compiled variants are keyed by."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax


@dataclasses.dataclass
class Request:
    """One generation request; None fields fall back to the SamplerConfig defaults."""

    prompt_ids: Sequence[int]
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop_ids: Sequence[int] = ()
    id: Any = None


@dataclasses.dataclass
class Completion:
    request: Request
    tokens: list[int]
    logprobs: list[float]  # under the (temperature/top-k/top-p) distribution sampled from
    raw_logprobs: list[float]  # log_softmax of the model's logits
    versions: list[int]  # weight version that produced each generated token
    finish_reason: str = ""  # "stop" | "length"

    @property
    def token_versions(self) -> list[int]:
        """Versions over prompt + completion; prompt tokens carry -1."""
        return [-1] * len(self.request.prompt_ids) + self.versions


@dataclasses.dataclass
class Round:
    """One scheduling round's dispatched device work, read back one round later: the prefills
    of the requests it admitted and the decode calls ``(lo, rows, window)`` of its chunk."""

    version: int
    admitted: list[tuple[tuple[jax.Array, ...], list[Completion]]]  # prefill outs, completions
    calls: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    outs: list[tuple[jax.Array, ...]] = dataclasses.field(default_factory=list)
    rows: list[list[Completion | None]] = dataclasses.field(default_factory=list)  # at dispatch
    decoding: set[int] = dataclasses.field(default_factory=set)  # id() of completions in calls


def buckets_up_to(n: int, start: int) -> tuple[int, ...]:
    """2^k and 1.5 * 2^k from ``start`` below ``n``, and ``n``: at most ~1.5x padding."""
    out = {n}
    b = start
    while b < n:
        out.update(x for x in (b, b * 3 // 2) if x < n)
        b *= 2
    return tuple(sorted(out))


def bucket_for(n: int, buckets: Sequence[int]) -> int:
    """The smallest of the sorted ``buckets`` holding ``n``."""
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"length {n} exceeds the largest bucket {buckets[-1]}")
