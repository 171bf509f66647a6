"""What crosses the sampler's boundary (requests in, completions out), the queue requests wait
in, the record of one scheduling round in flight, and the length buckets its compiled variants
are keyed by."""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import numbers
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from meshrl.configs.schema import SamplerConfig
from meshrl.inference.programs import MAX_STOP_IDS
from meshrl.inference.sampling import FILTERED, sampling_level
from meshrl.utils import multihost


@dataclasses.dataclass
class Request:
    """One generation request; None fields fall back to the SamplerConfig defaults."""

    prompt_ids: Sequence[int]
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    # The sample stream, in [0, 2**31): equal seeds draw equal samples for equal prompts, so
    # give each sample of a group its own (the default 0 is one stream for every request).
    seed: int = 0
    stop_ids: Sequence[int] = ()
    id: Any = None
    # The first min_new_tokens tokens are never a stop id (transformers' min_new_tokens): the
    # stop ids are masked out of the distribution sampled, and ``logprobs`` are under that mask.
    min_new_tokens: int = 0
    min_p: float | None = None  # keep tokens with p >= min_p * the top token's p; 0: off
    # Admitted before every queued request of a lower priority; first come, first served among
    # equals. Nothing is preempted: a running sequence keeps its slot.
    priority: int = 0


@dataclasses.dataclass
class Completion:
    request: Request
    tokens: list[int]
    logprobs: list[float]  # under the (temperature/top-k/top-p) distribution sampled from
    raw_logprobs: list[float]  # log_softmax of the model's logits
    versions: list[int]  # weight version that produced each generated token
    finish_reason: str = ""  # "stop" | "length"
    # Per token: how many tokens the distribution sampled from kept (top-k/top-p/min-p; the
    # vocabulary size without them); the RL trainer truncates its own logits to as many.
    kept: list[int] = dataclasses.field(default_factory=list)
    # Per token, with routing recorded (``Sampler(record_routing=True)``, MoE models): the
    # experts [layers, k] int32 of the forward it was sampled from (-1 in dense layers).
    routing: list[np.ndarray] = dataclasses.field(default_factory=list)

    @property
    def token_versions(self) -> list[int]:
        """Versions over prompt + completion; prompt tokens carry -1."""
        return [-1] * len(self.request.prompt_ids) + self.versions


class RequestQueue:
    """Requests waiting for a slot: ``head()`` / ``popleft()`` give the highest ``priority``,
    the earliest queued among equals."""

    def __init__(self) -> None:
        self._heap: list[tuple[int, int, Request]] = []
        self._order = itertools.count()

    def append(self, request: Request) -> None:
        # int(): a numpy integer priority (uint8, int8) would wrap around when negated.
        heapq.heappush(self._heap, (-int(request.priority), next(self._order), request))

    def head(self) -> Request:
        return self._heap[0][2]

    def popleft(self) -> Request:
        return heapq.heappop(self._heap)[2]

    def __len__(self) -> int:
        return len(self._heap)

    def remove(self, request_id: Any) -> bool:
        """Drop the waiting request with ``request_id``; False when none waits."""
        kept = [e for e in self._heap if e[2].id != request_id]
        if len(kept) == len(self._heap):
            return False
        self._heap = kept
        heapq.heapify(self._heap)
        return True


@dataclasses.dataclass
class Round:
    """One scheduling round's dispatched device work, read back one round later: the prefills
    of the requests it admitted and the decode calls ``(slots, rows, window)`` of its chunk."""

    version: int
    admitted: list[tuple[tuple[jax.Array, ...], list[Completion]]]  # prefill outs, completions
    calls: list[tuple[list[int], int, int]] = dataclasses.field(default_factory=list)
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


def token_budget(request: Request, c: SamplerConfig) -> int:
    """Most tokens ``request`` may generate: its max_new_tokens (or ``c``'s) and the cache end."""
    return min(request.max_new_tokens or c.max_new_tokens, c.max_len - len(request.prompt_ids))


def tokens_left(comp: Completion, c: SamplerConfig) -> int:
    """Tokens ``comp`` may still produce after its last known one."""
    return token_budget(comp.request, c) - len(comp.tokens)


