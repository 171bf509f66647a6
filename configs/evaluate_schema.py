"""The ``evaluate`` section of the schema: how ``job = evaluate`` watches an RL run's weights.

What it generates (held-out set, samples per prompt, temperature, new tokens) is the RL job's
own evaluation: ``data.eval_*``, ``rollout.group_size``, ``sampler.*``; not repeated here.
"""

from __future__ import annotations

import dataclasses

from meshrl.configs.fields import Section, at_least, field, greater_than


@dataclasses.dataclass(frozen=True)
class EvaluateConfig(Section):
    """The evaluate job (``job = evaluate``, with the RL run's own config): evaluates each
    weight version the run publishes under ``<workdir>/weights`` as it appears (greedy accuracy,
    pass@1 and pass@``rollout.group_size`` on the held-out set, as the RL job's evaluation) and
    writes the metrics under ``<workdir>/eval`` with the version as the step. It exits once the
    run's final version (``trainer.steps``) is evaluated, or once the run has ended
    (``<workdir>/summary.json``) and every version published by then is."""

    _section = "evaluate"
    timeout_s: float = field(
        3600.0, "Longest wait in seconds for the next weight version (or the run's end) after "
                "the last evaluation or the start; longer exits non-zero. 0: wait forever.",
        at_least(0.0))
    poll_s: float = field(5.0, "Seconds between listings of <workdir>/weights.",
                          greater_than(0.0))
