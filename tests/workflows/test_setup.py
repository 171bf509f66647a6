"""Config -> rollout side: settings, controller sizing, a batch at trainer.seq_len."""

from __future__ import annotations

import asyncio

import numpy as np

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.configs import base_config, from_config_dict
from meshrl.datasets import make_prompt_iterator
from meshrl.models.tokenizer import CharTokenizer
from meshrl.tests.workflows.fakes import FakeEngine, FakeRewards
from meshrl.workflows.setup import episode_settings, make_rl_batch, make_runner


def rl_config():
    cfg = base_config("rl")
    cfg.rollout.group_size, cfg.rollout.prompts_per_step = 2, 3
    cfg.rollout.max_staleness, cfg.rollout.filter_equal_groups = 1, False
    cfg.trainer.seq_len, cfg.sampler.max_new_tokens = 48, 5
    cfg.rl.advantage = "drgrpo"
    return from_config_dict(cfg)


def test_episode_settings_fit_the_train_length_and_stop_at_eos():
    config, tok = rl_config(), CharTokenizer()

    s = episode_settings(config, tok)

    assert (s.max_new_tokens, s.stop_ids, s.max_total_len, s.max_turns) == (5, (tok.eos_id,),
                                                                             48, 1)


def test_runner_from_config_yields_a_batch_at_trainer_seq_len():
    config, tok = rl_config(), CharTokenizer()
    prompts = make_prompt_iterator(config.data, tok, batch_size=4, seed=0)
    engine = FakeEngine(tokens=4)

    async def main():
        runner = make_runner(config, engine, FakeRewards(), prompts, tok)
        runner.start()
        groups = await runner.get_batch(0)
        await runner.stop()
        return runner, groups

    runner, groups = asyncio.run(main())
    batch = make_rl_batch(config, groups, pad_id=tok.pad_id)

    assert runner.controller.batch_size == 3 and runner.controller.max_staleness == 1
    assert batch.input_ids.shape == (6, 48) and len(groups) == 3
    assert isinstance(batch, RLTrainBatch) and batch.ref_logprobs is None
    np.testing.assert_array_equal(batch.loss_mask.sum(-1), 4)
