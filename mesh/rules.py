"""Logical -> physical axis rules, per role, and shardings built from them.

Model code names only logical axes. This module alone decides where they go:

| logical        | train role                           | sample role          |
|----------------|--------------------------------------|----------------------|
| batch          | (dcn_data, data, expert)             | (dcn_data, data,     |
|                |                                      |  expert, context)    |
| length         | context                              | -                    |
| embed          | data if mesh.fsdp, else -            | -                    |
| heads          | tensor                               | tensor               |
| kv_heads       | tensor                               | tensor               |
| head_dim       | -                                    | -                    |
| mlp            | tensor                               | tensor               |
| vocab          | tensor                               | tensor               |
| exp            | expert                               | expert               |
| mlp_moe        | expert_tensor                        | expert_tensor        |
| layers         | -                                    | -                    |
| act_embed      | -                                    | -                    |
| act_heads      | tensor                               | tensor               |
| act_kv_heads   | tensor                               | tensor               |
| act_mlp        | tensor                               | tensor               |
| act_vocab      | tensor                               | tensor               |
| loss_vocab     | (tensor, data, expert, context,      | tensor               |
|                |  expert_tensor, dcn_data)            |                      |
| cache_slots    | (dcn_data, data, expert)             | (dcn_data, data,     |
|                |                                      |  expert, context)    |
| cache_len      | -                                    | -                    |

``dcn_data`` exists only in a hybrid-sharded mesh (``mesh.fsdp`` with ``mesh.dcn_data`` > 1,
see ``mesh.mesh``): there ``data`` is the ICI part alone, so ``embed`` shards params within a
slice/host and they replicate across DCN (HSDP), while the batch still splits over both. Axes a
mesh does not have are dropped, like axes of size 1.

The sample role folds ``context`` into the batch: the sampler's sequences are short next to a
training sequence, so a colocated sampler spends those devices on more slots instead.

``loss_vocab`` shards the vocabulary of the chunked float32 logits of the losses
(``algorithms.logits``) over every axis: each chunk's few hidden states are gathered instead
of the [V, D] head, whose gradient then stays sharded too.

Resolution: each logical name takes its rule's mesh axes, minus axes already used earlier in the
same spec and minus axes whose size does not divide the dimension (when the shape is known), so
e.g. 2 KV heads on tensor=4 stay replicated instead of failing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Literal

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.configs.schema import DCN_DATA_AXIS

Role = Literal["train", "sample"]
Rules = tuple[tuple[str, tuple[str, ...]], ...]

_BATCH = (DCN_DATA_AXIS, "data", "expert")
_COMMON: Rules = (
    ("batch", _BATCH),
    ("heads", ("tensor",)),
    ("kv_heads", ("tensor",)),
    ("head_dim", ()),
    ("mlp", ("tensor",)),
    ("vocab", ("tensor",)),
    ("exp", ("expert",)),
    ("mlp_moe", ("expert_tensor",)),
    ("layers", ()),
    ("act_embed", ()),
    ("act_heads", ("tensor",)),
    ("act_kv_heads", ("tensor",)),
    ("act_mlp", ("tensor",)),
    ("act_vocab", ("tensor",)),
    ("cache_slots", _BATCH),
    ("cache_len", ()),
)


def train_rules(fsdp: bool) -> Rules:
    return (("length", ("context",)), ("embed", ("data",) if fsdp else ()),
            ("loss_vocab", ("tensor", "data", "expert", "context", "expert_tensor",
                            DCN_DATA_AXIS))) + _COMMON


def sample_rules() -> Rules:
    folded = (*_BATCH, "context")
    common = tuple((k, folded if k in ("batch", "cache_slots") else v) for k, v in _COMMON)
    return (("length", ()), ("embed", ()), ("loss_vocab", ("tensor",))) + common


def rules_for(role: Role, fsdp: bool = False) -> Rules:
    if role == "train":
        return train_rules(fsdp)
    if role == "sample":
        return sample_rules()
    raise ValueError(f"role = {role!r}: must be 'train' or 'sample'")


def logical_to_spec(logical: Sequence[str | None], rules: Rules, mesh: Mesh | None = None,
                    shape: Sequence[int] | None = None) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; see the module docstring for the rules."""
    table = dict(rules)
    if shape is not None and len(shape) != len(logical):
        raise ValueError(f"logical axes {tuple(logical)} do not match shape {tuple(shape)}")
    used: set[str] = set()
    out: list[Any] = []
    for i, name in enumerate(logical):
        if name is None:
            out.append(None)
            continue
        if name not in table:
            raise KeyError(f"logical axis {name!r} has no rule; known: {sorted(table)}")
        axes = [a for a in table[name] if a not in used]
        if mesh is not None:
            axes = [a for a in axes if mesh.shape.get(a, 1) > 1]
            if shape is not None:
                axes = _divisible_prefix(axes, shape[i], mesh)
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    return PartitionSpec(*out)


def _divisible_prefix(axes: list[str], dim: int, mesh: Mesh) -> list[str]:
    kept: list[str] = []
    for a in axes:
        if dim % (math.prod(mesh.shape[k] for k in kept) * mesh.shape[a]) == 0:
            kept.append(a)
    return kept


def logical_to_sharding(logical: Sequence[str | None], mesh: Mesh, rules: Rules,
                        shape: Sequence[int] | None = None) -> NamedSharding:
    return NamedSharding(mesh, logical_to_spec(logical, rules, mesh, shape))


def tree_shardings(logical_tree: Any, mesh: Mesh, rules: Rules, abstract_tree: Any) -> Any:
    """Shardings for a pytree given a matching tree of logical-axis tuples and of arrays/shapes."""
    is_leaf = lambda x: isinstance(x, tuple) and all(isinstance(a, (str, type(None))) for a in x)  # noqa: E731
    flat_logical, treedef = jax.tree.flatten(logical_tree, is_leaf=is_leaf)
    flat_arrays = treedef.flatten_up_to(abstract_tree)
    return treedef.unflatten([
        logical_to_sharding(lg, mesh, rules, getattr(a, "shape", None))
        for lg, a in zip(flat_logical, flat_arrays)])


def describe_rules(rules: Rules) -> str:
    return "\n".join(f"  {name:<13} -> {', '.join(axes) if axes else '-'}" for name, axes in rules)
