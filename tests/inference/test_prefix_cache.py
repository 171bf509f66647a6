"""The prefix cache's eviction: a prompt's leading pages outlive its later ones (a prefix matches
from page 0 on), and eviction never empties the cache for a reservation it cannot satisfy."""

from meshrl.inference.pages import PageAllocator
from meshrl.inference.prefix_cache import PrefixCache

PAGE = 4


def _cache(num_pages: int, capacity: int) -> tuple[PageAllocator, PrefixCache]:
    alloc = PageAllocator(num_pages=num_pages, page_size=PAGE, slots=2, pages_per_seq=8)
    return alloc, PrefixCache(alloc, PAGE, capacity)


def _finish(alloc: PageAllocator, cache: PrefixCache, prompt: list[int]) -> None:
    """A sequence of ``prompt`` ran on slot 0 and ended: its full prompt pages stay cached."""
    assert alloc.reserve(0, len(prompt))
    cache.insert(prompt, alloc.table[0])
    alloc.release(0)


def test_a_prompt_longer_than_the_cache_keeps_its_leading_pages():
    alloc, cache = _cache(num_pages=16, capacity=3)
    prompt = list(range(4 * PAGE))

    _finish(alloc, cache, prompt)

    assert len(cache.match(prompt, most=4)) == 3
    assert alloc.pages_in_use == 3  # the last page went back to the pool


def test_the_last_page_of_an_older_prompt_is_evicted_before_its_first():
    alloc, cache = _cache(num_pages=16, capacity=5)
    a, b = list(range(3 * PAGE)), list(range(100, 100 + 3 * PAGE))

    _finish(alloc, cache, a)
    _finish(alloc, cache, b)

    assert len(cache.match(a, most=3)) == 2 and len(cache.match(b, most=3)) == 3


def test_eviction_that_cannot_free_enough_pages_drops_nothing():
    alloc, cache = _cache(num_pages=8, capacity=8)
    _finish(alloc, cache, list(range(2 * PAGE)))  # 2 cached pages
    assert alloc.reserve(1, 4 * PAGE)  # a live sequence: 2 pages left free

    cache.evict(5)  # 2 free + 2 cached < 5

    assert len(cache.entries) == 2 and alloc.free_in(0) == 2
    cache.evict(3)  # one cached page is enough
    assert len(cache.entries) == 1 and alloc.free_in(0) == 3


def test_eviction_skips_entries_whose_page_a_live_sequence_still_reads():
    alloc, cache = _cache(num_pages=6, capacity=8)
    prompt = list(range(2 * PAGE))
    _finish(alloc, cache, prompt)
    alloc.adopt(1, cache.match(prompt, most=2))  # a new sequence lists both cached pages
    assert alloc.reserve(1, 3 * PAGE) and alloc.free_in(0) == 3

    cache.evict(4)  # dropping the cached entries would free no page

    assert len(cache.entries) == 2
