"""A trial killed while writing its summary.json is not finished: the next sweep reruns it.

The kill is real: the stand-in for main.py lowers its file-size limit (RLIMIT_FSIZE) below the
summary's size, so the kernel ends it with SIGXFSZ in the middle of the write, the way a
preemption or an OOM kill would at that moment."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from meshrl.launch import sweep, sweep_run, sweep_trials
from meshrl.tests.launch.pids import alive

# main.py's stand-in: its first attempt dies writing summary.json, a later one finishes.
# ``atomic`` writes the way the jobs do (utils.paths.write_text_atomic); ``in_place`` the way
# earlier builds did, leaving a summary cut short.
FAKE_MAIN = '''
import json, os, pathlib, resource, signal, sys
from meshrl.utils import paths
args = sys.argv[1:]
workdir = pathlib.Path(args[args.index("--workdir") + 1])
workdir.mkdir(parents=True, exist_ok=True)
summary = json.dumps({"accuracy_after": 0.5, "notes": "x" * 400})
first = not (workdir / "attempted").exists()
(workdir / "attempted").touch()
print("fake main.py: first attempt" if first else "fake main.py: again", flush=True)
if first:
    signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the default kills
    resource.setrlimit(resource.RLIMIT_FSIZE, (100, resource.RLIM_INFINITY))
if WRITER == "atomic":
    paths.write_text_atomic(paths.as_path(workdir / "summary.json"), summary)
else:
    (workdir / "summary.json").write_text(summary)
'''
ONE_TRIAL = """
from meshrl.launch import sweep as hyper
CONFIG = {config!r}
def sweep():
    return hyper.sweep("trainer.seed", [0])
"""
TRIAL = "seed=0"


@pytest.mark.parametrize("writer", ["atomic", "in_place"])
def test_kill_during_summary_writing_leaves_the_trial_unfinished_and_the_sweep_reruns_it(
        tmp_path, monkeypatch, meshrl_logger, capsys, writer):
    fake = tmp_path / "fake_main.py"
    fake.write_text(f"WRITER = {writer!r}\n" + FAKE_MAIN)
    monkeypatch.setattr(sweep_trials, "MAIN", fake)
    spec = tmp_path / "s.py"
    spec.write_text(ONE_TRIAL.format(config=str(sweep_trials.ROOT / "configs" / "default.py")))
    workdir = tmp_path / "w"

    rc = sweep.main([str(spec), "--workdir", str(workdir)])

    summary = workdir / TRIAL / "summary.json"
    log = (workdir / TRIAL / sweep_run.LOG).read_text()
    assert rc == 1 and "fake main.py: first attempt" in log
    assert f"exit code {-signal.SIGXFSZ}" in capsys.readouterr().err  # killed by the signal
    if writer == "in_place":  # what the kill left: a summary cut short, not a finished trial
        assert 0 < summary.stat().st_size < len(json.dumps({"notes": "x" * 400}))
    else:  # the whole file or none
        assert not summary.exists() and list((workdir / TRIAL).glob("summary.json.*.tmp"))
    assert not sweep.is_finished(workdir, sweep.load_sweep(spec).trials[0])

    rc = sweep.main([str(spec), "--workdir", str(workdir)])

    assert rc == 0, capsys.readouterr().err
    assert "1 trials, 0 finished, 1 to run" in capsys.readouterr().err
    assert json.loads(summary.read_text())["accuracy_after"] == 0.5
    assert (workdir / TRIAL / sweep_run.LOG).read_text().count("fake main.py: again") == 1


# A trial that records its pid and runs until stopped.
LONG_MAIN = '''
import os, pathlib, sys, time
args = sys.argv[1:]
workdir = pathlib.Path(args[args.index("--workdir") + 1])
(workdir / "pid").write_text(str(os.getpid()))
time.sleep(120)
'''
DRIVE = '''
import pathlib, sys
from meshrl.launch import sweep, sweep_trials
sweep_trials.MAIN = pathlib.Path(sys.argv[1])
sys.exit(sweep.main(sys.argv[2:]))
'''
THREE_TRIALS = """
from meshrl.launch import sweep as hyper
CONFIG = {config!r}
def sweep():
    return hyper.sweep("trainer.seed", [0, 1, 2])
"""


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_sweep_stops_its_trials_starts_no_more_and_reports(tmp_path, sig, code):
    fake = tmp_path / "long_main.py"
    fake.write_text(LONG_MAIN)
    spec = tmp_path / "s.py"
    spec.write_text(THREE_TRIALS.format(config=str(sweep_trials.ROOT / "configs" / "default.py")))
    workdir = tmp_path / "w"
    proc = subprocess.Popen([sys.executable, "-c", DRIVE, str(fake), str(spec), "--workdir",
                             str(workdir), "--parallel", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    pid_files = [workdir / f"seed={s}" / "pid" for s in (0, 1)]
    deadline = time.monotonic() + 60
    while not all(p.exists() and p.read_text() for p in pid_files):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    pids = [int(p.read_text()) for p in pid_files]

    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)

    try:
        assert proc.returncode == code, err[-2000:]
        assert not any(alive(p) for p in pids)
        assert not (workdir / "seed=2").exists()
        status = {ln.split()[0]: " ".join(ln.split()[1:3]) for ln in out.splitlines()[1:4]}
        assert status["seed=2"] == "not started", out
        assert "sweep stopped; the same command goes on where it stopped" in err
    finally:
        for p in pids:
            if alive(p):
                os.kill(p, signal.SIGKILL)
