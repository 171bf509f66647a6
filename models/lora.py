"""LoRA over a decoder's param state: adapters, their merge into the base, the frozen base.

The trainer's forward is a pure function of an ``nnx.State`` (``trainer.step.decoder_forward``),
so LoRA is applied to that state rather than to the module graph: each targeted ``Projection``
kernel ``W`` (shape ``lead + in + out``, ``lead`` the stacked ``layers`` axis if any) gets
``A: lead + in + (r,)`` and ``B: lead + (r,) + out``. The train step's forward runs them
unmerged (``x W + dropout(x) A B * alpha / r``, ``models/lora_kernel.py``); the weights the
sampler, evaluations and exports read are merged, ``W + alpha / r * A @ B``. ``A`` starts
normal with std ``1 / sqrt(fan_in)``, ``B`` at zero, so step 0 is the base model. The frozen base can be stored quantised (``models/quant.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshrl.configs.fields import ConfigError
from meshrl.configs.lora_schema import LoraConfig
from meshrl.models import quant
from meshrl.models.layers import Projection
from meshrl.models.lora_kernel import AdaptedKernel
from meshrl.utils.params import path_name

Adapters = dict[str, dict[str, jax.Array]]  # "layers/0/attn/q/kernel" -> {"a": A, "b": B}


@dataclasses.dataclass(frozen=True)
class Target:
    """One projection kernel: its path, shape and how its axes split (lead, in, out)."""

    path: str
    shape: tuple[int, ...]
    n_lead: int
    n_in: int

    @property
    def n_out(self) -> int:
        return len(self.shape) - self.n_lead - self.n_in

    def a_shape(self, rank: int) -> tuple[int, ...]:
        return self.shape[:self.n_lead + self.n_in] + (rank,)

    def b_shape(self, rank: int) -> tuple[int, ...]:
        return self.shape[:self.n_lead] + (rank,) + self.shape[self.n_lead + self.n_in:]


def projections(graphdef: nnx.GraphDef, params: Any) -> list[Target]:
    """Every ``Projection`` kernel of the decoder, in path order."""
    model = nnx.merge(graphdef, params)
    out = []
    for path, module in nnx.iter_modules(model):
        if isinstance(module, Projection):
            axes = module.kernel.get_metadata()["logical_axes"]
            lead = next((i for i, a in enumerate(axes) if a != "layers"), 0)
            out.append(Target("/".join(map(str, path)) + "/kernel",
                              tuple(module.kernel.shape), lead, module.n_in))
    return sorted(out, key=lambda t: t.path)


def select(targets: list[Target], regex: str) -> list[Target]:
    """The targets whose path ``regex`` searches; none is a config error naming the paths."""
    pattern = re.compile(regex)
    chosen = [t for t in targets if pattern.search(t.path)]
    if not chosen:
        names = ", ".join(t.path for t in targets[:4])
        raise ConfigError(f"lora.targets = {regex!r}: matches no projection; paths look like "
                          f"{names}")
    return chosen


def init_adapters(targets: list[Target], rank: int, seed: int) -> Adapters:
    """A ~ N(0, 1 / fan_in), B = 0 (float32: adapters are small and train in full precision)."""
    keys = jax.random.split(jax.random.key(seed), len(targets))
    out = {}
    for key, t in zip(keys, targets):
        fan_in = math.prod(t.shape[t.n_lead:t.n_lead + t.n_in])
        a = jax.random.normal(key, t.a_shape(rank), jnp.float32) / math.sqrt(fan_in)
        out[t.path] = {"a": a, "b": jnp.zeros(t.b_shape(rank), jnp.float32)}
    return out


def delta(t: Target, a: jax.Array, b: jax.Array) -> jax.Array:
    """``A @ B`` over the rank axis, in the kernel's shape (float32)."""
    lead = t.shape[:t.n_lead]
    a2 = a.reshape(lead + (-1, a.shape[-1]))
    b2 = b.reshape(lead + (b.shape[t.n_lead], -1))
    return jnp.matmul(a2.astype(jnp.float32), b2.astype(jnp.float32)).reshape(t.shape)


def add_delta(w: jax.Array, t: Target, ad: dict[str, jax.Array], scale: float) -> jax.Array:
    """``w + scale * A @ B`` in float32: the one merge the trainer and the sampler both run,
    so that a merge on either side gives the same values."""
    return w.astype(jnp.float32) + scale * delta(t, ad["a"], ad["b"])


