"""README's Recipes: every ``main.py`` command there passes ``--dry_run`` (config, input paths,
model architecture, meshes) once its placeholder paths point at real files; the sweep recipe names
the sweep file the sweep tests run."""

from __future__ import annotations

import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

from meshrl.tests.jobs import real_model

pytestmark = pytest.mark.distributed  # dry runs build the meshes on 8 fake CPU devices

ROOT = pathlib.Path(__file__).resolve().parents[1]


def recipes() -> dict[str, list[list[str]]]:
    """``<!-- recipe: NAME -->`` -> the commands of the bash block after it (continuations
    joined), each split into arguments."""
    text = (ROOT / "README.md").read_text()
    out: dict[str, list[list[str]]] = {}
    for m in re.finditer(r"<!-- recipe: (\w+) -->\n```bash\n(.*?)```", text, re.S):
        joined = m.group(2).replace("\\\n", " ")
        out[m.group(1)] = [shlex.split(line) for line in joined.splitlines()
                           if line.strip() and not line.lstrip().startswith("#")]
    return out


@pytest.fixture(scope="module")
def placeholders(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("recipes")
    real_model.save_qwen2(root / "model")
    gsm8k = {name: real_model.write_jsonl(root / f"{name}.jsonl", real_model.gsm8k_rows(8, i))
             for i, name in enumerate(("gsm8k_train", "gsm8k_test"))}
    chat = {name: real_model.write_jsonl(root / f"{name}.jsonl", real_model.chat_rows(8, i))
            for i, name in enumerate(("chat_train", "chat_eval"))}
    paths = {"model": root / "model", **gsm8k, **chat}
    return {f"/path/to/{k}" + ("" if k == "model" else ".jsonl"): str(v)
            for k, v in paths.items()}


def test_readme_has_the_issue_recipes():
    assert set(recipes()) == {"sft", "rl", "generate", "export", "sweep"}


def test_each_recipe_lists_its_cpu_rehearsal():
    # tests/jobs/test_real_model_recipes.py runs these :cpu variants end to end: RL, its
    # export and sampling, SFT and its export.
    expected = {"sft": ["configs/sft_chat.py", "configs/sft_chat.py:cpu"],
                "rl": ["configs/rl_gsm8k.py", "configs/rl_gsm8k.py:cpu"],
                "generate": ["configs/generate.py", "configs/rl_gsm8k.py",
                           "configs/rl_gsm8k.py:cpu"],
                "export": ["configs/rl_gsm8k.py", "configs/rl_gsm8k.py:cpu"]}
    for name, configs in expected.items():
        assert [cmd[cmd.index("--config") + 1] for cmd in recipes()[name]] == configs, name


def test_every_main_py_recipe_passes_its_dry_run(placeholders, tmp_path):
    commands = [cmd for cmds in recipes().values() for cmd in cmds if cmd[1] == "main.py"]
    assert len(commands) >= 5
    procs = []
    for i, cmd in enumerate(commands):
        args = [a.replace("/tmp/", f"{tmp_path}/{i}/") for a in cmd]  # the recipes' workdirs
        args = [re.sub(r"/path/to/[\w.]+", lambda m: placeholders.get(m.group(0), m.group(0)),
                       a) for a in args]
        unknown = [a for a in args if "/path/to/" in a]
        assert not unknown, f"README recipe uses a placeholder the test does not know: {unknown}"
        procs.append((cmd, subprocess.Popen(
            [sys.executable, *args[1:], "--dry_run"], cwd=ROOT, env=dict(os.environ),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    for cmd, proc in procs:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"{shlex.join(cmd)}\n{out[-3000:]}"
        assert "# resolved config" in out
    assert not any(tmp_path.rglob("checkpoints")), "a dry run wrote into its workdir"
