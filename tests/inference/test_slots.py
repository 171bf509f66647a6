"""The host mirror of the sampler's slots (no device): placement swaps, staleness, release."""

from __future__ import annotations

from meshrl.inference.requests import Completion, Request
from meshrl.inference.slots import SlotTable


def _completion(i: int) -> Completion:
    return Completion(Request([1, 2, i]), [], [], [], [])


def _table(live: dict[int, Completion], slots: int = 6) -> SlotTable:
    table = SlotTable(slots)
    for s, c in live.items():
        table.out[s] = c
    return table


def test_gathering_moves_only_outsiders_into_the_range_and_swap_applies_it():
    a, b, c = _completion(0), _completion(1), _completion(2)
    table = _table({1: a, 4: b, 5: c})

    pairs = table.gathering([a, b, c], 0, 3)
    table.swap(pairs)

    assert pairs == [(4, 0), (5, 2)]  # a already sits in the range: it stays
    assert set(map(id, table.out[:3])) == {id(a), id(b), id(c)}
    assert table.free() == [3, 4, 5]


def test_staleness_follows_its_sequence_through_a_swap_and_is_taken_once():
    a, b = _completion(0), _completion(1)
    table = _table({0: a, 3: b})
    table.mark_stale()
    table.out[1] = _completion(2)  # admitted under the new weights: not stale

    table.swap([(3, 1)])

    assert table.stale == {0, 1}
    assert table.take_stale() == [(0, a), (1, b)]
    assert table.stale == set() and table.take_stale() == []


def test_release_empties_the_slot_a_completion_moved_to_and_ignores_a_replaced_one():
    a, b = _completion(0), _completion(1)
    table = _table({0: a, 2: b})
    table.swap([(2, 1)])

    table.release(b)
    table.release(_completion(9))  # its slot was taken over already: nothing to free

    assert table.out[1] is None and table.out[0] is a
    assert table.busy() and table.free() == [1, 2, 3, 4, 5]
