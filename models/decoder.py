"""The decoder-only transformer (Llama 3.x, Qwen2/2.5, Qwen3, Qwen3-MoE, Mixtral) and its
functional helpers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from meshrl.configs.schema import ModelConfig
from meshrl.mesh.rules import Rules, rules_for
from meshrl.models.block import Block, add_stats, run_block
from meshrl.models.context_attention import check_length, context_size, sequence_order
from meshrl.models.kv_cache import KVCache
from meshrl.models.layers import RMSNorm, dtype_of, param
from meshrl.models.moe import zero_stats
from meshrl.models.moe_math import RouterStats
from meshrl.models.rope import inv_frequencies, rope_tables
from meshrl.models.sharding import ShardingContext, constrain, param_shardings

_REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer in the backward pass
    # Keep weight matmul outputs (no batch dims), recompute attention and elementwise work.
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


class Decoder(nnx.Module):
    """Token ids -> logits. ``model(ids, positions=None, segment_ids=None)`` -> logits [B, L, V];
    with ``cache=KVCache`` returns ``(logits, new_cache)``. ``return_hidden=True`` returns the
    final hidden states [B, L, D] (after the final norm) in place of the logits; ``head`` maps
    them to logits, ``head_weight`` is the head's matrix (for losses that chunk the logits).
    ``router_stats=True`` (no cache) returns ``(out, stats)``: the MoE layers' router sums
    (``moe_math.router_stats``) added over layers; None for a dense decoder.

    Segment ids pack several sequences in one row: no attention across different ids; id 0 is
    padding (it only attends to padding). Positions default to 0..L-1 and drive RoPE (and, with a
    cache, where k/v are written and which entries are visible). With a cache, segment ids are
    ignored: each slot holds one sequence (see ``kv_cache``).
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs,
                 sharding: ShardingContext | None = None):
        pd = dtype_of(cfg.param_dtype)
        self.cfg = cfg
        self.sharding = sharding
        self.embed = param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd)
        if cfg.scan_layers:
            # One Block whose params carry a leading "layers" axis; the forward scans over it.
            self.layers = _stacked_blocks(cfg, rngs, sharding)
        else:
            self.layers = nnx.List([Block(cfg, rngs=rngs, sharding=sharding, layer=i)
                                    for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "embed", rngs=rngs,
                                  param_dtype=pd)
        self.lm_head = (None if cfg.tie_embeddings else
                        param(rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd))

    def __call__(self, input_ids_BxL: jax.Array, positions_BxL: jax.Array | None = None,
                 segment_ids_BxL: jax.Array | None = None, *, cache: KVCache | None = None,
                 return_hidden: bool = False, router_stats: bool = False,
                 replay_NxBxLxK: jax.Array | None = None, return_routing: bool = False,
                 ) -> Any:
        cfg, ctx = self.cfg, self.sharding
        B, L = input_ids_BxL.shape
        cd = dtype_of(cfg.compute_dtype)
        if positions_BxL is None:
            if cache is not None:
                raise ValueError("a KV-cache forward needs explicit positions_BxL")
            positions_BxL = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
        if segment_ids_BxL is None:
            segment_ids_BxL = jnp.ones((B, L), jnp.int32)
        assert positions_BxL.shape == (B, L), (positions_BxL.shape, (B, L))
        assert segment_ids_BxL.shape == (B, L), (segment_ids_BxL.shape, (B, L))
        K = cfg.num_experts_per_tok
        if replay_NxBxLxK is not None:
            assert replay_NxBxLxK.shape == (cfg.num_layers, B, L, K), replay_NxBxLxK.shape
        C = context_size(ctx, (B, L)) if cache is None else 1
        natural_L = None
        if C > 1 and cfg.context_balance:
            # Context parallelism: every [B, L] input in the balanced layout here, the hidden
            # states back in natural order below, so the outside never sees the layout.
            check_length(L, C, True)
            order_L = sequence_order(L, C, True)
            natural_L = np.argsort(order_L)
            input_ids_BxL, positions_BxL, segment_ids_BxL = (
                a[:, order_L] for a in (input_ids_BxL, positions_BxL, segment_ids_BxL))
            if replay_NxBxLxK is not None:
                replay_NxBxLxK = replay_NxBxLxK[:, :, order_L]
        elif C > 1:
            check_length(L, C, False)

        x_BxLxD = jnp.take(self.embed[...], input_ids_BxL, axis=0).astype(cd)
        x_BxLxD = constrain(x_BxLxD, ("batch", "length", "act_embed"), ctx)
        cos_BxLxH, sin_BxLxH = rope_tables(positions_BxL, inv_frequencies(cfg))
        rows = (cos_BxLxH, sin_BxLxH, positions_BxL, segment_ids_BxL)
        if cfg.scan_layers:
            x_BxLxD, cache, stats, routing = self._scan(x_BxLxD, *rows, cache, replay_NxBxLxK)
        else:
            x_BxLxD, cache, stats, routing = self._loop(x_BxLxD, *rows, cache, replay_NxBxLxK)
        if natural_L is not None:
            x_BxLxD = constrain(x_BxLxD[:, natural_L], ("batch", "length", "act_embed"), ctx)
            routing = routing[:, :, natural_L]

        x_BxLxD = self.final_norm(x_BxLxD)
        if return_hidden:
            out = x_BxLxD
        else:
            out = self.head(x_BxLxD)
            assert out.shape == (B, L, cfg.vocab_size), out.shape
        # Extras follow the output in this order: cache, router stats, routing.
        extras = (() if cache is None else (cache,)) + ((stats,) if router_stats else ())
        if router_stats:
            assert cache is None, "router_stats is for the no-cache forward"
        extras += (routing,) if return_routing else ()
        return (out, *extras) if extras else out

    def _loop(self, x_BxLxD: jax.Array, cos_BxLxH: jax.Array, sin_BxLxH: jax.Array,
              positions_BxL: jax.Array, segment_ids_BxL: jax.Array, kv: KVCache | None,
              replay_NxBxLxK: jax.Array | None,
              ) -> tuple[jax.Array, KVCache | None, RouterStats | None, jax.Array]:
        """The layers one by one: (x, cache, router stats, routing [layers, B, L, k], -1 in
        dense layers)."""
        rows = (cos_BxLxH, sin_BxLxH, positions_BxL, segment_ids_BxL)
        run = run_block
        if self.cfg.remat != "none" and kv is None:
            run = nnx.remat(run_block, policy=_REMAT_POLICIES[self.cfg.remat])
        stats, routing = None, []
        for i, block in enumerate(self.layers):
            replay = None if replay_NxBxLxK is None else replay_NxBxLxK[i]
            if kv is None:
                x_BxLxD, layer_stats, experts = run(block, x_BxLxD, *rows, replay)
            else:
                x_BxLxD, kv, layer_stats, experts = block(x_BxLxD, *rows, kv, i, replay)
            stats = add_stats(stats, layer_stats)
            routing.append(self._no_experts(x_BxLxD) if experts is None else experts)
        return x_BxLxD, kv, stats, jnp.stack(routing)

    def _no_experts(self, x_BxLxD: jax.Array) -> jax.Array:
        """A dense layer's routing: -1 (XLA drops it unless the caller asked for routing)."""
        B, L, _ = x_BxLxD.shape
        return jnp.full((B, L, self.cfg.num_experts_per_tok), -1, jnp.int32)

    def head_weight(self) -> tuple[jax.Array, bool]:
        """(the output head's matrix, tied): ``lm_head`` [D, V], or the [V, D] embedding."""
        if self.lm_head is None:
            return self.embed[...], True
        return self.lm_head[...], False

    def head(self, x_xD: jax.Array) -> jax.Array:
        """Final hidden states [..., D] (batch first) -> logits [..., V], compute dtype."""
        cd = dtype_of(self.cfg.compute_dtype)
        w, tied = self.head_weight()
        spec = "...d,vd->...v" if tied else "...d,dv->...v"
        logits_xV = jnp.einsum(spec, x_xD.astype(cd), w.astype(cd))
        axes = ("batch",) + ("length",) * (x_xD.ndim - 2) + ("act_vocab",)
        return constrain(logits_xV, axes, self.sharding)

    def _scan(self, x_BxLxD: jax.Array, cos_BxLxH: jax.Array, sin_BxLxH: jax.Array,
              positions_BxL: jax.Array, segment_ids_BxL: jax.Array, kv: KVCache | None,
              replay_NxBxLxK: jax.Array | None,
              ) -> tuple[jax.Array, KVCache | None, RouterStats | None, jax.Array]:
        """Layers as a lax.scan over the stacked params. The KV cache rides in the carry (not
        in xs/ys) so each layer's write is an in-place update at a traced layer index; a
        layer-stacked cache (``KVCache.init`` with ``scan_layers``) is carried as it is."""
        graphdef, layer_params_stack = nnx.split(self.layers)

        sparse = self.cfg.is_sparse_layer(0)  # scan_layers: every layer alike (config rule)

        def body(carry, xs):
            x, kv, stats = carry
            layer_params, i, replay = xs
            block = nnx.merge(graphdef, layer_params)
            x, kv, layer_stats, experts = block(x, cos_BxLxH, sin_BxLxH, positions_BxL,
                                                segment_ids_BxL, kv, i, replay)
            experts = self._no_experts(x) if experts is None else experts
            return (x, kv, add_stats(stats, layer_stats) if sparse else None), experts

        if self.cfg.remat != "none" and kv is None:
            # prevent_cse=False is safe (and faster) inside scan, per the jax.checkpoint docs.
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.cfg.remat],
                                  prevent_cse=False)
        layer_ids = jnp.arange(self.cfg.num_layers, dtype=jnp.int32)
        # A traced layer index needs the cache stacked. A per-layer cache (tuple) is stacked
        # and unstacked here, a copy of the whole cache per forward; a stacked one is not.
        per_layer = kv is not None and not kv.is_stacked
        stacked = kv.stacked() if per_layer else kv
        stats0 = zero_stats(self.cfg.num_experts) if sparse else None
        (x_BxLxD, stacked, stats), routing = jax.lax.scan(
            body, (x_BxLxD, stacked, stats0), (layer_params_stack, layer_ids, replay_NxBxLxK))
        return x_BxLxD, stacked.unstacked() if per_layer else stacked, stats, routing


