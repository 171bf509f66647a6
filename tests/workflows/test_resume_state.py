"""The runner's rollout state: finished untrained groups and started or waiting prompts survive a
save/restore through JSON, so the trained prompts before and after a restart are every prompt
exactly once; stale restored groups are generated again, not skipped; the trained-prompts log
drops lines past the restored step and torn lines."""

from __future__ import annotations

import asyncio
import json

from meshrl.workflows import RolloutRunner, StalenessController, Trajectory
from meshrl.workflows.rollout_state import TrainedPromptsLog, prompt_id, read_trained_prompts


class ListPrompts:
    """A checkpointable iterator over items with stable ids (one per ``next``)."""

    def __init__(self, n: int) -> None:
        self.items = [{"prompt_ids": [1, 2], "prompt_index": i, "epoch": 0} for i in range(n)]
        self.pos = 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        if self.pos >= len(self.items):
            raise StopIteration
        self.pos += 1
        return dict(self.items[self.pos - 1])

    def get_state(self) -> dict:
        return {"pos": self.pos}

    def set_state(self, state: dict) -> None:
        self.pos = state["pos"]


def group_fn(version: list[int], filtered: set[int]):
    """Groups of 2 whose tokens carry the current weight version; ``filtered`` prompt indices
    end untrained (as an all-equal-reward group does)."""
    async def run(item: dict, group_id: int):
        await asyncio.sleep(0.001 * (1 + item["prompt_index"] % 3))  # out-of-order finishes
        if item["prompt_index"] in filtered:
            return None
        v = version[0]
        return [Trajectory(item["prompt_ids"], [5, 6], [-0.5, -0.5], [v, v], [1, 1],
                           reward=1.0, group_id=group_id) for _ in range(2)]
    return run


def make_runner(prompts, version, filtered, max_staleness=1):
    runner = RolloutRunner(group_fn(version, filtered), prompts,
                           StalenessController(batch_size=2, max_staleness=max_staleness),
                           track_prompts_state=True)
    return runner


async def train(runner, version, steps, start=0):
    """Run ``steps`` steps from ``start``; returns [(trained ids, skipped ids)] per step."""
    out = []
    runner.start()
    for step in range(start + 1, start + steps + 1):
        groups = await runner.get_batch(step - 1)
        await asyncio.sleep(0.003)  # the train step: the rollout keeps going
        version[0] = step
        taken, skipped = runner.take_record()
        assert len(taken) == len(groups) == 2
        out.append(([prompt_id(i)[1] for i in taken], [prompt_id(i)[1] for i, _ in skipped]))
    return out


async def killed_then_resumed(kill_after: int, total: int, filtered: set[int],
                              max_staleness: int = 1):
    version = [0]
    prompts = ListPrompts(100)
    first = make_runner(prompts, version, filtered, max_staleness)
    before = await train(first, version, kill_after)
    await asyncio.sleep(0.004)  # let some groups finish and wait untrained
    saved = json.loads(json.dumps({"runner": first.state_dict(),
                                   "rollout": first.rollout_state()}))
    held = len(saved["rollout"]["finished"]) + len(saved["rollout"]["pending"])
    await first.stop()  # the kill: everything in memory is gone

    prompts = ListPrompts(100)
    prompts.set_state(saved["rollout"]["prompts"])
    second = make_runner(prompts, version, filtered, max_staleness)
    second.load_state_dict(saved["runner"])
    second.load_rollout_state(saved["rollout"])
    after = await train(second, version, total - kill_after, start=kill_after)
    await second.stop()
    return before + after, held, saved, second


def covered_once(records) -> list[int]:
    seen = [i for trained, skipped in records for i in trained + skipped]
    assert len(seen) == len(set(seen)), sorted(seen)  # none twice
    return sorted(seen)


def test_restored_rollout_state_trains_every_prompt_exactly_once():
    records, held, saved, _ = asyncio.run(killed_then_resumed(3, 7, filtered={4, 9}))

    assert held > 0 and saved["rollout"]["finished"], saved["rollout"]  # work was in flight
    seen = covered_once(records)
    # None skipped: the ids form a prefix of the stream, up to what was still in flight.
    assert seen[:len(seen) - 6] == list(range(len(seen) - 6)), seen
    assert {4, 9} <= {i for _, skipped in records for i in skipped}


