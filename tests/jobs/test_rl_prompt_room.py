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


def test_an_episode_whose_prompt_fills_its_budget_is_refused():
    class Unused:
        version = 0

        async def agenerate(self, request):
            raise AssertionError("nothing to sample")

    item = {"prompt": "p", "prompt_ids": [1, 2, 3, 4]}
    with pytest.raises(PromptTooLongError, match="prompt has 4 tokens: no room for a "
                                                 "completion in .* = 4"):
        asyncio.run(arun_episode(Unused(), item, reward_pool=None, decode=str,
                                 settings=EpisodeSettings(max_total_len=4)))


def test_an_agent_episode_whose_first_observation_overflows_is_rejected_and_counted(caplog):
    from meshrl.models.tokenizer import CharTokenizer
    from meshrl.tests.workflows.agent_fakes import ConstRewards, ScriptedSampler
    from meshrl.workflows.agent import AgentSpec
    from meshrl.workflows.environment import FunctionEnv
    from meshrl.workflows.render import TurnRenderer

    tok = CharTokenizer()
    briefing = {"long": "x" * 40, "short": "go"}
    spec = AgentSpec(lambda: FunctionEnv(lambda ex, a, t: (None, 1.0, True),
                                         reset_fn=lambda ex: briefing[ex["prompt"]]),
                     TurnRenderer(tok))
    sampler = ScriptedSampler([tok.encode("7") + [tok.eos_id]])
    settings = EpisodeSettings(max_turns=2, stop_ids=(tok.eos_id,), max_total_len=32)

    async def go():
        return [await arun_episode(sampler, {"prompt": p, "prompt_ids": [tok.bos_id, 5]},
                                   reward_pool=ConstRewards(), decode=tok.decode,
                                   settings=settings, agent=spec)
                for p in ("long", "short", "long")]

    long1, short, long2 = asyncio.run(go())

    assert long1 is None and long2 is None and short is not None
    assert spec.metrics()["agent/overlong_first_contexts"] == 2.0
    assert sum("first context" in r.getMessage() for r in caplog.records) == 1  # said once
