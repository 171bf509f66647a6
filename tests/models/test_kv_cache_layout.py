"""The two key layouts of the dense KV cache (keys [B, K, H, T] for CPU, [B, K, T, H] for
TPU/GPU): same entries under every cache operation, same cached decode, picked by the mesh's
platform."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.schema import MeshConfig, ModelConfig
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import KVCache, create_model, forward, split_model
from meshrl.models.kv_cache import TIME_MAJOR, TRANSPOSED, key_layout_for, write
from meshrl.tests.trees import assert_trees_close

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, max_position_embeddings=640)
SCAN = dataclasses.replace(CFG, scan_layers=True)
# float32, the same products; only the contraction's operand layout differs.
RTOL, ATOL = 1e-5, 1e-5


def _random_cache(cfg: ModelConfig, batch: int, max_len: int, seed: int) -> KVCache:
    rng = np.random.default_rng(seed)
    empty = KVCache.init(cfg, batch, max_len)
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), jnp.float32), empty)


def _assert_same(time_major: KVCache, transposed: KVCache, atol: float = 0.0) -> None:
    """Entry by entry; ``atol`` where a forward wrote them (the layouts' attention sums in
    another order, so later layers' entries differ in the last bits)."""
    assert (time_major.key_layout, transposed.key_layout) == (TIME_MAJOR, TRANSPOSED)
    back = time_major.with_key_layout(TRANSPOSED)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=atol), back,
                 transposed)


@pytest.mark.parametrize("cfg", [CFG, SCAN], ids=["per_layer", "stacked"])
def test_every_cache_operation_gives_the_same_entries_in_both_key_layouts(cfg):
    full, part = _random_cache(cfg, 6, 16, seed=1), _random_cache(cfg, 3, 8, seed=2)
    if cfg.scan_layers:
        full, part = full.stacked(), part.stacked()
    t_full, t_part = full.with_key_layout(TIME_MAJOR), part.with_key_layout(TIME_MAJOR)
    start_B, slots_N = jnp.array([0, 3, 7]), jnp.array([5, 6, 1])  # 6: dropped
    rows_R = jnp.array([4, 0, 6])  # 6: a padding row (read clipped, written nowhere)

    assert (t_full.slots, t_full.max_len) == (full.slots, full.max_len) == (6, 16)
    assert t_full.layer(1)[0].shape == KVCache.shapes(cfg, 6, 16, TIME_MAJOR)[0]
    _assert_same(t_full.window(8, rows_R), full.window(8, rows_R))
    _assert_same(t_full.put_band(t_part, start_B, 3, rows_R),
                 full.put_band(part, start_B, 3, rows_R))
    _assert_same(t_full.put_slots(t_part, slots_N), full.put_slots(part, slots_N))
    # A part in the other layout (the prefill's temporary cache) is transposed on the way in.
    _assert_same(t_full.put_slots(part, slots_N), full.put_slots(part, slots_N))


@pytest.mark.parametrize("layout", [TRANSPOSED, TIME_MAJOR])
@pytest.mark.parametrize("cfg", [CFG, SCAN], ids=["per_layer", "stacked"])
def test_write_puts_each_tokens_kv_heads_at_its_slot_and_position_and_drops_past_the_end(
        cfg, layout):
    B, L, T, K, H = 3, 2, 8, CFG.num_kv_heads, CFG.resolved_head_dim
    rng = np.random.default_rng(4)
    k_BxLxKxH, v_BxLxKxH = (rng.standard_normal((B, L, K, H)).astype(np.float32)
                            for _ in range(2))
    pos_BxL = np.array([[0, 1], [5, 6], [7, 8]], np.int32)  # 8: past the end, dropped
    want_k, want_v = np.zeros((B, K, T, H), np.float32), np.zeros((B, K, T, H), np.float32)
    for b, i in np.ndindex(B, L):
        t = pos_BxL[b, i]
        if t < T:
            want_k[b, :, t], want_v[b, :, t] = k_BxLxKxH[b, i], v_BxLxKxH[b, i]

    cache = write(KVCache.init(cfg, B, T, key_layout=layout), 1, jnp.asarray(k_BxLxKxH),
                  jnp.asarray(v_BxLxKxH), jnp.asarray(pos_BxL))

    assert cache.key_layout == layout and cache.is_stacked == cfg.scan_layers
    keys, values = cache.with_key_layout(TIME_MAJOR).layer(1)
    np.testing.assert_array_equal(np.asarray(keys), want_k)
    np.testing.assert_array_equal(np.asarray(values), want_v)
    assert not np.any(np.asarray(cache.layer(0)[0])) and not np.any(np.asarray(cache.layer(0)[1]))


