"""Params trees on the host side: one ``"a/b/c"`` name per leaf, and a whole copy per process.

The names are what published weight versions are stored under (``inference.weights``), so they
must not change: a dict key or attribute name per level, a list index as its number, and the
``value`` level of an ``nnx.Variable`` left out.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec


def _key_name(k: Any) -> str | None:
    if isinstance(k, jax.tree_util.DictKey):
        return str(k.key)
    if isinstance(k, jax.tree_util.GetAttrKey):
        return None if k.name == "value" else k.name  # the Variable's own .value level
    if isinstance(k, jax.tree_util.SequenceKey):
        return str(k.idx)
    return str(k)


def path_name(path: tuple[Any, ...]) -> str:
    """``"layers/0/attn/q/kernel"`` for a key path of ``jax.tree_util.tree_flatten_with_path``."""
    return "/".join(n for n in map(_key_name, path) if n is not None)


def flat_params(params: Any) -> dict[str, Any]:
    """``{"layers/0/attn/q/kernel": leaf}`` for an nnx.Module (its ``nnx.Param`` state), an
    nnx.State, a pure dict or a published tree, in the tree's leaf order."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    return {path_name(path): leaf
            for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}


def nested(flat: dict[str, Any]) -> dict[str, Any]:
    """Nested dict with string keys (the layout Orbax stores)."""
    root: dict[str, Any] = {}
    for name, leaf in flat.items():
        node = root
        *parents, last = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = leaf
    return root


def _identity(tree: Any) -> Any:
    return tree


def process_local_copy(tree: Any) -> Any:
    """``tree`` (global arrays, possibly sharded across processes) as arrays on this process's
    first local device, each holding the whole value: what a consumer on this process alone
    reads (a sampler on this process's devices, a checkpoint writer). Every process calls it
    with the same tree: one jitted all-gather (a collective). A fully addressable tree comes
    back unchanged."""
    leaves = jax.tree.leaves(tree)
    if all(getattr(x, "is_fully_addressable", True) for x in leaves):
        return tree
    mesh = leaves[0].sharding.mesh
    # TODO(meshrl): this gathers every leaf of ``tree`` whole onto every device at once; a large
    # model handed over in one call needs it tensor by tensor (or a sampler mesh that spans
    # processes).
    replicated = jax.jit(_identity, out_shardings=NamedSharding(mesh, PartitionSpec()))(tree)
    return jax.tree.map(lambda x: x.addressable_shards[0].data, replicated)
