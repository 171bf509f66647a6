"""Vendor attention kernels behind ``model.attention``: cuDNN flash attention (GPU) and the
Pallas splash attention (TPU), for causal self-attention within equal segment ids.

Same contract as ``attention_kernels.blockwise_attention`` (GQA grouping, segment id 0 is padding
that attends to earlier padding, no row is ever fully masked), with the kernels' own numerics:
they run in the compute dtype (cuDNN needs bfloat16/float16) and scale q before the matmul.

* ``cudnn_attention``: ``jax.nn.dot_product_attention(implementation='cudnn', is_causal=True)``
  with the segment mask as its boolean ``mask`` ([B, 1, L, L]: the public API has no segment ids,
  so packing costs one bool per token pair; the fused kernel still never writes the scores).
  ``implementation='xla'`` runs the same call on any backend (used by the CPU tests).
* ``splash_attention``: ``make_splash_mha`` with a causal ``MultiHeadMask`` and ``SegmentIds``,
  vmapped over the batch. A Pallas call cannot be partitioned by XLA, so with a mesh it runs in
  ``jax.shard_map`` over the batch and head shardings the logical rules give q; the length is
  gathered (no sequence sharding inside the kernel). ``interpret=True`` runs the kernel in the
  Pallas interpreter (any backend, slow: tests only).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from meshrl.models.attention_kernels import kv_repeats
from meshrl.models.sharding import ShardingContext

_SPLASH_ALIGN = 128  # splash blocks are multiples of the TPU lane width


def cudnn_attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
                    segment_ids_BxL: jax.Array, *, implementation: str = "cudnn") -> jax.Array:
    """Causal, segment-masked attention through ``jax.nn.dot_product_attention``."""
    same_seg_Bx1xLxL = (segment_ids_BxL[:, :, None] == segment_ids_BxL[:, None, :])[:, None]
    return jax.nn.dot_product_attention(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, mask=same_seg_Bx1xLxL,
                                        is_causal=True, implementation=implementation)


def splash_attention(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
                     segment_ids_BxL: jax.Array, ctx: ShardingContext | None, *,
                     interpret: bool = False) -> jax.Array:
    """Causal, segment-masked attention through the TPU splash kernel (see the module doc)."""
    B, L, N, H = q_BxLxNxH.shape
    K = k_BxLxKxH.shape[2]
    # Pad to the kernel's block multiple; padding gets segment id -1, which no real token has.
    Lp = -(-L // _SPLASH_ALIGN) * _SPLASH_ALIGN
    pad = ((0, 0), (0, Lp - L), (0, 0), (0, 0))
    q, k, v = (jnp.pad(x, pad) for x in (q_BxLxNxH, k_BxLxKxH, v_BxLxKxH))
    seg_BxLp = jnp.pad(segment_ids_BxL, ((0, 0), (0, Lp - L)), constant_values=-1)

    def local(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
              seg_BxL: jax.Array) -> jax.Array:
        return _splash_local(q_BxLxNxH, k_BxLxKxH, v_BxLxKxH, seg_BxL, interpret)

    if ctx is None:
        return local(q, k, v, seg_BxLp)[:, :L]
    spec = ctx.sharding(("batch", "length", "act_heads", "head_dim"), q.shape).spec
    batch_axes, head_axes = spec[0], spec[2]
    shards = _axes_size(ctx, head_axes)
    # Each device must hold whole kv groups for its query heads: when K does not split over the
    # head shards, repeat every kv head r times (GQA with N // K / r groups) until it does.
    r = kv_repeats(N, K, shards)
    if r > 1:
        k, v = jnp.repeat(k, r, axis=2), jnp.repeat(v, r, axis=2)
    qkv_spec = PartitionSpec(batch_axes, None, head_axes, None)
    out = jax.shard_map(local, mesh=ctx.mesh, in_specs=(qkv_spec, qkv_spec, qkv_spec,
                                                        PartitionSpec(batch_axes, None)),
                        out_specs=qkv_spec, check_vma=False)(q, k, v, seg_BxLp)
    return out[:, :L]


def _axes_size(ctx: ShardingContext, axes: str | tuple[str, ...] | None) -> int:
    if axes is None:
        return 1
    names = (axes,) if isinstance(axes, str) else axes
    size = 1
    for name in names:
        size *= ctx.mesh.shape[name]
    return size


def _splash_local(q_BxLxNxH: jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
                  seg_BxL: jax.Array, interpret: bool) -> jax.Array:
    """The kernel on one device's shard (L a multiple of ``_SPLASH_ALIGN``)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    B, L, N, H = q_BxLxNxH.shape
    block = next(b for b in (512, 256, _SPLASH_ALIGN) if L % b == 0)
    sizes = splash.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                              block_q_dkv=block, block_kv_dkv=block,
                              block_kv_dkv_compute=block, block_q_dq=block, block_kv_dq=block)
    mask = splash.MultiHeadMask([splash.CausalMask((L, L)) for _ in range(N)])
    kernel = splash.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                    interpret=interpret)
    # The kernel takes [heads, L, H] per example and does not scale the scores.
    q_BxNxLxH = jnp.swapaxes(q_BxLxNxH, 1, 2) * jnp.asarray(H ** -0.5, q_BxLxNxH.dtype)
    k_BxKxLxH, v_BxKxLxH = jnp.swapaxes(k_BxLxKxH, 1, 2), jnp.swapaxes(v_BxLxKxH, 1, 2)

    def one(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:
        return kernel(q, k, v, segment_ids=splash.SegmentIds(q=seg, kv=seg))

    out_BxNxLxH = jax.vmap(one)(q_BxNxLxH, k_BxKxLxH, v_BxKxLxH, seg_BxL)
    return jnp.swapaxes(out_BxNxLxH, 1, 2)