def merge_frozen(frozen: dict[str, Any], adapters: Adapters | None,
                 targets: tuple[Target, ...], scale: float, dtypes: dict[str, Any]
                 ) -> dict[str, jax.Array]:
    """Flat full params from a frozen base (``Lora.freeze``'s dict, quantised leaves
    dequantised) and the scaled adapters, each leaf in ``dtypes``; ``adapters = None``: the
    base alone. The trainer's full params (``engine.params``) and the sampler's merge both
    run this."""
    by_path = {t.path: t for t in targets}
    out = {}
    for path, stored in frozen.items():
        w = quant.dequantize(stored) if isinstance(stored, quant.QTensor) else stored
        if adapters is not None and path in by_path:
            w = add_delta(w, by_path[path], adapters[path], scale)
        out[path] = w.astype(dtypes[path])
    return out


def leaf_names(treedef: Any) -> list[str]:
    """The leaf names (``path_name``) of ``treedef`` in its own order. A frozen base dict is
    keyed by them but, once through jit, sorted as strings (``layers/10`` before
    ``layers/2``): leaves go back into a tree by name, never by the dict's order."""
    index = jax.tree.unflatten(treedef, list(range(treedef.num_leaves)))
    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(index)[0]]


BaseTree = tuple[tuple[str, tuple[int, ...], str], ...]


def base_tree(flat: dict[str, Any]) -> BaseTree:
    """The (name, shape, dtype) of every leaf of a full params tree: what an adapter handoff
    names as the base it adapts."""
    return tuple((k, tuple(v.shape), str(v.dtype)) for k, v in sorted(flat.items()))


@functools.partial(jax.tree_util.register_dataclass, data_fields=["adapters", "base"],
                   meta_fields=["targets", "scale", "base_tree"])
@dataclasses.dataclass(frozen=True)
class AdapterUpdate:
    """A weight handoff of the adapters only: the receiver merges them into its own copy of
    the frozen base. ``base`` (the frozen base as the trainer stores it, ``Lora.freeze``'s
    dict, quantised leaves included) travels with the first update, when the receiver has
    none yet; ``base_tree`` names the full params it stands for (their names, shapes and
    dtypes)."""

    adapters: Adapters
    base: Any
    targets: tuple[Target, ...]
    scale: float
    base_tree: BaseTree


def adapter_shardings(targets: list[Target], kernel_sh: dict[str, Any]) -> dict[str, Any]:
    """A follows its kernel's lead and input axes, B its lead and output axes; the rank axis
    is replicated (r is small and rarely divides a mesh axis)."""
    out = {}
    for t in targets:
        sh = kernel_sh[t.path]
        spec = tuple(sh.spec) + (None,) * (len(t.shape) - len(sh.spec))
        lead, ins, outs = (spec[:t.n_lead], spec[t.n_lead:t.n_lead + t.n_in],
                           spec[t.n_lead + t.n_in:])
        out[t.path] = {"a": NamedSharding(sh.mesh, PartitionSpec(*lead, *ins, None)),
                       "b": NamedSharding(sh.mesh, PartitionSpec(*lead, None, *outs))}
    return out


