"""What a run will use, and nothing silent about it: on a tiny Qwen2 saved by transformers (a
byte-level BPE tokenizer trained here, a ChatML template; ``real_model``), a checkpoint without
tokenizer.json is refused by the dry run and by the run whatever its vocabulary, the char
tokenizer is used only when asked for, chat rows without a checkpoint are refused (or the
built-in model is named), the dry run lists the checkpoint's architecture marked as its, and
neither a dry run nor a job prints JAX's TPU probe or Orbax's read-only notice."""

from __future__ import annotations

import json
import logging
import pathlib
import shutil
import subprocess
import sys

import pytest

from meshrl.configs import ConfigError, from_config_dict
from meshrl.configs import sft_chat as sft_chat_config
from meshrl.jobs import dispatch
from meshrl.models.tokenizer import resolve_tokenizer_spec
from meshrl.tests.jobs import real_model
from meshrl.tests.xla import cpu_env

ROOT = pathlib.Path(__file__).resolve().parents[2]
TPU_NOTICE = "Unable to initialize backend 'tpu'"
ORBAX_NOTICE = "Given directory is read only"


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("effective")
    real_model.save_qwen2(root / "qwen2")
    return {"qwen2": root / "qwen2",
            "chat": real_model.write_jsonl(root / "chat.jsonl", real_model.chat_rows(4, 0)),
            "gsm8k": real_model.write_jsonl(root / "gsm8k.jsonl", real_model.gsm8k_rows(4, 0))}


def _chat_config(files: dict[str, pathlib.Path], hf_path: pathlib.Path | None, **model):
    """configs/sft_chat.py:tiny on the chat rows, from ``hf_path`` (None: no checkpoint)."""
    cfg = sft_chat_config.get_config("tiny")
    cfg.data.path = cfg.data.eval_path = str(files["chat"])
    cfg.model.hf_path = str(hf_path) if hf_path else ""
    for key, value in model.items():
        setattr(cfg.model, key, value)
    return from_config_dict(cfg)


def _without_tokenizer(qwen2: pathlib.Path, out: pathlib.Path, vocab: int) -> pathlib.Path:
    """A copy of the checkpoint without tokenizer.json, its config.json saying ``vocab``."""
    shutil.copytree(qwen2, out)
    (out / "tokenizer.json").unlink()
    hf = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**hf, "vocab_size": vocab}))
    return out


@pytest.mark.parametrize("vocab", [512, 151_936])  # a byte-sized one and Qwen2.5's
def test_checkpoint_without_tokenizer_json_is_refused_by_dry_run_and_run_at_any_vocab(
        files, tmp_path, vocab):
    hf = _without_tokenizer(files["qwen2"], tmp_path / "hf", vocab)
    config = _chat_config(files, hf)
    workdir = tmp_path / "run"
    match = rf"model.hf_path = '{hf}': has no tokenizer.json"

    with pytest.raises(ConfigError, match=match):
        dispatch.dry_run(config)
    with pytest.raises(ConfigError, match=match):
        dispatch.run(config, str(workdir))

    assert not workdir.exists()


def test_char_tokenizer_with_hf_path_only_when_asked_and_only_without_tokenizer_json(
        files, tmp_path):
    hf = _without_tokenizer(files["qwen2"], tmp_path / "hf", 512)
    byte_model = _chat_config(files, hf, tokenizer="char").model
    shipped = _chat_config(files, files["qwen2"], tokenizer="char").model

    assert resolve_tokenizer_spec(byte_model) == "char"
    assert resolve_tokenizer_spec(_chat_config(files, files["qwen2"]).model) == str(
        files["qwen2"])
    with pytest.raises(ConfigError, match=r"model.tokenizer = 'char': model.hf_path = .* ships "
                                          r"its own tokenizer.json: set model.tokenizer = 'auto'"):
        resolve_tokenizer_spec(shipped)


