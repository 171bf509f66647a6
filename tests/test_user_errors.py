"""Errors a user can fix: one line ``error: ...`` from main.py, no traceback, workdir untouched;
``--dry_run`` rejects the same missing input paths as a run."""

from __future__ import annotations

import hashlib
import json
import pathlib
import shutil
import subprocess
import sys

import pytest

from meshrl.configs import ConfigError, from_config_dict
from meshrl.configs.loader import base_config
from meshrl.configs.paths import check_input_paths
from meshrl.datasets import DatasetError
from meshrl.jobs import dispatch as jobs
from meshrl.mesh import MeshShapeError
from meshrl.models.hf_config import CheckpointError, load_hf_config
from meshrl.models.tokenizer import HFTokenizer, TokenizerError, load_tokenizer
from meshrl.tests.xla import cpu_env
from meshrl.trainer.checkpoint import CheckpointMismatchError
from meshrl.utils.errors import MissingFileError, UserError

ROOT = pathlib.Path(__file__).resolve().parents[1]
SFT = str(ROOT / "configs" / "sft_synthetic.py") + ":smoke"
RL = str(ROOT / "configs" / "default.py") + ":smoke"
# One CPU device (the suite's 8 fake ones would not divide the tiny batches) and a tiny SFT run:
# one step, one checkpoint, no eval, no tensorboard.
ENV = cpu_env()
TINY_SFT = ("--config.trainer.steps=1", "--config.checkpoint.every_steps=1",
            "--config.trainer.eval_every=0", "--config.data.eval_examples=0",
            "--config.trainer.batch_size=2", "--config.trainer.seq_len=16",
            "--config.data.num_examples=20", "--config.logging.tensorboard=false",
            "--config.logging.progress_bar=false")
TINY_RL = ("--config.trainer.steps=2", "--config.rl.warm_start_steps=2",
           "--config.logging.tensorboard=false")


def _main(config: str, workdir: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "main.py"), "--config", config,
                           "--workdir", str(workdir), *args],
                          capture_output=True, text=True, env=ENV, timeout=600)


