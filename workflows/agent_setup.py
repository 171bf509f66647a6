"""Build the agent side of a job from the typed ``Config`` (``agent.*``): the environment
factory, the turn renderer, the tools and their sandbox, and the ``episodes.jsonl`` log."""

from __future__ import annotations

import importlib
import os

from meshrl.configs.schema import Config, ConfigError
from meshrl.models.tokenizer import Tokenizer
from meshrl.rewards.sandbox import SandboxLimits
from meshrl.rewards.tools import Tools
from meshrl.utils.errors import UserError
from meshrl.workflows.agent import AgentSpec, EpisodeLog
from meshrl.workflows.environment import EnvFactory, tool_env_factory
from meshrl.workflows.render import TurnRenderer

EPISODES_FILE = "episodes.jsonl"


class EnvLoadError(UserError, ValueError):
    """``agent.env`` names a factory that cannot be imported or called."""


def load_env_factory(spec: str) -> EnvFactory:
    """``'package.module:function'`` -> the factory (config names only, never model text)."""
    module, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module), attr, None)
    except ImportError as e:
        raise EnvLoadError(f"agent.env = {spec!r}: cannot import {module!r} ({e}): make the "
                           f"module importable (installed, or on PYTHONPATH)") from None
    if not callable(fn):
        raise EnvLoadError(f"agent.env = {spec!r}: {module} has no callable {attr!r}: name a "
                           f"function that returns an environment")
    return fn


def sandbox_limits(config: Config) -> SandboxLimits:
    a = config.agent
    return SandboxLimits(wall_s=a.tool_timeout_s, cpu_s=a.tool_cpu_s,
                         memory_mb=a.tool_memory_mb, output_bytes=a.tool_output_bytes)


def agent_spec(config: Config, tokenizer: Tokenizer, *,
               workdir: str | os.PathLike[str] | None = None,
               log: bool = True) -> AgentSpec | None:
    """The agent episode of ``config`` (None when ``agent.env`` is empty). With ``workdir``
    and ``agent.episodes_log`` (and ``log``) every finished episode is appended to
    ``<workdir>/episodes.jsonl``. Tools run in their own processes; they are stopped when the
    spec is garbage-collected or the process exits."""
    a = config.agent
    if not a.env:
        return None
    tools: Tools | None = None
    if a.env == "tools":
        tools = Tools(a.tools, sandbox_limits(config))
        factory = tool_env_factory(tools, a.tool_format)
    else:
        factory = load_env_factory(a.env)
    episode_log = None
    if workdir is not None and a.episodes_log and log:
        episode_log = EpisodeLog(os.path.join(os.fspath(workdir), EPISODES_FILE))
    return AgentSpec(factory, TurnRenderer(tokenizer), max_staleness=config.rollout.max_staleness,
                     log=episode_log, tools=tools, stop_ids=turn_stop_ids(config, tokenizer))


def turn_stop_ids(config: Config, tokenizer: Tokenizer) -> tuple[int, ...]:
    """``agent.turn_stop`` as its one token id (empty: none); more tokens is a ConfigError."""
    text = config.agent.turn_stop
    if not text:
        return ()
    ids = tokenizer.encode(text)
    if len(ids) != 1:
        raise ConfigError(f"agent.turn_stop = {text!r}: the tokenizer encodes it as {len(ids)} "
                          f"tokens {ids}: the sampler stops on single tokens, use a string that "
                          f"is one token")
    return (ids[0],)
