"""nf4 packed two codes a byte: halved base bytes, the same weights and logits as one code a
byte, and the frozen base's shardings on a mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from meshrl.configs import base_config, from_config_dict
from meshrl.configs.lora_schema import LoraConfig
from meshrl.mesh import create_mesh
from meshrl.models import create_model, quant, split_model
from meshrl.models.lora import Lora, frozen_sharding
from meshrl.tests.trainer.tiny import tiny_config


@pytest.mark.parametrize(("shape", "n_lead"), [((128, 8), 0), ((2, 192, 3, 4), 1),
    pytest.param((7, 5), 0, marks=pytest.mark.slow), pytest.param((3, 33, 6), 1, marks=pytest.mark.slow)])
def test_packed_nf4_dequantises_bitwise_to_the_one_code_a_byte_form(shape, n_lead):
    w = jax.random.normal(jax.random.key(0), shape)
    packed, plain = (quant.quantize(w, "nf4", n_lead, pack=p) for p in (True, False))
    assert packed.codes.dtype == jnp.uint8 and packed.packed and not plain.packed
    first = shape[n_lead]
    block = first if first % quant.NF4_BLOCK else quant.NF4_BLOCK
    rows = first // block * -(-block // 2)  # odd blocks (7, 33) carry one padding row
    assert packed.codes.shape == shape[:n_lead] + (rows,) + shape[n_lead + 1:]
    np.testing.assert_array_equal(quant.dequantize(packed), quant.dequantize(plain))


def test_packing_keeps_both_nibbles_of_every_byte():
    codes = jnp.arange(16, dtype=jnp.uint8).reshape(1, 1, 16, 1)
    packed = quant.pack_nibbles(codes)
    assert packed[0, 0, :, 0].tolist() == [(i << 4) | (i + 8) for i in range(8)]
    np.testing.assert_array_equal(quant.unpack_nibbles(packed, 16), codes)


def test_packed_nf4_base_halves_code_bytes_and_keeps_logits_bitwise():
    cfg = tiny_config(**{"model.hidden_size": 128, "model.intermediate_size": 128}).model
    g, params = split_model(create_model(cfg, seed=0))
    lora = Lora.of(LoraConfig(rank=4, base_dtype="nf4"), g, params)
    packed = lora.freeze(params)
    plain = {k: (quant.quantize(params_flat, "nf4", v.n_lead, pack=False)
                 if isinstance(v, quant.QTensor) else v)
             for (k, v), params_flat in zip(packed.items(), jax.tree.leaves(params), strict=True)}
    codes = lambda f: sum(v.codes.nbytes for v in f.values()  # noqa: E731
                          if isinstance(v, quant.QTensor))
    assert codes(packed) * 2 == codes(plain)
    dtypes = {k: v.dtype for k, v in zip(packed, jax.tree.leaves(params), strict=True)}
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, 64)

    @jax.jit
    def logits(frozen):
        merged = lora.merged(jax.tree.structure(params), frozen, None, dtypes)
        return nnx.merge(g, merged)(ids)

    np.testing.assert_array_equal(logits(packed), logits(plain))


def test_frozen_scales_shard_with_their_kernel_and_odd_packed_axes_replicate():
    mesh = create_mesh(from_config_dict(base_config("sft")).mesh, jax.devices())
    data = mesh.shape["data"]
    kernel_sh = NamedSharding(mesh, PartitionSpec(None, "data", None))  # [layers, in, out]
    big = jax.eval_shape(lambda: quant.quantize(jnp.zeros((2, 64 * data, 8)), "nf4", 1))
    sh = frozen_sharding(big, kernel_sh)
    assert sh.codes.spec == PartitionSpec(None, "data", None)
    assert sh.scale.spec == PartitionSpec(None, "data", None, None)  # one group a shard
    odd = jax.eval_shape(lambda: quant.quantize(jnp.zeros((2, 2 * data + 2, 8)), "nf4", 1))
    sh = frozen_sharding(odd, kernel_sh)  # data + 1 packed rows: not divisible by data
    assert sh.codes.spec == PartitionSpec(None, None, None)
    assert sh.scale.spec == PartitionSpec(None, None, None, None)
