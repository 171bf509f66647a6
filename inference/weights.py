"""Weight versions for the sampler: in-process handoff (reshard + cast) and Orbax publication.

Both paths end in the same jitted copy-and-cast onto the sampler's shardings, so a version handed
over in process and the same version restored from ``<workdir>/weights/<version>`` are bitwise
identical on the sampler.

With LoRA the in-process handoff may carry the adapters alone (``models.lora.AdapterUpdate``):
the sampler keeps its own copy of the frozen base (from the first such update, which carries
it, quantised as the trainer stores it) and merges each version's adapters into it on its
devices, with the trainer's arithmetic.

Publication and retention of ``<workdir>/weights/<version>``: ``inference.published``;
``restore_weights`` here reads a published version onto the sampler's shardings.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from meshrl.inference.published import WeightVersionGoneError, published_versions, weights_dir
from meshrl.models.lora import (
    AdapterUpdate,
    BaseTree,
    adapter_shardings,
    frozen_sharding,
    merge_frozen,
)
from meshrl.utils import paths
from meshrl.utils.log import get_logger
from meshrl.utils.params import flat_params, nested

log = get_logger("inference")


class WeightMismatchError(ValueError):
    """Incoming params do not match the sampler's model (tree, shape or dtype kind)."""



def _kind(dtype: Any) -> str:
    # numpy's dtype.kind calls bfloat16 'V' (void); ask JAX's type lattice instead.
    for kind in ("floating", "complexfloating", "signedinteger", "unsignedinteger", "bool_"):
        if jnp.issubdtype(dtype, getattr(jnp, kind)):
            return kind
    return str(jnp.dtype(dtype))


def check_compatible(incoming: dict[str, Any], expected: dict[str, Any]) -> None:
    """Raise WeightMismatchError naming the first offending param path."""
    missing = sorted(set(expected) - set(incoming))
    extra = sorted(set(incoming) - set(expected))
    if missing or extra:
        raise WeightMismatchError(f"param tree mismatch: missing {missing[:5]}, unexpected "
                                  f"{extra[:5]}")
    for name, want in expected.items():
        got = incoming[name]
        if tuple(got.shape) != tuple(want.shape):
            raise WeightMismatchError(f"param {name}: shape {tuple(got.shape)}, sampler expects "
                                      f"{tuple(want.shape)}")
        if _kind(got.dtype) != _kind(want.dtype):
            raise WeightMismatchError(f"param {name}: dtype {got.dtype} ({_kind(got.dtype)}) "
                                      f"cannot become {want.dtype} ({_kind(want.dtype)})")


# Leaves are copied and cast in groups of up to this many bytes of copies, or of the largest
# leaf's copy where that is larger: one program call per group instead of one per leaf (each
# call costs a host dispatch), while the transient copies stay within what a leaf-by-leaf copy
# of the largest leaf holds anyway (or this much).
GROUP_BYTES = 64 << 20


def make_copy_cast(dtypes: dict[str, Any]) -> Callable[[list[str], list[jax.Array]],
                                                       list[jax.Array]]:
    """``(names, leaves) ->`` jitted copies of the leaves cast to the sampler's dtypes for
    ``names``, laid out as the leaves are (one program a group; the leaves of a call share
    their devices).

    ``jnp.array(copy=True)`` keeps a real copy even where the dtype already matches, so the
    sampler never aliases a buffer the trainer will donate to its next step.
    """
    group = jax.jit(lambda vs, dts: [jnp.array(v, copy=True).astype(d) for v, d in zip(vs, dts)],
                    static_argnums=1)
    return lambda names, leaves: group(list(leaves), tuple(dtypes[k] for k in names))


def copy_groups(flat: dict[str, jax.Array], expected: dict[str, Any]) -> list[list[str]]:
    """``flat``'s names in order, cut into groups of at most ``GROUP_BYTES`` of cast copies (or
    the largest leaf's) whose leaves sit on the same devices in the same order (one jitted call
    takes its arguments on one device assignment)."""
    nbytes = {k: math.prod(v.shape) * jnp.dtype(expected[k].dtype).itemsize
              for k, v in flat.items()}
    budget = max([GROUP_BYTES, *nbytes.values()])
    groups: list[list[str]] = []
    size, devices = 0, None
    for k, v in flat.items():
        here = _device_order(v)
        if not groups or size + nbytes[k] > budget or here != devices:
            groups.append([])
            size, devices = 0, here
        groups[-1].append(k)
        size += nbytes[k]
    return groups


