"""The transformers side of ``benchmarks/sampler.py``: ``generate`` timed greedy for a fixed
number of new tokens, or sampled with each row stopping at its own length."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np


def stop_at(prompt_len: int, lengths_B: Sequence[int]):
    """A per-row ``StoppingCriteria``: row b is done once it generated ``lengths_B[b]``
    tokens (``generate`` keeps running a batch until every row is done)."""
    import torch
    from transformers import StoppingCriteria

    class StopAtLength(StoppingCriteria):
        def __init__(self) -> None:
            self.lengths_B = torch.tensor(list(lengths_B))

        def __call__(self, input_ids, scores, **kwargs) -> torch.BoolTensor:
            return self.lengths_B <= input_ids.shape[1] - prompt_len

    return StopAtLength()


def generate_seconds(model, prompts_BxP: np.ndarray, new_tokens: int,
                     lengths_B: Sequence[int] | None = None) -> float:
    """Seconds of one transformers ``generate``: greedy for exactly ``new_tokens``, or with
    ``lengths_B``, sampled at temperature 1.0 with each row stopping at its length."""
    import torch
    from transformers import StoppingCriteriaList

    ids = torch.from_numpy(prompts_BxP.astype(np.int64))
    if lengths_B is None:
        kw = dict(do_sample=False, min_new_tokens=new_tokens)
    else:
        kw = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, stopping_criteria=
                  StoppingCriteriaList([stop_at(ids.shape[1], lengths_B)]))
    t = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             pad_token_id=0, eos_token_id=None, **kw)
    dt = time.perf_counter() - t
    want = new_tokens if lengths_B is None else max(lengths_B)
    assert out.shape[1] == ids.shape[1] + want, (out.shape, want)
    return dt


def long_tail_run(model, prompts_NxP: np.ndarray, lengths: Sequence[int], max_new: int,
                  batch: int) -> Callable[[], float]:
    """Seconds of transformers' arrival-order batches of ``batch`` over the long tail, each row
    stopping at its length."""
    def run() -> float:
        return sum(generate_seconds(model, prompts_NxP[lo:lo + batch], max_new,
                                    lengths[lo:lo + batch])
                   for lo in range(0, len(lengths), batch))
    return run
