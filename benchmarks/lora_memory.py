"""LoRA rows of ``benchmarks/memory.py``: trainer state and compiled step temp memory of a
Llama-3.1-8B-shaped model with rank-16 adapters on every projection, against full fine-tuning.

Ahead-of-time only, like the rest of memory.py: the state is ``eval_shape``'d, the SFT train
step (AdamW) is lowered on abstract inputs and compiled, its ``memory_analysis()`` read; nothing
is allocated. Both steps are built as ``TrainEngine`` builds them: full fine-tuning trains the
params; LoRA trains the adapters and takes the frozen base as a second, donated argument that
it merges into (``models/lora.py``, ``trainer/engine.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from meshrl.algorithms.batch import abstract_batch
from meshrl.algorithms.losses import get_loss
from meshrl.configs.loader import base_config, from_config_dict
from meshrl.configs.schema import Config
from meshrl.mesh import rules_for
from meshrl.models import abstract_model, param_shardings, resolve_model_config, split_model
from meshrl.models.lora import Lora, LoraSetup
from meshrl.trainer import (
    abstract_state,
    batch_shardings,
    decoder_forward,
    expand_prefix,
    jit_leaf_step,
    make_optimizer,
    make_train_step,
    state_shardings,
)

LLAMA31_8B = dict(arch="llama", vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
                  num_layers=32, num_heads=32, num_kv_heads=8, tie_embeddings=False,
                  max_position_embeddings=131_072, rope_theta=500_000.0)
STATE_RATIO_MAX = 0.03  # LoRA trainer state / full fine-tuning's


def lora_config(seq: int, rows: int, layers: int, rank: int, dtype: str,
                base_dtype: str) -> Config:
    """SFT of the 8B shape (FSDP over data = 8, full remat, scanned layers) with rank-``rank``
    adapters (alpha 2 * rank) on every attention and MLP projection."""
    cfg = base_config("sft")
    cfg.mesh.update(data=8, fsdp=True)
    cfg.model.update(**{**LLAMA31_8B, "num_layers": layers}, compute_dtype=dtype,
                     scan_layers=True, remat="full")
    cfg.trainer.update(seq_len=seq, batch_size=rows, microbatches=1)
    cfg.lora.update(rank=rank, alpha=2.0 * rank, base_dtype=base_dtype)
    return from_config_dict(cfg)


def _bytes(tree: Any) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def lora_rows(config: Config, mesh: Any) -> dict[str, Any]:
    """{full,lora}_state_bytes (global), their ratio, {full,lora}_step_temp_bytes (per
    device), lora_base_bytes (the frozen base as stored) and lora_base_bytes_by_dtype (it under
    each ``lora.base_dtype``) of ``config``'s model."""
    t, rules = config.trainer, rules_for("train", True)
    graphdef, params = split_model(abstract_model(resolve_model_config(config.model), mesh=mesh,
                                                  rules=rules))
    params_sh = expand_prefix(param_shardings(params, mesh, rules), params)
    tx, schedule = make_optimizer(config.optimizer, t.learning_rate, t.steps, 1)
    forward, loss = decoder_forward(graphdef, t.logits_chunk), get_loss("sft")
    batch_sh = batch_shardings(mesh, rules, t.batch_size, t.seq_len)
    batch = abstract_batch(batch_sh, t.batch_size, t.seq_len)

    full_sh = state_shardings(params_sh, tx, mesh, params)
    full = abstract_state(full_sh, params, tx)
    step = make_train_step(forward, loss, tx, schedule, microbatches=t.microbatches)
    full_temp = jit_leaf_step(step, full_sh, batch_sh, mesh).lower(
        jax.tree.leaves(full), batch).compile().memory_analysis().temp_size_in_bytes

    setup = LoraSetup(config.lora, graphdef, params, params_sh)
    adapters = setup.abstract_adapters()
    lora_sh = state_shardings(setup.adapter_sh, tx, mesh, adapters)
    lora = abstract_state(lora_sh, adapters, tx)
    frozen = setup.abstract_frozen(params)
    lora_step = setup.step(forward, lambda fwd: make_train_step(  # TrainEngine's LoRA step
        fwd, loss, tx, schedule, microbatches=t.microbatches))

    lora_temp = jit_leaf_step(lora_step, (lora_sh, setup.frozen_sh), batch_sh, mesh).lower(
        jax.tree.leaves(lora) + jax.tree.leaves(frozen), batch).compile().memory_analysis(
    ).temp_size_in_bytes
    full_bytes, lora_bytes = _bytes(full), _bytes(lora)
    return {"lora_state_bytes": lora_bytes, "full_state_bytes": full_bytes,
            "lora_state_ratio": round(lora_bytes / full_bytes, 5),
            "lora_step_temp_bytes": int(lora_temp), "full_step_temp_bytes": int(full_temp),
            "lora_base_bytes": _bytes(frozen),
            "lora_base_bytes_by_dtype": base_bytes_by_dtype(config, graphdef, params)}


def base_bytes_by_dtype(config: Config, graphdef: Any, params: Any) -> dict[str, int]:
    """The frozen base's stored bytes (global) for each ``lora.base_dtype``: nf4 packs two
    codes a byte plus one float32 absmax per 64 weights, int8 one byte plus one per channel."""
    out = {}
    for dtype in ("float32", "bfloat16", "int8", "nf4"):
        lora = Lora.of(dataclasses.replace(config.lora, base_dtype=dtype), graphdef, params)
        out[dtype] = _bytes(jax.eval_shape(lora.freeze, params))
    return out


__all__ = ["LLAMA31_8B", "STATE_RATIO_MAX", "lora_config", "lora_rows"]
