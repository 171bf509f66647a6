"""Agent episodes: the model and an environment (``workflows/environment.py``) take turns, token
in and token out.

The context is the prompt ids, then each model turn exactly as the sampler produced it (its ids,
behaviour logprobs and weight versions), then each observation's ids (``workflows/render.py``:
loss mask 0, version -1, never sampled). Nothing is decoded and re-encoded across turns, so the
trainer scores exactly the ids the sampler generated. Limits: ``max_turns`` model turns and
``max_total_len`` tokens in all (prompt, turns and observations); an episode that runs out before
the environment says done ends with ``finish_reason = "length"``, keeps what it has, and is
scored by the reward pool as an empty answer (its last turn is no final answer).

Versions across turns: every generated token records its version, so a turn after a weight
handoff carries the new version and the episode's ``oldest_version`` the first turn's. An episode
whose oldest token is already more than ``max_staleness`` versions behind the sampler can never
be trained on (every later batch is at least that new), so it stops there and is rejected
instead of spending more turns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from meshrl.inference.sampler import Request
from meshrl.utils.log import get_logger
from meshrl.workflows.batch import Trajectory
from meshrl.workflows.environment import EnvFactory, close_env
from meshrl.workflows.episode import (
    EpisodeSettings,
    RewardScorer,
    SamplerClient,
    episode_seed,
    no_room,
    reward_fields,
)
from meshrl.workflows.render import TurnRenderer, as_messages

log = get_logger("workflows")

OBSERVATION_CHARS_LOGGED = 2000  # per observation in episodes.jsonl


class EpisodeLog:
    """Appends one JSON line per finished episode to ``path`` (``<workdir>/episodes.jsonl``),
    from a worker thread so the event loop never waits on the disk."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._lock = threading.Lock()

    def _append(self, lines: Sequence[str]) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        with self._lock, open(self.path, "a", encoding="utf-8") as f:
            f.writelines(lines)

    async def awrite(self, records: Sequence[dict[str, Any]]) -> None:
        lines = [json.dumps(r, default=str) + "\n" for r in records]
        await asyncio.to_thread(self._append, lines)


@dataclasses.dataclass
class _Context:
    ids: list[int]
    prompt_len: int
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None,
            versions: Sequence[int] | None) -> None:
        generated = logprobs is not None
        self.ids += list(ids)
        self.logprobs += [float(x) for x in logprobs] if generated else [0.0] * len(ids)
        self.versions += [int(v) for v in versions] if generated else [-1] * len(ids)
        self.mask += [1 if generated else 0] * len(ids)

    def oldest(self) -> int | None:
        gen = [v for v, m in zip(self.versions, self.mask) if m]
        return min(gen) if gen else None


@dataclasses.dataclass
class AgentSpec:
    """What turns a plain episode into an agent episode (``arun_episode(..., agent=spec)``)."""

    env_factory: EnvFactory
    renderer: TurnRenderer
    max_staleness: int | None = None
    log: EpisodeLog | None = None
    tools: Any = None  # ``rewards.tools.Tools`` the environments share (its metrics), or None
    stop_ids: tuple[int, ...] = ()  # ids that end a model turn besides the settings' (EOS)
    counters: dict[str, int] = dataclasses.field(default_factory=dict)

    def metrics(self) -> dict[str, float]:
        """The episode counters (``agent/*``) and the tools' (``tools/*``)."""
        out = {f"agent/{k}": float(v) for k, v in self.counters.items()}
        return out | (self.tools.metrics() if self.tools is not None else {})

    async def arun(self, engine: SamplerClient, item: dict, *, reward_pool: RewardScorer,
                   decode: Callable[[Sequence[int]], str], settings: EpisodeSettings,
                   group_id: int = 0, sample_index: int = 0) -> Trajectory | None:
        if self.stop_ids:
            settings = dataclasses.replace(settings, stop_ids=tuple(dict.fromkeys(
                (*settings.stop_ids, *self.stop_ids))))
        return await arun_agent_episode(engine, item, spec=self, reward_pool=reward_pool,
                                        decode=decode, settings=settings, group_id=group_id,
                                        sample_index=sample_index)


def _stale(spec: AgentSpec, engine: SamplerClient, ctx: _Context) -> bool:
    oldest = ctx.oldest()
    return (spec.max_staleness is not None and oldest is not None
            and engine.version - oldest > spec.max_staleness)


async def arun_agent_episode(engine: SamplerClient, item: dict, *, spec: AgentSpec,
                             reward_pool: RewardScorer, decode: Callable[[Sequence[int]], str],
                             settings: EpisodeSettings, group_id: int = 0,
                             sample_index: int = 0) -> Trajectory | None:
    """One agent episode; None (reject) when the model generated nothing or the episode went
    stale. The trajectory's ``metadata["episode"]`` is its ``episodes.jsonl`` record."""
    env = spec.env_factory()
    try:
        return await _episode(env, engine, item, spec=spec, reward_pool=reward_pool,
                              decode=decode, settings=settings, group_id=group_id,
                              sample_index=sample_index)
    finally:
        # However the episode ends (done, out of turns or tokens, stale, cancelled), what
        # the environment holds goes with it.
        await close_env(env)


