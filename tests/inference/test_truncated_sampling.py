"""Truncated sampling (top-k, top-p, min-p): the sampler records how many tokens it kept per
token, its logprob is under the truncated renormalised distribution, and the trainer's
truncated logprobs of the same tokens under the same params equal it."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms.logits import token_stats
from meshrl.inference.sampler import Request
from meshrl.inference.sampling import sample_kept
from meshrl.models import forward
from meshrl.tests.inference.tiny import TINY, make_sampler

LOGITS_1xV = jnp.log(jnp.asarray([[0.05, 0.4, 0.1, 0.3, 0.15]]))  # sorted: 1, 3, 4, 2, 0


def _sample(n: int, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0,
            logits_1xV: jax.Array = LOGITS_1xV):
    return sample_kept(jnp.repeat(logits_1xV, n, 0), jnp.ones(n), jnp.full(n, top_k),
                       jnp.full(n, top_p), jnp.arange(n), jnp.zeros(n, jnp.int32),
                       min_p_B=jnp.full(n, min_p))


@pytest.mark.parametrize("settings, kept, support", [
    ({}, 5, [0, 1, 2, 3, 4]),
    ({"top_k": 2}, 2, [1, 3]),
    ({"top_p": 0.75}, 3, [1, 3, 4]),  # mass before token 4: 0.7 < 0.75
    ({"min_p": 0.3}, 3, [1, 3, 4]),  # p >= 0.3 * 0.4 = 0.12
    ({"top_k": 4, "top_p": 0.75, "min_p": 0.3}, 3, [1, 3, 4]),
])
def test_sample_kept_records_the_kept_count_and_the_renormalised_logprob(settings, kept,
                                                                         support):
    tokens, lp, raw, kept_B = _sample(64, **settings)

    probs = np.asarray([0.05, 0.4, 0.1, 0.3, 0.15])
    renorm = probs[support].sum()
    assert set(np.asarray(tokens).tolist()) <= set(support)
    np.testing.assert_array_equal(kept_B, kept)
    np.testing.assert_allclose(lp, np.log(probs[np.asarray(tokens)] / renorm), rtol=1e-5,
                               atol=1e-6)
    np.testing.assert_allclose(raw, np.log(probs[np.asarray(tokens)]), rtol=1e-5, atol=1e-6)


def test_sample_kept_counts_ties_at_the_top_k_threshold_as_kept():
    logits_1xV = jnp.asarray([[3.0, 1.0, 1.0, 0.0]])

    tokens, lp, _, kept_B = _sample(64, top_k=2, logits_1xV=logits_1xV)

    # Both tokens tied at the threshold are kept (and sampled from), so three count.
    np.testing.assert_array_equal(kept_B, 3)
    z = np.asarray([3.0, 1.0, 1.0, 0.0])
    assert set(np.asarray(tokens).tolist()) <= {0, 1, 2}
    np.testing.assert_allclose(lp, z[np.asarray(tokens)] - np.log(np.exp(z[:3]).sum()),
                               rtol=1e-5, atol=1e-6)


def test_greedy_rows_keep_one_token():
    out = sample_kept(LOGITS_1xV, jnp.zeros(1), jnp.zeros(1, jnp.int32), jnp.ones(1),
                      jnp.zeros(1, jnp.int32), jnp.zeros(1, jnp.int32))

    assert int(out[0][0]) == 1 and int(out[3][0]) == 1


SETTINGS = [{"top_k": 5}, {"top_p": 0.9}, {"min_p": 0.8}, {"top_k": 20, "top_p": 0.8, "min_p": 0.7}]


def test_trainer_truncated_logprobs_equal_the_samplers_with_identical_params(tiny_params):
    graphdef, params = tiny_params
    # Sampling settings are per request: one sampler (one compile) serves all four.
    sampler = make_sampler(params, temperature=0.8, max_new_tokens=12)
    prompts = [[5, 9, 17, 3], [40, 2, 8, 8, 61, 7, 11]]
    cases = [(kw, p) for kw in SETTINGS for p in prompts]

    outs = sampler.generate([Request(p, seed=i, **kw) for i, (kw, p) in enumerate(cases)])

    # One compile: every sequence right-padded to 32 (causal, so padding never changes the
    # logits of the positions scored).
    fwd = jax.jit(lambda ids: forward(graphdef, params, ids))
    for (kw, p), out in zip(cases, outs):
        assert len(out.kept) == len(out.tokens) == len(out.logprobs)
        assert all(1 <= k <= TINY.vocab_size for k in out.kept), out.kept
        assert min(out.kept) < TINY.vocab_size, (kw, out.kept)  # it truncated
        seq = p + out.tokens
        ids_1xL, kept_1xL = np.zeros((1, 33), np.int32), np.zeros((1, 32), np.int32)
        ids_1xL[0, :len(seq)] = seq
        kept_1xL[0, len(p) - 1:len(seq) - 1] = out.kept  # position t predicts token t + 1
        stats = token_stats(fwd(ids_1xL[:, :-1]), jnp.asarray(ids_1xL[:, 1:]), 0.8,
                            kept_BxL=jnp.asarray(kept_1xL), kept_cap=kw.get("top_k", 0))
        got = slice(len(p) - 1, len(seq) - 1)
        np.testing.assert_allclose(stats.logprobs_BxL[0, got], out.logprobs, rtol=0,
                                   atol=1e-6, err_msg=str(kw))
        np.testing.assert_array_equal(stats.outside_BxL[0, got], 0.0)


def test_untruncated_sampler_records_the_vocabulary_size(tiny_params):
    _, params = tiny_params
    sampler = make_sampler(params, temperature=1.0)

    out = sampler.generate([Request([5, 9, 17], max_new_tokens=5)])[0]

    assert out.kept == [TINY.vocab_size] * 5
