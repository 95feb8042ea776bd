"""A worker removed for good (``WorkerRemoved(final=True)``) stays removed: late messages about
it never bring its ranks back, until a ``WorkerAdded`` of its id."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqstate import (
    AddRequest,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    decode_event,
    encode_event,
)
from seqstate.snapshot import _State
from seqstate.state import MAX_REMOVED_WORKERS

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000


def busy(**options: object) -> SequenceState:
    """Worker 7 with requests on two ranks; worker 8 beside it."""
    s = SequenceState(**options)  # type: ignore[arg-type]
    s.apply(AddRequest("a", 7, 0, block_hashes=[1, 2], prefill_tokens=32), 1 * S)
    s.apply(AddRequest("b", 7, 1, block_hashes=[3]), 2 * S)
    s.apply(AddRequest("c", 8, 0, block_hashes=[4]), 3 * S)
    return s


def ranks(s: SequenceState) -> list[tuple[int, int]]:
    return [(r.worker_id, r.dp_rank) for r in s.registry.loads(s.now_ns)]


def test_a_plain_removal_bytes_are_unchanged_and_final_is_sent_only_when_true() -> None:
    assert (
        encode_event(WorkerRemoved(7)) == b"\x92\x01\x82\xa4type\xadWorkerRemoved\xa9worker_id\x07"
    )
    data = encode_event(WorkerRemoved(7, final=True))
    assert msgspec.msgpack.decode(data) == [
        1,
        {"type": "WorkerRemoved", "worker_id": 7, "final": True},
    ]
    assert decode_event(data) == WorkerRemoved(7, final=True)


def test_late_messages_do_not_bring_a_worker_removed_for_good_back() -> None:
    s = busy()
    gone = s.apply(WorkerRemoved(7, final=True), 10 * S)
    assert gone.outcome == "applied"
    assert [tuple(r) for r in gone.removed_ranks] == [(7, 0), (7, 1)]
    assert sorted(s.requests.owner) == ["c"] and ranks(s) == [(8, 0)]
    # A frontend's Add routed before it noticed, then the Mark and Free of that request:
    late = s.apply(AddRequest("d", 7, 0, block_hashes=[5], prefill_tokens=16), 11 * S)
    assert (late.outcome, late.changes, late.added_ranks) == ("removed_worker", [], [])
    assert s.apply(MarkPrefillCompleted("d", 7, 0), 12 * S).outcome == "unknown_request"
    assert s.apply(Free("d", 7, 0), 13 * S).outcome == "unknown_request"
    # ... and those of its cut requests.
    assert s.apply(MarkPrefillCompleted("a", 7, 0), 14 * S).outcome == "unknown_request"
    assert s.apply(Free("b", 7, 1), 15 * S).outcome == "unknown_request"
    assert s.apply(Tick(), 16 * S).outcome == "applied"
    assert ranks(s) == [(8, 0)] and "7" in s.removed_workers
    assert len(s.tombstones) == 0 and s.counters["tombstoned"] == 0
    assert s.counters["removed_worker"] == 1
    s.check_invariants()


def test_a_free_before_the_late_add_leaves_no_tombstone_either() -> None:
    s = busy()
    s.apply(WorkerRemoved(7, final=True), 10 * S)
    assert s.apply(Free("d", 7, 0), 11 * S).outcome == "unknown_request"
    assert "d" not in s.tombstones
    assert s.apply(AddRequest("d", 7, 0), 12 * S).outcome == "removed_worker"
    assert "d" not in s.requests.owner and ranks(s) == [(8, 0)]


def test_a_worker_added_again_starts_empty_and_takes_requests() -> None:
    s = busy()
    s.apply(WorkerRemoved(7, final=True), 10 * S)
    back = s.apply(WorkerAdded(7, dp_size=2), 20 * S)
    assert back.outcome == "applied" and [tuple(r) for r in back.added_ranks] == [(7, 0), (7, 1)]
    assert "7" not in s.removed_workers
    assert [r.active_requests for r in s.registry.loads(20 * S)] == [0, 0, 1]
    assert s.apply(AddRequest("e", 7, 1), 21 * S).outcome == "applied"
    s.apply(WorkerRemoved(7), 22 * S)  # a plain removal now: a late add brings it back lazily
    lazy = s.apply(AddRequest("f", 7, 0), 23 * S)
    assert (lazy.outcome, [tuple(r) for r in lazy.added_ranks]) == ("applied", [(7, 0)])
    s.check_invariants()


def test_a_plain_removal_keeps_todays_lazy_return() -> None:
    s = busy()
    s.apply(WorkerRemoved(7), 10 * S)
    assert len(s.removed_workers) == 0
    late = s.apply(AddRequest("d", 7, 0), 11 * S)
    assert (late.outcome, [tuple(r) for r in late.added_ranks]) == ("applied", [(7, 0)])
    assert s.apply(Free("x", 7, 0), 12 * S).outcome == "unknown_request"
    assert "x" in s.tombstones


def test_a_final_removal_of_a_worker_never_seen_is_remembered_and_a_repeat_changes_nothing() -> (
    None
):
    s = SequenceState()
    first = s.apply(WorkerRemoved(9, final=True), 1 * S)
    assert (first.outcome, first.removed_ranks) == ("applied", [])
    assert s.apply(AddRequest("a", 9), 2 * S).outcome == "removed_worker"
    assert s.apply(WorkerRemoved(9, final=True), 3 * S).outcome == "duplicate"
    assert s.apply(WorkerRemoved(9), 4 * S).outcome == "unknown_worker"  # plain: as ever
    assert list(s.removed_workers.entries) == ["9"] and ranks(s) == []


def test_a_final_removal_ends_the_requests_at_once_whatever_the_grace() -> None:
    s = busy(worker_grace_s=60.0)
    s.apply(WorkerRemoved(7, final=True), 10 * S)
    assert sorted(s.requests.owner) == ["c"] and len(s.departures) == 0
    assert {"a", "b"} <= set(s.ended.entries)
    # A worker parked by a plain removal, then removed for good: its parked requests end.
    s.apply(WorkerRemoved(8), 11 * S)
    assert len(s.departures) == 1 and "c" in s.requests.owner
    s.apply(WorkerRemoved(8, final=True), 12 * S)
    assert len(s.departures) == 0 and len(s.requests) == 0
    back = s.apply(WorkerAdded(8), 13 * S)
    assert (back.changes, [tuple(r) for r in back.added_ranks]) == ([], [(8, 0)])  # empty
    assert [r.active_requests for r in s.registry.loads(13 * S)] == [0]
    s.check_invariants()


def test_under_the_slot_tracker_rules_final_is_a_plain_removal() -> None:
    s = SequenceState(slot_tracker=True)
    s.apply(WorkerAdded(7, block_size=16), 0)
    s.apply(WorkerAdded(8, block_size=16), 0)
    assert s.apply(WorkerRemoved(7, final=True), S).outcome == "applied"
    assert len(s.removed_workers) == 0
    assert s.apply(AddRequest("a", 7), 2 * S).outcome == "unknown_worker"


def test_the_memory_is_bounded_the_oldest_forgotten_first() -> None:
    s = SequenceState()
    for worker in range(MAX_REMOVED_WORKERS + 1):
        s.apply(WorkerRemoved(worker, final=True), S)
    assert len(s.removed_workers) == MAX_REMOVED_WORKERS and s.removed_workers.evicted == 1
    assert s.apply(AddRequest("a", 0), 2 * S).outcome == "applied"  # forgotten: lazy again
    assert s.apply(AddRequest("b", 1), 2 * S).outcome == "removed_worker"
    s.check_invariants()


def test_a_snapshot_keeps_the_removed_workers_and_restores_byte_identically() -> None:
    s = busy()
    s.apply(WorkerRemoved(7, final=True), 10 * S)
    s.apply(WorkerRemoved(3, final=True), 11 * S)
    data = s.snapshot()
    restored = SequenceState.restore(data)
    assert restored.snapshot() == data
    assert list(restored.removed_workers.entries) == ["7", "3"]
    assert restored.apply(AddRequest("d", 3), 12 * S).outcome == "removed_worker"
    # A snapshot from before the field: none removed, and the fold goes on.
    magic, body = data[:4], msgspec.msgpack.decode(data[4:])
    older = magic + msgspec.msgpack.encode(
        body[: _State.__struct_fields__.index("removed_workers")]
    )
    assert len(SequenceState.restore(older).removed_workers) == 0


def test_a_snapshot_naming_a_removed_worker_with_a_rank_is_refused() -> None:
    s = busy()
    s.apply(WorkerRemoved(9, final=True), 10 * S)
    magic, body = s.snapshot()[:4], msgspec.msgpack.decode(s.snapshot()[4:])
    field = _State.__struct_fields__.index("removed_workers")
    body[field][2][0] = "7"  # worker 7 still has ranks (the ids' column of the memory)
    with pytest.raises(ValueError, match="removed for good and present"):
        SequenceState.restore(magic + msgspec.msgpack.encode(body))


# ---- the invariant, whatever the order of events --------------------------------------------

WORKERS = (1, 2, 3)
STEP = st.tuples(
    st.sampled_from(("add", "mark", "free", "remove", "remove_final", "register", "tick")),
    st.sampled_from(WORKERS),
    st.sampled_from(("r0", "r1", "r2", "r3")),
    st.integers(0, 1),  # a dp rank
    st.integers(0, 40),  # seconds since the previous event
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(STEP, max_size=60), grace=st.sampled_from((None, 20.0)))
def test_no_rank_of_a_worker_removed_for_good_exists_until_it_is_added_again(
    steps: list[tuple[str, int, str, int, int]], grace: float | None
) -> None:
    s = SequenceState(worker_grace_s=grace, lease_scan_s=30.0)
    gone: set[int] = set()
    now = 0
    for op, worker, rid, dp_rank, gap in steps:
        now += gap * S
        if op == "add":
            event: object = AddRequest(rid, worker, dp_rank, block_hashes=[worker, dp_rank])
        elif op == "mark":
            event = MarkPrefillCompleted(rid, worker, dp_rank)
        elif op == "free":
            event = Free(rid, worker, dp_rank)
        elif op in ("remove", "remove_final"):
            event = WorkerRemoved(worker, final=op == "remove_final")
        elif op == "register":
            event = WorkerAdded(worker, dp_size=2)
        else:
            event = Tick()
        delta = s.apply(event, now)
        if op == "remove_final":
            gone.add(worker)
        elif op == "register":
            gone.discard(worker)
        elif op == "add" and worker in gone:
            assert delta.outcome in ("removed_worker", "duplicate")
            assert delta.added_ranks == []
        for w in gone:
            assert not any(rank[0] == w for rank in s.workers.slots)
            assert not any(rank[0] == w for rank in s.departures.slots)
            assert not any(r.worker_id == w for r in s.registry.loads(now))
            assert not any(owner[0] == w for owner in s.requests.owner.values())
        assert {int(k) for k in s.removed_workers.entries} == gone
        s.check_invariants()
