"""Applying one scheduling round's read-back outputs to host-side completions.

Host code only, over numpy arrays already transferred (``Sampler._read`` does the one
device->host transfer per round): each function appends, in place, what a prefill or a decode
call produced to its ``Completion``s and returns those that finished; the caller frees their
slots.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from meshrl.inference import programs
from meshrl.inference.requests import Completion

REASONS = {programs.STOP: "stop", programs.LENGTH: "length"}


def first_tokens(comps: Sequence[Completion], tok_N: np.ndarray, lp_N: np.ndarray,
                 raw_N: np.ndarray, active_N: np.ndarray, reason_N: np.ndarray,
                 kept_N: np.ndarray | None = None, routing_NxLxK: np.ndarray | None = None,
                 ) -> list[Completion]:
    """Fill in the placeholder first token of each admitted completion (row i: ``comps[i]``);
    returns those the first token already finished."""
    finished = []
    for i, c in enumerate(comps):
        c.tokens[0], c.logprobs[0], c.raw_logprobs[0] = \
            int(tok_N[i]), float(lp_N[i]), float(raw_N[i])
        if kept_N is not None:
            c.kept[:1] = [int(kept_N[i])]
        if routing_NxLxK is not None:
            c.routing[:1] = [routing_NxLxK[i]]
        if not active_N[i]:
            c.finish_reason = REASONS[int(reason_N[i])]
            finished.append(c)
    return finished


def chunk_tokens(comps: Sequence[Completion | None], version: int, tok_BxC: np.ndarray,
                 lp_BxC: np.ndarray, raw_BxC: np.ndarray, active_B: np.ndarray,
                 reason_B: np.ndarray, kept_BxC: np.ndarray | None = None,
                 routing_BxCxLxK: np.ndarray | None = None) -> list[Completion]:
    """Append one decode call's outputs (row r: ``comps[r]``, as dispatched) under weight
    ``version``; rows without a completion, or whose completion had already finished, emit
    nothing. Returns the completions that finished in this call."""
    # A slot's tokens are a prefix of its row (it never reactivates within a chunk): list
    # slicing, since per-row numpy ops cost more host time than a small model's chunk.
    n_B = (tok_BxC >= 0).sum(axis=1).tolist()
    toks, lps, raws, active = tok_BxC.tolist(), lp_BxC.tolist(), raw_BxC.tolist(), \
        active_B.tolist()
    kepts = kept_BxC.tolist() if kept_BxC is not None else None
    finished = []
    for r, (c, n) in enumerate(zip(comps, n_B)):
        if c is None or c.finish_reason:
            continue
        c.tokens += toks[r][:n]
        c.logprobs += lps[r][:n]
        c.raw_logprobs += raws[r][:n]
        if kepts is not None:
            c.kept += kepts[r][:n]
        if routing_BxCxLxK is not None:
            c.routing += list(routing_BxCxLxK[r, :n])
        c.versions += [version] * n
        if not active[r]:
            c.finish_reason = REASONS[int(reason_B[r])]
            finished.append(c)
    return finished
