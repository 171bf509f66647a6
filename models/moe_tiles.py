"""Grouped SwiGLU over rows sorted by expert, in row tiles, for backends without a grouped matmul.

``tiled_swiglu(rows_MxD, sizes_G, w_gate, w_up, w_down)``: rows ``[start_g, start_g + size_g)``
of the sorted ``rows_MxD`` go through expert ``g``'s SwiGLU; rows past ``sum(sizes_G)`` come out
0. A loop over experts reads each expert's weights once, and an inner loop with a data-dependent
trip count covers its rows in full tiles, then the remainder in small tail tiles, so the work is
the real rows plus less than one tail tile per expert, whatever the routing (dropless, no static
worst case). XLA's CPU ``ragged_dot`` runs every row through every group instead, and a static
layout of blocks pays for a worst case of padding and a weight gather per block (docs/moe.md).
The backward pass is written by hand (``jax.custom_vjp``), as loops with data-dependent trip
counts cannot be differentiated; it reuses the forward's pre-activations.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax


def tile_rows(rows: int, groups: int) -> tuple[int, int]:
    """(full tile, tail tile) rows: the full tile about rows / groups (a power of two in
    [8, 256], large enough for an efficient matmul), the tail an eighth of it (at least 8), which
    bounds the padding to under one tail tile per expert."""
    target = max(8, rows // max(groups, 1))
    full = min(256, 1 << (target.bit_length() - 1))
    return full, max(8, full // 8)


def tiled_swiglu(rows_MxD: jax.Array, sizes_G: jax.Array, w_gate_GxDxF: jax.Array,
                 w_up_GxDxF: jax.Array, w_down_GxFxD: jax.Array) -> jax.Array:
    full, tail = tile_rows(rows_MxD.shape[0], sizes_G.shape[0])
    return _tiled(rows_MxD, sizes_G, w_gate_GxDxF, w_up_GxDxF, w_down_GxFxD, full, tail)


def _silu_grad(a: jax.Array) -> jax.Array:
    s = jax.nn.sigmoid(a)
    return s * (1 + a * (1 - s))


def _each_tile(size: jax.Array, full: int, tail: int, body, carry):
    """``body(offset, tile_rows, valid_Tx1, carry)`` over one expert's rows: full tiles, then
    tail tiles over the remainder; ``valid`` marks the tile's rows that are the expert's."""
    def step(b: int, base: jax.Array, i: jax.Array, c):
        off = base + i * b
        return body(off, b, (jnp.arange(b) < size - off)[:, None], c)

    n_full = size // full
    carry = lax.fori_loop(0, n_full, functools.partial(step, full, 0), carry)
    base = n_full * full
    n_tail = (size - base + tail - 1) // tail
    return lax.fori_loop(0, n_tail, functools.partial(step, tail, base), carry)


def _put(buf: jax.Array, start: jax.Array, valid: jax.Array, value: jax.Array) -> jax.Array:
    """Write ``value``'s valid rows at ``start``; rows of the next expert keep theirs."""
    cur = lax.dynamic_slice_in_dim(buf, start, value.shape[0])
    return lax.dynamic_update_slice_in_dim(buf, jnp.where(valid, value, cur), start, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _tiled(x, sizes, wg, wu, wd, full: int, tail: int):
    return _forward(x, sizes, wg, wu, wd, full, tail)[0]


def _forward(x_MxD, sizes_G, wg, wu, wd, full, tail):
    M, D = x_MxD.shape
    G, _, F = wg.shape
    dt = x_MxD.dtype
    starts_G = jnp.cumsum(sizes_G) - sizes_G
    pad = ((0, full), (0, 0))  # a tile starting at any real row stays in bounds
    xp = jnp.pad(x_MxD, pad)

    def expert(g, carry):
        wg_g, wu_g, wd_g = wg[g].astype(dt), wu[g].astype(dt), wd[g].astype(dt)

        def tile(off, b, valid, c):
            y, pre_g, pre_u = c
            r0 = starts_G[g] + off
            xt = lax.dynamic_slice_in_dim(xp, r0, b)
            a, u = xt @ wg_g, xt @ wu_g
            yt = (jax.nn.silu(a) * u) @ wd_g
            return _put(y, r0, valid, yt), _put(pre_g, r0, valid, a), _put(pre_u, r0, valid, u)

        return _each_tile(sizes_G[g], full, tail, tile, carry)

    init = (jnp.zeros((M + full, D), dt), jnp.zeros((M + full, F), dt),
            jnp.zeros((M + full, F), dt))
    y, pre_g, pre_u = lax.fori_loop(0, G, expert, init)
    return y[:M], (x_MxD, sizes_G, wg, wu, wd, pre_g, pre_u)


def _backward(full, tail, res, dy_MxD):
    x_MxD, sizes_G, wg, wu, wd, pre_g, pre_u = res
    M, D = x_MxD.shape
    F = wg.shape[2]
    dt = x_MxD.dtype
    starts_G = jnp.cumsum(sizes_G) - sizes_G
    pad = ((0, full), (0, 0))
    xp, dyp = jnp.pad(x_MxD, pad), jnp.pad(dy_MxD.astype(dt), pad)

    def expert(g, carry):
        dx, dwg, dwu, dwd = carry
        wg_g, wu_g, wd_g = wg[g].astype(dt), wu[g].astype(dt), wd[g].astype(dt)

        def tile(off, b, valid, c):
            dx, gg, gu, gd = c
            r0 = starts_G[g] + off
            xt = lax.dynamic_slice_in_dim(xp, r0, b)
            dyt = jnp.where(valid, lax.dynamic_slice_in_dim(dyp, r0, b), 0)
            a = lax.dynamic_slice_in_dim(pre_g, r0, b)
            u = lax.dynamic_slice_in_dim(pre_u, r0, b)
            s = jax.nn.silu(a)
            dh = dyt @ wd_g.T
            da, du = dh * u * _silu_grad(a), dh * s
            gd = gd + ((s * u).T @ dyt).astype(jnp.float32)
            gg = gg + (xt.T @ da).astype(jnp.float32)
            gu = gu + (xt.T @ du).astype(jnp.float32)
            return _put(dx, r0, valid, da @ wg_g.T + du @ wu_g.T), gg, gu, gd

        zeros = (jnp.zeros((D, F), jnp.float32), jnp.zeros((D, F), jnp.float32),
                 jnp.zeros((F, D), jnp.float32))
        dx, gg, gu, gd = _each_tile(sizes_G[g], full, tail, tile, (dx, *zeros))
        return (dx, dwg.at[g].set(gg.astype(wg.dtype)), dwu.at[g].set(gu.astype(wu.dtype)),
                dwd.at[g].set(gd.astype(wd.dtype)))

    init = (jnp.zeros((M + full, D), dt), jnp.zeros_like(wg), jnp.zeros_like(wu),
            jnp.zeros_like(wd))
    dx, dwg, dwu, dwd = lax.fori_loop(0, wg.shape[0], expert, init)
    return dx[:M], None, dwg, dwu, dwd


_tiled.defvjp(_forward, _backward)
