"""The sampler's price of a weights pass: configured, or measured when its first weights land."""

from __future__ import annotations

import pytest

from meshrl.inference import schedule
from meshrl.inference.sampler import Request
from meshrl.inference.schedule import SHARE_RANGE
from meshrl.tests.inference.tiny import make_sampler

SPLITTING = dict(slots=8, decode_row_buckets=(2,), max_len=128, prompt_buckets=(16,))


def test_configured_share_prices_the_sampler_weights_pass(tiny_params):
    _, params = tiny_params

    sampler = make_sampler(params, decode_split_weights_pass=0.25, **SPLITTING)

    assert sampler.split_cuts == (2,)
    assert sampler._weights_pass == int(sampler._weights_size * 0.25)


def test_cpu_sampler_measures_the_share_when_its_first_weights_land_and_decodes_unchanged(
        tiny_params, monkeypatch):
    _, params = tiny_params
    monkeypatch.setattr(schedule, "_measured", {})
    configured = make_sampler(params, decode_split_weights_pass=1.0, **SPLITTING)
    sampler = make_sampler(None, **SPLITTING)
    assert sampler._weights_pass is None and not schedule._measured

    sampler.update_weights(params, 1)

    share = sampler._weights_pass / sampler._weights_size
    assert len(schedule._measured) == 1
    assert SHARE_RANGE[0] - 1e-3 <= share <= SHARE_RANGE[1]
    # The timing ran the decode program on the sampler's own (inactive) slots.
    requests = [Request(list(range(3, 3 + n)), max_new_tokens=12) for n in (5, 9, 14)]
    for out, ref in zip(sampler.generate(requests), configured.generate(requests), strict=True):
        assert out.tokens == ref.tokens
        assert out.raw_logprobs == pytest.approx(ref.raw_logprobs, rel=1e-4, abs=1e-5)
