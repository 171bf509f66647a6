"""Async episodes: one prompt -> one ``Trajectory`` (single-turn RLVR or multi-turn with an
environment), and groups of n samples per prompt with dynamic filtering.

Everything here awaits: the engine (``await engine.agenerate``), the reward pool (``await
reward_pool.ascore``) and the environment. Nothing blocks the event loop, so one loop can keep
hundreds of episodes in flight while the sampler batches them continuously.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from meshrl.inference.sampler import Completion, Request
from meshrl.utils.aio import gather_or_cancel
from meshrl.utils.errors import UserError
from meshrl.utils.log import get_logger
from meshrl.workflows.batch import Trajectory

log = get_logger("workflows")

# Example keys that are inputs of the episode itself, not reward fields.
_NOT_REWARD_FIELDS = frozenset({"prompt", "prompt_ids", "prompt_text"})


class PromptTooLongError(UserError):
    """A prompt leaves its episode no room for a completion (the RL job's prompt pipeline drops
    such prompts first: ``workflows.setup.prompt_room``)."""


def no_room(prompt_len: int, max_total_len: int | None) -> bool:
    """Whether a first context of ``prompt_len`` tokens fills the episode's token budget."""
    return max_total_len is not None and prompt_len >= max_total_len


def check_room(prompt_len: int, max_total_len: int | None) -> None:
    """Refuse a prompt that fills the episode's token budget: every episode of it would be
    rejected, and a run of them never fills a batch."""
    if no_room(prompt_len, max_total_len):
        raise PromptTooLongError(
            f"an episode's prompt has {prompt_len} tokens: no room for a completion in "
            f"min(trainer.seq_len, sampler.max_len) = {max_total_len}: raise both, or lower "
            f"data.max_prompt_len")


class SamplerClient(Protocol):
    """What workflows need from the sampler (``meshrl.inference.async_sampler.AsyncSampler``)."""

    @property
    def version(self) -> int: ...

    async def agenerate(self, request: Request) -> Completion: ...


class RewardScorer(Protocol):
    """``meshrl.rewards.RewardPool`` as seen from an episode."""

    async def ascore(self, prompts: Sequence[str], completions: Sequence[str],
                     **fields: Sequence[Any]) -> list[float]: ...


@dataclasses.dataclass
class EnvStep:
    """An environment's answer to one model turn."""

    feedback_ids: list[int]  # appended to the context; never trained on
    done: bool
    reward: float | None = None  # final reward when done; None: score with the reward pool
    reject: bool = False  # drop the whole episode (counted as a rejected episode)


class Environment(Protocol):
    async def astep(self, item: dict, completion_text: str, turn: int) -> EnvStep: ...


class AgentEpisode(Protocol):
    """``workflows.agent.AgentSpec``: runs a token-in/token-out agent episode instead."""

    async def arun(self, engine: SamplerClient, item: dict, *, reward_pool: RewardScorer,
                   decode: Callable[[Sequence[int]], str], settings: EpisodeSettings,
                   group_id: int = 0, sample_index: int = 0) -> Trajectory | None: ...


@dataclasses.dataclass(frozen=True)
class EpisodeSettings:
    max_new_tokens: int | None = None  # per turn; None: the sampler's default
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    stop_ids: tuple[int, ...] = ()
    max_turns: int = 1
    max_total_len: int | None = None  # prompt + completion budget over all turns
    seed: int = 0


def episode_seed(settings: EpisodeSettings, group_id: int, sample_index: int, turn: int) -> int:
    # Distinct, reproducible sampler seeds per (group, sample, turn); ints hash deterministically.
    return hash((settings.seed, group_id, sample_index, turn)) & 0x7FFFFFFF


def reward_fields(item: dict, n: int = 1) -> dict[str, list[Any]]:
    return {k: [v] * n for k, v in item.items()
            if k not in _NOT_REWARD_FIELDS and not k.startswith("_")}


