"""Default job: a tiny decoder learns a synthetic verifiable task on a laptop CPU.

  python main.py --config configs/default.py --workdir /tmp/meshrl
  python main.py --config configs/default.py:smoke --workdir /tmp/meshrl_smoke   # < 1 minute
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.loader import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    cfg = base_config("sft")
    cfg.model.vocab_size = 256  # the built-in char tokenizer's byte vocabulary
    cfg.model.hidden_size = 128  # small enough to train in minutes on 2 CPU cores
    cfg.model.intermediate_size = 344  # ~8/3 x hidden, as in Llama
    cfg.model.num_layers = 4  # depth of the tiny decoder
    cfg.model.num_heads = 4  # 32-wide heads
    cfg.model.num_kv_heads = 2  # GQA, as in the real model families
    cfg.data.source = "arithmetic"  # synthetic, verifiable, generated from a seed
    cfg.data.difficulty = 2  # operands up to two digits
    cfg.trainer.learning_rate = 3e-3  # tiny models tolerate a high peak rate
    cfg.trainer.steps = 300  # SFT steps
    cfg.trainer.batch_size = 32  # sequences per step
    cfg.trainer.seq_len = 64  # prompt + answer fit in 64 characters
    cfg.optimizer.warmup_steps = 20  # linear warmup before the cosine decay
    cfg.optimizer.weight_decay = 0.01  # decoupled, masked off norms and biases
    if arg == "smoke":
        cfg.trainer.steps = 10  # the whole pipeline, end to end, in seconds
        cfg.trainer.log_every = 2  # see every stage log at least once
        cfg.checkpoint.every_steps = 5  # exercise save and keep-N
    elif arg not in (None, ""):
        raise ValueError(f"configs/default.py: unknown variant {arg!r}; known: 'smoke'")
    return cfg
