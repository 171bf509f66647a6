"""Example sources: local JSONL / Parquet files and the synthetic tasks.

Every example is a dict with ``prompt`` (str), ``answer`` (str ground truth), ``origin`` (where it
came from, e.g. ``"data/gsm8k.jsonl:12"``, for error messages), optionally ``messages`` (SFT chat
data) and any reward fields (countdown: ``numbers``, ``target``; other columns of a file row).
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

from jinja2.exceptions import TemplateError

from meshrl.configs.schema import DataConfig
from meshrl.datasets import synthetic
from meshrl.utils.errors import UserError
from meshrl.utils.log import get_logger

log = get_logger("datasets")

SYNTHETIC = ("arithmetic", "countdown")


class DatasetError(UserError, ValueError):
    """Bad or missing data; the message names the file (and line) or the config field."""


def _check_messages(messages: Any, origin: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise DatasetError(f"{origin}: 'messages' = {messages!r:.80}: must be a non-empty list "
                           f"of {{'role', 'content'}} dicts")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str)):
            raise DatasetError(f"{origin}: message {m!r:.120}: every message needs string "
                               f"'role' and 'content'")
    return messages


def row_to_example(row: Any, data: DataConfig, origin: str, require_answer: bool = True) -> dict:
    """Normalise one file row; a row that cannot be used raises naming ``origin``. Without
    ``require_answer`` (prompts to sample for) a row may lack the answer field."""
    if not isinstance(row, dict):
        raise DatasetError(f"{origin}: row {row!r:.60} ({type(row).__name__}): every row must be "
                           f"a JSON object")
    if "messages" in row:
        messages = _check_messages(row["messages"], origin)
        extra = {k: v for k, v in row.items() if k != "messages"}
        if messages[-1]["role"] == "assistant":
            # SFT chat data: the last assistant turn is the response, the rest is the prompt.
            prompt_messages, answer = messages[:-1], messages[-1]["content"]
            extra["_answer_message"] = dict(messages[-1])
            if not prompt_messages:
                raise DatasetError(f"{origin}: 'messages' has only an assistant turn: "
                                   f"add the user turn it answers")
        else:  # the answer comes from its field, checked as a plain row's
            _check_fields(row, data, origin, require_answer, (data.answer_field,))
            prompt_messages, answer = messages, _answer(row, data, origin)
            extra.pop(data.answer_field, None)
        last_user = next((m["content"] for m in reversed(prompt_messages)
                          if m["role"] == "user"), prompt_messages[-1]["content"])
        out = {**extra, "prompt": last_user, "messages": prompt_messages, "origin": origin}
        return out if answer is None else {**out, "answer": answer}
    _check_fields(row, data, origin, require_answer, (data.prompt_field, data.answer_field))
    prompt = row[data.prompt_field]
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(f"{origin}: field {data.prompt_field!r} = {prompt!r:.80}: must be a "
                           f"non-empty string")
    answer = _answer(row, data, origin)
    extra = {k: v for k, v in row.items() if k not in (data.prompt_field, data.answer_field)}
    if answer is None:  # a prompt to sample for: no ground truth to invent
        return {**extra, "prompt": prompt, "origin": origin}
    return {**extra, "prompt": prompt, "answer": answer, "origin": origin}


def _check_fields(row: dict, data: DataConfig, origin: str, require_answer: bool,
                  fields: tuple[str, ...]) -> None:
    """Raise naming the ``fields`` ``row`` lacks (the answer field only where required)."""
    missing = [f for f in fields if f not in row
               and (require_answer or f != data.answer_field)]
    if not missing:
        return
    if "messages" in row:  # a chat row whose last turn is not the assistant's
        raise DatasetError(f"{origin}: 'messages' ends with a {row['messages'][-1]['role']!r} "
                           f"turn and the row has no {data.answer_field!r} field: end the "
                           f"messages with the assistant turn to train on, or set "
                           f"data.answer_field to the row's answer")
    raise DatasetError(f"{origin}: missing field(s) {missing} (row has {sorted(row)}): set "
                       f"data.prompt_field / data.answer_field to match the file, or give chat "
                       f"rows a 'messages' list")


def _answer(row: dict, data: DataConfig, origin: str) -> str | None:
    """The row's answer field as text (None: it has none), a string or a number."""
    if data.answer_field not in row:
        return None
    answer = row[data.answer_field]
    if not isinstance(answer, (str, int, float)) or isinstance(answer, bool):
        raise DatasetError(f"{origin}: field {data.answer_field!r} = {answer!r:.80}: must be a "
                           f"string or number")
    return str(answer)