def test_dry_run_lists_the_checkpoints_architecture_marked_as_from_it(files):
    out = dispatch.dry_run(_chat_config(files, files["qwen2"]))

    mark = f"# from {files['qwen2']}/config.json"
    hf = real_model.QWEN2_TINY
    for line in (f"model.arch = 'qwen2'  {mark}", f"model.vocab_size = {hf['vocab_size']}  {mark}",
                 f"model.hidden_size = {hf['hidden_size']}  {mark}",
                 f"model.tie_embeddings = True  {mark}", f"model.attention_bias = True  {mark}"):
        assert line in out.splitlines(), line
    # Runtime fields come from model.* and say so; the tokenizer line names the file and EOS.
    assert ("model.compute_dtype = 'bfloat16'  # from model.* (the checkpoint stores float32)"
            in out)
    assert f"model.tokenizer = 'auto'  # {files['qwen2']}/tokenizer.json:" in out
    assert "chat template yes" in out
    inputs = out.split("# inputs (checked)\n")[1].split("\n#")[0].splitlines()
    assert inputs == [f"  model.hf_path: {files['qwen2']}",
                      f"  tokenizer (model.tokenizer = 'auto'): {files['qwen2']}/tokenizer.json",
                      f"  data.path: {files['chat']}", f"  data.eval_path: {files['chat']}"]


def test_chat_rows_without_hf_path_are_refused_unless_the_tokenizer_is_named(
        files, tmp_path, caplog):
    with pytest.raises(ConfigError, match=r"data.path = '.*chat.jsonl' holds chat rows "
                                          r"\('messages'\) but model.hf_path is empty: set "
                                          r"model.hf_path"):
        dispatch.dry_run(_chat_config(files, None))

    with caplog.at_level(logging.WARNING):
        dispatch.dry_run(_chat_config(files, None, tokenizer="char"))

    named = [r.getMessage() for r in caplog.records if "holds chat rows" in r.getMessage()]
    assert len(named) == 1 and "training the built-in random llama model" in named[0]


def test_chat_rows_in_parquet_without_hf_path_are_refused(files, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(real_model.chat_rows(2, 0)), path)
    cfg = sft_chat_config.get_config("tiny")
    cfg.data.source, cfg.data.path, cfg.data.eval_path = "parquet", str(path), str(path)

    with pytest.raises(ConfigError, match=r"chat.parquet' holds chat rows \('messages'\)"):
        dispatch.dry_run(from_config_dict(cfg))


def test_prompt_rows_without_hf_path_need_no_chat_model(files, caplog):
    cfg = sft_chat_config.get_config("tiny")
    cfg.data.path = cfg.data.eval_path = str(files["gsm8k"])

    with caplog.at_level(logging.WARNING):
        out = dispatch.dry_run(from_config_dict(cfg))

    assert "model.hf_path = ''  # empty: a random init of model.*" in out
    assert not any("chat rows" in r.getMessage() for r in caplog.records)


def test_dry_run_on_a_host_without_libtpu_prints_no_tpu_probe_notice(files, tmp_path):
    env = cpu_env(8)
    env.pop("JAX_PLATFORMS")  # let JAX probe every backend, as on a user's machine

    proc = subprocess.run([sys.executable, str(ROOT / "main.py"), "--config",
                           str(ROOT / "configs" / "sft_chat.py") + ":tiny",
                           f"--config.model.hf_path={files['qwen2']}",
                           f"--config.data.path={files['chat']}",
                           f"--config.data.eval_path={files['chat']}", "--dry_run"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "# resolved config" in proc.stdout
    assert TPU_NOTICE not in proc.stderr and ORBAX_NOTICE not in proc.stderr, proc.stderr


def test_orbax_read_only_notice_is_dropped_and_other_absl_warnings_kept(tmp_path, caplog):
    import orbax.checkpoint as ocp
    from absl import logging as absl_logging

    dispatch.quiet_known_noise()
    with caplog.at_level(logging.INFO):
        ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(
            read_only=True, create=False)).close()
        absl_logging.warning("a checkpoint warning a user needs")

    messages = [r.getMessage() for r in caplog.records]
    assert not any(ORBAX_NOTICE in m for m in messages), messages
    assert "a checkpoint warning a user needs" in messages