def test_restored_finished_groups_keep_tokens_and_versions():
    _, _, saved, second = asyncio.run(killed_then_resumed(2, 2, filtered=set()))
    entry = saved["rollout"]["finished"][0]
    t = entry["group"][0]

    assert t["completion_ids"] == [5, 6] and set(t["versions"]) <= {1, 2}  # max_staleness 1
    assert t["group_id"] >= 0 and "prompt_index" in entry["item"]
    assert second.controller.accepted == second.controller.consumed + len(
        saved["rollout"]["finished"])


def test_stale_restored_group_is_generated_again_not_skipped():
    async def run():
        version = [0]
        first = make_runner(ListPrompts(10), version, set(), max_staleness=1)
        await train(first, version, 1)
        await asyncio.sleep(0.01)
        saved = json.loads(json.dumps({"runner": first.state_dict(),
                                       "rollout": first.rollout_state()}))
        await first.stop()
        old = saved["rollout"]["finished"]
        for entry in old:  # as if generated at version 0, restored at version 2
            for t in entry["group"]:
                t["versions"] = [0, 0]
        saved["runner"]["controller"]["version"] = 2
        prompts = ListPrompts(10)
        prompts.set_state(saved["rollout"]["prompts"])
        second = make_runner(prompts, version, set(), max_staleness=1)
        second.load_state_dict(saved["runner"])
        second.load_rollout_state(saved["rollout"])
        version[0] = 2
        records = await train(second, version, 2, start=2)
        held = second.rollout_state()
        await second.stop()
        held_ids = [prompt_id(i)[1] for i in held["pending"]] + [
            prompt_id(e["item"])[1] for e in held["finished"]]
        return [prompt_id(e["item"])[1] for e in old], records, held_ids, second

    old, records, held, second = asyncio.run(run())
    assert old  # groups were waiting at the save
    trained = [i for ids, _ in records for i in ids]
    # Each dropped group's prompt was trained on afresh or is still held for generation.
    assert set(old) <= set(trained) | set(held), (old, trained, held)
    assert not set(trained) & set(held)
    assert second.counters["requeued_stale_groups"] == len(old)


def test_trained_prompts_log_drops_lines_past_the_restored_step_and_torn_lines(tmp_path):
    log = TrainedPromptsLog(tmp_path)
    item = {"prompt_index": 3, "epoch": 1}
    for step in (1, 2, 3):
        log.append(step, [item], [({"prompt_index": 7, "epoch": 1}, "filtered")])
    with open(log.path, "a") as f:
        f.write('{"step": 4, "prompt_')  # a torn line

    log.resume(2)

    records = read_trained_prompts(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert records[0] == {"step": 1, "prompt_ids": [[1, 3]], "epoch": 1,
                          "skipped": [[1, 7, "filtered"]]}


def test_get_batch_cancelled_half_way_hands_its_groups_back():
    async def run():
        gate = asyncio.Event()

        async def fn(item, group_id):
            if item["prompt_index"] % 2:  # odd prompts wait (a long generation)
                await gate.wait()
            return [Trajectory([1], [5], [-0.5], [0], [1], reward=1.0, group_id=group_id)]

        runner = RolloutRunner(fn, ListPrompts(10),
                               StalenessController(batch_size=4, max_staleness=0),
                               track_prompts_state=True)
        runner.start()
        task = asyncio.ensure_future(runner.get_batch(0))
        await asyncio.sleep(0.02)  # two groups done and consumed, two waiting
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        state = runner.rollout_state()
        consumed = runner.controller.consumed
        await runner.stop()
        return state, consumed, runner.take_record()

    state, consumed, (taken, _) = asyncio.run(run())
    assert consumed == 0 and not taken
    assert sorted(prompt_id(e["item"])[1] for e in state["finished"]) == [0, 2]
    assert [prompt_id(i)[1] for i in state["pending"]] == [1, 3]
    assert state["prompts"] == {"pos": 4}
