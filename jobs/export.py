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
* ``export.format = 'peft'``: a LoRA run's checkpoint as ``OUT/adapter_model.safetensors`` +
  ``OUT/adapter_config.json`` that ``peft.PeftModel.from_pretrained`` loads onto the run's base,
  which must be a Hugging Face directory (``model.hf_path``; ``models/peft_export.py``). A
  published version holds the merged weights the sampler loads, not adapters, so a PEFT export
  reads the trainer checkpoint; a published version, a run without LoRA or a base that is no HF directory (a
  warm start, a random init) is one ``ConfigError`` line that names ``export.format = 'merged'``
  where that exports the same model.
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
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config
from meshrl.jobs import weights_source
from meshrl.mesh import create_mesh
from meshrl.models import save_hf_checkpoint
from meshrl.models.lora import projections
from meshrl.models.peft_export import save_peft_adapter
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


def check_peft(src: weights_source.WeightSource, workdir: str) -> str:
    """The HF base directory a PEFT export of ``src`` names; a ConfigError when there is none."""
    head = "export.format = 'peft'"
    if src.kind == "version":
        raise ConfigError(f"{head}: weight version {src.version} holds merged weights, not "
                          f"adapters: export the adapters from the run's trainer checkpoint "
                          f"(export.version = -1, export.step = the step to export), or this "
                          f"version as a merged model with export.format = 'merged'")
    if src.base is None:
        raise ConfigError(f"{head}: checkpoint step {src.step} of {workdir} is no LoRA run "
                          f"(lora.rank = 0): export it with export.format = 'merged'")
    if src.base.kind != "hf_path":
        raise ConfigError(f"{head}: the adapters of checkpoint step {src.step} adapt "
                          f"{src.base.describe('')}, not a Hugging Face directory a PEFT "
                          f"adapter can name: export the merged model with "
                          f"export.format = 'merged'")
    return str(pathlib.Path(src.model.hf_path).absolute())


def _write(save: Any, out: pathlib.Path, tok: str | None) -> list[str]:
    """What ``save(directory)`` writes (and the tokenizer files in ``tok``) at ``out``, moved
    into place whole; the tokenizer files copied (a generation_config.json the checkpoint
    ships is kept, the special ids it lacks added)."""
    # os.mkdir, not tempfile.mkdtemp: the export keeps the user's umask, not mode 0700.
    tmp = out.parent / f".{out.name}.{os.getpid()}.{time.time_ns()}"
    tmp.mkdir()
    try:
        save(tmp)
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


def _saver(config: Config, workdir: str, src: weights_source.WeightSource, peft_base: str
           ) -> tuple[Callable[[pathlib.Path, bool], None], int]:
    """(``save(directory, write)`` of the export, the weight version); ``peft_base`` (the HF
    base directory) set: the PEFT adapter of the checkpoint's adapters, without loading the
    base, else the full (merged) model."""
    # Sharded as the trainer's FSDP rules shard params: the least memory per device.
    mesh = create_mesh(config.mesh)
    target = weights_source.skeleton(config, src, mesh, "train", fsdp=True)
    if peft_base:
        w, version = weights_source.lora_weights(workdir, src, target, with_base=False)
        every = projections(w.base.graphdef, w.base.params)

        def save_peft(d: pathlib.Path, write: bool = True) -> None:
            save_peft_adapter(w.base.arch, w.setup.cfg, w.setup.lora.targets, every,
                              w.adapters, peft_base, d, write=write)
        return save_peft, version
    loaded, version = weights_source.fill(config, workdir, src, target)
    ids = special_ids(loaded.tokenizer)
    model = nnx.merge(loaded.graphdef, loaded.params)

    def save_model(d: pathlib.Path, write: bool = True) -> None:
        save_hf_checkpoint(model, d, write=write, special_ids=ids)
    return save_model, version


def run(config: Config, workdir: str) -> pathlib.Path:
    """Export (see the module docstring); returns the output directory."""
    out = check_output(config.export.path)
    src = resolve_export(config, workdir)
    peft = config.export.format == "peft"
    base = check_peft(src, workdir) if peft else ""
    tok = None if peft else tokenizer_dir(src)
    save, version = _saver(config, workdir, src, base)
    log.info("exporting %s%s", src.describe(workdir, version),
             " as a PEFT adapter" if peft else "")
    primary = jax.process_index() == 0
    # Every process takes part in gathering the params; process 0 alone writes (the same
    # path on a shared filesystem), and the others wait for the finished directory.
    copied: list[str] = []
    try:
        if primary:
            copied = _write(save, out, tok)
        else:
            save(out, False)
    finally:
        multihost.sync("meshrl-export-done")
    log.info("exported to %s (tokenizer files: %s)", out, copied or "none")
    return out
