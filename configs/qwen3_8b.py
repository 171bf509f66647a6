"""Qwen3-8B (Qwen/Qwen3-8B's config.json) at real size: SFT and GRPO variants.

  python main.py --config configs/qwen3_8b.py:grpo@v5p-8 --config.job=compile --workdir W

Variants and meshes: configs/real_sizes.py; figures per slice: docs/scale.md.
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.real_sizes import QWEN3, real_size_config

ARCH = dict(arch="qwen3", vocab_size=151_936, hidden_size=4096, intermediate_size=12_288,
            num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128, tie_embeddings=False,
            **QWEN3)
RECOMMENDED_MESH = {"v5p-8": dict(data=4), "v5p-16": dict(data=8), "v6e-8": dict(data=1, tensor=8)}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return real_size_config("qwen3_8b", ARCH, arg, RECOMMENDED_MESH)
