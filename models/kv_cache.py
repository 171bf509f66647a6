"""Static-shape KV cache for the sampler.

Per layer, in the canonical batched-matmul layouts for ``q @ k^T`` and ``p @ v`` with (B, K)
as batch dims:

* keys ``k[layer]``:   [slots B, kv_heads K, head_dim H, max_len T] (``key_layout`` "BKHT",
  stored transposed) or [B, K, T, H] ("BKTH", like the values)
* values ``v[layer]``: [slots B, kv_heads K, max_len T, head_dim H]

Why these shapes: with a [layers, B, T, K, H] stack, XLA on CPU copied every layer's keys and
values on every decode step, once to slice the layer out of the stack and once to transpose
it for the matmul. That is a full read and write of the attended cache per step and made
decode 4-5x slower at long windows. Per-layer arrays in matmul order are read in place. The
key layout is the platform's: CPU reads transposed keys in place, while the TPU compiler keeps
head_dim minor and copied a transposed key cache to that layout and back on every decode call
(the whole key cache twice per call). ``key_layout_for(mesh)`` picks by the mesh's devices (a
compile for TPU from a CPU host gets the TPU layout); the layout is static data on the cache,
so every method and the attention read it from the cache they get. ``write`` scatters one row
of head_dim per (slot, kv head, position) so the TPU compiler keeps that layout also where a
chip holds several kv heads (see ``write``).

Entry ``t`` of slot ``b`` holds the key/value of the token at *position* t of the sequence in
slot b: the forward writes each token at its position and a query at position p attends to
entries t <= p. A new sequence in a slot therefore needs no reset as long as it is written from
position 0 upward (prompts right-padded; padding positions are overwritten by the decoded
tokens that take them).

Two layouts hold those per-layer arrays (``KVCache.init`` picks by ``model.scan_layers``):

* unrolled layers: a tuple with one array per layer;
* ``scan_layers``: one array per k and v stacked over a leading layers axis
  ``[layers, B, K, H, T]`` / ``[layers, B, K, T, H]``. The layer scan carries it as it is and
  writes each layer's entries in place at the traced layer index; a per-layer tuple would have
  to be stacked and unstacked around the scan, a copy of the whole cache on every forward
  (every decode step).

Every method below accepts both layouts and keeps the one it gets; ``layer(i)`` is the same
per-layer pair in either.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import struct
from jax.sharding import Mesh

from meshrl.configs.schema import ModelConfig
from meshrl.mesh.rules import Rules, logical_to_sharding

K_CACHE_AXES = ("cache_slots", "kv_heads", "head_dim", "cache_len")
V_CACHE_AXES = ("cache_slots", "kv_heads", "cache_len", "head_dim")
TRANSPOSED, TIME_MAJOR = "BKHT", "BKTH"  # key layouts: [B, K, H, T] (CPU) / [B, K, T, H]
KEY_AXES = {TRANSPOSED: K_CACHE_AXES, TIME_MAJOR: V_CACHE_AXES}

Layers = tuple[jax.Array, ...] | jax.Array  # per-layer tuple, or stacked over layers
LayerFn = Callable[..., jax.Array]


@struct.dataclass
class KVCache:
    """Per layer: keys [B, K, H, T] or [B, K, T, H] (``key_layout``) and values [B, K, T, H]
    (see the module docstring)."""

    k: Layers
    v: Layers
    key_layout: str = struct.field(pytree_node=False, default=TRANSPOSED)

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int,
             dtype: jnp.dtype | str = jnp.float32, key_layout: str = TRANSPOSED) -> KVCache:
        """Zeros; stacked over layers when ``cfg.scan_layers``, else one array per layer."""
        k_shape, v_shape = cls.shapes(cfg, batch, max_len, key_layout)
        if cfg.scan_layers:
            return cls(jnp.zeros((cfg.num_layers, *k_shape), dtype),
                       jnp.zeros((cfg.num_layers, *v_shape), dtype), key_layout)
        return cls(tuple(jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers)),
                   tuple(jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers)), key_layout)

    @staticmethod
    def shapes(cfg: ModelConfig, batch: int, max_len: int, key_layout: str = TRANSPOSED,
               ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Per-layer (key shape, value shape)."""
        _check_layout(key_layout)
        K, H = cfg.num_kv_heads, cfg.resolved_head_dim
        v_shape = (batch, K, max_len, H)
        return (batch, K, H, max_len) if key_layout == TRANSPOSED else v_shape, v_shape

    @classmethod
    def shardings(cls, cfg: ModelConfig, batch: int, max_len: int, mesh: Mesh,
                  rules: Rules, key_layout: str | None = None) -> KVCache:
        """A KVCache of NamedShardings (for jit in/out_shardings), in ``init``'s layout; the key
        layout defaults to the mesh platform's (``key_layout_for``)."""
        key_layout = key_layout or key_layout_for(mesh)
        k_shape, v_shape = cls.shapes(cfg, batch, max_len, key_layout)
        k_axes = KEY_AXES[key_layout]
        if cfg.scan_layers:
            L = cfg.num_layers
            return cls(logical_to_sharding(("layers", *k_axes), mesh, rules, (L, *k_shape)),
                       logical_to_sharding(("layers", *V_CACHE_AXES), mesh, rules, (L, *v_shape)),
                       key_layout)
        k_sh = logical_to_sharding(k_axes, mesh, rules, k_shape)
        v_sh = logical_to_sharding(V_CACHE_AXES, mesh, rules, v_shape)
        return cls((k_sh,) * cfg.num_layers, (v_sh,) * cfg.num_layers, key_layout)

    @classmethod
    def slots_per_shard(cls, cfg: ModelConfig, batch: int, max_len: int, mesh: Mesh,
                        rules: Rules) -> int:
        """Cache slots each device holds under ``shardings``."""
        sh = cls.shardings(cfg, batch, max_len, mesh, rules)
        k_shape = cls.shapes(cfg, batch, max_len, sh.key_layout)[0]
        if sh.is_stacked:
            return sh.k.shard_shape((cfg.num_layers, *k_shape))[1]
        return sh.k[0].shard_shape(k_shape)[0]

    @property
    def is_stacked(self) -> bool:
        """True for the layer-stacked layout (one array per k and v)."""
        return not isinstance(self.k, tuple)

    @property
    def max_len(self) -> int:
        return self.v_first.shape[-2]

    @property
    def v_first(self) -> jax.Array:
        """Layer 0's values (or the stack): [.., B, K, T, H] in every layout."""
        return self.v if self.is_stacked else self.v[0]

    @property
    def keys_like_values(self) -> bool:
        """True when keys are [B, K, T, H] like the values (``TIME_MAJOR``)."""
        return self.key_layout == TIME_MAJOR

    def with_key_layout(self, key_layout: str) -> KVCache:
        """This cache in ``key_layout`` (the keys transposed: a copy unless already in it)."""
        if key_layout == self.key_layout:
            return self
        _check_layout(key_layout)
        return KVCache(_per_layer(lambda k: jnp.swapaxes(k, -1, -2), self.k), self.v, key_layout)

    @property
    def slots(self) -> int:
        return self.v_first.shape[-4]

    def window(self, length: int, slots_R: jax.Array | None = None) -> KVCache:
        """Entries [0, length) of the slots ``slots_R``, in that order (default: every slot): a
        copy the decode loop updates in place. An out-of-range index (a padding row) reads the
        last slot's entries, which ``put_band`` never writes back."""
        def rows(x: jax.Array) -> jax.Array:
            # Cut the window first: the gather then copies only its entries.
            return x if slots_R is None else jnp.take(x, slots_R, axis=0, mode="clip")

        def cut_k(k: jax.Array) -> jax.Array:
            return rows(k[:, :, :length] if self.keys_like_values else k[..., :length])

        return KVCache(_per_layer(cut_k, self.k),
                       _per_layer(lambda v: rows(v[:, :, :length]), self.v), self.key_layout)

    def put_band(self, window: KVCache, start_B: jax.Array, width: int,
                 slots_B: jax.Array | None = None) -> KVCache:
        """Write back entries [start_B[b], start_B[b] + width) of each window row b into slot
        ``slots_B[b]`` (default: slot b; out of range: dropped), the only entries a
        ``width``-step decode chunk changes. Bands reaching past the window's end are shifted
        left to fit (their extra entries are unchanged copies)."""
        B, W = window.slots, window.max_len
        width = min(width, W)
        idx_BxC = jnp.clip(start_B, 0, W - width)[:, None] + jnp.arange(width)
        rows_B = jnp.arange(B) if slots_B is None else slots_B
        b_BxC = jnp.broadcast_to(rows_B[:, None], idx_BxC.shape)

        # Advanced indices split by slices: the updates are [B, C, K, H] (see ``write``).
        def put_k(full: jax.Array, part: jax.Array) -> jax.Array:
            band_BxKxHxC = jnp.take_along_axis(part, idx_BxC[:, None, None, :], axis=3)
            return full.at[b_BxC, :, :, idx_BxC].set(band_BxKxHxC.transpose(0, 3, 1, 2),
                                                     mode="drop")

        def put_v(full: jax.Array, part: jax.Array) -> jax.Array:
            band_BxKxCxH = jnp.take_along_axis(part, idx_BxC[:, None, :, None], axis=2)
            return full.at[b_BxC, :, idx_BxC].set(band_BxKxCxH.transpose(0, 2, 1, 3),
                                                  mode="drop")

        window = window.with_key_layout(self.key_layout)
        return KVCache(_per_layer(put_v if self.keys_like_values else put_k, self.k, window.k),
                       _per_layer(put_v, self.v, window.v), self.key_layout)

    def put_slots(self, part: KVCache, slots_N: jax.Array) -> KVCache:
        """Write ``part`` (N slots, P entries) over entries [0, P) of slots ``slots_N``;
        out-of-range slot indices are dropped (padding rows). A ``part`` in the other key
        layout is transposed to this one first (a copy of the part's keys)."""
        P, part = part.max_len, part.with_key_layout(self.key_layout)
        rows = with_layer_index(self.k.shape[0], slots_N) if self.is_stacked else (slots_N,)

        def put_k(f: jax.Array, p: jax.Array) -> jax.Array:
            return f.at[(*rows, slice(None), slice(None), slice(None, P))].set(p, mode="drop")

        def put_v(f: jax.Array, p: jax.Array) -> jax.Array:
            return f.at[(*rows, slice(None), slice(None, P))].set(p, mode="drop")

        if self.is_stacked:
            return KVCache(put_v(self.k, part.k) if self.keys_like_values else
                           put_k(self.k, part.k), put_v(self.v, part.v), self.key_layout)
        return KVCache(_per_layer(put_v if self.keys_like_values else put_k, self.k, part.k),
                       _per_layer(put_v, self.v, part.v), self.key_layout)

    def stacked(self) -> KVCache:
        """Layers stacked on a leading axis (a copy unless already stacked)."""
        return self if self.is_stacked else self.replace(k=jnp.stack(self.k), v=jnp.stack(self.v))

    def unstacked(self) -> KVCache:
        """One array per layer (a copy unless already per layer)."""
        return self.replace(k=tuple(self.k), v=tuple(self.v)) if self.is_stacked else self

    def layer(self, layer: int | jax.Array) -> tuple[jax.Array, jax.Array]:
        """(keys in ``key_layout``, values B x K x T x H) of one layer."""
        return self.k[layer], self.v[layer]


