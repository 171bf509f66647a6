"""JAX's TPU ragged paged attention (Pallas) over the sampler's (B, L) queries, and its lowering
for a TPU slice from a host without one.

The kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) reads each sequence's
pages in place, where the portable ``paged_attention.paged_attention`` gathers them into a
contiguous copy on every call. Its pool is one array per layer, keys and values interleaved on
the heads axis: ``kv[page, offset, 2j]`` is kv head j's key and ``2j + 1`` its value (the
combined ``PagedKVCache``, ``paged_attention.interleave``). The sampler's decode calls it on a
TPU mesh (``applies``), in ``jax.shard_map`` over the batch, whose slots' pages each shard
holds, and the pool's head shards, each holding whole (key, value) pairs
(``sharded_ragged_paged_attention``).

Two things the kernel reads from the host when left to itself, both given explicitly here so a
CPU host can compile it for a TPU topology: its block sizes (``Blocks``; the kernel's own table
looks up ``jax.devices()``), and the chip generation its Mosaic lowering needs, which JAX reads
from the abstract mesh in context, else from the default device (the host's CPU):
``lowering_for(mesh)`` scopes the mesh of the target devices around ``.lower()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec

from meshrl.models import paged_attention
from meshrl.models.paged_attention import PAGE_AXES
from meshrl.models.sharding import ShardingContext


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The kernel's tuning inputs: kv pages and queries one flash block covers, VMEM cap."""

    pages_per_block: int = 8
    queries_per_block: int = 32
    vmem_limit_bytes: int = 32 * 2 ** 20


