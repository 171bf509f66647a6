"""The sampler's price of a weights pass: configured, or measured when a plan first needs it."""

from __future__ import annotations

import pytest

from meshrl.inference import schedule
from meshrl.inference.sampler import Request
from meshrl.inference.schedule import SHARE_RANGE
from meshrl.tests.inference.tiny import make_sampler

SPLITTING = dict(slots=8, decode_row_buckets=(2,), max_len=128, prompt_buckets=(16,),
                 max_new_tokens=64)


def test_configured_share_prices_the_sampler_weights_pass(tiny_params):
    _, params = tiny_params

    sampler = make_sampler(params, decode_split_weights_pass=0.25, **SPLITTING)

    assert sampler._split and sampler.row_buckets == (2, 8)
    assert sampler._weights_pass == int(sampler._weights_size * 0.25)


@pytest.mark.slow  # compiles and times decode windows mid-run
def test_cpu_sampler_measures_the_share_only_when_a_plan_first_needs_it_and_decodes_unchanged(
        tiny_params, monkeypatch):
    _, params = tiny_params
    monkeypatch.setattr(schedule, "_measured", {})
    configured = make_sampler(params, decode_split_weights_pass=1.0, **SPLITTING)
    sampler = make_sampler(None, **SPLITTING)
    sampler.update_weights(params, 1)
    # A full chunk at one position: no cut shortens a window, so there is nothing to price.
    level = [Request(list(range(3, 12)), max_new_tokens=12, seed=i) for i in range(8)]
    sampler.generate(level)
    assert sampler._weights_pass_price is None and not schedule._measured

    # Long requests first, short refills after: a cut would shorten the short ones' window.
    budgets = [60, 60] + [3 + i % 4 for i in range(12)]
    requests = [Request(list(range(3, 3 + 5 + i % 9)), max_new_tokens=b)
                for i, b in enumerate(budgets)]
    outs = sampler.generate(requests, longest_first=False)

    share = sampler._weights_pass / sampler._weights_size
    assert len(schedule._measured) == 1
    assert SHARE_RANGE[0] - 1e-3 <= share <= SHARE_RANGE[1]
    # The timing ran mid-run on a scratch cache: the live slots decode as if it had not.
    refs = configured.generate(requests, longest_first=False)
    for out, ref in zip(outs, refs, strict=True):
        assert out.tokens == ref.tokens
        assert out.raw_logprobs == pytest.approx(ref.raw_logprobs, rel=1e-4, abs=1e-5)
