"""Agent episodes are token in, token out: the trainer's batch holds exactly the sampler's ids,
observations are rendered incrementally from the real chat template (equal to rendering the
whole conversation where the template allows), never trained on, and versions and the
staleness bound hold across turns."""

from __future__ import annotations

import asyncio
import collections
import json

import numpy as np
import pytest

from meshrl.models.tokenizer import CharTokenizer
from meshrl.rewards.tools import Tools
from meshrl.tests.workflows.agent_fakes import (
    DRIFTING_TEMPLATE,
    QWEN3_THINK_TEMPLATE,
    ConstRewards,
    ScriptedSampler,
    qwen_tokenizer,
)
from meshrl.workflows import EpisodeSettings, arun_episode, arun_group, build_rl_batch
from meshrl.workflows.agent import AgentSpec, EpisodeLog
from meshrl.workflows.environment import FunctionEnv, tool_env_factory
from meshrl.workflows.render import TemplateDriftError, TurnRenderer

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*456"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return qwen_tokenizer(tmp_path_factory.mktemp("qwen"))


def messages_prompt(tok) -> tuple[list[dict], dict]:
    messages = [{"role": "user", "content": "What is 123*456?"}]
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    return messages, {"prompt": "What is 123*456?", "prompt_ids": ids, "answer": "56088"}


async def _episode_with_tools(tok, sampler, *, max_staleness=None, log=None, max_len=None):
    _, item = messages_prompt(tok)
    settings = EpisodeSettings(max_turns=4, stop_ids=tok.stop_ids, max_total_len=max_len)
    async with Tools(["calculator"]) as tools:
        spec = AgentSpec(tool_env_factory(tools), TurnRenderer(tok),
                         max_staleness=max_staleness, log=log)
        traj = await arun_episode(sampler, item, reward_pool=ConstRewards(), decode=tok.decode,
                                  settings=settings, agent=spec)
    return traj, spec, item


def two_turns(tok) -> list[list[int]]:
    return [tok.encode(CALL) + [tok.eos_id], tok.encode("The answer is 56088.") + [tok.eos_id]]


def test_trainer_batch_holds_exactly_the_sampler_ids_across_a_weight_handoff(tok, tmp_path):
    def handoff(turn):  # the trainer publishes version 1 between the two turns
        sampler.version += 1
    sampler = ScriptedSampler(two_turns(tok), after_turn=handoff)
    log = EpisodeLog(tmp_path / "episodes.jsonl")
    traj, _, item = asyncio.run(_episode_with_tools(tok, sampler, log=log))

    context = traj.prompt_ids + traj.completion_ids
    last = sampler.completions[-1]
    assert context == list(last.request.prompt_ids) + last.tokens  # no re-tokenization
    batch = build_rl_batch([[traj]], length_buckets=(len(context),), advantage=None)
    assert [int(x) for x in batch.input_ids[0]] == context
    assert [int(x) for x in batch.targets[0, :-1]] == context[1:]
    # Each target the model sampled has mask 1, its logprob and its turn's version;
    # every observation token has mask 0 and version -1.
    turn1, turn2 = sampler.completions
    # A later turn is admitted ahead of queued first turns (fresh episodes).
    assert [c.request.priority for c in sampler.completions] == [0, 1]
    p, n1 = len(item["prompt_ids"]), len(turn1.tokens)
    obs = len(turn2.request.prompt_ids) - p - n1
    end = p - 1 + len(traj.completion_ids)  # the last column's target is padding
    mask = batch.loss_mask[0, p - 1:end]
    assert list(mask) == [1] * n1 + [0] * obs + [1] * len(turn2.tokens)
    assert list(batch.versions[0, p - 1:end]) == [0] * n1 + [-1] * obs + [1] * len(
        turn2.tokens)
    np.testing.assert_allclose(batch.behaviour_logprobs[0, p - 1:p - 1 + n1], turn1.logprobs,
                               rtol=1e-6, atol=1e-6)
    assert traj.oldest_version == 0
    record = json.loads((tmp_path / "episodes.jsonl").read_text())
    assert record["tool_calls"] == [{"name": "calculator", "arguments": {
        "expression": "123*456"}, "ok": True, "output": "56088"}]
    assert [t["versions"] for t in record["turns"] if t["role"] == "assistant"] == [[0], [1]]


def _assert_context_is_the_whole_rendering(tok, traj) -> None:
    """The episode's ids are the whole conversation's rendering, up to what closes the last
    turn after the end-of-turn token the model stopped on ("\n" in ChatML)."""
    messages, _ = messages_prompt(tok)
    messages += [{"role": "assistant", "content": CALL}, {"role": "tool", "content": "56088"},
                 {"role": "assistant", "content": "The answer is 56088."}]
    whole = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=False))
    context = traj.prompt_ids + traj.completion_ids
    assert whole[:len(context)] == context and tok.decode(whole[len(context):]) == "\n"