def _stacked_blocks(cfg: ModelConfig, rngs: nnx.Rngs, sharding: ShardingContext | None,
                    ) -> Block:
    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, axis_size=cfg.num_layers)
    def make(layer_rngs: nnx.Rngs) -> Block:
        return Block(cfg, rngs=layer_rngs, sharding=sharding)

    blocks = make(rngs)
    for _, var in nnx.iter_graph(blocks):
        if isinstance(var, nnx.Param):
            names = ("layers",) + tuple(var.get_metadata()["logical_axes"])
            var.set_metadata("logical_axes", names)
    return blocks


# ---- functional helpers for jit boundaries ------------------------------------------------


def split_model(model: Decoder) -> tuple[nnx.GraphDef, nnx.State]:
    """(graphdef, params); the model holds nothing but Params, so this is the whole state."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    assert not jax.tree.leaves(rest), f"model has non-Param state: {rest}"
    return graphdef, params


def forward(graphdef: nnx.GraphDef, params: nnx.State, input_ids_BxL: jax.Array,
            positions_BxL: jax.Array | None = None, segment_ids_BxL: jax.Array | None = None,
            cache: KVCache | None = None, *, return_hidden: bool = False,
            return_routing: bool = False) -> Any:
    """Pure forward over params: logits, or (logits, cache) when a cache is given; with
    ``return_hidden`` the final hidden states [B, L, D] take the logits' place; with
    ``return_routing`` the experts of every token, [layers, B, L, k] (-1 in dense layers),
    come last."""
    model = nnx.merge(graphdef, params)
    return model(input_ids_BxL, positions_BxL, segment_ids_BxL, cache=cache,
                 return_hidden=return_hidden, return_routing=return_routing)


def forward_hidden(graphdef: nnx.GraphDef, params: nnx.State, input_ids_BxL: jax.Array,
                   positions_BxL: jax.Array | None = None,
                   segment_ids_BxL: jax.Array | None = None, *, router_stats: bool = False,
                   replay_NxBxLxK: jax.Array | None = None) -> tuple[Any, ...]:
    """(final hidden states [B, L, D] in the compute dtype, head matrix, tied): the forward
    without its output head, for losses that compute the logits chunk by chunk. The head is
    ``lm_head`` [D, V], or with ``tied`` the [V, D] embedding (its param dtype). With
    ``router_stats`` a fourth item: the MoE router sums (``Decoder``). ``replay_NxBxLxK``:
    routing replay, [layers, B, L, k] expert ids (-1: the model's own routing)."""
    model = nnx.merge(graphdef, params)
    out = model(input_ids_BxL, positions_BxL, segment_ids_BxL, return_hidden=True,
                router_stats=router_stats, replay_NxBxLxK=replay_NxBxLxK)
    if router_stats:
        return (out[0], *model.head_weight(), out[1])
    return (out, *model.head_weight())


def model_config(graphdef: nnx.GraphDef, params: nnx.State) -> ModelConfig:
    """The ``ModelConfig`` a split model was built from."""
    return nnx.merge(graphdef, params).cfg


def loss_vocab_axes(graphdef: nnx.GraphDef, params: nnx.State, vocab_size: int, rows: int
                    ) -> tuple[Mesh | None, tuple[str, ...], tuple[str, ...]]:
    """(mesh, the mesh axes the losses shard the vocabulary of their logits over: the
    ``loss_vocab`` rule, the axes of the batch of ``rows`` rows); ``(None, (), ())`` for a
    model built without a mesh."""
    ctx = nnx.merge(graphdef, params).sharding
    if ctx is None:
        return None, (), ()
    vocab = ctx.sharding(("loss_vocab",), (vocab_size,)).spec[0]
    batch = ctx.sharding(("batch",), (rows,)).spec[0]
    as_tuple = lambda a: () if a is None else (a,) if isinstance(a, str) else tuple(a)  # noqa: E731
    return ctx.mesh, as_tuple(vocab), as_tuple(batch)


def loss_length_axes(graphdef: nnx.GraphDef, params: nnx.State, rows: int, length: int,
                     ) -> tuple[str, ...]:
    """The mesh axes the hidden states' length dimension is sharded over (``context`` under
    context parallelism); () without a mesh."""
    ctx = nnx.merge(graphdef, params).sharding
    if ctx is None:
        return ()
    part = ctx.sharding(("batch", "length"), (rows, length)).spec[1]
    return () if part is None else (part,) if isinstance(part, str) else tuple(part)


def apply_head(graphdef: nnx.GraphDef, params: nnx.State, hidden_xD: jax.Array) -> jax.Array:
    """The model's output head on final hidden states [..., D]: logits [..., V] in the compute
    dtype, the same math as ``forward``'s last step."""
    return nnx.merge(graphdef, params).head(hidden_xD)


def abstract_model(cfg: ModelConfig, *, mesh: Mesh | None = None, rules: Rules | None = None,
                   seed: int = 0) -> Decoder:
    """The model with ShapeDtypeStruct params: nothing is allocated."""
    ctx = _context(mesh, rules)
    return nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(seed), sharding=ctx))


