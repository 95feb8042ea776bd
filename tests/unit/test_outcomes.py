"""Lifecycle oddities are outcomes, never exceptions: our precise rules beyond the reference.

Dynamo forgets a Free or MarkPrefillCompleted that overtakes its AddRequest
(its ActiveSequences): the late add leaks load until expiry and a lost mark keeps prefill
charged. These tests pin the tombstone rules (docs/architecture.md, "The rules") that replace
that.
"""

from __future__ import annotations

import pytest

from seqstate import (
    AddOutputBlock,
    AddRequest,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)
from seqstate.recent import STALE_SLACK

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000


def add(
    rid: str,
    worker: int = 1,
    rank: int = 0,
    hashes: list[int] | None = None,
    tokens: int = 0,
    ms: float | None = None,
) -> AddRequest:
    return AddRequest(
        request_id=rid,
        worker_id=worker,
        dp_rank=rank,
        block_hashes=hashes or [],
        prefill_tokens=tokens,
        expected_prefill_ms=ms,
    )


def row(state: SequenceState, worker: int, rank: int = 0, now: int = 0) -> tuple[int, int, int]:
    for r in state.registry.loads(now):
        if (r.worker_id, r.dp_rank) == (worker, rank):
            return r.active_blocks, r.active_prefill_tokens, r.active_requests
    raise AssertionError(f"no row for {(worker, rank)}")


def test_free_before_add_supersedes_the_late_add() -> None:
    state = SequenceState()
    assert state.apply(Free(request_id="r", worker_id=1), 0).outcome == "unknown_request"
    assert state.counters["tombstoned"] == 1
    delta = state.apply(add("r", hashes=[1, 2], tokens=10), 1)
    assert delta.outcome == "superseded"
    assert not delta.changes and not delta.added_ranks  # nothing booked, no rank created
    assert state.registry.loads(1) == []
    assert state.counters["superseded"] == 1
    # The tombstone is consumed: the id can be booked again afterwards.
    assert state.apply(add("r", hashes=[1], tokens=4), 2).outcome == "applied"
    assert row(state, 1, now=2) == (1, 4, 1)


def test_duplicate_free_after_superseded_add_does_not_block_reuse() -> None:
    state = SequenceState()
    state.apply(Free(request_id="r", worker_id=1), 0)
    state.apply(add("r"), 1)
    assert state.apply(Free(request_id="r", worker_id=1), 2).outcome == "unknown_request"
    assert state.apply(add("r", tokens=3), 3).outcome == "applied"


def test_mark_before_add_books_blocks_without_prefill_load() -> None:
    state = SequenceState()
    assert state.apply(MarkPrefillCompleted(request_id="r", worker_id=1), 0).outcome == (
        "unknown_request"
    )
    delta = state.apply(add("r", hashes=[1, 2, 3], tokens=100, ms=10.0), S)
    assert delta.outcome == "applied"
    assert row(state, 1, now=S) == (3, 0, 1)
    assert state.counters["mark_before_add"] == 1
    # Its real mark, arriving again, is a duplicate; its Free frees it.
    assert state.apply(MarkPrefillCompleted(request_id="r", worker_id=1), S).outcome == "duplicate"
    assert state.apply(Free(request_id="r", worker_id=1), 2 * S).outcome == "applied"
    assert row(state, 1, now=2 * S) == (0, 0, 0)


def test_mark_then_free_before_add_the_free_wins() -> None:
    for order in ([MarkPrefillCompleted, Free], [Free, MarkPrefillCompleted]):
        state = SequenceState()
        for kind in order:
            state.apply(kind(request_id="r", worker_id=1), 0)
        assert state.apply(add("r", hashes=[1]), 1).outcome == "superseded", order


def test_free_of_a_recently_ended_id_is_a_plain_no_op() -> None:
    state = SequenceState()
    state.apply(add("r", tokens=5), 0)
    state.apply(Free(request_id="r", worker_id=1), 1)
    assert state.apply(Free(request_id="r", worker_id=1), 2).outcome == "unknown_request"
    assert state.apply(MarkPrefillCompleted(request_id="r", worker_id=1), 3).outcome == (
        "unknown_request"
    )
    assert state.counters["tombstoned"] == 0
    # Reuse after free is allowed (Dynamo allows it) and not superseded by the duplicate free.
    assert state.apply(add("r", tokens=5), 4).outcome == "applied"


