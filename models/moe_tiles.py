"""Grouped SwiGLU over rows sorted by expert, in row tiles, for backends without a grouped matmul.

``tiled_swiglu(rows_MxD, sizes_G, w_gate, w_up, w_down)``: rows ``[start_g, start_g + size_g)``
of the sorted ``rows_MxD`` go through expert ``g``'s SwiGLU; rows past ``sum(sizes_G)`` come out
0. A loop over experts reads each expert's weights once (gate and up side by side, so one matmul
computes both), and an inner loop with a data-dependent trip count covers its rows in full
tiles; the remainder (fewer rows than a full tile) runs as one tile, the power of two at or
above it (at least the smallest tile), moved back to end inside the buffer where it would run
past it, and masked to the remainder's rows. The work is the real rows plus less than the
remainder again per expert, whatever the routing (dropless, no static worst case), and no
buffer is padded. XLA's CPU ``ragged_dot`` runs every row through every group instead, and a
static layout of blocks pays for a worst case of padding and a weight gather per block
(docs/moe.md). The backward pass is written by hand (``jax.custom_vjp``), as loops with
data-dependent trip counts cannot be differentiated; it walks the same tiles and reuses the
forward's pre-activations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

# Tile rows: the full tile follows the mean rows per group; these bounds keep one tile's matmuls
# large enough to run near a matmul's speed (SMALLEST) and its operands small next to a cache
# (LARGEST).
SMALLEST, LARGEST = 8, 512


def tile_rows(rows: int, groups: int) -> tuple[int, int]:
    """(full, smallest) tile rows, powers of two: the full tile the largest power of two within
    the mean rows per group (in [SMALLEST, LARGEST], at most ``rows``), the smallest tile
    ``SMALLEST`` (or the full tile when that is smaller): no remainder runs in fewer rows."""
    target = min(max(SMALLEST, rows // max(groups, 1)), LARGEST, max(rows, 1))
    full = 1 << (target.bit_length() - 1)
    return full, min(SMALLEST, full)


def tiled_swiglu(rows_MxD: jax.Array, sizes_G: jax.Array, w_gate_GxDxF: jax.Array,
                 w_up_GxDxF: jax.Array, w_down_GxFxD: jax.Array) -> jax.Array:
    full, smallest = tile_rows(rows_MxD.shape[0], sizes_G.shape[0])
    return _tiled(rows_MxD, sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD, full, smallest)


Body = Callable[[jax.Array, int, "jax.Array | None", tuple], tuple]


def _each_tile(start: jax.Array, size: jax.Array, rows: int, full: int, smallest: int,
               body: Body, carry: tuple) -> tuple:
    """``body(row0, tile_rows, valid_Tx1 or None, carry)`` over rows ``[start, start + size)``
    of a buffer of ``rows`` rows. ``valid`` is None where every row of the tile is new; the
    remainder's tile starts early enough to stay in the buffer and marks the rows that are
    left."""
    n_full = size // full
    carry = lax.fori_loop(0, n_full, lambda i, c: body(start + i * full, full, None, c), carry)
    off = start + n_full * full
    left = size - n_full * full

    def rest(b: int) -> Callable[[tuple], tuple]:
        def run(c: tuple) -> tuple:
            row0 = jnp.minimum(off, rows - b)
            i_T = row0 + jnp.arange(b)
            return body(row0, b, ((i_T >= off) & (i_T < off + left))[:, None], c)

        return run

    # One tile for the whole remainder, not one exact tile per set bit of it: every tile pays a
    # fixed cost (the expert's weights read again, the f32 weight-gradient accumulators read
    # and written) that a few rows of padding cost less than. One two-way cond per tile size:
    # XLA copies the carried buffers into a many-way conditional (lax.switch).
    b, below = smallest, 0
    while b <= full:
        carry = _when((left > below) & (left <= b), rest(b), carry)
        b, below = 2 * b, b
    return carry


def _when(pred: jax.Array, fn: Callable[[tuple], tuple], carry: tuple) -> tuple:
    return lax.cond(pred, fn, lambda c: c, carry)


def _put(buf: jax.Array, start: jax.Array, valid: jax.Array | None,
         value: jax.Array) -> jax.Array:
    """Write ``value`` at ``start``; where ``valid`` is given, only its rows (the rest keep
    what earlier tiles or other experts wrote)."""
    if valid is not None:
        value = jnp.where(valid, value, lax.dynamic_slice_in_dim(buf, start, value.shape[0]))
    return lax.dynamic_update_slice_in_dim(buf, value, start, 0)


def _gate_up(wg: jax.Array, wu: jax.Array, g: jax.Array, dt: jnp.dtype) -> jax.Array:
    """Expert ``g``'s gate and up weights side by side, [D, 2F]."""
    return jnp.concatenate([wg[g], wu[g]], axis=1).astype(dt)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _tiled(x, sizes, wg, wu, wd, full: int, smallest: int):
    return _forward(x, sizes, wg, wu, wd, full, smallest)[0]


