"""Static-shape KV cache for the sampler.

Layout: ``k``/``v`` of shape [layers, slots B, max_len T, kv_heads K, head_dim H] (stacked over
layers so one sharding covers the whole cache). Entry ``[l, b, t]`` holds the key/value of the
token at *position* t of the sequence in slot b: the forward writes each token at its position
and a query at position p attends to entries t <= p. A new sequence in a slot therefore needs no
reset as long as it is written from position 0 upward (prompts right-padded; padding positions
are overwritten by the decoded tokens that take them).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from meshrl.configs.schema import ModelConfig
from meshrl.mesh.rules import Rules, logical_to_sharding

CACHE_AXES = ("layers", "cache_slots", "cache_len", "kv_heads", "head_dim")


@struct.dataclass
class KVCache:
    """Keys and values, each [layers L, slots B, max_len T, kv_heads K, head_dim H]."""

    k: jax.Array  # L x B x T x K x H
    v: jax.Array  # L x B x T x K x H

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int,
             dtype: jnp.dtype | str = jnp.float32) -> KVCache:
        shape = cls.shape(cfg, batch, max_len)
        return cls(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    @staticmethod
    def shape(cfg: ModelConfig, batch: int, max_len: int) -> tuple[int, ...]:
        return (cfg.num_layers, batch, max_len, cfg.num_kv_heads, cfg.resolved_head_dim)

    @classmethod
    def shardings(cls, cfg: ModelConfig, batch: int, max_len: int, mesh: Mesh,
                  rules: Rules) -> KVCache:
        """A KVCache of NamedShardings (for jit in/out_shardings)."""
        s = logical_to_sharding(CACHE_AXES, mesh, rules, cls.shape(cfg, batch, max_len))
        return cls(s, s)

    @property
    def max_len(self) -> int:
        return self.k.shape[2]


def write(cache_LxBxTxKxH: jax.Array, layer: int, new_BxLxKxH: jax.Array,
          positions_BxL: jax.Array) -> jax.Array:
    """Scatter new entries of one layer at their positions (in place under jit + donation).

    Positions outside [0, T) are dropped, so padding tokens past the cache end are harmless.
    """
    b_BxL = jnp.broadcast_to(jnp.arange(new_BxLxKxH.shape[0])[:, None], positions_BxL.shape)
    return cache_LxBxTxKxH.at[layer, b_BxL, positions_BxL].set(
        new_BxLxKxH.astype(cache_LxBxTxKxH.dtype), mode="drop")
