"""A removed worker's grace: a flap (remove, then re-add within the grace) keeps its bookings;
a worker that stays away past the grace ends its requests as a plain removal does."""

from __future__ import annotations

import pytest

from seqstate import (
    AddRequest,
    Free,
    MarkPrefillCompleted,
    RouterHeartbeat,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
GRACE_S = 10.0


def state(**options: object) -> SequenceState:
    return SequenceState(**{"expiry_s": 300.0, "worker_grace_s": GRACE_S, **options})  # type: ignore[arg-type]


def busy(s: SequenceState) -> SequenceState:
    """Worker 1 with two ranks: a and b on rank 0 (a still prefilling), c on rank 1."""
    s.apply(WorkerAdded(1, dp_size=2), 0)
    s.apply(AddRequest("a", 1, 0, block_hashes=[1, 2, 3], prefill_tokens=48), S)
    s.apply(AddRequest("b", 1, 0, block_hashes=[1, 2, 9]), 2 * S)
    s.apply(AddRequest("c", 1, 1, block_hashes=[4]), 3 * S)
    s.apply(MarkPrefillCompleted("b", 1, 0), 3 * S)
    return s


def rows(s: SequenceState, at_s: float) -> list[tuple[int, int, int, int, int]]:
    return [
        (r.worker_id, r.dp_rank, r.active_blocks, r.active_prefill_tokens, r.active_requests)
        for r in s.registry.loads(int(at_s * S))
    ]


def test_a_worker_back_within_its_grace_keeps_its_bookings() -> None:
    s = busy(state())
    before = rows(s, 4)
    assert before == [(1, 0, 4, 48, 2), (1, 1, 1, 0, 1)]
    removed = s.apply(WorkerRemoved(1), 4 * S)
    assert removed.outcome == "applied"
    assert [tuple(r) for r in removed.removed_ranks] == [(1, 0), (1, 1)]
    assert rows(s, 5) == []  # out of sight at once: nothing new is routed to it
    assert sorted(s.requests.owner) == ["a", "b", "c"]  # still followed
    back = s.apply(WorkerAdded(1, dp_size=2), 13 * S)
    assert [tuple(r) for r in back.added_ranks] == [(1, 0), (1, 1)]
    assert [
        (tuple(c.rank), [(b.slot, b.request_id, b.hashes) for b in c.booked]) for c in back.changes
    ] == [((1, 0), [(0, "a", [1, 2, 3]), (1, "b", [1, 2, 9])]), ((1, 1), [(0, "c", [4])])]
    assert rows(s, 4) == before
    assert s.registry.overlap_depths([1, 2, 9]) == {(1, 0): 3}
    s.check_invariants()


def test_events_for_a_parked_worker_apply_out_of_sight() -> None:
    s = busy(state())
    s.apply(WorkerRemoved(1), 4 * S)
    freed = s.apply(Free("b", 1, 0), 5 * S)
    assert (freed.outcome, freed.changes) == ("applied", [])
    marked = s.apply(MarkPrefillCompleted("a", 1, 0), 6 * S)
    assert (marked.outcome, marked.changes) == ("applied", [])
    # A router still sending to the flapping worker: the request waits with the others.
    added = s.apply(AddRequest("d", 1, 1, block_hashes=[5, 6]), 7 * S)
    assert (added.outcome, added.changes, added.added_ranks) == ("applied", [], [])
    assert rows(s, 7) == []
    s.apply(WorkerAdded(1, dp_size=2), 8 * S)
    assert rows(s, 8) == [(1, 0, 3, 0, 1), (1, 1, 3, 0, 2)]
    s.check_invariants()


@pytest.mark.parametrize(("back_at_ns", "kept"), [(14 * S - 1, True), (14 * S, False)])
def test_the_grace_ends_at_log_time_exactly(back_at_ns: int, kept: bool) -> None:
    s = busy(state())
    s.apply(WorkerRemoved(1), 4 * S)  # the grace ends at 4 s + 10 s
    s.apply(WorkerAdded(1, dp_size=2), back_at_ns)
    assert rows(s, 15)[0][4] == (2 if kept else 0)
    assert sorted(s.requests.owner) == (["a", "b", "c"] if kept else [])
    s.check_invariants()


def test_a_lapsed_grace_ends_the_requests_at_the_next_event_of_any_kind() -> None:
    s = busy(state())
    s.apply(WorkerRemoved(1), 4 * S)
    s.apply(AddRequest("x", 2, block_hashes=[8]), 20 * S)  # past the grace: worker 1 is gone
    assert sorted(s.requests.owner) == ["x"]
    assert len(s.departures) == 0 and not s.departures.slots
    # Ended like any removed request: a late Free is a no-op, not a tombstone.
    assert s.apply(Free("a", 1, 0), 21 * S).outcome == "unknown_request"
    assert "a" not in s.tombstones
    assert rows(s, 21) == [(2, 0, 1, 0, 1)]
    s.check_invariants()


def test_without_a_grace_a_removed_worker_added_again_starts_empty() -> None:
    s = busy(state(worker_grace_s=None))
    s.apply(WorkerRemoved(1), 4 * S)
    s.apply(WorkerAdded(1, dp_size=2), 5 * S)
    assert rows(s, 5) == [(1, 0, 0, 0, 0), (1, 1, 0, 0, 0)]
    assert s.requests.owner == {}


def test_a_narrower_re_add_keeps_only_the_ranks_of_its_range() -> None:
    s = busy(state())
    s.apply(WorkerRemoved(1), 4 * S)
    back = s.apply(WorkerAdded(1, dp_start=1, dp_size=1), 5 * S)
    assert [tuple(r) for r in back.added_ranks] == [(1, 1)]
    assert rows(s, 5) == [(1, 1, 1, 0, 1)]
    assert sorted(s.requests.owner) == ["c"]
    s.check_invariants()


def test_an_idle_worker_leaves_nothing_to_park() -> None:
    s = state()
    s.apply(WorkerAdded(3, dp_size=4), 0)
    s.apply(WorkerRemoved(3), S)
    assert len(s.departures) == 0
    assert s.apply(WorkerRemoved(3), 2 * S).outcome == "unknown_worker"


def test_an_orphaned_router_frees_its_parked_requests_out_of_sight() -> None:
    s = state(orphan_after_s=30.0)
    s.apply(RouterHeartbeat("r"), 0)
    s.apply(AddRequest("a", 1, block_hashes=[1], router_id="r"), S)
    s.apply(AddRequest("b", 2, block_hashes=[2], router_id="r"), S)
    s.apply(WorkerRemoved(1), 2 * S)
    # At 31 s the grace (10 s from 2 s) has lapsed first: a ended with its worker, so only b
    # is left for the orphan sweep.
    delta = s.apply(RouterHeartbeat("other"), 31 * S)
    assert delta.orphaned == ["b"] and s.requests.owner == {}
    s2 = state(orphan_after_s=30.0, worker_grace_s=60.0)
    s2.apply(RouterHeartbeat("r"), 0)
    s2.apply(AddRequest("a", 1, block_hashes=[1], router_id="r"), S)
    s2.apply(AddRequest("b", 2, block_hashes=[2], router_id="r"), S)
    s2.apply(WorkerRemoved(1), 2 * S)
    delta = s2.apply(Tick(), 31 * S)
    assert delta.orphaned == ["a", "b"]
    assert [tuple(c.rank) for c in delta.changes] == [(2, 0)]  # the parked rank is not shown
    assert s2.departures.slots[(1, 0)].requests == {}
    s2.check_invariants()


def test_a_snapshot_taken_within_the_grace_restores_the_parked_worker() -> None:
    s = busy(state())
    s.apply(WorkerRemoved(1), 4 * S)
    s.apply(Free("b", 1, 0), 5 * S)
    data = s.snapshot()
    restored = SequenceState.restore(data)
    assert restored.snapshot() == data
    for t in (s, restored):
        t.apply(WorkerAdded(1, dp_size=2), 6 * S)
        t.apply(AddRequest("e", 1, 0, block_hashes=[7]), 7 * S)  # takes b's freed slot 1
    assert restored.snapshot() == s.snapshot()
    assert rows(restored, 7) == [(1, 0, 4, 48, 2), (1, 1, 1, 0, 1)]
    assert restored.slot(1, 0).requests["e"].slot == 1  # type: ignore[union-attr]
    restored.check_invariants()


def test_the_grace_must_be_positive() -> None:
    with pytest.raises(ValueError, match="worker_grace_s"):
        SequenceState(worker_grace_s=0)


def test_a_worker_parked_twice_is_restored_from_a_snapshot_in_the_same_order() -> None:
    """Worker 1 parked, worker 2 parked, worker 1 back lazily and parked again: its ranks
    are due after worker 2's. The live state and one restored from its snapshot list the
    parked ranks alike (the restore rebuilds them in deadline order; the live state once kept
    worker 1's first rank ahead of worker 2's)."""
    s = state(lazy_workers=True)
    s.apply(AddRequest("a", 1, 0, block_hashes=[1]), 1 * S)
    s.apply(WorkerRemoved(1), 2 * S)
    s.apply(AddRequest("b", 2, 0, block_hashes=[2]), 3 * S)
    s.apply(WorkerRemoved(2), 4 * S)
    s.apply(AddRequest("c", 1, 1, block_hashes=[3]), 5 * S)
    s.apply(WorkerRemoved(1), 6 * S)
    assert list(s.departures.workers) == [2, 1]
    assert list(s.departures.slots) == [(2, 0), (1, 0), (1, 1)]
    restored = SequenceState.restore(s.snapshot())
    assert list(restored.departures.slots) == list(s.departures.slots)
    assert restored.snapshot() == s.snapshot()
