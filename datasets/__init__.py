"""Data pipelines: synthetic tasks, JSONL/Parquet sources, tokenization, packing (grain)."""

from meshrl.datasets.pipeline import (
    PromptIterator,
    SFTIterator,
    eval_examples,
    make_prompt_iterator,
    make_sft_iterator,
    merge_row_states,
)
from meshrl.datasets.sources import DatasetError

__all__ = ["DatasetError", "PromptIterator", "SFTIterator", "eval_examples",
           "make_prompt_iterator", "make_sft_iterator", "merge_row_states"]