def test_incremental_rendering_equals_rendering_the_whole_conversation(tok):
    sampler = ScriptedSampler(two_turns(tok))
    traj, _, _ = asyncio.run(_episode_with_tools(tok, sampler))
    _assert_context_is_the_whole_rendering(tok, traj)


def test_a_turn_ended_on_a_generation_config_stop_id_is_closed_once(tmp_path):
    # EOS is <|endoftext|>; the template closes turns with <|im_end|>, a stop id only
    # generation_config.json lists (as some Llama 3 releases ship <|eot_id|>).
    tok = qwen_tokenizer(tmp_path / "qwen", eos_token="<|endoftext|>")
    (im_end,) = tok.encode("<|im_end|>")
    (tmp_path / "qwen" / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [tok.eos_id, im_end]}))
    tok = type(tok)(str(tmp_path / "qwen"))
    sampler = ScriptedSampler([tok.encode(CALL) + [im_end],
                               tok.encode("The answer is 56088.") + [im_end]])

    traj, _, _ = asyncio.run(_episode_with_tools(tok, sampler))

    _assert_context_is_the_whole_rendering(tok, traj)


def test_a_turn_ended_on_a_token_other_than_a_stop_id_gets_the_end_of_turn_from_the_template(
        tok):
    (im_end,) = tok.encode("<|im_end|>")
    (close,) = tok.encode("\n")[-1:]  # an ordinary token the model ended its turn with
    renderer = TurnRenderer(tok)
    observation = [{"role": "tool", "content": "1"}]

    after_stop = renderer.observation_ids(observation, last_token=im_end)
    after_other = renderer.observation_ids(observation, last_token=close)

    assert tok.eos_id == im_end and after_other == [im_end, *after_stop]


def test_an_episode_whose_environment_speaks_first_starts_with_bos_as_the_pipeline_does(
        tmp_path):
    from meshrl.datasets.render import encode_prompt, prompt_text

    # A BOS the template never writes: the pipeline prepends it, and so must the episode.
    tok = qwen_tokenizer(tmp_path / "qwen", bos_token="<|endoftext|>")
    ex = {"prompt": "What is 2+2?"}
    ex["prompt_ids"] = encode_prompt(prompt_text(ex, tok), tok)
    renderer = TurnRenderer(tok)

    first = renderer.prompt_ids(ex, "You have 3 tries.")

    assert renderer.prompt_ids(ex, None)[0] == first[0] == tok.bos_id
    assert first.count(tok.bos_id) == 1


def test_tool_messages_in_a_row_render_as_the_template_groups_them(tok):
    renderer = TurnRenderer(tok)
    ids = renderer.observation_ids([{"role": "tool", "content": "1"},
                                    {"role": "tool", "content": "2"}], last_token=tok.eos_id)
    base = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    new = [{"role": "tool", "content": "1"}, {"role": "tool", "content": "2"}]
    before = tok.apply_chat_template(base, add_generation_prompt=False)
    after = tok.apply_chat_template(base + new, add_generation_prompt=True)
    # stopped on EOS: the ids start after the EOS the model sampled ("\n" in ChatML)
    assert tok.encode(before)[:-1] + ids == tok.encode(after)


def test_sampled_ids_are_kept_even_when_they_are_not_the_canonical_tokenization(tok):
    text = "56088"
    odd = [i for ch in text for i in tok.encode(ch)] + [tok.eos_id]  # one id per digit
    sampler = ScriptedSampler([tok.encode(CALL) + [tok.eos_id], odd])
    traj, _, _ = asyncio.run(_episode_with_tools(tok, sampler))
    assert traj.completion_ids[-len(odd):] == odd


def test_a_turn_that_went_stale_stops_the_episode_and_rejects_it(tok):
    def handoff(turn):
        sampler.version += 2  # two versions pass during the first turn
    sampler = ScriptedSampler(two_turns(tok), after_turn=handoff)
    traj, spec, _ = asyncio.run(_episode_with_tools(tok, sampler, max_staleness=1))
    assert traj is None and spec.counters["stale_episodes"] == 1
    assert len(sampler.requests) == 1  # no turn was spent on a sample that cannot train


def test_total_token_budget_ends_the_episode_with_length(tok):
    sampler = ScriptedSampler(two_turns(tok))
    _, item = messages_prompt(tok)
    limit = len(item["prompt_ids"]) + len(two_turns(tok)[0]) + 3  # no room for the answer
    traj, _, _ = asyncio.run(_episode_with_tools(tok, sampler, max_len=limit))
    assert traj.finish_reason == "length" and len(traj) <= limit


