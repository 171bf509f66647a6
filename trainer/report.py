"""What a job says on the console: the RL step line and the closing summary tables.

Contract: pure functions from host values a job already has (metric records, ``summary.json``
dicts) to text; nothing here reads the device or writes files. The RL job logs ``rl_step_line``
at its first step, then every ``trainer.log_every`` steps, and ``summary_table`` once at the
end, so a run's console is a few dozen lines whatever its length.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from meshrl.utils import paths


def rl_step_line(step: int, total: int, record: Mapping[str, float], eta: str) -> str:
    """``version 30/300 reward 0.512 staleness 0.94 (max 2) dropped 1 loss -0.0123
    4,210 tok/s ETA 00:45``: the weight version the step produced, the batch's mean reward
    (then the mean over every group scored since the previous step line, the filtered ones
    too, and the fraction kept), its tokens' mean and max version lag, stale groups dropped so far, the loss and the
    generated tokens per second of the step."""
    parts = [f"version {step}/{total}"]
    if "rollout/reward_mean" in record:
        parts.append(f"reward {record['rollout/reward_mean']:.3f}")
    if "rollout/reward_mean_all" in record:  # the kept groups' mean alone flatters the policy
        parts.append(f"(all {record['rollout/scored_groups']:,.0f} groups "
                     f"{record['rollout/reward_mean_all']:.3f}, kept "
                     f"{record['rollout/kept_fraction']:.3f})")
    if "rollout/batch_staleness_mean" in record:
        parts.append(f"staleness {record['rollout/batch_staleness_mean']:.2f} "
                     f"(max {record.get('rollout/batch_staleness_max', 0.0):.0f})")
    if "rollout/dropped_stale" in record:
        parts.append(f"dropped {record['rollout/dropped_stale']:.0f}")
    if "train/loss" in record:
        parts.append(f"loss {record['train/loss']:.4f}")
    if "perf/tokens_per_s" in record:
        parts.append(f"{record['perf/tokens_per_s']:,.0f} tok/s")
    parts.append(f"ETA {eta}")
    return " ".join(parts)


def table(title: str, rows: Sequence[tuple[str, str]]) -> str:
    """``title`` then one ``label  value`` line per row, labels padded to one column."""
    width = max((len(label) for label, _ in rows), default=0)
    return "\n".join([title, *(f"  {label.ljust(width)}  {value}" for label, value in rows)])


def _num(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def _change(before: float | None, after: float | None) -> str:
    return f"{_num(before)} -> {_num(after)}"


def _tb(workdir: str) -> str:
    """``tb/, `` when the run wrote TensorBoard events (``logging.tensorboard``)."""
    return "tb/, " if (paths.as_path(workdir) / "tb").exists() else ""


def rl_summary_table(summary: Mapping[str, Any], workdir: str) -> str:
    """The RL run's closing table: accuracy and reward before -> after, steps, throughput,
    staleness, time and where the outputs are."""
    before, after = summary.get("eval_before") or {}, summary.get("eval_after") or {}
    rows = [("held-out greedy accuracy", _change(summary.get("accuracy_before"),
                                                 summary.get("accuracy_after")))]
    rows += [(f"held-out {k.split('/', 1)[1].replace('_at_', '@')}",
              _change(before.get(k), after.get(k)))
             for k in sorted(set(before) | set(after)) if k.startswith("eval/pass_at_")]
    rows.append(("batch reward", _change(summary.get("reward_first"),
                                         summary.get("reward_last"))))
    steps = f"{summary['steps']} RL"
    if summary.get("start_step"):
        steps += f" (resumed at {summary['start_step']})"
    if summary.get("warm_start_steps"):
        steps += f" after {summary['warm_start_steps']} SFT warm-start"
    rows += [("steps", steps),
             ("generated tokens/s", "n/a (nothing generated)" if summary.get("tokens_per_s")
              is None else f"{summary['tokens_per_s']:,.0f}"),
             ("staleness", f"max {summary.get('max_staleness_seen', 0)} seen (limit "
                           f"{summary.get('max_staleness', 0)}), "
                           f"{summary.get('dropped_stale_groups', 0)} stale groups dropped")]
    wall = f"{summary.get('wall_s', 0.0):.0f} s"
    if "rl_wall_s" in summary:
        wall += f" (RL loop {summary['rl_wall_s']:.0f} s)"
    rows += [("wall time", wall),
             ("outputs", f"{workdir}: summary.json, metrics.jsonl, rl_curves.png, "
                         f"{_tb(workdir)}checkpoints/, weights/")]
    return table("RL summary", rows)


def sft_summary_table(summary: Mapping[str, Any], workdir: str) -> str:
    """The SFT run's closing table: loss first -> last, held-out figures, throughput, time."""
    rows = [("train loss", _change(summary.get("first_loss"), summary.get("final_loss")))]
    rows += [(k.replace("_", " "), f"{v:.4f}") for k, v in summary.items()
             if k.startswith("eval_") and k != "eval_sequences" and v is not None]
    steps = f"{summary['steps']}"
    if summary.get("start_step"):
        steps += f" (resumed at {summary['start_step']})"
    tok_s, mfu = summary.get("tokens_per_s"), summary.get("mfu")
    rows += [("steps", steps),
             ("tokens/s", "n/a" if tok_s is None else f"{tok_s:,.0f}"
              + ("" if mfu is None else f" (MFU {mfu:.1%})")),
             ("wall time", f"{summary.get('wall_s', 0.0):.0f} s"),
             ("outputs", f"{workdir}: summary.json, metrics.jsonl, {_tb(workdir)}checkpoints/")]
    return table("SFT summary", rows)
