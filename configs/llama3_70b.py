"""Llama-3.1-70B (meta-llama/Llama-3.1-70B's config.json) at real size: SFT and GRPO variants.

  python main.py --config configs/llama3_70b.py:sft@v5p-64 --config.job=compile --workdir W

Variants and meshes: configs/real_sizes.py; figures per slice: docs/scale.md.
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.real_sizes import LLAMA31_ROPE, real_size_config

ARCH = dict(arch="llama", vocab_size=128_256, hidden_size=8192, intermediate_size=28_672,
            num_layers=80, num_heads=64, num_kv_heads=8, head_dim=128, tie_embeddings=False,
            **LLAMA31_ROPE)
RECOMMENDED_MESH = {"v5p-64": dict(data=32)}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    # 128 sequences a step: each of the 4 microbatches puts one row on each of 32 chips.
    return real_size_config("llama3_70b", ARCH, arg, RECOMMENDED_MESH, rows=128)
