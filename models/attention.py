"""Grouped-query self-attention with RoPE, optional q/k/v bias and per-head q/k RMSNorm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from meshrl.configs.schema import ModelConfig
from meshrl.models import kv_cache as kvc
from meshrl.models.layers import Projection, RMSNorm, dtype_of
from meshrl.models.rope import apply_rope
from meshrl.models.sharding import ShardingContext, constrain

# Finite mask value: a fully masked row (padding) gives a uniform average instead of NaN.
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, sharding: ShardingContext | None):
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
        pd, cd = dtype_of(cfg.param_dtype), dtype_of(cfg.compute_dtype)
        kw = dict(rngs=rngs, param_dtype=pd, compute_dtype=cd)
        self.q = Projection((D,), (N, H), ("embed",), ("heads", "head_dim"),
                            use_bias=cfg.attention_bias, **kw)
        self.k = Projection((D,), (K, H), ("embed",), ("kv_heads", "head_dim"),
                            use_bias=cfg.attention_bias, **kw)
        self.v = Projection((D,), (K, H), ("embed",), ("kv_heads", "head_dim"),
                            use_bias=cfg.attention_bias, **kw)
        self.o = Projection((N, H), (D,), ("heads", "head_dim"), ("embed",), use_bias=False, **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(H, cfg.rms_norm_eps, "head_dim", rngs=rngs, param_dtype=pd)
            self.k_norm = RMSNorm(H, cfg.rms_norm_eps, "head_dim", rngs=rngs, param_dtype=pd)
        else:
            self.q_norm = None
            self.k_norm = None
        self.num_kv_heads, self.head_dim = K, H
        self.compute_dtype = cd
        self.sharding = sharding

    def __call__(self, x_BxLxD: jax.Array, cos_BxLxH: jax.Array, sin_BxLxH: jax.Array,
                 positions_BxL: jax.Array, segment_ids_BxL: jax.Array,
                 cache: kvc.KVCache | None = None, layer: int | jax.Array = 0,
                 ) -> tuple[jax.Array, kvc.KVCache | None]:
        """Without a cache: causal within equal segment ids (packing). With a ``KVCache``
        (stacked over layers): write this layer's k/v at ``positions`` and attend to entries at
        cache index <= the query's position. Returns (output [B, L, D], updated cache or None).
        """
        ctx = self.sharding
        q_BxLxNxH = constrain(self.q(x_BxLxD), ("batch", "length", "act_heads", "head_dim"), ctx)
        k_BxLxKxH = constrain(self.k(x_BxLxD), ("batch", "length", "act_kv_heads", "head_dim"),
                              ctx)
        v_BxLxKxH = constrain(self.v(x_BxLxD), ("batch", "length", "act_kv_heads", "head_dim"),
                              ctx)
        if self.q_norm is not None:
            q_BxLxNxH, k_BxLxKxH = self.q_norm(q_BxLxNxH), self.k_norm(k_BxLxKxH)
        q_BxLxNxH = apply_rope(q_BxLxNxH, cos_BxLxH, sin_BxLxH)
        k_BxLxKxH = apply_rope(k_BxLxKxH, cos_BxLxH, sin_BxLxH)

        if cache is None:
            L = x_BxLxD.shape[1]
            causal_LxL = jnp.tril(jnp.ones((L, L), bool))
            same_seg_BxLxL = segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :]
            mask_BxLxT = causal_LxL[None] & same_seg_BxLxL
            out_BxLxNxH = _attend(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, mask_BxLxT)
        else:
            cache = kvc.write(cache, layer, k_BxLxKxH, v_BxLxKxH, positions_BxL)
            keys_BxKxHxT, values_BxKxTxH = cache.layer(layer)
            T = keys_BxKxHxT.shape[-1]
            mask_BxLxT = jnp.arange(T)[None, None, :] <= positions_BxL[:, :, None]
            out_BxLxNxH = _attend_cache(q_BxLxNxH, keys_BxKxHxT.astype(self.compute_dtype),
                                        values_BxKxTxH.astype(self.compute_dtype), mask_BxLxT)
        out_BxLxNxH = constrain(out_BxLxNxH, ("batch", "length", "act_heads", "head_dim"), ctx)
        return self.o(out_BxLxNxH), cache


def _attend(q_BxLxNxH: jax.Array, k_BxTxKxH: jax.Array, v_BxTxKxH: jax.Array,
            mask_BxLxT: jax.Array) -> jax.Array:
    """Softmax attention with GQA; scores and softmax in float32 (as HF eager)."""
    B, L, N, H = q_BxLxNxH.shape
    K = k_BxTxKxH.shape[2]
    if K == N:  # no GQA: 4-D einsums; the 5-D form's unit group axis cost extra transposes
        scores_BxNxLxT = jnp.einsum("blnh,btnh->bnlt", q_BxLxNxH, k_BxTxKxH,
                                    preferred_element_type=jnp.float32) * (H ** -0.5)
        scores_BxNxLxT = jnp.where(mask_BxLxT[:, None], scores_BxNxLxT, _MASK_VALUE)
        probs_BxNxLxT = jax.nn.softmax(scores_BxNxLxT, axis=-1).astype(v_BxTxKxH.dtype)
        return jnp.einsum("bnlt,btnh->blnh", probs_BxNxLxT, v_BxTxKxH)
    q_BxLxKxGxH = q_BxLxNxH.reshape(B, L, K, N // K, H)
    scores_BxKxGxLxT = jnp.einsum("blkgh,btkh->bkglt", q_BxLxKxGxH, k_BxTxKxH,
                                  preferred_element_type=jnp.float32) * (H ** -0.5)
    scores_BxKxGxLxT = jnp.where(mask_BxLxT[:, None, None], scores_BxKxGxLxT, _MASK_VALUE)
    probs = jax.nn.softmax(scores_BxKxGxLxT, axis=-1).astype(v_BxTxKxH.dtype)
    out_BxLxKxGxH = jnp.einsum("bkglt,btkh->blkgh", probs, v_BxTxKxH)
    return out_BxLxKxGxH.reshape(B, L, N, H)


def _attend_cache(q_BxLxNxH: jax.Array, k_BxKxHxT: jax.Array, v_BxKxTxH: jax.Array,
                  mask_BxLxT: jax.Array) -> jax.Array:
    """Attention over the cache layout: (B, K) batch dims, canonical matmul operands, so the
    cache is read in place (only the few queries are transposed)."""
    B, L, N, H = q_BxLxNxH.shape
    K, T = k_BxKxHxT.shape[1], k_BxKxHxT.shape[-1]
    G = N // K
    q_BxKxQxH = q_BxLxNxH.reshape(B, L, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * L, H)
    scores_BxKxQxT = jnp.einsum("bkqh,bkht->bkqt", q_BxKxQxH, k_BxKxHxT,
                                preferred_element_type=jnp.float32) * (H ** -0.5)
    scores_BxKxGxLxT = scores_BxKxQxT.reshape(B, K, G, L, T)
    scores_BxKxGxLxT = jnp.where(mask_BxLxT[:, None, None], scores_BxKxGxLxT, _MASK_VALUE)
    probs_BxKxQxT = jax.nn.softmax(scores_BxKxGxLxT, axis=-1).astype(v_BxKxTxH.dtype).reshape(
        B, K, G * L, T)
    out_BxKxQxH = jnp.einsum("bkqt,bkth->bkqh", probs_BxKxQxT, v_BxKxTxH)
    return out_BxKxQxH.reshape(B, K, G, L, H).transpose(0, 3, 1, 2, 4).reshape(B, L, N, H)