def _device_order(x: Any) -> Any:
    """The devices a leaf's program call runs on, in order; None for a host array; a fresh
    object (a group of its own) for a multi-device sharding with no mesh to give the order."""
    if not isinstance(x, jax.Array):
        return None
    if isinstance(x.sharding, NamedSharding):
        return tuple(x.sharding.mesh.devices.flat)
    devices = x.sharding.device_set
    return tuple(devices) if len(devices) == 1 else object()


def move_all(xs: Any, shardings: Any) -> Any:
    """``jax.device_put(xs, shardings)`` (pytrees of one structure) in one call for the arrays
    not on their sharding yet (each costs the call host time); an array going onto the same
    devices in another order once it is computed: that move (``jax._src.dispatch``'s
    reorder_shards) of an array still being computed aborted the whole process now and then on
    XLA:CPU (jax 0.10.2)."""
    leaves, tree = jax.tree.flatten(xs)
    targets = tree.flatten_up_to(shardings)
    todo = [i for i, (x, sh) in enumerate(zip(leaves, targets, strict=True))
            if not (isinstance(x, jax.Array) and x.sharding == sh)]
    ready = [jax.block_until_ready(leaves[i]) if _reorders(leaves[i], targets[i]) else leaves[i]
             for i in todo]
    for i, moved in zip(todo, jax.device_put(ready, [targets[i] for i in todo]), strict=True):
        leaves[i] = moved
    return jax.tree.unflatten(tree, leaves)


def _reorders(x: Any, sharding: Any) -> bool:
    src = getattr(x, "sharding", None)
    return (isinstance(src, NamedSharding) and isinstance(sharding, NamedSharding)
            and src.device_set == sharding.device_set
            and tuple(src.mesh.devices.flat) != tuple(sharding.mesh.devices.flat))


def reshard_cast(params: Any, expected: dict[str, Any], shardings: dict[str, Any],
                 copy_cast: Callable[[list[str], list[jax.Array]], list[jax.Array]],
                 ) -> dict[str, jax.Array]:
    """Validate, then group by group (``copy_groups``) copy and cast where the params are and
    move the copies onto the sampler's shardings (any source mesh)."""
    flat = flat_params(params)
    check_compatible(flat, expected)
    # Cast before moving, a group at a time: the trainer's float32 params are sharded over
    # every chip and the sampler's replicate over ``data``, so moving first would hold float32
    # copies in the sampler's layout (twice its weights) beside the train state; this way the
    # transient is one group's cast copies in the trainer's layout, freed once moved. The
    # copies are fresh, so the move may keep their buffers where the layouts agree.
    out: dict[str, jax.Array] = {}
    for names in copy_groups(flat, expected):
        copies = copy_cast(names, [flat[k] for k in names])
        out.update(zip(names, move_all(copies, [shardings[k] for k in names]), strict=True))
    jax.block_until_ready(out)
    return out