async def arun_episode(engine: SamplerClient, item: dict, *, reward_pool: RewardScorer,
                       decode: Callable[[Sequence[int]], str],
                       settings: EpisodeSettings = EpisodeSettings(),
                       env: Environment | None = None, group_id: int = 0,
                       sample_index: int = 0,
                       agent: AgentEpisode | None = None) -> Trajectory | None:
    """Run one episode for ``item`` (a prompt-iterator example with ``prompt_ids``, ``prompt``
    and reward fields). Without ``env`` it is single-turn RLVR: one completion, scored by the
    reward pool. With ``env`` the model and the environment alternate for up to
    ``settings.max_turns`` model turns; feedback tokens get loss mask 0 and version -1.
    Returns None (reject) when the engine generated nothing or the environment rejects.
    With ``agent`` (``workflows.agent.AgentSpec``) the episode is an agent episode: the
    environment API of ``workflows/environment.py``, observations rendered from the chat
    template, ``episodes.jsonl``."""
    if agent is not None:
        return await agent.arun(engine, item, reward_pool=reward_pool, decode=decode,
                                settings=settings, group_id=group_id, sample_index=sample_index)
    prompt_ids = list(item["prompt_ids"])
    check_room(len(prompt_ids), settings.max_total_len)
    completion_ids: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    loss_mask: list[int] = []
    kept: list[int] | None = []  # None once a completion did not record its kept counts
    routing: list[Any] | None = []  # None once a completion did not record its routing
    finish_reason, env_reward = "", None
    max_turns = settings.max_turns if env is not None else 1
    for turn in range(max_turns):
        max_new = settings.max_new_tokens
        if settings.max_total_len is not None:
            budget = settings.max_total_len - len(prompt_ids) - len(completion_ids)
            if budget <= 0:
                finish_reason = "length"
                break
            max_new = budget if max_new is None else min(max_new, budget)
        request = Request(prompt_ids=prompt_ids + completion_ids, max_new_tokens=max_new,
                          temperature=settings.temperature, top_k=settings.top_k,
                          top_p=settings.top_p, stop_ids=settings.stop_ids,
                          seed=episode_seed(settings, group_id, sample_index, turn),
                          id=(group_id, sample_index, turn))
        out = await engine.agenerate(request)
        assert len(out.tokens) == len(out.logprobs) == len(out.versions), (
            len(out.tokens), len(out.logprobs), len(out.versions))
        completion_ids += list(out.tokens)
        # The behaviour policy is the distribution actually sampled (softmax(logits / T),
        # truncated by top-k/top-p/min-p to ``out.kept`` tokens); the trainer scores with
        # logits / T truncated to as many (``algorithms.truncation``). At T = 1 without
        # truncation this is the raw log_softmax.
        logprobs += [float(x) for x in out.logprobs]
        recorded = kept is not None and len(out.kept) == len(out.tokens)
        kept = kept + [int(k) for k in out.kept] if recorded else None
        routed = routing is not None and len(out.routing) == len(out.tokens)
        routing = routing + list(out.routing) if routed else None
        versions += [int(v) for v in out.versions]
        loss_mask += [1] * len(out.tokens)
        finish_reason = out.finish_reason
        if env is None:
            break
        step = await env.astep(item, decode(out.tokens), turn)
        if step.reject:
            return None
        if step.done or turn == max_turns - 1:
            env_reward = step.reward
            break
        if settings.max_total_len is not None and (
                len(prompt_ids) + len(completion_ids) + len(step.feedback_ids)
                >= settings.max_total_len):
            # No room for the feedback plus one model token: end here rather than exceed the
            # budget (the trainer's bucket) or train on a context the model never answered.
            finish_reason = "length"
            break
        completion_ids += list(step.feedback_ids)
        logprobs += [0.0] * len(step.feedback_ids)
        versions += [-1] * len(step.feedback_ids)
        loss_mask += [0] * len(step.feedback_ids)
        kept = None if kept is None else kept + [0] * len(step.feedback_ids)
        routing = None if routing is None else routing + [None] * len(step.feedback_ids)
    if not any(loss_mask):
        return None
    if env_reward is None:
        text = decode([t for t, m in zip(completion_ids, loss_mask) if m])
        (env_reward,) = await reward_pool.ascore([item.get("prompt", "")], [text],
                                                 **reward_fields(item))
    return Trajectory(prompt_ids=prompt_ids, completion_ids=completion_ids, logprobs=logprobs,
                      versions=versions, loss_mask=loss_mask, reward=float(env_reward),
                      group_id=group_id, finish_reason=finish_reason,
                      metadata={"sample_index": sample_index}, kept=kept, routing=routing)


async def arun_group(engine: SamplerClient, item: dict, *, group_size: int, group_id: int,
                     filter_equal: bool = True,
                     counters: collections.Counter[str] | None = None,
                     **episode_kwargs: Any) -> list[Trajectory] | None:
    """``group_size`` concurrent episodes for one prompt. Returns None (counted in ``counters``)
    when any episode is rejected (``rejected_groups``; a partial group would bias the group
    baseline) or, with ``filter_equal``, when all rewards are equal (``filtered_equal_groups``:
    such a group has zero advantage everywhere and only dilutes the batch, DAPO dynamic
    sampling)."""
    counters = counters if counters is not None else collections.Counter()
    trajs = await gather_or_cancel(*(
        arun_episode(engine, item, group_id=group_id, sample_index=i, **episode_kwargs)
        for i in range(group_size)))
    if any(t is None for t in trajs):
        counters["rejected_groups"] += 1
        return None
    if filter_equal and group_size > 1 and len({t.reward for t in trajs}) == 1:
        counters["filtered_equal_groups"] += 1
        return None
    counters["accepted_groups"] += 1
    return list(trajs)
