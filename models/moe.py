"""The MoE FFN layer (Qwen3-MoE, Mixtral); ``ModelConfig.is_sparse_layer`` says which layers.

``MoE(x_BxLxD, mask_BxL) -> (y_BxLxD, RouterStats)``. Params: ``router`` [D, E] (replicated),
``gate``/``up`` [E, D, F] and ``down`` [E, F, D], the expert dim on logical ``exp`` (mesh
``expert``) and F on ``mlp_moe`` (mesh ``expert_tensor``). On a mesh the grouped path runs in
``jax.shard_map`` over the whole mesh (``moe_math`` has the math): each shard routes its own
tokens, exchanges the copies with the ``expert`` shards in an all-to-all and sums the FFN-width
slices over ``expert_tensor``. ``model.moe_impl = dense`` is the masked every-expert baseline,
left to XLA's partitioner.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from meshrl.configs.cross_section import check_moe_mesh
from meshrl.configs.schema import ModelConfig
from meshrl.models.layers import dtype_of, param
from meshrl.models.moe_math import MoESpec, RouterStats, dense_moe_ffn, moe_ffn
from meshrl.models.sharding import ShardingContext

STAT_KEYS = ("counts", "prob_sum", "rows", "z_sum", "dropped")


def resolved_impl(cfg: ModelConfig) -> str:
    """``auto``: ragged_dot where XLA has a grouped kernel (TPU, GPU), else blocked (CPU, where
    ragged_dot becomes a dense loop over all experts)."""
    if cfg.moe_impl != "auto":
        return cfg.moe_impl
    return "blocked" if jax.default_backend() == "cpu" else "ragged_dot"


def zero_stats(num_experts: int) -> RouterStats:
    return {"counts": jnp.zeros((num_experts,)), "prob_sum": jnp.zeros((num_experts,)),
            "rows": jnp.zeros(()), "z_sum": jnp.zeros(()), "dropped": jnp.zeros(())}


class MoE(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, sharding: ShardingContext | None):
        pd = dtype_of(cfg.param_dtype)
        E, D, F = cfg.num_experts, cfg.hidden_size, cfg.resolved_moe_intermediate_size
        self.router = param(rngs, (D, E), ("embed", None), pd)
        self.gate = param(rngs, (E, D, F), ("exp", "embed", "mlp_moe"), pd)
        self.up = param(rngs, (E, D, F), ("exp", "embed", "mlp_moe"), pd)
        self.down = param(rngs, (E, F, D), ("exp", "mlp_moe", "embed"), pd)
        self.cfg, self.sharding = cfg, sharding
        if sharding is not None:
            shape = sharding.mesh.shape
            check_moe_mesh(E, F, expert=shape["expert"], expert_tensor=shape["expert_tensor"])

    def spec(self, ep_axis: str | None = None, ep_size: int = 1,
             et_axis: str | None = None) -> MoESpec:
        c = self.cfg
        impl = resolved_impl(c)
        return MoESpec(c.num_experts, c.num_experts_per_tok, c.norm_topk_prob, c.router,
                       "blocked" if impl == "dense" else impl, c.capacity_factor,
                       ep_axis, ep_size, et_axis)

    def __call__(self, x_BxLxD: jax.Array, mask_BxL: jax.Array,
                 replay_BxLxK: jax.Array | None = None,
                 ) -> tuple[jax.Array, RouterStats, jax.Array]:
        """(y, router stats, the experts each token went to [B, L, k]); ``replay_BxLxK``
        routes the tokens whose row holds ids to those experts (``moe_math.route``)."""
        B, L, D = x_BxLxD.shape
        k = self.cfg.num_experts_per_tok
        cd = dtype_of(self.cfg.compute_dtype)
        x_BxLxD = x_BxLxD.astype(cd)
        weights = (self.router[...], self.gate[...], self.up[...], self.down[...])
        replay = None if replay_BxLxK is None else replay_BxLxK.reshape(B * L, k)
        if self.sharding is None or resolved_impl(self.cfg) == "dense":
            fn = dense_moe_ffn if resolved_impl(self.cfg) == "dense" else moe_ffn
            y, stats, experts = fn(x_BxLxD.reshape(B * L, D), mask_BxL.reshape(-1), *weights,
                                   self.spec(), replay)
            return y.reshape(B, L, D), stats, experts.reshape(B, L, k)
        return self._sharded(x_BxLxD, mask_BxL, weights, replay_BxLxK)

    def _sharded(self, x_BxLxD: jax.Array, mask_BxL: jax.Array, weights: tuple[jax.Array, ...],
                 replay_BxLxK: jax.Array | None,
                 ) -> tuple[jax.Array, RouterStats, jax.Array]:
        ctx = self.sharding
        assert ctx is not None
        mesh = ctx.mesh
        x_spec = ctx.sharding(("batch", "length", "act_embed"), x_BxLxD.shape).spec
        ep = "expert" if mesh.shape["expert"] > 1 else None
        et = "expert_tensor" if mesh.shape["expert_tensor"] > 1 else None
        spec = self.spec(ep, mesh.shape["expert"], et)
        k = spec.top_k
        # The axes this shard's tokens are split over: router sums add over exactly these.
        token_axes = tuple(a for part in x_spec[:2] if part is not None
                           for a in ((part,) if isinstance(part, str) else part))

        def local(x, m, r, g, u, d, *rep):
            b, n, D = x.shape
            y, stats, experts = moe_ffn(x.reshape(b * n, D), m.reshape(-1), r, g, u, d, spec,
                                        rep[0].reshape(b * n, k) if rep else None)
            if token_axes:
                stats = jax.lax.psum(stats, token_axes)
            return y.reshape(b, n, D), stats, experts.reshape(b, n, k)

        w_in, w_out = P(ep, None, et), P(ep, et, None)
        tok_spec = P(*x_spec[:2], None)
        replay = () if replay_BxLxK is None else (replay_BxLxK,)
        # check_vma off: where the batch cannot be split over ``expert`` (a small decode), every
        # expert shard routes the same tokens and gets the same result back, which the vma
        # types cannot see through the all-to-all.
        return jax.shard_map(local, mesh=mesh,
                             in_specs=(x_spec, P(*x_spec[:2]), P(), w_in, w_in, w_out)
                             + (tok_spec,) * len(replay),
                             out_specs=(x_spec, P(), tok_spec), check_vma=False)(
            x_BxLxD, mask_BxL, *weights, *replay)
