"""Causal attention over a sequence sharded on the ``context`` mesh axis (context parallelism).

Layout: with ``balanced`` the model reorders each sequence at its boundary into 2 x C chunks
(C = the context size) so that rank i holds chunks i and 2C-1-i: under a causal mask every rank
then does the same attention work. ``sequence_order(L, C, balanced)`` is the original index of
the token in each slot of that layout (the identity when not balanced). Attention masks by
those indices (``key index <= query index``) and by segment ids (packing), so the result is the
unsharded attention of the original sequence whatever the layout.

Strategies (``model.context_attention``), each inside ``jax.shard_map`` with the kernel of
``attention_kernels.blockwise_attention_lse`` per rank:

* ``all_gather``: gather K/V (and their indices and segment ids) over ``context`` and attend to
  the whole sequence, its key blocks in natural order so those above the diagonal are skipped;
* ``ring``: C steps (a ``lax.scan``); at each a rank attends to the K/V block it holds and passes
  it to the next rank with ``ppermute`` (independent of the step's compute, so the transfer can
  overlap it), combining the partial results with their log-sum-exps (online softmax). No rank
  holds more than its own and the incoming K/V block; the backward recomputes the steps.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from meshrl.configs.fields import ConfigError
from meshrl.models.attention_kernels import blockwise_attention_lse, kv_repeats
from meshrl.models.sharding import ShardingContext

AXIS = "context"


def sequence_order(length: int, context: int, balanced: bool) -> np.ndarray:
    """[L] int32: the original index of the token in each slot of the layout."""
    if not balanced or context == 1:
        return np.arange(length, dtype=np.int32)
    chunks = np.arange(length, dtype=np.int32).reshape(2 * context, length // (2 * context))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * context - 1 - i]])
                           for i in range(context)])


def rank_work(length: int, context: int, balanced: bool) -> np.ndarray:
    """[C]: the causal (query, key) pairs each rank computes, sum over its queries of index+1."""
    order = sequence_order(length, context, balanced).reshape(context, -1)
    return (order.astype(np.int64) + 1).sum(axis=1)


def context_size(ctx: ShardingContext | None, shape: tuple[int, int]) -> int:
    """How many ``context`` shards a [B, L] activation has under ``ctx`` (1: not sharded)."""
    if ctx is None or ctx.mesh.shape.get(AXIS, 1) == 1:
        return 1
    spec = ctx.sharding(("batch", "length"), shape).spec
    part = spec[1] if len(spec) > 1 else None
    axes = () if part is None else (part,) if isinstance(part, str) else tuple(part)
    return ctx.mesh.shape[AXIS] if AXIS in axes else 1


def check_length(length: int, context: int, balanced: bool) -> None:
    need = 2 * context if balanced else context
    if length % need:
        raise ConfigError(f"sequence length {length}: must be divisible by "
                          f"{'2 x ' if balanced else ''}mesh.context = {need} (set "
                          f"trainer.seq_len to a multiple of {need})")


def context_attention(strategy: str, q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array,
                      v_BxLxKxH: jax.Array, segment_ids_BxL: jax.Array, order_L: np.ndarray,
                      ctx: ShardingContext) -> jax.Array:
    """Causal attention within equal segment ids of the sequence in layout ``order_L``, its
    length sharded over ``context`` (module docstring)."""
    B, L, N, H = q_BxLxNxH.shape
    K = k_BxLxKxH.shape[2]
    q_spec = ctx.sharding(("batch", "length", "act_heads", "head_dim"), q_BxLxNxH.shape).spec
    k_spec = ctx.sharding(("batch", "length", "act_kv_heads", "head_dim"), k_BxLxKxH.shape).spec
    if q_spec[2] != k_spec[2]:
        # The kv heads do not split over the query heads' shards (fewer kv heads than tensor):
        # repeat each until they do, as the fused kernel does, so a device holds whole groups.
        heads = q_spec[2]
        names = () if heads is None else (heads,) if isinstance(heads, str) else tuple(heads)
        r = kv_repeats(N, K, int(np.prod([ctx.mesh.shape[a] for a in names])))
        k_BxLxKxH, v_BxLxKxH = (jnp.repeat(x, r, axis=2) for x in (k_BxLxKxH, v_BxLxKxH))
        k_spec = P(k_spec[0], k_spec[1], heads, *k_spec[3:])
    row_spec = P(q_spec[0], q_spec[1])
    index_BxL = jnp.broadcast_to(jnp.asarray(order_L, jnp.int32), (B, L))
    natural = np.argsort(order_L).astype(np.int32)
    C = ctx.mesh.shape[AXIS]

    def gathered(q, k, v, seg, idx):
        k_all, v_all, seg_all = (jax.lax.all_gather(x, AXIS, axis=1, tiled=True)
                                 for x in (k, v, seg))
        # Natural order: key blocks ascend, so the kernel skips those above the diagonal.
        k_all, v_all, seg_all = k_all[:, natural], v_all[:, natural], seg_all[:, natural]
        kidx = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), seg_all.shape)
        return blockwise_attention_lse(q, k_all, v_all, idx, seg, kidx, seg_all)[0]

    def ring(q, k, v, seg, idx):
        perm = [(i, (i + 1) % C) for i in range(C)]

        # A scan, not an unrolled loop: one step's buffers are reused by the next. The next
        # block's ppermute depends on nothing computed in the step, so it overlaps the step.
        def attend(block, out, lse):
            o_s, lse_s = blockwise_attention_lse(q, block[0], block[1], idx, seg, block[3],
                                                 block[2])
            return _combine(out, lse, o_s, lse_s)

        def step(carry, _):
            block, out, lse = carry
            incoming = jax.lax.ppermute(block, AXIS, perm)
            return (incoming, *attend(block, out, lse)), None

        b, n, N_local, H_ = q.shape
        init = ((k, v, seg, idx), jnp.zeros((b, n, N_local, H_), jnp.float32),
                jnp.full((b, n, N_local), -jnp.inf, jnp.float32))
        # C steps, so C exchanges of which the last is unused: a last step outside the loop
        # would not reuse the loop's buffers (8% more temp memory at the benchmark's shape).
        (_, out, _), _ = jax.lax.scan(jax.checkpoint(step, prevent_cse=False), init, None,
                                      length=C)
        return out.astype(q.dtype)

    # Remat: the backward pass keeps only the inputs and reruns the exchange and the kernels,
    # so no layer holds every ring step's (or the gathered sequence's) residuals.
    local = jax.checkpoint(gathered if strategy == "all_gather" else ring)
    return jax.shard_map(local, mesh=ctx.mesh,
                         in_specs=(q_spec, k_spec, k_spec, row_spec, row_spec),
                         out_specs=q_spec, check_vma=False)(
        q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, segment_ids_BxL, index_BxL)


def _combine(out_BxLxNxH: jax.Array, lse_BxLxN: jax.Array, o_BxLxNxH: jax.Array,
             lse2_BxLxN: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Two softmax-normalised partial attentions over disjoint keys -> the one over both."""
    new = jnp.logaddexp(lse_BxLxN, lse2_BxLxN)
    a, b = jnp.exp(lse_BxLxN - new)[..., None], jnp.exp(lse2_BxLxN - new)[..., None]
    return out_BxLxNxH * a + o_BxLxNxH.astype(jnp.float32) * b, new
