"""The RL job's sampler compiles its programs in the first RL step and none after: each step's
metric row counts the sampler programs compiled during it (``sampler/programs_compiled``)."""

from __future__ import annotations

import pytest

from meshrl.tests.trainer.tiny import run_rl, tiny_rl_config


@pytest.mark.slow  # a whole RL run
def test_default_like_rl_run_compiles_no_sampler_program_after_its_first_step(tmp_path):
    # The default job's sampler and rollout shape (configs/default.py, smoke sizes): one
    # prompt bucket, a window that is max_len, asynchronous rollouts up to 2 versions behind.
    config = tiny_rl_config(**{"trainer.steps": 4, "sampler.slots": 32,
                               "sampler.max_new_tokens": 8, "sampler.temperature": 0.6,
                               "rollout.group_size": 4, "rollout.prompts_per_step": 4,
                               "rollout.max_staleness": 2})

    loop, _ = run_rl(config, tmp_path, timeout_s=300)

    counts = [(row["step"], row["sampler/programs_compiled"]) for row in loop.history]
    assert [s for s, _ in counts] == [1, 2, 3, 4]
    assert counts[0][1] > 0, counts  # the first step compiles what the run needs
    assert all(n == 0 for _, n in counts[1:]), counts
