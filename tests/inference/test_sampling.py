"""The sampling filters as pure functions on tiny logits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.inference.sampling import filter_logits, first_argmax, sample, slot_keys

LOGITS_1xV = jnp.log(jnp.asarray([[0.1, 0.4, 0.2, 0.3]]))


def _kept(filtered_BxV) -> list[int]:
    return np.flatnonzero(np.asarray(filtered_BxV[0]) > -1e29).tolist()


def test_top_k_keeps_the_k_most_likely_tokens():
    out = filter_logits(LOGITS_1xV, jnp.ones(1), jnp.asarray([2]), jnp.ones(1))
    assert _kept(out) == [1, 3]


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    # Sorted probs 0.4, 0.3, 0.2, 0.1: 0.4 < 0.65 so the 0.3 token is still needed.
    out = filter_logits(LOGITS_1xV, jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.asarray([0.65]))
    assert _kept(out) == [1, 3]
    tiny = filter_logits(LOGITS_1xV, jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.asarray([0.0]))
    assert _kept(tiny) == [1]


def test_top_k_and_top_p_together_keep_what_each_keeps_alone_ties_included():
    from meshrl.inference.sampling import filter_and_count

    logits = jnp.asarray([[2.0, 1.0, 1.0, 1.0, 1.0, -1.0]])  # a tie at the 2nd logit
    one, zero_k, k2, p = jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.asarray([2]), jnp.asarray([0.6])

    kept = {name: int(filter_and_count(logits, one, k, pp)[1][0]) for name, k, pp in (
        ("top_k", k2, one), ("top_p", zero_k, p), ("both", k2, p))}

    assert kept == {"top_k": 5, "top_p": 5, "both": 5}


def test_sampled_logprob_is_under_the_renormalised_distribution():
    tokens, lp, raw = sample(jnp.repeat(LOGITS_1xV, 64, 0), jnp.ones(64),
                             jnp.full((64,), 2, jnp.int32), jnp.ones(64),
                             jnp.arange(64, dtype=jnp.int32), jnp.zeros(64, jnp.int32))
    tokens = np.asarray(tokens)
    assert set(tokens.tolist()) == {1, 3}
    want = np.where(tokens == 1, np.log(0.4 / 0.7), np.log(0.3 / 0.7))
    np.testing.assert_allclose(np.asarray(lp), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(raw), np.log([0.1, 0.4, 0.2, 0.3])[tokens],
                               rtol=1e-5, atol=1e-6)


def test_temperature_zero_rows_are_greedy_even_in_a_sampled_batch():
    logits_2xV = jnp.repeat(LOGITS_1xV, 2, 0)
    tokens, lp, _ = sample(logits_2xV, jnp.asarray([0.0, 1.0]), jnp.zeros(2, jnp.int32),
                           jnp.ones(2), jnp.asarray([1, 2]), jnp.zeros(2, jnp.int32))
    assert int(tokens[0]) == 1
    assert float(lp[0]) == 0.0


def test_banned_ids_are_never_sampled_and_logprobs_are_under_the_mask():
    # Row r bans token 1 (the likeliest) and row r+1 bans nothing (-1 padding only).
    banned_Bx2 = jnp.asarray([[1, -1], [-1, -1]] * 32, jnp.int32)
    tokens, lp, raw = sample(jnp.repeat(LOGITS_1xV, 64, 0), jnp.ones(64),
                             jnp.zeros(64, jnp.int32), jnp.ones(64),
                             jnp.arange(64, dtype=jnp.int32), jnp.zeros(64, jnp.int32),
                             banned_Bx2)
    tokens, lp = np.asarray(tokens), np.asarray(lp)
    assert 1 not in tokens[0::2].tolist()
    assert 1 in tokens[1::2].tolist()  # the unbanned rows still sample it (p = 0.4)
    probs = np.asarray([0.1, 0.4, 0.2, 0.3])
    want_banned = np.log(probs[tokens[0::2]] / 0.6)
    np.testing.assert_allclose(lp[0::2], want_banned, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lp[1::2], np.log(probs[tokens[1::2]]), rtol=1e-5, atol=1e-6)
    # The raw logprob is the model's own, unmasked.
    np.testing.assert_allclose(np.asarray(raw), np.log(probs[tokens]), rtol=1e-5, atol=1e-6)


def test_greedy_with_a_banned_argmax_takes_the_next_best():
    tokens, lp, _ = sample(LOGITS_1xV, jnp.zeros(1), jnp.zeros(1, jnp.int32), jnp.ones(1),
                           jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32),
                           jnp.asarray([[1, -1]], jnp.int32))
    assert int(tokens[0]) == 3
    assert float(lp[0]) == 0.0


def test_sampled_tokens_follow_the_softmax_over_many_positions():
    V, B = 50, 20000
    logits_V = np.random.default_rng(0).standard_normal(V).astype(np.float32) * 1.5
    logits_BxV = jnp.broadcast_to(jnp.asarray(logits_V), (B, V))

    tokens_B = sample(logits_BxV, jnp.ones(B), jnp.zeros(B, jnp.int32), jnp.ones(B),
                      jnp.full(B, 7), jnp.arange(B))[0]

    freq_V = np.bincount(np.asarray(tokens_B), minlength=V) / B
    # 20k draws: each frequency's standard error is at most 0.0035.
    np.testing.assert_allclose(freq_V, np.asarray(jax.nn.softmax(logits_V)), atol=0.012)


def test_first_argmax_equals_argmax_with_ties_at_the_lowest_index():
    rng = np.random.default_rng(0)
    x_BxV = rng.integers(0, 4, size=(64, 37)).astype(np.float32)  # many ties
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x_BxV))),
                                  np.argmax(x_BxV, axis=-1))


def test_sampled_tokens_are_jax_categorical_draws_for_the_same_keys():
    logits_BxV = jax.random.normal(jax.random.key(3), (16, 100))
    seed_B, position_B = jnp.arange(16), jnp.arange(16) * 7
    tokens_B = sample(logits_BxV, jnp.ones(16), jnp.zeros(16, jnp.int32), jnp.ones(16),
                      seed_B, position_B)[0]
    expected_B = jax.vmap(jax.random.categorical)(slot_keys(seed_B, position_B), logits_BxV)
    np.testing.assert_array_equal(np.asarray(tokens_B), np.asarray(expected_B))
