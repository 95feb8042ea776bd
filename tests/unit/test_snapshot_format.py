"""The snapshot format: remembered ids (tombstones, ended ids, workers removed for good) are
stored as columns, which restore without an object per id beyond the id itself; a snapshot of
the earlier format, one (id, value, time) triple per id, still restores to the same state.

``tests/data/snapshot-v1.bin`` is what the earlier format's build saved for :func:`folded`'s
log (the same bytes on every run: the fold is deterministic).
"""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from seqstate import (
    AddRequest,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    SnapshotError,
    WorkerAdded,
    WorkerRemoved,
)
from seqstate.recent import RecentIds
from seqstate.snapshot import MAGIC

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
V1 = Path(__file__).resolve().parent.parent / "data" / "snapshot-v1.bin"
# Fields of the snapshot body (an array): the version, then the two memories.
VERSION, TOMBSTONES, ENDED, REMOVED = 0, 8, 9, 25


def folded() -> SequenceState:
    """A log that leaves something in every memory: ended ids (some evicted for capacity),
    tombstones of both kinds, a worker removed for good, and live requests."""
    state = SequenceState(expiry_s=60.0, max_tombstones=3, max_ended=4)
    at = 1_700_000_000 * S
    state.apply(WorkerAdded(worker_id=1, dp_size=2), at)
    state.apply(WorkerAdded(worker_id=2), at)
    for i in range(8):
        at += S // 4
        state.apply(AddRequest(f"r{i}", 1, i % 2, [10 * i + 1, 10 * i + 2], 64), at)
        if i % 3 != 2:
            state.apply(MarkPrefillCompleted(f"r{i}", 1, i % 2), at)
            state.apply(Free(f"r{i}", 1, i % 2), at + 7)
    state.apply(Free("early", 2), at + S)  # a tombstone: the Free came first
    state.apply(MarkPrefillCompleted("marked", 2), at + S)  # another, of a Mark
    state.apply(Free("early-too", 2), at + 2 * S)
    state.apply(AddRequest("on-2", 2, 0, [5]), at + 2 * S)
    state.apply(WorkerRemoved(worker_id=2, final=True), at + 3 * S)
    return state


def body(state: SequenceState) -> list[object]:
    data = state.snapshot()
    assert data.startswith(MAGIC)
    decoded: list[object] = msgspec.msgpack.decode(data[len(MAGIC) :])
    return decoded


def encoded(body: list[object]) -> bytes:
    return MAGIC + msgspec.msgpack.encode(body)


