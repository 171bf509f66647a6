"""A minimal hand-written GRPO train step: the floor ``benchmarks/rl_step.py`` holds the RL job's
train step to.

Plain JAX and optax, nothing of meshrl's trainer: a Llama decoder (RMSNorm, RoPE at the batch's
positions, GQA attention masked causally within each packed segment, SwiGLU, untied head) in
float32 with full [B, L, V] logits, the decoupled-PPO loss with one update per batch (proximal =
current logprobs, stop-gradient; the behaviour weight pi_prox / pi_behav), token mean, then
global-norm clipping and AdamW with decoupled weight decay on matrices, params donated.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

BATCH_FIELDS = ("input_ids", "positions", "segment_ids", "targets", "loss_mask",
                "behaviour_logprobs", "advantages")


def init_params(m: Any, key: jax.Array) -> dict[str, Any]:
    D, F, H, K, Hd = (m.hidden_size, m.intermediate_size, m.num_heads, m.num_kv_heads,
                      m.resolved_head_dim)
    ks = iter(jax.random.split(key, 2 + 7 * m.num_layers))
    normal = lambda *shape: 0.02 * jax.random.normal(next(ks), shape, jnp.float32)  # noqa: E731
    layers = [{"attn_norm": jnp.ones(D), "mlp_norm": jnp.ones(D), "wq": normal(D, H * Hd),
               "wk": normal(D, K * Hd), "wv": normal(D, K * Hd), "wo": normal(H * Hd, D),
               "gate": normal(D, F), "up": normal(D, F), "down": normal(F, D)}
              for _ in range(m.num_layers)]
    return {"embed": normal(m.vocab_size, D), "final_norm": jnp.ones(D),
            "head": normal(D, m.vocab_size), "layers": layers}


def _rms(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return w * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps)


def _rope(x_BxLxNxH: jax.Array, pos_BxL: jax.Array, theta: float) -> jax.Array:
    h = x_BxLxNxH.shape[-1]
    inv_H2 = 1.0 / theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h)
    ang_BxLx1xH2 = (pos_BxL[..., None].astype(jnp.float32) * inv_H2)[:, :, None]
    cos, sin = jnp.cos(ang_BxLx1xH2), jnp.sin(ang_BxLx1xH2)
    x1, x2 = x_BxLxNxH[..., : h // 2], x_BxLxNxH[..., h // 2:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1)


def logprobs(m: Any, params: dict[str, Any], b: dict[str, jax.Array], temperature: float
             ) -> jax.Array:
    ids, pos, seg = b["input_ids"], b["positions"], b["segment_ids"]
    B, L = ids.shape
    H, K, Hd = m.num_heads, m.num_kv_heads, m.resolved_head_dim
    same_BxLxL = (seg[:, :, None] == seg[:, None, :]) & jnp.tril(jnp.ones((L, L), bool))
    x = params["embed"][ids]
    for p in params["layers"]:
        h = _rms(x, p["attn_norm"], m.rms_norm_eps)
        q = _rope((h @ p["wq"]).reshape(B, L, K, H // K, Hd), pos[..., None], m.rope_theta)
        k = _rope((h @ p["wk"]).reshape(B, L, K, Hd), pos, m.rope_theta)
        v = (h @ p["wv"]).reshape(B, L, K, Hd)
        s = jnp.einsum("blkgh,btkh->bkglt", q, k) * Hd ** -0.5
        a = jax.nn.softmax(jnp.where(same_BxLxL[:, None, None], s, -1e30), -1)
        o = jnp.einsum("bkglt,btkh->blkgh", a, v).reshape(B, L, H * Hd)
        x = x + o @ p["wo"]
        h = _rms(x, p["mlp_norm"], m.rms_norm_eps)
        x = x + (jax.nn.silu(h @ p["gate"]) * (h @ p["up"])) @ p["down"]
    logits = (_rms(x, params["final_norm"], m.rms_norm_eps) @ params["head"]) / temperature
    return jnp.take_along_axis(jax.nn.log_softmax(logits), b["targets"][..., None], -1)[..., 0]


def grpo_loss(m: Any, rl: Any, temperature: float, params: dict[str, Any],
              b: dict[str, jax.Array]) -> jax.Array:
    mask = b["loss_mask"].astype(jnp.float32)
    logp = logprobs(m, params, b, temperature)
    prox = jax.lax.stop_gradient(logp)
    weight = jnp.exp(jnp.clip(jnp.where(mask > 0, prox - b["behaviour_logprobs"], 0.0), -20, 20))
    ratio = jnp.exp(jnp.where(mask > 0, logp - prox, 0.0))
    adv = b["advantages"]
    obj = jnp.minimum(ratio * adv, jnp.clip(ratio, 1 - rl.eps_low, 1 + rl.eps_high) * adv)
    return (-weight * obj * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def build(config: Any, key: jax.Array) -> tuple[Any, dict[str, Any], Any]:
    """(step(params, opt, batch) -> (params, opt, loss), params, opt_state) for ``config``."""
    from meshrl.models import resolve_model_config

    m, o = resolve_model_config(config.model), config.optimizer
    params = init_params(m, key)
    tx = optax.chain(optax.clip_by_global_norm(o.grad_clip_norm),
                     optax.adamw(config.trainer.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
                                 weight_decay=o.weight_decay,
                                 mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p)))
    loss_fn = functools.partial(grpo_loss, m, config.rl, config.sampler.temperature)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt = tx.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt, loss

    return step, params, tx.init(params)
