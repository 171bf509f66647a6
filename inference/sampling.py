"""Token sampling: greedy, temperature, top-k, top-p and min-p with per-slot parameters and seeds.

Everything here is a pure function over device arrays so it can run inside the fused decode
chunk. Each slot carries its own parameters (temperature, top_k, top_p, seed), so one compiled
step serves requests with different settings without recompiling.

Every filter keeps a prefix of the tokens sorted by logit, so the kept set is always "the
``n`` largest scaled logits" (ties at the threshold included): ``sample_kept`` records that
``n`` per token, and the RL trainer renormalises its own logits over its top ``n``
(``algorithms.truncation``) to score the same truncated distribution.

A program's sampling ``level`` (static) bounds what its rows may ask for: ``GREEDY`` compiles
the argmax alone, ``TEMPERATURE`` adds the Gumbel draw, ``FILTERED`` the vocabulary sort behind
the filters. A row within the level gets the same token and logprobs at any higher level; a
lower level only compiles less: no random draw, no sort.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Finite "minus infinity": log_softmax of a row with masked entries stays NaN-free.
_NEG = -1e30
GREEDY, TEMPERATURE, FILTERED = 0, 1, 2  # sampling levels, each a superset of the one before
SAMPLING_LEVELS = ("greedy", "temperature", "top-k/top-p/min-p")


def sampling_level(temperature: float, top_k: int, top_p: float, min_p: float) -> int:
    """The lowest level that samples a row with these settings exactly."""
    if temperature <= 0.0:
        return GREEDY  # greedy ignores the filters
    return FILTERED if top_k > 0 or top_p < 1.0 or min_p > 0.0 else TEMPERATURE


def filter_logits(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                  top_p_B: jax.Array, sort: bool = True, min_p_B: jax.Array | None = None
                  ) -> jax.Array:
    """Scaled logits of the distribution actually sampled from (masked entries at -1e30).

    temperature 0 is greedy: only the argmax survives (ties: the lowest index, as ``argmax``).
    top_k 0, top_p 1 and min_p 0 (or None) disable their filters. The filters keep at least one
    token.
    """
    return filter_and_count(logits_BxV, temperature_B, top_k_B, top_p_B, sort, min_p_B)[0]


def filter_and_count(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                     top_p_B: jax.Array, sort: bool = True, min_p_B: jax.Array | None = None
                     ) -> tuple[jax.Array, jax.Array]:
    """(``filter_logits``, int32 ``[B]`` number of tokens each row kept: V without a filter,
    1 for greedy rows)."""
    B, V = logits_BxV.shape
    logits_BxV = logits_BxV.astype(jnp.float32)
    greedy_B = temperature_B <= 0.0
    safe_t_B = jnp.where(greedy_B, 1.0, temperature_B)
    scaled_BxV = logits_BxV / safe_t_B[:, None]
    argmax_B = first_argmax(logits_BxV)
    greedy_BxV = jnp.where(jnp.arange(V)[None, :] == argmax_B[:, None], 0.0, _NEG)
    if not sort:  # no top-k/top-p/min-p anywhere in the batch: temperature only
        kept_B = jnp.where(greedy_B, 1, V).astype(jnp.int32)
        return jnp.where(greedy_B[:, None], greedy_BxV, scaled_BxV), kept_B

    sorted_BxV = -jnp.sort(-scaled_BxV, axis=-1)  # descending
    rank_V = jnp.arange(V)
    k_B = jnp.where(top_k_B <= 0, V, jnp.minimum(top_k_B, V))
    # Ties with the k-th logit stay (as in HF's TopKLogitsWarper). The order is transformers':
    # top-k, then top-p over the top-k set renormalised, then min-p (vLLM applies min-p first,
    # which keeps another set when min-p and top-p are combined).
    kth_Bx1 = jnp.take_along_axis(sorted_BxV, (k_B - 1)[:, None], axis=-1)
    keep_k_BxV = sorted_BxV >= kth_Bx1
    sorted_k_BxV = jnp.where(keep_k_BxV, sorted_BxV, _NEG)
    probs_BxV = jax.nn.softmax(sorted_k_BxV, axis=-1)
    # A token is kept while the mass of the strictly better tokens is below top_p. top_p 1 keeps
    # every token outright: a float32 cumsum over a large vocabulary can reach 1 before its tail.
    mass_before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV
    keep_BxV = keep_k_BxV & ((mass_before_BxV < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0))
    if min_p_B is not None:
        # p / p_max >= min_p: the ratio is the same before and after top-k/top-p renormalise,
        # so min-p last keeps what min-p right after top-p would.
        keep_BxV &= sorted_BxV >= sorted_BxV[:, :1] + jnp.log(min_p_B)[:, None]
    keep_BxV |= rank_V[None, :] == 0
    n_keep_B = jnp.sum(keep_BxV, axis=-1)
    threshold_B = jnp.take_along_axis(sorted_BxV, (n_keep_B - 1)[:, None], axis=-1)[:, 0]
    in_set_BxV = scaled_BxV >= threshold_B[:, None]
    filtered_BxV = jnp.where(in_set_BxV, scaled_BxV, _NEG)
    # Ties at the threshold are kept (and sampled), so the count is of the set, not n_keep.
    kept_B = jnp.where(greedy_B, 1, jnp.sum(in_set_BxV, axis=-1)).astype(jnp.int32)
    return jnp.where(greedy_B[:, None], greedy_BxV, filtered_BxV), kept_B


def first_argmax(x_BxV: jax.Array) -> jax.Array:
    """int32 ``[B]``: ``jnp.argmax(x_BxV, -1)`` for finite rows (ties: the lowest index).

    A max and a masked min are two plain reductions that XLA vectorises; ``argmax`` lowers to
    one (value, index) reduction, which XLA:CPU runs element by element with its producers
    (the Gumbel noise's two logs) fused in. A row with a NaN gives V - 1.
    """
    V = x_BxV.shape[-1]
    max_Bx1 = jnp.max(x_BxV, axis=-1, keepdims=True)
    index_BxV = jnp.where(x_BxV == max_Bx1, jnp.arange(V, dtype=jnp.int32), V)
    return jnp.minimum(jnp.min(index_BxV, axis=-1), V - 1)


def slot_keys(seed_B: jax.Array, position_B: jax.Array) -> jax.Array:
    """One key per slot from (request seed, position of the token being sampled).

    Depending only on the request and the position makes a sample independent of which slot or
    batch the request landed in, and of re-prefills after a weight update.
    """
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seed_B, position_B)


def ban(logits_BxV: jax.Array, banned_BxS: jax.Array) -> jax.Array:
    """``logits_BxV`` with each row's ``banned_BxS`` ids (-1: none) at the finite minus
    infinity: a scatter of B x S entries, not a [B, V, S] comparison."""
    B, V = logits_BxV.shape
    ids_BxS = jnp.where(banned_BxS < 0, V, banned_BxS)  # V is out of range: dropped
    return logits_BxV.at[jnp.arange(B)[:, None], ids_BxS].set(_NEG, mode="drop")


def sample(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
           top_p_B: jax.Array, seed_B: jax.Array, position_B: jax.Array,
           banned_BxS: jax.Array | None = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``sample_kept`` without min-p and without the kept counts."""
    return sample_kept(logits_BxV, temperature_B, top_k_B, top_p_B, seed_B, position_B,
                       banned_BxS)[:3]


def sample_kept(logits_BxV: jax.Array, temperature_B: jax.Array, top_k_B: jax.Array,
                top_p_B: jax.Array, seed_B: jax.Array, position_B: jax.Array,
                banned_BxS: jax.Array | None = None, min_p_B: jax.Array | None = None,
                level: int = FILTERED) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Sample one token per row, never one of its ``banned_BxS`` ids (-1: none; a request's
    stop ids before its ``min_new_tokens``).

    Returns (tokens_B int32, logprob under the sampling distribution actually used -- the
    temperature-scaled logits truncated by top-k/top-p/min-p and renormalised, the banned ids
    masked out; 0 for greedy --, raw model logprob log_softmax(logits)[token], unmasked, and
    kept_B int32: how many tokens that distribution kept, V when no filter ran, 1 for greedy).
    The banned ids are not part of ``kept_B``: they are only banned before ``min_new_tokens``.
    ``level`` (static): every row's settings are within it (``sampling_level``).
    """
    raw_logp_BxV = jax.nn.log_softmax(logits_BxV.astype(jnp.float32), axis=-1)
    logits_BxV = logits_BxV.astype(jnp.float32)
    B, V = logits_BxV.shape
    if banned_BxS is not None:
        logits_BxV = ban(logits_BxV, banned_BxS)
    min_p_B = jnp.zeros((B,), jnp.float32) if min_p_B is None else min_p_B

    def greedy() -> tuple[jax.Array, jax.Array, jax.Array]:
        tokens_B = first_argmax(logits_BxV)
        return tokens_B, jnp.zeros(tokens_B.shape, jnp.float32), jnp.ones((B,), jnp.int32)

    def stochastic() -> tuple[jax.Array, jax.Array, jax.Array]:
        def unfiltered() -> tuple[jax.Array, jax.Array]:
            return filter_and_count(logits_BxV, temperature_B, jnp.zeros_like(top_k_B),
                                    jnp.ones_like(top_p_B), sort=False)

        if level < FILTERED:
            filtered_BxV, kept_B = unfiltered()
        else:  # the vocab sort behind top-k/top-p/min-p only runs when some row asks for it
            needs_sort = jnp.any(top_k_B > 0) | jnp.any(top_p_B < 1.0) | jnp.any(min_p_B > 0.0)
            filtered_BxV, kept_B = jax.lax.cond(
                needs_sort,
                lambda: filter_and_count(logits_BxV, temperature_B, top_k_B, top_p_B,
                                         min_p_B=min_p_B),
                unfiltered)
        # jax.random.categorical's draw (the same Gumbel noise, so the same tokens per seed),
        # with the argmax taken by ``first_argmax``.
        noise_BxV = jax.vmap(lambda key: jax.random.gumbel(key, (V,)))(
            slot_keys(seed_B, position_B))
        tokens_B = first_argmax(filtered_BxV + noise_BxV)
        lp_B = jnp.take_along_axis(jax.nn.log_softmax(filtered_BxV, axis=-1),
                                   tokens_B[:, None], axis=-1)[:, 0]
        return tokens_B, lp_B, kept_B

    # All-greedy batches (evaluation, benchmarks) skip the RNG and the filters entirely.
    tokens_B, sample_lp_B, kept_B = greedy() if level == GREEDY else jax.lax.cond(
        jnp.all(temperature_B <= 0.0), greedy, stochastic)
    raw_lp_B = jnp.take_along_axis(raw_logp_BxV, tokens_B[:, None], axis=-1)[:, 0]
    return tokens_B, sample_lp_B, raw_lp_B, kept_B
