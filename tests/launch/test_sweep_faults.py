"""A trial killed while writing its summary.json is not finished: the next sweep reruns it.

The kill is real: the stand-in for main.py lowers its file-size limit (RLIMIT_FSIZE) below the
summary's size, so the kernel ends it with SIGXFSZ in the middle of the write, the way a
preemption or an OOM kill would at that moment."""

from __future__ import annotations

import json
import signal

import pytest

from meshrl.launch import sweep, sweep_run, sweep_trials

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
        assert not summary.exists() and (workdir / TRIAL / "summary.json.tmp").exists()
    assert not sweep.is_finished(workdir, sweep.load_sweep(spec).trials[0])

    rc = sweep.main([str(spec), "--workdir", str(workdir)])

    assert rc == 0, capsys.readouterr().err
    assert "1 trials, 0 finished, 1 to run" in capsys.readouterr().err
    assert json.loads(summary.read_text())["accuracy_after"] == 0.5
    assert (workdir / TRIAL / sweep_run.LOG).read_text().count("fake main.py: again") == 1
