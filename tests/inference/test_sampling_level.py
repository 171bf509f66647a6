"""Sampling levels: a program compiles only the sampling its rows may ask for (greedy, then the
random draw, then the vocabulary sort), samples them exactly as the full step does, and a
sampler raises its level when a request needs more, never lowering it."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import SamplerConfig
from meshrl.inference.requests import Request, request_sampling, start_sampling
from meshrl.inference.sampling import (
    FILTERED,
    GREEDY,
    TEMPERATURE,
    sample_kept,
    sampling_level,
)
from tests.inference.tiny import TINY, make_sampler

B, V = 6, 40


def _rows(temperature_B, top_k_B=None, top_p_B=None, min_p_B=None):
    logits_BxV = jax.random.normal(jax.random.key(0), (B, V)) * 3.0
    return (logits_BxV, jnp.asarray(temperature_B, jnp.float32),
            jnp.zeros(B, jnp.int32) if top_k_B is None else jnp.asarray(top_k_B, jnp.int32),
            jnp.ones(B) if top_p_B is None else jnp.asarray(top_p_B, jnp.float32),
            jnp.arange(B, dtype=jnp.int32) + 7, jnp.full((B,), 5, jnp.int32),
            jnp.full((B, 2), -1, jnp.int32).at[0, 0].set(3),
            jnp.zeros(B) if min_p_B is None else jnp.asarray(min_p_B, jnp.float32))


def _sample(args, level):
    return jax.jit(lambda *a: sample_kept(*a, level=level))(*args)


@pytest.mark.parametrize(("settings", "level"), [
    ((0.0, 0, 1.0, 0.0), GREEDY), ((0.0, 5, 0.5, 0.1), GREEDY),  # greedy ignores filters
    ((0.7, 0, 1.0, 0.0), TEMPERATURE), ((1.0, 3, 1.0, 0.0), FILTERED),
    ((1.0, 0, 0.9, 0.0), FILTERED), ((1.0, 0, 1.0, 0.05), FILTERED)])
def test_sampling_level_is_the_lowest_that_samples_the_settings(settings, level):
    assert sampling_level(*settings) == level


@pytest.mark.parametrize(("level", "temperature_B"), [
    (GREEDY, [0.0] * B), (TEMPERATURE, [0.0, 0.5, 1.0, 0.0, 1.3, 0.9])])
def test_a_lower_level_samples_its_rows_like_the_full_step(level, temperature_B):
    args = _rows(temperature_B)
    got = _sample(args, level)
    want = _sample(args, FILTERED)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))  # tokens
    np.testing.assert_array_equal(np.asarray(got[3]), np.asarray(want[3]))  # kept counts
    for g, w in zip(got[1:3], want[1:3], strict=True):  # sampled and raw logprobs
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)


def test_an_unfiltered_row_beside_a_filtered_one_samples_as_alone():
    # A large vocabulary and a peaked row: a float32 cumsum of its probabilities reaches 1
    # before the tail, which must not cut a row with top_p 1 when the batch sorts.
    logits_2xV = jax.random.normal(jax.random.key(0), (2, 32000)).at[:, 0].set(15.0)
    seed_2, pos_2 = jnp.asarray([7, 8], jnp.int32), jnp.asarray([5, 5], jnp.int32)
    both = jax.jit(lambda *a: sample_kept(*a, level=FILTERED))(
        logits_2xV, jnp.ones(2), jnp.zeros(2, jnp.int32), jnp.asarray([1.0, 0.9]), seed_2,
        pos_2)
    alone = jax.jit(lambda *a: sample_kept(*a, level=TEMPERATURE))(
        logits_2xV[:1], jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.ones(1), seed_2[:1],
        pos_2[:1])
    assert int(both[3][0]) == 32000
    for b, a in zip(both, alone, strict=True):
        np.testing.assert_allclose(np.asarray(b[:1]), np.asarray(a), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(("level", "sorts", "draws"), [
    (GREEDY, 0, False), (TEMPERATURE, 0, True), (FILTERED, 1, True)])
def test_a_level_compiles_only_its_own_sort_and_random_draw(level, sorts, draws):
    text = jax.jit(lambda *a: sample_kept(*a, level=level)).lower(*_rows([1.0] * B)).as_text()
    assert text.count("stablehlo.sort") == sorts
    assert ("threefry" in text) == draws


def test_request_level_takes_the_configs_settings_it_leaves_unset():
    cfg = SamplerConfig(temperature=1.0, top_p=0.9)
    assert request_sampling(None, cfg) == FILTERED
    assert request_sampling(Request([1], top_p=1.0), cfg) == TEMPERATURE
    assert request_sampling(Request([1], temperature=0.0), cfg) == GREEDY


def test_a_sampler_spanning_processes_starts_at_the_highest_level():
    other = types.SimpleNamespace(process_index=jax.process_index() + 1)
    mesh = types.SimpleNamespace(devices=np.array([jax.devices()[0], other]))
    assert start_sampling(SamplerConfig(temperature=0.0), mesh) == FILTERED


@pytest.mark.parametrize("kv_cache", ["dense", "paged"])
def test_sampler_raises_its_level_for_a_request_and_samples_like_the_full_programs(
        tiny_params, kv_cache):
    _, params = tiny_params
    prompts = [[5, 9, 11, 3], [7, 7, 2, 9, 30, 31, 4], [5, 9, 11, 3]]  # a shared prompt too
    greedy = [Request(p, max_new_tokens=6) for p in prompts]
    hot = [Request(p, max_new_tokens=6, temperature=0.8, seed=i) for i, p in enumerate(prompts)]
    sampler = make_sampler(params, kv_cache=kv_cache)  # temperature 0: greedy programs
    assert sampler.state.sampling == GREEDY
    first = sampler.generate(greedy)
    sampled = sampler.generate(hot)
    assert sampler.state.sampling == TEMPERATURE
    full = make_sampler(params, kv_cache=kv_cache)
    # A top-k of the whole vocabulary filters nothing but lifts the programs to the top level.
    full.generate([Request(prompts[0], max_new_tokens=1, temperature=1.0, top_k=TINY.vocab_size)])
    assert full.state.sampling == FILTERED
    for got, want in zip(first + sampled, full.generate(greedy) + full.generate(hot),
                         strict=True):
        assert got.tokens == want.tokens
        np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(got.raw_logprobs, want.raw_logprobs, rtol=1e-6, atol=1e-6)
        assert got.kept == want.kept


def test_warmup_compiles_the_top_level_unless_told(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, max_len=32, prompt_buckets=(8,))
    sampler.warmup(sampling=TEMPERATURE)
    assert sampler.state.sampling == TEMPERATURE
    sampler.warmup()
    assert sampler.state.sampling == FILTERED
    compiled = sampler.compile_count()
    sampler.generate([Request([3, 4, 5], max_new_tokens=5, temperature=1.0, top_p=0.9)])
    assert sampler.compile_count() == compiled  # nothing compiles after warmup()


def test_sampler_level_never_drops_and_lower_requests_compile_nothing(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, temperature=1.0)
    assert sampler.state.sampling == TEMPERATURE
    requests = [Request([4, 8, 15, 16], max_new_tokens=6, seed=3)]
    sampler.generate(requests)
    compiled = sampler.compile_count()
    sampler.generate([Request(r.prompt_ids, max_new_tokens=6, temperature=0.0)
                      for r in requests])
    assert sampler.state.sampling == TEMPERATURE
    assert sampler.compile_count() == compiled


def test_a_level_raise_keeps_the_paged_re_prefill_tail_programs(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, kv_cache="paged", max_len=32, prompt_buckets=(8,))
    sampler.warmup(recompute=True, sampling=GREEDY)
    tails = sampler.pages.tail._cache_size()
    assert tails > 0
    sampler.warmup(recompute=True)  # the top level: every decode and prefill compiles again
    assert sampler.state.sampling == FILTERED
    assert sampler.pages.tail._cache_size() == tails  # the tail reads no slot state
