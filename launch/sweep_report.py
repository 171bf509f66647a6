"""A sweep's results: ``W/results.csv``, the table on stdout, ``W/sweep_curves.png``.

Contract: one row per trial, in sweep order: ``trial``, ``status`` (``done`` when it is
finished: a whole summary.json and exit code 0; ``not started`` without a trial directory (a
stopped sweep), else ``failed``), its overrides (one column per dotted
key), every scalar of its summary.json (nested dicts flattened to ``outer.inner``; lists left
out) and, for a failed trial, ``error``: the last line of its ``sweep.log``. The table shows the
overrides and the headline numbers of the job (RL: accuracy and reward; SFT: loss); the CSV has
every column. The plot has one panel per curve of ``CURVES`` that some trial's
``metrics.jsonl`` holds, one line per trial; without any there is no plot (and an earlier one
is removed), and the table's last line names only the files written.
"""

from __future__ import annotations

import csv
import io
import json
import math
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

from meshrl.launch.sweep_trials import (
    LOG,
    Trial,
    format_value,
    is_finished,
    log_tail,
    read_summary,
)
from meshrl.utils import paths
from meshrl.utils.log import get_logger

log = get_logger("launch.sweep")
RESULTS, PLOT = "results.csv", "sweep_curves.png"
# The table's numbers, those a summary has: RL's accuracy and reward, SFT's losses.
HEADLINE = ("accuracy_before", "accuracy_after", "reward_first", "reward_last", "first_loss",
            "final_loss", "eval_loss", "tokens_per_s", "wall_s")
CURVES = (("rollout/reward_mean", "batch reward (mean)"),
          ("eval/greedy_accuracy", "held-out greedy accuracy"),
          ("eval_loss", "held-out loss (SFT)"))


def flatten(summary: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Scalars of ``summary`` (str, bool, numbers, None), nested dicts as ``outer.inner``."""
    out: dict[str, Any] = {}
    for key, value in summary.items():
        if isinstance(value, Mapping):
            out.update(flatten(value, f"{prefix}{key}."))
        elif value is None or isinstance(value, (str, bool, int, float)):
            out[f"{prefix}{key}"] = value
    return out


def trial_row(trial: Trial, workdir: pathlib.Path) -> dict[str, Any]:
    row: dict[str, Any] = {"trial": trial.name}
    summary = read_summary(workdir, trial)
    row["status"] = "done" if is_finished(workdir, trial) else "failed"
    row.update(trial.overrides)
    if summary is not None:  # a failed trial's too: what it wrote before it failed
        row.update(flatten(summary))
    if row["status"] == "done":
        return row
    if not (workdir / trial.name).is_dir():  # the sweep stopped before it
        row["status"], row["error"] = "not started", "not started"
    else:
        tail = log_tail(workdir / trial.name / LOG, 1)
        row["error"] = tail[0] if tail else f"no {LOG} (launched by XManager: see its output)"
    return row


def write_csv(rows: Sequence[Mapping[str, Any]], path: pathlib.Path) -> None:
    columns = list(dict.fromkeys(k for r in rows for k in r if k != "error"))
    if any("error" in r for r in rows):
        columns.append("error")
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=columns, restval="")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in r.items()} for r in rows)
    paths.write_text_atomic(paths.as_path(path), text.getvalue())


def read_metrics(path: pathlib.Path) -> dict[int, dict[str, float]]:
    """``metrics.jsonl`` merged per step, newest value last. As ``trainer.curves.read_metrics``,
    which cannot be imported here without JAX and the model code."""
    by_step: dict[int, dict[str, float]] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
                by_step.setdefault(int(rec.pop("step")), {}).update(rec)
            except (ValueError, KeyError, TypeError):  # a line cut by a kill
                continue
    return by_step


def plot_curves(trials: Sequence[Trial], workdir: pathlib.Path, path: pathlib.Path) -> bool:
    """PNG of the ``CURVES`` some trial has, over steps, one line per trial; False (no file)
    when no trial has any of them."""
    series = {}  # (curve key, trial name) -> [(step, value)]
    for trial in trials:
        metrics = read_metrics(workdir / trial.name / "metrics.jsonl")
        for key, _ in CURVES:
            pts = sorted((s, m[key]) for s, m in metrics.items() if key in m)
            if pts:
                series[key, trial.name] = pts
    curves = [(key, title) for key, title in CURVES if any(k == key for k, _ in series)]
    if not curves:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(curves), figsize=(6 * len(curves), 4), squeeze=False)
    for ax, (key, title) in zip(axes[0], curves):
        for trial in trials:
            pts = series.get((key, trial.name))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", ms=3, label=trial.name)
        ax.set_title(title)
        ax.set_xlabel("step (weight version)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def write_report(trials: Sequence[Trial], workdir: pathlib.Path) -> list[dict[str, Any]]:
    """The rows, ``results.csv`` and the plot under ``workdir``; a plot left from an earlier
    report is removed when this one has nothing to draw, so it never disagrees with the CSV."""
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [trial_row(t, workdir) for t in trials]
    write_csv(rows, workdir / RESULTS)
    if not plot_curves(trials, workdir, workdir / PLOT):
        (workdir / PLOT).unlink(missing_ok=True)
        log.warning("no trial has metrics to plot; %s not written", PLOT)
    return rows


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return format_value(value)


def format_table(trials: Sequence[Trial], rows: Sequence[Mapping[str, Any]],
                 workdir: pathlib.Path) -> str:
    """A plain-text table (trial, status, overrides, ``HEADLINE`` numbers), then the last log
    lines of each failed trial and where the full results are."""
    keys = list(dict.fromkeys(k for t in trials for k in t.overrides))
    numbers = [k for k in HEADLINE if any(k in r for r in rows)]
    columns = ["trial", "status", *keys, *numbers]
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in cells]
    for r in rows:
        if r["status"] == "failed":
            where = workdir / str(r["trial"]) / LOG
            tail = log_tail(where) or [str(r.get("error", ""))]
            source = f"the last lines of {where}" if where.is_file() else "why"
            lines += [f"failed: {r['trial']}; {source}:", *(f"  | {ln}" for ln in tail)]
    written = [f"results: {workdir / RESULTS}"]
    if (workdir / PLOT).is_file():  # write_report removes a plot it did not draw
        written.append(f"curves: {workdir / PLOT}")
    lines.append("; ".join(written))
    return "\n".join(lines)
