"""Every benchmark's config passes the config rules it will meet (the benchmarks themselves run
outside the suite: a rule added later must not break them unseen)."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("reference", [True, False])
def test_the_memory_benchmarks_rl_config_is_valid(reference):
    from meshrl.benchmarks import memory

    config = memory.make_config(4096, 8, 256, 256, reference=reference, dtype="float32")

    assert config.rollout.group_size == 1 and config.rl.advantage == "reinforce_pp"


def test_the_rl_step_and_rl_async_benchmarks_configs_are_valid():
    from meshrl.benchmarks import rl_async, rl_step

    assert rl_step.make_config(0, 4).trainer.steps == 4
    assert rl_async.make_config(1, 4).trainer.steps == 4


def test_the_context_benchmarks_configs_are_valid():
    from meshrl.benchmarks import context

    for c in (1, 4):
        assert context.make_config(32_768, c, "all_gather").mesh.context == c