async def _episode(env: Any, engine: SamplerClient, item: dict, *, spec: AgentSpec,
                   reward_pool: RewardScorer, decode: Callable[[Sequence[int]], str],
                   settings: EpisodeSettings, group_id: int, sample_index: int
                   ) -> Trajectory | None:
    first = await env.reset(item)
    ctx = _Context(spec.renderer.prompt_ids(item, first), 0)
    ctx.prompt_len = len(ctx.ids)
    if no_room(ctx.prompt_len, settings.max_total_len):
        # An environment's first observation can overflow a prompt the pipeline let through:
        # this episode is rejected (its group too), counted and said once; the run goes on.
        if not spec.counters.get("overlong_first_contexts"):
            log.warning("agent: an episode's first context (prompt and the environment's first "
                        "observation) has %d tokens: no room for a completion in "
                        "min(trainer.seq_len, sampler.max_len) = %d; such episodes are "
                        "rejected, counted in agent/overlong_first_contexts", ctx.prompt_len,
                        settings.max_total_len)
        spec.counters["overlong_first_contexts"] = (
            spec.counters.get("overlong_first_contexts", 0) + 1)
        return None
    turns: list[dict[str, Any]] = []
    rewards: list[float] = []
    finish, last_text, limit, ended = "", "", settings.max_total_len, False
    for turn in range(settings.max_turns):
        if _stale(spec, engine, ctx):
            spec.counters["stale_episodes"] = spec.counters.get("stale_episodes", 0) + 1
            return None
        max_new = settings.max_new_tokens
        if limit is not None:
            if (budget := limit - len(ctx.ids)) <= 0:
                finish = "length"
                break
            max_new = budget if max_new is None else min(max_new, budget)
        out = await engine.agenerate(Request(
            prompt_ids=list(ctx.ids), max_new_tokens=max_new, temperature=settings.temperature,
            top_k=settings.top_k, top_p=settings.top_p, stop_ids=settings.stop_ids,
            seed=episode_seed(settings, group_id, sample_index, turn),
            id=(group_id, sample_index, turn),
            # A later turn goes ahead of queued earlier ones (fresh episodes): its episode's
            # tokens age toward the staleness bound while it waits, and its group trains only
            # once every episode in it ends.
            priority=turn))
        assert len(out.tokens) == len(out.logprobs) == len(out.versions)
        ctx.add(out.tokens, out.logprobs, out.versions)
        finish, last_text = out.finish_reason, decode(out.tokens)
        observation, reward, done = await env.step(last_text)
        if reward is not None:
            rewards.append(float(reward))
        turns.append({"role": "assistant", "text": last_text, "tokens": len(out.tokens),
                      "versions": sorted(set(int(v) for v in out.versions)),
                      "finish_reason": out.finish_reason})
        if done:
            ended = True
            break
        if turn == settings.max_turns - 1:
            break
        # A turn ended on the template's end-of-turn token is closed; one ended on another id
        # (``agent.turn_stop``) or by its budget gets that token from the observation.
        obs_ids = spec.renderer.observation_ids(
            observation, last_token=out.tokens[-1] if out.tokens else None)
        if limit is not None and len(ctx.ids) + len(obs_ids) >= limit:
            finish = "length"  # no room for the observation and one more model token
            break
        ctx.add(obs_ids, None, None)
        turns += [{"role": m["role"], "text": str(m["content"])[:OBSERVATION_CHARS_LOGGED],
                   "tokens": len(obs_ids)} for m in as_messages(observation)]
    if not any(ctx.mask):
        return None
    if not ended:
        # Out of turns or tokens before the environment said done: the last turn is no final
        # answer (a tool call, say), so it is scored as an empty one.
        finish, last_text = "length", ""
    if rewards:
        total = sum(rewards)
    else:
        (total,) = await reward_pool.ascore([item.get("prompt", "")], [last_text],
                                            **reward_fields(item))
    record = {"group_id": group_id, "sample_index": sample_index,
              "prompt": item.get("prompt", ""), "turns": turns,
              "tool_calls": list(getattr(env, "calls", [])), "reward": float(total),
              "finish_reason": finish, "tokens": len(ctx.ids)}
    if spec.log is not None:
        await spec.log.awrite([record])
    return Trajectory(prompt_ids=ctx.ids[:ctx.prompt_len], completion_ids=ctx.ids[ctx.prompt_len:],
                      logprobs=ctx.logprobs, versions=ctx.versions, loss_mask=ctx.mask,
                      reward=float(total), group_id=group_id, finish_reason=finish,
                      metadata={"sample_index": sample_index, "episode": record})
