"""The slot-tracker rules of the core (``SequenceState(slot_tracker=True)``): the scenarios of
Dynamo's standalone slot tracker (docs/slot-tracker-api.md, sections 3.1 to 3.5)
with their exact numbers, as outcomes the HTTP drop-in turns into status codes.

Where seqstate departs from Dynamo on purpose, the test says so: an early Free or Mark is
remembered (a tombstone), so the late add is ``superseded`` instead of leaking until expiry.
"""

from __future__ import annotations

import pytest

from seqstate import (
    AddRequest,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000


def tracker() -> SequenceState:
    return SequenceState(slot_tracker=True)


def register(
    s: SequenceState, worker: int, dp_start: int = 0, dp_size: int = 1, block: int | None = 16
) -> str:
    return s.apply(WorkerAdded(worker, dp_start, dp_size, block_size=block), s.now_ns).outcome


def add(
    s: SequenceState, rid: str, worker: int, hashes: list[int], isl: int = 0, dp_rank: int = 0
) -> str:
    event = AddRequest(rid, worker, dp_rank, block_hashes=hashes, prefill_tokens=isl)
    return s.apply(event, s.now_ns + S).outcome


def loads(s: SequenceState) -> list[tuple[int, int, int, int]]:
    """``(worker_id, dp_rank, active_prefill_tokens, active_decode_blocks)`` as /loads."""
    return [
        (r.worker_id, r.dp_rank, r.active_prefill_tokens, r.active_blocks)
        for r in s.registry.loads(s.now_ns)
    ]


def test_shared_prefixes_count_once_per_rank_and_unregister_drops_the_requests() -> None:
    s = tracker()
    assert register(s, 1) == register(s, 2) == "applied"
    assert add(s, "r1", 1, [1, 2, 3], isl=100) == "applied"
    assert add(s, "r2", 1, [1, 2, 4], isl=50) == "applied"
    assert add(s, "r3", 2, [1, 2, 3]) == "applied"  # ranks never share blocks
    assert loads(s) == [(1, 0, 150, 4), (2, 0, 0, 3)]
    assert s.apply(Free("r1", 1), s.now_ns).outcome == "applied"
    assert loads(s) == [(1, 0, 50, 3), (2, 0, 0, 3)]  # 3 stays: r2 does not hold it
    assert s.apply(WorkerRemoved(1), s.now_ns).outcome == "applied"
    assert loads(s) == [(2, 0, 0, 3)]
    # Its dropped requests: prefill_complete is 404 (unknown), free is 200 (a no-op).
    assert s.apply(MarkPrefillCompleted("r2", 1), s.now_ns).outcome == "unknown_request"
    assert s.apply(Free("r2", 1), s.now_ns).outcome == "unknown_request"


def test_the_prefill_lifecycle_on_both_load_dimensions() -> None:
    s = tracker()
    register(s, 5, dp_start=3, dp_size=2)  # ranks 3 and 4
    assert add(s, "p", 5, [7, 8], isl=1200, dp_rank=4) == "applied"
    assert add(s, "q", 5, [], isl=30, dp_rank=4) == "applied"  # no blocks, still prefill
    assert loads(s) == [(5, 3, 0, 0), (5, 4, 1230, 2)]
    assert s.apply(MarkPrefillCompleted("p", 5, 4), s.now_ns).outcome == "applied"
    assert loads(s) == [(5, 3, 0, 0), (5, 4, 30, 2)]  # blocks unchanged
    again = s.apply(MarkPrefillCompleted("p", 5, 4), s.now_ns)
    assert again.outcome == "duplicate"  # idempotent: HTTP 200 again
    assert s.apply(Free("q", 5, 4), s.now_ns).outcome == "applied"  # free implies complete
    assert s.apply(Free("p", 5, 4), s.now_ns).outcome == "applied"
    assert loads(s) == [(5, 3, 0, 0), (5, 4, 0, 0)]
    # No decay and no dependence on time: an hour later the same.
    assert add(s, "z", 5, [1], isl=64, dp_rank=3) == "applied"
    assert s.registry.loads(s.now_ns + 3600 * S)[0].active_prefill_tokens == 64


def test_unregister_then_register_starts_fresh() -> None:
    s = tracker()
    register(s, 1)
    add(s, "a", 1, [1, 2], isl=10)
    s.apply(WorkerRemoved(1), s.now_ns)
    assert register(s, 1) == "applied"
    assert loads(s) == [(1, 0, 0, 0)]
    assert add(s, "a", 1, [1, 2], isl=10) == "applied"  # the id is free again


def test_a_duplicate_add_names_the_owner_and_the_rank_is_checked_first() -> None:
    s = tracker()
    register(s, 1, dp_size=2)
    register(s, 2)
    add(s, "d", 1, [1, 2, 3], isl=40, dp_rank=1)
    dup = s.apply(AddRequest("d", 2, block_hashes=[9], prefill_tokens=5), s.now_ns)
    assert (dup.outcome, dup.owner, dup.changes) == ("duplicate", (1, 1), [])  # 409
    assert loads(s) == [(1, 0, 0, 0), (1, 1, 40, 3), (2, 0, 0, 0)]  # the original kept all
    bad_rank = s.apply(AddRequest("d", 1, 7, block_hashes=[9]), s.now_ns)
    assert bad_rank.outcome == "unknown_worker"  # 404 before 409, as Dynamo
    assert add(s, "e", 3, [1]) == "unknown_worker"  # a worker never registered
    assert len(s.workers.slots) == 3  # strict: no rank was created


def test_free_is_idempotent_and_an_id_can_be_reused_after_it() -> None:
    s = tracker()
    register(s, 1)
    add(s, "f", 1, [4, 5], isl=8)
    assert s.apply(Free("f", 1), s.now_ns).outcome == "applied"
    assert s.apply(Free("f", 1), s.now_ns).outcome == "unknown_request"  # HTTP 200
    assert add(s, "f", 1, [4], isl=2) == "applied"  # a fresh request: 201
    assert loads(s) == [(1, 0, 2, 1)]


def test_the_first_registration_fixes_the_block_size_and_a_worker_is_registered_once() -> None:
    s = tracker()
    assert register(s, 1, block=16) == "applied"
    mismatch = s.apply(WorkerAdded(2, block_size=32), s.now_ns)
    assert (mismatch.outcome, mismatch.block_size) == ("block_size_mismatch", 16)  # 409
    assert register(s, 1, dp_size=4) == "worker_exists"  # 409, its range unchanged
    again = s.apply(WorkerAdded(1, block_size=32), s.now_ns)  # Dynamo checks the size first
    assert (again.outcome, again.block_size) == ("block_size_mismatch", 16)
    assert [(w.worker_id, w.dp_start, w.dp_size) for w in s.workers.worker_ranges()] == [(1, 0, 1)]
    assert register(s, 2, block=16) == "applied"
    assert s.block_size == 16


def test_removing_the_last_worker_ends_the_tracker() -> None:
    s = tracker()
    register(s, 1, block=16)
    add(s, "x", 1, [1])
    s.apply(WorkerRemoved(1), s.now_ns)
    assert loads(s) == [] and s.block_size is None
    # Lifecycle calls: 404 no slot tracker, and nothing is remembered.
    assert add(s, "y", 1, [1]) == "no_tracker"
    assert s.apply(MarkPrefillCompleted("y", 1), s.now_ns).outcome == "no_tracker"
    assert s.apply(Free("y", 1), s.now_ns).outcome == "no_tracker"
    assert len(s.tombstones) == 0
    assert s.apply(WorkerRemoved(1), s.now_ns).outcome == "unknown_worker"  # 404
    assert register(s, 3, block=32) == "applied"  # a new tracker may pick another size
    assert s.block_size == 32


def test_an_early_free_is_remembered_where_dynamo_forgets_it() -> None:
    """Departs from Dynamo (free before add: 200 and forgotten, the add then leaks until the
    300 s expiry): seqstate keeps a tombstone, so the late add is ``superseded`` (the drop-in
    answers it 201, like any accepted add) and books nothing."""
    s = tracker()
    register(s, 1)
    assert s.apply(Free("late", 1), s.now_ns).outcome == "unknown_request"
    assert add(s, "late", 1, [1, 2], isl=100) == "superseded"
    assert loads(s) == [(1, 0, 0, 0)]
    # An early prefill_complete (Dynamo: 404, forgotten) is remembered too: the add counts
    # its blocks but no prefill.
    assert s.apply(MarkPrefillCompleted("early", 1), s.now_ns).outcome == "unknown_request"
    assert add(s, "early", 1, [3], isl=70) == "applied"
    assert loads(s) == [(1, 0, 0, 1)]


def test_expiry_runs_on_log_time_as_dynamos_does_on_its_clock() -> None:
    """Departs from Dynamo in its clock only: a request older than the expiry (300 s by
    default, as Dynamo's) is reclaimed at the next check of its rank at least 30 s after the
    last, each check driven by an event's log time (an add on the rank, or the writer's Tick
    when the stream is idle), so a replay reclaims it at the same point of the log. Dynamo's
    60 s sweep on its own clock reclaimed at 345-360 s; here it is 300-330 s of log time."""
    s = tracker()
    t0 = s.now_ns
    register(s, 1)
    assert (
        s.apply(AddRequest("old", 1, 0, block_hashes=[1, 2], prefill_tokens=64), t0 + 1 * S).outcome
        == "applied"
    )
    for at_s in range(30, 301, 30):  # a Tick every 30 s: nothing is old enough yet
        assert s.apply(Tick(), t0 + at_s * S).expired == []
    assert loads(s) == [(1, 0, 64, 2)]
    assert s.apply(Tick(), t0 + 330 * S).expired == ["old"]
    assert loads(s) == [(1, 0, 0, 0)]
    # Gone as a free leaves it: prefill_complete 404, free 200, the id free for reuse.
    assert s.apply(MarkPrefillCompleted("old", 1), s.now_ns).outcome == "unknown_request"
    assert s.apply(Free("old", 1), s.now_ns).outcome == "unknown_request"
    assert s.apply(AddRequest("old", 1, 0, block_hashes=[3]), s.now_ns).outcome == "applied"


def test_snapshots_keep_the_rules_and_the_block_size() -> None:
    s = tracker()
    register(s, 1, block=64)
    add(s, "k", 1, [1], isl=3)
    restored = SequenceState.restore(s.snapshot())
    assert (restored.slot_tracker, restored.lazy_workers, restored.block_size) == (True, False, 64)
    assert restored.apply(WorkerAdded(2, block_size=16), s.now_ns).outcome == "block_size_mismatch"


def test_the_rules_refuse_a_worker_grace() -> None:
    with pytest.raises(ValueError, match="slot-tracker"):
        SequenceState(slot_tracker=True, worker_grace_s=5.0)
