"""The host mirror of the sampler's slots (no device): staleness, release."""

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


def test_staleness_is_taken_once_and_skips_slots_admitted_under_new_weights():
    a, b = _completion(0), _completion(1)
    table = _table({0: a, 3: b})
    table.mark_stale()
    table.out[1] = _completion(2)  # admitted under the new weights: not stale

    assert table.stale == {0, 3}
    assert table.take_stale() == [(0, a), (3, b)]
    assert table.stale == set() and table.take_stale() == []


def test_release_empties_the_completions_slot_and_ignores_a_replaced_one():
    a, b = _completion(0), _completion(1)
    table = _table({0: a, 2: b})

    table.release(b)
    table.release(_completion(9))  # its slot was taken over already: nothing to free

    assert table.out[2] is None and table.out[0] is a
    assert table.busy() and table.free() == [1, 2, 3, 4, 5]
