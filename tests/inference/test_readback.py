"""Host-side bookkeeping of read-back outputs and token budgets (no device work)."""

from __future__ import annotations

import numpy as np

from meshrl.configs.schema import SamplerConfig
from meshrl.inference import programs, readback
from meshrl.inference.requests import Completion, Request, token_budget, tokens_left


def _comp(prompt_len: int = 3, max_new: int | None = 6) -> Completion:
    return Completion(Request(list(range(3, 3 + prompt_len)), max_new_tokens=max_new),
                      [-1], [0.0], [0.0], [0])


def test_chunk_tokens_appends_each_rows_prefix_and_skips_empty_and_finished_rows():
    live, done, stopped = _comp(), _comp(), _comp()
    done.finish_reason = "length"
    tok_BxC = np.array([[7, 8, -1], [9, 9, 9], [5, -1, -1], [4, 4, 4]], np.int32)
    lp_BxC = np.full((4, 3), -0.5, np.float32)

    finished = readback.chunk_tokens(
        [live, done, stopped, None], 3, tok_BxC, lp_BxC, lp_BxC - 1,
        np.array([True, True, False, True]), np.array([0, 0, programs.STOP, 0]))

    assert finished == [stopped] and stopped.finish_reason == "stop"
    assert live.tokens == [-1, 7, 8] and live.versions == [0, 3, 3]
    assert live.raw_logprobs == [0.0, -1.5, -1.5] and not live.finish_reason
    assert done.tokens == [-1] and stopped.tokens == [-1, 5]


def test_first_tokens_replaces_the_placeholder_and_finishes_rows_ended_by_length():
    a, b = _comp(), _comp(max_new=1)

    finished = readback.first_tokens([a, b], np.array([11, 12]), np.array([-0.1, -0.2]),
                                      np.array([-1.1, -1.2]), np.array([True, False]),
                                      np.array([0, programs.LENGTH]))

    assert finished == [b] and b.finish_reason == "length"
    assert (a.tokens, b.tokens) == ([11], [12])
    np.testing.assert_allclose(a.logprobs + b.raw_logprobs, [-0.1, -1.2], rtol=0, atol=1e-6)


def test_token_budget_is_capped_by_the_cache_end_and_tokens_left_counts_down():
    cfg = SamplerConfig(max_len=16, max_new_tokens=8, prompt_buckets=(8, 12))
    assert token_budget(Request([5] * 4), cfg) == 8  # the sampler default
    assert token_budget(Request([5] * 12, max_new_tokens=8), cfg) == 4  # 12 + 4 fill 16
    c = _comp(prompt_len=12, max_new=8)
    c.tokens += [6, 6]
    assert tokens_left(c, cfg) == 1