def _snapshot(root: pathlib.Path) -> dict[str, tuple[int, str]]:
    """Relative path -> (size, sha256) of every file under ``root``."""
    return {str(p.relative_to(root)): (p.stat().st_size, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(root.rglob("*")) if p.is_file()}


def _trained(tmp_path_factory: pytest.TempPathFactory, name: str, config: str,
             args: tuple[str, ...]) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp(name)
    out = _main(config, workdir, *args)
    assert out.returncode == 0, out.stderr[-3000:]
    assert any(p.name.isdigit() for p in (workdir / "checkpoints").iterdir()), "no checkpoint"
    return workdir


@pytest.fixture(scope="module")
def sft_workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A finished one-step SFT run (one checkpoint); tests work on copies of it."""
    return _trained(tmp_path_factory, "sft_run", SFT, TINY_SFT)


@pytest.fixture(scope="module")
def rl_workdir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A finished two-step smoke RL run (warm start, checkpoints, published weights)."""
    return _trained(tmp_path_factory, "rl_run", RL, TINY_RL)


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """Data files and directories the bad-input cases point at."""
    d = tmp_path_factory.mktemp("inputs")
    rows = [{"question": f"{a}+{a}=", "answer": str(2 * a)} for a in range(10, 30)]
    lines = [json.dumps(r) for r in rows]
    (d / "malformed.jsonl").write_text("\n".join(lines[:2] + ['{"question": "1+1=", "answer": ']
                                                 + lines[3:]) + "\n")
    (d / "no_field.jsonl").write_text("\n".join(lines[:4] + [json.dumps({"prompt": "1+1="})]
                                                + lines[5:]) + "\n")
    (d / "weights_only").mkdir()
    (d / "weights_only" / "model.safetensors").write_bytes(b"\0" * 8)
    (d / "no_tokenizer_json").mkdir()
    (d / "no_tokenizer_json" / "tokenizer_config.json").write_text("{}")
    return d


# (case id, config, extra args (``{in}``: the inputs dir), what the last line must name)
CASES = [
    ("config_value", SFT, ("--config.model.num_kv_heads=3",), "model.num_kv_heads = 3"),
    ("config_file_missing", str(ROOT / "configs" / "nope.py"), (), "nope.py"),
    ("config_variant", str(ROOT / "configs" / "sft_synthetic.py") + ":tiny", (),
     "unknown variant 'tiny'"),
    ("mesh", SFT, ("--config.mesh.data=3",), "data=3"),
    ("jsonl_malformed_row", SFT, ("--config.data.source=jsonl",
                                  "--config.data.path={in}/malformed.jsonl"),
     "malformed.jsonl:3: malformed JSON"),
    ("jsonl_missing_field", SFT, ("--config.data.source=jsonl",
                                  "--config.data.path={in}/no_field.jsonl"),
     "no_field.jsonl:5: missing field(s) ['question', 'answer']"),  # or 'messages', it says
    ("data_file_missing", SFT, ("--config.data.source=jsonl",
                                "--config.data.path={in}/absent.jsonl"),
     "data.path = '{in}/absent.jsonl': file not found"),
    ("hf_path_without_config_json", SFT, ("--config.model.hf_path={in}/weights_only",),
     "model.hf_path = '{in}/weights_only': no config.json"),
    ("hf_path_missing", SFT, ("--config.model.hf_path={in}/absent_model",),
     "model.hf_path = '{in}/absent_model': no such directory"),
    ("tokenizer_dir_without_tokenizer_json", SFT,
     ("--config.model.tokenizer={in}/no_tokenizer_json",),
     "model.tokenizer = '{in}/no_tokenizer_json': no tokenizer.json"),
    ("sft_checkpoint_mismatch", SFT, (*TINY_SFT, "--config.model.hidden_size=32"),
     "checkpoint step 1 under {workdir}/checkpoints: intact but does not fit"),
    ("sft_data_state_mismatch", SFT, (*TINY_SFT, "--config.data.num_examples=21"),
     "data iterator state num_examples = 20: this run's pipeline has 21"),
]


# The default run keeps one case per kind of failure (config, mesh, data, model path, restore);
# the other cases of a kind run with -m slow (each starts main.py: seconds per case).
SLOW_CASES = {"jsonl_malformed_row", "jsonl_missing_field", "hf_path_without_config_json",
              "tokenizer_dir_without_tokenizer_json", "sft_data_state_mismatch"}


@pytest.mark.parametrize("config, args, names", [
    pytest.param(*c[1:], id=c[0], marks=[pytest.mark.slow] if c[0] in SLOW_CASES else [])
    for c in CASES])
def test_user_error_prints_one_error_line_and_leaves_the_workdir_alone(
        config, args, names, sft_workdir, inputs, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(sft_workdir, workdir)
    before = _snapshot(workdir)
    out = _main(config, workdir, *(a.replace("{in}", str(inputs)) for a in args))
    _assert_one_error_line(out, names.replace("{in}", str(inputs)).replace(
        "{workdir}", str(workdir)))
    assert _snapshot(workdir) == before


@pytest.mark.slow
def test_rl_checkpoint_mismatch_is_one_error_line_without_event_loop_noise(rl_workdir, tmp_path):
    workdir = tmp_path / "run"
    shutil.copytree(rl_workdir, workdir)
    before = _snapshot(workdir)
    out = _main(RL, workdir, *TINY_RL, "--config.model.hidden_size=32")
    _assert_one_error_line(out, f"checkpoint step 2 under {workdir}/checkpoints: intact but "
                                f"does not fit")
    assert _snapshot(workdir) == before


def _assert_one_error_line(out: subprocess.CompletedProcess, names: str) -> None:
    assert out.returncode != 0, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: "), out.stderr[-3000:]
    assert names in last, last
    assert out.stderr.count("error: ") == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert "Event loop is closed" not in out.stderr, out.stderr[-3000:]


@pytest.mark.parametrize("args", [
    pytest.param(("--config.mesh.data=3",), id="validated_config"),
    pytest.param(("--config.model.num_kv_heads=3",), id="config_that_failed_validation",
                 marks=pytest.mark.slow)])
def test_debug_log_level_prints_the_traceback_before_the_error_line(args, tmp_path):
    out = _main(SFT, tmp_path / "run", *args, "--config.logging.level=DEBUG")
    assert out.returncode != 0
    assert "Traceback (most recent call last)" in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: "), out.stderr[-3000:]


@pytest.mark.parametrize("error, builtin", [
    (ConfigError, ValueError), (MeshShapeError, ValueError), (DatasetError, ValueError),
    (CheckpointError, ValueError), (TokenizerError, ValueError),
    (MissingFileError, FileNotFoundError), (CheckpointMismatchError, RuntimeError)])
def test_user_errors_keep_their_builtin_base(error, builtin):
    assert issubclass(error, UserError) and issubclass(error, builtin)


def test_model_and_tokenizer_directories_fail_with_user_errors(tmp_path):
    with pytest.raises(MissingFileError, match=r"config\.json: not found"):
        load_hf_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        load_hf_config(tmp_path)
    with pytest.raises(MissingFileError, match="no tokenizer.json there"):
        HFTokenizer(str(tmp_path))
    with pytest.raises(TokenizerError, match="'Qwen/Qwen2.5-0.5B': not a local directory"):
        load_tokenizer("Qwen/Qwen2.5-0.5B")


# ---- input paths: --dry_run and a run reject the same ones ------------------------------------


def _config(**sections: dict) -> object:
    cfg = base_config("sft")
    cfg.model.num_layers = 1
    for section, values in sections.items():
        for key, value in values.items():
            cfg[section][key] = value
    return from_config_dict(cfg)


def _word_tokenizer(out: pathlib.Path) -> None:
    """A loadable three-word tokenizer.json and its tokenizer_config.json (EOS ``</s>``)."""
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"</s>": 0, "a": 1, "b": 2}, unk_token="</s>")).save(
        str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))


