"""The agent variants of the RL job (``agent.*``): the calculator-trace data of
``agent.sft_traces`` and the run without tools of ``agent.compare_without_tools``, whose
accuracy the summary shows beside the tool-using run's (``configs/agent_calc.py``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from typing import Any

from meshrl.configs.schema import Config
from meshrl.datasets import agent_calc
from meshrl.utils import log as log_lib
from meshrl.utils import paths
from meshrl.utils.aio import run_sync
from meshrl.workflows.agent_eval import agenerate_episodes
from meshrl.workflows.agent_setup import agent_spec
from meshrl.workflows.setup import episode_settings

log = log_lib.get_logger("rl")

BASELINE_DIR = "no_tools"


def with_traces(config: Config, workdir: paths.PathLike) -> Config:
    """With ``agent.sft_traces``: ``data.*`` becomes the trace rows of its synthetic task,
    written under ``<workdir>/agent_data`` (the warm start learns to call the calculator; the
    reward reads the answer after ``####``)."""
    if not config.agent.sft_traces:
        return config
    train, held_out = agent_calc.write_task(config.data, paths.as_path(workdir) / "agent_data",
                                            config.agent.tool_format)
    data = dataclasses.replace(config.data, source="jsonl", path=train, eval_path=held_out,
                               prompt_field="question", answer_field="answer")
    # The traces are written: the data now names them (sft_traces asks for a synthetic task).
    agent = dataclasses.replace(config.agent, sft_traces=False)
    return dataclasses.replace(config, data=data, agent=agent)


def without_tools(config: Config) -> Config:
    """The same job with plain single-turn episodes and a bare-answer warm start. Its groups
    may well all score 0 (the task is out of its reach): they are kept, not filtered, so the
    run ends on time instead of waiting for a group that scores both ways."""
    agent = dataclasses.replace(config.agent, env="", sft_traces=False,
                                compare_without_tools=False, turn_stop="")
    rollout = dataclasses.replace(config.rollout, max_turns=1, filter_equal_groups=False,
                                  max_filtered_in_a_row=0)
    return dataclasses.replace(config, agent=agent, rollout=rollout)


def run_baseline(config: Config, workdir: paths.PathLike,
                 run: Callable[[Config, str], dict[str, Any]]) -> dict[str, Any]:
    """The no-tools run's summary: read from ``<workdir>/no_tools/summary.json`` when a
    previous attempt finished it, else run it there (``run`` is ``jobs.rl.run``)."""
    directory = paths.as_path(workdir) / BASELINE_DIR
    done = directory / "summary.json"
    if done.exists():
        return json.loads(done.read_text())
    directory.mkdir(parents=True, exist_ok=True)
    log.info("agent.compare_without_tools: training the same model without tools under %s",
             directory)
    return run(without_tools(config), str(directory))


def baseline_fields(baseline: dict[str, Any]) -> dict[str, Any]:
    return {"accuracy_without_tools_before": baseline.get("accuracy_before"),
            "accuracy_without_tools": baseline.get("accuracy_after"),
            "no_tools_wall_s": baseline.get("wall_s")}


def generate_episodes(config: Config, sampler: Any, rows: list[tuple[dict, str, list[int]]],
                      first_index: int, tokenizer: Any, workdir: paths.PathLike,
                      ) -> list[dict[str, Any]]:
    """``agent.env`` in the generate job: one sampled agent episode per prompt row
    ``(example, text, ids)``, its ``episodes.jsonl`` record, in the rows' order (the caller
    writes them). The episodes' seeds follow the prompts' indices."""
    from meshrl.inference.async_sampler import AsyncSampler

    spec = agent_spec(config, tokenizer, workdir=workdir)
    assert spec is not None, "generate_episodes needs agent.env"
    spec.log = None  # the records are the job's output, written once by the caller
    examples = [{**ex, "prompt_ids": ids} for ex, _, ids in rows]
    engine = AsyncSampler(sampler)
    try:
        return run_sync(agenerate_episodes(
            engine, examples, spec=spec, settings=episode_settings(config, tokenizer),
            decode=tokenizer.decode, first_index=first_index))
    finally:
        engine.shutdown()
