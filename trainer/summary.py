"""A run's ``summary.json``: every job that trains writes it through ``write_summary``, once, at
the end of the run. A resumed run's first-step figures come from ``metrics.jsonl``, which holds
the whole run (``first_logged``)."""

from __future__ import annotations

import json
from typing import Any

import jax

from meshrl.trainer.curves import read_metrics
from meshrl.utils import paths
from meshrl.utils.log import get_logger

_log = get_logger("trainer.summary")


def write_summary(summary: dict[str, Any], workdir: str, table: str | None = None) -> None:
    """Log ``params_checksum`` on every process (equal values show the processes ended with
    the same params); on process 0, write ``summary.json`` under ``workdir`` atomically and
    log ``table``, the job's console summary."""
    _log.info("params_checksum %.17g", summary["params_checksum"])
    if jax.process_index() == 0:
        paths.write_text_atomic(paths.as_path(workdir) / "summary.json",
                                json.dumps(summary, indent=2))
        if table is not None:
            _log.info("%s", table)


def first_logged(engine: Any, key: str) -> float | None:
    """``key`` at the run's first step: from ``<workdir>/metrics.jsonl`` when ``engine`` (a
    ``TrainEngine``) resumed a run (its history starts after the restored step), else from its
    history; None when neither has it."""
    if engine.start_step:
        rows = read_metrics(engine.workdir / "metrics.jsonl")
        first = next((rows[s][key] for s in sorted(rows) if key in rows[s]), None)
        if first is not None:
            return first
    return next((h[key] for h in engine.history if key in h), None)


def logged_history(engine: Any, key: str) -> list[dict[str, float]]:
    """The run's step records that hold ``key``: ``engine.history`` (a ``TrainEngine``'s), or,
    when this process trained nothing (a finished run run again), the rows of
    ``<workdir>/metrics.jsonl``, in step order, so the summary keeps the run's figures."""
    history = [h for h in engine.history if key in h]
    if history or not engine.start_step:
        return history
    rows = read_metrics(engine.workdir / "metrics.jsonl")
    return [rows[s] for s in sorted(rows) if key in rows[s]]


def last_logged(engine: Any, key: str) -> float | None:
    """``key`` at the newest step that has it (``logged_history``); None when none has."""
    history = logged_history(engine, key)
    return history[-1][key] if history else None


def data_stats(data: Any) -> dict[str, int]:
    """This process's data counters (examples taken, over-long ones dropped, epoch) of a
    pipeline iterator that keeps them (``datasets.pipeline``), else ``{}``."""
    stats = getattr(data, "stats", None)
    return dict(stats) if isinstance(stats, dict) else {}