@dataclasses.dataclass(frozen=True)
class Lora:
    """A resolved LoRA setup: which kernels, the scale, how the frozen base is stored."""

    targets: tuple[Target, ...]
    scale: float
    base_dtype: str
    quantised: dict[str, int]  # paths stored as quant.QTensor in the frozen base -> n_lead
    # Every projection kernel: the leaves ``base_dtype`` stores (embeddings, LM head, norms,
    # biases and MoE routers keep their dtype).
    projections: frozenset[str] = frozenset()

    @classmethod
    def of(cls, cfg: LoraConfig, graphdef: nnx.GraphDef, params: Any) -> Lora:
        every = projections(graphdef, params)
        chosen = select(every, cfg.targets)
        quantise = cfg.base_dtype in quant.QUANT_DTYPES
        q = {t.path: t.n_lead for t in every} if quantise else {}
        return cls(tuple(chosen), cfg.alpha / cfg.rank, cfg.base_dtype, q,
                   frozenset(t.path for t in every))

    def freeze(self, params: Any) -> dict[str, Any]:
        """The frozen base: ``{path: array | QTensor}`` (a flat dict, so it can hold the
        quantised kernels whose pytree differs from the param's)."""
        flat = {path_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
        return {k: self._store(k, v) for k, v in flat.items()}

    def _store(self, path: str, leaf: jax.Array) -> Any:
        if path in self.quantised:
            return quant.quantize(leaf, self.base_dtype, self.quantised[path])
        if self.base_dtype == "bfloat16" and path in self.projections:
            return leaf.astype(jnp.bfloat16)
        return leaf

    def merged(self, treedef: Any, frozen: dict[str, Any], adapters: Adapters | None,
               dtypes: dict[str, Any]) -> Any:
        """The param state the base forward takes: dequantised base + scaled ``A @ B``, each
        leaf in its original dtype (``dtypes``); ``adapters = None``: the base alone."""
        flat = merge_frozen(frozen, adapters, self.targets, self.scale, dtypes)
        return jax.tree.unflatten(treedef, [flat[k] for k in leaf_names(treedef)])

    def unmerged(self, treedef: Any, frozen: dict[str, Any], adapters: Adapters | None,
                 dtypes: dict[str, Any], key: jax.Array | None = None, dropout: float = 0.0
                 ) -> Any:
        """The param state of the unmerged forward: every projection kernel an
        ``AdaptedKernel`` over its stored base (a target's with its adapter, dropout keyed by
        ``key``), every other leaf in its dtype; ``adapters = None``: the base alone."""
        by_path = {t.path: t for t in self.targets}
        keys = self.dropout_keys(key) if key is not None and dropout > 0.0 else {}
        leaves = []
        for path in leaf_names(treedef):
            stored = frozen[path]
            ad = None if adapters is None else adapters.get(path)
            if ad is not None:
                leaves.append(AdaptedKernel(stored, ad["a"], ad["b"], keys.get(path),
                                            self.scale, dropout, dtypes[path]))
            elif path in by_path or path in self.quantised:
                leaves.append(AdaptedKernel(stored, None, None, None, self.scale, 0.0,
                                            dtypes[path]))
            else:
                leaves.append(stored.astype(dtypes[path]))
        return jax.tree.unflatten(treedef, leaves)

    def dropout_keys(self, key: jax.Array) -> dict[str, jax.Array]:
        """One key per target and stacked layer (``lead + (2,)`` key data), from ``key``."""
        out = {}
        for i, t in enumerate(self.targets):
            k = jax.random.fold_in(key, i)
            lead = t.shape[:t.n_lead]
            out[t.path] = jax.random.key_data(jax.random.split(k, lead) if lead else k)
        return out


class LoraSetup:
    """LoRA bound to one placed base: shardings of the frozen base and the adapters, and the
    jitted programs that build them and merge them back into a full param state."""

    def __init__(self, cfg: LoraConfig, graphdef: nnx.GraphDef, params: Any,
                 params_sh: Any) -> None:
        self.cfg, self.lora = cfg, Lora.of(cfg, graphdef, params)
        flat = jax.tree_util.tree_flatten_with_path(params)[0]
        self.treedef = jax.tree.structure(params)
        self.dtypes = {path_name(p): leaf.dtype for p, leaf in flat}
        self.base_tree = base_tree({path_name(p): leaf for p, leaf in flat})
        self.params_sh = params_sh  # one sharding per leaf of ``params``
        kernel_sh = {path_name(p): sh for p, sh in
                     jax.tree_util.tree_flatten_with_path(params_sh)[0]}
        self.adapter_sh = adapter_shardings(list(self.lora.targets), kernel_sh)
        abstract = jax.eval_shape(self.lora.freeze, params)
        self.frozen_sh = {k: frozen_sharding(v, kernel_sh[k]) for k, v in abstract.items()}
        # Jitted once: a merge runs at every publish, evaluation and checksum, and a jit built
        # per call would trace and compile it each time.
        self._init_jit = jax.jit(self._init, out_shardings=self.adapter_sh)
        self._freeze_jit = jax.jit(self.lora.freeze, out_shardings=self.frozen_sh)
        self._merge_jit = jax.jit(
            lambda f, a: self.lora.merged(self.treedef, f, a, self.dtypes),
            out_shardings=self.params_sh)

    def abstract_adapters(self) -> Adapters:
        return jax.eval_shape(self._init)

    def _init(self) -> Adapters:
        return init_adapters(list(self.lora.targets), self.cfg.rank, self.cfg.seed)

    def adapters(self) -> Adapters:
        """Fresh adapters, placed."""
        return self._init_jit()

    def freeze(self, params: Any) -> dict[str, Any]:
        """The frozen (possibly quantised) base of ``params``, placed like the kernels."""
        return self._freeze_jit(params)

    def merged(self, frozen: dict[str, Any], adapters: Adapters | None) -> Any:
        """The full param state (base + adapters) in the base's placement."""
        return self._merge_jit(frozen, adapters)

    def update(self, adapters: Adapters, frozen: dict[str, Any], with_base: bool
               ) -> AdapterUpdate:
        """The adapter-only handoff of ``adapters`` over ``frozen``; ``with_base``: carrying
        ``frozen`` itself (for a receiver that has no base yet, which must copy it: the train
        step donates it)."""
        return AdapterUpdate(adapters, frozen if with_base else None, self.lora.targets,
                             self.lora.scale, self.base_tree)

    def abstract_frozen(self, params: Any) -> dict[str, Any]:
        """``ShapeDtypeStruct``s of ``freeze(params)`` carrying its shardings (nothing runs)."""
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                            jax.eval_shape(self.lora.freeze, params), self.frozen_sh)

    def step(self, base_forward: Any, make_step: Any) -> Any:
        """``step((state, frozen), batch)``: ``make_step(forward)``'s step over the adapters,
        its forward applying them to the frozen base passed alongside, which comes back
        unchanged (the step donates it, so its buffer is aliased, not copied). The dropout key
        is the state's ``rng`` folded with its step: a resumed run draws the same masks."""
        def lora_step(ext: tuple[Any, Any], batch: Any) -> tuple[Any, Any]:
            state, frozen = ext
            key = jax.random.fold_in(jax.random.wrap_key_data(state.rng), state.step)
            new, metrics = make_step(self.forward(base_forward, frozen, key))(state, batch)
            return (new, frozen), metrics
        return lora_step

    def forward(self, base_forward: Any, frozen: dict[str, Any], key: jax.Array | None = None
                ) -> Any:
        """``forward(adapters, ...)``: ``base_forward`` with the adapters applied to ``frozen``
        unmerged (``Lora.unmerged``), never merged: a merge materialises the dequantised
        float32 base inside the step (docs/lora.md has the compile figures). ``frozen`` is a
        traced argument of the step (never a closed-over constant: jit would embed it);
        ``adapters = None`` runs the base alone (the frozen reference)."""
        def fwd(adapters: Adapters | None, *args: Any) -> Any:
            params = self.lora.unmerged(self.treedef, jax.lax.stop_gradient(frozen), adapters,
                                        self.dtypes, key, self.cfg.dropout)
            return base_forward(params, *args)
        return fwd


    def reference_forward(self, base_forward: Any) -> Any:
        """``forward(frozen, ...)``: the adapter-disabled forward over the frozen base, the
        KL reference of a LoRA run (the step-0 policy, since ``B`` starts at zero) with no
        second copy of the weights."""
        return lambda frozen, *args: self.forward(base_forward, frozen)(None, *args)


