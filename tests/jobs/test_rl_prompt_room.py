"""The RL job's prompts must leave their episode room for a completion: over-long ones are
dropped and counted (or raise, per ``data.on_overlong``); a run where none fits stops with one
clear error instead of waiting for groups that are never accepted."""

from __future__ import annotations

import asyncio

import pytest

from meshrl.datasets import DatasetError
from meshrl.tests.trainer.tiny import run_rl, tiny_rl_config
from meshrl.workflows import EpisodeSettings, arun_episode
from meshrl.workflows.episode import PromptTooLongError


def test_an_rl_run_whose_prompts_fill_the_episode_stops_with_one_clear_error(tmp_path):
    # "12+34=" is 7 ids with BOS: an episode of 7 tokens (trainer.seq_len) has no room.
    config = tiny_rl_config(**{"trainer.seq_len": 7})
    with pytest.raises(DatasetError, match="every example is dropped"):
        run_rl(config, tmp_path)


def test_an_episode_whose_first_context_fills_its_budget_is_refused():
    class Unused:
        version = 0

        async def agenerate(self, request):
            raise AssertionError("nothing to sample")

    item = {"prompt": "p", "prompt_ids": [1, 2, 3, 4]}
    with pytest.raises(PromptTooLongError, match="first context has 4 tokens: no room for a "
                                                 "completion in .* = 4"):
        asyncio.run(arun_episode(Unused(), item, reward_pool=None, decode=str,
                                 settings=EpisodeSettings(max_total_len=4)))
