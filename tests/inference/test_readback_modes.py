"""``sampler.readback``: a round read after the next is dispatched (lagged) or right away
(immediate) changes when slots are refilled, never what any request generates."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import SamplerConfig
from meshrl.inference.sampler import Request
from meshrl.inference.schedule import lagged_readback
from meshrl.tests.inference.tiny import make_sampler


def _with_stop(params, request: Request, lo: int) -> tuple[Request, int]:
    """``request`` (sampled: its draws depend on its seed and position only) with a stop id
    that ends it at the first token, from the ``lo``-th on, it has not drawn before; and
    that length."""
    ref = make_sampler(params, slots=1).generate([request])[0].tokens
    n = next(i for i in range(lo - 1, len(ref)) if ref[i] not in ref[:i]) + 1
    return dataclasses.replace(request, stop_ids=(ref[n - 1],)), n


def _requests(params) -> list[Request]:
    """More requests than slots, ending by length or by a stop id mid-chunk, greedy or
    sampled."""
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 96, size=int(n)).tolist() for n in (5, 12, 7, 9, 14, 4)]
    stopping, _ = _with_stop(params, Request(prompts[1], max_new_tokens=20, temperature=1.0,
                                             seed=2), 3)
    return [Request(prompts[0], max_new_tokens=11), stopping,
            Request(prompts[2], max_new_tokens=3),
            Request(prompts[3], max_new_tokens=14, temperature=1.0, seed=4),
            Request(prompts[4], max_new_tokens=9, temperature=1.0, seed=5),
            Request(prompts[5], max_new_tokens=7)]


# The paged cache's own programs under both read-backs: -m slow; the readback logic is shared.
@pytest.mark.parametrize("kv_cache", ["dense", pytest.param("paged", marks=pytest.mark.slow)])
def test_lagged_and_immediate_readback_generate_identical_completions(tiny_params, kv_cache):
    _, params = tiny_params
    requests = _requests(params)
    kw = dict(slots=2, kv_cache=kv_cache, page_size=8, max_new_tokens=20)
    lagged = make_sampler(params, readback="lagged", **kw).generate(requests, longest_first=False)

    immediate = make_sampler(params, readback="immediate", **kw).generate(
        requests, longest_first=False)

    assert lagged[1].finish_reason == "stop"
    for got, want in zip(immediate, lagged, strict=True):
        assert (got.tokens, got.finish_reason, got.versions) == (
            want.tokens, want.finish_reason, want.versions)
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=0, atol=1e-6)


def test_immediate_readback_refills_a_stopped_slot_a_round_sooner(tiny_params):
    # One slot: A stops on a stop id inside its first chunk. Lagged, the host learns it only
    # after dispatching A's next chunk (an inactive row), so B waits one more round.
    _, params = tiny_params
    first, n_stop = _with_stop(params, Request([5, 9, 14, 3, 22], max_new_tokens=12,
                                               temperature=1.0, seed=1), 2)
    assert n_stop < 4  # inside the first chunk (decode_chunk 4)
    requests = [first, Request([40, 41, 42, 43, 44, 45], max_new_tokens=5)]
    rounds = {}
    for readback in ("lagged", "immediate"):
        sampler = make_sampler(params, slots=1, readback=readback)
        outs, n = [], 0
        for r in requests:
            sampler.submit(r)
        while sampler.has_work():
            outs += sampler.step()
            n += 1
        rounds[readback] = n
        assert [len(c.tokens) for c in sorted(outs, key=lambda c: c.request.id)] == [n_stop, 5]

    assert rounds["immediate"] < rounds["lagged"], rounds


@pytest.mark.parametrize("readback, platform, lagged", [
    ("auto", "cpu", False), ("auto", "tpu", True), ("auto", "gpu", True),
    ("lagged", "cpu", True), ("immediate", "tpu", False)])
def test_auto_readback_is_immediate_on_a_cpu_and_lagged_on_an_accelerator(
        readback, platform, lagged):
    assert lagged_readback(SamplerConfig(readback=readback), platform) is lagged


def test_unknown_readback_names_the_field_and_the_choices():
    with pytest.raises(ConfigError, match="sampler.readback"):
        SamplerConfig(readback="sometimes")
