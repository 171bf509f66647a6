"""Refilling a slot freed by a stop id while requests wait: the decode chunk ends at the stop,
never before a sequence the host counts as ending by length has ended."""

from __future__ import annotations

import numpy as np

from meshrl.inference import readback
from meshrl.inference.sampler import Request
from meshrl.inference.schedule import refill_batch
from meshrl.tests.inference.tiny import make_sampler, reference_greedy

PROMPTS = [[40, 41, 42, 43, 44, 45, 46], [1, 2, 3], [7, 8, 61], [88, 12, 19, 30]]


def _tokens_per_call(monkeypatch) -> list[dict[int, int]]:
    """Per decode call read back: tokens each request (by id) got in it."""
    calls: list[dict[int, int]] = []
    chunk_tokens = readback.chunk_tokens

    def counting(comps, version, tok_BxC, *rest):
        calls.append({c.request.id: int((tok_BxC[r] >= 0).sum())
                      for r, c in enumerate(comps) if c is not None})
        return chunk_tokens(comps, version, tok_BxC, *rest)
    monkeypatch.setattr(readback, "chunk_tokens", counting)
    return calls


def _assert_solo(params, requests, outs) -> None:
    solo = make_sampler(params, slots=1, decode_chunk=8)
    for r, out in zip(requests, outs, strict=True):
        alone = solo.generate([r])[0]
        assert out.tokens == alone.tokens and out.finish_reason == alone.finish_reason
        np.testing.assert_allclose(out.raw_logprobs, alone.raw_logprobs, rtol=1e-4, atol=1e-5)


def test_stop_while_a_request_waits_ends_the_chunk_at_that_step(tiny_params, monkeypatch):
    # Slot 0 stops on its 2nd token (1st of the chunk); the long request in slot 1 gets only
    # that one step's token in the chunk, and the waiting request takes slot 0.
    graphdef, params = tiny_params
    first_two, _ = reference_greedy(graphdef, params, PROMPTS[0], 2)
    requests = [Request(PROMPTS[0], max_new_tokens=20, stop_ids=(first_two[1],), id="stop"),
                Request(PROMPTS[1], max_new_tokens=20, id="long"),
                Request(PROMPTS[2], max_new_tokens=20, id="waits")]
    calls = _tokens_per_call(monkeypatch)
    sampler = make_sampler(params, slots=2, decode_chunk=8, max_new_tokens=20)

    outs = sampler.generate(requests, longest_first=False)

    assert calls[0] == {"stop": 1, "long": 1}
    assert outs[0].finish_reason == "stop" and len(outs[0].tokens) == 2
    _assert_solo(params, requests, outs)


def test_no_early_end_before_a_sequence_reaches_its_length_limit_in_the_chunk(
        tiny_params, monkeypatch):
    # One slot stops on its 2nd token, another reaches its 5-token limit at step 4 of the
    # chunk: the chunk runs those 4 steps (the host refills the length-limited slot as certain
    # to end there), then ends, with a request still waiting.
    graphdef, params = tiny_params
    first_two, _ = reference_greedy(graphdef, params, PROMPTS[0], 2)
    requests = [Request(PROMPTS[0], max_new_tokens=20, stop_ids=(first_two[1],), id="stop"),
                Request(PROMPTS[1], max_new_tokens=5, id="limit"),
                Request(PROMPTS[2], max_new_tokens=20, id="long"),
                Request(PROMPTS[3], max_new_tokens=20, id="waits")]
    calls = _tokens_per_call(monkeypatch)
    sampler = make_sampler(params, slots=3, decode_chunk=8, max_new_tokens=20)

    outs = sampler.generate(requests, longest_first=False)

    assert calls[0] == {"stop": 1, "limit": 4, "long": 4}
    assert [len(o.tokens) for o in outs[:2]] == [2, 5]
    _assert_solo(params, requests, outs)


def test_without_waiting_requests_a_chunk_runs_its_steps_past_a_stop(tiny_params, monkeypatch):
    # Nothing to refill: a stop does not end the chunk early (fewer, longer chunks).
    graphdef, params = tiny_params
    first_two, _ = reference_greedy(graphdef, params, PROMPTS[0], 2)
    requests = [Request(PROMPTS[0], max_new_tokens=20, stop_ids=(first_two[1],), id="stop"),
                Request(PROMPTS[1], max_new_tokens=20, id="long")]
    calls = _tokens_per_call(monkeypatch)
    sampler = make_sampler(params, slots=2, decode_chunk=8, max_new_tokens=20)

    outs = sampler.generate(requests, longest_first=False)

    assert calls[0] == {"stop": 1, "long": 8}
    _assert_solo(params, requests, outs)


def test_refill_batch_balances_idle_rows_against_a_call_and_stays_within_its_rows():
    # k = 2 rows / sqrt(mean length): later refills for short sequences (they free slots
    # often), sooner for long ones; at least 1, at most the call's rows.
    assert [refill_batch(32, m) for m in (75, 512)] == [7, 3]
    assert refill_batch(4, 75) == 1 and refill_batch(2, 20) == 1
    assert refill_batch(32, 1) == 32 and refill_batch(32, 0) == 32
