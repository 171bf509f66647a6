"""Process checks of the launcher tests, by pid in /proc."""

from __future__ import annotations

import pathlib


def alive(pid: int) -> bool:
    """Running, not a zombie: an orphan's zombie lingers where PID 1 does not reap."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"
