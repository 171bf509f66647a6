"""The environment API's adapters (plain functions, gymnasium-style environments, tools), and
an environment written only against the documented API training in the RL job."""

from __future__ import annotations

import asyncio
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import pytest

from meshrl.models.tokenizer import CharTokenizer
from meshrl.rewards.tools import Tools
from meshrl.tests.workflows.agent_fakes import ConstRewards, ScriptedSampler
from meshrl.workflows import EpisodeSettings, arun_episode
from meshrl.workflows.agent import AgentSpec
from meshrl.workflows.environment import FunctionEnv, GymEnv, ToolEnv
from meshrl.workflows.render import TurnRenderer

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_function_env_accepts_sync_and_async_step_functions():
    async def astep(example, action, turn):
        return f"seen {action}", 0.5, turn >= 1

    async def go():
        sync = FunctionEnv(lambda ex, a, t: (None, 1.0, True), reset_fn=lambda ex: "start")
        first = await sync.reset({"prompt": "p"})
        out = [await sync.step("a")]
        env = FunctionEnv(astep)
        await env.reset({})
        out += [await env.step("x"), await env.step("y")]
        return first, out
    first, out = asyncio.run(go())
    assert first == "start"
    assert out == [(None, 1.0, True), ("seen x", 0.5, False), ("seen y", 0.5, True)]


def test_gym_env_drives_a_gymnasium_environment_by_text_and_reports_invalid_actions():
    pytest.importorskip("gymnasium")

    def parse(text: str) -> int:
        if text.strip() not in ("0", "1", "2", "3"):
            raise ValueError(f"{text!r} is not a move 0-3")
        return int(text)

    async def go():
        env = GymEnv("FrozenLake-v1", parse_action=parse, render=lambda s: f"state {s}")
        first = await env.reset({"seed": 3})
        bad = await env.step("jump")
        moved = await env.step("2")
        return first, bad, moved
    first, bad, moved = asyncio.run(go())
    assert first == "state 0"
    assert bad == ("invalid action: 'jump' is not a move 0-3", 0.0, False)
    assert moved[0].startswith("state ") and moved[1] in (0.0, 1.0)


class _Simulator:
    """A gymnasium-style simulator that never ends an episode itself, counting opens/closes."""

    opened = closed = 0

    def __init__(self) -> None:
        type(self).opened += 1

    def reset(self, seed=None):
        return 0, {}

    def step(self, action):
        return 1, 0.0, False, False, {}

    def close(self) -> None:
        type(self).closed += 1


def _gym_episode(simulator: type, cancel_when: Any = None) -> Any:
    """One agent episode of up to 3 turns over ``GymEnv(simulator)``, cancelled once
    ``cancel_when(sampler)`` holds (None: run to its end); its result or its exception."""
    tok = CharTokenizer()
    item = {"prompt": "go", "prompt_ids": [tok.bos_id] + tok.encode("go")}
    sampler = ScriptedSampler([tok.encode("1") + [tok.eos_id]] * 3)
    spec = AgentSpec(lambda: GymEnv(simulator, parse_action=int), TurnRenderer(tok))

    async def go():
        episode = asyncio.create_task(arun_episode(
            sampler, item, reward_pool=ConstRewards(), decode=tok.decode, agent=spec,
            settings=EpisodeSettings(max_turns=3, stop_ids=(tok.eos_id,))))
        if cancel_when is not None:
            while not cancel_when(sampler):
                await asyncio.sleep(0)
            episode.cancel()
        return await asyncio.gather(episode, return_exceptions=True)

    return asyncio.run(go())[0]


@pytest.mark.parametrize("how", ["out_of_turns", "cancelled"])
def test_an_environment_is_closed_however_its_episode_ends(how, monkeypatch):
    monkeypatch.setattr(_Simulator, "opened", 0)
    monkeypatch.setattr(_Simulator, "closed", 0)

    out = _gym_episode(_Simulator, (lambda sampler: sampler.requests)  # in its first turn
                       if how == "cancelled" else None)

    if how == "cancelled":
        assert isinstance(out, asyncio.CancelledError)
    else:
        assert out.finish_reason == "length"
    assert _Simulator.opened == _Simulator.closed == 1


def test_malformed_and_failing_tool_calls_become_error_observations_and_the_episode_goes_on():
    tok = CharTokenizer()
    item = {"prompt": "q", "prompt_ids": [tok.bos_id] + tok.encode("q"), "answer": "2"}
    turns = ['<tool_call>{"name": "calculator", </tool_call>\n',
             '<tool_call>{"name": "calculator", "arguments": {"expression": "1/0"}}'
             '</tool_call>\n', "2"]
    sampler = ScriptedSampler([tok.encode(t) for t in turns])

    async def go():
        async with Tools(["calculator"]) as tools:
            envs = []

            def factory():
                envs.append(ToolEnv(tools))
                return envs[-1]
            spec = AgentSpec(factory, TurnRenderer(tok), stop_ids=(ord("\n"),))
            traj = await arun_episode(sampler, item, reward_pool=ConstRewards(),
                                      decode=tok.decode, agent=spec,
                                      settings=EpisodeSettings(max_turns=3,
                                                               stop_ids=(tok.eos_id,)))
            return traj, envs[0].calls
    traj, calls = asyncio.run(go())
    assert traj is not None and traj.reward == 1.0
    assert [c["ok"] for c in calls] == [False, False]
    assert "malformed tool call: not valid JSON" in calls[0]["output"]
    assert "division by zero" in calls[1]["output"]
    assert "<tool_response>error: malformed" in tok.decode(traj.completion_ids)


