"""The ``dpo`` section of the schema: the preference (DPO-family) job, ``job = dpo``.

The losses are ``algorithms/preference.py``'s; docs/dpo.md has their formulas and sources.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshrl.configs.fields import ConfigError, Section, at_least, field, greater_than


@dataclasses.dataclass(frozen=True)
class DPOConfig(Section):
    """Preference training (``job = dpo``): pairs of (chosen, rejected) completions of one
    prompt, from ``dpo.path`` (JSONL) or the synthetic preference task of ``data.source``."""

    _section = "dpo"
    loss: Literal["dpo", "ipo", "simpo"] = field(
        "dpo", "Preference loss: dpo (sigmoid), ipo (squared) or simpo (reference-free, "
               "length-normalised); formulas in docs/dpo.md.")
    beta: float = field(0.1, "Inverse temperature of the implicit reward (ipo: the margin is "
                             "1 / (2 beta)).", greater_than(0.0))
    path: str = field("", "Preference JSONL file (rows: messages, chosen, rejected); empty: the "
                          "synthetic preference task of data.source.")
    eval_path: str = field("", "Held-out preference JSONL in the same format; empty with "
                               "dpo.path set: no held-out accuracy.")
    label_smoothing: float = field(
        0.0, "dpo loss only: assumed probability that a pair's label is flipped (conservative "
             "DPO); must be in [0, 0.5).", at_least(0.0))
    simpo_gamma: float = field(0.5, "simpo loss only: target reward margin gamma.",
                               at_least(0.0))

    def validate(self) -> None:
        if self.eval_path and not self.path:
            raise ConfigError(f"dpo.eval_path = {self.eval_path!r} needs dpo.path: without it "
                              f"training and held-out pairs are the synthetic task's; set "
                              f"dpo.path or clear dpo.eval_path")
        if not self.label_smoothing < 0.5:
            raise ConfigError(f"dpo.label_smoothing = {self.label_smoothing}: must be < 0.5 "
                              f"(0.5 makes the loss ignore the labels)")
        if self.label_smoothing and self.loss != "dpo":
            raise ConfigError(f"dpo.label_smoothing = {self.label_smoothing}: only the dpo "
                              f"loss uses it, dpo.loss = {self.loss!r}: set it to 0")
