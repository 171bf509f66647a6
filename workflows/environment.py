"""The environment API of agent episodes, and adapters for what users already have.

An environment is any object with two async methods (no meshrl type is needed to write one)::

    class MyEnv:
        async def reset(self, example: dict) -> Observation: ...
        async def step(self, action: str) -> tuple[Observation, float | None, bool]: ...

* ``reset(example)`` starts an episode for one prompt-iterator example (its ``prompt`` and
  every column of its row) and returns the first observation, or None when the prompt says all.
* ``step(action)`` gets the model's turn as text (special tokens stripped) and returns
  ``(observation, reward, done)``. ``reward`` is this turn's reward or None; the episode's reward
  is the sum of the non-None rewards, or, when every turn returned None, the job's reward pool
  scores the model's final turn (``reward.names``).
* An optional ``close()`` (sync or async) runs once when the episode ends, however it ends
  (done, out of turns or tokens, stale, cancelled): release what the environment holds there.
* An observation is text (shown as a user turn), a list of chat messages
  (``{"role": "tool" | "user", "content": ...}``), or None. It is tokenized once, appended to the
  context after the model's own tokens and never trained on (loss mask 0).

The episode makes one environment per sample with a factory (``Callable[[], env]``), so an
environment may keep per-episode state. Adapters: ``FunctionEnv`` (a plain Python function),
``GymEnv`` (a gymnasium-style ``reset``/``step`` environment; gymnasium itself is imported only
if you pass an environment id) and ``ToolEnv`` (turns with tool calls get the tools' outputs).
"""

from __future__ import annotations

import asyncio
import inspect
import threading
from collections.abc import Callable
from typing import Any, Protocol

from meshrl.rewards.tools import Tools
from meshrl.workflows.tool_calls import ToolCallError, get_parser

Observation = str | list[dict[str, Any]] | None
StepResult = tuple[Observation, float | None, bool]


class AgentEnv(Protocol):
    async def reset(self, example: dict) -> Observation: ...

    async def step(self, action: str) -> StepResult: ...


EnvFactory = Callable[[], AgentEnv]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


async def close_env(env: Any) -> None:
    """The environment's optional ``close()``, run to its end even when the episode was
    cancelled."""
    close = getattr(env, "close", None)
    if close is not None:
        await asyncio.shield(_maybe_await(close()))


class FunctionEnv:
    """``step_fn(example, action, turn) -> (observation, reward, done)``, sync or async, and an
    optional ``reset_fn(example) -> observation``: an environment without a class."""

    def __init__(self, step_fn: Callable[..., Any],
                 reset_fn: Callable[[dict], Any] | None = None) -> None:
        self.step_fn, self.reset_fn = step_fn, reset_fn
        self.example: dict = {}
        self.turn = 0

    async def reset(self, example: dict) -> Observation:
        self.example, self.turn = example, 0
        return None if self.reset_fn is None else await _maybe_await(self.reset_fn(example))

    async def step(self, action: str) -> StepResult:
        out = await _maybe_await(self.step_fn(self.example, action, self.turn))
        self.turn += 1
        observation, reward, done = out
        return observation, reward, bool(done)


class GymEnv:
    """A gymnasium-style environment (``reset(seed=) -> (obs, info)``, ``step(a) -> (obs,
    reward, terminated, truncated, info)``) driven by text: ``parse_action(text)`` turns the
    model's turn into an action (raise ``ValueError`` for an invalid one: the model is told and
    gets ``invalid_reward``; the episode goes on) and ``render(obs)`` an observation into text.
    ``make``: a factory or a registered gymnasium id. Its calls run in a worker thread, so a
    slow simulator never blocks the event loop. The example's ``seed_key`` column seeds reset."""

    def __init__(self, make: Callable[[], Any] | str, *, parse_action: Callable[[str], Any],
                 render: Callable[[Any], str] = str, seed_key: str = "seed",
                 invalid_reward: float = 0.0) -> None:
        if isinstance(make, str):
            env_id = make

            def make() -> Any:
                import gymnasium  # an optional dependency: only for registered ids

                return gymnasium.make(env_id)
        self.make, self.parse_action, self.render = make, parse_action, render
        self.seed_key, self.invalid_reward = seed_key, invalid_reward
        self.env: Any = None
        # A cancelled episode's simulator call runs on in its thread: every call holds this, so
        # ``close`` waits for it (simulators are not safe to close mid-step).
        self._busy = threading.Lock()

    def _start(self, seed: int | None) -> Any:
        with self._busy:
            self.env = self.make()
            return self.env.reset(seed=seed)

    def _step(self, action: Any) -> Any:
        with self._busy:
            return self.env.step(action)

    def _close(self) -> None:
        with self._busy:
            env, self.env = self.env, None
            if env is not None and hasattr(env, "close"):
                env.close()

    async def reset(self, example: dict) -> Observation:
        seed = example.get(self.seed_key)
        obs, _ = await asyncio.to_thread(self._start, None if seed is None else int(seed))
        return self.render(obs)

    async def step(self, action: str) -> StepResult:
        try:
            act = self.parse_action(action)
        except ValueError as e:
            return f"invalid action: {e}", self.invalid_reward, False
        obs, reward, terminated, truncated, _ = await asyncio.to_thread(self._step, act)
        return self.render(obs), float(reward), bool(terminated or truncated)

    async def close(self) -> None:
        await asyncio.to_thread(self._close)


class ToolEnv:
    """Tool use: a turn with tool calls (format ``parser``, ``workflows/tool_calls.py``) gets
    one ``tool`` message per call with its output or error; a turn without calls ends the
    episode (reward None: the reward pool scores that final answer). ``calls`` records every
    call of the episode for ``episodes.jsonl``."""

    def __init__(self, tools: Tools, parser: str = "hermes") -> None:
        self.tools, self.parse = tools, get_parser(parser)
        self.calls: list[dict[str, Any]] = []

    async def reset(self, example: dict) -> Observation:
        self.calls = []
        return None

    async def step(self, action: str) -> StepResult:
        turn = self.parse(action)
        if not turn.calls:
            return None, None, True
        messages = []
        for call in turn.calls:
            if isinstance(call, ToolCallError):
                self.tools.counters["malformed"] += 1
                record = {"name": None, "arguments": None, "ok": False,
                          "output": f"error: malformed tool call: {call.message}"}
            else:
                out = await self.tools.acall(call.name, call.arguments)
                record = {"name": call.name, "arguments": call.arguments, "ok": out.ok,
                          "output": out.text}
            self.calls.append(record)
            messages.append({"role": "tool", "name": record["name"] or "",
                             "content": record["output"]})
        return messages, None, False


def tool_env_factory(tools: Tools, parser: str = "hermes") -> EnvFactory:
    """A factory of ``ToolEnv``s sharing ``tools`` (and its sandbox)."""
    return lambda: ToolEnv(tools, parser)
