"""The namespace's block size under the router rules: a scheduler reads it to count a
prompt's tokens in blocks, so a registration that names one records it. The router rules refuse
no registration: the latest that names a size sets it, and a removal leaves it (the
slot-tracker rules, which fix it at the first registration: test_slot_tracker_rules.py).
"""

from __future__ import annotations

import pytest

from seqstate import Delta, SequenceState, WorkerAdded, WorkerRemoved

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too


def register(s: SequenceState, worker: int, dp_size: int = 1, block: int | None = None) -> Delta:
    return s.apply(WorkerAdded(worker, 0, dp_size, block_size=block), s.now_ns)


def test_the_latest_registration_naming_a_block_size_sets_it() -> None:
    s = SequenceState()
    assert s.block_size is None
    first = register(s, 1)  # names none: nothing to record
    assert (first.outcome, first.block_size, s.block_size) == ("applied", None, None)
    named = register(s, 2, block=16)
    assert (named.outcome, named.block_size, s.block_size) == ("applied", 16, 16)
    other = register(s, 3, block=32)  # never refused: the latest wins
    assert (other.outcome, other.block_size, s.block_size) == ("applied", 32, 32)
    silent = register(s, 4)  # a registration naming none keeps the namespace's
    assert (silent.outcome, silent.block_size, s.block_size) == ("applied", 32, 32)
    # The same registrations under the slot-tracker rules: the first fixes it, another is
    # refused, and the last removal ends it.
    t = SequenceState(slot_tracker=True)
    assert register(t, 2, block=16).outcome == "applied"
    refused = register(t, 3, block=32)
    assert (refused.outcome, refused.block_size, t.block_size) == ("block_size_mismatch", 16, 16)
    assert t.apply(WorkerRemoved(2), t.now_ns).block_size == 0  # the tracker ended
    assert t.block_size is None


def test_the_same_range_with_a_new_block_size_is_applied_and_the_same_again_a_duplicate() -> None:
    s = SequenceState()
    assert register(s, 1, dp_size=2, block=16).outcome == "applied"
    assert register(s, 1, dp_size=2, block=16).outcome == "duplicate"
    assert register(s, 1, dp_size=2).outcome == "duplicate"
    again = register(s, 1, dp_size=2, block=64)
    assert (again.outcome, again.block_size, again.added_ranks, again.removed_ranks) == (
        "applied",
        64,
        [],
        [],
    )
    assert s.block_size == 64
    assert [(w.worker_id, w.dp_start, w.dp_size) for w in s.workers.worker_ranges()] == [(1, 0, 2)]


def test_a_removal_leaves_the_block_size_and_a_snapshot_keeps_it() -> None:
    s = SequenceState()
    register(s, 1, block=16)
    removed = s.apply(WorkerRemoved(1), s.now_ns)
    assert (removed.outcome, removed.block_size, s.block_size) == ("applied", None, 16)
    restored = SequenceState.restore(s.snapshot())
    assert (restored.slot_tracker, restored.block_size) == (False, 16)
    assert restored.snapshot() == s.snapshot()
