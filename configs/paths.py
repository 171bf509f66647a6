"""The local files and directories a job reads, checked before anything runs.

``jobs/dispatch.py`` calls ``check_input_paths`` in ``--dry_run`` and at the start of every run,
so a dry run rejects exactly the paths a run would reject, before any compilation, thread or
write under the workdir.
"""

from __future__ import annotations

import os

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config

_FILE_SOURCES = ("jsonl", "parquet")
_HF_DIR = "a local Hugging Face checkpoint directory (config.json + *.safetensors)"


def _model_problems(hf_path: str) -> list[str]:
    if not hf_path:
        return []
    where = f"model.hf_path = {hf_path!r}"
    if not os.path.isdir(hf_path):
        what = "not a directory" if os.path.exists(hf_path) else "no such directory"
        return [f"{where}: {what}: point it at {_HF_DIR}"]
    names = os.listdir(hf_path)
    missing = [want for want, found in
               (("config.json", "config.json" in names),
                ("*.safetensors", any(n.endswith(".safetensors") for n in names))) if not found]
    if missing:
        return [f"{where}: no {' and no '.join(missing)} there: point it at {_HF_DIR} "
                f"(pickled *.bin weights are not read)"]
    return []


def _tokenizer_problems(spec: str) -> list[str]:
    if spec == "char":
        return []
    where = f"model.tokenizer = {spec!r}"
    fix = "use 'char' or a local directory holding tokenizer.json (downloads are not supported)"
    if not os.path.isdir(spec):
        return [f"{where}: not 'char' and no such directory: {fix}"]
    if not os.path.isfile(os.path.join(spec, "tokenizer.json")):
        return [f"{where}: no tokenizer.json there: {fix}"]
    return []


def _data_problems(source: str, paths: dict[str, str]) -> list[str]:
    if source not in _FILE_SOURCES:
        return []
    out = []
    for name, path in paths.items():
        if not path or os.path.isfile(path):
            continue  # an empty data.path is a schema error; an empty eval_path means no eval
        what = "a directory, not a file" if os.path.isdir(path) else "file not found"
        out.append(f"{name} = {path!r}: {what}: point {name} at a local {source} file")
    return out


def check_input_paths(config: Config) -> None:
    """Raise ``ConfigError`` naming every input path that does not hold what the job reads:
    ``model.hf_path`` (a directory with config.json and *.safetensors), ``model.tokenizer``
    unless ``'char'`` (a directory with tokenizer.json) and, for file sources, ``data.path``
    and ``data.eval_path`` when held-out examples are read (files). The sample job's weights
    read from the workdir are checked where that job resolves them."""
    data = config.data
    files = {"data.path": data.path, "data.eval_path": data.eval_path if data.eval_examples else ""}
    problems = [*_model_problems(config.model.hf_path),
                *_tokenizer_problems(config.model.tokenizer),
                *_data_problems(data.source, files)]
    if problems:
        raise ConfigError("; ".join(problems))
