"""Paged KV cache: a pool of fixed-size pages shared by all sequences, and attention over it.

Per layer the pool holds keys and values as ``[num_pages P, page_size S, kv_heads K,
head_dim H]``. A sequence owns the pages listed in its row of the page table
``[slots B, pages_per_seq M]`` (int32): token at position t of slot b lives at
``page_table[b, t // S]``, offset ``t % S``. Pages need not be contiguous or in order, and two
slots may list the same page (a shared prompt prefix), so memory follows the tokens actually
held instead of ``slots x max_len``.

Compiled programs depend only on (B, M, L, P, S): any mix of sequence lengths runs in one
program, the lengths are data. The attention here is portable JAX (a gather of each slot's
pages, then masked softmax) for one query per sequence (decode) and for a chunk of L queries
per sequence (chunked prefill, causal by position).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from meshrl.configs.schema import ModelConfig
from meshrl.mesh.rules import Rules, logical_to_sharding

# Pages and their offsets are not sharded: any device may own any sequence's pages. Heads
# shard over ``tensor`` like the dense cache.
PAGE_AXES = (None, None, "kv_heads", "head_dim")
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


@struct.dataclass
class PagedKVCache:
    """Per layer: keys and values [P, S, K, H] (a tuple with one array per layer)."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @classmethod
    def init(cls, cfg: ModelConfig, num_pages: int, page_size: int,
             dtype: jnp.dtype | str = jnp.float32) -> PagedKVCache:
        shape = cls.shape(cfg, num_pages, page_size)
        return cls(tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)),
                   tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers)))

    @staticmethod
    def shape(cfg: ModelConfig, num_pages: int, page_size: int) -> tuple[int, int, int, int]:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"paged cache: num_pages={num_pages}, page_size={page_size}: "
                             f"both must be >= 1")
        return num_pages, page_size, cfg.num_kv_heads, cfg.resolved_head_dim

    @classmethod
    def shardings(cls, cfg: ModelConfig, num_pages: int, page_size: int, mesh: Mesh,
                  rules: Rules) -> PagedKVCache:
        """A PagedKVCache of NamedShardings (for jit in/out_shardings)."""
        sh = logical_to_sharding(PAGE_AXES, mesh, rules, cls.shape(cfg, num_pages, page_size))
        return cls((sh,) * cfg.num_layers, (sh,) * cfg.num_layers)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[0]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[1]

    def layer(self, layer: int) -> tuple[jax.Array, jax.Array]:
        return self.k[layer], self.v[layer]


def slot_index(page_table_BxM: jax.Array, positions_BxL: jax.Array, page_size: int,
               ) -> tuple[jax.Array, jax.Array]:
    """(page, offset) of each position. Positions < 0 or past the table get page index P
    (out of range), which ``write`` drops: padding tokens never touch another sequence's page."""
    M = page_table_BxM.shape[1]
    logical_BxL = positions_BxL // page_size
    valid_BxL = (positions_BxL >= 0) & (logical_BxL < M)
    page_BxL = jnp.take_along_axis(page_table_BxM, jnp.clip(logical_BxL, 0, M - 1), axis=1)
    page_BxL = jnp.where(valid_BxL & (page_BxL >= 0), page_BxL, jnp.iinfo(jnp.int32).max)
    return page_BxL, positions_BxL % page_size


def write(cache: PagedKVCache, layer: int, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
          positions_BxL: jax.Array, page_table_BxM: jax.Array) -> PagedKVCache:
    """Scatter one layer's new keys/values into their pages (in place under jit + donation)."""
    page_BxL, off_BxL = slot_index(page_table_BxM, positions_BxL, cache.page_size)
    k_l, v_l = cache.k[layer], cache.v[layer]
    k_l = k_l.at[page_BxL, off_BxL].set(k_BxLxKxH.astype(k_l.dtype), mode="drop")
    v_l = v_l.at[page_BxL, off_BxL].set(v_BxLxKxH.astype(v_l.dtype), mode="drop")
    return PagedKVCache(_replace(cache.k, layer, k_l), _replace(cache.v, layer, v_l))


def paged_attention(q_BxLxNxH: jax.Array, k_PxSxKxH: jax.Array, v_PxSxKxH: jax.Array,
                    page_table_BxM: jax.Array, positions_BxL: jax.Array,
                    sliding_window: int = 0) -> jax.Array:
    """Attention of each query to its own sequence's entries at positions <= its position
    (and > position - ``sliding_window`` when that is > 0). GQA: N query heads share
    K = N / G kv heads. Entries past a sequence's last written position are masked, so stale
    data in a reused page is never read. Returns [B, L, N, H]."""
    B, L, N, H = q_BxLxNxH.shape
    P, S, K, _ = k_PxSxKxH.shape
    M = page_table_BxM.shape[1]
    G = N // K
    pages_BxM = jnp.clip(page_table_BxM, 0, P - 1)
    # Gathered per slot: [B, M*S, K, H], entry t is position t of that sequence.
    k_BxTxKxH = k_PxSxKxH[pages_BxM].reshape(B, M * S, K, H)
    v_BxTxKxH = v_PxSxKxH[pages_BxM].reshape(B, M * S, K, H)
    q_BxLxKxGxH = q_BxLxNxH.reshape(B, L, K, G, H)
    scores_BxKxGxLxT = jnp.einsum("blkgh,btkh->bkglt", q_BxLxKxGxH, k_BxTxKxH,
                                  preferred_element_type=jnp.float32) * (H ** -0.5)
    t_T = jnp.arange(M * S)
    pos_BxLx1 = positions_BxL[:, :, None]
    mask_BxLxT = t_T[None, None, :] <= pos_BxLx1
    if sliding_window > 0:
        mask_BxLxT &= t_T[None, None, :] > pos_BxLx1 - sliding_window
    scores_BxKxGxLxT = jnp.where(mask_BxLxT[:, None, None], scores_BxKxGxLxT, MASK_VALUE)
    probs = jax.nn.softmax(scores_BxKxGxLxT, axis=-1).astype(v_BxTxKxH.dtype)
    out_BxLxKxGxH = jnp.einsum("bkglt,btkh->blkgh", probs, v_BxTxKxH)
    return out_BxLxKxGxH.reshape(B, L, N, H).astype(q_BxLxNxH.dtype)


def _replace(layers: tuple[jax.Array, ...], i: int, x: jax.Array) -> tuple[jax.Array, ...]:
    return layers[:i] + (x,) + layers[i + 1:]