def with_layer_index(layers: int, *idx: jax.Array) -> tuple[jax.Array, ...]:
    """Scatter/gather indices ``idx`` (one shape) into every layer of a stacked array: the layer
    as a leading index broadcast against them. Vmapped over the layers instead (a batch
    dimension of the scatter), the TPU compiler gave the array a layout of its own and copied
    it in and out, and the partitioner all-gathered it when sharded over slots."""
    rank = idx[0].ndim
    return (jnp.arange(layers).reshape(layers, *(1,) * rank), *(i[None] for i in idx))


def key_layout_for(mesh: Mesh) -> str:
    """The key layout the platform of ``mesh``'s devices reads in place (module docstring)."""
    return TRANSPOSED if mesh.devices.flat[0].platform == "cpu" else TIME_MAJOR


def write(cache: KVCache, layer: int | jax.Array, k_BxLxKxH: jax.Array, v_BxLxKxH: jax.Array,
          positions_BxL: jax.Array) -> KVCache:
    """Scatter one layer's new keys/values at their positions (in place under jit + donation).

    Positions outside [0, T) are dropped, so padding tokens past the cache end are harmless.
    Each (slot, kv head, position) is its own index, writing one row of head_dim: with the
    kv heads in the update window instead ([K, H] per slot and position), the TPU compiler,
    wherever a chip holds several kv heads, laid the cache out [B, T, K, H] for the scatter
    and copied the whole cache to that layout and back on every decode call.
    """
    B, L, K, _ = k_BxLxKxH.shape
    b_BxLxK = jnp.broadcast_to(jnp.arange(B)[:, None, None], (B, L, K))
    k_BxLxK = jnp.broadcast_to(jnp.arange(K), (B, L, K))
    t_BxLxK = jnp.broadcast_to(positions_BxL[:, :, None], (B, L, K))

    # Numpy puts the dims of advanced indices first when slices split them ([B, K, H, T]) and
    # in place when adjacent ([B, K, T, H]): either way each update is [B, L, K, H].
    def put(x: jax.Array, new: jax.Array, transposed: bool, *lead: int | jax.Array) -> jax.Array:
        idx = (*lead, b_BxLxK, k_BxLxK, *((slice(None),) if transposed else ()), t_BxLxK)
        return x.at[idx].set(new.astype(x.dtype), mode="drop")

    transposed = not cache.keys_like_values
    if not cache.is_stacked:
        k_l = put(cache.k[layer], k_BxLxKxH, transposed)
        v_l = put(cache.v[layer], v_BxLxKxH, False)
        return cache.replace(k=_replace(cache.k, layer, k_l), v=_replace(cache.v, layer, v_l))
    return cache.replace(k=put(cache.k, k_BxLxKxH, transposed, layer),
                         v=put(cache.v, v_BxLxKxH, False, layer))


def _check_layout(key_layout: str) -> None:
    if key_layout not in KEY_AXES:
        raise ValueError(f"kv cache key_layout: {key_layout!r}: must be one of "
                         f"{sorted(KEY_AXES)}")


def _replace(layers: tuple[jax.Array, ...], i: int, x: jax.Array) -> tuple[jax.Array, ...]:
    return layers[:i] + (x,) + layers[i + 1:]


def _per_layer(fn: LayerFn, layers: Layers, *others: Layers) -> Layers:
    """``fn`` of one layer's arrays, over every layer, in the layout of ``layers``: per tuple
    entry, or vmapped over the stacked layers axis (one op on the whole stack, which XLA
    updates in place like the per-layer ops)."""
    if isinstance(layers, tuple):
        return tuple(fn(*xs) for xs in zip(layers, *others))
    return jax.vmap(fn)(layers, *others)
