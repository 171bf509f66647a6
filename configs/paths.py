"""The local files and directories a job reads, checked before anything runs.

``jobs/dispatch.py`` calls ``check_input_paths`` in ``--dry_run`` and at the start of every run,
so a dry run rejects exactly the paths a run would reject, before any compilation, thread or
write under the workdir.
"""

from __future__ import annotations

import json
import os

from meshrl.configs.fields import ConfigError
from meshrl.configs.schema import Config, Job

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
    if spec in ("auto", "char"):
        return []  # the model's own tokenizer is checked with the model (models/build.py)
    where = f"model.tokenizer = {spec!r}"
    fix = ("use 'auto', 'char' or a local directory holding tokenizer.json (downloads are not "
           "supported)")
    if not os.path.isdir(spec):
        return [f"{where}: not 'auto' or 'char' and no such directory: {fix}"]
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


def preference_file_problem(name: str, path: str) -> str | None:
    """What is wrong with ``path`` (the config field ``name``) as the preference JSONL file the
    DPO job reads (``datasets/preference.py``), or None."""
    if os.path.isfile(path):
        return None
    what = "a directory, not a file" if os.path.isdir(path) else "no such file"
    return (f"{name} = {path!r}: {what}: give a local preference JSONL file (rows: messages, "
            f"chosen, rejected)")


def _preference_files(config: Config) -> list[tuple[str, str]]:
    """(field, path) of the preference files the DPO job reads: set ones only (an empty
    dpo.path means the synthetic task; an empty dpo.eval_path no held-out pairs)."""
    if config.job != Job.DPO:
        return []
    dpo = config.dpo
    return [(name, path) for name, path in (("dpo.path", dpo.path),
                                            ("dpo.eval_path", dpo.eval_path)) if path]


def _teacher_problems(config: Config) -> list[str]:
    # What the directory holds (config.json or a verified checkpoint) is checked where the RL
    # job loads the teacher (jobs/distill.py), before its warm start trains.
    teacher = config.distill.teacher
    if config.job != Job.RL or not teacher or os.path.isdir(teacher):
        return []
    return [f"distill.teacher = {teacher!r}: no such directory: point it at a Hugging Face "
            f"checkpoint directory or a meshrl run's workdir"]


def check_input_paths(config: Config) -> None:
    """Raise ``ConfigError`` naming every input path that does not hold what the job reads:
    ``model.hf_path`` (a directory with config.json and *.safetensors), ``model.tokenizer``
    unless ``'char'`` (a directory with tokenizer.json) and, for file sources of a job that
    reads data (``reads_data``), ``data.path`` and ``data.eval_path`` when held-out examples
    are read (files); for the DPO job ``dpo.path`` and ``dpo.eval_path`` instead (preference
    JSONL files, ``preference_file_problem``). The generate job's weights
    read from the workdir are checked where that job resolves them."""
    data = config.data
    files = {"data.path": data.path, "data.eval_path": data.eval_path if data.eval_examples else ""}
    problems = [*_model_problems(config.model.hf_path),
                *_tokenizer_problems(config.model.tokenizer),
                *(_data_problems(data.source, files) if reads_data(config) else []),
                *filter(None, (preference_file_problem(name, path)
                               for name, path in _preference_files(config))),
                *_teacher_problems(config)]
    if problems:
        raise ConfigError("; ".join(problems))


def reads_data(config: Config) -> bool:
    """Whether the job reads ``data.*`` files: export and compile read none, DPO its
    ``dpo.*`` files."""
    return config.job not in (Job.EXPORT, Job.COMPILE, Job.DPO)


def input_paths(config: Config) -> list[tuple[str, str]]:
    """(field, path) of every local input ``check_input_paths`` checks, in that order; the
    model's tokenizer directory is the model's to report (``models/build.py``)."""
    data = config.data
    out = [("model.hf_path", config.model.hf_path)]
    if config.model.tokenizer not in ("auto", "char"):
        out.append(("model.tokenizer", config.model.tokenizer))
    if data.source in _FILE_SOURCES and reads_data(config):
        out += [("data.path", data.path), ("data.eval_path", data.eval_path
                                           if data.eval_examples else "")]
    out += _preference_files(config)
    return [(name, path) for name, path in out if path]


def _has_messages(path: str, source: str) -> bool:
    """Whether the file's rows are chat rows (a ``messages`` field), from its first row only:
    the data pipeline checks every row when it reads them."""
    if source == "parquet":
        import pyarrow.parquet as pq

        return "messages" in pq.read_schema(path).names
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    return False  # the pipeline names the bad line when it reads it
                return isinstance(row, dict) and "messages" in row
    return False


def check_chat_model(config: Config) -> str | None:
    """Chat rows (``messages``) in data.path train a chat model: SFT or RL of them without
    ``model.hf_path`` would train the built-in random model with the char tokenizer's makeshift
    chat format. Refused (``ConfigError``) unless the config names its tokenizer on purpose
    (``model.tokenizer`` not 'auto'); then the returned warning line names the model."""
    data, model = config.data, config.model
    if (config.job not in (Job.SFT, Job.RL) or model.hf_path or data.source not in _FILE_SOURCES
            or not os.path.isfile(data.path) or not _has_messages(data.path, data.source)):
        return None
    what = f"data.path = {data.path!r} holds chat rows ('messages') but model.hf_path is empty"
    if model.tokenizer == "auto":
        raise ConfigError(f"{what}: set model.hf_path to a local chat checkpoint (with its "
                          f"tokenizer and chat template), or set model.tokenizer = 'char' to "
                          f"train the built-in random model on purpose")
    return (f"{what}: training the built-in random {model.arch} model of model.* "
            f"({model.num_layers} layers, hidden {model.hidden_size}, vocab {model.vocab_size}) "
            f"with tokenizer {model.tokenizer!r}, as model.tokenizer asks")
