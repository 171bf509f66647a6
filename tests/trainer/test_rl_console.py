"""The RL console: a line saying why a step's groups were filtered; a Ctrl-C seen while the
trainer waits for a batch."""

from __future__ import annotations

import asyncio

from meshrl.trainer.rl_console import await_batch, filtered_note
from meshrl.utils import interrupt
from meshrl.workflows.watch import Window


def test_filtered_note_counts_filtered_and_kept_groups_and_says_why():
    note = filtered_note(1, Window(kept=16, filtered=1077, reward_sum=3.0, samples=4372))

    assert note == ("version 1: 1,077 of 1,093 groups scored since the last line were "
                    "filtered: every sample of each got the same reward, so its advantages are "
                    "all zero (rollout.filter_equal_groups); 16 kept")
    assert filtered_note(1, Window(kept=16, filtered=16)) is None  # not many: no line


class _NeverReady:
    def __init__(self) -> None:
        self.cancelled = False

    async def get_batch(self, version: int) -> list:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        return []


def test_await_batch_returns_none_soon_after_a_stop_request(monkeypatch):
    monkeypatch.setattr(interrupt, "_state", {"requested": False})
    runner = _NeverReady()

    async def main():
        asyncio.get_running_loop().call_later(0.1, interrupt.request)
        return await asyncio.wait_for(await_batch(runner, 0), timeout=5.0)

    assert asyncio.run(main()) is None
    assert runner.cancelled
