"""Shared code of the real-size configs (llama3_8b.py, qwen3_8b.py, qwen3_30b_a3b.py,
llama3_70b.py): the settings of their ``sft`` and ``grpo`` variants and their ``@topology`` form.

A variant is ``sft`` or ``grpo``, optionally ``@<topology>`` (``grpo@v5p-8``): that sets
``compile.topology`` and the file's ``RECOMMENDED_MESH[topology]`` (``docs/scale.md`` has the
compile job's figures for each). Without a topology the mesh is FSDP over every device, valid on
any device count. Every field stays overridable on the command line. The architectures are
written from each model's published config.json (nothing is downloaded); a real run also sets
``model.hf_path`` (the checkpoint, its tokenizer) and ``data.*``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ml_collections

from meshrl.configs.loader import base_config

# Llama 3.1's RoPE scaling (rope_scaling in meta-llama/Llama-3.1-*/config.json).
LLAMA31_ROPE = dict(rope_theta=500_000.0, rope_scaling="llama3", rope_scaling_factor=8.0,
                    rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                    rope_original_max_position=8192, max_position_embeddings=131_072,
                    rms_norm_eps=1e-5)
QWEN3 = dict(rope_theta=1_000_000.0, qk_norm=True, rms_norm_eps=1e-6,
             max_position_embeddings=40_960)


def real_size_config(name: str, arch: Mapping[str, Any], variant: str | None,
                     meshes: Mapping[str, Mapping[str, Any]], rows: int = 32,
                     microbatches: int = 4) -> ml_collections.ConfigDict:
    """The ``variant`` of ``configs/<name>.py``: ``arch`` (model fields), the job's real-size
    settings with ``rows`` sequences a step in ``microbatches`` (each microbatch's rows must
    split over the batch shards of the meshes given), and ``meshes[topology]`` when the variant
    names a topology."""
    job, _, topology = (variant or "grpo").partition("@")
    if job not in ("sft", "grpo"):
        raise ValueError(f"configs/{name}.py: unknown variant {variant!r}; known: sft, grpo, "
                         f"and <variant>@<topology> for {sorted(meshes)}")
    if topology and topology not in meshes:
        raise ValueError(f"configs/{name}.py: no recommended mesh for {topology!r}; known: "
                         f"{sorted(meshes)} (or set --config.compile.topology and mesh.*)")
    cfg = base_config("sft" if job == "sft" else "rl")
    cfg.model.update(**arch, param_dtype="float32", compute_dtype="bfloat16",
                     scan_layers=True, remat="full", attention="splash")
    cfg.mesh.update(data=-1, fsdp=True)  # params and Adam moments sharded over every device
    cfg.trainer.update(seq_len=4096, microbatches=microbatches, learning_rate=1e-6, steps=1000,
                       log_every=10)
    cfg.optimizer.update(warmup_steps=20, weight_decay=0.0)
    cfg.checkpoint.every_steps = 50
    if job == "sft":
        cfg.trainer.batch_size = rows
        cfg.data.max_prompt_len = 2048
    else:
        # Groups of 8 samples: 32 rows are 4 prompts x 8 (8 per data shard on a 4-chip slice).
        cfg.rollout.update(prompts_per_step=rows // 8, group_size=8)
        cfg.rl.ppo_minibatches = 1
        cfg.data.max_prompt_len = 512
        cfg.sampler.update(slots=256, max_len=4096, prompt_buckets=(512,), max_new_tokens=3584,
                           dtype="bfloat16", decode_chunk=16)
    if topology:
        cfg.compile.topology = topology
        cfg.mesh.update(**meshes[topology])
    return cfg
