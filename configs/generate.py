"""Generate job: sample completions for prompts with the sampler.

  python main.py --config configs/generate.py --workdir /tmp/meshrl_sample
  python main.py --config configs/generate.py --workdir /tmp/meshrl_sample \\
      --config.generate.source=hf_path --config.model.hf_path=/path/to/hf_model \\
      --config.data.source=jsonl --config.data.path=prompts.jsonl

As is, it samples from a random tiny model with the char tokenizer (generate.source = 'random': runs
anywhere). To sample from a training run, run its own config as the generate job on its workdir:
``--config.job=generate --config.generate.source=checkpoint`` (or ``=version``).
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.loader import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    cfg = base_config("generate")
    cfg.generate.source = "random"  # hf_path, checkpoint or version for trained weights
    cfg.model.vocab_size = 256  # the built-in char tokenizer's byte vocabulary
    cfg.model.hidden_size = 64  # a tiny random model when model.hf_path is empty
    cfg.model.intermediate_size = 172
    cfg.model.num_layers = 2
    cfg.data.source = "arithmetic"  # jsonl + data.path for a prompt file
    cfg.data.prompt_field = "prompt"  # the JSONL field holding the prompt text
    cfg.data.num_examples = 8  # synthetic prompts to sample for
    cfg.sampler.max_len = 128  # prompt + completion per slot
    cfg.sampler.slots = 8  # concurrent sequences
    cfg.sampler.max_new_tokens = 32
    cfg.sampler.temperature = 0.0  # greedy: reproducible output
    cfg.sampler.prompt_buckets = (16, 32, 64)
    if arg not in (None, ""):
        raise ValueError(f"configs/generate.py: unknown variant {arg!r}")
    return cfg
