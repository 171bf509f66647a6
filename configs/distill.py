"""On-policy distillation, all local: after a tiny student's short SFT warm start, the run
trains a wider teacher with SFT on the default job's synthetic task (two-digit sums), and the
student distils from it on-policy: the student samples, the teacher scores the student's tokens, and
each token's advantage is log p_teacher - log p_student (docs/distill.md).

  python main.py --config configs/distill.py --workdir /tmp/meshrl_distill
  python main.py --config configs/distill.py:smoke --workdir /tmp/meshrl_distill_smoke

Phases, each resumable: ``<workdir>/sft`` (the student's ``rl.warm_start_steps``),
``<workdir>/teacher`` (``distill.teacher_steps`` SFT steps of the teacher), then the RL job's loop with
the teacher in the KL reference's place. ``summary.json``'s ``distill`` entry has the teacher's,
the student's before and the student's after held-out greedy accuracy. To distil from an
existing teacher instead, set ``--config.distill.teacher=DIR`` (a Hugging Face checkpoint or a
meshrl run's workdir) and ``--config.distill.teacher_steps=0``.
"""

from __future__ import annotations

import ml_collections

from meshrl.configs import default


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    if arg not in (None, "", "smoke"):
        raise ValueError(f"configs/distill.py: unknown variant {arg!r}; known: 'smoke'")
    cfg = default.get_config("smoke" if arg == "smoke" else None)
    # The teacher: twice the student's width, trained long enough to be clearly better.
    cfg.distill.teacher_steps = 800  # SFT loss ~0.02 by then
    cfg.distill.teacher_hidden_size = 128
    cfg.distill.teacher_intermediate_size = 344
    cfg.distill.reward_weight = 0.0  # pure distillation: the reward is only measured
    # The student: the default job's 0.1M-param decoder with the default job's short warm
    # start, at half the teacher's width, so it starts far below the teacher.
    cfg.rl.warm_start_steps = 500
    cfg.rollout.filter_equal_groups = False  # every group carries the teacher's signal
    cfg.rollout.max_filtered_in_a_row = 0
    # Per-token advantages of a confident teacher reach tens of nats: a low rate keeps the
    # student from overshooting (5e-5 with 64 samples a step first gained, then lost, ground).
    cfg.trainer.learning_rate = 2e-5
    cfg.trainer.steps = 100
    cfg.trainer.eval_every = 50
    cfg.checkpoint.every_steps = 50
    cfg.checkpoint.publish_every = 50
    # 64 samples a step, a quarter of the default job's: every token carries the teacher's
    # signal, where GRPO needs many samples for one rare right answer to show up.
    cfg.rollout.prompts_per_step = 8
    cfg.rollout.group_size = 8
    cfg.sampler.slots = 128
    if arg == "smoke":
        cfg.distill.teacher_steps = 4
        cfg.rl.warm_start_steps = 2
        cfg.trainer.steps = 2
        cfg.trainer.eval_every = 1
        cfg.checkpoint.every_steps = 1
        cfg.checkpoint.publish_every = 1
        cfg.rollout.prompts_per_step = 2
        cfg.rollout.group_size = 2
        cfg.sampler.slots = 16
    return cfg
