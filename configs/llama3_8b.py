"""Llama-3.1-8B (meta-llama/Llama-3.1-8B's config.json) at real size: SFT and GRPO variants.

  python main.py --config configs/llama3_8b.py:grpo --config.job=compile \\
      --config.compile.topology=v5p-8 --workdir /tmp/l8b_compile
  python main.py --config configs/llama3_8b.py:grpo@v5p-8 --config.job=compile ...
  python main.py --config configs/llama3_8b.py:grpo@v5e-8 --config.job=compile \\
      --config.compile.programs=train --config.lora.rank=16 --config.lora.base_dtype=nf4

Variants and meshes: configs/real_sizes.py; figures per slice: docs/scale.md.
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.real_sizes import LLAMA31_ROPE, real_size_config

ARCH = dict(arch="llama", vocab_size=128_256, hidden_size=4096, intermediate_size=14_336,
            num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, tie_embeddings=False,
            **LLAMA31_ROPE)
# v5e-8 (16 GiB a chip) holds the LoRA/QLoRA step, not full fine-tuning (docs/lora.md).
RECOMMENDED_MESH = {"v5p-8": dict(data=4), "v5p-16": dict(data=8), "v6e-8": dict(data=1, tensor=8),
                    "v5e-8": dict(data=8)}


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    return real_size_config("llama3_8b", ARCH, arg, RECOMMENDED_MESH)