def test_an_episode_out_of_turns_mid_tool_use_ends_with_length_and_scores_no_answer(tok):
    # The model calls the tool in every turn: its last turn is no final answer.
    call = tok.encode(CALL) + [tok.eos_id]
    sampler = ScriptedSampler([call, call])
    _, item = messages_prompt(tok)
    rewards = ConstRewards(1.0)

    async def run():
        async with Tools(["calculator"]) as tools:
            spec = AgentSpec(tool_env_factory(tools), TurnRenderer(tok))
            return await arun_episode(sampler, item, reward_pool=rewards, decode=tok.decode,
                                      settings=EpisodeSettings(max_turns=2,
                                                               stop_ids=(tok.eos_id,)),
                                      agent=spec)
    traj = asyncio.run(run())

    assert traj.finish_reason == traj.metadata["episode"]["finish_reason"] == "length"
    assert rewards.seen == [""]


def test_a_turn_ended_on_a_turn_stop_id_keeps_the_templates_end_of_turn(tok):
    # agent.turn_stop: the turn ends on the call's last id, not on EOS (<|im_end|>), so the
    # observation must close the turn with the template's end token itself.
    call = tok.encode(CALL)
    sampler = ScriptedSampler([call, tok.encode("56088") + [tok.eos_id]])
    messages, item = messages_prompt(tok)

    async def run():
        async with Tools(["calculator"]) as tools:
            spec = AgentSpec(tool_env_factory(tools), TurnRenderer(tok), stop_ids=(call[-1],))
            return await arun_episode(sampler, item, reward_pool=ConstRewards(),
                                      decode=tok.decode, agent=spec,
                                      settings=EpisodeSettings(max_turns=3,
                                                               stop_ids=(tok.eos_id,)))
    traj = asyncio.run(run())

    whole = tok.apply_chat_template(messages + [{"role": "assistant", "content": CALL},
                                                {"role": "tool", "content": "56088"}],
                                    add_generation_prompt=True)
    assert traj.prompt_ids + traj.completion_ids[:-len(tok.encode("56088")) - 1] == \
        tok.encode(whole)


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_reason(tmp_path):
    drifting = qwen_tokenizer(tmp_path / "drift", DRIFTING_TEMPLATE)
    with pytest.raises(TemplateDriftError, match="renders earlier turns differently"):
        TurnRenderer(drifting)  # at construction: before a job samples anything


def test_a_template_that_rewrites_the_assistant_turn_before_its_content_renders_turn_by_turn(
        tmp_path):
    # Qwen3: the last assistant turn opens with an empty <think> block, an earlier one without:
    # the observation is what follows the model's own turn either way.
    qwen3 = qwen_tokenizer(tmp_path / "qwen3", QWEN3_THINK_TEMPLATE)

    ids = TurnRenderer(qwen3).observation_ids([{"role": "tool", "content": "42"}],
                                              last_token=qwen3.eos_id)

    want = qwen3.encode("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response>"
                        "<|im_end|>\n<|im_start|>assistant\n")
    assert want[0] == qwen3.eos_id and ids == want[1:]


def test_plain_tokenizer_keeps_its_eos_between_turns_and_masks_tool_responses():
    tok = CharTokenizer()
    item = {"prompt": "12*34=", "prompt_ids": [tok.bos_id] + tok.encode("12*34="),
            "answer": "408"}
    env = FunctionEnv(lambda ex, action, turn: ("408", None, turn >= 1))
    sampler = ScriptedSampler([tok.encode("calc") + [tok.eos_id],
                               tok.encode("408") + [tok.eos_id]])
    spec = AgentSpec(lambda: env, TurnRenderer(tok))
    rewards = ConstRewards(1.0)
    traj = asyncio.run(arun_episode(sampler, item, reward_pool=rewards, decode=tok.decode,
                                    settings=EpisodeSettings(max_turns=3,
                                                             stop_ids=(tok.eos_id,)),
                                    agent=spec))
    observation = tok.encode("408\n")  # a user observation: its text and a newline
    assert traj.completion_ids == (tok.encode("calc") + [tok.eos_id] + observation
                                   + tok.encode("408") + [tok.eos_id])
    assert traj.loss_mask == [1] * 5 + [0] * len(observation) + [1] * 4
    assert rewards.seen == ["408"]  # the pool scores the final turn only


def test_groups_of_agent_episodes_share_one_environment_factory_per_sample(tok):
    made = collections.Counter()

    def factory():
        made["envs"] += 1
        return FunctionEnv(lambda ex, action, turn: (None, 1.0 if turn == 0 else 0.0, True))
    sampler = ScriptedSampler([tok.encode("hi") + [tok.eos_id]])
    _, item = messages_prompt(tok)
    group = asyncio.run(arun_group(
        sampler, item, group_size=3, group_id=5, filter_equal=False, reward_pool=ConstRewards(),
        decode=tok.decode, settings=EpisodeSettings(stop_ids=(tok.eos_id,)),
        agent=AgentSpec(factory, TurnRenderer(tok))))
    assert made["envs"] == 3 and [t.reward for t in group] == [1.0, 1.0, 1.0]
