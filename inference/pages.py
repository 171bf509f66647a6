"""Host-side page allocator for the paged KV cache (``models.paged_attention``).

Owns the page table ``[slots, pages_per_seq]`` (int32, -1 = no page) and a refcount per page.
A slot gets pages as its sequence grows (``reserve``), never moves them, and returns them on
``release``. A page listed by several slots (a shared prompt prefix, ``share``) is freed when
its last holder releases it. A reservation that does not fit takes nothing and returns False,
so the caller can keep the request waiting in arrival order.

With ``shards`` > 1 (the sampler's slots and the pool's pages sharded over the same mesh axes)
the slots and the pages split into that many equal consecutive ranges, and a slot only ever
lists pages of its own range: attention then reads each sequence's pages on the device that
holds the sequence, and no device holds another shard's pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, slots: int, pages_per_seq: int,
                 shards: int = 1):
        if min(num_pages, page_size, slots, pages_per_seq, shards) < 1:
            raise ValueError(f"page allocator: num_pages={num_pages}, page_size={page_size}, "
                             f"slots={slots}, pages_per_seq={pages_per_seq}, shards={shards}: "
                             f"all must be >= 1")
        if slots % shards or num_pages % shards:
            raise ValueError(f"page allocator: slots={slots} and num_pages={num_pages} must "
                             f"both divide into shards={shards} equal ranges")
        self.page_size = page_size
        self.table = np.full((slots, pages_per_seq), -1, np.int32)
        self.refs = np.zeros(num_pages, np.int32)
        self._slots_per_shard, self._pages_per_shard = slots // shards, num_pages // shards
        # Lowest page first: a fresh pool fills from the front, which keeps tests readable.
        self._free = [list(range((d + 1) * self._pages_per_shard - 1,
                                 d * self._pages_per_shard - 1, -1)) for d in range(shards)]

    def shard_of_slot(self, slot: int) -> int:
        return slot // self._slots_per_shard

    def shard_of_page(self, page: int) -> int:
        return int(page) // self._pages_per_shard

    @property
    def free_pages(self) -> int:
        return sum(map(len, self._free))

    def free_in(self, shard: int) -> int:
        """Free pages a slot of ``shard`` may take."""
        return len(self._free[shard])

    @property
    def pages_in_use(self) -> int:
        return int((self.refs > 0).sum())

    def held(self, slot: int) -> int:
        return int((self.table[slot] >= 0).sum())

    def reserve(self, slot: int, num_tokens: int) -> bool:
        """Give ``slot`` enough pages for positions [0, num_tokens). All or nothing."""
        need = -(-num_tokens // self.page_size)
        if need > self.table.shape[1]:
            raise ValueError(f"page allocator: {num_tokens} tokens need {need} pages: more than "
                             f"pages_per_seq={self.table.shape[1]}")
        have, free = self.held(slot), self._free[self.shard_of_slot(slot)]
        if need - have > len(free):
            return False
        for i in range(have, need):
            page = free.pop()
            self.refs[page] = 1
            self.table[slot, i] = page
        return True

    def share(self, src: int, dst: int, num_pages: int) -> None:
        """List ``src``'s first ``num_pages`` pages as ``dst``'s first pages (read-only
        prefix: only full pages, which no slot writes again, may be shared)."""
        pages = self.table[src, :num_pages]
        if (pages < 0).any():
            raise ValueError(f"page allocator: slot {src} holds fewer than {num_pages} pages")
        self.adopt(dst, pages)

    def adopt(self, slot: int, pages: Sequence[int] | np.ndarray) -> None:
        """List ``pages`` (held elsewhere: another slot, the prefix cache) as ``slot``'s first
        pages, one more reference each."""
        if self.held(slot):
            raise ValueError(f"page allocator: slot {slot} already holds pages")
        pages = np.asarray(pages, np.int32)
        shard = self.shard_of_slot(slot)
        if any(self.shard_of_page(p) != shard for p in pages):
            raise ValueError(f"page allocator: slot {slot} (shard {shard}) cannot list pages "
                             f"{pages.tolist()}: a slot lists only its own shard's pages")
        self.table[slot, :len(pages)] = pages
        self.refs[pages] += 1

    def release(self, slot: int) -> None:
        """Drop ``slot``'s references; pages nobody else lists return to the pool."""
        pages = self.table[slot][self.table[slot] >= 0]
        self.refs[pages] -= 1
        for p in pages[::-1]:
            if self.refs[p] == 0:
                self._free[self.shard_of_page(p)].append(int(p))
        self.table[slot] = -1

    def hold(self, page: int) -> None:
        """One more reference to ``page`` held outside the table (the prefix cache)."""
        self.refs[page] += 1

    def drop(self, page: int) -> bool:
        """Drop a ``hold``; True when the page went back to the pool."""
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self._free[self.shard_of_page(page)].append(page)
            return True
        return False
