"""The ``agent`` section: agent episodes in the RL job (and the generate and evaluate jobs).

With ``agent.env`` set, every rollout episode is an agent episode (``workflows/agent.py``): the
model and an environment take turns, token in and token out, for up to ``rollout.max_turns``
model turns within ``min(trainer.seq_len, sampler.max_len)`` tokens, and each finished episode
is one line of ``<workdir>/episodes.jsonl``. docs/agents.md has the design and the environment
API.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from meshrl.configs.fields import ConfigError, Section, at_least, field, greater_than

# The built-in tools (``rewards/tools.py``; a test checks the two lists agree).
TOOL_NAMES = ("calculator", "python")


@dataclasses.dataclass(frozen=True)
class AgentConfig(Section):
    """Agent episodes: the model and an environment (tools, or your own) take turns, token in
    and token out, for up to rollout.max_turns model turns (docs/agents.md)."""

    _section = "agent"
    env: str = field(
        "", "The environment of agent episodes: '' (none: plain episodes), 'tools' (the model "
            "calls agent.tools; a turn without a call ends the episode and the reward pool "
            "scores it), or 'package.module:function', a factory returning an environment with "
            "async reset(example) and step(action) (docs/agents.md).")
    tools: tuple[str, ...] = field(
        ("calculator",), "agent.env = 'tools': the tools the model may call (calculator, "
                         "python).")
    tool_format: Literal["hermes", "llama3"] = field(
        "hermes", "How the model writes a tool call: hermes (<tool_call>{json}</tool_call>, "
                  "Qwen) or llama3 (a JSON object with name and parameters).")
    episodes_log: bool = field(True, "Write each finished agent episode (turns, tool calls, "
                                     "versions, reward) to <workdir>/episodes.jsonl.")
    turn_stop: str = field("", "A string of exactly one token that also ends a model turn "
                               "(besides EOS), e.g. '\\n' for one tool call per line; empty: EOS "
                               "only.")
    sft_traces: bool = field(False, "agent.env = 'tools' on a synthetic arithmetic task: the "
                                    "SFT warm start trains on calculator traces of data.* "
                                    "(datasets/agent_calc.py) instead of bare answers.")
    compare_without_tools: bool = field(
        False, "First run the same job without tools (agent.env = '', bare-answer warm start) "
               "under <workdir>/no_tools; the summary shows both accuracies.")
    tool_timeout_s: float = field(5.0, "Wall-clock limit of one tool call, seconds; then its "
                                       "process group is killed and the model sees an error.",
                                  greater_than(0.0))
    tool_cpu_s: int = field(5, "CPU-time limit (RLIMIT_CPU) of one tool call's process, "
                               "seconds.", at_least(1))
    tool_memory_mb: int = field(512, "Address-space limit (RLIMIT_AS) of a tool's process, MiB.",
                                at_least(64))
    tool_output_bytes: int = field(16384, "Most bytes of a tool's output kept; a tool that "
                                          "prints more is stopped with an error.", at_least(1))

    def validate(self) -> None:
        if self.env not in ("", "tools") and ":" not in self.env:
            raise ConfigError(f"agent.env = {self.env!r}: must be '', 'tools' or "
                              f"'package.module:function' (a factory of environments)")
        bad = [t for t in self.tools if t not in TOOL_NAMES]
        if bad:
            raise ConfigError(f"agent.tools = {self.tools!r}: {bad} unknown: built-in tools are "
                              f"{list(TOOL_NAMES)}")
        if (self.sft_traces or self.compare_without_tools) and self.env != "tools":
            raise ConfigError(f"agent.env = {self.env!r}: agent.sft_traces and "
                              f"agent.compare_without_tools need agent.env = 'tools'")
        if self.sft_traces and "calculator" not in self.tools:
            raise ConfigError(f"agent.tools = {self.tools!r}: agent.sft_traces teaches calls "
                              f"to the calculator, which the episodes must have: add "
                              f"'calculator' or set agent.sft_traces = False")
        if self.env == "tools" and not self.tools:
            raise ConfigError("agent.tools = (): agent.env = 'tools' needs at least one tool: "
                              "name one of " + ", ".join(TOOL_NAMES))


def check_agent(config: Any) -> None:
    """Rules of ``agent`` with ``rollout``, ``sampler`` and ``trainer``: a later turn sends the
    whole context so far (up to the episode's token budget less one) to the sampler as its
    prompt, so the largest prompt bucket must hold it."""
    a, r, s = config.agent, config.rollout, config.sampler
    if a.sft_traces and config.data.source != "arithmetic":
        raise ConfigError(f"data.source = {config.data.source!r}: agent.sft_traces writes "
                          f"calculator traces of the synthetic arithmetic task: set "
                          f"data.source = 'arithmetic' or agent.sft_traces = False")
    if not a.env and r.max_turns > 1:
        raise ConfigError(f"rollout.max_turns = {r.max_turns}: later turns need an environment "
                          f"to answer the model (agent.env is empty): set agent.env, or "
                          f"rollout.max_turns = 1")
    if not a.env or r.max_turns == 1:
        return
    need = min(config.trainer.seq_len, s.max_len) - 1
    if not s.prompt_buckets or s.prompt_buckets[-1] < need:
        raise ConfigError(f"sampler.prompt_buckets = {s.prompt_buckets}: agent episodes "
                          f"(agent.env = {a.env!r}, rollout.max_turns = {r.max_turns}) send "
                          f"contexts of up to {need} tokens as prompts: add a bucket of at "
                          f"least {need} (min(trainer.seq_len, sampler.max_len) - 1)")
