"""Shared-prefix (cascade) decode attention equals softmax attention over each whole sequence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from meshrl.models.cascade_attention import CascadeWindow, cascade_attention, merge
from meshrl.models.kv_cache import KVCache

B, K, G, H = 5, 2, 2, 8  # slots, kv heads, queries per kv head, head_dim
P, W = 6, 4  # prefix entries, suffix entries (positions P .. P + W - 1)
# Rows: slots 0, 2, 3 share prefix row 0; slot 1 has row 1 to itself; slot 4 is in no row
# (a free slot); row 2 is padding.
MEMBERS = np.array([[0, 2, 3], [1, B, B], [B, B, B]], np.int32)
POS = np.array([P + 1, P, P + 3, P + 2, 0], np.int32)  # each slot's query position


def _window(rng: np.random.Generator) -> CascadeWindow:
    def normal(*shape: int) -> jnp.ndarray:
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    suffix = KVCache((normal(B, K, H, W),), (normal(B, K, W, H),))
    prefix = KVCache((normal(3, K, H, P),), (normal(3, K, P, H),))
    return CascadeWindow(suffix, prefix, jnp.asarray(MEMBERS), P)


def _reference(win: CascadeWindow, q_BxNxH: np.ndarray) -> np.ndarray:
    """Softmax over each slot's row prefix followed by its suffix, positions <= its own."""
    out = np.zeros(q_BxNxH.shape)
    row_of = {int(s): r for r, row in enumerate(MEMBERS) for s in row if s < B}
    for b in range(B):
        if b not in row_of:
            continue
        r = row_of[b]
        keys_KxHxT = np.concatenate([np.asarray(win.prefix.k[0][r]),
                                     np.asarray(win.suffix.k[0][b])], axis=-1).astype(np.float64)
        values_KxTxH = np.concatenate([np.asarray(win.prefix.v[0][r]),
                                       np.asarray(win.suffix.v[0][b])], axis=-2).astype(np.float64)
        for n in range(K * G):
            s_T = q_BxNxH[b, n] @ keys_KxHxT[n // G] * H ** -0.5
            s_T = np.where(np.arange(P + W) <= POS[b], s_T, -np.inf)
            p_T = np.exp(s_T - s_T.max())
            out[b, n] = (p_T / p_T.sum()) @ values_KxTxH[n // G]
    return out


def test_cascade_equals_softmax_over_row_prefix_and_own_suffix():
    rng = np.random.default_rng(0)
    win = _window(rng)
    q_Bx1xNxH = rng.standard_normal((B, 1, K * G, H)).astype(np.float32)
    new_k, new_v = (rng.standard_normal((B, 1, K, H)).astype(np.float32) for _ in range(2))

    got_win, out_Bx1xNxH = cascade_attention(win, 0, jnp.asarray(q_Bx1xNxH), jnp.asarray(new_k),
                                             jnp.asarray(new_v), jnp.asarray(POS[:, None]),
                                             jnp.float32)

    # The new entries land at position - offset of the suffix; slot 4 (before it) is dropped.
    for b in range(4):
        np.testing.assert_array_equal(np.asarray(got_win.suffix.k[0])[b, :, :, POS[b] - P],
                                      new_k[b, 0])
        np.testing.assert_array_equal(np.asarray(got_win.suffix.v[0])[b, :, POS[b] - P],
                                      new_v[b, 0])
    np.testing.assert_array_equal(np.asarray(got_win.suffix.k[0])[4],
                                  np.asarray(win.suffix.k[0])[4])
    want = _reference(got_win, q_Bx1xNxH[:, 0])
    np.testing.assert_allclose(np.asarray(out_Bx1xNxH)[:, 0], want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out_Bx1xNxH)[4], 0.0)  # no entry: 0, not NaN


def test_merge_of_two_parts_equals_one_softmax_over_both():
    rng = np.random.default_rng(1)
    scores_T, values_TxH = rng.standard_normal(10) * 4, rng.standard_normal((10, 3))

    def part(sl: slice) -> tuple[jnp.ndarray, jnp.ndarray, jnp.ndarray]:
        m = scores_T[sl].max()
        p = np.exp(scores_T[sl] - m)
        return jnp.asarray(m), jnp.asarray(p.sum()), jnp.asarray(p @ values_TxH[sl])

    got = merge(part(slice(0, 4)), part(slice(4, 10)))

    p_T = np.exp(scores_T - scores_T.max())
    np.testing.assert_allclose(np.asarray(got), (p_T / p_T.sum()) @ values_TxH, rtol=0,
                               atol=1e-6)
