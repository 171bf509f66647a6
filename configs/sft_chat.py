"""SFT of a local Hugging Face checkpoint on your chat data (JSONL of ``messages``).

The model directory and the data files are given on the command line (never hard-coded):

  python main.py --config configs/sft_chat.py --workdir /tmp/meshrl_sft_chat \\
      --config.model.hf_path=/path/to/Qwen2.5-0.5B-Instruct \\
      --config.data.path=/path/to/train.jsonl --config.data.eval_path=/path/to/eval.jsonl

Each JSONL row is ``{"messages": [{"role": "system" | "user" | "assistant", "content": ...},
...]}`` ending in the assistant turn to learn; the prompt is every turn before it, rendered with
the checkpoint's chat template, and only the assistant turn's tokens carry loss. Export the
result with ``--config.job=export --config.export.path=OUT``. The ``:cpu`` variant shrinks every
budget (batch 8 x 128 tokens, 4 steps) to rehearse the same run on a CPU in a few minutes; CI
runs it end to end on a tiny Qwen2.
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.loader import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    cfg = base_config("sft")
    cfg.mesh.fsdp = True  # params and optimizer moments sharded over data (ZeRO-3)
    cfg.model.remat = "full"  # 1024-token sequences: recompute activations per layer
    cfg.model.compute_dtype = "bfloat16"  # float32 master weights, bf16 matmuls
    cfg.data.source = "jsonl"
    # Placeholders relative to the launch directory; pass the real files as overrides.
    cfg.data.path = "data/chat/train.jsonl"
    cfg.data.eval_path = "data/chat/eval.jsonl"
    cfg.data.max_prompt_len = 768
    cfg.data.eval_examples = 256  # first rows of data.eval_path
    cfg.trainer.learning_rate = 1e-5  # full fine-tuning of a sub-1B instruct model
    cfg.trainer.steps = 1000
    cfg.trainer.batch_size = 32
    cfg.trainer.seq_len = 1024
    cfg.trainer.microbatches = 4
    cfg.trainer.log_every = 10
    cfg.trainer.eval_every = 250
    cfg.optimizer.warmup_steps = 50
    cfg.optimizer.schedule = "cosine"
    cfg.optimizer.weight_decay = 0.0
    cfg.checkpoint.every_steps = 250
    if arg in ("cpu", "tiny"):  # a few minutes' rehearsal on a laptop CPU ('tiny': old name)
        cfg.trainer.steps = 4
        cfg.trainer.eval_every = 2
        cfg.trainer.batch_size = 8
        cfg.trainer.seq_len = 128
        cfg.trainer.microbatches = 1
        cfg.data.max_prompt_len = 64
        cfg.data.eval_examples = 4
        cfg.checkpoint.every_steps = 2
    elif arg not in (None, ""):
        raise ValueError(f"configs/sft_chat.py: unknown variant {arg!r}; known: 'cpu'")
    return cfg
