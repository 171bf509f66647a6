"""utils.watchdog: a step that never completes ends in a report, a steady run never fires."""

from __future__ import annotations

import threading
import time

from meshrl.utils.watchdog import EXIT_HANG, Watchdog


def test_no_completed_step_within_timeout_reports_last_step_and_program(caplog, capfd):
    fired = threading.Event()
    dog = Watchdog(0.3, on_timeout=fired.set, poll_s=0.02)
    dog.start()
    dog.launched("train step 1")
    dog.completed(1)
    dog.launched("train step 2")  # ... and step 2 never completes

    assert fired.wait(5)
    dog.stop()
    assert dog.fired
    message = " ".join(r.getMessage() for r in caplog.records)
    assert "last completed step: 1; last program launched: train step 2" in message
    assert f"exiting with code {EXIT_HANG}" in message
    stacks = capfd.readouterr().err
    assert "Thread 0x" in stacks and "test_watchdog.py" in stacks  # every thread's stack


def test_steps_completing_in_time_never_fire_and_zero_disables():
    fired = threading.Event()
    dog = Watchdog(0.3, on_timeout=fired.set, poll_s=0.02)
    dog.start()
    for step in range(10):
        time.sleep(0.05)
        dog.completed(step)
    dog.stop()
    off = Watchdog(0.0, on_timeout=fired.set)
    off.start()
    time.sleep(0.1)

    assert not fired.is_set() and not dog.fired and off._thread is None


def test_first_step_has_its_own_limit_for_compilation():
    fired = threading.Event()
    dog = Watchdog(0.2, 3.0, on_timeout=fired.set, poll_s=0.02)
    dog.start()
    dog.launched("train step 1")  # compiling: longer than the per-step limit

    assert not fired.wait(0.6)
    dog.completed(1)
    assert fired.wait(5)  # step 2 gets only the per-step limit
    dog.stop()
    assert "distributed.step_timeout_s = 0.2" in dog.report()
