"""``model.attention``: the blockwise kernel equals the einsum reference (values and gradients)
for causal, packed, GQA/MHA/MQA inputs, ragged block counts, the KV-cache prefill layout and
sharded meshes; whole decoders agree; wrong values and platforms are errors naming the field."""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import MeshConfig, ModelConfig
from meshrl.mesh import create_mesh, rules_for
from meshrl.models import KVCache, abstract_model, forward, split_model
from meshrl.models.attention import check_platform, self_attention
from meshrl.models.attention_fused import cudnn_attention, splash_attention
from meshrl.models.attention_kernels import (
    BLOCK,
    blockwise_attention,
    blockwise_cache_attention,
    causal_segment_mask,
    einsum_attention,
)
from meshrl.models.sharding import ShardingContext
from meshrl.tests.models.conftest import random_ids
from meshrl.tests.trees import assert_trees_close

RTOL, ATOL = 1e-5, 1e-5  # float32 both sides; blocks only reorder the sums

# name -> (B, L, N, K, H, block_q, block_k, packed); no L is a multiple of its blocks.
# (Equal q and k blocks on GQA packed inputs: the sharded test below.)
CASES = {
    "mha_causal_q3_k5": (2, 13, 4, 4, 8, 3, 5, False),  # q/k blocks differ: the skip bound
    "gqa_packed_q4_k3": (2, 13, 4, 2, 8, 4, 3, True),
    "mqa_packed": (1, 11, 4, 1, 8, 4, 4, True),
    "gqa_packed_one_block": (2, 6, 4, 2, 8, 8, 8, True),
}


def _qkv(B: int, L: int, N: int, K: int, H: int, T: int | None = None, seed: int = 0,
         ) -> tuple[np.ndarray, ...]:
    """q, k, v and an output cotangent (numpy: no per-shape random programs to compile)."""
    rng = np.random.default_rng(seed)
    T = L if T is None else T
    shapes = ((B, L, N, H), (B, T, K, H), (B, T, K, H), (B, L, N, H))
    return tuple(rng.standard_normal(shape, np.float32) for shape in shapes)


def _segments(B: int, L: int, packed: bool) -> jax.Array:
    if not packed:
        return jnp.ones((B, L), jnp.int32)
    # Row 0: three sequences then padding (id 0); row 1: one sequence then padding.
    n = L // 4
    row0 = n * [1] + n * [2] + (L - 2 * n - 2) * [3] + 2 * [0]
    row1 = (L - L // 3) * [7] + (L // 3) * [0]
    return jnp.array([row0, row1][:B], jnp.int32)


_COLLECTIVE = re.compile(r"\b(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)"
                         r"(-start)?\(")


def _value_and_grads(attend, q, k, v, cot, *args, collectives: bool = False):
    """(out, d<out, cot>/d(q, k, v)) of a jitted attention function, and with ``collectives``
    the number of collective ops in its compiled program."""
    def loss(q, k, v):
        out = attend(q, k, v, *args)
        return jnp.sum(out * cot), out

    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)).lower(
        q, k, v).compile()
    (_, out), grads = compiled(q, k, v)
    if collectives:
        return (out, grads), len(_COLLECTIVE.findall(compiled.as_text()))
    return out, grads


def _assert_same(got, want, rtol=RTOL, atol=ATOL):
    assert_trees_close(got, want, rtol=rtol, atol=atol)


def _reference(q, k, v, seg):
    return einsum_attention(q, k, v, causal_segment_mask(seg))


@pytest.mark.parametrize("name", list(CASES))
def test_blockwise_equals_einsum_values_and_gradients(name):
    B, L, N, K, H, bq, bk, packed = CASES[name]
    q, k, v, cot = _qkv(B, L, N, K, H)
    seg = _segments(B, L, packed)
    blockwise = functools.partial(blockwise_attention, block_q=bq, block_k=bk)

    got = _value_and_grads(blockwise, q, k, v, cot, seg)
    want = _value_and_grads(_reference, q, k, v, cot, seg)

    _assert_same(got, want)
    assert np.isfinite(np.asarray(got[0])).all()


def _cache_reference(q, k_BxKxHxT, v_BxKxTxH, positions_BxL):
    T = k_BxKxHxT.shape[-1]
    mask_BxLxT = jnp.arange(T)[None, None, :] <= positions_BxL[:, :, None]
    return einsum_attention(q, jnp.moveaxis(k_BxKxHxT, 3, 1), jnp.swapaxes(v_BxKxTxH, 1, 2),
                            mask_BxLxT)


