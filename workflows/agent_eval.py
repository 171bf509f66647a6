"""Held-out evaluation through agent episodes: the same turns, environment and tools as the
rollouts, greedy (temperature 0), one episode per example. An episode is correct when the
verifier (the first of ``reward.names``) scores its final turn > 0.5, or, for an environment
that returns rewards itself, when their sum is > 0.5. Every generated token must come from the
version evaluated, as in ``workflows/evaluate.py``."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshrl.utils.aio import gather_or_cancel
from meshrl.workflows.agent import AgentSpec
from meshrl.workflows.episode import EpisodeSettings, SamplerClient
from meshrl.workflows.evaluate import EvalVersionError


class _Verifier:
    """The reward pool's first reward, unweighted, as the episodes' scorer."""

    def __init__(self, reward_pool: Any) -> None:
        self.pool = reward_pool

    async def ascore(self, prompts: Sequence[str], completions: Sequence[str],
                     **fields: Sequence[Any]) -> list[float]:
        comps = await asyncio.to_thread(self.pool.score_components, prompts, completions,
                                        **fields)
        return comps[self.pool.names[0]]


async def aevaluate_agent(engine: SamplerClient, reward_pool: Any, examples: Sequence[dict], *,
                          version: int, spec: AgentSpec, settings: EpisodeSettings,
                          decode: Callable[[Sequence[int]], str], seed: int = 0
                          ) -> dict[str, float]:
    """``eval/greedy_accuracy`` and ``eval/reward_mean`` of agent episodes on ``examples`` at
    ``version`` (a rejected episode scores 0), with the share of episodes that called a tool
    and the mean number of model turns."""
    if not examples:
        return {}
    if engine.version != version:
        raise EvalVersionError(f"engine holds version {engine.version}, evaluating {version}")
    greedy = dataclasses.replace(settings, temperature=0.0, seed=seed)
    # No staleness cut: an episode that sees another version must reach the version check
    # below (an error), not end as a rejected, wrong answer.
    spec = dataclasses.replace(spec, max_staleness=None)
    verifier = _Verifier(reward_pool)
    trajs = await gather_or_cancel(*(
        spec.arun(engine, ex, reward_pool=verifier, decode=decode, settings=greedy,
                  group_id=-1 - i) for i, ex in enumerate(examples)))
    bad = sorted({v for t in trajs if t is not None
                  for v, m in zip(t.versions, t.loss_mask) if m and v != version})
    if bad:
        raise EvalVersionError(f"evaluation of version {version} got tokens of versions {bad}; "
                               f"weights changed during evaluation")
    rewards = [t.reward if t is not None else 0.0 for t in trajs]
    episodes = [t.metadata["episode"] for t in trajs if t is not None]
    turns = [sum(1 for x in e["turns"] if x["role"] == "assistant") for e in episodes]
    return {"eval/greedy_accuracy": float(np.mean([r > 0.5 for r in rewards])),
            "eval/reward_mean": float(np.mean(rewards)), "eval/examples": float(len(examples)),
            "eval/tool_call_rate": float(np.mean([bool(e["tool_calls"]) for e in episodes]))
            if episodes else 0.0,
            "eval/turns": float(np.mean(turns)) if turns else 0.0}


class _Unscored:
    """The generate job has prompts, not answers: a final turn the environment did not reward
    scores 0.0."""

    async def ascore(self, prompts: Sequence[str], completions: Sequence[str],
                     **fields: Sequence[Any]) -> list[float]:
        return [0.0] * len(completions)


async def agenerate_episodes(engine: SamplerClient, examples: Sequence[dict], *,
                             spec: AgentSpec, settings: EpisodeSettings,
                             decode: Callable[[Sequence[int]], str], first_index: int = 0
                             ) -> list[dict[str, Any]]:
    """One sampled agent episode per example (the generate job): each episode's record (the
    ``episodes.jsonl`` line, written by ``spec.log``), seeded by its index in the file."""
    trajs = await gather_or_cancel(*(
        spec.arun(engine, ex, reward_pool=_Unscored(), decode=decode, settings=settings,
                  group_id=first_index + i) for i, ex in enumerate(examples)))
    return [t.metadata["episode"] for t in trajs if t is not None]
