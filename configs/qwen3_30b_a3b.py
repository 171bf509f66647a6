"""Qwen3-30B-A3B (Qwen/Qwen3-30B-A3B's config.json: 128 experts, 8 per token) at real size:
SFT and GRPO variants, experts sharded over the expert axis; GRPO frees the colocated
sampler's weights for the train step (``rl.release_sampler_weights``) and shards its experts
over a host's chips (``rl.sampler_expert``).

  python main.py --config configs/qwen3_30b_a3b.py:grpo@v5p-16 --config.job=compile --workdir W

Variants and meshes: configs/real_sizes.py; figures per slice: docs/scale.md.
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.real_sizes import QWEN3, real_size_config

ARCH = dict(arch="qwen3_moe", vocab_size=151_936, hidden_size=2048, intermediate_size=6144,
            num_layers=48, num_heads=32, num_kv_heads=4, head_dim=128, tie_embeddings=False,
            num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
            norm_topk_prob=True, decoder_sparse_step=1, moe_impl="ragged_dot", **QWEN3)
RECOMMENDED_MESH = {"v5p-16": dict(data=4, expert=2), "v5p-32": dict(data=4, expert=4)}
# The colocated sampler's expert axis per slice: a host's 4 chips (each process samples on its
# own devices), where the trainer's mesh.expert is smaller.
SAMPLER_EXPERT = {"v5p-16": 4}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    # One microbatch: gradient accumulation's float32 buffer (as large as the sharded params)
    # is what a 30B model's step cannot spare on a 16-core slice.
    cfg = real_size_config("qwen3_30b_a3b", ARCH, arg, RECOMMENDED_MESH, microbatches=1)
    if cfg.job == "rl":
        # The train step leaves no room for the colocated sampler's weights: they are freed
        # for it (the handoff refills them) and sharded over more chips while sampling.
        cfg.rl.release_sampler_weights = True
        cfg.rl.sampler_expert = SAMPLER_EXPERT.get(cfg.compile.topology, 0)
    return cfg
