"""Default job: a tiny char decoder learns 2-digit addition with a short SFT warm start, then
asynchronous GRPO raises its held-out accuracy. Runs on a laptop CPU in a few minutes.

  python main.py --config configs/default.py --workdir /tmp/meshrl
  python main.py --config configs/default.py:smoke --workdir /tmp/meshrl_smoke   # < 1 minute
  python main.py --config configs/default.py:moe --workdir /tmp/meshrl_moe  # MoE decoder
  python main.py --config configs/default.py:lora --workdir /tmp/meshrl_lora  # LoRA RL

The warm start (``<workdir>/sft``, ``rl.warm_start_steps`` SFT steps at the constant rate
``rl.warm_start_lr``, see ``jobs/rl.py``) is deliberately short, so RL starts from a
mediocre policy. RL samples at temperature 0.6 (the trainer scores the same tempered policy)
with a constant rate 20x lower than the warm start's. Writes tensorboard events, checkpoints,
published weight versions, ``rl_curves.png`` and ``summary.json`` (accuracy before/after RL)
under the workdir; a rerun of the same command resumes.

Held-out greedy accuracy on 2 CPU cores: BUILD_NOTES.md, "Current figures" (about 0.4 after the
warm start, about 0.8 after 300 RL steps). Why these settings (tuning runs on that CPU): at T = 1 the
model's sampled accuracy stays near 0.2 and RL gains ~7 points in 500 steps; RL rates of 1e-4
and above first lower the greedy accuracy of this 0.1M-param model by 10-35 points; a shorter
warm start (250-450 steps) leaves 0.04-0.51 and RL then gains only 0.03-0.18; an RL rate of
8e-5 gains no more than 5e-5 does (mean +0.21 over seeds 0-2 for both).
"""

from __future__ import annotations

import ml_collections

from meshrl.configs.loader import base_config


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    cfg = base_config("rl")
    cfg.model.vocab_size = 256  # the built-in char tokenizer's byte vocabulary
    cfg.model.hidden_size = 64  # 0.1M params: SFT + RL in minutes on 2 CPU cores
    cfg.model.intermediate_size = 172  # ~8/3 x hidden (SwiGLU)
    cfg.model.num_layers = 2
    cfg.model.num_heads = 4
    cfg.model.num_kv_heads = 2  # GQA, as in the real model families
    cfg.data.source = "arithmetic"  # synthetic and verifiable ("12+34=" -> "46")
    cfg.data.difficulty = 2  # two-digit operands
    cfg.data.max_prompt_len = 16  # "<bos>99+99=" is 7 tokens
    cfg.data.eval_examples = 200  # held-out prompts (disjoint from the training set)
    cfg.reward.names = ("math",)  # exact numeric answer
    cfg.trainer.learning_rate = 5e-5  # the RL rate (Adam); the warm start uses its own
    cfg.trainer.steps = 300  # RL steps (weight versions)
    cfg.rl.warm_start_steps = 500  # SFT steps before RL
    cfg.rl.warm_start_batch_size = 32  # SFT warm-start sequences per step
    cfg.trainer.seq_len = 32  # prompt + completion fit in 32 tokens
    cfg.trainer.log_every = 10  # metric rows and console step lines: 30 over the RL run
    cfg.trainer.eval_every = 100  # held-out greedy accuracy and pass@k with the sampler
    cfg.optimizer.warmup_steps = 10
    cfg.optimizer.schedule = "constant"  # warm start and RL alike
    cfg.optimizer.weight_decay = 0.01
    cfg.sampler.max_len = 32
    cfg.sampler.max_new_tokens = 8  # answers are at most 3 digits + EOS
    cfg.sampler.prompt_buckets = (16,)  # one prefill shape: no recompiles
    cfg.sampler.slots = 256  # room for the batches in flight (max_staleness + 1)
    cfg.sampler.decode_chunk = 4
    cfg.sampler.temperature = 0.6  # behaviour policy softmax(logits / 0.6); eval pass@k too
    cfg.rollout.group_size = 16  # many samples per prompt: a rare right answer still shows up
    cfg.rollout.prompts_per_step = 16  # 256 samples per optimizer step
    cfg.rollout.max_staleness = 2  # asynchronous: up to 2 versions behind
    cfg.checkpoint.every_steps = 100
    cfg.checkpoint.publish_every = 50  # Orbax weight versions under <workdir>/weights
    if arg in ("moe", "moe_smoke"):
        # The same task on a Qwen3-MoE-shaped decoder: every layer's FFN is 4 experts, top-2.
        cfg.model.arch = "qwen3_moe"
        cfg.model.qk_norm = True
        cfg.model.num_experts = 4
        cfg.model.num_experts_per_tok = 2
        cfg.model.moe_intermediate_size = 96  # 2 active experts: about the dense FFN's FLOPs
        cfg.model.router_aux_loss_coef = 0.01
    if arg in ("smoke", "moe_smoke"):
        cfg.trainer.steps = 4  # the whole pipeline, end to end, in well under a minute
        cfg.trainer.log_every = 1
        cfg.rl.warm_start_steps = 4
        cfg.trainer.eval_every = 2
        cfg.checkpoint.every_steps = 2
        cfg.checkpoint.publish_every = 2
        cfg.data.num_examples = 200
        cfg.data.eval_examples = 16
        cfg.rollout.group_size = 4
        cfg.rollout.prompts_per_step = 4
        cfg.rollout.filter_equal_groups = False  # an untrained policy: keep every group
        cfg.sampler.slots = 32
        cfg.logging.progress_bar = False
    if arg == "lora":
        # RL through rank-16 adapters on every projection (docs/lora.md): the base is frozen,
        # so the adapters take a 10x higher rate than full fine-tuning's.
        cfg.lora.rank = 16
        cfg.lora.alpha = 32.0
        cfg.trainer.learning_rate = 5e-4
    if arg not in (None, "", "smoke", "moe", "moe_smoke", "lora"):
        raise ValueError(f"configs/default.py: unknown variant {arg!r}; known: 'smoke', 'moe', "
                         f"'moe_smoke', 'lora'")
    return cfg
