"""The ``export`` section of the schema: which of a run's weights ``job = export`` writes where.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshrl.configs.fields import ConfigError, Section, at_least, field


@dataclasses.dataclass(frozen=True)
class ExportConfig(Section):
    """The export job (``job = export``): writes the params of the run under ``--workdir`` as a
    Hugging Face checkpoint (``model.safetensors`` + ``config.json``, and the run's tokenizer
    files when it used a tokenizer directory) that ``transformers`` loads."""

    _section = "export"
    path: str = field("", "Output directory (absent or empty); required with job = 'export'.")
    format: Literal["merged", "peft"] = field(
        "merged", "merged: the full model (a LoRA run's adapters merged into its base); peft: "
                  "a LoRA run's adapters as a PEFT adapter (adapter_model.safetensors + "
                  "adapter_config.json) for its Hugging Face base (model.hf_path).")
    step: int = field(-1, "Checkpoint step to export; -1: the newest verified one.", at_least(-1))
    version: int = field(-1, "Published weight version <workdir>/weights/<version> to export "
                             "instead of a checkpoint; -1: export a checkpoint.", at_least(-1))

    def validate(self) -> None:
        if self.step != -1 and self.version != -1:
            raise ConfigError(f"export.step = {self.step}: set export.step or export.version "
                              f"(= {self.version}), not both")
