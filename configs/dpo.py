"""DPO on the synthetic preference task: two-digit sums, the chosen completion the correct sum,
the rejected one a wrong number of as many digits; a tiny char-level decoder from random init.

  python main.py --config configs/dpo.py --workdir /tmp/meshrl_dpo
  python main.py --config configs/dpo.py:smoke --workdir /tmp/meshrl_dpo_smoke
  python main.py --config configs/dpo.py --config.dpo.loss=simpo --workdir /tmp/meshrl_simpo

The summary's ``eval_preference_accuracy_before`` and ``eval_preference_accuracy`` are the
held-out share of pairs whose chosen completion the policy finds likelier, before and after.
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.loader import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    cfg = base_config("dpo")
    cfg.model.vocab_size = 256  # the char tokenizer's byte vocabulary
    cfg.model.hidden_size = 64
    cfg.model.intermediate_size = 172
    cfg.model.num_layers = 2
    cfg.model.num_heads = 4
    cfg.model.num_kv_heads = 2
    cfg.data.source = "arithmetic"
    cfg.data.difficulty = 2
    cfg.dpo.loss = "dpo"
    cfg.dpo.beta = 0.1
    cfg.trainer.learning_rate = 3e-3
    cfg.trainer.steps = 300
    cfg.trainer.batch_size = 32  # 16 (chosen, rejected) pairs
    cfg.trainer.seq_len = 16
    cfg.trainer.log_every = 10
    cfg.trainer.eval_every = 100
    cfg.optimizer.warmup_steps = 10
    cfg.optimizer.weight_decay = 0.01
    cfg.checkpoint.every_steps = 100
    if arg == "smoke":
        cfg.trainer.steps = 4
        cfg.trainer.log_every = 1
        cfg.trainer.eval_every = 2
        cfg.checkpoint.every_steps = 2
        cfg.data.num_examples = 64
        cfg.data.eval_examples = 16
    elif arg not in (None, ""):
        raise ValueError(f"configs/dpo.py: unknown variant {arg!r}; known: 'smoke'")
    return cfg
