"""Laws of the decoder: causality, packing equals separate sequences, KV-cache decode equals
the full forward, remat does not change values."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from meshrl.configs.schema import ModelConfig
from meshrl.models import Decoder, KVCache, create_model, forward, split_model
from meshrl.tests.models.conftest import random_ids
from meshrl.tests.models.layer_stacking import stacked_like
from meshrl.tests.trees import assert_trees_close

RTOL, ATOL = 1e-5, 1e-5  # float32, same math in a different order/shape only

CONFIGS = {
    "llama3_rope": ModelConfig(arch="llama", vocab_size=128, rope_scaling="llama3",
                               rope_scaling_factor=8.0, rope_original_max_position=16),
    "qwen2_tied": ModelConfig(arch="qwen2", vocab_size=128, attention_bias=True,
                              tie_embeddings=True),
    "qwen3": ModelConfig(arch="qwen3", vocab_size=128, qk_norm=True, head_dim=32),
    "qwen3_scan": ModelConfig(arch="qwen3", vocab_size=128, qk_norm=True, head_dim=32,
                              scan_layers=True),
}
UNROLLED = ["llama3_rope", "qwen2_tied", "qwen3"]


def _default_only(names: list[str], *keep: str) -> list:
    """``names`` as parameters, those not in ``keep`` marked slow (the default run keeps one
    model per property; ``-m slow`` checks every config)."""
    return [n if n in keep else pytest.param(n, marks=pytest.mark.slow) for n in names]


@functools.cache
def _model(cfg: ModelConfig, seed: int = 0) -> Decoder:
    """Random model with weights large enough that every logit depends visibly on context.

    Cached per config: tests only read it.
    """
    graphdef, params = split_model(create_model(cfg, seed=seed))
    return nnx.merge(graphdef, _perturb(params, jax.random.key(seed + 1)))


@jax.jit
def _perturb(params: nnx.State, key: jax.Array) -> nnx.State:
    keys = iter(jax.random.split(key, len(jax.tree.leaves(params))))
    return jax.tree.map(lambda p: p + 0.2 * jax.random.normal(next(keys), p.shape, p.dtype),
                        params)


def _unstacked_like(params: nnx.State, stacked: nnx.State) -> nnx.State:
    flat = dict(nnx.to_flat_state(stacked))
    out = jax.tree.map(lambda x: x, params)
    for key, var in nnx.to_flat_state(out):
        if key[0] == "layers":
            var.set_value(flat[("layers", *key[2:])][...][key[1]])
        else:
            var.set_value(flat[key][...])
    return out


_jit_forward = jax.jit(forward, static_argnums=0)


def _logits(model: Decoder, ids, positions=None, segments=None) -> np.ndarray:
    """Jitted forward (eager op-by-op dispatch is far slower on CPU)."""
    graphdef, params = split_model(model)
    return np.asarray(_jit_forward(graphdef, params, ids, positions, segments))


@pytest.mark.parametrize("name", _default_only(UNROLLED, "llama3_rope"))
def test_changing_future_tokens_leaves_past_logits_unchanged(name):
    model = _model(CONFIGS[name])
    ids_BxL = random_ids(2, 10)
    changed_BxL = ids_BxL.copy()
    changed_BxL[:, 6:] = (changed_BxL[:, 6:] + 7) % 128

    a, b = _logits(model, ids_BxL), _logits(model, changed_BxL)

    np.testing.assert_allclose(a[:, :6], b[:, :6], rtol=RTOL, atol=ATOL)
    assert np.abs(a[:, 6:] - b[:, 6:]).max() > 1e-3  # the future did change


@pytest.mark.parametrize("name", _default_only(sorted(CONFIGS), "llama3_rope"))
def test_packed_segments_equal_separate_sequences(name):
    model = _model(CONFIGS[name])
    seq_a, seq_b = random_ids(1, 5, seed=1)[0], random_ids(1, 4, seed=2)[0]
    packed_1xL = np.concatenate([seq_a, seq_b, np.zeros(3, np.int32)])[None]
    positions_1xL = np.concatenate([np.arange(5), np.arange(4), np.arange(3)])[None]
    segments_1xL = np.array([[1] * 5 + [2] * 4 + [0] * 3])

    packed = _logits(model, packed_1xL, positions_1xL, segments_1xL)[0]

    np.testing.assert_allclose(packed[:5], _logits(model, seq_a[None])[0], rtol=RTOL,
                               atol=ATOL)
    np.testing.assert_allclose(packed[5:9], _logits(model, seq_b[None])[0], rtol=RTOL,
                               atol=ATOL)
    assert np.isfinite(packed).all()  # padding rows stay finite


@pytest.mark.parametrize("name", _default_only(sorted(CONFIGS), "llama3_rope"))
def test_kv_cache_prefill_then_token_by_token_decode_equals_full_forward(name):
    cfg = CONFIGS[name]
    model = _model(cfg)
    graphdef, params = split_model(model)
    T, prompt_lens, total = 16, np.array([5, 3]), 11
    ids_BxL = random_ids(2, total, seed=3)
    full_BxLxV = _logits(model, ids_BxL)

    step = jax.jit(forward, static_argnums=0, donate_argnames=("cache",))
    cache = KVCache.init(cfg, batch=2, max_len=T, dtype=jnp.float32)
    # Prefill: prompts right-padded to 5; slot 1's padding at positions 3, 4 gets overwritten.
    prompt_BxP = ids_BxL[:, :5]
    positions_BxP = np.broadcast_to(np.arange(5, dtype=np.int32), (2, 5))
    logits_BxPxV, cache = step(graphdef, params, prompt_BxP, positions_BxP, None, cache)
    for b, n in enumerate(prompt_lens):
        np.testing.assert_allclose(np.asarray(logits_BxPxV)[b, :n], full_BxLxV[b, :n],
                                   rtol=RTOL, atol=ATOL)
    # Decode: each slot continues from its own position.
    pos_B = prompt_lens.astype(np.int32)
    while pos_B.max() < total:
        tok_Bx1 = ids_BxL[np.arange(2), np.minimum(pos_B, total - 1)][:, None]
        logits_Bx1xV, cache = step(graphdef, params, tok_Bx1, pos_B[:, None], None, cache)
        for b in range(2):
            if pos_B[b] < total:
                np.testing.assert_allclose(np.asarray(logits_Bx1xV)[b, 0],
                                           full_BxLxV[b, pos_B[b]], rtol=RTOL, atol=ATOL)
        pos_B = pos_B + 1
    assert len(cache.k) == cfg.num_layers
    assert cache.k[0].shape == (2, cfg.num_kv_heads, cfg.resolved_head_dim, T)
    assert cache.v[0].shape == (2, cfg.num_kv_heads, T, cfg.resolved_head_dim)


def _loss(params: nnx.State, graphdef: nnx.GraphDef, ids_BxL: jax.Array) -> jax.Array:
    return jnp.mean(jax.nn.logsumexp(forward(graphdef, params, ids_BxL), axis=-1))


# Module-level so the un-rematted baseline compiles once for all cases.
_value_and_grad = jax.jit(jax.value_and_grad(_loss), static_argnums=1)


@pytest.mark.parametrize("remat, scan", [("full", False), pytest.param("dots", False, marks=pytest.mark.slow),
                                         ("dots", True)])
def test_remat_and_scan_keep_logits_and_gradients(remat, scan):
    cfg = CONFIGS["qwen3"]
    ids_BxL = random_ids(2, 8)
    base = _model(cfg)
    graphdef, params = split_model(base)
    remat_cfg = dataclasses.replace(cfg, remat=remat, scan_layers=scan)
    remat_graphdef, remat_params = split_model(_model(remat_cfg))
    if scan:  # same weights, stacked over a leading layers axis
        remat_params = stacked_like(params, remat_params)

    value, grads = _value_and_grad(params, graphdef, ids_BxL)
    r_value, r_grads = _value_and_grad(remat_params, remat_graphdef, ids_BxL)
    if scan:
        r_grads = _unstacked_like(grads, r_grads)

    np.testing.assert_allclose(r_value, value, rtol=RTOL, atol=ATOL)
    assert_trees_close(r_grads, grads, rtol=1e-4, atol=1e-5)


def test_bfloat16_compute_runs_and_stays_close_to_float32():
    cfg = CONFIGS["llama3_rope"]
    model = _model(cfg)
    graphdef, params = split_model(model)
    bf16_graphdef, _ = split_model(create_model(dataclasses.replace(cfg,
                                                                    compute_dtype="bfloat16")))
    ids_BxL = random_ids(2, 8)

    logits_bf16 = _jit_forward(bf16_graphdef, params, ids_BxL)

    assert logits_bf16.dtype == jnp.bfloat16
    # bfloat16 keeps ~3 significant digits; the logits here are O(1).
    np.testing.assert_allclose(np.asarray(logits_bf16, np.float32),
                               _logits(model, ids_BxL), rtol=0.1, atol=0.15)
