"""A least-recently-used cache of prompt pages across requests (``sampler.prefix_cache_pages``).

When a sequence's pages return to the pool, the pages holding only its prompt stay listed here,
keyed by the whole token prefix they close (page i of a prompt: its first (i + 1) x page_size
tokens), so a later request starting with the same tokens (a system prompt, the history of a
multi-turn episode, the next group of one prompt) lists them instead of prefilling them. A page's
keys and values depend only on the tokens up to its end, so pages of different sequences chain.
Entries hold a reference on their page; the least recently used go first when the cache is over
its size or the pool is short. Entries are computed under one weight version: a new version
clears the cache. With a sharded pool (``PageAllocator`` shards) a page serves only slots of
its own shard, so entries are keyed by shard too.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from meshrl.inference.pages import PageAllocator


class PrefixCache:
    def __init__(self, alloc: PageAllocator, page_size: int, capacity: int):
        self.alloc, self.page_size, self.capacity = alloc, page_size, capacity
        # (shard, token prefix) -> page
        self.entries: collections.OrderedDict[tuple[int, tuple[int, ...]], int] = \
            collections.OrderedDict()
        self.hits = 0  # pages listed from the cache instead of prefilled (``SlotPages.reserve``)

    def match(self, prompt: Sequence[int], most: int, shard: int = 0) -> list[int]:
        """Pages of ``shard`` holding the longest cached prefix of ``prompt``, at most ``most``
        of them."""
        keys: list[tuple[int, tuple[int, ...]]] = []
        for i in range(most):
            key = (shard, tuple(prompt[:(i + 1) * self.page_size]))
            if key not in self.entries:
                break
            keys.append(key)
        self._touch(keys)
        return [self.entries[k] for k in keys]

    def _touch(self, keys: Sequence[tuple[int, tuple[int, ...]]]) -> None:
        """Mark a prompt's entries used, its first page the most recently: a prefix matches
        from page 0 on, so a page outliving the pages before it could never match again."""
        for key in reversed(keys):
            self.entries.move_to_end(key)

    def insert(self, prompt: Sequence[int], pages: Sequence[int]) -> None:
        """Keep the pages holding only ``prompt``'s tokens (``pages``: its page-table row)."""
        keys = []
        for i in range(len(prompt) // self.page_size):
            if pages[i] < 0:
                continue
            key = (self.alloc.shard_of_page(pages[i]), tuple(prompt[:(i + 1) * self.page_size]))
            if key not in self.entries:
                self.entries[key] = int(pages[i])
                self.alloc.hold(int(pages[i]))
            keys.append(key)
        self._touch(keys)
        while len(self.entries) > self.capacity:
            self.alloc.drop(self.entries.popitem(last=False)[1])

    def evict(self, pages: int, shard: int = 0) -> None:
        """Drop least recently used entries of ``shard`` until it has ``pages`` free pages;
        none when dropping every entry would not get there (a request that waits anyway keeps
        the cache), and never an entry whose page a sequence still holds (it frees nothing)."""
        alone = [k for k, page in self.entries.items()
                 if k[0] == shard and self.alloc.refs[page] == 1]
        short = pages - self.alloc.free_in(shard)
        if short <= 0 or short > len(alone):
            return
        for key in alone[:short]:
            self.alloc.drop(self.entries.pop(key))

    def clear(self) -> None:
        while self.entries:
            self.alloc.drop(self.entries.popitem(last=False)[1])