def _forward(x_MxD, sizes_G, wg, wu, wd, full, smallest):
    M, D = x_MxD.shape
    G, _, F = wg.shape
    dt = x_MxD.dtype
    starts_G = jnp.cumsum(sizes_G) - sizes_G

    def expert(g, carry):
        w_gu, wd_g = _gate_up(wg, wu, g, dt), wd[g].astype(dt)

        def tile(r0, b, valid, c):
            y, pre = c
            h = lax.dynamic_slice_in_dim(x_MxD, r0, b) @ w_gu
            yt = (jax.nn.silu(h[:, :F]) * h[:, F:]) @ wd_g
            return _put(y, r0, valid, yt), _put(pre, r0, valid, h)

        return _each_tile(starts_G[g], sizes_G[g], M, full, smallest, tile, carry)

    init = (jnp.zeros((M, D), dt), jnp.zeros((M, 2 * F), dt))
    y, pre = lax.fori_loop(0, G, expert, init)
    return y, (x_MxD, sizes_G, wg, wu, wd, pre)


def _backward(full, smallest, res, dy_MxD):
    x_MxD, sizes_G, wg, wu, wd, pre = res
    M, D = x_MxD.shape
    F = wg.shape[2]
    dt = x_MxD.dtype
    dy_MxD = dy_MxD.astype(dt)
    starts_G = jnp.cumsum(sizes_G) - sizes_G

    def expert(g, carry):
        dx, dwg, dwu, dwd = carry
        w_gu, wd_g = _gate_up(wg, wu, g, dt), wd[g].astype(dt)

        def tile(r0, b, valid, c):
            dx, g_gu, g_d = c
            dyt = lax.dynamic_slice_in_dim(dy_MxD, r0, b)
            if valid is not None:
                dyt = jnp.where(valid, dyt, 0)
            h = lax.dynamic_slice_in_dim(pre, r0, b)
            a, u = h[:, :F], h[:, F:]
            sig = jax.nn.sigmoid(a)
            s = a * sig
            dh = dyt @ wd_g.T
            d_gu = jnp.concatenate([dh * u * sig * (1 + a * (1 - sig)), dh * s], axis=1)
            xt = lax.dynamic_slice_in_dim(x_MxD, r0, b)
            g_gu = g_gu + (xt.T @ d_gu).astype(jnp.float32)
            g_d = g_d + ((s * u).T @ dyt).astype(jnp.float32)
            return _put(dx, r0, valid, d_gu @ w_gu.T), g_gu, g_d

        zeros = (jnp.zeros((D, 2 * F), jnp.float32), jnp.zeros((F, D), jnp.float32))
        dx, g_gu, g_d = _each_tile(starts_G[g], sizes_G[g], M, full, smallest, tile,
                                   (dx, *zeros))
        return (dx, dwg.at[g].set(g_gu[:, :F].astype(wg.dtype)),
                dwu.at[g].set(g_gu[:, F:].astype(wu.dtype)), dwd.at[g].set(g_d.astype(wd.dtype)))

    init = (jnp.zeros((M, D), dt), jnp.zeros_like(wg), jnp.zeros_like(wu), jnp.zeros_like(wd))
    dx, dwg, dwu, dwd = lax.fori_loop(0, wg.shape[0], expert, init)
    return dx, None, dwg, dwu, dwd


_tiled.defvjp(_forward, _backward)