def frozen_sharding(abstract: Any, kernel_sh: NamedSharding) -> Any:
    """A plain leaf keeps its param's sharding. A QTensor's codes do too, where the packed axis
    still divides; its scales (``[lead, groups, 1, rest]``) follow the kernel's major lead,
    first-input and major output axes, each flattened axis split as its major one was (the
    scales of an 8B nf4 base replicated would cost ~0.4 GiB a chip)."""
    if not isinstance(abstract, quant.QTensor):
        return kernel_sh
    mesh, n = kernel_sh.mesh, abstract.n_lead
    spec = tuple(kernel_sh.spec) + (None,) * (len(abstract.shape) - len(kernel_sh.spec))
    rest = spec[n + 1] if len(spec) > n + 1 else None
    scale_spec = (spec[0] if n else None, spec[n], None, rest)
    return dataclasses.replace(
        abstract, codes=NamedSharding(mesh, _fit(mesh, spec, abstract.codes.shape)),
        scale=NamedSharding(mesh, _fit(mesh, scale_spec, abstract.scale.shape)))


def _fit(mesh: Any, spec: tuple[Any, ...], shape: tuple[int, ...]) -> PartitionSpec:
    """``spec`` with the mesh axes of any dimension they do not divide dropped (replicated)."""
    out = []
    for names, dim in zip(spec, shape):
        axes = (names,) if isinstance(names, str) else tuple(names or ())
        size = math.prod(mesh.shape[a] for a in axes)
        out.append(names if axes and dim % size == 0 else None)
    return PartitionSpec(*out)
