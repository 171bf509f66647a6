"""Progress: a tqdm bar on a terminal, a log line every 10% otherwise, nothing when disabled."""

from __future__ import annotations

import io

from meshrl.trainer import progress as progress_lib
from meshrl.trainer.progress import Progress


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class _Records:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args if args else msg)


def test_log_line_shows_step_loss_throughput_and_eta():
    line = Progress(100, 0, stream=io.StringIO()).line(25, 1.23456, 12345.6)

    assert line.startswith("step 25/100 loss 1.2346 12,346 tok/s ") and " step/s ETA " in line


def test_off_a_terminal_logs_every_tenth_of_the_run_and_the_last_step(monkeypatch):
    records = _Records()
    monkeypatch.setattr(progress_lib, "_log", records)
    stream = io.StringIO()
    progress = Progress(30, 10, stream=stream)

    for step in range(11, 31):
        progress.update(step, 0.5, 100.0)
    progress.close()

    assert [line.split(" loss")[0] for line in records.lines] == [
        f"step {s}/30" for s in (11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 30)]
    assert stream.getvalue() == ""  # no bar drawn into a log file


def test_on_a_terminal_draws_a_tqdm_bar_with_loss_and_throughput(monkeypatch):
    records = _Records()
    monkeypatch.setattr(progress_lib, "_log", records)
    stream = _Terminal()
    progress = Progress(10, 2, stream=stream)

    for step in range(3, 11):
        progress.update(step, 0.25, 2048.0)
    progress.close()

    out = stream.getvalue()
    assert "10/10" in out and "loss 0.2500" in out and "2,048 tok/s" in out
    assert out.endswith("\n") and records.lines == []


def test_disabled_or_finished_run_writes_nothing(monkeypatch):
    records = _Records()
    monkeypatch.setattr(progress_lib, "_log", records)
    for progress in (Progress(10, 0, enabled=False, stream=_Terminal()),
                     Progress(10, 10, stream=_Terminal())):
        progress.update(10, 1.0, 1.0)
        progress.close()

        assert progress._stream.getvalue() == "" and records.lines == []


def test_on_a_terminal_log_records_print_through_tqdm_and_the_handler_comes_back(monkeypatch):
    import logging
    import sys

    from meshrl.utils import log

    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    log.setup("INFO")  # the meshrl handler writes to (this) stderr
    root = logging.getLogger("meshrl")
    before = list(root.handlers)
    progress = Progress(4, 0, stream=terminal)

    redirected = list(root.handlers)
    log.get_logger("test").info("eval at version 2")
    progress.update(4, 0.5, 10.0)
    progress.close()

    assert redirected != before and root.handlers == before
    assert "eval at version 2" in terminal.getvalue() and "4/4" in terminal.getvalue()
