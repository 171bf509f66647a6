"""Test-only entry point: ``main.py`` with a fault injected into process 1.

``MESHRL_TEST_FAULT=hang_at_step:N``: process 1 stops before issuing step N's program, so it
never joins that step's collectives and process 0 waits in them; only the watchdog ends that.
"""

from __future__ import annotations

import os
import pathlib
import runpy
import sys
import threading

import jax

from meshrl.trainer import engine

_KIND, _STEP = os.environ["MESHRL_TEST_FAULT"].split(":")
assert _KIND == "hang_at_step", _KIND
_dispatch = engine.TrainEngine.dispatch


def _faulty_dispatch(self, step, batch, prepare=None):
    if jax.process_index() == 1 and step == int(_STEP):
        threading.Event().wait()  # the skipped collective: this process never arrives
    return _dispatch(self, step, batch, prepare)


engine.TrainEngine.dispatch = _faulty_dispatch
main = pathlib.Path(__file__).resolve().parents[2] / "main.py"
sys.argv = [str(main), *sys.argv[1:]]
runpy.run_path(str(main), run_name="__main__")
