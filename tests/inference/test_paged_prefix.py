"""Shared prompt prefixes on the paged cache: a group of identical prompts admitted together is
prefilled once and holds its full prompt pages once."""

from __future__ import annotations

import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import MeshConfig
from meshrl.inference import paged_programs
from meshrl.inference.programs import in_passes
from meshrl.inference.sampler import Request
from meshrl.models import create_model, split_model
from meshrl.tests.inference.tiny import TINY, make_sampler

PROMPT = [(5 * i) % 90 + 1 for i in range(13)]  # 3 full pages of 4, the 13th token on a 4th
KW = dict(page_size=4, max_new_tokens=12, prompt_buckets=(16,), temperature=1.0)


def _group(g=4, budgets=(6, 10, 10, 10)):
    # Distinct seeds: G different samples of one prompt; the first ends early.
    return [Request(PROMPT, max_new_tokens=budgets[i], seed=i) for i in range(g)]


def _run(sampler, requests, update=None):
    for r in requests:
        sampler.submit(r)
    outs = sampler.step()
    counts = (sampler.pages.prompt_pages(sampler.slots.out),
              sampler.pages.prompt_prefills) if sampler.pages else None
    outs += sampler.step()
    if update is not None:
        sampler.update_weights(update, version=1)
    while sampler.has_work():
        outs += sampler.step()
    return sorted(outs, key=lambda c: c.request.id), counts


def _assert_same(got, want):
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and g.versions == w.versions
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-6)
        np.testing.assert_allclose(g.raw_logprobs, w.raw_logprobs, rtol=0, atol=1e-6)


def test_group_of_four_prefills_the_prompt_once_and_samples_like_unshared(tiny_params):
    _, params = tiny_params
    want, _ = _run(make_sampler(params, **KW), _group())
    sampler = make_sampler(params, kv_cache="paged", **KW)

    got, (prompt_pages, prefills) = _run(sampler, _group())

    _assert_same(got, want)
    assert prefills == 1 and sampler.pages.fanouts == 3
    assert prompt_pages == 3 + 4  # the 3 full pages once, each sample's copy of the 4th
    assert len({tuple(c.tokens) for c in got[1:]}) == 3  # seeds still differ per sample
    assert sampler.pages.pages_in_use == 0  # the leader ended first: refcounts kept the pages


def test_weight_update_re_prefills_a_group_prompt_once(tiny_params):
    _, old = tiny_params
    new = split_model(create_model(TINY, seed=1))[1]
    budgets = (10,) * 4
    want, _ = _run(make_sampler(old, **KW), _group(budgets=budgets), update=new)
    sampler = make_sampler(old, kv_cache="paged", **KW)

    got, _ = _run(sampler, _group(budgets=budgets), update=new)

    _assert_same(got, want)
    assert all(c.versions[-1] == 1 and c.versions[0] == 0 for c in got)
    assert sampler.pages.prompt_prefills == 2  # once per version
    assert sampler.pages.tail_prefills == 3
    assert sampler.pages.pages_in_use == 0


@pytest.mark.slow  # group sharing: test_group_of_four_... in the default run
def test_group_members_the_pool_cannot_hold_wait_and_start_a_group_of_their_own(tiny_params):
    _, params = tiny_params
    budgets = (10,) * 4
    kw = {**KW, "max_len": 32}
    want, _ = _run(make_sampler(params, **kw), _group(budgets=budgets))
    # A member needs 6 pages (22 positions), 3 of them shared: 2 members fit in 10 pages.
    sampler = make_sampler(params, kv_cache="paged", num_pages=10, **kw)

    got, (prompt_pages, prefills) = _run(sampler, _group(budgets=budgets))

    _assert_same(got, want)
    assert (prompt_pages, prefills) == (3 + 2, 1)
    assert sampler.pages.prompt_prefills == 2 and sampler.pages.fanouts == 2


@pytest.mark.slow  # group sharing: test_group_of_four_... in the default run
def test_group_admitted_over_rounds_shares_a_live_members_prompt_pages(tiny_params):
    _, params = tiny_params
    budgets = (3, 10, 4, 10)
    want, _ = _run(make_sampler(params, **KW), _group(budgets=budgets))
    # Two slots: the last two samples are admitted as the first two end, one by one.
    sampler = make_sampler(params, kv_cache="paged", slots=2, **KW)

    got, _ = _run(sampler, _group(budgets=budgets))

    _assert_same(got, want)
    assert sampler.pages.prompt_prefills == 1 and sampler.pages.fanouts == 3
    assert sampler.pages.pages_in_use == 0


def test_group_starts_of_any_size_run_in_one_extend_program(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, kv_cache="paged", **KW)

    _run(sampler, _group(g=2, budgets=(6, 10)))  # one member starts from the leader's pages
    got, _ = _run(sampler, _group())  # three do

    _assert_same(got, _run(make_sampler(params, **KW), _group())[0])
    assert sampler.pages.fanouts == 1 + 3
    assert sampler.pages.extend._cache_size() == 1


