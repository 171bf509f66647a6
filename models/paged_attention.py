"""Paged KV cache: a pool of fixed-size pages shared by all sequences, and attention over it.

Per layer the pool holds keys and values as ``[num_pages P, page_size S, kv_heads K,
head_dim H]``, or both in one combined pool ``[P, S, 2K, H]`` (kv head j's key at 2j, its value
at 2j + 1: the TPU ragged paged attention kernel's layout, ``paged_kernel``). A sequence owns
the pages listed in its row of the page table ``[slots B, pages_per_seq M]`` (int32): token at
position t of slot b lives at
``page_table[b, t // S]``, offset ``t % S``. Pages need not be contiguous or in order, and two
slots may list the same page (a shared prompt prefix), so memory follows the tokens actually
held instead of ``slots x max_len``.

Compiled programs depend only on (B, M, L, P, S): any mix of sequence lengths runs in one
program, the lengths are data. The attention here is portable JAX (a gather of each slot's
pages, then masked softmax) for one query per sequence (decode) and for a chunk of L queries
per sequence (chunked prefill, causal by position). A ``PagedKVCache`` carrying its
``page_table`` goes through the model's forward like a dense ``KVCache`` (``models.attention``
writes and attends over pages); ``window``, ``put_band`` and ``put_slots`` give it the dense
cache's roles in the sampler's programs without copying entries.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.configs.schema import ModelConfig
from meshrl.mesh.rules import Rules, logical_to_spec
from meshrl.models.cascade_attention import SharedPrefix
from meshrl.models.kv_cache import KVCache, with_layer_index

# Pages shard over the mesh axes of the slots (``PagedKVCache.page_axes``, given explicitly: a
# page count may divide where the slot count does not); the sampler's allocator gives each slot
# pages of its own shard (``inference.pages``), so the decode reads each slot's pages on the
# device that holds the slot (``take_pages``, the TPU kernel's shard_map). Offsets within a
# page are not sharded; heads shard over ``tensor`` like the dense cache.
PAGE_AXES = (None, None, "kv_heads", "head_dim")
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def pool_spec(spec: PartitionSpec, page_axes: tuple[str, ...]) -> PartitionSpec:
    """``spec`` of a pool ([.., P, S, K, H]) with its pages over ``page_axes``."""
    entry = None if not page_axes else page_axes[0] if len(page_axes) == 1 else page_axes
    return PartitionSpec(*spec[:-4], entry, *spec[-3:])


@struct.dataclass
class PagedKVCache:
    """Per layer: keys and values [P, S, K, H] (or, ``combined``, both in ``k`` [P, S, 2K, H]
    and ``v`` None): a tuple with one array per layer, or (for a ``scan_layers`` model) one
    array stacked over a leading layers axis. ``page_table`` [slots B, pages_per_seq M]
    (int32, -1 = no page) rides along when the cache is handed to the model's forward, so
    attention knows where each slot's positions live. ``shared``, on the cache a decode chunk
    is handed, says which slots share which leading pages (``cascade_attention``). ``shards``:
    the equal consecutive ranges slots and pages split into over the mesh axes ``page_axes``
    (the slots'), a slot's pages in its own range; ``slot_rows``: the page table's rows are the
    slots in order (a program's view of some slots' rows is not)."""

    k: tuple[jax.Array, ...] | jax.Array
    v: tuple[jax.Array, ...] | jax.Array | None
    page_table: jax.Array | None = None
    shared: SharedPrefix | None = None
    shards: int = struct.field(pytree_node=False, default=1)
    page_axes: tuple[str, ...] = struct.field(pytree_node=False, default=())
    slot_rows: bool = struct.field(pytree_node=False, default=True)

    @classmethod
    def init(cls, cfg: ModelConfig, num_pages: int, page_size: int,
             dtype: jnp.dtype | str = jnp.float32, stacked: bool = False,
             combined: bool = False, shards: int = 1, page_axes: tuple[str, ...] = (),
             ) -> PagedKVCache:
        """A zero pool; ``combined``: keys and values interleaved in ``k`` (``interleave``)."""
        shape = cls.shape(cfg, num_pages, page_size, combined)

        def pools() -> tuple[jax.Array, ...] | jax.Array:
            if stacked:
                return jnp.zeros((cfg.num_layers, *shape), dtype)
            return tuple(jnp.zeros(shape, dtype) for _ in range(cfg.num_layers))

        return cls(pools(), None if combined else pools(), shards=shards, page_axes=page_axes)

    @staticmethod
    def shape(cfg: ModelConfig, num_pages: int, page_size: int, combined: bool = False,
              ) -> tuple[int, int, int, int]:
        if num_pages < 1 or page_size < 1:
            raise ValueError(f"paged cache: num_pages={num_pages}, page_size={page_size}: "
                             f"both must be >= 1")
        heads = cfg.num_kv_heads * (2 if combined else 1)
        return num_pages, page_size, heads, cfg.resolved_head_dim

    @classmethod
    def shardings(cls, cfg: ModelConfig, num_pages: int, page_size: int, mesh: Mesh,
                  rules: Rules, stacked: bool = False, combined: bool = False,
                  page_axes: tuple[str, ...] = ()) -> PagedKVCache:
        """A PagedKVCache of NamedShardings (for jit in/out_shardings), pages over
        ``page_axes``; the page table, when the caller adds one, is replicated."""
        # A combined pool shards its heads as the separate pools would: whole (key, value)
        # pairs on each shard, or none (2K may divide where K does not).
        shape = cls.shape(cfg, num_pages, page_size)
        if stacked:
            spec = pool_spec(logical_to_spec(("layers", *PAGE_AXES), rules, mesh,
                                             (cfg.num_layers, *shape)), page_axes)
            sh = NamedSharding(mesh, spec)
        else:
            spec = pool_spec(logical_to_spec(PAGE_AXES, rules, mesh, shape), page_axes)
            sh = (NamedSharding(mesh, spec),) * cfg.num_layers
        shards = math.prod(mesh.shape[a] for a in page_axes)
        return cls(sh, None if combined else sh, shards=shards, page_axes=page_axes)

    @property
    def combined(self) -> bool:
        """Keys and values interleaved on the heads axis of ``k`` (``v`` is None)."""
        return self.v is None

    @property
    def is_stacked(self) -> bool:
        return not isinstance(self.k, tuple)

    @property
    def num_pages(self) -> int:
        return self.k[0].shape[-4]

    @property
    def page_size(self) -> int:
        return self.k[0].shape[-3]

    @property
    def slots(self) -> int:
        """Sequences the page table describes (the sampler's slots)."""
        return self.page_table.shape[0]

    @property
    def max_len(self) -> int:
        """Positions a sequence's page-table row can hold."""
        return self.page_table.shape[1] * self.page_size

    def layer(self, layer: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """One layer's (keys, values) pools [P, S, K, H] (of a combined pool: strided views)."""
        if self.combined:
            pool = self.k[layer]
            return pool[..., 0::2, :], pool[..., 1::2, :]
        return self.k[layer], self.v[layer]

    def window(self, length: int, rows: int | None = None, lo: int = 0) -> PagedKVCache:
        """Positions [0, ``length``) of slots [lo, lo + rows): the same pool under the first
        ``length / page_size`` columns of those rows' page table, so attention reads only those
        pages and writes past them are dropped (``KVCache.window``'s role, with no copy)."""
        if length % self.page_size:
            raise ValueError(f"paged cache window {length}: must be a multiple of the page "
                             f"size {self.page_size}")
        hi = None if rows is None else lo + rows
        return self.replace(page_table=self.page_table[lo:hi, :length // self.page_size])

    def put_band(self, window: PagedKVCache, start_B: jax.Array, width: int, lo: int = 0,
                 ) -> PagedKVCache:
        """The pool a decode chunk over ``window`` wrote in place, under this cache's table
        (``KVCache.put_band``'s role: nothing to copy back)."""
        return window.replace(page_table=self.page_table)

    def stacked(self) -> PagedKVCache:
        """Layers stacked on a leading axis (a copy unless already stacked)."""
        if self.is_stacked:
            return self
        return self.replace(k=jnp.stack(self.k), v=None if self.combined else jnp.stack(self.v))

    def unstacked(self) -> PagedKVCache:
        """One array per layer (a copy unless already per layer)."""
        if not self.is_stacked:
            return self
        return self.replace(k=tuple(self.k), v=None if self.combined else tuple(self.v))

    def put_slots(self, part: KVCache, slots_N: jax.Array) -> PagedKVCache:
        """Write a dense cache ``part`` (N rows, entries [0, T)) into the pages of slots
        ``slots_N`` (the prefill's prompts); out-of-range slots (padding rows) and positions
        past a slot's pages are dropped."""
        N, T = slots_N.shape[0], part.max_len
        table_NxM = jnp.take(self.page_table, slots_N, axis=0, mode="fill", fill_value=-1)
        pos_NxT = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (N, T))
        page_NxT, off_NxT = slot_index(table_NxM, pos_NxT, self.page_size)
        # Dense keys are [.., N, K, H, T] or [.., N, K, T, H], values [.., N, K, T, H]: the
        # pages take [.., N, T, K, H]. The part takes the pool's layout (a stacked pool, a
        # stacked part: no unstacking and restacking).
        part = part.stacked() if self.is_stacked else part.unstacked()

        def layers(fn: Callable[[jax.Array], jax.Array], x: tuple[jax.Array, ...] | jax.Array,
                   ) -> tuple[jax.Array, ...] | jax.Array:
            return fn(x) if self.is_stacked else tuple(map(fn, x))

        keys = layers(lambda x: jnp.swapaxes(x, -2, -3) if part.keys_like_values
                      else jnp.moveaxis(x, -1, -3), part.k)
        values = layers(lambda x: jnp.swapaxes(x, -2, -3), part.v)
        if self.combined:
            pairs = (interleave(keys, values) if self.is_stacked
                     else tuple(map(interleave, keys, values)))
            return self.replace(k=put_entries(self.k, page_NxT, off_NxT, pairs))
        return self.replace(k=put_entries(self.k, page_NxT, off_NxT, keys),
                            v=put_entries(self.v, page_NxT, off_NxT, values))


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


def write(cache: PagedKVCache, layer: int | jax.Array, k_BxLxKxH: jax.Array,
          v_BxLxKxH: jax.Array, positions_BxL: jax.Array,
          page_table_BxM: jax.Array | None = None) -> PagedKVCache:
    """Scatter one layer's new keys/values into their pages (in place under jit + donation);
    ``page_table_BxM`` defaults to the one the cache carries."""
    table = cache.page_table if page_table_BxM is None else page_table_BxM
    page_BxL, off_BxL = slot_index(table, positions_BxL, cache.page_size)

    # A stacked pool takes the layer as a scatter index: one in-place scatter, no layer copy.
    idx = (layer, page_BxL, off_BxL) if cache.is_stacked else (page_BxL, off_BxL)

    def put(layers: tuple[jax.Array, ...] | jax.Array, x: jax.Array,
            ) -> tuple[jax.Array, ...] | jax.Array:
        if cache.is_stacked:
            return layers.at[idx].set(x.astype(layers.dtype), mode="drop")
        pool = layers[layer].at[idx].set(x.astype(layers[layer].dtype), mode="drop")
        return _replace(layers, layer, pool)

    if cache.combined:
        return cache.replace(k=put(cache.k, interleave(k_BxLxKxH, v_BxLxKxH)))
    return cache.replace(k=put(cache.k, k_BxLxKxH), v=put(cache.v, v_BxLxKxH))


def interleave(k_XxKxH: jax.Array, v_XxKxH: jax.Array) -> jax.Array:
    """Keys and values [..., K, H] as one [..., 2K, H]: kv head j's key at 2j, its value at
    2j + 1 (the combined pool's layout, the TPU kernel's)."""
    *lead, K, H = k_XxKxH.shape
    return jnp.stack([k_XxKxH, v_XxKxH], axis=-2).reshape(*lead, 2 * K, H)


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


def put_entries(pools: tuple[jax.Array, ...] | jax.Array, page_NxT: jax.Array,
                off_NxT: jax.Array, x: tuple[jax.Array, ...] | jax.Array, shards: int = 1,
                ) -> tuple[jax.Array, ...] | jax.Array:
    """Per-layer pools ([P, S, K, H] each, ``x`` [N, T, K, H] each) or a stacked pool
    ([layers, P, S, K, H], ``x`` [layers, N, T, K, H]) with each entry written at its (page,
    offset); out-of-range pages are dropped. A stacked pool takes every layer in one scatter
    (``kv_cache.with_layer_index``). ``shards`` > 1: the N rows are the slots in order, each
    writing only pages of its own shard, and each shard scatters into its own pages
    (``by_shard``)."""
    def put(pool: jax.Array, page: jax.Array, off: jax.Array, x: jax.Array) -> jax.Array:
        idx = (page, off) if pool.ndim == 4 else with_layer_index(pool.shape[0], page, off)
        return pool.at[idx].set(x.astype(pool.dtype), mode="drop")

    def put_sharded(pool: jax.Array, x: jax.Array) -> jax.Array:
        return by_shard(put, pool, shards, page_NxT, ((off_NxT, 0), (x, x.ndim - 4)))

    if isinstance(pools, tuple):
        return tuple(put_sharded(p, xi) for p, xi in zip(pools, x, strict=True))
    return put_sharded(pools, x)


def take_pages(pool: jax.Array, table_BxM: jax.Array, shards: int = 1) -> jax.Array:
    """The pages of each row of ``table_BxM`` (in range) from ``pool`` [.., P, S, K, H]:
    [.., B, M, S, K, H]. ``shards`` > 1: the B rows are the slots in order, each listing pages
    of its own shard, gathered on that shard (``by_shard``)."""
    def take(pool: jax.Array, table: jax.Array) -> jax.Array:
        # "clip": the indices are in range already; take's default fill checks every element.
        return jnp.take(pool, table, axis=-4, mode="clip")

    return by_shard(take, pool, shards, table_BxM)


def by_shard(fn: Callable[..., jax.Array], pool: jax.Array, shards: int, pages_Nx: jax.Array,
             rows: tuple[tuple[jax.Array, int], ...] = ()) -> jax.Array:
    """``fn(pool, pages, *rows)`` run per shard: ``pool`` [.., P, S, K, H] split into
    ``shards`` ranges of pages, ``pages_Nx`` (global page numbers, N rows: the slots in
    order) and each (array, axis of its N rows) of ``rows`` into as many ranges of rows,
    pages renumbered within their shard's range, and the results (pool-shaped, or rows after
    the pool's leading axes) joined back. A gather or scatter vmapped over the shards keeps each
    shard's rows on its own pages: over global numbers the partitioner, which cannot see that
    a row's pages are its shard's, gathers the whole pool onto every device."""
    if shards == 1:
        return fn(pool, pages_Nx, *(r for r, _ in rows))
    lead, per = pool.ndim - 4, pool.shape[-4] // shards

    def split(x: jax.Array, axis: int) -> jax.Array:
        return x.reshape(*x.shape[:axis], shards, x.shape[axis] // shards, *x.shape[axis + 1:])

    pages = split(pages_Nx, 0)
    pages = pages - (jnp.arange(shards, dtype=pages.dtype) * per).reshape(
        shards, *(1,) * (pages.ndim - 1))
    out = jax.vmap(fn, in_axes=(lead, 0, *(axis for _, axis in rows)), out_axes=lead)(
        split(pool, lead), pages, *(split(r, axis) for r, axis in rows))
    return out.reshape(*out.shape[:lead], -1, *out.shape[lead + 2:])
