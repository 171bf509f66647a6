"""JAX's TPU ragged paged attention (Pallas) over the sampler's (B, L) queries, and its lowering
for a TPU slice from a host without one.

The kernel (``jax.experimental.pallas.ops.tpu.ragged_paged_attention``) reads each sequence's
pages in place, where the portable ``paged_attention.paged_attention`` gathers them into a
contiguous copy on every call. Its pool is one array per layer, keys and values interleaved on
the heads axis: ``kv[page, offset, 2j]`` is kv head j's key and ``2j + 1`` its value
(``combine_pages``). Interleaved, a ``tensor`` shard of the heads axis holds whole (key, value)
pairs.

Two things the kernel reads from the host when left to itself, both given explicitly here so a
CPU host can compile it for a TPU topology: its block sizes (``Blocks``; the kernel's own table
looks up ``jax.devices()``), and the chip generation its Mosaic lowering needs, which JAX reads
from the abstract mesh in context, else from the default device (the host's CPU):
``lowering_for(mesh)`` scopes the mesh of the target devices around ``.lower()``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import jax
import jax.numpy as jnp
from jax.sharding import Mesh


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The kernel's tuning inputs: kv pages and queries one flash block covers, VMEM cap."""

    pages_per_block: int = 8
    queries_per_block: int = 32
    vmem_limit_bytes: int = 32 * 2 ** 20


def combine_pages(k_PxSxKxH: jax.Array, v_PxSxKxH: jax.Array) -> jax.Array:
    """The kernel's pool [P, S, 2K, H] from separate key and value pools (interleaved)."""
    P, S, K, H = k_PxSxKxH.shape
    return jnp.stack([k_PxSxKxH, v_PxSxKxH], axis=3).reshape(P, S, 2 * K, H)


def kernel_inputs(page_table_BxM: jax.Array, positions_BxL: jax.Array, num_pages: int,
                  page_size: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(kv_lens [B], page_indices [B, M], cu_q_lens [B + 1], num_seqs [1]) for B sequences of
    L queries at consecutive positions ending at ``positions_BxL[:, -1]``: the kernel's query j
    of L attends to entries < kv_len - L + j + 1, the position rule of ``paged_attention``.
    Rows with nothing written (a free slot, position < L - 1) get kv_len L over page 0, a
    finite output nobody reads; missing pages (-1) read page 0, masked by kv_len."""
    B, L = positions_BxL.shape
    M = page_table_BxM.shape[1]
    kv_lens_B = jnp.clip(positions_BxL[:, -1] + 1, L, M * page_size).astype(jnp.int32)
    pages_BxM = jnp.clip(page_table_BxM, 0, num_pages - 1).astype(jnp.int32)
    cu_q_lens = (jnp.arange(B + 1, dtype=jnp.int32) * L)
    return kv_lens_B, pages_BxM, cu_q_lens, jnp.array([B], jnp.int32)


def ragged_paged_attention(q_BxLxNxH: jax.Array, kv_PxSx2KxH: jax.Array,
                           page_table_BxM: jax.Array, positions_BxL: jax.Array,
                           blocks: Blocks = Blocks(), *, reference: bool = False) -> jax.Array:
    """Attention of each query to its sequence's entries at positions <= its own, over the
    combined pool; [B, L, N, H]. ``reference``: JAX's portable reference of the kernel (a
    Python loop over sequences: eager only), which the tests compare with
    ``paged_attention``."""
    from jax.experimental.pallas.ops.tpu.ragged_paged_attention import kernel as rpa

    B, L, N, H = q_BxLxNxH.shape
    P, S = kv_PxSx2KxH.shape[:2]
    args = (q_BxLxNxH.reshape(B * L, N, H), kv_PxSx2KxH,
            *kernel_inputs(page_table_BxM, positions_BxL, P, S))
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


@contextlib.contextmanager
def lowering_for(mesh: Mesh) -> Iterator[None]:
    """Lower (``jitted.lower(...)``) the kernel for ``mesh``'s devices: their chip, not the
    host's default device, is what the Mosaic lowering targets."""
    with jax.set_mesh(mesh):
        yield
