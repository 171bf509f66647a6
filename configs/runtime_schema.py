"""The ``runtime`` section: process-wide JAX settings every job applies first.
"""

from __future__ import annotations

import dataclasses

from meshrl.configs.fields import Section, field


@dataclasses.dataclass(frozen=True)
class RuntimeConfig(Section):
    _section = "runtime"
    compile_cache: bool = field(
        True, "JAX's persistent compilation cache: a rerun or a resumed job loads the programs "
              "an earlier run compiled (same code, shapes, devices) instead of compiling them "
              "again. False turns it off for the job.")
    compile_cache_dir: str = field(
        "", "Cache directory (a local path or gs://...); empty: $JAX_COMPILATION_CACHE_DIR "
            "when set, else $XDG_CACHE_HOME/meshrl/jax (default ~/.cache/meshrl/jax).")
