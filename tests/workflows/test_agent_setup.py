"""The ``agent`` config section: validation, every field taking effect, the calculator task's
traces, and held-out evaluation through agent episodes."""

from __future__ import annotations

import asyncio
import json

import pytest

from meshrl.configs.agent_schema import TOOL_NAMES
from meshrl.configs.fields import ConfigError
from meshrl.configs.loader import base_config, from_config_dict
from meshrl.datasets.agent_calc import trace, write_task
from meshrl.models.tokenizer import CharTokenizer
from meshrl.rewards.math_answer import math_reward
from meshrl.rewards.tools import BUILTIN_TOOLS
from meshrl.tests.workflows.agent_fakes import ScriptedSampler
from meshrl.workflows.agent_eval import aevaluate_agent
from meshrl.workflows.agent_setup import EnvLoadError, agent_spec, load_env_factory
from meshrl.workflows.episode import EpisodeSettings
from meshrl.workflows.tool_calls import ToolCall, get_parser


def config(**agent):
    cfg = base_config("rl")
    cfg.sampler.prompt_buckets = (16, 31)
    cfg.sampler.max_len = 32
    cfg.trainer.seq_len = 32
    cfg.data.max_prompt_len = 16
    for k, v in agent.items():
        cfg.agent[k] = v
    cfg.rollout.max_turns = 2 if cfg.agent.env else 1
    return from_config_dict(cfg)


def test_config_tool_names_are_the_built_in_tools():
    assert set(TOOL_NAMES) == set(BUILTIN_TOOLS)


@pytest.mark.parametrize("agent,needle", [
    ({"env": "gym"}, "agent.env = 'gym'"),
    ({"env": "tools", "tools": ("shell",)}, "agent.tools"),
    ({"env": "tools", "tools": ()}, "needs at least one tool"),
    ({"env": "", "sft_traces": True}, "need agent.env = 'tools'"),
    ({"env": "tools", "tools": ("python",), "sft_traces": True},
     r"agent.tools = \('python',\): agent.sft_traces teaches calls to the calculator"),
])
def test_bad_agent_fields_fail_with_the_field_and_the_rule(agent, needle):
    with pytest.raises(ConfigError, match=needle):
        config(**agent)


def test_multi_turn_agents_need_a_prompt_bucket_for_the_whole_context():
    cfg = base_config("rl")
    cfg.agent.env, cfg.rollout.max_turns = "tools", 2
    cfg.trainer.seq_len = cfg.sampler.max_len = 64
    cfg.sampler.prompt_buckets = (32,)
    cfg.data.max_prompt_len = 32
    with pytest.raises(ConfigError, match="add a bucket of at least 63"):
        from_config_dict(cfg)


def test_sft_traces_need_the_synthetic_arithmetic_task():
    cfg = base_config("rl")
    cfg.agent.update(env="tools", sft_traces=True)
    cfg.data.update(source="countdown")
    with pytest.raises(ConfigError, match="agent.sft_traces writes calculator traces"):
        from_config_dict(cfg)


def test_agent_spec_applies_every_field(tmp_path):
    c = config(env="tools", tools=("calculator", "python"), tool_format="llama3",
               turn_stop="\n", tool_timeout_s=1.5, tool_cpu_s=2, tool_memory_mb=128,
               tool_output_bytes=99)
    spec = agent_spec(c, CharTokenizer(), workdir=tmp_path)
    limits = spec.tools.sandbox.limits
    assert (limits.wall_s, limits.cpu_s, limits.memory_mb, limits.output_bytes) == (
        1.5, 2, 128, 99)
    assert set(spec.tools.specs) == {"calculator", "python"}
    assert spec.stop_ids == (ord("\n"),)
    assert spec.env_factory().parse is get_parser("llama3")
    assert spec.log.path == str(tmp_path / "episodes.jsonl")
    assert spec.max_staleness == c.rollout.max_staleness
    assert agent_spec(config(env="tools", episodes_log=False), CharTokenizer(),
                      workdir=tmp_path).log is None
    assert agent_spec(config(env=""), CharTokenizer()) is None


def test_turn_stop_of_several_tokens_is_a_config_error():
    with pytest.raises(ConfigError, match="agent.turn_stop = 'ab'.*2 tokens"):
        agent_spec(config(env="tools", turn_stop="ab"), CharTokenizer())


def test_user_env_factories_load_by_name_and_bad_names_say_why():
    make = load_env_factory("meshrl.tests.workflows.user_env:make")
    assert hasattr(make(), "step")
    with pytest.raises(EnvLoadError, match="cannot import"):
        load_env_factory("meshrl.no_such_module:make")
    with pytest.raises(EnvLoadError, match="no callable 'nope'"):
        load_env_factory("meshrl.tests.workflows.user_env:nope")