def _prefill_then_decode(cfg: ModelConfig, cache: KVCache, ids_BxL: np.ndarray, prompt: int
                         ) -> tuple[list[np.ndarray], KVCache]:
    graphdef, params = split_model(create_model(cfg, seed=3))
    step = jax.jit(forward, static_argnums=0, donate_argnames=("cache",))
    outs = []
    for lo, hi in [(0, prompt)] + [(t, t + 1) for t in range(prompt, ids_BxL.shape[1])]:
        pos_BxL = np.broadcast_to(np.arange(lo, hi, dtype=np.int32), (ids_BxL.shape[0], hi - lo))
        logits_BxLxV, cache = step(graphdef, params, ids_BxL[:, lo:hi], pos_BxL, None, cache)
        outs.append(np.asarray(jax.nn.log_softmax(logits_BxLxV)))
    return outs, cache


@pytest.mark.parametrize("cfg, prompt", [(CFG, 5), pytest.param(SCAN, 5, marks=pytest.mark.slow), (CFG, 520)],
                         ids=["per_layer", "stacked", "blockwise_prefill"])
def test_cached_decode_gives_the_same_tokens_and_logprobs_in_both_key_layouts(cfg, prompt):
    ids_BxL = np.random.default_rng(0).integers(0, 64, (2, prompt + 4)).astype(np.int32)
    T = prompt + 8

    want, cache = _prefill_then_decode(cfg, KVCache.init(cfg, 2, T), ids_BxL, prompt)
    got, t_cache = _prefill_then_decode(cfg, KVCache.init(cfg, 2, T, key_layout=TIME_MAJOR),
                                        ids_BxL, prompt)

    assert t_cache.key_layout == TIME_MAJOR and t_cache.k[0].shape == t_cache.v[0].shape
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.argmax(-1), w.argmax(-1))  # the greedy tokens
    assert_trees_close(got, want, rtol=RTOL, atol=ATOL)
    _assert_same(t_cache, cache, atol=ATOL)


def test_key_layout_follows_the_mesh_platform_and_shardings_match_init():
    mesh = create_mesh(MeshConfig(data=1, tensor=1), jax.devices()[:1])

    sh = KVCache.shardings(CFG, 4, 16, mesh, rules_for("sample"))
    forced = KVCache.shardings(CFG, 4, 16, mesh, rules_for("sample"), key_layout=TIME_MAJOR)
    cache = jax.jit(lambda: KVCache.init(CFG, 4, 16, key_layout=forced.key_layout),
                    out_shardings=forced)()

    assert key_layout_for(mesh) == TRANSPOSED == sh.key_layout  # a CPU mesh
    assert cache.key_layout == TIME_MAJOR and cache.k[0].shape == (4, 2, 16, 8)


def test_unknown_key_layout_is_rejected_naming_the_value_and_the_choices():
    with pytest.raises(ValueError, match=r"key_layout: 'BTKH': must be one of \['BKHT', 'BKTH'\]"):
        KVCache.init(CFG, 2, 8, key_layout="BTKH")
    with pytest.raises(ValueError, match="key_layout: 'BTKH'"):
        KVCache.init(CFG, 2, 8).with_key_layout("BTKH")
