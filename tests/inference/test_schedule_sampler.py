"""The sampler's decode call costs: configured, or measured when a plan first needs them."""

from __future__ import annotations

import pytest

from meshrl.inference import schedule
from meshrl.inference.sampler import Request
from meshrl.inference.schedule import CallCosts
from meshrl.tests.inference.tiny import make_sampler

SPLITTING = dict(slots=8, decode_row_buckets=(2,), max_len=128, prompt_buckets=(16,),
                 max_new_tokens=64)


def test_configured_costs_price_the_sampler_calls(tiny_params):
    _, params = tiny_params

    sampler = make_sampler(params, decode_call_costs=(1e6, 2e5), **SPLITTING)
    deprecated = make_sampler(params, decode_split_weights_pass=0.25, **SPLITTING)

    assert sampler._split and sampler.row_buckets == (2, 8)
    assert sampler.call_costs == CallCosts(1e6, 2e5)
    assert deprecated.call_costs == CallCosts(deprecated._weights_size * 0.25, 0)


@pytest.mark.slow  # compiles and times decode shapes mid-run
def test_cpu_sampler_measures_the_costs_only_when_a_plan_first_needs_them_and_decodes_unchanged(
        tiny_params, monkeypatch):
    _, params = tiny_params
    monkeypatch.setattr(schedule, "_measured", {})
    configured = make_sampler(params, decode_call_costs=(1e5, 1e4), **SPLITTING)
    sampler = make_sampler(None, **SPLITTING)
    sampler.update_weights(params, 1)
    # A full chunk at one position: no cut shortens a window, so there is nothing to price.
    level = [Request(list(range(3, 12)), max_new_tokens=12, seed=i) for i in range(8)]
    sampler.generate(level)
    assert not sampler._costs_known and not schedule._measured

    # Long requests first, short refills after: a cut would shorten the short ones' window.
    budgets = [60, 60] + [3 + i % 4 for i in range(40)]
    requests = [Request(list(range(3, 3 + 5 + i % 9)), max_new_tokens=b)
                for i, b in enumerate(budgets)]
    outs = sampler.generate(requests, longest_first=False)

    assert sampler._costs_known and len(schedule._measured) == 1
    costs = sampler.call_costs
    assert costs is None or (costs.call >= 0 and costs.row >= 0)
    # The timing ran mid-run on a scratch cache: the live slots decode as if it had not.
    refs = configured.generate(requests, longest_first=False)
    for out, ref in zip(outs, refs, strict=True):
        assert out.tokens == ref.tokens
        assert out.raw_logprobs == pytest.approx(ref.raw_logprobs, rel=1e-4, abs=1e-5)