def test_remembered_ids_are_stored_as_columns() -> None:
    state = folded()
    assert (len(state.ended), state.ended.evicted, len(state.tombstones)) == (4, 3, 3)
    snapshot = body(state)
    assert snapshot[VERSION] == 2
    ended = snapshot[ENDED]
    assert isinstance(ended, list)
    # no triples: the ids, one byte of value each, and the gaps between their write times
    entries, evicted, ids, values, gaps = ended
    assert (entries, evicted) == ([], 3)
    assert ids == [rid for rid, _, _ in state.ended.items()] == ["r4", "r6", "r7", "on-2"]
    assert values == b"\x00\x00\x00\x00"
    # r4 freed 1.25 s (and 7 ns) into the log, r6 half a second later, r7 a quarter, and on-2
    # with its worker, at 5 s
    assert gaps == [1_700_000_001_250_000_007, S // 2, S // 4, 3 * S - 7]
    tombstones = snapshot[TOMBSTONES]
    assert tombstones == [
        [],
        0,
        ["early", "marked", "early-too"],
        b"\x02\x01\x02",
        [1_700_000_003 * S, 0, S],
    ]
    assert snapshot[REMOVED] == [[], 0, ["2"], b"\x00", [1_700_000_005 * S]]


def test_columns_restore_to_the_same_bytes_and_the_same_fold() -> None:
    state = folded()
    data = state.snapshot()
    assert body(state)[VERSION] == 2  # the columns
    restored = SequenceState.restore(data)
    assert restored.snapshot() == data
    restored.check_invariants()
    at = state.now_ns + S
    for fold in (state, restored):  # the memories still decide what later events do
        fold.apply(Free("r7", 1, 1), at)  # ended lately: remembered, no tombstone
        assert (fold.counters["tombstoned"], "r7" in fold.tombstones) == (3, False)
        fold.apply(Free("r0", 1, 0), at)  # ended, but forgotten for capacity: a tombstone
        assert (fold.counters["tombstoned"], "r0" in fold.tombstones) == (4, True)
        assert fold.apply(AddRequest("early-too", 1, 0, [1]), at).outcome == "superseded"
        assert fold.apply(AddRequest("x", 2, 0, [1]), at).outcome == "removed_worker"
    assert restored.snapshot() == state.snapshot()


def test_a_snapshot_of_the_earlier_format_restores_and_saves_in_the_new_one() -> None:
    old = V1.read_bytes()
    assert msgspec.msgpack.decode(old[len(MAGIC) :])[VERSION] == 1
    restored = SequenceState.restore(old)
    restored.check_invariants()
    assert restored.snapshot() == folded().snapshot()  # the same state, saved as version 2
    assert body(restored)[VERSION] == 2


def test_memory_columns_of_different_lengths_are_a_damaged_snapshot() -> None:
    snapshot = body(folded())
    ended = snapshot[ENDED]
    assert isinstance(ended, list)
    ended[3] = ended[3][:-1]  # one value short
    with pytest.raises(SnapshotError, match="differ in length"):
        SequenceState.restore(encoded(snapshot))


def test_an_id_twice_in_a_memory_is_a_damaged_snapshot() -> None:
    snapshot = body(folded())
    ended = snapshot[ENDED]
    assert isinstance(ended, list)
    ended[2][1] = ended[2][0]
    with pytest.raises(SnapshotError, match="an id twice"):
        SequenceState.restore(encoded(snapshot))


def test_a_memory_in_both_formats_is_a_damaged_snapshot() -> None:
    snapshot = body(folded())
    tombstones = snapshot[TOMBSTONES]
    assert isinstance(tombstones, list)
    tombstones[0] = [["ghost", 2, 5]]  # a triple beside the columns
    with pytest.raises(SnapshotError, match="version 2 memory with entries"):
        SequenceState.restore(encoded(snapshot))
    old = msgspec.msgpack.decode(V1.read_bytes()[len(MAGIC) :])
    old[ENDED] += [["r9"], b"\x00", [5]]  # columns in a version 1 body
    with pytest.raises(SnapshotError, match="version 1 memory with columns"):
        SequenceState.restore(encoded(old))


def test_recent_ids_round_trip_through_columns_with_stale_entries() -> None:
    ids = RecentIds(retention_ns=100 * S, capacity=5)
    for i in range(9):
        ids.put(f"a{i % 6}", i % 3, i * S)  # rewrites leave stale queue entries behind
    ids.pop("a1")
    again = RecentIds(retention_ns=100 * S, capacity=5)
    again.load_columns(*ids.columns())
    assert list(again.items()) == list(ids.items())
    assert (again.oldest_ns(), again.due_ns, again.evicted) == (4 * S, 104 * S, 0)
    for later in (ids, again):  # both forget the same ids at the same times
        later.put("b", 1, 200 * S)
        later.prune(106 * S)
    assert list(again.items()) == list(ids.items())
    assert list(again.items()) == [("a0", 0, 6 * S), ("a2", 2, 8 * S), ("b", 1, 200 * S)]


def test_a_restore_without_the_registry_leaves_it_to_sync_registry() -> None:
    state = folded()
    data = state.snapshot()
    bare = SequenceState.restore(data, registry=False)
    assert bare.registry.ranks() == [] and bare.snapshot() == data
    at = state.now_ns + S
    for fold in (state, bare):
        fold.apply(AddRequest("late", 1, 0, [1, 2, 3], 32), at)
    bare.sync_registry()
    assert sorted(bare.registry.ranks()) == sorted(state.registry.ranks()) == [(1, 0), (1, 1)]
    assert bare.registry.loads(now_ns=at) == state.registry.loads(now_ns=at)
    assert bare.registry.potential_loads([1, 2], 32, now_ns=at) == state.registry.potential_loads(
        [1, 2], 32, now_ns=at
    )
