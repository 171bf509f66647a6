"""The unmerged LoRA projection: a kernel value that projects its input itself.

``models.lora`` installs an ``AdaptedKernel`` as the value of a ``Projection``'s kernel in the
param state it hands the forward; ``Projection`` then computes
``x W + dropout(x) A B * scale`` (PEFT's order: dropout on the adapter's input only) instead of
``x W``. The frozen base ``W`` stays as stored (a ``quant.QTensor`` is dequantised here, one
layer at a time under the decoder's scan), so no merged full-precision copy of the base ever
exists. ``a = None`` is a frozen kernel without an adapter (a quantised base kernel that is not
a target, or the adapter-disabled reference forward).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from meshrl.models import quant


@flax.struct.dataclass
class AdaptedKernel:
    """``base`` (array or QTensor, ``lead + in + out``), ``a`` (``lead + in + (r,)``), ``b``
    (``lead + (r,) + out``), ``key`` (``lead + (2,)`` uint32 key data, one dropout key per
    layer; None without dropout), ``scale`` (alpha / r), ``dropout`` (the rate p) and
    ``dtype`` (the param dtype the merged kernel would have had)."""

    base: Any
    a: jax.Array | None
    b: jax.Array | None
    key: jax.Array | None
    scale: float = flax.struct.field(pytree_node=False)
    dropout: float = flax.struct.field(pytree_node=False)
    dtype: Any = flax.struct.field(pytree_node=False)

    def weight(self) -> jax.Array:
        """The base kernel in ``dtype``; a QTensor sliced by the decoder's layer scan (its
        leaves lost the lead axes its metadata still names) is dequantised as one layer."""
        w = self.base
        if isinstance(w, quant.QTensor):
            n = w.n_lead
            if n and w.codes.ndim == len(w.shape) - n:
                w = quant.QTensor(w.codes, w.scale[None], w.shape[n:], w.kind, 0, w.packed)
            w = quant.dequantize(w)
        return w.astype(self.dtype)

    def project(self, x: jax.Array, n_in: int, compute_dtype: Any,
                part: jax.Array | None = None) -> jax.Array:
        """``x`` (``... + in``) through the base, plus the scaled, dropped-out adapter path;
        ``part`` (the chunk of a longer input ``x`` is) is folded into the dropout key."""
        x = x.astype(compute_dtype)
        contract = (tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in)))
        y = jax.lax.dot_general(x, self.weight().astype(compute_dtype), (contract, ((), ())))
        if self.a is None:
            return y
        h = x
        if self.key is not None and self.dropout > 0.0:
            key = jax.random.wrap_key_data(self.key)
            if part is not None:
                key = jax.random.fold_in(key, part)
            keep = jax.random.bernoulli(key, 1.0 - self.dropout, x.shape)
            h = jnp.where(keep, x / (1.0 - self.dropout), 0.0).astype(compute_dtype)
        xa = jax.lax.dot_general(h, self.a.astype(compute_dtype), (contract, ((), ())))
        xab = jax.lax.dot_general(xa, self.b.astype(compute_dtype),
                                  (((xa.ndim - 1,), (0,)), ((), ())))
        return y + (self.scale * xab).astype(y.dtype)

    def __getitem__(self, index: Any) -> AdaptedKernel:
        # ``Variable[...]`` reads the value whole; any other index would silently slice a
        # wrapper, so it is refused.
        if index is not Ellipsis:
            raise TypeError(f"AdaptedKernel[{index!r}]: only [...] reads an adapted kernel")
        return self
