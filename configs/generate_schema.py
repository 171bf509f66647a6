"""The ``generate`` section: which weights the generate job samples with, and its output.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from meshrl.configs.fields import ConfigError, Section, at_least, field


@dataclasses.dataclass(frozen=True)
class GenerateConfig(Section):
    """The generate job (``job = generate``): where its weights come from. The run sources read the
    run under ``--workdir``; its samples go to ``<workdir>/samples.jsonl`` (agent episodes to
    ``episodes.jsonl``; never over an earlier one unless ``generate.overwrite``)."""

    _section = "generate"
    source: Literal["hf_path", "random", "checkpoint", "version"] = field(
        "hf_path", "Weights to sample from: hf_path (the model.hf_path checkpoint), random (a "
                   "random init of model.*, for smoke tests), checkpoint (the params of the newest "
                   "verified checkpoint under <workdir>/checkpoints, with the model and tokenizer "
                   "of the run's saved config), version (the published weight version "
                   "<workdir>/weights/<generate.version>, with the model and tokenizer of the run's "
                   "newest checkpoint config, or of this config when the run has none).")
    version: int = field(-1, "Weight version for generate.source = 'version'; -1: the newest "
                             "published one. Must stay -1 with the other sources.", at_least(-1))
    overwrite: bool = field(False, "Replace an existing <workdir>/samples.jsonl (episodes.jsonl "
                                   "with agent.env); False: keep it and write the first free "
                                   "samples-<n>.jsonl (n = 1, 2, ...), named in the job's last "
                                   "log line.")

    def validate(self) -> None:
        if self.version != -1 and self.source != "version":
            raise ConfigError(f"generate.version = {self.version}: only read with generate.source = "
                              f"'version' (generate.source = {self.source!r}); set "
                              f"generate.source = 'version' or leave generate.version at -1")
