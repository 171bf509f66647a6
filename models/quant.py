"""Weight-only quantisation of a frozen base (QLoRA): int8 per output channel and nf4.

int8: ``W ~ codes * scale`` with ``scale = absmax / 127`` over the input axes (one per output
channel). nf4 (Dettmers et al., QLoRA): blocks of 64 consecutive input rows share an absmax;
each weight becomes the index of the nearest of the 16 NormalFloat4 levels (stored one code per
uint8 byte, unpacked). Dequantisation runs inside the jitted step, in float32.
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
    """``codes`` (int8 or uint8 level indices), ``scale`` (float32, broadcastable after a
    reshape to ``blocks``), the original ``shape`` and the ``kind`` (int8 | nf4)."""

    codes: jax.Array
    scale: jax.Array
    shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
    kind: str = flax.struct.field(pytree_node=False)
    n_lead: int = flax.struct.field(pytree_node=False, default=0)


def _blocks(w: jax.Array, kind: str, n_lead: int) -> jax.Array:
    """``[lead, groups, block, rest]``: axis 2 shares one scale. It runs along the first input
    axis (after the ``n_lead`` stacked-layer axes): all of it for int8 (one scale per output
    channel of a 2-D kernel), blocks of 64 rows for nf4 (all rows if 64 does not divide it)."""
    lead = int(np.prod(w.shape[:n_lead]))
    first = w.shape[n_lead]
    block = first if kind == "int8" or first % NF4_BLOCK else NF4_BLOCK
    return w.reshape(lead, first // block, block, -1)


def quantize(w: jax.Array, kind: str, n_lead: int = 0) -> QTensor:
    """``w`` (any float dtype, ``ndim >= n_lead + 2``) quantised as ``kind``; the first
    ``n_lead`` axes (stacked layers) never share a scale."""
    if kind not in QUANT_DTYPES:
        raise ValueError(f"quantize kind = {kind!r}: must be one of {QUANT_DTYPES}")
    x = _blocks(w.astype(jnp.float32), kind, n_lead)
    absmax = jnp.max(jnp.abs(x), axis=2, keepdims=True)
    safe = jnp.where(absmax == 0, 1.0, absmax)
    if kind == "int8":
        scale = safe / 127.0
        codes = jnp.clip(jnp.round(x / scale), -127, 127).astype(jnp.int8)
    else:
        scale = safe
        levels = jnp.asarray(NF4_LEVELS)
        codes = jnp.argmin(jnp.abs((x / scale)[..., None] - levels), axis=-1).astype(jnp.uint8)
    return QTensor(codes.reshape(w.shape), scale, tuple(w.shape), kind, n_lead)


def dequantize(q: QTensor) -> jax.Array:
    """The float32 weights ``q`` stands for."""
    x = _blocks(q.codes, q.kind, q.n_lead)
    vals = (x.astype(jnp.float32) if q.kind == "int8"
            else jnp.asarray(NF4_LEVELS)[x.astype(jnp.int32)])
    return (vals * q.scale).reshape(q.shape)


def stored_bytes(tree: Any) -> int:
    """Bytes of every array in ``tree`` (codes and scales of a QTensor included)."""
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves(tree))
