"""Advantage estimators, chosen by name (``rl.advantage``): small pure functions in a registry.

Every estimator maps group rewards ``[G, N]`` (G prompts, N samples each) to advantages of the same
shape. They are pure and written with array methods only, so they are jit-able on jax arrays and
run in plain numpy on numpy arrays: the rollout side computes advantages on the host without
queueing work behind the sampler and the train step on a shared device. Reward shaping that
happens before the estimator (the DAPO overlong penalty) lives here too, so the rollout side and
the trainer side share one definition.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from meshrl.utils.registry import Registry

AdvantageFn = Callable[..., jax.Array]  # (rewards_GxN, *, eps, tokens_GxN) -> advantages_GxN
_ADVANTAGES: Registry[AdvantageFn] = Registry("advantage")
register = _ADVANTAGES.register
get = _ADVANTAGES.get
names = _ADVANTAGES.names


def _centered(rewards: jax.Array, axis: int | None) -> jax.Array:
    """``rewards`` minus their mean over ``axis``, exactly 0 where those rewards are all equal:
    a float32 mean of equal non-dyadic rewards (7 x 0.7) can be one ulp off, and a division by
    a std of one ulp would turn that into a large advantage shared by the whole group."""
    keep = axis is not None
    spread = rewards.max(axis, keepdims=keep) > rewards.min(axis, keepdims=keep)
    return (rewards - rewards.mean(axis, keepdims=keep)) * spread


@register("grpo")
def grpo(rewards_GxN: jax.Array, *, eps: float = 1e-6, tokens_GxN: jax.Array | None = None
         ) -> jax.Array:
    """GRPO: standardise within each group (population std, as in DeepSeekMath; verl and TRL
    divide by the sample std, sqrt(N / (N - 1)) times smaller advantages); a group whose rewards
    are all equal gets exactly 0. A sample's advantage is its sequence's: ``tokens_GxN``
    (each sample's loss tokens) is unused."""
    del tokens_GxN
    rewards_GxN = rewards_GxN.astype(jnp.float32)
    std_Gx1 = rewards_GxN.std(-1, keepdims=True)
    return _centered(rewards_GxN, -1) / (std_Gx1 + eps)


@register("drgrpo")
def drgrpo(rewards_GxN: jax.Array, *, eps: float = 1e-6, tokens_GxN: jax.Array | None = None
           ) -> jax.Array:
    """Dr. GRPO: subtract the group mean only; dividing by the std biases towards easy/hard
    prompts (Liu et al. 2025). ``eps`` and ``tokens_GxN`` are accepted for a uniform signature
    and unused."""
    del eps, tokens_GxN
    return _centered(rewards_GxN.astype(jnp.float32), -1)


@register("rloo")
def rloo(rewards_GxN: jax.Array, *, eps: float = 1e-6, tokens_GxN: jax.Array | None = None
         ) -> jax.Array:
    """RLOO: baseline is the mean of the *other* N-1 samples, i.e. N/(N-1) * (r - group mean).
    A group of one has no baseline and gets advantage 0 (``tokens_GxN`` unused)."""
    del eps, tokens_GxN
    rewards_GxN = rewards_GxN.astype(jnp.float32)
    n = rewards_GxN.shape[-1]
    if n == 1:
        return rewards_GxN * 0.0
    return _centered(rewards_GxN, -1) * (n / (n - 1))


@register("reinforce_pp")
def reinforce_pp(rewards_GxN: jax.Array, *, eps: float = 1e-6,
                 tokens_GxN: jax.Array | None = None) -> jax.Array:
    """REINFORCE++ (Hu 2025): no critic and no per-group baseline; the batch's token-level
    returns are whitened over its loss tokens (OpenRLHF's and verl's ``masked_whiten``), so a
    sample's reward counts once per token it trains (``tokens_GxN``; without it, once per
    sample). Equal rewards across the batch get exactly 0."""
    rewards_GxN = rewards_GxN.astype(jnp.float32)
    w_GxN = (rewards_GxN * 0.0 + 1.0 if tokens_GxN is None
             else tokens_GxN.astype(jnp.float32))
    total = w_GxN.sum().clip(1.0)  # array methods: numpy stays numpy (module docstring)
    mean = (w_GxN * rewards_GxN).sum() / total
    std = ((w_GxN * (rewards_GxN - mean) ** 2).sum() / total) ** 0.5
    spread = rewards_GxN.max() > rewards_GxN.min()  # no ulp-sized "advantage" (``_centered``)
    return (rewards_GxN - mean) * spread / (std + eps)


def compute(name: str, rewards_B: jax.Array, group_size: int, *, eps: float = 1e-6,
            tokens_B: jax.Array | None = None) -> jax.Array:
    """Flat rewards of contiguous groups (``[G * N]``, group g = rows g*N..g*N+N-1) -> ``[B]``;
    ``tokens_B``: each sample's loss tokens (estimators that weigh samples by them)."""
    B = rewards_B.shape[0]
    assert B % group_size == 0, f"batch {B} is not a whole number of groups of {group_size}"
    shape = (B // group_size, group_size)
    tokens = None if tokens_B is None else tokens_B.reshape(shape)
    return get(name)(rewards_B.reshape(shape), eps=eps, tokens_GxN=tokens).reshape(B)


def overlong_penalty(lengths_B: jax.Array, *, max_len: int, buffer: int,
                     penalty: float = 1.0) -> jax.Array:
    """DAPO soft overlong punishment (Yu et al. 2025, eq. 13), a value in [-penalty, 0] to add
    to each reward: 0 up to ``max_len - buffer`` generated tokens, then linear down to
    ``-penalty`` at ``max_len``, and ``-penalty`` beyond. Truncated answers are penalised softly
    instead of being rewarded or zeroed abruptly, which DAPO found reduces reward noise."""
    lengths_B = lengths_B.astype(jnp.float32)
    if buffer <= 0:
        return lengths_B * 0.0
    assert max_len > buffer, f"max_len {max_len} must exceed buffer {buffer}"
    over_B = lengths_B - (max_len - buffer)
    return -penalty * (over_B / buffer).clip(0.0, 1.0)
