"""Host page allocator: grow on demand, all-or-nothing, shared prefixes refcounted."""

import numpy as np
import pytest

from meshrl.inference.pages import PageAllocator


def test_reserve_grows_and_release_returns_pages():
    a = PageAllocator(num_pages=6, page_size=4, slots=2, pages_per_seq=4)
    assert a.reserve(0, 5) and a.held(0) == 2
    table_before = a.table[0, :2].copy()
    assert a.reserve(0, 9) and a.held(0) == 3
    np.testing.assert_array_equal(a.table[0, :2], table_before)  # growing never moves pages
    a.release(0)
    assert a.free_pages == 6 and a.pages_in_use == 0 and (a.table[0] == -1).all()


def test_reservation_that_does_not_fit_takes_nothing():
    a = PageAllocator(num_pages=3, page_size=4, slots=2, pages_per_seq=4)
    assert a.reserve(0, 8)
    assert not a.reserve(1, 8)
    assert a.held(1) == 0 and a.free_pages == 1
    with pytest.raises(ValueError, match="17 tokens need 5 pages"):
        a.reserve(1, 17)


def test_shared_prefix_pages_free_only_after_last_holder():
    a = PageAllocator(num_pages=8, page_size=4, slots=3, pages_per_seq=4)
    assert a.reserve(0, 8)
    a.share(0, 1, 2)
    a.share(0, 2, 2)
    assert a.pages_in_use == 2  # prompt KV divided by the group size
    assert a.reserve(1, 10) and a.pages_in_use == 3  # slot 1's own tail page
    a.release(0)
    a.release(1)
    assert a.pages_in_use == 2 and (a.refs[a.table[2, :2]] == 1).all()
    a.release(2)
    assert a.free_pages == 8
    with pytest.raises(ValueError, match="holds fewer than 2 pages"):
        a.share(0, 1, 2)


def test_bad_sizes_name_the_values():
    with pytest.raises(ValueError, match="page_size=0"):
        PageAllocator(num_pages=4, page_size=0, slots=1, pages_per_seq=1)


def test_sharded_pool_gives_each_slot_pages_of_its_own_shard():
    # 4 slots and 8 pages over 2 shards: slots 0-1 take pages 0-3, slots 2-3 pages 4-7.
    a = PageAllocator(num_pages=8, page_size=4, slots=4, pages_per_seq=4, shards=2)
    assert a.reserve(0, 12) and a.reserve(3, 8)
    assert set(a.table[0, :3]) <= {0, 1, 2, 3} and set(a.table[3, :2]) <= {4, 5, 6, 7}
    assert a.free_in(0) == 1 and a.free_in(1) == 2
    # Shard 0 is short while shard 1 still has pages: slot 1 waits, slot 2 does not.
    assert not a.reserve(1, 8) and a.held(1) == 0
    assert a.reserve(2, 8) and a.free_in(1) == 0
    a.release(0)
    assert a.free_in(0) == 4 and a.free_pages == 4


def test_sharded_pool_refuses_a_page_of_another_shard_and_uneven_sizes():
    a = PageAllocator(num_pages=8, page_size=4, slots=4, pages_per_seq=4, shards=2)
    assert a.reserve(0, 8)
    with pytest.raises(ValueError, match="slot 2 \\(shard 1\\) cannot list pages"):
        a.share(0, 2, 2)
    with pytest.raises(ValueError, match="num_pages=7 must both divide into shards=2"):
        PageAllocator(num_pages=7, page_size=4, slots=4, pages_per_seq=4, shards=2)
