"""Build the rollout side of an RL job from the typed ``Config`` (one place that maps config
fields onto episode settings, the staleness controller, the runner and the batch builder)."""

from __future__ import annotations

import collections
import os
from collections.abc import Iterator, Sequence
from typing import Any

from meshrl.algorithms.batch import RLTrainBatch
from meshrl.algorithms.truncation import truncates
from meshrl.configs.schema import Config
from meshrl.models.tokenizer import Tokenizer
from meshrl.workflows.agent_eval import aevaluate_agent
from meshrl.workflows.agent_setup import agent_spec
from meshrl.workflows.batch import Trajectory, build_rl_batch
from meshrl.workflows.episode import Environment, EpisodeSettings, RewardScorer, SamplerClient
from meshrl.workflows.evaluate import aevaluate
from meshrl.workflows.runner import RolloutRunner, group_episode_fn
from meshrl.workflows.staleness import StalenessController
from meshrl.workflows.watch import RolloutWatch


def episode_settings(config: Config, tokenizer: Tokenizer) -> EpisodeSettings:
    """Sampling from ``sampler.*``; every episode (all turns) fits ``trainer.seq_len`` so the
    batch has the one static length the train step was compiled for."""
    s = config.sampler
    return EpisodeSettings(max_new_tokens=s.max_new_tokens, temperature=s.temperature,
                           top_k=s.top_k, top_p=s.top_p, stop_ids=tokenizer.stop_ids,
                           max_turns=config.rollout.max_turns,
                           max_total_len=min(config.trainer.seq_len, s.max_len),
                           seed=config.trainer.seed)


def prompt_room(config: Config) -> int:
    """The longest RL prompt that leaves its episode (``episode_settings``' max_total_len) room
    for one completion token: longer ones are over-long prompts (``data.on_overlong``)."""
    return min(config.trainer.seq_len, config.sampler.max_len) - 1


def make_runner(config: Config, engine: SamplerClient, reward_pool: RewardScorer,
                prompts: Iterator[Any], tokenizer: Tokenizer, *,
                env: Environment | None = None, version: int = 0,
                workdir: str | None = None) -> RolloutRunner:
    """A runner whose controller admits ``rollout.prompts_per_step`` groups per version with
    ``rollout.max_staleness``; call ``start()`` inside the event loop. With ``agent.env`` its
    episodes are agent episodes (``workflows/agent_setup.py``), logged under ``workdir``."""
    r = config.rollout
    counters: collections.Counter[str] = collections.Counter()
    watch = RolloutWatch(reward_names=config.reward.names, filter_equal=r.filter_equal_groups,
                         group_size=r.group_size, max_in_a_row=r.max_filtered_in_a_row)
    agent = agent_spec(config, tokenizer, workdir=workdir)
    group_fn = group_episode_fn(engine, group_size=r.group_size,
                                filter_equal=r.filter_equal_groups, counters=counters, watch=watch,
                                reward_pool=reward_pool, decode=tokenizer.decode,
                                settings=episode_settings(config, tokenizer), env=env,
                                agent=agent)
    controller = StalenessController(batch_size=r.prompts_per_step, max_staleness=r.max_staleness,
                                     version=version)
    return RolloutRunner(group_fn, prompts, controller, counters=counters,
                         max_failed_groups=r.max_failed_groups, watch=watch,
                         status_every_s=r.status_every_s,
                         metric_sources=() if agent is None else (agent.metrics,))


def routing_shape(config: Config, model_cfg: Any) -> tuple[int, int] | None:
    """``(layers, k)`` of the loaded model (``model.hf_path``'s, not ``config.model``'s) when
    the RL step replays the sampler's routing (``rl.routing_replay = 'rollout'``), else None."""
    if config.rl.routing_replay != "rollout":
        return None
    return (model_cfg.num_layers, model_cfg.num_experts_per_tok)


def make_rl_batch(config: Config, groups: Sequence[Sequence[Trajectory]], pad_id: int,
                  rows: int | Sequence[int] | None = None,
                  routing: tuple[int, int] | None = None) -> RLTrainBatch:
    """The RL step's batch with ``rl.*`` shaping and advantages, its rows of
    ``trainer.seq_len`` tokens (one static shape on every process), packed into ``rows`` rows
    when given. With the KL reference in the reward the advantages depend on the reference's
    logprobs: the device computes them (``trainer.reference``), the host leaves them 0.
    ``routing``: ``routing_shape``; the batch then carries the recorded experts."""
    rl = config.rl
    kl_in_reward = rl.kl_coef > 0.0 and rl.kl_where == "reward"
    return build_rl_batch(groups, length_buckets=(config.trainer.seq_len,), pad_id=pad_id,
                          advantage=None if kl_in_reward else rl.advantage, adv_eps=rl.adv_eps,
                          overlong_buffer=rl.overlong_buffer,
                          overlong_max_len=rl.overlong_max_len,
                          overlong_penalty=rl.overlong_penalty, rows=rows,
                          kept=truncates(config.sampler), routing=routing)


async def aevaluate_held_out(config: Config, engine: Any, reward_pool: Any, examples: Any,
                             tokenizer: Tokenizer, *, version: int,
                             workdir: str | os.PathLike[str] | None = None) -> dict[str, float]:
    """The RL job's held-out evaluation of ``version``: agent episodes when ``agent.env`` is
    set (logged under ``workdir`` when given), else single-turn greedy accuracy and pass@k."""
    c = config
    agent = agent_spec(c, tokenizer, workdir=workdir, log=workdir is not None)
    if agent is not None:
        return await aevaluate_agent(engine, reward_pool, examples, version=version, spec=agent,
                                     settings=episode_settings(c, tokenizer),
                                     decode=tokenizer.decode, seed=c.trainer.seed)
    return await aevaluate(engine, reward_pool, examples, version=version,
                           decode=tokenizer.decode, stop_ids=tokenizer.stop_ids,
                           max_new_tokens=c.sampler.max_new_tokens, n=c.rollout.group_size,
                           temperature=c.sampler.temperature, seed=c.trainer.seed)
