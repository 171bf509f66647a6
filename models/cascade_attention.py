"""Shared-prefix ("cascade") decode attention over a paged cache's gathered windows.

When several sequences start with the same pages (a GRPO group's prompt), a decode query's
attention splits exactly into two partial softmaxes: one over the shared prefix, computed once
per prefix for all the sequences sharing it (their queries batched against the prefix's keys
and values, read once), and one over each sequence's own positions after it. Each partial
keeps its running max and sum (the log-sum-exp statistics), so the two merge into the softmax
over the whole sequence (FlashInfer's cascade attention, vLLM's and SGLang's shared-prefix
attention).

A ``CascadeWindow`` holds, per layer, three dense windows gathered from the pages:

* ``prefix``: R rows of positions [0, P) (keys [R, K, H, P], values [R, K, P, H]); row r is the
  prefix its members ``members_RxG[r]`` (slot indices, B: padding) all list as their first pages;
* ``blocks``: N blocks of a slot's older positions past the prefix (keys [N, K, H, C]), block n
  read by slot ``owners_N[n]`` alone (B: padding); a block's padding pages are -1 in
  ``SharedPrefix.blocks_NxQ`` and masked through ``block_valid_NxC``;
* ``suffix``: each slot's band, positions [offset_B[b], offset_B[b] + W) (keys [B, K, H, W],
  values [B, K, W, H]), where the decode writes its new entries.

Every live slot is a member of exactly one row (a sequence sharing nothing is a row of its
own), its blocks cover the positions from P up to its band, and each query attends to the
entries of all three at positions <= its own. ``SharedPrefix`` is the page-level description
of the same split, carried by the ``PagedKVCache`` a decode program is handed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from meshrl.models import kv_cache as kvc
from meshrl.models.attention_kernels import MASK_VALUE


@struct.dataclass
class SharedPrefix:
    """A decode chunk's split, in pages: ``rows_RxP`` the pages of R prefixes of P pages each
    (-1: a padding row), ``members_RxG`` the slots attending each row's prefix (the slot count
    B: padding), ``blocks_NxQ`` / ``owners_N`` each block's pages (-1: none) and slot,
    ``band_BxW`` each slot's band pages, from position ``band_start_B``; ``window`` the
    ``CascadeWindow`` they describe, once gathered."""

    rows_RxP: jax.Array  # noqa: N815
    members_RxG: jax.Array  # noqa: N815
    blocks_NxQ: jax.Array  # noqa: N815
    owners_N: jax.Array  # noqa: N815
    band_BxW: jax.Array  # noqa: N815
    band_start_B: jax.Array  # noqa: N815
    # The three windows, gathered from the pages by a program of their own ahead of the decode
    # (``inference.page_table.SlotPages.bind_plan``).
    window: CascadeWindow | None = None


@struct.dataclass
class CascadeWindow:
    """The dense windows of a cascade decode (module docstring); goes through the model's
    forward like a dense ``KVCache`` (the decode writes into ``suffix``)."""

    suffix: kvc.KVCache
    prefix: kvc.KVCache
    members_RxG: jax.Array  # noqa: N815
    offset_B: jax.Array  # noqa: N815
    blocks: kvc.KVCache | None = None
    owners_N: jax.Array | None = None  # noqa: N815
    block_valid_NxC: jax.Array | None = None  # noqa: N815

    @property
    def k(self) -> kvc.Layers:
        return self.suffix.k

    @property
    def v(self) -> kvc.Layers:
        return self.suffix.v

    @property
    def max_len(self) -> int:
        """Entries of the suffix window (the decode's writable span)."""
        return self.suffix.max_len

    @property
    def slots(self) -> int:
        return self.suffix.slots

    @property
    def is_stacked(self) -> bool:
        return self.suffix.is_stacked

    def stacked(self) -> CascadeWindow:
        blocks = None if self.blocks is None else self.blocks.stacked()
        return self.replace(suffix=self.suffix.stacked(), prefix=self.prefix.stacked(),
                            blocks=blocks)

    def unstacked(self) -> CascadeWindow:
        blocks = None if self.blocks is None else self.blocks.unstacked()
        return self.replace(suffix=self.suffix.unstacked(), prefix=self.prefix.unstacked(),
                            blocks=blocks)


def cascade_attention(cache: CascadeWindow, layer: int | jax.Array, q_BxLxNxH: jax.Array,
                      k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array, positions_BxL: jax.Array,
                      dtype: jnp.dtype) -> tuple[CascadeWindow, jax.Array]:
    """Write one layer's new keys/values at ``positions_BxL`` into the suffix window (positions
    before ``cache.offset_B`` or past the window are dropped), then attend each query to its
    row's prefix, its blocks and its own suffix up to its position. Returns (cache, output
    [B, L, N, H])."""
    B, L, N, H = q_BxLxNxH.shape
    local_BxL = positions_BxL - cache.offset_B[:, None]
    # Negative indices would wrap: send them past the window, where the write drops them.
    suffix = kvc.write(cache.suffix, layer, k_BxLxKxH, v_BxLxKxH,
                       jnp.where(local_BxL >= 0, local_BxL, cache.max_len))
    cache = cache.replace(suffix=suffix)
    s_keys, s_values_BxKxWxH = suffix.layer(layer)
    K, W = s_values_BxKxWxH.shape[1], s_values_BxKxWxH.shape[2]
    G = N // K
    # Query order (g, l) within each kv head, as ``attention._attend_cache``.
    q_BxKxQxH = q_BxLxNxH.reshape(B, L, K, G, H).transpose(0, 2, 3, 1, 4).reshape(B, K, G * L, H)
    mask_BxLxW = jnp.arange(W)[None, None, :] <= local_BxL[:, :, None]
    suffix_part = partial_attention(q_BxKxQxH, s_keys.astype(dtype),
                                    s_values_BxKxWxH.astype(dtype),
                                    _per_query(mask_BxLxW, K, G), suffix.key_layout)
    parts = [suffix_part, _prefix_part(cache, layer, q_BxLxNxH, dtype)]
    if cache.blocks is not None:
        parts.append(_blocks_part(cache, layer, q_BxKxQxH, dtype))
    out_BxKxQxH = merge(*parts)
    out_BxLxNxH = out_BxKxQxH.reshape(B, K, G, L, H).transpose(0, 3, 1, 2, 4).reshape(B, L, N, H)
    return cache, out_BxLxNxH.astype(q_BxLxNxH.dtype)


def _prefix_part(cache: CascadeWindow, layer: int | jax.Array, q_BxLxNxH: jax.Array,
                 dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each slot's partial attention over its row's prefix, as (max, sum, output) [B, K, Q]
    / [B, K, Q, H]; a slot in no row gets an empty part (sum 0)."""
    B, L, N, H = q_BxLxNxH.shape
    R, Gm = cache.members_RxG.shape
    p_keys, p_values_RxKxPxH = cache.prefix.layer(layer)
    K = p_values_RxKxPxH.shape[1]
    G = N // K
    members_X = cache.members_RxG.reshape(R * Gm)
    q_XxLxNxH = jnp.take(q_BxLxNxH, members_X, axis=0, mode="fill", fill_value=0)
    # A row's queries side by side: [R, K, (member, g, l), H] against its prefix, read once.
    q_RxKxQxH = q_XxLxNxH.reshape(R, Gm, L, K, G, H).transpose(0, 3, 1, 4, 2, 5).reshape(
        R, K, Gm * G * L, H)
    # No mask: a prefix is whole pages written before the chunk, so every member sees all of
    # it (``inference.prefix_plan``); padding members' parts are never read back.
    parts = partial_attention(q_RxKxQxH, p_keys.astype(dtype), p_values_RxKxPxH.astype(dtype),
                              None, cache.prefix.key_layout)
    # Back to slot order: member x of the rows -> its slot; slots in no row read index R * Gm.
    where_B = jnp.full((B,), R * Gm, jnp.int32).at[members_X].set(
        jnp.arange(R * Gm, dtype=jnp.int32), mode="drop")

    def to_slots(x: jax.Array, fill: float) -> jax.Array:
        per_member = x.reshape(R, K, Gm, G * L, *x.shape[3:]).swapaxes(1, 2).reshape(
            R * Gm, K, G * L, *x.shape[3:])
        return jnp.take(per_member, where_B, axis=0, mode="fill", fill_value=fill)

    m, s, o = parts
    return to_slots(m, MASK_VALUE), to_slots(s, 0.0), to_slots(o, 0.0)


def _blocks_part(cache: CascadeWindow, layer: int | jax.Array, q_BxKxQxH: jax.Array,
                 dtype: jnp.dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each slot's partial attention over its own blocks, as (max, sum, output) [B, K, Q] /
    [B, K, Q, H]: every block against its slot's queries, then the blocks of a slot combined
    (a slot with no block gets an empty part, sum 0)."""
    B = q_BxKxQxH.shape[0]
    keys, values_NxKxCxH = cache.blocks.layer(layer)
    owners_N = cache.owners_N
    q_NxKxQxH = jnp.take(q_BxKxQxH, owners_N, axis=0, mode="fill", fill_value=0)
    # Every query of the chunk sits past its blocks: only padding pages are masked.
    mask = cache.block_valid_NxC[:, None, None, :]
    m_N, s_N, o_N = partial_attention(q_NxKxQxH, keys.astype(dtype), values_NxKxCxH.astype(dtype),
                                      mask, cache.blocks.key_layout)
    # Padding blocks (owner B) fall outside the segments and are dropped.
    m_B = jax.ops.segment_max(m_N, owners_N, B)
    m_B = jnp.maximum(m_B, MASK_VALUE)  # no block: the empty max, -inf
    scale_N = jnp.exp(m_N - jnp.take(m_B, owners_N, axis=0, mode="fill", fill_value=0.0))
    s_B = jax.ops.segment_sum(scale_N * s_N, owners_N, B)
    o_B = jax.ops.segment_sum(scale_N[..., None] * o_N, owners_N, B)
    return m_B, s_B, o_B


def _per_query(mask_XxLxT: jax.Array, K: int, G: int) -> jax.Array:
    """A [X, L, T] mask per query of ``partial_attention``'s [X, K, (g, l), T] order."""
    X, L, T = mask_XxLxT.shape
    return jnp.broadcast_to(mask_XxLxT[:, None, None], (X, K, G, L, T)).reshape(X, K, G * L, T)


def partial_attention(q_XxKxQxH: jax.Array, keys: jax.Array, values_XxKxTxH: jax.Array,
                      mask_XxKxQxT: jax.Array | None, key_layout: str = kvc.TRANSPOSED,
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Softmax attention over the visible entries, unnormalized: (max score [X, K, Q], sum of
    exp(score - max) [X, K, Q], sum of exp(score - max) x value [X, K, Q, H]), in float32.
    Keys are [X, K, H, T] or [X, K, T, H] (``key_layout``). No visible entry: sum 0. A mask of
    None makes every entry visible (no selects over the scores)."""
    H = q_XxKxQxH.shape[-1]
    spec = "xkqh,xkht->xkqt" if key_layout == kvc.TRANSPOSED else "xkqh,xkth->xkqt"
    scores_XxKxQxT = jnp.einsum(spec, q_XxKxQxH, keys,
                                preferred_element_type=jnp.float32) * (H ** -0.5)
    if mask_XxKxQxT is not None:
        scores_XxKxQxT = jnp.where(mask_XxKxQxT, scores_XxKxQxT, MASK_VALUE)
    max_XxKxQ = scores_XxKxQxT.max(-1)
    p_XxKxQxT = jnp.exp(scores_XxKxQxT - max_XxKxQ[..., None])
    if mask_XxKxQxT is not None:
        p_XxKxQxT = jnp.where(mask_XxKxQxT, p_XxKxQxT, 0.0)
    out_XxKxQxH = jnp.einsum("xkqt,xkth->xkqh", p_XxKxQxT.astype(values_XxKxTxH.dtype),
                             values_XxKxTxH, preferred_element_type=jnp.float32)
    return max_XxKxQ, p_XxKxQxT.sum(-1), out_XxKxQxH


def merge(*parts: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
    """The softmax attention over the union of the parts' entries, from each part's
    (max, sum, output) statistics; 0 where no part saw an entry."""
    max_all = parts[0][0]
    for m, _, _ in parts[1:]:
        max_all = jnp.maximum(max_all, m)
    scales = [jnp.exp(m - max_all) for m, _, _ in parts]
    total = sum(c * s for c, (_, s, _) in zip(scales, parts, strict=True))
    out = sum(c[..., None] * o for c, (_, _, o) in zip(scales, parts, strict=True))
    return out / jnp.maximum(total, jnp.finfo(jnp.float32).tiny)[..., None]
