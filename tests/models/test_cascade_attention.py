"""Shared-prefix (cascade) decode attention equals softmax attention over each whole sequence."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from meshrl.models.cascade_attention import CascadeWindow, cascade_attention, merge
from meshrl.models.kv_cache import KVCache

B, K, G, H = 5, 2, 2, 8  # slots, kv heads, queries per kv head, head_dim
P, C, W = 6, 4, 4  # prefix entries, entries a block, band entries
# Rows: slots 0, 2, 3 share prefix row 0; slot 1 has row 1 to itself; slot 4 is in no row
# (a free slot); row 2 is padding.
MEMBERS = np.array([[0, 2, 3], [1, B, B], [B, B, B]], np.int32)
# Blocks: slot 0 has two (the second half padding), slots 1 and 3 one each, slot 2 none; the
# last block is padding.
OWNERS = np.array([0, 0, 1, 3, B], np.int32)
VALID = np.array([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0], [0, 0, 0, 0]], bool)
OFFSET = np.array([P + 6, P + 4, P, P + 3, P], np.int32)  # each band's first position
POS = OFFSET + np.array([1, 0, 3, 2, -P], np.int32)  # each slot's query position (slot 4: 0)


def _window(rng: np.random.Generator) -> CascadeWindow:
    def normal(*shape: int) -> jnp.ndarray:
        return jnp.asarray(rng.standard_normal(shape), jnp.float32)

    suffix = KVCache((normal(B, K, H, W),), (normal(B, K, W, H),))
    prefix = KVCache((normal(3, K, H, P),), (normal(3, K, P, H),))
    blocks = KVCache((normal(5, K, H, C),), (normal(5, K, C, H),))
    return CascadeWindow(suffix, prefix, jnp.asarray(MEMBERS), jnp.asarray(OFFSET), blocks,
                         jnp.asarray(OWNERS), jnp.asarray(VALID))


def _reference(win: CascadeWindow, q_BxNxH: np.ndarray) -> np.ndarray:
    """Softmax over each slot's row prefix, its blocks' valid entries and its band up to its
    position."""
    out = np.zeros(q_BxNxH.shape)
    row_of = {int(s): r for r, row in enumerate(MEMBERS) for s in row if s < B}
    for b in range(B):
        if b not in row_of:
            continue
        r = row_of[b]
        own = [n for n in range(len(OWNERS)) if OWNERS[n] == b]
        keys = [np.asarray(win.prefix.k[0][r])]
        values = [np.asarray(win.prefix.v[0][r])]
        for n in own:
            keys.append(np.asarray(win.blocks.k[0][n])[:, :, VALID[n]])
            values.append(np.asarray(win.blocks.v[0][n])[:, VALID[n]])
        visible_W = OFFSET[b] + np.arange(W) <= POS[b]
        keys.append(np.asarray(win.suffix.k[0][b])[:, :, visible_W])
        values.append(np.asarray(win.suffix.v[0][b])[:, visible_W])
        keys_KxHxT = np.concatenate(keys, axis=-1).astype(np.float64)
        values_KxTxH = np.concatenate(values, axis=-2).astype(np.float64)
        for n in range(K * G):
            s_T = q_BxNxH[b, n] @ keys_KxHxT[n // G] * H ** -0.5
            p_T = np.exp(s_T - s_T.max())
            out[b, n] = (p_T / p_T.sum()) @ values_KxTxH[n // G]
    return out


def test_cascade_equals_softmax_over_row_prefix_own_blocks_and_band():
    rng = np.random.default_rng(0)
    win = _window(rng)
    q_Bx1xNxH = rng.standard_normal((B, 1, K * G, H)).astype(np.float32)
    new_k, new_v = (rng.standard_normal((B, 1, K, H)).astype(np.float32) for _ in range(2))

    got_win, out_Bx1xNxH = cascade_attention(win, 0, jnp.asarray(q_Bx1xNxH), jnp.asarray(new_k),
                                             jnp.asarray(new_v), jnp.asarray(POS[:, None]),
                                             jnp.float32)

    # The new entries land at position - offset of each band; slot 4 (before it) is dropped.
    for b in range(4):
        np.testing.assert_array_equal(
            np.asarray(got_win.suffix.k[0])[b, :, :, POS[b] - OFFSET[b]], new_k[b, 0])
        np.testing.assert_array_equal(
            np.asarray(got_win.suffix.v[0])[b, :, POS[b] - OFFSET[b]], new_v[b, 0])
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
