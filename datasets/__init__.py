"""Data pipelines: synthetic tasks, JSONL/Parquet sources, tokenization, packing (grain)."""

from meshrl.datasets.pipeline import (
    PromptIterator,
    SFTIterator,
    eval_examples,
    make_prompt_iterator,
    make_sft_iterator,
    merge_row_states,
)
from meshrl.datasets.preference import (
    PreferenceIterator,
    eval_pair_batches,
    load_pairs,
    tokenize_pairs,
)
from meshrl.datasets.sources import DatasetError

__all__ = ["DatasetError", "PreferenceIterator", "PromptIterator", "SFTIterator",
           "eval_examples", "eval_pair_batches", "load_pairs", "make_prompt_iterator",
           "make_sft_iterator", "merge_row_states", "tokenize_pairs"]