class SamplerWeights:
    """The sampler's param layout: what a handoff or a restore must match (names, shapes,
    dtypes), the shardings it lands on, and the jitted copy-cast that puts it there."""

    def __init__(self, abstract_state: Any, shardings: Any) -> None:
        self.template = abstract_state
        self.expected = flat_params(abstract_state)
        self.shardings = flat_params(shardings)
        self.copy_cast = make_copy_cast({k: v.dtype for k, v in self.expected.items()})
        # Adapter-only handoffs: the kept frozen base, the full params it stands for, the
        # merge program, and (adapter bytes, full bytes) of the latest such handoff.
        self._base: dict[str, Any] | None = None
        self._base_tree: BaseTree = ()
        self._merge: Callable | None = None
        self.full_bytes = 0
        self.handoff_bytes: tuple[int, int] | None = None

    def handoff(self, params: Any) -> dict[str, jax.Array]:
        """In-process ``params`` (any mesh) as validated, resharded, cast sampler copies;
        an ``AdapterUpdate``: its adapters merged into the kept base."""
        if isinstance(params, AdapterUpdate):
            return self._merge_adapters(params)
        return reshard_cast(params, self.expected, self.shardings, self.copy_cast)

    @property
    def has_base(self) -> bool:
        """Whether an adapter-only handoff gave this sampler its frozen base already."""
        return self._base is not None

    def kept_base(self) -> dict[str, Any] | None:
        """The frozen base kept for adapter-only handoffs (None without one): what releasing
        the sampler's weights must not delete."""
        return self._base

    def _keep_base(self, update: AdapterUpdate) -> None:
        """Keep a copy of ``update.base`` (the trainer's frozen base, quantised leaves as they
        are) placed like the sampler's kernels, and the merge that turns it plus adapters into
        the sampler's params with the trainer's arithmetic (dequantise, add in float32, cast to
        the param dtype) and then the sampler's cast, as a full handoff of merged params does."""
        named = {k: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
                 for k, shape, dtype in update.base_tree}
        check_compatible(named, self.expected)
        sh = {k: frozen_sharding(v, self.shardings[k]) for k, v in update.base.items()}
        copy = jax.jit(lambda f: jax.tree.map(lambda v: jnp.array(v, copy=True), f),
                       out_shardings=sh)
        # The trainer donates its own; the base is ready before it moves (``move``'s reason).
        self._base = copy(jax.device_put(jax.block_until_ready(update.base), sh))
        self._base_tree = update.base_tree
        dtypes = {k: v.dtype for k, v in named.items()}
        self._merge = jax.jit(
            lambda base, ad, targets, scale: {
                k: v.astype(self.expected[k].dtype)
                for k, v in merge_frozen(base, ad, targets, scale, dtypes).items()},
            static_argnums=(2, 3), out_shardings=self.shardings)
        self.full_bytes = sum(math.prod(v.shape) * v.dtype.itemsize for v in named.values())

    def _merge_adapters(self, update: AdapterUpdate) -> dict[str, jax.Array]:
        if update.base is not None:
            self._keep_base(update)
        base, merge = self._base, self._merge
        if base is None or merge is None:
            raise WeightMismatchError("an adapter-only handoff before the sampler holds a "
                                      "base: the first update must carry the base")
        if update.base_tree != self._base_tree:
            theirs, ours = dict((k, v) for k, *v in update.base_tree), dict(
                (k, v) for k, *v in self._base_tree)
            diff = sorted(k for k in set(theirs) | set(ours) if theirs.get(k) != ours.get(k))
            raise WeightMismatchError(f"adapter handoff for another frozen base: the base "
                                      f"differs at {diff[:3]}; hand over the full params")
        sh = adapter_shardings(list(update.targets), self.shardings)
        adapters = move_all(update.adapters, {p: {k: sh[p][k] for k in ab}
                                              for p, ab in update.adapters.items()})
        out = merge(base, adapters, update.targets, update.scale)
        jax.block_until_ready(out)
        sent = sum(v.size * v.dtype.itemsize for ab in update.adapters.values()
                   for v in ab.values())
        first = self.handoff_bytes is None
        self.handoff_bytes = (sent, self.full_bytes)
        (log.info if first else log.debug)(
            "adapter-only weight handoff: %d bytes per version instead of %d (full params)",
            sent, self.full_bytes)
        return out

    def restore(self, workdir: paths.PathLike, version: int) -> dict[str, jax.Array]:
        """Published version ``version`` as the same copies ``handoff`` gives."""
        restored = restore_weights(workdir, version, self.expected, self.shardings)
        return reshard_cast(restored, self.expected, self.shardings, self.copy_cast)

    def tree(self, flat: dict[str, jax.Array]) -> Any:
        """``flat`` as the sampler's params tree (``expected`` is in the template's order)."""
        leaves = [flat[k] for k in self.expected]
        return jax.tree.unflatten(jax.tree.structure(self.template), leaves)


def restore_weights(workdir: paths.PathLike, version: int, expected: dict[str, Any],
                    shardings: dict[str, Any]) -> dict[str, jax.Array]:
    """Restore a published version straight into the sampler shardings (stored dtype kept).
    A version absent, or removed while being read, is a ``WeightVersionGoneError``."""
    import orbax.checkpoint as ocp

    path = weights_dir(workdir, version)
    gone = (f"weight version {version} at {path} {{}}: the run keeps only its newest "
            f"checkpoint.keep_versions versions (published now: {{}}); pick a listed version, "
            f"or publish with checkpoint.keep_versions = 0 to keep every one")
    if not path.exists():
        raise WeightVersionGoneError(gone.format("does not exist", published_versions(workdir)))
    ckptr = ocp.StandardCheckpointer()
    try:
        meta = flat_params(ckptr.metadata(path).item_metadata)
        check_compatible(meta, expected)
        target = nested({k: jax.ShapeDtypeStruct(tuple(m.shape), m.dtype, sharding=shardings[k])
                         for k, m in meta.items()})
        return flat_params(ckptr.restore(path, target))
    except WeightMismatchError:
        raise
    except Exception as e:
        if path.exists():
            raise
        # Whatever Orbax or tensorstore raised for the vanished files, the cause is this.
        raise WeightVersionGoneError(gone.format("was deleted while being read",
                                                 published_versions(workdir))) from e
