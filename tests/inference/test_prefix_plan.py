"""Planning a paged decode chunk's shared prefixes from the page table (host only)."""

from __future__ import annotations

import numpy as np

from meshrl.inference.prefix_plan import BLOCK_PAGES, plan_prefixes, warm_plans

S, B, M = 4, 8, 16  # page size, slots, pages a slot's row of the table holds
CHUNK = 4


def _table(prefixes: list[list[int]], own: int = 4) -> np.ndarray:
    """A table whose slot b lists ``prefixes[b]`` then ``own`` pages of its own."""
    table = np.full((B, M), -1, np.int32)
    nxt = 100
    for b, pre in enumerate(prefixes):
        table[b, :len(pre)] = pre
        table[b, len(pre):len(pre) + own] = range(nxt, nxt + own)
        nxt += own
    return table


def test_a_group_shares_its_rows_and_lone_slots_get_rows_of_their_own():
    # Slots 0-5 share pages 0-2 (a 13-token prompt), slots 6 and 7 have prompts of their own.
    prefixes = [[0, 1, 2]] * 6 + [[10, 11, 12], [20, 21, 22]]
    lens = {b: 13 for b in range(B)}

    plan = plan_prefixes(_table(prefixes), lens, _at(lens, 13), S, window=32, chunk=CHUNK)

    # The group of 6 and two lone slots: 3 rows of 6, the fewest rows that hold them (4 rows
    # of 4 would read the shared pages twice, 8 rows of 1 six times).
    assert plan is not None
    assert plan.members_RxG.tolist() == [[0, 1, 2, 3, 4, 5], [6, B, B, B, B, B],
                                         [7, B, B, B, B, B]]
    table = _table(prefixes)
    for row, pages in zip(plan.members_RxG, plan.rows_RxP, strict=True):
        for s in row[row < B]:  # each member lists the row's pages first
            np.testing.assert_array_equal(table[s, :3], pages)
    # The band starts at the page of position 13 (page 3, right after the 3 shared pages) and
    # holds the chunk's positions 13 .. 16: pages 3 and 4 of each slot; no older pages.
    assert plan.rows_RxP.shape[1] == 3
    np.testing.assert_array_equal(plan.band_BxW, _table(prefixes)[:, 3:3 + 2])
    np.testing.assert_array_equal(plan.band_start_B, [12] * B)
    assert (plan.owners_N == B).all() and (plan.blocks_NxQ == -1).all()


def _at(lens: dict[int, int], pos: int) -> dict[int, int]:
    return {b: pos for b in lens}


def test_each_slot_reads_its_own_older_pages_in_blocks_up_to_its_band():
    # One group of 8 (prompt of 9: two shared pages), slots decoding at different positions.
    table = _table([[0, 1]] * B, own=M - 2)
    lens = {b: 9 for b in range(B)}
    positions = {b: 9 + 5 * b for b in range(B)}  # slot 7 at 44: page 11

    plan = plan_prefixes(table, lens, positions, S, window=64, chunk=CHUNK)

    assert plan is not None and plan.rows_RxP.shape[1] == 2
    for b in range(B):
        start = positions[b] // S * S
        assert plan.band_start_B[b] == start
        np.testing.assert_array_equal(plan.band_BxW[b], table[b, start // S:start // S + 2])
        # Its blocks list its pages from the prefix end up to the band, in order.
        mine = plan.blocks_NxQ[plan.owners_N == b]
        np.testing.assert_array_equal(mine[mine >= 0], table[b, 2:start // S])
        assert len(mine) == -(-(start // S - 2) // BLOCK_PAGES)


def test_one_group_of_all_slots_takes_the_fewest_rows():
    lens = {b: 13 for b in range(B)}

    plan = plan_prefixes(_table([[0, 1, 2]] * B), lens, _at(lens, 13), S, window=32,
                         chunk=CHUNK)

    assert plan.members_RxG.shape == (1, B)
    np.testing.assert_array_equal(plan.rows_RxP, [[0, 1, 2]])


def test_distinct_prompts_share_nothing_so_no_plan():
    prefixes = [[10 * b, 10 * b + 1, 10 * b + 2] for b in range(B)]
    lens = {b: 13 for b in range(B)}

    assert plan_prefixes(_table(prefixes), lens, _at(lens, 13), S, window=32,
                         chunk=CHUNK) is None


def test_fewer_than_two_live_slots_get_no_plan():
    assert plan_prefixes(_table([[0, 1, 2]] * B), {0: 13}, {0: 13}, S, window=32,
                         chunk=CHUNK) is None


def test_the_prefix_never_covers_a_position_a_live_slot_may_still_write():
    # Slot 7's prompt is 5 tokens: only its first page (positions 0-3) is written before the
    # chunk, so no prefix may be longer than one page although the others share three.
    table = _table([[0, 1, 2]] * 7 + [[0]])
    lens = {b: 13 for b in range(7)} | {7: 5}

    plan = plan_prefixes(table, lens, _at(lens, 13) | {7: 5}, S, window=32, chunk=CHUNK)

    assert plan is not None and plan.rows_RxP.shape[1] == 1
    np.testing.assert_array_equal(plan.members_RxG.ravel()[plan.members_RxG.ravel() < B],
                                  range(B))


def test_warm_plans_hold_the_shapes_a_group_filling_its_prompt_bucket_takes():
    lens = {b: 13 for b in range(B)}  # fills a prompt bucket of 13
    table = _table([[0, 1, 2]] * 6 + [[10, 11, 12], [20, 21, 22]], own=M - 3)
    windows = (32, 48, 64)

    def shapes(p) -> tuple:
        return tuple(a.shape for a in p.arrays())

    warm = {shapes(p) for p in warm_plans(B, M * S, S, (13,), windows, CHUNK)}

    # Slots side by side and at scattered positions (samples that ended and were replaced).
    rng = np.random.default_rng(0)
    side_by_side = [_at(lens, pos) for pos in range(13, M * S - CHUNK)]
    scattered = [dict(enumerate(rng.integers(13, M * S - CHUNK, B).tolist())) for _ in range(200)]
    taken = with_blocks = 0
    for positions in side_by_side + scattered:
        window = min(w for w in windows if w >= min(max(positions.values()) + CHUNK, M * S))
        plan = plan_prefixes(table, lens, positions, S, window, CHUNK)
        if plan is not None:
            taken += 1
            with_blocks += bool((plan.owners_N < B).any())
            assert shapes(plan) in warm, (positions, shapes(plan))
    assert taken > 100 and with_blocks > 50