def test_calculator_traces_parse_as_calls_and_score_as_the_answer(tmp_path):
    ex = {"prompt": "12*34=", "answer": "408"}
    call, response, final = trace(ex).split("\n")
    assert get_parser("hermes")(call).calls == (ToolCall("calculator", {"expression": "12*34"}),)
    assert response == "<tool_response>408</tool_response>"
    # The reward reads the trace's answer after '####' and the model's final number.
    assert math_reward([""], [final], answer=[trace(ex)]) == [1.0]
    assert math_reward([""], ["#### 407"], answer=[trace(ex)]) == [0.0]
    c = config(env="tools", sft_traces=True)
    train, held_out = write_task(c.data, tmp_path)
    rows = [json.loads(x) for x in open(train)]
    assert len(rows) == c.data.num_examples and rows[0]["answer"].startswith("<tool_call>")
    held = [json.loads(x)["question"] for x in open(held_out)]
    assert len(held) == c.data.eval_examples
    # Held out: distinct prompts, none of them trained on.
    assert len(set(held)) == len(held) and not set(held) & {r["question"] for r in rows}


class _Pool:
    names = ["math"]

    def score_components(self, prompts, completions, answer, **_):
        return {"math": math_reward(prompts, completions, answer=answer)}


def test_agent_evaluation_runs_the_tool_episode_greedily_and_scores_the_final_turn():
    tok = CharTokenizer()
    ex = {"prompt": "12*34=", "answer": trace({"prompt": "12*34=", "answer": "408"}),
          "prompt_ids": [tok.bos_id] + tok.encode("12*34=")}
    call = trace({"prompt": "12*34=", "answer": "408"}).split("\n")[0] + "\n"
    sampler = ScriptedSampler([tok.encode(call), tok.encode("#### 408") + [tok.eos_id]])
    spec = agent_spec(config(env="tools", turn_stop="\n"), tok)

    async def go():
        try:
            return await aevaluate_agent(sampler, _Pool(), [ex], version=0, spec=spec,
                                         settings=EpisodeSettings(max_turns=2,
                                                                  stop_ids=(tok.eos_id,)),
                                         decode=tok.decode)
        finally:
            await spec.tools.aclose()
    ev = asyncio.run(go())
    assert ev["eval/greedy_accuracy"] == 1.0 and ev["eval/tool_call_rate"] == 1.0
    assert ev["eval/reward_mean"] == 1.0 and ev["eval/turns"] == 2.0
    assert all(r.request.temperature == 0.0 for r in sampler.completions)


def test_agent_evaluation_with_weights_changing_mid_episode_raises_even_with_a_staleness_bound():
    from meshrl.workflows.agent import AgentSpec
    from meshrl.workflows.environment import FunctionEnv
    from meshrl.workflows.evaluate import EvalVersionError
    from meshrl.workflows.render import TurnRenderer

    tok = CharTokenizer()
    ex = {"prompt": "1+1=", "answer": "2", "prompt_ids": [tok.bos_id] + tok.encode("1+1=")}

    def handoff(turn):
        sampler.version += 1  # the trainer publishes during the evaluation
    sampler = ScriptedSampler([tok.encode("hmm") + [tok.eos_id], tok.encode("2") + [tok.eos_id]],
                              after_turn=handoff)
    # rollout.max_staleness = 0 on the spec, as agent_spec builds it for the RL job.
    spec = AgentSpec(lambda: FunctionEnv(lambda ex, action, turn: ("again", None, turn >= 1)),
                     TurnRenderer(tok), max_staleness=0)

    with pytest.raises(EvalVersionError, match="got tokens of versions \\[1\\]"):
        asyncio.run(aevaluate_agent(sampler, _Pool(), [ex], version=0, spec=spec,
                                    settings=EpisodeSettings(max_turns=2, stop_ids=(tok.eos_id,)),
                                    decode=tok.decode))


def test_the_rl_runner_reports_agent_and_tool_counts_bad_calls_included():
    from meshrl.tests.workflows.agent_fakes import ConstRewards
    from meshrl.workflows.setup import make_runner

    tok = CharTokenizer()
    cfg = base_config("rl")
    cfg.sampler.update(prompt_buckets=(16, 255), max_len=256, max_new_tokens=128)
    cfg.trainer.seq_len = 256
    cfg.data.max_prompt_len = 16
    cfg.rollout.update(max_turns=2, group_size=1)
    cfg.rl.advantage = "reinforce_pp"  # a group of one has no GRPO advantage
    cfg.agent.update(env="tools", turn_stop="\n")
    bad = '<tool_call>{"name":"nope","arguments":{}}</tool_call><tool_call>{oops</tool_call>\n'
    sampler = ScriptedSampler([tok.encode(bad), tok.encode("#### 6") + [tok.eos_id]])
    runner = make_runner(from_config_dict(cfg), sampler, ConstRewards(), iter([]), tok)
    item = {"prompt": "2*3=", "prompt_ids": [tok.bos_id] + tok.encode("2*3="), "answer": "6"}

    async def go():
        try:
            return await runner.group_fn(item, 0)
        finally:
            for source in runner.metric_sources:
                await source.__self__.tools.aclose()
    group = asyncio.run(go())

    assert group is not None
    metrics = runner.metrics()
    assert metrics["tools/invalid"] == 1.0 and metrics["tools/malformed"] == 1.0
    assert metrics["tools/calls"] == 0.0  # neither reached the sandbox
