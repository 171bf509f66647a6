"""Weight updates landing between decode chunks while sequences are in flight."""

from __future__ import annotations

from meshrl.inference.sampler import Request
from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import TINY, make_sampler, reference_greedy


def test_update_mid_generation_tags_versions_and_continues_with_new_weights(tiny_params):
    graphdef, old = tiny_params
    new = split_model(create_model(TINY, seed=1))[1]
    prompts = [[5, 9, 14, 3, 22], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49]]
    sampler = make_sampler(old, decode_chunk=4, max_len=64)
    for p in prompts:
        sampler.submit(Request(p, max_new_tokens=16))
    finished = sampler.step() + sampler.step()  # prefill token + 2 chunks of 4
    assert not finished

    sampler.update_weights(new, version=1)
    outs = []
    while sampler.has_work():
        outs += sampler.step()

    for out in sorted(outs, key=lambda c: c.request.id):
        assert out.versions == [0] * 9 + [1] * 7
        prefix = list(out.request.prompt_ids) + out.tokens[:9]
        again, _ = reference_greedy(graphdef, new, prefix, 7)
        assert out.tokens[9:] == again
        assert out.token_versions == [-1] * len(out.request.prompt_ids) + out.versions
