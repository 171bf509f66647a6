"""Per-token statistics of a model's output, in float32, computed over sequence chunks.

A loss receives the model output either as full logits ``[B, L, V]`` (any dtype) or as a
``Hidden``: the final hidden states ``[B, L, D]`` (after the final norm) and the output head.
``token_stats`` turns either into per-target-position ``[B, L]`` float32 statistics:

* ``logprobs_BxL``: log p(target) under softmax(logits / temperature);
* ``entropy_BxL``: the entropy of that distribution (on request);
* ``correct_BxL``: 1 where the target's logit is the row maximum, ties counting as right
  (on request; it reuses the max the log-sum-exp needs instead of a separate ``argmax``).

With ``kept_BxL`` (the sampler's per-token kept counts, RL with top-k/top-p/min-p) the
distribution is softmax(logits / temperature) truncated to its ``kept`` largest entries and
renormalised (``truncation``), and ``outside_BxL`` marks targets outside that set.

From a ``Hidden`` the head matmul and the log-softmax run in float32 whatever the model's
compute dtype. With ``chunk > 0`` they run ``chunk`` tokens at a time (all rows, ``chunk // B``
positions) inside a ``lax.map`` whose body is rematerialised (``jax.checkpoint``): neither the
forward nor the backward pass ever holds more than one chunk's float32 logits, where the
unchunked path holds ``[B, L, V]`` (Qwen's vocabulary x 8 x 1,024 tokens: ~5 GB). The price is
one more head matmul per token in the backward pass. Chunked and unchunked results agree to
float32 rounding, values and gradients (see docs/memory.md).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from meshrl.algorithms.truncation import truncated_stats


@flax.struct.dataclass
class Hidden:
    """The model output a loss scores chunk by chunk: logits = hidden @ head (float32)."""

    hidden_BxLxD: jax.Array  # noqa: N815 -- final hidden states, the model's compute dtype
    head: jax.Array  # [D, V]; with ``tied`` the [V, D] input embedding
    # Tokens per chunk, 0: all at once. Required: the run's value is ``trainer.logits_chunk``.
    chunk: int = flax.struct.field(pytree_node=False)
    tied: bool = flax.struct.field(pytree_node=False, default=False)
    # Chunked path on a mesh: each chunk's logits are sharded over the vocabulary on these
    # mesh axes, the chunk's hidden states replicated (module docstring). None: no constraint.
    mesh: Mesh | None = flax.struct.field(pytree_node=False, default=None)
    vocab_axes: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
    # The mesh axes of the hidden states' batch dimension (kept outside the chunk loop).
    batch_axes: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
    # ... and of their length (context parallelism): each chunk then takes its positions from
    # every length shard, so the stack of chunks stays sharded (never the whole sequence).
    length_axes: tuple[str, ...] = flax.struct.field(pytree_node=False, default=())
    # MoE models: the router sums of the forward (models.moe_math.router_stats, added over
    # layers) and the weights of the load-balancing loss and the z-loss (``losses.router_terms``).
    router: dict[str, jax.Array] | None = None
    aux_loss_coef: float = flax.struct.field(pytree_node=False, default=0.0)
    z_loss_coef: float = flax.struct.field(pytree_node=False, default=0.0)

    @property
    def shape(self) -> tuple[int, int, int]:
        """(B, L, V): the shape of the logits this output stands for."""
        B, L, _ = self.hidden_BxLxD.shape
        return B, L, self.head.shape[0 if self.tied else 1]


ModelOutput = jax.Array | Hidden  # what a train-time forward hands to a loss


class TokenStats(NamedTuple):
    logprobs_BxL: jax.Array  # noqa: N815
    entropy_BxL: jax.Array | None = None  # noqa: N815
    correct_BxL: jax.Array | None = None  # noqa: N815
    outside_BxL: jax.Array | None = None  # noqa: N815 -- truncated: 1.0 where outside the set


def check_temperature(temperature: float) -> None:
    """Raise ValueError unless ``temperature > 0``: greedy decoding (0) has no distribution."""
    if not temperature > 0.0:
        raise ValueError(f"temperature = {temperature}: must be > 0 (greedy decoding has no "
                         f"distribution to score)")


def tempered(logits_BxLxV: jax.Array, temperature: float = 1.0) -> jax.Array:
    """float32 ``logits / temperature``: the distribution the sampler draws from at that
    temperature (``inference.sampling.filter_logits`` casts, then divides, in the same order)."""
    check_temperature(temperature)
    logits_BxLxV = logits_BxLxV.astype(jnp.float32)
    if temperature == 1.0:  # no division at all: T = 1 stays bitwise what it always was
        return logits_BxLxV
    return logits_BxLxV / temperature


def logits_f32(head: jax.Array, hidden_xD: jax.Array, tied: bool) -> jax.Array:
    """``hidden [..., D] @ head`` -> float32 ``[..., V]`` (operands cast to float32)."""
    spec = "...d,vd->...v" if tied else "...d,dv->...v"
    return jnp.einsum(spec, hidden_xD.astype(jnp.float32), head.astype(jnp.float32),
                      preferred_element_type=jnp.float32)


def output_shape(out: ModelOutput) -> tuple[int, ...]:
    """(B, L, V) of logits or of a ``Hidden``."""
    return out.shape


def token_stats(out: ModelOutput, targets_BxL: jax.Array, temperature: float = 1.0, *,
                entropy: bool = False, correct: bool = False, kept_BxL: jax.Array | None = None,
                kept_cap: int = 0) -> TokenStats:
    """Per-position statistics of softmax(logits / temperature) (module docstring); the
    fields not asked for are ``None``. ``temperature`` is a static Python float > 0. With
    ``kept_BxL`` the distribution is truncated to each token's ``kept`` largest logits
    (``kept_cap`` > 0: a static bound on them, ``truncation.kept_threshold``)."""
    check_temperature(temperature)
    B, L, _ = output_shape(out)
    assert targets_BxL.shape == (B, L), (targets_BxL.shape, (B, L))
    stats = functools.partial(_stats, temperature=temperature, entropy=entropy,
                              correct=correct, kept_cap=kept_cap)
    toks = (targets_BxL,) if kept_BxL is None else (targets_BxL, kept_BxL)
    if kept_BxL is not None:
        assert kept_BxL.shape == (B, L), (kept_BxL.shape, (B, L))
    if not isinstance(out, Hidden):
        return stats(out, *toks)
    S = _length_shards(out)
    c = chunk_positions(out.chunk, B * S, L // S)
    if c >= L // S:
        return stats(logits_f32(out.head, out.hidden_BxLxD, out.tied), *toks)
    return _chunked(stats, out, toks, c, S)


def _length_shards(out: Hidden) -> int:
    if out.mesh is None or not out.length_axes or not out.vocab_axes:
        return 1
    S = 1
    for a in out.length_axes:
        S *= out.mesh.shape[a]
    return S


def chunk_positions(chunk: int, rows: int, length: int) -> int:
    """Sequence positions per chunk: ``chunk`` tokens over ``rows`` rows (at least one
    position); ``length`` (one chunk) when ``chunk`` is 0 or covers every token."""
    if chunk <= 0 or chunk >= rows * length:
        return length
    return max(1, chunk // rows)


def _chunked(stats: functools.partial, out: Hidden, toks: tuple[jax.Array, ...], c: int,
             S: int = 1) -> TokenStats:
    """``stats`` over chunks of ``c`` positions; ``toks``: the per-token inputs (targets, kept
    counts), ``[B, L]`` each. With the length sharded ``S`` ways, chunk i holds positions
    [i*c, (i+1)*c) of every shard's local sequence ([B, S, c] tokens, each local sequence padded
    to a multiple of c), so the stack of chunks keeps the length sharding and no device ever
    gathers the whole sequence."""
    B, L, D = out.hidden_BxLxD.shape
    Ls = L // S
    n = -(-Ls // c)
    hidden_BxSxLsxD = out.hidden_BxLxD.reshape(B, S, Ls, D)
    toks_BxSxLs = tuple(x.reshape(B, S, Ls) for x in toks)
    if n * c > Ls:
        hidden_BxSxLsxD = jnp.pad(hidden_BxSxLsxD, ((0, 0), (0, 0), (0, n * c - Ls), (0, 0)))
        toks_BxSxLs = tuple(jnp.pad(x, ((0, 0), (0, 0), (0, n * c - Ls))) for x in toks_BxSxLs)
    constrain = _vocab_sharding(out, S > 1)
    hidden_NxBxSxCxD = constrain(
        hidden_BxSxLsxD.reshape(B, S, n, c, D).transpose(2, 0, 1, 3, 4), "stack")
    toks_NxBxSxC = tuple(x.reshape(B, S, n, c).transpose(2, 0, 1, 3) for x in toks_BxSxLs)
    # Cast once, not per chunk; on a mesh, resharded once to vocabulary shards.
    head = constrain(out.head.astype(jnp.float32), "head")

    # Remat: the backward pass saves only each chunk's inputs and recomputes its logits, so
    # no [n, B, S, c, V] stack of residuals is ever built (the head is loop-invariant).
    @functools.partial(jax.checkpoint, prevent_cse=False)
    def one(head: jax.Array, hidden_BxSxCxD: jax.Array, toks_BxSxC: tuple[jax.Array, ...]
            ) -> TokenStats:
        hidden_BxSxCxD = constrain(hidden_BxSxCxD, "hidden")
        logits_BxSxCxV = constrain(logits_f32(head, hidden_BxSxCxD, out.tied), "logits")
        return stats(logits_BxSxCxV, *toks_BxSxC,
                     vocab_sharded=bool(out.mesh and out.vocab_axes))

    per_chunk = jax.lax.map(lambda xs: one(head, *xs), (hidden_NxBxSxCxD, toks_NxBxSxC))
    return jax.tree.map(
        lambda x_NxBxSxC: x_NxBxSxC.transpose(1, 2, 0, 3).reshape(B, S, n * c)[:, :, :Ls]
        .reshape(B, L), per_chunk)


def _vocab_sharding(out: Hidden, length_sharded: bool):  # noqa: ANN202 -- (array, role) -> array
    """The chunked path's sharding constraints: logits sharded over the vocabulary on
    ``out.vocab_axes``, hidden states replicated; the identity without a mesh."""
    if out.mesh is None or not out.vocab_axes:
        return lambda x, role: x
    vocab, batch, length = (axes[0] if len(axes) == 1 else axes or None
                            for axes in (out.vocab_axes, out.batch_axes, out.length_axes))
    # "stack": the chunks' hidden states [n, B, S, c, D] keep the batch (and length) sharding
    # outside the loop, or the in-loop "replicated" would propagate into the whole forward.
    specs = {"head": PartitionSpec(vocab, None) if out.tied else PartitionSpec(None, vocab),
             "hidden": PartitionSpec(),
             "stack": PartitionSpec(None, batch, length if length_sharded else None),
             "logits": PartitionSpec(None, None, None, vocab)}
    return lambda x, role: jax.lax.with_sharding_constraint(
        x, NamedSharding(out.mesh, specs[role]))


def _stats(logits_BxLxV: jax.Array, targets_BxL: jax.Array, kept_BxL: jax.Array | None = None,
           *, temperature: float, entropy: bool, correct: bool, kept_cap: int = 0,
           vocab_sharded: bool = False) -> TokenStats:
    logits_BxLxV = tempered(logits_BxLxV, temperature)
    max_BxL = jax.lax.stop_gradient(jnp.max(logits_BxLxV, axis=-1))
    shifted_BxLxV = logits_BxLxV - max_BxL[..., None]
    log_sum_BxL = jnp.log(jnp.sum(jnp.exp(shifted_BxLxV), axis=-1))
    if vocab_sharded:
        # A masked sum (exact: one nonzero term) instead of a gather: over vocabulary shards it
        # is a local reduction plus a small all-reduce, where a gather would collect the logits.
        vocab_V = jax.lax.broadcasted_iota(jnp.int32, (logits_BxLxV.shape[-1],), 0)
        picked_BxL = jnp.where(vocab_V == targets_BxL[..., None], logits_BxLxV, 0.0).sum(-1)
    else:
        picked_BxL = jnp.take_along_axis(logits_BxLxV, targets_BxL[..., None], axis=-1)[..., 0]
    if kept_BxL is not None:
        logprobs_BxL, entropy_BxL, max_BxL, outside_BxL = truncated_stats(
            logits_BxLxV, picked_BxL, kept_BxL, kept_cap, entropy=entropy)
        correct_BxL = None
        if correct:
            correct_BxL = jax.lax.stop_gradient((picked_BxL >= max_BxL).astype(jnp.float32))
        return TokenStats(logprobs_BxL, entropy_BxL, correct_BxL, outside_BxL)
    logprobs_BxL = picked_BxL - (max_BxL + log_sum_BxL)
    entropy_BxL = correct_BxL = None
    if entropy:
        logp_BxLxV = shifted_BxLxV - log_sum_BxL[..., None]
        entropy_BxL = -(jnp.exp(logp_BxLxV) * logp_BxLxV).sum(-1)
    if correct:
        correct_BxL = jax.lax.stop_gradient((picked_BxL >= max_BxL).astype(jnp.float32))
    return TokenStats(logprobs_BxL, entropy_BxL, correct_BxL)
