"""The baseline of ``benchmarks/aot.py``: the Llama train step a JAX user writes without meshrl.

Plain ``jax.numpy`` on a named mesh, FSDP the usual way: every weight sharded over ``data`` on
its first dimension that divides, cast to bfloat16 while sharded, each layer's weights gathered
inside the scanned layer (a sharding constraint to replicated), the embedding and head gathered
before use, activations kept batch-sharded, gradients kept sharded like the params, the layer under
``jax.checkpoint`` (full remat), XLA's causal ``jax.nn.dot_product_attention``, float32 logits
of the whole vocabulary, gradient accumulation as a scan over microbatches, AdamW from optax
with float32 master weights. No kernels, no chunking: the competent first version.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

BF16 = jnp.bfloat16


def param_shapes(cfg: Any) -> dict[str, Any]:
    """Shapes of the stacked (scanned) layer weights and the embedding, norm and head."""
    D, F, V, Lyr = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.num_layers
    H, K, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim
    layers = {"attn_norm": (Lyr, D), "q": (Lyr, D, H * Dh), "k": (Lyr, D, K * Dh),
              "v": (Lyr, D, K * Dh), "o": (Lyr, H * Dh, D), "mlp_norm": (Lyr, D),
              "gate": (Lyr, D, F), "up": (Lyr, D, F), "down": (Lyr, F, D)}
    return {"embed": (V, D), "final_norm": (D,), "head": (D, V), "layers": layers}


def fsdp_spec(shape: tuple[int, ...], n: int, stacked: bool) -> PartitionSpec:
    """``data`` on the first dimension (after the layer axis) that ``n`` divides."""
    dims: list[str | None] = [None] * len(shape)
    for i in range(1 if stacked else 0, len(shape)):
        if shape[i] % n == 0:
            dims[i] = "data"
            break
    return PartitionSpec(*dims)


def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + eps)).astype(BF16) * w


def _rope(x_BxLxHxD: jax.Array, theta: float) -> jax.Array:
    L, half = x_BxLxHxD.shape[1], x_BxLxHxD.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    ang = jnp.arange(L, dtype=jnp.float32)[:, None] * freq[None]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    a, b = x_BxLxHxD[..., :half].astype(jnp.float32), x_BxLxHxD[..., half:].astype(jnp.float32)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(BF16)


def make_loss(cfg: Any, mesh: Mesh) -> Any:
    H, K, Dh, eps = cfg.num_heads, cfg.num_kv_heads, cfg.resolved_head_dim, cfg.rms_norm_eps
    replicated = NamedSharding(mesh, PartitionSpec())
    rows = NamedSharding(mesh, PartitionSpec("data", None, None))  # activations: batch-sharded

    def layer(h_BxLxD: jax.Array, w: dict[str, jax.Array]) -> tuple[jax.Array, None]:
        w = jax.lax.with_sharding_constraint(w, replicated)  # FSDP: this layer's, gathered here
        h_BxLxD = jax.lax.with_sharding_constraint(h_BxLxD, rows)
        B, L, _ = h_BxLxD.shape
        x = _rms(h_BxLxD, w["attn_norm"], eps)
        q = _rope((x @ w["q"]).reshape(B, L, H, Dh), cfg.rope_theta)
        k = _rope((x @ w["k"]).reshape(B, L, K, Dh), cfg.rope_theta)
        v = (x @ w["v"]).reshape(B, L, K, Dh)
        att = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(B, L, H * Dh)
        h_BxLxD = h_BxLxD + att @ w["o"]
        x = _rms(h_BxLxD, w["mlp_norm"], eps)
        out = h_BxLxD + (jax.nn.silu(x @ w["gate"]) * (x @ w["up"])) @ w["down"]
        return jax.lax.with_sharding_constraint(out, rows), None

    def loss(params: dict[str, Any], tokens_BxL: jax.Array, targets_BxL: jax.Array
             ) -> jax.Array:
        # Cast while sharded, so every gather moves bfloat16.
        p = jax.tree.map(lambda a: a.astype(BF16), params)
        embed, head = (jax.lax.with_sharding_constraint(p[k], replicated) for k in ("embed", "head"))
        h = jax.lax.with_sharding_constraint(embed[tokens_BxL], rows)
        h, _ = jax.lax.scan(jax.checkpoint(layer), h, p["layers"])
        h = _rms(h, p["final_norm"], eps)
        logits = (h @ head).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, targets_BxL[..., None], -1).mean()

    return loss


def make_step(cfg: Any, mesh: Mesh, microbatches: int, params_sh: Any,
              learning_rate: float = 1e-5) -> Any:
    loss = make_loss(cfg, mesh)
    tx = optax.adamw(learning_rate, b1=0.9, b2=0.95, weight_decay=0.0)

    def step(params: Any, opt_state: Any, tokens_BxL: jax.Array, targets_BxL: jax.Array
             ) -> tuple[Any, Any, jax.Array]:
        B, L = tokens_BxL.shape
        mb = (tokens_BxL.reshape(microbatches, B // microbatches, L),
              targets_BxL.reshape(microbatches, B // microbatches, L))

        def accumulate(acc: Any, batch: tuple[jax.Array, jax.Array]) -> tuple[Any, jax.Array]:
            value, grads = jax.value_and_grad(loss)(params, *batch)
            # Gradients sharded like the params: a reduce-scatter, not an all-reduce, each
            # microbatch, and a sharded accumulator.
            grads = jax.lax.with_sharding_constraint(grads, params_sh)
            return jax.tree.map(jnp.add, acc, grads), value

        zeros = jax.lax.with_sharding_constraint(jax.tree.map(jnp.zeros_like, params), params_sh)
        grads, values = jax.lax.scan(accumulate, zeros, mb)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, values.mean()

    return step, tx


def lower(cfg: Any, mesh: Mesh, rows: int, seq_len: int, microbatches: int) -> Any:
    """The baseline step lowered on abstract float32 params, AdamW state and a batch."""
    n = mesh.shape["data"]
    shapes = param_shapes(cfg)

    def abstract(shape: tuple[int, ...], stacked: bool) -> jax.ShapeDtypeStruct:
        sh = NamedSharding(mesh, fsdp_spec(shape, n, stacked))
        return jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sh)

    params = {k: abstract(v, False) for k, v in shapes.items() if k != "layers"}
    params["layers"] = {k: abstract(v, True) for k, v in shapes["layers"].items()}
    params_sh = jax.tree.map(lambda x: x.sharding, params)
    step, tx = make_step(cfg, mesh, microbatches, params_sh)
    opt = jax.eval_shape(tx.init, params)

    def place(path: Any, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        # Adam's moments mirror the params (same shape, same sharding); the count is a scalar.
        stacked = any(getattr(k, "key", None) == "layers" for k in path)
        spec = fsdp_spec(x.shape, n, stacked) if x.ndim else PartitionSpec()
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    opt = jax.tree_util.tree_map_with_path(place, opt)
    opt_sh = jax.tree.map(lambda x: x.sharding, opt)
    batch_sh = NamedSharding(mesh, PartitionSpec("data", None))
    batch = jax.ShapeDtypeStruct((rows, seq_len), jnp.int32, sharding=batch_sh)
    jitted = jax.jit(step, out_shardings=(params_sh, opt_sh, NamedSharding(mesh, PartitionSpec())),
                     donate_argnums=(0, 1))
    return jitted.lower(params, opt, batch, batch)
