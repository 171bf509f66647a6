"""Rotary position embeddings (HF "rotate_half" layout) with default, linear and llama3 scaling."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from meshrl.configs.schema import ModelConfig


def inv_frequencies(cfg: ModelConfig) -> np.ndarray:
    """Per-pair inverse frequencies [H/2], float32, computed on the host as HF does."""
    dim = cfg.resolved_head_dim
    # HF: base ** (arange(0, dim, 2).float() / dim), all in float32.
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    inv_freq = (1.0 / (np.float32(cfg.rope_theta) ** exponent)).astype(np.float32)
    if cfg.rope_scaling == "linear":
        return (inv_freq / np.float32(cfg.rope_scaling_factor)).astype(np.float32)
    if cfg.rope_scaling == "llama3":
        return _llama3(inv_freq, cfg)
    return inv_freq


def _llama3(inv_freq: np.ndarray, cfg: ModelConfig) -> np.ndarray:
    """Mirror of transformers' ``_compute_llama3_parameters`` (Llama 3.1 long-context RoPE)."""
    factor = cfg.rope_scaling_factor
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    old_len = cfg.rope_original_max_position
    low_freq_wavelen = old_len / low
    high_freq_wavelen = old_len / high
    wavelen = (2 * math.pi / inv_freq).astype(np.float32)
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq).astype(np.float32)
    smooth = ((old_len / wavelen - low) / (high - low)).astype(np.float32)
    smoothed = ((1 - smooth) * scaled / factor + smooth * scaled).astype(np.float32)
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return np.where(is_medium, smoothed, scaled).astype(np.float32)


def rope_tables(positions_BxL: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """cos, sin [B, L, H] in float32 (the half-table repeated, HF layout)."""
    freqs_BxLxH2 = positions_BxL.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    emb_BxLxH = jnp.concatenate([freqs_BxLxH2, freqs_BxLxH2], axis=-1)
    return jnp.cos(emb_BxLxH), jnp.sin(emb_BxLxH)


def apply_rope(x_BxLxNxH: jax.Array, cos_BxLxH: jax.Array, sin_BxLxH: jax.Array) -> jax.Array:
    """Rotate q or k; tables are cast to x's dtype first, as HF does."""
    cos = cos_BxLxH[:, :, None, :].astype(x_BxLxNxH.dtype)
    sin = sin_BxLxH[:, :, None, :].astype(x_BxLxNxH.dtype)
    half = x_BxLxNxH.shape[-1] // 2
    rotated = jnp.concatenate([-x_BxLxNxH[..., half:], x_BxLxNxH[..., :half]], axis=-1)
    return x_BxLxNxH * cos + rotated * sin
