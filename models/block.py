"""One pre-norm decoder layer (attention, then a dense or MoE FFN) and its helpers."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl.configs.schema import ModelConfig
from meshrl.models.attention import Attention
from meshrl.models.kv_cache import KVCache
from meshrl.models.layers import MLP, RMSNorm, dtype_of
from meshrl.models.moe import MoE
from meshrl.models.moe_math import RouterStats
from meshrl.models.sharding import ShardingContext, constrain


class Block(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)); x + mlp(norm(x)), the MLP dense or MoE
    (``cfg.is_sparse_layer(layer)``). Returns (x, cache, router stats, the experts each token
    went to [B, L, k]); the last two are None in a dense layer. ``replay_BxLxK`` (MoE layers):
    routing replay, ``moe_math.route``."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, sharding: ShardingContext | None,
                 layer: int = 0):
        pd, cd = dtype_of(cfg.param_dtype), dtype_of(cfg.compute_dtype)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", rngs=rngs,
                                 param_dtype=pd)
        self.attn = Attention(cfg, rngs=rngs, sharding=sharding)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", rngs=rngs,
                                param_dtype=pd)
        self.mlp = (MoE(cfg, rngs=rngs, sharding=sharding) if cfg.is_sparse_layer(layer) else
                    MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, param_dtype=pd,
                        chunk=cfg.mlp_chunk, compute_dtype=cd, sharding=sharding))
        self.sharding = sharding

    def __call__(self, x_BxLxD: jax.Array, cos_BxLxH: jax.Array, sin_BxLxH: jax.Array,
                 positions_BxL: jax.Array, segment_ids_BxL: jax.Array,
                 cache: KVCache | None = None, layer: int | jax.Array = 0,
                 replay_BxLxK: jax.Array | None = None,
                 ) -> tuple[jax.Array, KVCache | None, RouterStats | None, jax.Array | None]:
        h, cache = self.attn(self.attn_norm(x_BxLxD), cos_BxLxH, sin_BxLxH, positions_BxL,
                             segment_ids_BxL, cache, layer)
        x_BxLxD = constrain(x_BxLxD + h, ("batch", "length", "act_embed"), self.sharding)
        stats = experts = None
        if isinstance(self.mlp, MoE):
            h, stats, experts = self.mlp(self.mlp_norm(x_BxLxD), segment_ids_BxL > 0,
                                         replay_BxLxK)
        else:
            h = self.mlp(self.mlp_norm(x_BxLxD))
        x_BxLxD = constrain(x_BxLxD + h, ("batch", "length", "act_embed"), self.sharding)
        return x_BxLxD, cache, stats, experts


def run_block(block: Block, x: jax.Array, cos: jax.Array, sin: jax.Array, pos: jax.Array,
              seg: jax.Array, replay: jax.Array | None = None,
              ) -> tuple[jax.Array, RouterStats | None, jax.Array | None]:
    """The block without a cache (the remat-able form): (x, router stats, experts)."""
    x, _, stats, experts = block(x, cos, sin, pos, seg, None, 0, replay)
    return x, stats, experts


def add_stats(total: RouterStats | None, stats: RouterStats | None) -> RouterStats | None:
    if stats is None:
        return total
    return stats if total is None else jax.tree.map(jnp.add, total, stats)
