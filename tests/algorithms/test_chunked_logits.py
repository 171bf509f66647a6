"""Chunked float32 logits: the same statistics, losses and gradients as the full logits, with
the [B, L, V] float32 array never held (compiled temp memory)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.algorithms import policy_loss as pl
from meshrl.algorithms.batch import RLTrainBatch, TrainBatch
from meshrl.algorithms.logits import Hidden, chunk_positions, logits_f32, token_stats
from meshrl.algorithms.losses import sft_cross_entropy
from meshrl.configs.schema import RLConfig
from meshrl.tests.trees import assert_trees_close

# float32, the same math over row blocks: only the head-gradient summation order differs.
RTOL, ATOL = 1e-5, 1e-6
B, L, D, V = 2, 12, 8, 33


def _hidden(tied: bool = False, seed: int = 0, dtype: jnp.dtype = jnp.float32
            ) -> tuple[jax.Array, jax.Array, jax.Array]:
    k = jax.random.split(jax.random.key(seed), 3)
    hidden_BxLxD = jax.random.normal(k[0], (B, L, D)).astype(dtype)
    head = jax.random.normal(k[1], (V, D) if tied else (D, V)).astype(dtype)
    targets_BxL = jax.random.randint(k[2], (B, L), 0, V)
    return hidden_BxLxD, head, targets_BxL


def _all_stats(hidden_BxLxD, head, targets_BxL, tied, chunk, temperature=1.0):
    out = Hidden(hidden_BxLxD, head, tied=tied, chunk=chunk)
    return token_stats(out, targets_BxL, temperature, entropy=True, correct=True)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [2, 8, 10])  # 1 / 4 / 5 positions: padding when 5
def test_chunked_stats_equal_the_full_logits_stats(tied, temperature, chunk):
    hidden_BxLxD, head, targets_BxL = _hidden(tied)
    logits_BxLxV = logits_f32(head, hidden_BxLxD, tied)

    full = token_stats(logits_BxLxV, targets_BxL, temperature, entropy=True, correct=True)
    unchunked = _all_stats(hidden_BxLxD, head, targets_BxL, tied, 0, temperature)
    chunked = _all_stats(hidden_BxLxD, head, targets_BxL, tied, chunk, temperature)

    assert full.outside_BxL is None  # only truncated stats have it (test_truncation.py)
    for a, b, c in zip(full[:3], unchunked[:3], chunked[:3], strict=True):
        assert c.shape == (B, L) and c.dtype == jnp.float32
        np.testing.assert_array_equal(a, b)
        np.testing.assert_allclose(c, a, rtol=RTOL, atol=ATOL)
    logp_ref = jax.nn.log_softmax(logits_BxLxV / temperature)
    np.testing.assert_allclose(chunked.logprobs_BxL, np.take_along_axis(
        logp_ref, targets_BxL[..., None], -1)[..., 0], rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("chunk", [8, 10])
def test_chunked_gradients_equal_unchunked_for_hidden_and_head(tied, chunk):
    hidden_BxLxD, head, targets_BxL = _hidden(tied, seed=1)
    w_BxL = jax.random.normal(jax.random.key(7), (2, B, L))

    def objective(h, w, c):
        s = _all_stats(h, w, targets_BxL, tied, c, 0.8)
        return (w_BxL[0] * s.logprobs_BxL).sum() + (w_BxL[1] * s.entropy_BxL).sum()

    grad = jax.jit(jax.value_and_grad(objective, argnums=(0, 1)), static_argnums=2)
    value, (g_hidden, g_head) = grad(hidden_BxLxD, head, 0)
    c_value, (c_hidden, c_head) = grad(hidden_BxLxD, head, chunk)

    np.testing.assert_allclose(c_value, value, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(c_hidden, g_hidden, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(c_head, g_head, rtol=RTOL, atol=ATOL)


def test_bfloat16_hidden_and_head_are_projected_and_normalised_in_float32():
    hidden_BxLxD, head, targets_BxL = _hidden(dtype=jnp.bfloat16)

    chunked = _all_stats(hidden_BxLxD, head, targets_BxL, False, 8)
    in_f32 = _all_stats(hidden_BxLxD.astype(jnp.float32), head.astype(jnp.float32),
                        targets_BxL, False, 8)

    assert chunked.logprobs_BxL.dtype == jnp.float32
    # bf16 -> f32 is exact, so the two are the same float32 computation.
    np.testing.assert_array_equal(chunked.logprobs_BxL, in_f32.logprobs_BxL)
    np.testing.assert_array_equal(chunked.entropy_BxL, in_f32.entropy_BxL)


def test_chunk_positions_spread_the_token_budget_over_the_rows():
    assert chunk_positions(0, rows=8, length=512) == 512  # 0: one chunk
    assert chunk_positions(1024, rows=8, length=512) == 128
    assert chunk_positions(4096, rows=8, length=512) == 512  # covers every token
    assert chunk_positions(3, rows=8, length=512) == 1  # at least one position


def _sft_batch(targets_BxL: jax.Array) -> TrainBatch:
    mask_BxL = (jnp.arange(L) >= 3).astype(jnp.float32) * jnp.ones((B, 1))
    return TrainBatch(input_ids=None, targets=targets_BxL, loss_mask=mask_BxL, positions=None,
                      segment_ids=None)


def _rl_batch(targets_BxL: jax.Array) -> RLTrainBatch:
    mask_BxL = _sft_batch(targets_BxL).loss_mask
    behav_BxL = -2.0 * mask_BxL
    return RLTrainBatch(input_ids=None, targets=targets_BxL, loss_mask=mask_BxL, positions=None,
                        segment_ids=None, behaviour_logprobs=behav_BxL,
                        advantages=mask_BxL * jnp.array([[1.0], [-0.5]]), versions=None,
                        sample_ids=None, ref_logprobs=behav_BxL - 0.3)


@pytest.mark.parametrize("loss", ["sft", "rl"])
def test_losses_on_chunked_hidden_equal_losses_on_full_logits(loss):
    hidden_BxLxD, head, targets_BxL = _hidden(seed=2)
    if loss == "sft":
        loss_fn, batch = sft_cross_entropy, _sft_batch(targets_BxL)
    else:
        rl = RLConfig(policy_loss="ppo", kl_coef=0.1, entropy_coef=0.01)
        loss_fn, batch = pl.make_rl_loss_fn(rl, temperature=0.9), _rl_batch(targets_BxL)

    def total(h, w, chunk):
        out = (logits_f32(w, h, False) if chunk is None
               else Hidden(h, w, tied=False, chunk=chunk))
        loss_sum, weight, aux = loss_fn(out, batch)
        return loss_sum, (weight, aux)

    grad = jax.jit(jax.value_and_grad(total, argnums=(0, 1), has_aux=True), static_argnums=2)
    (ref, (ref_w, ref_aux)), ref_g = grad(hidden_BxLxD, head, None)
    (got, (got_w, got_aux)), got_g = grad(hidden_BxLxD, head, 6)

    np.testing.assert_allclose(got, ref, rtol=RTOL, atol=ATOL)
    assert float(got_w) == float(ref_w) > 0
    assert set(got_aux) == set(ref_aux)
    assert_trees_close(got_aux, ref_aux, rtol=RTOL, atol=ATOL)  # ``Mean`` statistics too
    assert_trees_close(got_g, ref_g, rtol=RTOL, atol=ATOL)


def _sft_grad_temp_bytes(chunk: int, rows: int, length: int, vocab: int) -> int:
    hidden = jax.ShapeDtypeStruct((rows, length, 32), jnp.float32)
    head = jax.ShapeDtypeStruct((32, vocab), jnp.float32)
    batch = TrainBatch(input_ids=None, targets=jnp.zeros((rows, length), jnp.int32),
                       loss_mask=jnp.ones((rows, length)), positions=None, segment_ids=None)

    def loss(h, w):
        return sft_cross_entropy(Hidden(h, w, chunk=chunk), batch)[0]

    compiled = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(hidden, head).compile()
    return compiled.memory_analysis().temp_size_in_bytes


def test_chunked_loss_gradient_never_holds_the_full_float32_logits():
    rows, length, vocab = 2, 512, 4096
    logits_bytes = rows * length * vocab * 4  # 16 MiB

    full = _sft_grad_temp_bytes(0, rows, length, vocab)
    chunked = _sft_grad_temp_bytes(128, rows, length, vocab)  # 8 chunks of 2 x 64 tokens

    # Measured on CPU: both hold about two logits-sized float32 buffers (the logits and their
    # cotangent), [B, L, V] each unchunked (32 MiB), [B, L / 8, V] each chunked (4.75 MiB).
    assert full >= logits_bytes, (full, logits_bytes)
    assert chunked < logits_bytes // 2, (chunked, logits_bytes)


def _fsdp_loss_and_temp(tied: bool, vocab_axes: tuple[str, ...]) -> tuple[object, int]:
    """(value and gradients, compiled temp bytes) of a chunked loss on a data=4 mesh, the
    head sharded FSDP-style (over its hidden dim) and the rows over data."""
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    rows, length, d, v = 8, 16, 32, 4096
    k = jax.random.split(jax.random.key(3), 3)
    head_spec = PartitionSpec(None, "data") if tied else PartitionSpec("data", None)
    hidden = jax.device_put(jax.random.normal(k[0], (rows, length, d)),
                            NamedSharding(mesh, PartitionSpec("data")))
    head = jax.device_put(0.1 * jax.random.normal(k[1], (v, d) if tied else (d, v)),
                          NamedSharding(mesh, head_spec))
    targets = jax.device_put(jax.random.randint(k[2], (rows, length), 0, v),
                             NamedSharding(mesh, PartitionSpec("data")))

    def loss(h, w):
        out = Hidden(h, w, tied=tied, chunk=32, mesh=mesh, vocab_axes=vocab_axes,
                     batch_axes=("data",))
        stats = token_stats(out, targets, entropy=True)
        return stats.logprobs_BxL.sum() + 0.1 * stats.entropy_BxL.sum()

    fn = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
    temp = fn.lower(hidden, head).compile().memory_analysis().temp_size_in_bytes
    return jax.device_get(fn(hidden, head)), temp


@pytest.mark.distributed
@pytest.mark.parametrize("tied", [False, True])
def test_vocab_sharded_chunks_equal_replicated_head_and_never_gather_the_head(tied):
    (val, grads), temp = _fsdp_loss_and_temp(tied, ("data",))
    (ref_val, ref_grads), ref_temp = _fsdp_loss_and_temp(tied, ())

    np.testing.assert_allclose(val, ref_val, rtol=RTOL, atol=1e-4)
    assert_trees_close(grads, ref_grads, rtol=RTOL, atol=ATOL)
    # The gathered float32 head and its full gradient are 2 x 512 KiB; vocabulary shards
    # hold a quarter of each (measured on CPU: see docs/memory.md).
    head_bytes = 4096 * 32 * 4
    assert temp <= ref_temp - head_bytes, (temp, ref_temp)


@pytest.mark.distributed
@pytest.mark.parametrize("chunk", [8, 6], ids=["whole_chunks", "padded_chunks"])
def test_length_sharded_chunks_equal_the_full_logits_in_values_and_gradients(chunk):
    # The sequence over context = 2 and the vocabulary over data = 2: each chunk stacks
    # positions of both length shards ([B, S, c] tokens), padded when c does not divide them.
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((2, 2), ("data", "context"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    rows, length, d, v = 4, 16, 32, 512
    k = jax.random.split(jax.random.key(5), 3)
    hidden = jax.device_put(jax.random.normal(k[0], (rows, length, d)),
                            NamedSharding(mesh, PartitionSpec("data", "context")))
    head = jax.device_put(0.1 * jax.random.normal(k[1], (d, v)), NamedSharding(mesh, PartitionSpec()))
    targets = jax.random.randint(k[2], (rows, length), 0, v)

    def loss(h, w, c):
        out = Hidden(h, w, tied=False, chunk=c, mesh=mesh, vocab_axes=("data",),
                     batch_axes=("data",), length_axes=("context",))
        stats = token_stats(out, targets, entropy=True)
        return stats.logprobs_BxL.sum() + 0.1 * stats.entropy_BxL.sum()

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=2)
    val, grads = jax.device_get(grad(hidden, head, rows * chunk))
    ref_val, ref_grads = jax.device_get(grad(hidden, head, 0))

    np.testing.assert_allclose(val, ref_val, rtol=RTOL, atol=1e-4)
    assert_trees_close(grads, ref_grads, rtol=1e-4, atol=1e-5)
