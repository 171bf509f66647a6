"""Padding to a fixed set of lengths (buckets), so jitted programs see a few static shapes and
compile once per bucket instead of once per length."""

from __future__ import annotations

from collections.abc import Sequence


def bucket_for(n: int, buckets: Sequence[int], *, what: str = "length", fix: str = "") -> int:
    """The smallest of ``buckets`` (any order) holding ``n``. Past the largest: ``ValueError``
    naming ``what``, ``n``, the largest bucket and, when given, the ``fix``."""
    best = None
    for b in buckets:
        if b >= n and (best is None or b < best):
            best = b
    if best is None:
        raise ValueError(f"{what} {n} exceeds the largest bucket {max(buckets, default=0)}"
                         + (f"; {fix}" if fix else ""))
    return best
