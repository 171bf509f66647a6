"""Prompts to sample for, read and rendered as training renders them: the ``data.*`` rows
(JSONL/Parquet, the answer optional; or the synthetic task) through the pipeline's
``prompt_text`` + ``encode_prompt`` (chat template when the tokenizer has one, BOS), so a
prompt's ids equal the RL prompt iterator's for the same row."""

from __future__ import annotations

from meshrl.configs.schema import DataConfig
from meshrl.datasets import sources
from meshrl.datasets.render import encode_prompt, prompt_text
from meshrl.datasets.sources import DatasetError
from meshrl.models.tokenizer import Tokenizer


def read_prompts(data: DataConfig) -> list[dict]:
    """Example dicts (``prompt``, ``origin``, optionally ``messages``, the row's other fields):
    the data.path file (answer field optional) or the synthetic task's training examples."""
    if data.source in sources.SYNTHETIC:
        return sources.load_train(data, {})
    return sources.read_file(data.path, data, {}, "data.path", require_answer=False)


def encode_prompts(examples: list[dict], tokenizer: Tokenizer, data: DataConfig, limit: int
                   ) -> tuple[list[tuple[dict, str, list[int]]], int]:
    """([(example, prompt text, prompt ids)], dropped): rendered exactly as the RL pipeline does;
    prompts over ``limit`` tokens are dropped (counted) or raise (``data.on_overlong``)."""
    kept, dropped = [], 0
    for ex in examples:
        text = prompt_text(ex, tokenizer)
        ids = encode_prompt(text, tokenizer)
        if 1 <= len(ids) <= limit:
            kept.append((ex, text, ids))
        elif data.on_overlong == "raise":
            raise DatasetError(f"{ex.get('origin', '?')}: prompt of {len(ids)} tokens > {limit}: "
                               f"shorten it, or raise data.max_prompt_len and the largest "
                               f"sampler.prompt_buckets (data.on_overlong = 'raise')")
        else:
            dropped += 1
    if not kept:
        what = (f"data.source = {data.source!r}" if data.source in sources.SYNTHETIC
                else f"data.path = {data.path!r}")
        raise DatasetError(f"{what}: none of its {len(examples)} prompts is 1..{limit} tokens "
                           f"long: raise data.max_prompt_len and the largest "
                           f"sampler.prompt_buckets, or shorten the prompts")
    return kept, dropped
