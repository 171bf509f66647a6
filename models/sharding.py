"""Logical-axis sharding for model code: constraints on activations, shardings of params.

Model code names logical axes only; ``mesh.rules`` maps them to physical mesh axes. With no mesh
every helper here is the identity, so the same model runs unsharded on one device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from meshrl.mesh.rules import Rules, logical_to_sharding, rules_for

LogicalAxes = tuple[str | None, ...]


@dataclasses.dataclass(frozen=True)
class ShardingContext:
    """A mesh plus the logical->physical rules of the role (train or sample) using it.

    Frozen and hashable: it lives in the module's static graph, so changing it retraces.
    """

    mesh: Mesh
    rules: Rules

    @classmethod
    def for_role(cls, mesh: Mesh, role: str = "train", fsdp: bool = False) -> ShardingContext:
        return cls(mesh, rules_for(role, fsdp))  # type: ignore[arg-type]

    def sharding(self, logical: Sequence[str | None], shape: Sequence[int]) -> NamedSharding:
        return logical_to_sharding(logical, self.mesh, self.rules, shape)


def constrain(x: jax.Array, logical: LogicalAxes, ctx: ShardingContext | None) -> jax.Array:
    """``with_sharding_constraint`` from logical names; the identity without a mesh."""
    if ctx is None:
        return x
    assert x.ndim == len(logical), (x.shape, logical)
    return jax.lax.with_sharding_constraint(x, ctx.sharding(logical, x.shape))


def _is_variable(x: Any) -> bool:
    return isinstance(x, nnx.Variable)


def _param_state(model_or_state: Any) -> Any:
    if isinstance(model_or_state, nnx.Module):
        return nnx.state(model_or_state, nnx.Param)
    return model_or_state


def logical_axes(model_or_state: Any) -> Any:
    """``nnx.State`` with the param state's paths whose leaves are logical-axis tuples.

    The Param wrappers are unwrapped, so the result is a pytree *prefix* of the param state:
    usable directly with ``mesh.tree_shardings`` and as jit in/out_shardings structure.
    """
    state = _param_state(model_or_state)

    def axes(var: nnx.Variable) -> LogicalAxes:
        names = var.get_metadata().get("logical_axes")
        if names is None:
            raise ValueError(f"parameter of shape {var.get_value().shape} has no logical_axes metadata")
        return tuple(names)

    return jax.tree.map(axes, state, is_leaf=_is_variable)


def param_shardings(model_or_abstract_state: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for ``nnx.state(model, nnx.Param)`` (concrete or abstract).

    Same paths as the param state with the Param wrappers unwrapped: a pytree prefix of it, so it
    can be passed as ``jax.jit(..., in_shardings/out_shardings=...)`` for the params or to
    ``jax.device_put(params, shardings)``.
    """
    state = _param_state(model_or_abstract_state)

    def shard(var: nnx.Variable) -> NamedSharding:
        return logical_to_sharding(var.get_metadata()["logical_axes"], mesh, rules,
                                   var.get_value().shape)

    return jax.tree.map(shard, state, is_leaf=_is_variable)