def _env() -> dict[str, str]:
    return {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
            "JAX_PLATFORMS": "cpu"}


@pytest.mark.slow  # the RL job end to end: about a minute on 2 CPU cores
def test_an_env_written_only_against_the_documented_api_trains_in_the_rl_job(tmp_path):
    workdir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "main.py"),
           "--config", str(ROOT / "configs/default.py:smoke"), f"--workdir={workdir}",
           "--config.agent.env=meshrl.tests.workflows.user_env:make",
           "--config.rollout.max_turns=2", "--config.sampler.prompt_buckets=(16, 31)",
           "--config.trainer.steps=2", "--config.rl.warm_start_steps=2",
           "--config.trainer.eval_every=0", "--config.data.eval_examples=4"]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["rollout_counters"]["accepted_groups"] >= 8
    episodes = [json.loads(x) for x in (workdir / "episodes.jsonl").read_text().splitlines()]
    assert len(episodes) >= 16
    retried = [e for e in episodes if len(e["turns"]) == 3]
    assert retried and retried[0]["turns"][1]["text"].startswith("no, ")
    assert {v for e in episodes for t in e["turns"] for v in t.get("versions", [])} <= {0, 1, 2}


@pytest.mark.slow  # two RL runs (with and without tools) end to end: about a minute
def test_agent_calc_smoke_job_writes_both_accuracies_and_the_episode_log(tmp_path):
    workdir = tmp_path / "agent"
    cmd = [sys.executable, str(ROOT / "main.py"),
           "--config", str(ROOT / "configs/agent_calc.py:smoke"), f"--workdir={workdir}"]
    out = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads((workdir / "summary.json").read_text())
    assert {"accuracy_after", "accuracy_without_tools"} <= summary.keys()
    assert (workdir / "no_tools" / "summary.json").exists()
    assert (workdir / "episodes.jsonl").read_text().count("\n") >= 8


def test_generate_job_with_an_env_writes_one_episode_per_prompt_and_keeps_earlier_runs(
        tmp_path):
    from meshrl.configs import generate as generate_config
    from meshrl.configs.loader import from_config_dict
    from meshrl.jobs import generate

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                               for p, a in (("1+1=", "2"), ("2+3=", "5"))))
    cfg = generate_config.get_config()
    cfg.data.update(source="jsonl", path=str(prompts), max_prompt_len=16)
    cfg.sampler.update(max_new_tokens=4, max_len=32, prompt_buckets=(16, 31))
    cfg.trainer.seq_len = 32
    cfg.rollout.max_turns = 2
    cfg.agent.env = "meshrl.tests.workflows.user_env:make"
    def prompts_in(name):
        return sorted(json.loads(x)["prompt"] for x in (tmp_path / name).read_text().splitlines())

    generate.run(from_config_dict(cfg), str(tmp_path))
    episodes = [json.loads(x) for x in (tmp_path / "episodes.jsonl").read_text().splitlines()]
    assert sorted(e["prompt"] for e in episodes) == ["1+1=", "2+3="]
    for e in episodes:
        assert e["turns"][0]["role"] == "assistant" and e["turns"][0]["versions"] == [0]
        assert len([t for t in e["turns"] if t["role"] == "assistant"]) in (1, 2)
    assert not (tmp_path / "samples.jsonl").exists()

    generate.run(from_config_dict(cfg), str(tmp_path))  # a rerun keeps the first file
    assert prompts_in("episodes.jsonl") == prompts_in("episodes-1.jsonl") == ["1+1=", "2+3="]
    cfg.generate.overwrite = True
    generate.run(from_config_dict(cfg), str(tmp_path))
    assert prompts_in("episodes.jsonl") == ["1+1=", "2+3="]
    assert not (tmp_path / "episodes-2.jsonl").exists()


def test_generate_with_an_env_keeps_only_prompts_its_episodes_have_room_for():
    from meshrl.configs import generate as generate_config
    from meshrl.configs.loader import from_config_dict
    from meshrl.jobs import generate

    cfg = generate_config.get_config()
    cfg.data.max_prompt_len = 16
    cfg.sampler.update(max_len=32, prompt_buckets=(16, 31))
    cfg.trainer.seq_len = 12
    plain = from_config_dict(cfg)
    cfg.rollout.max_turns = 2
    cfg.agent.env = "meshrl.tests.workflows.user_env:make"

    assert generate.prompt_limit(plain) == 16  # one completion: the sampler's own length
    assert generate.prompt_limit(from_config_dict(cfg)) == 11  # the episode's, less one


def test_a_cancelled_episode_closes_its_simulator_only_after_the_step_in_its_thread():
    import threading

    events: list[str] = []
    stepping = threading.Event()

    class SlowSimulator:
        in_step = False

        def reset(self, seed=None):
            return 0, {}

        def step(self, action):
            self.in_step = True
            stepping.set()
            time.sleep(0.3)  # a slow physics step; a cancelled thread call runs on
            self.in_step = False
            return 1, 0.0, False, False, {}

        def close(self):
            events.append(f"close during a step: {self.in_step}")

    out = _gym_episode(SlowSimulator, lambda sampler: stepping.is_set())

    assert isinstance(out, asyncio.CancelledError)
    assert events == ["close during a step: False"]
