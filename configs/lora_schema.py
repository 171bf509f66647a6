"""The ``lora`` section of the schema: low-rank adapters on any training job (rank 0: off).

The math, the target matching and the quantised frozen base are ``models/lora.py``'s;
docs/lora.md describes them.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from meshrl.configs.fields import ConfigError, Section, at_least, field, greater_than


@dataclasses.dataclass(frozen=True)
class LoraConfig(Section):
    """LoRA / QLoRA: the base weights are frozen, only ``A`` and ``B`` of each targeted
    projection train (``W + alpha / rank * A @ B``)."""

    _section = "lora"
    rank: int = field(0, "Adapter rank r; 0 turns LoRA off (full fine-tuning).", at_least(0))
    alpha: float = field(16.0, "Adapter scale numerator: the update is alpha / rank * A @ B.",
                         greater_than(0.0))
    targets: str = field(
        r"attn/(q|k|v|o)|mlp/(gate|up|down)",
        "Regex searched in each projection's parameter path (e.g. layers/0/attn/q/kernel); "
        "every match gets an adapter.")
    base_dtype: Literal["float32", "bfloat16", "int8", "nf4"] = field(
        "float32", "Storage of the frozen base projections: float32, bfloat16, int8 "
                   "(per-channel absmax) or nf4 (QLoRA 4-bit normal-float, blocks of 64).")
    dropout: float = field(0.0, "Dropout rate p on each adapter's input (PEFT's lora_dropout), "
                                "0 <= p < 1; the train step draws a new mask each step.",
                           at_least(0.0))
    seed: int = field(0, "Seed of the adapters' A initialisation (B starts at zero).")

    def validate(self) -> None:
        try:
            re.compile(self.targets)
        except re.error as e:
            raise ConfigError(f"lora.targets = {self.targets!r}: not a valid regex ({e}); "
                              f"write a Python regex such as 'attn/(q|v)'") from None
        if not self.dropout < 1.0:
            raise ConfigError(f"lora.dropout = {self.dropout}: must be < 1 (1 drops every "
                              f"adapter input); use 0 <= p < 1")
