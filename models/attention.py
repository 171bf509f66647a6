"""Grouped-query self-attention with RoPE, optional q/k/v bias and per-head q/k RMSNorm.

``model.attention`` picks the kernel of the no-cache forward (training, logprob recompute):

* ``blockwise`` (default): ``attention_kernels.blockwise_attention``, an online softmax over
  blocks of at most ``BLOCK`` (512) queries x keys; up to 512 tokens it is the einsum reference
  itself (one block), so short sequences run exactly the old code.
* ``einsum``: the reference, the full [B, N, L, L] float32 scores.
* ``cudnn`` / ``splash``: the GPU / TPU fused kernels of ``attention_fused``; the wrong platform
  is a ``ConfigError`` naming ``model.attention`` at the first call (trace), not at build, so a
  CPU host can still build the model (export, param counts).

With a KV cache: decode (at most ``BLOCK`` queries) attends over the cache layout in one pass,
for every value; a longer prefill uses ``blockwise_cache_attention`` unless ``einsum``.
Docs: docs/attention.md.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import ModelConfig
from meshrl.models import kv_cache as kvc
from meshrl.models import paged_attention as paged
from meshrl.models import paged_kernel
from meshrl.models.attention_fused import cudnn_attention, splash_attention
from meshrl.models.attention_kernels import (
    BLOCK,
    MASK_VALUE,
    blockwise_attention,
    blockwise_cache_attention,
    causal_segment_mask,
    einsum_attention,
)
from meshrl.models.cascade_attention import CascadeWindow, cascade_attention
from meshrl.models.context_attention import context_attention, context_size, sequence_order
from meshrl.models.layers import Projection, RMSNorm, dtype_of
from meshrl.models.rope import apply_rope
from meshrl.models.sharding import ShardingContext, constrain

# Fused kernels -> (the platform they need, in words).
_PLATFORMS = {"cudnn": ("gpu", "a GPU"), "splash": ("tpu", "a TPU")}


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
        self.impl = cfg.attention
        self.context_strategy, self.context_balance = cfg.context_attention, cfg.context_balance

    def __call__(self, x_BxLxD: jax.Array, cos_BxLxH: jax.Array, sin_BxLxH: jax.Array,
                 positions_BxL: jax.Array, segment_ids_BxL: jax.Array,
                 cache: kvc.KVCache | paged.PagedKVCache | None = None,
                 layer: int | jax.Array = 0,
                 ) -> tuple[jax.Array, kvc.KVCache | paged.PagedKVCache | None]:
        """Without a cache: causal within equal segment ids (packing). With a ``KVCache``
        (stacked over layers): write this layer's k/v at ``positions`` and attend to entries at
        cache index <= the query's position; a ``PagedKVCache`` (carrying its page table) the
        same over pages. Returns (output [B, L, D], updated cache or None).
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

        B, L = segment_ids_BxL.shape
        C = context_size(ctx, (B, L)) if cache is None else 1
        if C > 1:
            # The Decoder put the sequence in this layout (``context_attention``).
            order_L = sequence_order(L, C, self.context_balance)
            out_BxLxNxH = context_attention(self.context_strategy, q_BxLxNxH, k_BxLxKxH,
                                            v_BxLxKxH, segment_ids_BxL, order_L, ctx)
        elif cache is None:
            out_BxLxNxH = self_attention(self.impl, q_BxLxNxH, k_BxLxKxH, v_BxLxKxH,
                                         segment_ids_BxL, ctx)
        elif isinstance(cache, CascadeWindow):
            cache, out_BxLxNxH = cascade_attention(cache, layer, q_BxLxNxH, k_BxLxKxH, v_BxLxKxH,
                                                   positions_BxL, self.compute_dtype)
        elif isinstance(cache, paged.PagedKVCache):
            cache = paged.write(cache, layer, k_BxLxKxH, v_BxLxKxH, positions_BxL)
            # The kernel reads each shard's pages for the rows on that shard: rows must be the
            # slots in order when the pages are sharded (a group start's rows are not).
            if (paged_kernel.applies(ctx, cache.combined, L)
                    and (cache.slot_rows or not cache.page_axes)):  # reads the pages in place
                # q takes the pool's dtype: casting the pool would copy it every step.
                pool = cache.k if cache.is_stacked else cache.k[layer]
                out_BxLxNxH = paged_kernel.sharded_ragged_paged_attention(
                    q_BxLxNxH.astype(pool.dtype), pool, cache.page_table, positions_BxL, layer,
                    ctx, page_axes=cache.page_axes).astype(self.compute_dtype)
            else:
                keys_PxSxKxH, values_PxSxKxH = cache.layer(layer)
                out_BxLxNxH = paged.paged_attention(
                    q_BxLxNxH, keys_PxSxKxH.astype(self.compute_dtype),
                    values_PxSxKxH.astype(self.compute_dtype), cache.page_table, positions_BxL)
        else:
            cache = kvc.write(cache, layer, k_BxLxKxH, v_BxLxKxH, positions_BxL)
            keys, values_BxKxTxH = cache.layer(layer)  # keys in ``cache.key_layout``
            keys = keys.astype(self.compute_dtype)
            values_BxKxTxH = values_BxKxTxH.astype(self.compute_dtype)
            if self.impl != "einsum" and x_BxLxD.shape[1] > BLOCK:
                keys_BxKxHxT = jnp.swapaxes(keys, 2, 3) if cache.keys_like_values else keys
                out_BxLxNxH = blockwise_cache_attention(q_BxLxNxH, keys_BxKxHxT, values_BxKxTxH,
                                                        positions_BxL)
            else:
                T = values_BxKxTxH.shape[2]
                mask_BxLxT = jnp.arange(T)[None, None, :] <= positions_BxL[:, :, None]
                out_BxLxNxH = _attend_cache(q_BxLxNxH, keys, values_BxKxTxH, mask_BxLxT,
                                            cache.key_layout)
        out_BxLxNxH = constrain(out_BxLxNxH, ("batch", "length", "act_heads", "head_dim"), ctx)
        return self.o(out_BxLxNxH), cache


