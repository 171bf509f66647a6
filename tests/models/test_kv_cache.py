"""KVCache windows and band write-back."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from meshrl.configs.schema import ModelConfig
from meshrl.models import KVCache

CFG = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=2,
                  num_heads=2, num_kv_heads=2, max_position_embeddings=64)


def test_put_band_writes_only_each_rows_band_and_shifts_bands_past_the_window_end():
    full = KVCache.init(CFG, batch=6, max_len=16)
    slots_R = jnp.array([4, 2, 3, 6])  # entries 0..7 of slots 4, 2, 3; 6: a padding row
    window = full.window(8, slots_R)
    rng = np.random.default_rng(0)
    window = KVCache(tuple(jnp.asarray(rng.standard_normal(k.shape), jnp.float32)
                           for k in window.k),
                     tuple(jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
                           for v in window.v))
    start_B = jnp.array([0, 3, 7, 0])  # the band [7, 10) is shifted to [5, 8)

    out = full.put_band(window, start_B, width=3, slots_B=slots_R)

    bands = {4: (0, range(0, 3)), 2: (1, range(3, 6)), 3: (2, range(5, 8))}
    for layer in range(CFG.num_layers):
        k, v = np.asarray(out.k[layer]), np.asarray(out.v[layer])  # [B,K,H,T], [B,K,T,H]
        expect_k, expect_v = np.zeros_like(k), np.zeros_like(v)
        for slot, (row, band) in bands.items():
            for t in band:
                expect_k[slot, :, :, t] = np.asarray(window.k[layer])[row, :, :, t]
                expect_v[slot, :, t] = np.asarray(window.v[layer])[row, :, t]
        np.testing.assert_array_equal(k, expect_k)
        np.testing.assert_array_equal(v, expect_v)


def test_window_of_listed_slots_holds_their_entries_in_list_order():
    rng = np.random.default_rng(1)
    full = KVCache.init(CFG, batch=6, max_len=16)
    full = KVCache(tuple(jnp.asarray(rng.standard_normal(k.shape), jnp.float32) for k in full.k),
                   tuple(jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for v in full.v))

    window = full.window(8, jnp.array([5, 0, 3]))

    for layer in range(CFG.num_layers):
        np.testing.assert_array_equal(np.asarray(window.k[layer]),
                                      np.asarray(full.k[layer])[[5, 0, 3], :, :, :8])
        np.testing.assert_array_equal(np.asarray(window.v[layer]),
                                      np.asarray(full.v[layer])[[5, 0, 3], :, :8])
