"""Weight-only quantisation of a frozen base (QLoRA): int8 per output channel and nf4.

int8: ``W ~ codes * scale`` with ``scale = absmax / 127`` over the input axes (one per output
channel). nf4 (Dettmers et al., QLoRA): blocks of 64 consecutive input rows share an absmax;
each weight becomes the index of the nearest of the 16 NormalFloat4 levels, two codes a uint8
byte: within each block, row ``i`` of its first half in the high nibble and row ``i`` of its
second half in the low one, so the packed axis is the kernel's first input axis, halved (its
sharding still splits it). Dequantisation, unpacking included, runs inside the jitted step, in
float32.
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

QUANT_DTYPES = ("int8", "nf4")
NF4_BLOCK = 64
# The 16 NormalFloat4 levels (QLoRA, appendix E; bitsandbytes' table).
NF4_LEVELS = np.array([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], np.float32)


@flax.struct.dataclass
class QTensor:
    """``codes`` (int8 or uint8 level indices; nf4 ``packed``: two a byte along the first input
    axis), ``scale`` (float32, broadcastable after a reshape to ``blocks``), the original
    ``shape`` and the ``kind`` (int8 | nf4)."""

    codes: jax.Array
    scale: jax.Array
    shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    kind: str = flax.struct.field(pytree_node=False)
    n_lead: int = flax.struct.field(pytree_node=False, default=0)
    packed: bool = flax.struct.field(pytree_node=False, default=False)


def _block_shape(shape: tuple[int, ...], kind: str, n_lead: int) -> tuple[int, int, int, int]:
    """``[lead, groups, block, rest]``: axis 2 shares one scale. It runs along the first input
    axis (after the ``n_lead`` stacked-layer axes): all of it for int8 (one scale per output
    channel of a 2-D kernel), blocks of 64 rows for nf4 (all rows if 64 does not divide it)."""
    lead, first = int(np.prod(shape[:n_lead])), shape[n_lead]
    block = first if kind == "int8" or first % NF4_BLOCK else NF4_BLOCK
    return lead, first // block, block, int(np.prod(shape[n_lead + 1:]))


def _blocks(w: jax.Array, kind: str, n_lead: int) -> jax.Array:
    return w.reshape(_block_shape(w.shape, kind, n_lead))


def quantize(w: jax.Array, kind: str, n_lead: int = 0, pack: bool = True) -> QTensor:
    """``w`` (any float dtype, ``ndim >= n_lead + 2``) quantised as ``kind``; the first
    ``n_lead`` axes (stacked layers) never share a scale. ``pack = False`` keeps nf4 at one code
    a byte (the reference the packed form must dequantise to, bitwise)."""
    if kind not in QUANT_DTYPES:
        raise ValueError(f"quantize kind = {kind!r}: must be one of {QUANT_DTYPES}")
    x = _blocks(w.astype(jnp.float32), kind, n_lead)
    absmax = jnp.max(jnp.abs(x), axis=2, keepdims=True)
    safe = jnp.where(absmax == 0, 1.0, absmax)
    if kind == "int8":
        scale = safe / 127.0
        codes = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
        return QTensor(codes.reshape(w.shape), scale, tuple(w.shape), kind, n_lead)
    levels = jnp.asarray(NF4_LEVELS)
    codes = jnp.argmin(jnp.abs((x / safe)[..., None] - levels), axis=-1).astype(jnp.uint8)
    if not pack:
        return QTensor(codes.reshape(w.shape), safe, tuple(w.shape), kind, n_lead)
    packed = pack_nibbles(codes)
    stored = w.shape[:n_lead] + (packed.shape[1] * packed.shape[2],) + w.shape[n_lead + 1:]
    return QTensor(packed.reshape(stored), safe, tuple(w.shape), kind, n_lead, packed=True)


def pack_nibbles(codes: jax.Array) -> jax.Array:
    """``[lead, groups, block, rest]`` 4-bit codes -> ``[lead, groups, ceil(block / 2), rest]``
    bytes: the block's first half high, its second half low (an odd block gets a zero row)."""
    half = -(-codes.shape[2] // 2)
    pad = 2 * half - codes.shape[2]
    codes = jnp.pad(codes, ((0, 0), (0, 0), (0, pad), (0, 0)))
    return (codes[:, :, :half] << 4) | codes[:, :, half:]


def unpack_nibbles(packed: jax.Array, block: int) -> jax.Array:
    """``pack_nibbles``' inverse: ``[lead, groups, block, rest]`` codes."""
    return jnp.concatenate([packed >> 4, packed & 0xF], axis=2)[:, :, :block]


def dequantize(q: QTensor) -> jax.Array:
    """The float32 weights ``q`` stands for."""
    if q.kind == "int8":
        return (_blocks(q.codes, q.kind, q.n_lead).astype(jnp.float32) * q.scale).reshape(q.shape)
    shape = _block_shape(q.shape, q.kind, q.n_lead)
    levels = jnp.asarray(NF4_LEVELS)
    if not q.packed:
        return (levels[q.codes.reshape(shape).astype(jnp.int32)] * q.scale).reshape(q.shape)
    packed = q.codes.reshape(shape[:2] + (-(-shape[2] // 2), shape[3]))
    # Each nibble is dequantised before the halves are joined: joining the codes first left
    # the TPU compiler more step temporaries (docs/scale.md, 8B LoRA on v5e-8).
    hi, lo = (levels[c.astype(jnp.int32)] * q.scale for c in (packed >> 4, packed & 0xF))
    return jnp.concatenate([hi, lo], axis=2)[:, :, :shape[2]].reshape(q.shape)


def stored_bytes(tree: Any) -> int:
    """Bytes of every array in ``tree`` (codes and scales of a QTensor included)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))
