"""An SFT sweep's report, as an RL sweep's: the table shows the run's headline numbers (the
losses), and its last line names only the files the report wrote (no curves without curves)."""

from __future__ import annotations

import json
import pathlib

from meshrl.launch import sweep_report
from meshrl.launch.sweep import Trial

TRIALS = [Trial("lr=0.001", {"trainer.learning_rate": 1e-3}),
          Trial("lr=0.01", {"trainer.learning_rate": 1e-2})]


def _sft_trials(workdir: pathlib.Path, eval_curve: bool) -> None:
    """What a finished SFT run leaves: its summary.json and metrics.jsonl (``eval_loss`` rows
    only with ``eval_curve``)."""
    for i, trial in enumerate(TRIALS):
        tdir = workdir / trial.name
        tdir.mkdir(parents=True)
        (tdir / "summary.json").write_text(json.dumps({
            "job": "sft", "steps": 4, "first_loss": 5.5, "final_loss": 4.0 - i,
            "eval_loss": 4.25 - i, "tokens_per_s": 100.0, "wall_s": 2.0}))
        rows = [{"step": s, "loss": 5.0 - s} for s in range(1, 5)]
        if eval_curve:
            rows += [{"step": s, "eval_loss": 4.5 - s / 4 - i} for s in (2, 4)]
        (tdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_sft_sweep_table_shows_losses_and_names_no_plot_it_did_not_write(tmp_path):
    _sft_trials(tmp_path, eval_curve=False)
    (tmp_path / sweep_report.PLOT).write_bytes(b"an earlier report's plot")

    rows = sweep_report.write_report(TRIALS, tmp_path)
    table = sweep_report.format_table(TRIALS, rows, tmp_path).splitlines()

    assert table[0].split() == ["trial", "status", "trainer.learning_rate", "first_loss",
                                "final_loss", "eval_loss", "tokens_per_s", "wall_s"]
    assert table[2].split() == ["lr=0.01", "done", "0.01", "5.5", "3", "3.25", "100", "2"]
    assert table[-1] == f"results: {tmp_path / sweep_report.RESULTS}"
    assert not (tmp_path / sweep_report.PLOT).exists()


def test_sft_sweep_with_eval_losses_plots_them_and_names_the_plot(tmp_path):
    _sft_trials(tmp_path, eval_curve=True)

    rows = sweep_report.write_report(TRIALS, tmp_path)
    table = sweep_report.format_table(TRIALS, rows, tmp_path)

    assert (tmp_path / sweep_report.PLOT).read_bytes()[:4] == b"\x89PNG"
    assert table.splitlines()[-1] == (f"results: {tmp_path / sweep_report.RESULTS}; curves: "
                                      f"{tmp_path / sweep_report.PLOT}")