def _context(mesh: Mesh | None, rules: Rules | None) -> ShardingContext | None:
    if mesh is None:
        return None
    return ShardingContext(mesh, rules if rules is not None else rules_for("train"))


def create_model(cfg: ModelConfig, *, mesh: Mesh | None = None, rules: Rules | None = None,
                 seed: int = 0) -> Decoder:
    """Random init; with a mesh every param is born in its NamedSharding (jit out_shardings),
    so no device ever holds a full replica of a sharded weight. ``rules`` default to train."""
    ctx = _context(mesh, rules)
    graphdef, init = _initializer(cfg, ctx)
    return nnx.merge(graphdef, init(jax.random.key(seed)))


@functools.lru_cache(maxsize=8)
def _initializer(cfg: ModelConfig, ctx: ShardingContext | None,
                 ) -> tuple[nnx.GraphDef, Callable[[jax.Array], nnx.State]]:
    """Jitted init per (config, sharding), the seed traced: re-creating a model (new seed, tests,
    restarts in one process) reuses the compiled initializer."""

    def init(key: jax.Array) -> nnx.State:
        return split_model(Decoder(cfg, rngs=nnx.Rngs(key), sharding=ctx))[1]

    graphdef, abstract_params = split_model(
        nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0), sharding=ctx)))
    if ctx is None:
        return graphdef, jax.jit(init)
    return graphdef, jax.jit(init, out_shardings=param_shardings(abstract_params, ctx.mesh,
                                                                  ctx.rules))


def param_count(cfg: ModelConfig) -> int:
    """Parameters (tied embeddings counted once), computed abstractly."""
    params = split_model(abstract_model(cfg))[1]
    return sum(int(x.size) for x in jax.tree.leaves(params))


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 * matmul params + attention (Kaplan/PaLM convention).

    Matmul params exclude the embedding lookup but include the output head (also when tied:
    the matmul still runs). Attention adds 6 * 2 * layers * heads * head_dim * seq_len (QK^T and
    PV, forward + backward, no discount for the causal mask), as in the PaLM MFU appendix.
    """
    D, F, N, K, H = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                     cfg.resolved_head_dim)
    attn = D * N * H * 2 + D * K * H * 2
    # An MoE layer's matmuls per token: the router and top-k experts' FFNs (the active params).
    moe = D * cfg.num_experts + 3 * D * cfg.resolved_moe_intermediate_size * cfg.num_experts_per_tok
    matmul_params = sum(attn + (moe if cfg.is_sparse_layer(i) else 3 * D * F)
                        for i in range(cfg.num_layers)) + D * cfg.vocab_size
    attention = 12 * cfg.num_layers * N * H * seq_len
    return float(6 * matmul_params + attention)