def test_expired_id_is_remembered_so_its_late_free_leaves_no_tombstone() -> None:
    state = SequenceState(expiry_s=60)
    state.apply(add("old"), 0)
    assert state.apply(Tick(), 61 * S).expired == ["old"]
    assert state.counters["expired"] == 1
    assert state.apply(Free(request_id="old", worker_id=1), 62 * S).outcome == "unknown_request"
    assert state.counters["tombstoned"] == 0
    assert state.apply(add("old"), 63 * S).outcome == "applied"


def test_requests_dropped_with_their_worker_are_remembered() -> None:
    state = SequenceState()
    state.apply(add("r", worker=4, hashes=[1, 2], tokens=8), 0)
    delta = state.apply(WorkerRemoved(worker_id=4), 1)
    assert delta.outcome == "applied" and delta.removed_ranks == [(4, 0)]
    assert state.apply(Free(request_id="r", worker_id=4), 2).outcome == "unknown_request"
    assert state.counters["tombstoned"] == 0
    assert len(state.requests) == 0 and state.registry.membership_size() == 0


def test_tombstones_expire_with_the_expiry_duration() -> None:
    state = SequenceState(expiry_s=60)
    state.apply(Free(request_id="r", worker_id=1), 0)
    assert "r" in state.tombstones
    assert state.apply(add("r"), 60 * S).outcome == "superseded"  # not older than 60 s: kept
    state = SequenceState(expiry_s=60)
    state.apply(Free(request_id="q", worker_id=1), 0)
    assert state.apply(add("q"), 60 * S + 1).outcome == "applied"  # older: forgotten


def test_tombstones_are_kept_300s_when_expiry_is_off() -> None:
    state = SequenceState(expiry_s=None)
    state.apply(Free(request_id="r", worker_id=1), 0)
    state.apply(Tick(), 300 * S)
    assert "r" in state.tombstones
    state.apply(Tick(), 300 * S + 1)
    assert "r" not in state.tombstones


def test_tombstones_are_bounded_oldest_evicted_first() -> None:
    state = SequenceState(max_tombstones=3)
    for i in range(5):
        state.apply(Free(request_id=f"r{i}", worker_id=1), i)
    assert [rid for rid, _, _ in state.tombstones.items()] == ["r2", "r3", "r4"]
    assert state.tombstones.evicted == 2
    assert state.apply(add("r0"), 10).outcome == "applied"
    assert state.apply(add("r4"), 11).outcome == "superseded"


def test_id_memories_stay_within_their_capacity_when_ids_are_consumed_or_reused() -> None:
    """Broke: a tombstone consumed by its Add, or an id ended again (a reused id), left its
    old entry in the memory's time queue until the retention (300 s) passed, so the queue, and
    the ids it held, grew with the event rate whatever the capacity: the 20,000 Free-then-Add
    pairs below left 20,000 entries in a tombstone memory of capacity 100. Expected: neither
    queue ever holds more than twice the capacity plus STALE_SLACK; what the memories
    remember, and evict, is unchanged."""
    state = SequenceState(max_tombstones=100, max_ended=100)
    bound = 2 * 100 + STALE_SLACK
    for i in range(20_000):  # a Free overtakes each Add: the Add consumes its tombstone
        state.apply(Free(request_id=f"x{i}", worker_id=1), i * 1000)
        assert state.apply(add(f"x{i}"), i * 1000).outcome == "superseded"
        assert len(state.tombstones._queue) <= bound and len(state.ended._queue) <= bound
    for i in range(20_000):  # ten ids, each booked and freed again and again
        state.apply(add(f"y{i % 10}"), S + i * 1000)
        assert state.apply(Free(request_id=f"y{i % 10}", worker_id=1), S + i * 1000).outcome == (
            "applied"
        )
        assert len(state.tombstones._queue) <= bound and len(state.ended._queue) <= bound
    assert len(state.tombstones) == 0 and state.tombstones.evicted == 0
    assert [rid for rid, _, _ in state.ended.items()] == [
        *(f"x{i}" for i in range(19_910, 20_000)),
        *(f"y{i}" for i in range(10)),
    ]
    assert state.ended.evicted == 20_000 - 90


def test_duplicate_add_on_any_rank_changes_nothing() -> None:
    state = SequenceState(expiry_s=60)
    state.apply(add("r", worker=1, hashes=[1], tokens=4), 0)
    delta = state.apply(add("r", worker=2, hashes=[9], tokens=4), 100 * S)
    assert delta.outcome == "duplicate" and not delta.changes and not delta.expired
    assert state.requests.worker_for("r") == (1, 0)
    assert (2, 0) not in state.workers  # not even a lazy rank
    assert state.counters["duplicate"] == 1