def jsonl_rows(path: str) -> Iterator[tuple[int, dict | None]]:
    """``(line number, parsed row)`` of a JSONL file, None for a blank line. Lines end at
    ``\n`` alone (a ``\r`` inside a JSON string is data); a line that is not UTF-8 or not JSON
    raises ``DatasetError`` naming ``path:line``."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at "
                                   f"column {e.start + 1}): JSONL files must be UTF-8") from None
            if not line.strip():
                yield lineno, None
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{lineno}: malformed JSON ({e.msg} at column "
                                   f"{e.colno}) in {line.strip()!r:.60}: each line must hold "
                                   f"one JSON object") from None


def read_jsonl(path: str, data: DataConfig, stats: dict[str, int], require_answer: bool = True
               ) -> list[dict]:
    examples = []
    for lineno, row in jsonl_rows(path):
        if row is None:
            stats["blank_lines"] = stats.get("blank_lines", 0) + 1
            continue
        examples.append(row_to_example(row, data, f"{path}:{lineno}", require_answer))
    return examples


def read_parquet(path: str, data: DataConfig, require_answer: bool = True) -> list[dict]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a corrupt file
        raise DatasetError(f"{path}: not a readable Parquet file ({e}): check "
                           f"data.source and the file") from None
    # Parquet rows are numbered from 1 like JSONL lines, so messages read the same way.
    return [row_to_example(row, data, f"{path}:row {i}", require_answer)
            for i, row in enumerate(table.to_pylist(), start=1)]


def check_first_row(path: str, data: DataConfig, require_answer: bool = True) -> None:
    """Read the first row of ``path`` as the pipeline will (``row_to_example``): a file whose
    fields do not fit ``data.*`` fails here with the pipeline's error, before a run starts."""
    if data.source == "parquet":
        import pyarrow.parquet as pq

        try:
            batch = next(pq.ParquetFile(path).iter_batches(batch_size=1), None)
        except Exception as e:  # pyarrow raises several types for a corrupt file
            raise DatasetError(f"{path}: not a readable Parquet file ({e}): check "
                               f"data.source and the file") from None
        rows = [] if batch is None else batch.to_pylist()
        if rows:
            row_to_example(rows[0], data, f"{path}:row 1", require_answer)
        return
    for lineno, row in jsonl_rows(path):
        if row is not None:
            row_to_example(row, data, f"{path}:{lineno}", require_answer)
            return


def read_file(path: str, data: DataConfig, stats: dict[str, int], field_name: str,
              require_answer: bool = True) -> list[dict]:
    if not os.path.isfile(path):
        raise DatasetError(f"{field_name} = {path!r}: file not found: point {field_name} at a "
                           f"local {data.source} file")
    examples = (read_parquet(path, data, require_answer) if data.source == "parquet"
                else read_jsonl(path, data, stats, require_answer))
    if not examples:
        raise DatasetError(f"{field_name} = {path!r}: the file holds no examples: add rows or "
                           f"point {field_name} at another file")
    return examples


def load_train(data: DataConfig, stats: dict[str, int]) -> list[dict]:
    """The training examples of ``data`` (synthetic: stream 0, seeded by data.shuffle_seed)."""
    if data.source in SYNTHETIC:
        return synthetic.generate(data.source, data.shuffle_seed, synthetic.TRAIN_STREAM,
                                  data.num_examples, data.difficulty, data.ops)
    return read_file(data.path, data, stats, "data.path")


def load_eval(data: DataConfig) -> list[dict]:
    """Held-out examples. Synthetic: stream 1 with every prompt of the training set removed.
    Files: the first ``data.eval_examples`` rows of ``data.eval_path`` (none if unset)."""
    if data.eval_examples == 0:
        return []
    if data.source not in SYNTHETIC:
        if not data.eval_path:
            log.warning("data.eval_path is empty: no held-out examples for source %r",
                        data.source)
            return []
        return read_file(data.eval_path, data, {}, "data.eval_path")[:data.eval_examples]
    return disjoint_examples(
        lambda start: synthetic.generate(data.source, data.shuffle_seed, synthetic.EVAL_STREAM,
                                         data.eval_examples, data.difficulty, data.ops,
                                         start=start),
        {ex["prompt"] for ex in load_train(data, {})}, data)


def disjoint_examples(chunk_at: Callable[[int], list[dict]], taken: set[str],
                      data: DataConfig) -> list[dict]:
    """``data.eval_examples`` held-out examples of a synthetic task, read in chunks from
    ``chunk_at(start)``, each prompt once and none in ``taken`` (the training prompts)."""
    out: list[dict] = []
    start, budget = 0, 20 * data.eval_examples + 1000  # bounded: tiny task spaces run dry
    while len(out) < data.eval_examples and start < budget:
        chunk = chunk_at(start)
        start += len(chunk)
        for ex in chunk:
            if ex["prompt"] not in taken:
                taken.add(ex["prompt"])
                out.append(ex)
    if len(out) < data.eval_examples:
        log.warning("only %d of data.eval_examples = %d held-out prompts are disjoint from the "
                    "training set (task space too small at difficulty %d)", len(out),
                    data.eval_examples, data.difficulty)
    return out[:data.eval_examples]


@contextlib.contextmanager
def row_errors(ex: dict) -> Iterator[None]:
    """A chat template that refuses a row (``raise_exception``: roles that do not alternate, a
    system turn where none may be) as a ``DatasetError`` naming the row's file and line."""
    try:
        yield
    except TemplateError as e:
        raise DatasetError(f"{ex.get('origin', '?')}: the chat template refused this row "
                           f"({' '.join(str(e).split())}): fix its messages") from None