@pytest.mark.slow  # compiles every variant of a sampler: most of its time is the compiler
def test_warmup_compiles_every_paged_variant_a_group_run_uses(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, kv_cache="paged", **{**KW, "slots": 2, "max_len": 32})
    sampler.warmup()
    before = sampler.compile_count()

    outs = sampler.generate(_group(g=2, budgets=(3, 10)))

    assert sampler.compile_count() == before
    assert sampler.pages.fanouts == 1 and [len(c.tokens) for c in outs] == [3, 10]


def _solo(prompt, seed):
    return [Request(prompt, max_new_tokens=6, seed=seed)]


def test_prefix_cache_serves_repeated_and_extended_prompts_without_prefilling_them(tiny_params):
    _, params = tiny_params
    # A repeat, then a longer prompt starting with the first (a multi-turn history).
    prompts = [(PROMPT, 1), (PROMPT, 2), (PROMPT + [7, 8, 9, 10, 11, 12], 3)]
    kw = {**KW, "prompt_buckets": (16, 32)}
    dense = make_sampler(params, **kw)
    sampler = make_sampler(params, kv_cache="paged", prefix_cache_pages=8, **kw)

    for i, (prompt, seed) in enumerate(prompts):
        _assert_same(sampler.generate(_solo(prompt, seed)), dense.generate(_solo(prompt, seed)))
        assert sampler.pages.prompt_prefills == 1 and sampler.pages.prefix_cache.hits == 3 * i

    assert len(sampler.pages.prefix_cache.entries) == 4  # 13 // 4 pages, then 19 // 4
    assert sampler.pages.pages_in_use == 4  # held by the cache alone


def test_cached_start_runs_passes_of_at_most_prefill_tokens_and_samples_like_dense(
        tiny_params, monkeypatch):
    _, params = tiny_params
    passes = []  # (rows a pass, tokens a row) of each extend call traced

    def record(fn, carry, xs, n_rows, rows):
        if len(xs) == 5:  # extend's rows (tokens, positions, lens, slots, settings)
            passes.append((rows, xs[0].shape[1]))
        return in_passes(fn, carry, xs, n_rows, rows)

    monkeypatch.setattr(paged_programs, "in_passes", record)
    kw = {**KW, "slots": 16, "max_len": 64, "prompt_buckets": (16, 48), "prefill_tokens": 16}
    dense = make_sampler(params, **kw)
    sampler = make_sampler(params, kv_cache="paged", prefix_cache_pages=8, **kw)
    sampler.generate(_solo(PROMPT, 1))  # caches PROMPT's 3 full pages

    # 12 cached positions, 32 more run through extend in a row of the 48-token bucket.
    longer = PROMPT + [(3 * i) % 90 + 1 for i in range(31)]
    _assert_same(sampler.generate(_solo(longer, 2)), dense.generate(_solo(longer, 2)))

    assert sampler.pages.prefix_cache.hits == 3 and sampler.pass_tokens == 16
    assert passes and all(rows * length <= max(16, length) for rows, length in passes), passes


def test_prefix_cache_is_cleared_by_new_weights_and_keeps_its_size(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, kv_cache="paged", prefix_cache_pages=3, **KW)
    other = [p + 1 for p in PROMPT]
    sampler.generate(_solo(PROMPT, 1))
    sampler.generate(_solo(other, 1))  # its 3 pages push the first prompt's out

    sampler.generate(_solo(PROMPT, 2))
    assert sampler.pages.prompt_prefills == 3 and sampler.pages.prefix_cache.hits == 0
    sampler.update_weights(params, version=1)
    assert not sampler.pages.prefix_cache.entries and sampler.pages.pages_in_use == 0
    sampler.generate(_solo(PROMPT, 3))
    assert sampler.pages.prompt_prefills == 4


def test_a_cache_release_with_a_sequence_ending_in_flight_caches_none_of_its_zeroed_pages(
        tiny_params):
    _, params = tiny_params
    kw = {**KW, "readback": "lagged"}
    sampler = make_sampler(params, kv_cache="paged", prefix_cache_pages=8, **kw)
    sampler.submit(Request(PROMPT, max_new_tokens=3, seed=0))
    sampler.step()  # the chunk the request ends in is in flight

    sampler.release_cache()  # the pool's pages go; the new one is zeros
    sampler.restore_cache()
    while sampler.has_work():
        sampler.step()

    assert not sampler.pages.prefix_cache.entries
    _assert_same(sampler.generate(_solo(PROMPT, 1)),
                 make_sampler(params, **kw).generate(_solo(PROMPT, 1)))


@pytest.mark.slow  # the prefix cache: test_prefix_cache_serves_... in the default run
def test_cached_pages_are_evicted_when_the_pool_is_short(tiny_params):
    _, params = tiny_params
    # 16 pages: one max_len sequence; the second request needs all of them.
    sampler = make_sampler(params, kv_cache="paged", prefix_cache_pages=8, num_pages=16, **KW)
    sampler.generate(_solo(PROMPT, 1))
    assert sampler.pages.pages_in_use == 3

    out = sampler.generate([Request([p + 1 for p in PROMPT], max_new_tokens=51, seed=1)])

    assert len(out[0].tokens) == 51
    assert set(sampler.pages.prefix_cache.entries) == {  # (shard, prefix): one shard here
        (0, tuple(p + 1 for p in PROMPT[:4 * (i + 1)])) for i in range(3)}


