"""The metric writer loads tensorboardX without torch, and leaves torch importable."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import struct
import subprocess
import sys

import pytest

from meshrl.trainer.metrics import MetricsWriter

PROBE = r"""
import json, sys
from meshrl.trainer.metrics import MetricsWriter
w = MetricsWriter(sys.argv[1], tensorboard=True, process_index=0)
w.write(1, {"loss": 0.5})
w.close()
loaded = "torch" in sys.modules
import torch  # the writer must not leave torch marked unimportable
print(json.dumps({"torch_loaded_by_writer": loaded, "torch_after": torch.__name__}))
"""


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_writer_with_torch_installed_does_not_import_it_and_leaves_it_importable(tmp_path):
    out = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True,
                         text=True, timeout=120, check=True, cwd=tmp_path)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"torch_loaded_by_writer": False, "torch_after": "torch"}
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def _scalars(tb: pathlib.Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the event files (TFRecord framing: length,
    length CRC, record, record CRC)."""
    from tensorboardX.proto import event_pb2

    out = []
    for path in sorted(tb.glob("events.out.tfevents.*")):
        data, i = path.read_bytes(), 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + n])
            out += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
            i += 12 + n + 4
    return out


def test_writer_writes_scalars_to_tensorboard_and_jsonl(tmp_path):
    w = MetricsWriter(tmp_path, tensorboard=True, process_index=0)
    w.write(3, {"loss": 0.25})
    w.close()
    assert _scalars(tmp_path / "tb") == [("loss", 3, 0.25)]
    assert [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        {"step": 3, "loss": 0.25}]


FAKE_PROBE = r"""
import json, sys
from meshrl.trainer.metrics import summary_writer_class
cls = summary_writer_class()
print(json.dumps({"writer": cls.__module__, "torch_loaded": "torch" in sys.modules}))
"""


def test_writer_class_of_a_tensorboardx_that_needs_torch_imports_it_with_torch(tmp_path):
    # A tensorboardX whose import fails without torch (an unguarded ``import torch``).
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("")
    (tmp_path / "tensorboardX").mkdir()
    (tmp_path / "tensorboardX" / "__init__.py").write_text(
        "import torch\nfrom tensorboardX.writer import SummaryWriter\n")
    (tmp_path / "tensorboardX" / "writer.py").write_text("class SummaryWriter:\n    pass\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", FAKE_PROBE], capture_output=True, text=True,
                         timeout=120, check=True, env=env, cwd=tmp_path)
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"writer": "tensorboardX.writer", "torch_loaded": True}


def _rows(path: pathlib.Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_row_written_again_at_the_restored_step_replaces_the_same_kind_of_row(tmp_path):
    # A finished run run again restores its last step and evaluates it again.
    first = MetricsWriter(tmp_path, tensorboard=False, process_index=0)
    for step in (1, 2):
        first.write(step, {"loss": float(step)})
    first.write(2, {"eval/accuracy": 0.5})
    first.close()

    again = MetricsWriter(tmp_path, tensorboard=False, process_index=0, resume_step=2)
    again.write(2, {"eval/accuracy": 0.75})
    again.close()

    assert _rows(tmp_path / "metrics.jsonl") == [
        {"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 2, "eval/accuracy": 0.75}]
    assert _rows(tmp_path / "metrics.discarded.jsonl") == [{"step": 2, "eval/accuracy": 0.5}]


def test_a_fresh_start_moves_an_earlier_runs_summary_aside_and_a_resumed_run_keeps_it(tmp_path):
    # Nothing may read an earlier run's summary.json as this run's end (the evaluate job does).
    summary = tmp_path / "summary.json"
    for n, name in ((1, "summary.discarded.json"), (2, "summary.discarded-2.json")):
        summary.write_text(json.dumps({"job": "rl", "steps": 4, "run": n}))
        MetricsWriter(tmp_path, tensorboard=False, process_index=0).close()
        assert not summary.exists()
        assert json.loads((tmp_path / name).read_text())["run"] == n

    summary.write_text("{}")
    MetricsWriter(tmp_path, tensorboard=False, process_index=0, resume_step=2).close()
    assert summary.read_text() == "{}"