def test_strict_workers_reject_unregistered_ranks_without_creating_them() -> None:
    state = SequenceState(lazy_workers=False)
    delta = state.apply(add("r", worker=1), 0)
    assert delta.outcome == "unknown_worker" and not delta.added_ranks
    assert len(state.workers) == 0 and state.registry.loads(0) == []
    state.apply(WorkerAdded(worker_id=1, dp_size=2), 1)
    assert state.apply(add("r", worker=1, rank=1), 2).outcome == "applied"
    assert state.apply(add("q", worker=1, rank=2), 3).outcome == "unknown_worker"


def test_strict_rejection_keeps_a_free_tombstone() -> None:
    state = SequenceState(lazy_workers=False)
    state.apply(Free(request_id="r", worker_id=1), 0)
    assert state.apply(add("r"), 1).outcome == "unknown_worker"
    state.apply(WorkerAdded(worker_id=1), 2)
    assert state.apply(add("r"), 3).outcome == "superseded"


def test_mark_and_free_find_the_request_by_id_and_count_a_worker_mismatch() -> None:
    state = SequenceState()
    state.apply(add("r", worker=1, hashes=[1, 2], tokens=10), 0)
    assert state.apply(MarkPrefillCompleted(request_id="r", worker_id=2), 1).outcome == "applied"
    assert state.apply(Free(request_id="r", worker_id=1, dp_rank=5), 2).outcome == "applied"
    assert state.counters["worker_mismatch"] == 2
    assert row(state, 1, now=2) == (0, 0, 0)
    assert (2, 0) not in state.workers


def test_output_block_for_unknown_request_is_an_outcome() -> None:
    state = SequenceState()
    delta = state.apply(AddOutputBlock(request_id="nope", worker_id=1), 0)
    assert delta.outcome == "unknown_request"
    assert "nope" not in state.tombstones


def test_worker_added_replaces_the_range_and_keeps_state_in_range() -> None:
    state = SequenceState()
    state.apply(WorkerAdded(worker_id=1, dp_start=0, dp_size=2), 0)
    state.apply(add("a", worker=1, rank=0, hashes=[1]), 1)
    state.apply(add("b", worker=1, rank=1, hashes=[2]), 1)
    assert state.apply(WorkerAdded(worker_id=1, dp_size=2), 2).outcome == "duplicate"
    delta = state.apply(WorkerAdded(worker_id=1, dp_start=0, dp_size=1), 3)
    assert delta.removed_ranks == [(1, 1)] and delta.added_ranks == []
    assert row(state, 1, 0) == (1, 0, 1)
    assert state.requests.worker_for("b") is None
    assert state.apply(Free(request_id="b", worker_id=1, dp_rank=1), 4).outcome == (
        "unknown_request"
    )
    assert state.counters["tombstoned"] == 0


def test_worker_removed_takes_lazy_ranks_and_readd_starts_empty() -> None:
    state = SequenceState()
    state.apply(add("a", worker=3, rank=0, hashes=[1, 2]), 0)
    state.apply(add("b", worker=3, rank=7, hashes=[1]), 0)
    delta = state.apply(WorkerRemoved(worker_id=3), 1)
    assert sorted(delta.removed_ranks) == [(3, 0), (3, 7)]
    assert state.apply(WorkerRemoved(worker_id=3), 2).outcome == "unknown_worker"
    state.apply(WorkerAdded(worker_id=3), 3)
    assert state.registry.loads(3)[0].active_blocks == 0
    assert state.registry.overlap_depths([1, 2]) == {}


def test_log_time_never_goes_back() -> None:
    state = SequenceState()
    state.apply(add("a", tokens=100, ms=10_000.0), 10 * S)
    delta = state.apply(add("b", tokens=100, ms=10_000.0), 5 * S)  # a clock stepped back
    assert delta.at_ns == 10 * S
    assert state.slot(1).requests["b"].added_ns == 10 * S
    assert state.now_ns == 10 * S


def test_counters_count_every_outcome() -> None:
    state = SequenceState()
    state.apply(add("a"), 0)
    state.apply(add("a"), 0)
    state.apply(Free(request_id="x", worker_id=1), 0)
    state.apply(Free(request_id="a", worker_id=1), 0)
    state.apply(Tick(), 0)
    assert {k: v for k, v in state.counters.items() if v} == {
        "applied": 3,
        "duplicate": 1,
        "unknown_request": 1,
        "tombstoned": 1,
    }
