"""The ``export`` job: a run's params as a Hugging Face checkpoint that transformers loads.

  python main.py --config CFG --workdir RUN --config.job=export --config.export.path=OUT \\
      [--config.export.step=N | --config.export.version=V]

Contract:
* Weights: the newest verified checkpoint under ``<workdir>/checkpoints`` (``export.step``: that
  step), or the published version ``<workdir>/weights/<export.version>``. The architecture is
  the model section the run saved with the checkpoint (a version: with the run's newest
  checkpoint, or this config's when the run has none), resolved as every job builds it
  (``model.hf_path``'s config.json when set).
* Output: ``OUT/model.safetensors`` + ``OUT/config.json`` (params in the dtype they are stored
  in; the tokenizer's eos/bos/pad ids in it and in ``OUT/generation_config.json``), plus the
  tokenizer files of the run's tokenizer when it is a directory (``model.tokenizer`` or the
  ``model.hf_path`` checkpoint's own). Written into a temporary sibling directory and
  renamed to ``OUT`` whole: a failed export leaves nothing at ``OUT``. ``OUT`` gets the
  user's umask like any directory they create.
* Processes: on several (``distributed.*``), every process restores its shards and takes part
  in gathering each tensor; process 0 alone writes ``OUT`` (a path all processes share).
* Errors: no checkpoint, a missing step or version, an unusable ``export.path``: one
  ``ConfigError`` line; nothing is written.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from typing import Any

import jax
from flax import nnx

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.jobs import weights_source
from meshrl.mesh import create_mesh
from meshrl.models import save_hf_checkpoint
from meshrl.models.tokenizer import Tokenizer, resolve_tokenizer_spec
from meshrl.utils import multihost
from meshrl.utils.log import get_logger

log = get_logger("models")

# What transformers' tokenizer loaders read from a model directory.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "added_tokens.json",
                   "generation_config.json")


def check_output(path: str) -> pathlib.Path:
    """``export.path`` as an absolute path; ``ConfigError`` unless it is absent or empty."""
    if not path:
        raise ConfigError("export.path = '': required with job = 'export': set it to the "
                          "directory to write the Hugging Face checkpoint to")
    out = pathlib.Path(path).absolute()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        what = "not a directory" if not out.is_dir() else "a non-empty directory"
        raise ConfigError(f"export.path = {path!r}: {what}: give an absent or empty directory "
                          f"(an export never mixes with other files)")
    if not out.parent.is_dir():
        raise ConfigError(f"export.path = {path!r}: its parent {out.parent} is not a "
                          f"directory: create it first")
    return out


def resolve_export(config: Config, workdir: str | pathlib.Path) -> weights_source.WeightSource:
    """Which weights ``config.export`` names under ``workdir``; loads none of them."""
    e = config.export
    words = weights_source.Wording(
        source="job = 'export'", step="export.step", version="export.version",
        instead="export a checkpoint (export.version = -1)" if e.version != -1
        else "export a published weight version (export.version)")
    kind = "checkpoint" if e.version == -1 else "version"
    return weights_source.resolve(config, workdir, kind, words, step=e.step, version=e.version)


def tokenizer_dir(src: weights_source.WeightSource) -> str | None:
    """The run's tokenizer directory, or None for the built-in char tokenizer."""
    spec = resolve_tokenizer_spec(src.model)
    return None if spec == "char" else spec


def special_ids(tokenizer: Tokenizer) -> dict[str, int | None]:
    """The token ids transformers' ``generate`` reads from config.json / generation_config.json."""
    return {"eos_token_id": tokenizer.eos_id, "bos_token_id": tokenizer.bos_id,
            "pad_token_id": tokenizer.pad_id}


def _merge_generation_config(release: pathlib.Path, written: pathlib.Path) -> None:
    """The checkpoint's own generation_config.json (its sampling defaults, its EOS list), with
    the special ids written from the tokenizer filling the ones it lacks."""
    ours = json.loads(written.read_text())
    try:
        theirs = json.loads(release.read_text())
    except ValueError:
        log.warning("%s: not valid JSON; exported only the special token ids", release)
        return
    if isinstance(theirs, dict):
        merged = {**theirs, **{k: v for k, v in ours.items() if theirs.get(k) is None}}
        written.write_text(json.dumps(merged, indent=2))


def _write(model: Any, out: pathlib.Path, tok: str | None, ids: dict[str, int | None]
           ) -> list[str]:
    """The HF checkpoint of ``model`` (and the tokenizer files in ``tok``) at ``out``, moved
    into place whole; the tokenizer files copied (a generation_config.json the checkpoint
    ships is kept, the special ids it lacks added)."""
    # os.mkdir, not tempfile.mkdtemp: the export keeps the user's umask, not mode 0700.
    tmp = out.parent / f".{out.name}.{os.getpid()}.{time.time_ns()}"
    tmp.mkdir()
    try:
        save_hf_checkpoint(model, tmp, special_ids=ids)
        copied = [n for n in TOKENIZER_FILES if tok and os.path.isfile(os.path.join(tok, n))]
        for name in copied:
            if name == "generation_config.json":
                _merge_generation_config(pathlib.Path(tok) / name, tmp / name)
            else:
                shutil.copyfile(os.path.join(tok, name), tmp / name)
        if out.exists():
            out.rmdir()  # checked empty above
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return copied


def run(config: Config, workdir: str) -> pathlib.Path:
    """Export (see the module docstring); returns the output directory."""
    out = check_output(config.export.path)
    src = resolve_export(config, workdir)
    tok = tokenizer_dir(src)
    # Sharded as the trainer's FSDP rules shard params: the least memory per device.
    loaded, version = weights_source.load_source(config, workdir, src, create_mesh(config.mesh),
                                                 "train", fsdp=True)
    log.info("exporting %s", src.describe(workdir, version))
    ids = special_ids(loaded.tokenizer)
    model = nnx.merge(loaded.graphdef, loaded.params)
    primary = jax.process_index() == 0
    # Every process takes part in gathering the params; process 0 alone writes (the same
    # path on a shared filesystem), and the others wait for the finished directory.
    copied: list[str] = []
    try:
        if primary:
            copied = _write(model, out, tok, ids)
        else:
            save_hf_checkpoint(model, out, write=False)
    finally:
        multihost.sync("meshrl-export-done")
    log.info("exported to %s (tokenizer files: %s)", out, copied or "none, char tokenizer")
    return out