def kernel_inputs(page_table_BxM: jax.Array, positions_BxL: jax.Array, num_pages: int,
                  page_size: int, first_page: int | jax.Array = 0,
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(kv_lens [B], page_indices [B, M], cu_q_lens [B + 1], num_seqs [1]) for B sequences of
    L queries at consecutive positions ending at ``positions_BxL[:, -1]``: the kernel's query j
    of L attends to entries < kv_len - L + j + 1, the position rule of ``paged_attention``.
    Rows with nothing written (a free slot, position < L - 1) get kv_len L over page 0, a
    finite output nobody reads; missing pages (-1) read page 0, masked by kv_len. Page
    indices are offset by ``first_page`` (a layer's first page in a flattened stacked pool)."""
    B, L = positions_BxL.shape
    M = page_table_BxM.shape[1]
    kv_lens_B = jnp.clip(positions_BxL[:, -1] + 1, L, M * page_size).astype(jnp.int32)
    pages_BxM = (jnp.clip(page_table_BxM, 0, num_pages - 1) + first_page).astype(jnp.int32)
    cu_q_lens = (jnp.arange(B + 1, dtype=jnp.int32) * L)
    return kv_lens_B, pages_BxM, cu_q_lens, jnp.array([B], jnp.int32)


def ragged_paged_attention(q_BxLxNxH: jax.Array, kv_PxSx2KxH: jax.Array,
                           page_table_BxM: jax.Array, positions_BxL: jax.Array,
                           layer: int | jax.Array | None = None, blocks: Blocks = Blocks(), *,
                           reference: bool = False) -> jax.Array:
    """Attention of each query to its sequence's entries at positions <= its own, over the
    combined pool; [B, L, N, H]. With ``layer``, the pool is stacked over layers
    ([layers, P, S, 2K, H]): the kernel reads that layer's pages of it flattened to
    [layers x P, S, 2K, H] (a free reshape), where a slice of the layer would copy its whole
    pool on every call. ``reference``: JAX's portable reference of the kernel (a Python loop
    over sequences: eager only), which the tests compare with ``paged_attention``."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    B, L, N, H = q_BxLxNxH.shape
    P, S = kv_PxSx2KxH.shape[-4:-2]
    first_page = 0
    if layer is not None:
        first_page = layer * P
        kv_PxSx2KxH = kv_PxSx2KxH.reshape(-1, *kv_PxSx2KxH.shape[-3:])
    args = (q_BxLxNxH.reshape(B * L, N, H), kv_PxSx2KxH,
            *kernel_inputs(page_table_BxM, positions_BxL, P, S, first_page))
    if reference:
        out = rpa.ref_ragged_paged_attention(*args, sm_scale=H ** -0.5)
    else:
        M = page_table_BxM.shape[1]
        out = rpa.ragged_paged_attention(
            *args, sm_scale=H ** -0.5,
            num_kv_pages_per_block=min(blocks.pages_per_block, M),
            num_queries_per_block=min(blocks.queries_per_block, B * L),
            vmem_limit_bytes=blocks.vmem_limit_bytes)
    return out.reshape(B, L, N, H)


def applies(ctx: ShardingContext | None, combined: bool, queries: int) -> bool:
    """Whether attention over a paged pool runs the kernel: a decode step (one query per
    sequence) over a combined pool on a TPU mesh. Chunked prefill rows (padded at either end)
    keep the portable gather."""
    return (combined and queries == 1 and ctx is not None
            and ctx.mesh.devices.flat[0].platform == "tpu")


def sharded_ragged_paged_attention(q_BxLxNxH: jax.Array, pool: jax.Array,
                                   page_table_BxM: jax.Array, positions_BxL: jax.Array,
                                   layer: int | jax.Array, ctx: ShardingContext,
                                   attend: Callable[..., jax.Array] | None = None,
                                   page_axes: tuple[str, ...] = ()) -> jax.Array:
    """``ragged_paged_attention`` of layer ``layer`` of a combined ``pool`` (one layer's
    [P, S, 2K, H], or all layers' stacked: ``layer`` then picks its pages) inside
    ``jax.shard_map`` (XLA cannot partition a Pallas call): each device runs it on its batch
    shard, over the pages its shard of the pool holds (those of its slots; the page table is
    renumbered from the shard's first page) and on its heads (whole (key, value) pairs, and
    the query heads of those kv heads); q is gathered to the pool's head sharding where it
    differs. ``page_axes``: the mesh axes the pool's pages shard over, those of the batch (the
    rows are the slots in order). ``attend``: what runs on each shard, same signature (tests: a
    portable one)."""
    attend = attend or ragged_paged_attention
    stacked = pool.ndim == 5
    # The pool's sharding as ``PagedKVCache.shardings`` gives it (heads as the separate pools').
    logical = (("layers",) if stacked else ()) + PAGE_AXES
    pool_spec = paged_attention.pool_spec(ctx.sharding(logical, (
        *pool.shape[:-2], pool.shape[-2] // 2, pool.shape[-1])).spec, page_axes)
    heads, pages = pool_spec[-2], pool_spec[-4]
    assert all(a is None for i, a in enumerate(pool_spec) if i not in (pool.ndim - 2,
                                                                        pool.ndim - 4)), pool_spec
    batch = ctx.sharding(("batch", "length", "act_heads", "head_dim"), q_BxLxNxH.shape).spec[0]
    # A sequence's pages sit on the shard of its slot (the allocator's rule), so each shard's
    # rows read only its own pages, numbered from its first.
    assert pages is None or pages == batch, (pages, batch)
    q_spec, rows = PartitionSpec(batch, None, heads, None), PartitionSpec(batch, None)

    def local(q: jax.Array, kv: jax.Array, table: jax.Array, pos: jax.Array,
              layer: jax.Array) -> jax.Array:
        if pages is not None:
            table = jnp.where(table >= 0, table - jax.lax.axis_index(pages) * kv.shape[-4], -1)
        return attend(q, kv, table, pos, layer if stacked else None)

    return jax.shard_map(local, mesh=ctx.mesh,
                         in_specs=(q_spec, pool_spec, rows, rows, PartitionSpec()),
                         out_specs=q_spec, check_vma=False)(
        q_BxLxNxH, pool, page_table_BxM, positions_BxL, jnp.asarray(layer, jnp.int32))


@contextlib.contextmanager
def lowering_for(mesh: Mesh) -> Iterator[None]:
    """Lower (``jitted.lower(...)``) the kernel for ``mesh``'s devices: their chip, not the
    host's default device, is what the Mosaic lowering targets."""
    with jax.set_mesh(mesh):
        yield