def self_attention(impl: str, q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array,
                   v_BxLxKxH: jax.Array, segment_ids_BxL: jax.Array,
                   ctx: ShardingContext | None = None) -> jax.Array:
    """Causal attention within equal segment ids with the ``model.attention`` kernel ``impl``."""
    L = q_BxLxNxH.shape[1]
    if impl == "einsum" or (impl == "blockwise" and L <= BLOCK):
        return einsum_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH,
                                causal_segment_mask(segment_ids_BxL))
    if impl == "blockwise":
        return blockwise_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL)
    if impl not in _PLATFORMS:
        raise ConfigError(f"model.attention = {impl!r}: must be one of "
                          f"['blockwise', 'einsum', 'cudnn', 'splash']")
    check_platform(impl, _platform(ctx))
    if impl == "cudnn":
        return cudnn_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL)
    return splash_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, ctx)


def check_platform(impl: str, platform: str) -> None:
    """Raise ``ConfigError`` when kernel ``impl`` cannot run on ``platform`` ('cpu', 'gpu', ...)."""
    need = _PLATFORMS.get(impl)
    if need is not None and platform != need[0]:
        raise ConfigError(f"model.attention = {impl!r} needs {need[1]}; this run's devices are "
                          f"{platform}: use 'blockwise' (any platform) or 'einsum'")


def _platform(ctx: ShardingContext | None) -> str:
    if ctx is not None:
        return ctx.mesh.devices.flat[0].platform
    return jax.default_backend()


def _attend_cache(q_BxLxNxH: jax.Array, keys: jax.Array, v_BxKxTxH: jax.Array,
                  mask_BxLxT: jax.Array, key_layout: str = kvc.TRANSPOSED) -> jax.Array:
    """Attention over the cache layout: (B, K) batch dims, the keys contracted in the layout
    they are stored in (``key_layout``: [B, K, H, T] or [B, K, T, H]), so the cache is read in
    place (only the few queries are transposed)."""
    B, L, N, H = q_BxLxNxH.shape
    K, T = v_BxKxTxH.shape[1], v_BxKxTxH.shape[2]
    G = N // K
    q_BxKxQxH = q_BxLxNxH.reshape(B, L, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * L, H)
    spec = "bkqh,bkht->bkqt" if key_layout == kvc.TRANSPOSED else "bkqh,bkth->bkqt"
    scores_BxKxQxT = jnp.einsum(spec, q_BxKxQxH, keys,
                                preferred_element_type=jnp.float32) * (H ** -0.5)
    scores_BxKxGxLxT = scores_BxKxQxT.reshape(B, K, G, L, T)
    scores_BxKxGxLxT = jnp.where(mask_BxLxT[:, None, None], scores_BxKxGxLxT, MASK_VALUE)
    probs_BxKxQxT = jax.nn.softmax(scores_BxKxGxLxT, axis=-1).astype(v_BxKxTxH.dtype).reshape(
        B, K, G * L, T)
    out_BxKxQxH = jnp.einsum("bkqt,bkth->bkqh", probs_BxKxQxT, v_BxKxTxH)
    return out_BxKxQxH.reshape(B, K, G, L, H).transpose(0, 3, 1, 2, 4).reshape(B, L, N, H)