def test_blockwise_cache_layout_equals_einsum_including_fully_masked_rows():
    B, L, N, K, H, T = 2, 9, 4, 2, 8, 14
    q, k, v, cot = _qkv(B, L, N, K, H, T=T)
    k_BxKxHxT, v_BxKxTxH = k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)
    # Row 0: a prefill from 0; row 1: a chunk starting at 4, with two queries at position -1
    # that see no entry (the reference's uniform average over all T real entries).
    positions_BxL = jnp.array([list(range(L)), [-1, -1] + list(range(4, 4 + L - 2))], jnp.int32)
    blockwise = functools.partial(blockwise_cache_attention, block_q=4, block_k=4)

    got = _value_and_grads(blockwise, q, k_BxKxHxT, v_BxKxTxH, cot, positions_BxL)
    want = _value_and_grads(_cache_reference, q, k_BxKxHxT, v_BxKxTxH, cot, positions_BxL)

    _assert_same(got, want)
    np.testing.assert_allclose(got[0][1, 0], v[1].mean(0).repeat(N // K, 0), rtol=RTOL,
                               atol=ATOL)


# mesh -> kv heads (8 query heads): data2_tensor4 splits both over tensor; tensor8 replicates the
# 2 kv heads (they do not divide 8) while the query heads stay split.
MESHES = {"data2_tensor4": (MeshConfig(data=2, tensor=4), 4),
          "tensor8": (MeshConfig(data=1, tensor=8), 2)}


@pytest.mark.distributed
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_blockwise_sharded_by_batch_and_heads_equals_einsum_without_extra_collectives(mesh_name):
    mesh_cfg, K = MESHES[mesh_name]
    ctx = ShardingContext(create_mesh(mesh_cfg), rules_for("train"))
    B, L, N, H = 2, 13, 8, 8
    q, k, v, cot = _qkv(B, L, N, K, H)
    seg = _segments(B, L, packed=True)
    q_sh = ctx.sharding(("batch", "length", "act_heads", "head_dim"), q.shape)
    kv_sh = ctx.sharding(("batch", "length", "act_kv_heads", "head_dim"), k.shape)
    q_s, cot_s = jax.device_put(q, q_sh), jax.device_put(cot, q_sh)
    k_s, v_s = jax.device_put(k, kv_sh), jax.device_put(v, kv_sh)
    seg_s = jax.device_put(seg, ctx.sharding(("batch", "length"), seg.shape))
    blockwise = functools.partial(blockwise_attention, block_q=4, block_k=4)

    got, got_collectives = _value_and_grads(blockwise, q_s, k_s, v_s, cot_s, seg_s,
                                            collectives=True)
    want, want_collectives = _value_and_grads(_reference, q_s, k_s, v_s, cot_s, seg_s,
                                              collectives=True)

    _assert_same(got, want)
    assert q_s.sharding.spec[2] == "tensor"  # the heads really were split
    # Heads and batch stay on their devices: the blocks add no communication to the einsum's
    # (the loss reduction and, on tensor8, the replicated kv heads' gradient reduction).
    assert got_collectives <= want_collectives, (got_collectives, want_collectives)


def test_blockwise_up_to_one_block_is_the_einsum_program():
    q, k, v, _ = _qkv(1, BLOCK, 2, 2, 8)
    seg = jnp.ones((1, BLOCK), jnp.int32)

    def jaxpr(impl: str) -> str:
        return str(jax.make_jaxpr(functools.partial(self_attention, impl))(q, k, v, seg))

    assert jaxpr("blockwise") == jaxpr("einsum")


# ---- whole decoders --------------------------------------------------------------------------

DECODER = ModelConfig(arch="qwen3", vocab_size=128, qk_norm=True, head_dim=16, num_layers=2,
                      scan_layers=True, remat="dots")
LONG = BLOCK + 9  # two blocks of queries and keys with the default block size


@functools.cache
def _params():
    """Random weights from numpy: no init program to compile (norm scales around 1)."""
    rng = np.random.default_rng(0)

    def draw(path, shape_dtype):
        center = float("norm" in jax.tree_util.keystr(path))
        return jnp.asarray(center + 0.2 * rng.standard_normal(shape_dtype.shape, np.float32))

    return jax.tree_util.tree_map_with_path(draw, split_model(abstract_model(DECODER))[1])


def _graphdef(impl: str, cfg: ModelConfig = DECODER):
    """The graph of ``cfg`` with ``model.attention = impl`` (abstract: nothing is compiled)."""
    return split_model(abstract_model(dataclasses.replace(cfg, attention=impl)))[0]


def _loss(params, graphdef, ids_BxL, seg_BxL):
    logits = forward(graphdef, params, ids_BxL, None, seg_BxL)
    return jnp.mean(jax.nn.logsumexp(logits, axis=-1)), logits


_value_and_grad = jax.jit(jax.value_and_grad(_loss, has_aux=True), static_argnums=1)


@pytest.mark.slow  # ~15 s; the kernel-level tests and the prefill test cover blockwise in the default run
def test_scanned_rematted_decoder_blockwise_equals_einsum_logits_and_gradients():
    ids_BxL = random_ids(2, LONG)
    seg_BxL = jnp.array([[1] * 300 + [2] * (LONG - 320) + [0] * 20, [3] * LONG], jnp.int32)

    (_, logits), grads = _value_and_grad(_params(), _graphdef("einsum"), ids_BxL, seg_BxL)
    (_, bw_logits), bw_grads = _value_and_grad(_params(), _graphdef("blockwise"), ids_BxL,
                                               seg_BxL)

    _assert_same(bw_logits, logits)
    _assert_same(bw_grads, grads)


def test_decoder_blockwise_prefill_equals_einsum_prefill():
    T = LONG + 7
    ids_BxL = random_ids(2, LONG, seed=4)
    positions_BxL = jnp.broadcast_to(jnp.arange(LONG, dtype=jnp.int32), (2, LONG))
    step = jax.jit(forward, static_argnums=0)

    def prefill(impl: str):
        cache = KVCache.init(DECODER, batch=2, max_len=T)
        return step(_graphdef(impl), _params(), ids_BxL, positions_BxL, None, cache)

    _assert_same(prefill("blockwise"), prefill("einsum"))


# ---- errors and the fused kernels ------------------------------------------------------------


def test_unknown_attention_value_is_a_config_error_naming_the_field():
    with pytest.raises(ConfigError, match=r"model\.attention = 'flash': must be one of"):
        ModelConfig(attention="flash")


def test_cudnn_with_float32_compute_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model\.attention = 'cudnn': needs model\.compute_dtype"):
        ModelConfig(attention="cudnn")


@pytest.mark.parametrize("impl, words", [("cudnn", "a GPU"), ("splash", "a TPU")])
def test_fused_kernel_on_cpu_fails_at_first_call_naming_field_and_platform(impl, words):
    cfg = dataclasses.replace(DECODER, compute_dtype="bfloat16")
    graphdef = _graphdef(impl, cfg)  # building is fine anywhere (export, param counts)

    with pytest.raises(ConfigError, match=rf"model\.attention = '{impl}' needs {words}; "
                                          r"this run's devices are cpu"):
        jax.jit(forward, static_argnums=0)(graphdef, _params(), random_ids(1, 8))


def test_check_platform_accepts_the_right_platform():
    check_platform("cudnn", "gpu")
    check_platform("splash", "tpu")
    check_platform("blockwise", "cpu")


def test_cudnn_call_with_xla_implementation_equals_einsum():
    """The mask and GQA wiring of the cuDNN path, run through JAX's portable implementation."""
    q, k, v, cot = _qkv(2, 13, 4, 2, 8)
    seg = _segments(2, 13, packed=True)
    xla = functools.partial(cudnn_attention, implementation="xla")

    _assert_same(_value_and_grads(xla, q, k, v, cot, seg),
                 _value_and_grads(_reference, q, k, v, cot, seg))


@pytest.mark.slow
@pytest.mark.distributed
def test_splash_wrapper_in_pallas_interpreter_equals_einsum_on_a_mesh():
    """The splash path's padding, segment ids, GQA kv repeat and shard_map specs, with the real
    kernel run by the Pallas interpreter on CPU (2 kv heads do not split over tensor=4)."""
    ctx = ShardingContext(create_mesh(MeshConfig(data=2, tensor=4)), rules_for("train"))
    B, L, N, K, H = 2, 100, 8, 2, 128  # L pads to the kernel's 128
    q, k, v, cot = _qkv(B, L, N, K, H)
    seg = _segments(B, L, packed=True)
    splash = functools.partial(splash_attention, ctx=ctx, interpret=True)

    _assert_same(_value_and_grads(splash, q, k, v, cot, seg),
                 _value_and_grads(_reference, q, k, v, cot, seg))


def _on(platform: str) -> None:
    if jax.devices()[0].platform != platform:
        pytest.skip(f"needs a {platform.upper()}; this run's devices are "
                    f"{jax.devices()[0].platform}")


# bfloat16 kernels against the float32 reference on the same bfloat16-rounded inputs.
FUSED_RTOL, FUSED_ATOL = 2e-2, 2e-2


@pytest.mark.accelerator
@pytest.mark.parametrize("K", [8, 2], ids=["mha", "gqa"])
def test_cudnn_equals_einsum_on_gpu(K):
    _on("gpu")
    q, k, v, cot = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(2, 256, 8, K, 64))
    seg = _segments(2, 256, packed=True)

    got = _value_and_grads(cudnn_attention, q, k, v, cot, seg)
    want = _value_and_grads(_reference, *(x.astype(jnp.float32) for x in (q, k, v, cot)), seg)

    _assert_same(jax.tree.map(lambda x: x.astype(jnp.float32), got), want, FUSED_RTOL,
                 FUSED_ATOL)


@pytest.mark.accelerator
@pytest.mark.parametrize("K", [8, 2], ids=["mha", "gqa"])
def test_splash_equals_einsum_on_tpu(K):
    _on("tpu")
    q, k, v, cot = (jnp.asarray(x, jnp.bfloat16) for x in _qkv(2, 200, 8, K, 128))
    seg = _segments(2, 200, packed=True)
    ctx = ShardingContext(create_mesh(MeshConfig(data=1, tensor=-1)), rules_for("train"))
    splash = functools.partial(splash_attention, ctx=ctx)

    got = _value_and_grads(splash, q, k, v, cot, seg)
    want = _value_and_grads(_reference, *(x.astype(jnp.float32) for x in (q, k, v, cot)), seg)

    _assert_same(jax.tree.map(lambda x: x.astype(jnp.float32), got), want, FUSED_RTOL,
                 FUSED_ATOL)
