"""A run's curves: ``metrics.jsonl`` read back per step and the RL plot of batch reward and
held-out accuracy over weight versions."""

from __future__ import annotations

import io
import json

from etils import epath


def read_metrics(path: epath.Path) -> dict[int, dict[str, float]]:
    """``metrics.jsonl`` merged per step; a step re-run after a resume keeps its newest values."""
    by_step: dict[int, dict[str, float]] = {}
    if not path.exists():
        return by_step
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by a kill
            continue
        by_step.setdefault(int(rec.pop("step")), {}).update(rec)
    return by_step


def plot_curves(metrics: dict[int, dict[str, float]], path: epath.Path) -> None:
    """PNG of the batch reward and the held-out greedy accuracy over RL steps."""
    from matplotlib.figure import Figure

    # A bare Figure, not pyplot: no backend switch or figure registry in the calling process
    # (a notebook that runs the job keeps its inline plots).
    fig = Figure(figsize=(7, 4))
    ax = fig.subplots()
    values = [0.0, 1.0]  # the axis shows [0, 1] at least, and every reward outside it
    for key, label, style in (("rollout/reward_mean", "batch reward (mean)", "-"),
                              ("eval/greedy_accuracy", "held-out greedy accuracy", "o-"),
                              ("eval/pass_at_1", "held-out pass@1", "s--")):
        pts = sorted((s, m[key]) for s, m in metrics.items() if key in m)
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
            values += [p[1] for p in pts]
    ax.set_xlabel("RL step (weight version)")
    pad = 0.02 * (max(values) - min(values))
    ax.set_ylim(min(values) - pad, max(values) + pad)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right")
    ax.set_title("meshrl: asynchronous GRPO")
    fig.tight_layout()
    buf = io.BytesIO()  # savefig writes local files only; the workdir may be gs://
    fig.savefig(buf, format="png", dpi=100)
    path.write_bytes(buf.getvalue())
