"""The tiled grouped SwiGLU (CPU's ``blocked`` kernel): values and hand-written gradients equal
a per-row reference for group sizes that use full tiles, remainder tiles of each size (exact and
masked), a remainder tile moved back over earlier rows, empty groups, trailing padding rows and
buffers smaller than the smallest tile."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.models.moe_tiles import LARGEST, SMALLEST, tile_rows, tiled_swiglu

D, F = 8, 12


def _reference(x, sizes, wg, wu, wd):
    group = np.repeat(np.arange(len(sizes)), sizes)
    rows = []
    for i in range(x.shape[0]):
        if i >= len(group):
            rows.append(jnp.zeros((D,), x.dtype))
            continue
        g = group[i]
        rows.append((jax.nn.silu(x[i] @ wg[g]) * (x[i] @ wu[g])) @ wd[g])
    return jnp.stack(rows)


def _inputs(rows: int, groups: int, seed: int = 0):
    ks = jax.random.split(jax.random.key(seed), 5)
    x = jax.random.normal(ks[0], (rows, D))
    wg, wu = (0.3 * jax.random.normal(k, (groups, D, F)) for k in ks[1:3])
    wd = 0.3 * jax.random.normal(ks[3], (groups, F, D))
    probe = jax.random.normal(ks[4], (rows, D))
    return x, wg, wu, wd, probe


@pytest.mark.parametrize("sizes", [
    (40, 0, 3, 21),        # full tiles, exact and masked 8-row remainders, an empty group
    (0, 0, 64, 0),         # everything in one group, exact full tiles
    (5, 9, 2, 1),          # remainders only (masked 8- and 16-row tiles), 47 padding rows
    (60, 0, 0, 4),         # the last group's tile reaches back over the first group's rows
    (13, 30, 11, 10),      # masked full-size remainders, the last one moved back 6 rows
])
def test_tiled_swiglu_equals_a_per_row_loop_in_values_and_gradients(sizes):
    M, G = 64, len(sizes)
    assert tile_rows(M, G) == (16, 8)  # the cases above cross both tile sizes
    _check_against_reference(M, sizes)


@pytest.mark.parametrize("sizes", [(1, 0, 2), (0, 3, 0)])
def test_tiled_swiglu_with_fewer_rows_than_the_smallest_tile_equals_the_loop(sizes):
    assert tile_rows(3, len(sizes)) == (2, 2)
    _check_against_reference(3, sizes)


def _check_against_reference(M: int, sizes: tuple[int, ...]) -> None:
    x, wg, wu, wd, probe = _inputs(M, len(sizes))
    sizes_G = jnp.asarray(sizes, jnp.int32)

    def loss(fn):
        return lambda *a: (fn(a[0], sizes_G, *a[1:]) * probe).sum()

    got = jax.value_and_grad(loss(jax.jit(tiled_swiglu)), argnums=range(4))(x, wg, wu, wd)
    want = jax.value_and_grad(loss(_reference), argnums=range(4))(x, wg, wu, wd)

    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-5)
    for g, w in zip(got[1], want[1], strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    if sum(sizes) < M:
        y = jax.jit(tiled_swiglu)(x, sizes_G, wg, wu, wd)
        assert not np.asarray(y[sum(sizes):]).any()  # padding rows come out 0


def test_tile_rows_follow_the_mean_rows_per_group_within_bounds():
    assert tile_rows(8192, 16) == (512, SMALLEST)
    assert tile_rows(24, 4) == (8, 8)
    assert tile_rows(1000, 3) == (256, SMALLEST)
    assert tile_rows(1 << 20, 2) == (LARGEST, SMALLEST)
    assert tile_rows(3, 4) == (2, 2)  # never more rows than the buffer holds