@pytest.fixture
def good_inputs(tmp_path: pathlib.Path) -> pathlib.Path:
    """A model directory, a tokenizer directory and data files with the files the job reads."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 256,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    (tmp_path / "model" / "model-00001-of-00001.safetensors").write_bytes(b"")
    (tmp_path / "tok").mkdir()
    _word_tokenizer(tmp_path / "tok")  # the dry run loads it, as the run does
    row = json.dumps({"question": "a", "answer": "b"}) + "\n"
    (tmp_path / "train.jsonl").write_text("\n" + row)  # a blank first line is skipped
    (tmp_path / "eval.jsonl").write_text(row)
    return tmp_path


def _good(d: pathlib.Path) -> dict[str, dict]:
    return {"model": {"hf_path": str(d / "model"), "tokenizer": str(d / "tok")},
            "data": {"source": "jsonl", "path": str(d / "train.jsonl"),
                     "eval_path": str(d / "eval.jsonl")}}


def test_dry_run_accepts_paths_that_hold_what_the_job_reads(good_inputs):
    check_input_paths(_config(**_good(good_inputs)))
    assert "# mesh" in jobs.dry_run(_config(**_good(good_inputs)))


@pytest.mark.parametrize("name", ["train.jsonl", "eval.jsonl"])
def test_dry_run_reads_the_first_row_of_each_data_file_as_the_run_will(good_inputs, name):
    (good_inputs / name).write_text(json.dumps({"prompt": "a", "response": "b"}) + "\n")

    with pytest.raises(DatasetError, match=rf"{name}:1: missing field\(s\) \['question', "
                                           rf"'answer'\] \(row has \['prompt', 'response'\]\)"):
        jobs.dry_run(_config(**_good(good_inputs)))


# (section, field, path relative to the inputs (None: delete this file first), message)
MISSING = [
    ("model", "hf_path", "absent", "model.hf_path = '{d}/absent': no such directory"),
    ("model", "hf_path", "train.jsonl", "model.hf_path = '{d}/train.jsonl': not a directory"),
    ("model", "hf_path", "-model/config.json", "model.hf_path = '{d}/model': no config.json "
                                               "there"),
    ("model", "hf_path", "-model/model-00001-of-00001.safetensors",
     "model.hf_path = '{d}/model': no *.safetensors there"),
    ("model", "tokenizer", "absent", "model.tokenizer = '{d}/absent': not 'auto' or 'char' and "
                                     "no such directory"),
    ("model", "tokenizer", "-tok/tokenizer.json", "model.tokenizer = '{d}/tok': no "
                                                  "tokenizer.json there"),
    ("data", "path", "absent.jsonl", "data.path = '{d}/absent.jsonl': file not found"),
    ("data", "path", "tok", "data.path = '{d}/tok': a directory, not a file"),
    ("data", "eval_path", "absent.jsonl", "data.eval_path = '{d}/absent.jsonl': file not found"),
]


@pytest.mark.parametrize("section, name, path, message", MISSING,
                         ids=[f"{m[0]}.{m[1]}={m[2]}" for m in MISSING])
def test_dry_run_and_run_reject_a_missing_input_path_the_same_way(
        section, name, path, message, good_inputs, tmp_path_factory, monkeypatch):
    monkeypatch.setattr(jobs.log, "setup", lambda level: None)  # keep the suite's log handlers
    values = _good(good_inputs)
    if path.startswith("-"):  # the directory stays, one file it needs goes
        path = path[1:]
        (good_inputs / path).unlink()
        path = str(pathlib.Path(path).parent)
    values[section][name] = str(good_inputs / path)
    config = _config(**values)
    expected = message.replace("{d}", str(good_inputs))
    with pytest.raises(ConfigError) as dry:
        jobs.dry_run(config)
    assert expected in str(dry.value)
    workdir = tmp_path_factory.mktemp("run") / "never_created"
    with pytest.raises(ConfigError) as run:
        jobs.run(config, str(workdir))
    assert str(run.value) == str(dry.value)
    assert not workdir.exists()


def test_eval_path_is_not_checked_when_no_held_out_examples_are_read(good_inputs):
    values = _good(good_inputs)
    values["data"].update(eval_path=str(good_inputs / "absent.jsonl"), eval_examples=0)
    check_input_paths(_config(**values))


def test_every_missing_path_is_named_in_one_error(good_inputs):
    values = _good(good_inputs)
    values["model"]["hf_path"] = str(good_inputs / "absent")
    values["data"]["path"] = str(good_inputs / "absent.jsonl")
    with pytest.raises(ConfigError, match=r"model\.hf_path = .*; data\.path = "):
        check_input_paths(_config(**values))


def test_synthetic_sources_ignore_the_file_fields(good_inputs):
    check_input_paths(_config(data={"source": "arithmetic",
                                    "path": str(good_inputs / "absent.jsonl")}))


@pytest.mark.parametrize("job, checked", [("export", False), ("compile", False), ("sft", True)])
def test_only_jobs_that_read_data_check_its_files(good_inputs, job, checked):
    import dataclasses

    from meshrl.configs import Job

    values = _good(good_inputs)
    values["data"]["path"] = str(good_inputs / "absent.jsonl")
    config = dataclasses.replace(_config(**values), job=Job(job))

    if checked:
        with pytest.raises(ConfigError, match=r"data\.path = "):
            check_input_paths(config)
    else:
        check_input_paths(config)  # an export reads the run's weights, never its data


def test_the_closing_table_lists_tb_only_when_the_run_wrote_it(tmp_path):
    from meshrl.trainer.report import rl_summary_table, sft_summary_table

    summary = {"steps": 2, "first_loss": 1.0, "final_loss": 0.5}
    assert "tb/" not in sft_summary_table(summary, str(tmp_path))
    assert "tb/" not in rl_summary_table(summary, str(tmp_path))
    (tmp_path / "tb").mkdir()
    assert "tb/" in sft_summary_table(summary, str(tmp_path))
    assert "tb/" in rl_summary_table(summary, str(tmp_path))
