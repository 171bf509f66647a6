"""The train state pytree and its shardings."""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


@flax.struct.dataclass
class TrainState:
    """Everything a resumed run needs from the device: one pytree, checkpointed whole.

    ``rng`` is raw ``uint32[2]`` key data (not a typed key) so Orbax saves it like any array.
    ``weight_version`` counts applied updates (a skipped non-finite step leaves it unchanged), and
    ``skipped`` counts those skips.
    """

    step: jax.Array
    params: Any
    opt_state: Any
    rng: jax.Array
    weight_version: jax.Array
    skipped: jax.Array


def init_state(params: Any, tx: optax.GradientTransformation, seed: int) -> TrainState:
    """A fresh state at step 0 (call under ``jax.jit`` with ``out_shardings`` to place it)."""
    return TrainState(
        step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params),
        rng=jax.random.key_data(jax.random.key(seed)).astype(jnp.uint32),
        weight_version=jnp.zeros((), jnp.int32), skipped=jnp.zeros((), jnp.int32))


def _fits(sharding: Any, leaf: Any, mesh: Mesh) -> bool:
    spec = getattr(sharding, "spec", None)
    if spec is None or len(spec) > len(leaf.shape):
        return False
    for dim, axes in zip(leaf.shape, spec):
        if axes is None:
            continue
        names = axes if isinstance(axes, tuple) else (axes,)
        size = 1
        for a in names:
            size *= mesh.shape[a]
        if dim % size:
            return False
    return True


def state_shardings(params_shardings: Any, tx: optax.GradientTransformation, mesh: Mesh,
                    abstract_params: Any) -> TrainState:
    """Shardings of a ``TrainState``: optimizer moments follow their parameter's sharding, every
    other optimizer leaf (counts, factored statistics whose shape differs) is replicated."""
    replicated = NamedSharding(mesh, PartitionSpec())
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    opt_sh = optax.tree_map_params(tx, lambda _, sh: sh, abstract_opt, params_shardings,
                                   transform_non_params=lambda _: replicated)
    # Factored (Adafactor) statistics sit where param-shaped leaves are expected but have other
    # shapes; a parameter's spec would not fit them, so they are replicated.
    opt_sh = jax.tree.map(lambda sh, leaf: sh if _fits(sh, leaf, mesh) else replicated,
                          opt_sh, abstract_opt)
    return TrainState(step=replicated, params=params_shardings, opt_state=opt_sh, rng=replicated,
                      weight_version=replicated, skipped=replicated)


def abstract_state(state_sh: TrainState, params: Any, tx: optax.GradientTransformation,
                   seed: int = 0) -> TrainState:
    """``ShapeDtypeStruct`` tree of the state carrying ``state_sh``: the restore target."""
    shapes = jax.eval_shape(lambda p: init_state(p, tx, seed), params)
    return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                        shapes, state_sh)


def params_checksum(params: Any) -> float:
    """One float from the params, the same on every process and for any mesh of the same
    values: each leaf's float32 sum (a jitted, replicated reduction, so every process can read
    it), added on the host in float64. For comparing runs (summary.json), not for integrity."""
    leaves = jax.tree.leaves(params)
    sharding = getattr(leaves[0], "sharding", None)
    out = (NamedSharding(sharding.mesh, PartitionSpec()) if isinstance(sharding, NamedSharding)
           else None)
    sums = jax.jit(lambda xs: [jnp.sum(x.astype(jnp.float32)) for x in xs],
                   out_shardings=out)(leaves)
    return float(np.sum([np.float64(jax.device_get(s)) for s in sums]))
