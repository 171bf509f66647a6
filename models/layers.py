"""Small NNX building blocks whose params carry logical axis names: RMSNorm, projections, MLP."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from meshrl.models.lora_kernel import AdaptedKernel
from meshrl.models.sharding import LogicalAxes, ShardingContext, constrain

_INIT_STD = 0.02  # HF initializer_range for Llama/Qwen.


def dtype_of(name: str) -> jnp.dtype:
    return jnp.dtype(name)


def param(rngs: nnx.Rngs, shape: Sequence[int], axes: LogicalAxes, dtype: jnp.dtype,
          init: str = "normal") -> nnx.Param:
    """A Param with ``logical_axes`` metadata (read by ``logical_axes`` / ``param_shardings``)."""
    assert len(shape) == len(axes), (shape, axes)
    if init == "normal":
        value = _INIT_STD * jax.random.normal(rngs.params(), tuple(shape), jnp.float32)
    elif init == "ones":
        value = jnp.ones(tuple(shape), jnp.float32)
    else:
        value = jnp.zeros(tuple(shape), jnp.float32)
    return nnx.Param(value.astype(dtype), logical_axes=tuple(axes))


class RMSNorm(nnx.Module):
    """RMSNorm computed in float32 and cast back before the scale, exactly like HF."""

    def __init__(self, dim: int, eps: float, axis_name: str, *, rngs: nnx.Rngs,
                 param_dtype: jnp.dtype):
        self.eps = eps
        self.scale = param(rngs, (dim,), (axis_name,), param_dtype, init="ones")

    def __call__(self, x: jax.Array) -> jax.Array:
        x32 = x.astype(jnp.float32)
        var = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
        normed = (x32 * jax.lax.rsqrt(var + self.eps)).astype(x.dtype)
        return self.scale[...].astype(x.dtype) * normed


class Projection(nnx.Module):
    """Einsum projection: kernel of shape ``in_shape + out_shape`` with optional bias."""

    def __init__(self, in_shape: Sequence[int], out_shape: Sequence[int], in_axes: LogicalAxes,
                 out_axes: LogicalAxes, *, use_bias: bool, rngs: nnx.Rngs,
                 param_dtype: jnp.dtype, compute_dtype: jnp.dtype):
        self.n_in = len(in_shape)
        self.compute_dtype = compute_dtype
        self.kernel = param(rngs, tuple(in_shape) + tuple(out_shape),
                            tuple(in_axes) + tuple(out_axes), param_dtype)
        self.bias = (param(rngs, out_shape, out_axes, param_dtype, init="zeros")
                     if use_bias else None)

    def __call__(self, x: jax.Array, part: jax.Array | None = None) -> jax.Array:
        """``x`` projected; ``part``: which chunk of a longer input ``x`` is (LoRA dropout draws
        a mask of its own for each)."""
        k = self.kernel[...]
        if isinstance(k, AdaptedKernel):  # LoRA's unmerged forward (models/lora_kernel.py)
            y = k.project(x, self.n_in, self.compute_dtype, part)
        else:
            contract = (tuple(range(x.ndim - self.n_in, x.ndim)), tuple(range(self.n_in)))
            y = jax.lax.dot_general(x.astype(self.compute_dtype), k.astype(self.compute_dtype),
                                    (contract, ((), ())))
        if self.bias is not None:
            y = y + self.bias[...].astype(self.compute_dtype)
        return y


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). With ``chunk`` > 0 a forward over more tokens
    runs ``chunk`` tokens at a time (all rows, ``chunk // B`` positions) in a rematerialised
    ``lax.map``: the ``[B, L, F]`` activations never exist whole, forward or backward."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs, param_dtype: jnp.dtype,
                 compute_dtype: jnp.dtype, sharding: ShardingContext | None, chunk: int = 0):
        kw = dict(use_bias=False, rngs=rngs, param_dtype=param_dtype, compute_dtype=compute_dtype)
        self.gate = Projection((dim,), (hidden,), ("embed",), ("mlp",), **kw)
        self.up = Projection((dim,), (hidden,), ("embed",), ("mlp",), **kw)
        self.down = Projection((hidden,), (dim,), ("mlp",), ("embed",), **kw)
        self.sharding = sharding
        self.chunk = chunk

    def _apply(self, x_BxLxD: jax.Array, part: jax.Array | None = None) -> jax.Array:
        h_BxLxF = jax.nn.silu(self.gate(x_BxLxD, part)) * self.up(x_BxLxD, part)
        h_BxLxF = constrain(h_BxLxF, ("batch", "length", "act_mlp"), self.sharding)
        return self.down(h_BxLxF, part)

    def __call__(self, x_BxLxD: jax.Array) -> jax.Array:
        B, L, D = x_BxLxD.shape
        if self.chunk <= 0 or B * L <= self.chunk:
            return self._apply(x_BxLxD)
        c = max(1, self.chunk // B)
        n = -(-L // c)
        x_NxBxCxD = jnp.pad(x_BxLxD, ((0, 0), (0, n * c - L), (0, 0))).reshape(
            B, n, c, D).swapaxes(0, 1)
        # Remat per chunk: the backward saves each chunk's input and recomputes its F-wide
        # activations (the weights are loop-invariant).
        # Each chunk's index goes along: LoRA dropout masks differ from chunk to chunk.
        out_NxBxCxD = jax.lax.map(
            jax.checkpoint(lambda args: self._apply(*args), prevent_cse=False),
            (x_NxBxCxD, jnp.arange(n)))
        return out_NxBxCxD.swapaxes(0, 1).reshape(B, n * c, D)[:, :L]