_INT32 = 2 ** 31


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def validate_request(request: Request, c: SamplerConfig, prompt_buckets: Sequence[int]) -> None:
    """Raise ValueError for a request a sampler with ``c`` and ``prompt_buckets`` cannot serve."""
    n = len(request.prompt_ids)
    if not 1 <= n <= prompt_buckets[-1]:
        raise ValueError(f"prompt length {n}: must be in [1, {prompt_buckets[-1]}] "
                         f"(sampler.prompt_buckets = {tuple(prompt_buckets)})")
    if not _is_int(request.priority):
        raise ValueError(f"priority = {request.priority!r}: must be an integer")
    if not _is_int(request.seed) or not 0 <= request.seed < _INT32:
        # The device keys its draws by 31 bits: a larger seed would silently share a stream.
        raise ValueError(f"seed = {request.seed!r}: must be an integer in [0, 2**31)")
    if len(request.stop_ids) > MAX_STOP_IDS:
        raise ValueError(f"{len(request.stop_ids)} stop ids: at most {MAX_STOP_IDS}")
    # The device holds these as int32: a larger value would wrap, not mean "no limit".
    bad = [i for i in request.stop_ids if not _is_int(i) or not 0 <= i < _INT32]
    if bad:
        raise ValueError(f"stop_ids {bad}: each must be a token id in [0, 2**31)")
    if request.max_new_tokens is not None and not (_is_int(request.max_new_tokens)
                                                   and 1 <= request.max_new_tokens < _INT32):
        raise ValueError(f"max_new_tokens = {request.max_new_tokens!r}: must be an integer in "
                         f"[1, 2**31) (sampler.max_len caps what any request generates)")
    if not _is_int(request.min_new_tokens):
        raise ValueError(f"min_new_tokens = {request.min_new_tokens!r}: must be an integer")
    max_new = request.max_new_tokens or c.max_new_tokens
    if not 0 <= request.min_new_tokens <= max_new:
        raise ValueError(f"min_new_tokens = {request.min_new_tokens}: must be in [0, "
                         f"max_new_tokens = {max_new}]")
    _check_sampling(request)


def _check_sampling(request: Request) -> None:
    """The request's own sampling settings obey ``SamplerConfig``'s rules for its defaults: a
    program would read a negative min-p or a NaN top-p as a filter keeping one token, while
    the sampling level counts it as none (the request would be sampled greedily)."""
    t, k, p, m = request.temperature, request.top_k, request.top_p, request.min_p
    if t is not None and not 0 <= t < math.inf:
        raise ValueError(f"temperature = {t}: must be >= 0 and finite")
    if k is not None and not (_is_int(k) and 0 <= k < _INT32):
        raise ValueError(f"top_k = {k!r}: must be an integer in [0, 2**31) (>= the vocabulary "
                         f"keeps every token)")
    for name, v in (("top_p", p), ("min_p", m)):
        if v is not None and not 0 <= v <= 1:
            raise ValueError(f"{name} = {v}: must be in [0, 1]")


def _pick(r: Request | None, name: str, default: Any) -> Any:
    """``r``'s setting ``name``, ``default`` where it sets none (None: a padding row)."""
    v = getattr(r, name) if r is not None else None
    return default if v is None else v


def request_sampling(r: Request | None, c: SamplerConfig) -> int:
    """The sampling level (``sampling.sampling_level``) of ``r``'s settings, ``c``'s where it
    sets none (None: a padding row, all defaults)."""
    return sampling_level(*(_pick(r, n, getattr(c, n))
                            for n in ("temperature", "top_k", "top_p", "min_p")))


def start_sampling(c: SamplerConfig, mesh: Mesh) -> int:
    """The sampling level a sampler with ``c`` on ``mesh`` starts at: its defaults' own. Every
    process of a sampler spanning processes must run the same programs whatever its own
    requests ask for, so such a sampler starts at the highest level (and never changes)."""
    return request_sampling(None, c) if multihost.on_this_process(mesh) else FILTERED


def slot_settings(reqs: Sequence[Request | None], n: int, c: SamplerConfig
                  ) -> dict[str, np.ndarray]:
    """Per-row sampling settings of ``n`` prefill rows (padding rows get the defaults)."""
    stop_NxS = np.full((n, MAX_STOP_IDS), -1, np.int32)
    for i, r in enumerate(reqs):
        if r is not None and r.stop_ids:
            stop_NxS[i, :len(r.stop_ids)] = r.stop_ids
    rows = list(reqs) + [None] * (n - len(reqs))
    return dict(
        max_new_B=np.array([_pick(r, "max_new_tokens", c.max_new_tokens) for r in rows],
                           np.int32),
        min_new_B=np.array([r.min_new_tokens if r else 0 for r in rows], np.int32),
        stop_BxS=stop_NxS,
        temperature_B=np.array([_pick(r, "temperature", c.temperature) for r in rows],
                               np.float32),
        top_k_B=np.array([_pick(r, "top_k", c.top_k) for r in rows], np.int32),
        top_p_B=np.array([_pick(r, "top_p", c.top_p) for r in rows], np.float32),
        min_p_B=np.array([_pick(r, "min_p", c.min_p) for r in rows], np.float32),
        seed_B=np.array([r.seed if r else 0 for r in rows], np.int32))
