"""The ``data`` section: where prompts and examples come from and how they are read."""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshrl.configs.fields import (
    ConfigError,
    Section,
    at_least,
    field,
)


@dataclasses.dataclass(frozen=True)
class DataConfig(Section):
    _section = "data"
    source: Literal["arithmetic", "countdown", "jsonl", "parquet"] = field(
        "arithmetic", "Synthetic task or file format of data.path.")
    path: str = field("", "Local JSONL/Parquet file (for source jsonl/parquet).")
    eval_path: str = field("", "Local held-out file in the same format (file sources); empty: no "
                               "held-out set. Synthetic sources hold out a disjoint seed stream.")
    prompt_field: str = field("question", "Record field with the prompt.")
    answer_field: str = field("answer", "Record field with the ground truth.")
    max_prompt_len: int = field(128, "Longest prompt in tokens.", at_least(1))
    on_overlong: Literal["drop", "raise"] = field("drop", "Over-long prompts (and SFT sequences "
                                                          "over trainer.seq_len): drop and count, "
                                                          "or raise.")
    num_examples: int = field(2000, "Synthetic examples to generate.", at_least(1))
    eval_examples: int = field(200, "Held-out examples (synthetic, or first rows of "
                                    "data.eval_path).", at_least(0))
    difficulty: int = field(2, "Synthetic difficulty: arithmetic operand digits; countdown "
                               "uses difficulty + 1 numbers.", at_least(1))
    ops: tuple[str, ...] = field(("+",), "Arithmetic operators to sample from ('+', '-', '*').")
    pack: bool = field(True, "SFT: pack several examples into each row (segment ids keep them "
                             "apart); False: one example per row.")
    shuffle_seed: int = field(0, "Seed of synthetic generation; mixed with trainer.seed for the "
                                 "deterministic shuffle.")

    def validate(self) -> None:
        if self.source in ("jsonl", "parquet") and not self.path:
            raise ConfigError(f"data.path = '': required when data.source = {self.source!r}")
        if not self.ops or any(op not in ("+", "-", "*") for op in self.ops):
            raise ConfigError(f"data.ops = {self.ops}: must be a non-empty subset of "
                              f"('+', '-', '*')")
