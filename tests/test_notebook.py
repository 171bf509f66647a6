"""notebooks/quickstart.ipynb: committed clean, and it runs top to bottom as CI runs it
(``papermill notebooks/quickstart.ipynb OUT.ipynb -p QUICK True -p HF_PATH ...``), showing
curves and greedy completions of more than one weight version, for the quick job and for the
real-checkpoint section on the tiny Qwen2 checkpoint the recipe tests save."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import nbformat
import pytest

from meshrl.tests.jobs import real_model
from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "quickstart.ipynb"
ROW = re.compile(r"^\| (\d+) \| (.*) \| (.*) \| (-?\d+\.\d+) \|$")


def _tagged(nb: nbformat.NotebookNode, tag: str) -> nbformat.NotebookNode:
    cells = [c for c in nb.cells if tag in c.metadata.get("tags", [])]
    assert len(cells) == 1, f"{len(cells)} cells tagged {tag!r}"
    return cells[0]


def _text(cell: nbformat.NotebookNode) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_committed_notebook_is_valid_clean_and_has_a_parameters_cell():
    nb = nbformat.read(NOTEBOOK, as_version=4)

    nbformat.validate(nb)
    assert (nb.nbformat, nb.nbformat_minor) >= (4, 5)  # cell ids
    assert nb.metadata.kernelspec.name == "python3"
    assert "QUICK = False" in _tagged(nb, "parameters").source.splitlines()[0]
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.outputs == [] and c.execution_count is None for c in code)


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> nbformat.NotebookNode:
    """The notebook run by papermill in QUICK mode from the repository root, as in CI, its
    real-checkpoint section on a tiny random Qwen2 and GSM8K-format files."""
    tmp = tmp_path_factory.mktemp("notebook")
    real_model.save_qwen2(tmp / "qwen2")
    real = {"HF_PATH": tmp / "qwen2",
            "DATA_PATH": real_model.write_jsonl(tmp / "train.jsonl", real_model.gsm8k_rows(16, 1)),
            "EVAL_PATH": real_model.write_jsonl(tmp / "test.jsonl", real_model.gsm8k_rows(8, 2))}
    env = cpu_env()  # CI's shell has no fake devices: the notebook sets none either
    env["TMPDIR"] = str(tmp)  # the notebook's temporary workdir lands under tmp_path
    env["PYTHONUNBUFFERED"] = "1"
    out = tmp / "OUT.ipynb"
    proc = subprocess.run(
        [sys.executable, "-m", "papermill", "notebooks/quickstart.ipynb", str(out),
         "-p", "QUICK", "True", *(a for k, v in real.items() for a in ("-p", k, str(v)))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return nbformat.read(out, as_version=4)


def test_quick_run_has_no_error_outputs_and_runs_on_this_interpreter(executed):
    errors = [(c.id, o.ename, o.evalue) for c in executed.cells
              for o in c.get("outputs", []) if o.output_type == "error"]

    assert errors == []
    assert executed.metadata.papermill.parameters["QUICK"] is True
    # The "python3" kernel resolved to this interpreter: the one with the test extra installed.
    assert f"in {sys.prefix}" in _text(next(c for c in executed.cells if c.id == "install"))


def test_quick_run_shows_the_curves(executed):
    images = [o for o in _tagged(executed, "curves").outputs if "image/png" in o.get("data", {})]

    assert len(images) == 2  # rl_curves.png and the plot from metrics.jsonl


def _completion_versions(cell: nbformat.NotebookNode) -> list[int]:
    """The versions of the cell's one completions table, its rows checked."""
    tables = [o.data["text/markdown"] for o in cell.outputs if "text/markdown" in o.get("data", {})]
    assert len(tables) == 1
    rows = [ROW.match(line) for line in tables[0].splitlines()[2:]]
    assert rows and all(rows), tables[0]
    assert all(0.0 <= float(r.group(4)) <= 1.0 for r in rows)
    return [int(r.group(1)) for r in rows]


def test_quick_run_shows_completions_of_more_than_one_weight_version(executed):
    cell = _tagged(executed, "completions")

    versions = _completion_versions(cell)

    assert len(set(versions)) > 1 and versions == sorted(versions)
    assert f"published weight versions: {sorted(set(versions))}" in _text(cell)


def test_real_checkpoint_section_trains_the_qwen2_and_shows_its_first_and_last_versions(
        executed):
    cell = next(c for c in executed.cells if c.id == "real")
    images = [o for o in cell.outputs if "image/png" in o.get("data", {})]

    versions = _completion_versions(cell)

    assert "skipped" not in _text(cell)
    assert len(images) == 1  # the real run's rl_curves.png
    assert "published weight versions: [1, 2]" in _text(cell)
    assert sorted(set(versions)) == [1, 2]