# The pool shards its pages with the slots over data.
SHARDED = dict(mesh_cfg=MeshConfig(data=2, tensor=1), kv_cache="paged", paged_decode="in_place")


# The window's per-shard gather and write-back: also tests/models/test_paged_attention.py.
@pytest.mark.parametrize("decode", ["in_place", pytest.param("window", marks=pytest.mark.slow)])
def test_pool_sharded_over_data_groups_per_shard_and_samples_like_dense(tiny_params, decode):
    _, old = tiny_params
    new = split_model(create_model(TINY, seed=1))[1]
    budgets = (10,) * 4
    want, _ = _run(make_sampler(old, mesh_cfg=SHARDED["mesh_cfg"], **KW),
                   _group(budgets=budgets), update=new)
    sampler = make_sampler(old, **{**SHARDED, "paged_decode": decode}, **KW)

    got, (_, prefills) = _run(sampler, _group(budgets=budgets), update=new)

    _assert_same(got, want)
    # Slots 0-1 and their pages on one device, 2-3 on the other: the group leads once per
    # shard, and re-prefills once per shard after the update.
    assert sampler.cache.k[0].sharding.spec[0] == "data"
    assert prefills == 2 and sampler.pages.fanouts == 2
    assert sampler.pages.prompt_prefills == 4 and sampler.pages.tail_prefills == 2
    assert sampler.pages.pages_in_use == 0


def test_page_count_that_does_not_split_like_the_slots_is_refused(tiny_params):
    _, params = tiny_params
    # A config error (one line), not a crash.
    with pytest.raises(ConfigError, match="sampler.num_pages = 33: the pool splits over the mesh"):
        make_sampler(params, **SHARDED, num_pages=33, **KW)
    # 16 pages hold one max_len sequence, but 8 a shard do not.
    with pytest.raises(ConfigError, match="num_pages = 16: .* into 2 shards, each holding one max"):
        make_sampler(params, **SHARDED, num_pages=16, **KW)
    with pytest.raises(ConfigError, match="num_pages = 16: .* into 2 shards"):
        make_sampler(params, **{**SHARDED, "paged_decode": "window"}, num_pages=16, **KW)


def test_request_takes_a_slot_on_another_shard_when_its_first_free_shard_is_short(tiny_params):
    _, params = tiny_params
    # 12 pages over 2 shards, 6 each; a request needs 6 (22 positions of 4).
    sampler = make_sampler(params, **SHARDED, num_pages=12, **{**KW, "max_len": 24})
    first, other = Request(PROMPT, max_new_tokens=10, seed=0), \
        Request([p + 1 for p in PROMPT], max_new_tokens=10, seed=1)
    sampler.submit(first)
    sampler.submit(other)

    sampler.step()

    # Slot 1 shares shard 0 with slot 0, whose request holds all its pages: slot 2 runs it.
    assert [c is not None for c in sampler.slots.out] == [True, False, True, False]
    assert not sampler._queue


def test_pool_pages_shard_over_the_axes_the_slots_split_over(tiny_params):
    _, params = tiny_params
    # 2 slots on data=2 x expert=2: the slots split over data only, and so do the pages (the
    # default page count would also divide over expert).
    sampler = make_sampler(params, mesh_cfg=MeshConfig(data=2, expert=2, tensor=1),
                           kv_cache="paged", paged_decode="in_place", slots=2, **KW)

    assert sampler.pages.shards == 2 and sampler.pages.page_axes == ("data",)
    assert sampler.cache.k[0].sharding.spec[0] == "data"


@pytest.mark.slow  # the sharded group itself: test_pool_sharded_over_data_... in the default run
def test_group_start_on_a_sharded_pool_keeps_the_kernel_to_slot_rows(tiny_params, monkeypatch):
    # The TPU kernel's shard_map reads each device's pages for the rows on that device: right
    # for a decode (rows are the slots in order), wrong for a group start (rows are the
    # members). On CPU: the kernel's place taken by the portable attention, as if on a TPU.
    from meshrl.models import paged_attention as pa
    from meshrl.models import paged_kernel as pk

    def portable(q, kv, table, pos, layer=None):
        kv = kv if layer is None else kv[layer]
        return pa.paged_attention(q, kv[:, :, 0::2], kv[:, :, 1::2], table, pos)

    monkeypatch.setattr(pk, "applies", lambda ctx, combined, queries: combined and queries == 1)
    monkeypatch.setattr(pk, "ragged_paged_attention", portable)
    _, params = tiny_params
    group = [Request(PROMPT, max_new_tokens=6, seed=i) for i in range(12)]
    kw = {**KW, "slots": 16}
    want, _ = _run(make_sampler(params, mesh_cfg=SHARDED["mesh_cfg"], **kw), group)

    got, _ = _run(make_sampler(params, **SHARDED, **kw), group)

    _assert_same(got, want)
