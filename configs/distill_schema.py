"""The ``distill`` section: on-policy distillation in the RL job (``job = rl``).

With a teacher (``distill.teacher``, or one trained in the run with ``distill.teacher_steps``)
the RL job's advantages become per-token reverse-KL advantages against the teacher
(``algorithms/distill.py``); everything else -- sampler, staleness, policy loss, checkpoints --
is the RL job's. docs/distill.md has the design. ``check_distill`` holds the rules that read
other sections; ``Config.__post_init__`` runs it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from meshrl.configs.fields import ConfigError, Section, at_least, field
from meshrl.configs.model_schema import ModelConfig

_WIDTHS = ("teacher_hidden_size", "teacher_intermediate_size", "teacher_num_layers")


@dataclasses.dataclass(frozen=True)
class DistillConfig(Section):
    """On-policy distillation: the student (``model.*``) samples, the teacher scores its tokens,
    the advantage is log p_teacher - log p_student per token."""

    _section = "distill"
    teacher: str = field(
        "", "Teacher to distil from: a Hugging Face checkpoint directory (config.json + "
            "safetensors) or a meshrl run's workdir (its newest checkpoint, with the model "
            "section that run saved). Same tokenizer as the student; may be larger. Empty: no "
            "distillation unless distill.teacher_steps > 0.")
    reward_weight: float = field(
        0.0, "Weight of the task advantage (rl.advantage over reward.*) added to each token's "
             "distillation advantage; 0: pure distillation.", at_least(0.0))
    teacher_steps: int = field(
        0, "> 0: train the teacher in this run first, with that many SFT steps on data.* "
           "(rl.warm_start_lr, rl.warm_start_batch_size) under <workdir>/teacher (resumable), "
           "from a random init of model.* with the distill.teacher_* sizes; distill.teacher "
           "must then be empty.", at_least(0))
    teacher_hidden_size: int = field(
        0, "distill.teacher_steps > 0: the teacher's model.hidden_size; 0: the student's.",
        at_least(0))
    teacher_intermediate_size: int = field(
        0, "distill.teacher_steps > 0: the teacher's model.intermediate_size; 0: the "
           "student's.", at_least(0))
    teacher_num_layers: int = field(
        0, "distill.teacher_steps > 0: the teacher's model.num_layers; 0: the student's.",
        at_least(0))

    @property
    def enabled(self) -> bool:
        return bool(self.teacher) or self.teacher_steps > 0

    def validate(self) -> None:
        if self.teacher and self.teacher_steps:
            raise ConfigError(f"distill.teacher = {self.teacher!r}: must be empty when "
                              f"distill.teacher_steps = {self.teacher_steps} (the run trains "
                              f"its own teacher under <workdir>/teacher): set one of them")
        for name in _WIDTHS:
            if getattr(self, name) and not self.teacher_steps:
                raise ConfigError(f"distill.{name} = {getattr(self, name)}: shapes only a "
                                  f"teacher trained in this run: set distill.teacher_steps > 0 "
                                  f"or leave it 0 (a loaded teacher brings its own shape)")


def teacher_model(model: ModelConfig, distill: DistillConfig) -> ModelConfig:
    """The model section of a teacher trained in the run: the student's with the
    ``distill.teacher_*`` sizes that are set."""
    sizes = {name.removeprefix("teacher_"): getattr(distill, name) for name in _WIDTHS
             if getattr(distill, name)}
    try:
        return dataclasses.replace(model, **sizes)
    except ConfigError as e:
        raise ConfigError(f"distill.teacher_* = {sizes}: the teacher's model section is "
                          f"invalid: {e}") from None


def check_distill(config: Any) -> None:
    """The rules between ``distill`` and the other sections (``Config.__post_init__``)."""
    d = config.distill
    if not d.enabled:
        return
    what = (f"distill.teacher = {d.teacher!r}" if d.teacher
            else f"distill.teacher_steps = {d.teacher_steps}")
    if getattr(config.job, "value", config.job) != "rl":
        return  # only the RL job distils; the SFT configs it derives keep the section
    if config.rl.kl_coef > 0.0:
        raise ConfigError(f"rl.kl_coef = {config.rl.kl_coef}: must be 0 with {what} (the "
                          f"advantage already is the reverse KL to the teacher, which takes the "
                          f"reference policy's place)")
    if config.rollout.filter_equal_groups:
        raise ConfigError(f"rollout.filter_equal_groups = True: must be False with {what} "
                          f"(a group whose task rewards are all equal still carries the "
                          f"teacher's per-token signal)")
    if d.teacher_steps and config.model.hf_path and any(getattr(d, n) for n in _WIDTHS):
        raise ConfigError(f"model.hf_path = {config.model.hf_path!r}: distill.teacher_* sizes "
                          f"need a random-init teacher: clear model.hf_path or the sizes")
    if d.teacher_steps:
        teacher_model(config.model, d)
