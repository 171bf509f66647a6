"""Asynchronous GRPO of Qwen2.5-0.5B-Instruct on GSM8K-format JSONL (one GPU/TPU host).

The model directory and the data files are given on the command line (never hard-coded):

  python main.py --config configs/rl_gsm8k.py --workdir /tmp/meshrl_gsm8k \\
      --config.model.hf_path=/path/to/Qwen2.5-0.5B-Instruct \\
      --config.data.path=/path/to/gsm8k_train.jsonl \\
      --config.data.eval_path=/path/to/gsm8k_test.jsonl

Each JSONL row holds ``question`` and ``answer`` (the GSM8K solution ending in ``#### N``); the
``gsm8k`` reward compares the completion's final number with N. The prompt is rendered with
the checkpoint's chat template. With ``model.hf_path`` set there is no SFT warm start.
The full recipe needs an accelerator; the ``:cpu`` variant shrinks every budget (sequence
128, 16 new tokens, 2 prompts of 8 samples a step, 4 steps) to rehearse the same run on a CPU
in a few minutes, and CI runs it end to end on a tiny Qwen2.
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.loader import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    cfg = base_config("rl")
    cfg.mesh.fsdp = True  # trainer params and moments sharded over data (ZeRO-3)
    cfg.model.remat = "full"  # 1024-token sequences: recompute activations per layer
    # Layers in a scan: one layer's code to compile, and the remat recompute stays inside the
    # backward loop (unrolled, XLA may schedule it early and keep every layer's activations:
    # benchmarks/memory.py --unrolled shows it on CPU).
    cfg.model.scan_layers = True
    # The MLP 8,192 tokens at a time (a microbatch of 16 x 1,024 in two chunks): the
    # recomputed [tokens, 4,864] activations of one layer dominate the step's temp memory.
    cfg.model.mlp_chunk = 8192
    cfg.model.compute_dtype = "bfloat16"  # float32 master weights, bf16 matmuls
    cfg.data.source = "jsonl"
    # Placeholders relative to the launch directory; pass the real files as overrides.
    cfg.data.path = "data/gsm8k/train.jsonl"
    cfg.data.eval_path = "data/gsm8k/test.jsonl"
    cfg.data.prompt_field = "question"
    cfg.data.answer_field = "answer"
    cfg.data.max_prompt_len = 256
    cfg.data.eval_examples = 256  # first rows of data.eval_path
    cfg.reward.names = ("gsm8k",)
    cfg.reward.num_workers = 4
    cfg.trainer.learning_rate = 1e-6  # the usual GRPO rate for sub-1B instruct models
    cfg.trainer.steps = 200
    cfg.trainer.seq_len = 1024  # prompt + completion budget of every episode
    cfg.trainer.microbatches = 2  # per minibatch of 32 sequences: 2 microbatches of 16
    cfg.trainer.log_every = 1
    cfg.trainer.eval_every = 25
    cfg.optimizer.warmup_steps = 10
    cfg.optimizer.schedule = "constant"
    cfg.optimizer.weight_decay = 0.0
    cfg.sampler.dtype = "bfloat16"
    cfg.sampler.max_len = 1024
    cfg.sampler.max_new_tokens = 512
    cfg.sampler.prompt_buckets = (128, 256)
    cfg.sampler.slots = 256  # two batches in flight (max_staleness = 1)
    cfg.sampler.decode_chunk = 16
    cfg.rollout.group_size = 8
    cfg.rollout.prompts_per_step = 16
    cfg.rollout.max_staleness = 1
    cfg.rl.advantage = "grpo"
    cfg.rl.policy_loss = "decoupled_ppo"
    # 4 optimizer updates per rollout batch (AReaL's GSM8K setting): after the first, the ratio
    # to the pre-batch proximal policy moves off 1 and decoupled PPO's clip acts.
    cfg.rl.ppo_minibatches = 4
    cfg.checkpoint.every_steps = 25
    cfg.checkpoint.publish_every = 25
    if arg in ("cpu", "tiny"):  # a few minutes' rehearsal on a laptop CPU ('tiny': old name)
        cfg.trainer.steps = 4
        cfg.trainer.eval_every = 2
        cfg.trainer.seq_len = 128
        cfg.trainer.microbatches = 1
        cfg.data.max_prompt_len = 64
        cfg.data.eval_examples = 4
        cfg.sampler.max_len = 128
        cfg.sampler.max_new_tokens = 16
        cfg.sampler.prompt_buckets = (64,)
        cfg.sampler.slots = 32
        cfg.sampler.decode_chunk = 8
        cfg.rollout.prompts_per_step = 2
        cfg.reward.num_workers = 1
        cfg.checkpoint.every_steps = 2
    elif arg not in (None, ""):
        raise ValueError(f"configs/rl_gsm8k.py: unknown variant {arg!r}; known: 'cpu'")
    return cfg
