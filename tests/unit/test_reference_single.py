"""Port of Dynamo's ``lib/kv-router/src/sequences/single.rs`` tests.

Each test keeps the catalogue's name and numbers. Conventions: block size 4; times are seconds
from epoch 0 converted to log-time nanoseconds; a ``tracking_hint(n)`` is
``prefill_tokens=n`` with no duration, ``tracking_hint(0)`` / "no hint" is
``prefill_tokens=0``, a ``(n, s)`` hint is ``prefill_tokens=n, expected_prefill_ms=s*1000``.
Dynamo's ``ActiveSequences`` is one rank of a :class:`SequenceState` (worker 1, dp rank 0,
created lazily by the first AddRequest), read through the registry the state maintains.

Skipped:

* ``active_sequences_remains_send_and_sync`` (9.1 #1): Rust-specific (Send + Sync marker
  traits); Python has no counterpart.

Where our design replaces Dynamo's mechanism (docs/architecture.md, "The rules"), the test
asserts our rule and departs from the named Dynamo test as follows:

* ``active_worker_teardown_with_a_live_long_chain_is_iterative``: Dynamo drops the
  ``ActiveSequences`` value; here the 65,536-block chain is released both by a Free and by
  dropping its worker (WorkerRemoved) while the request is live.
* ``test_prompt_membership_delta_only_reports_first_add_and_last_remove``: our delta books and
  releases requests (by slot); the membership change is what the registry's rank set gains
  and loses, the BASE-credit shape (store [1,2], then [3]; remove [1,2,3]), not HEAD's full
  path plus start index.
* ``test_generic_block_membership_includes_output_blocks``: our output blocks are weights held
  per request, not random hashes, so the set of active hashes stays {1,2,3} after the output
  block (Dynamo's block-tracker set gains the output hash); the output block shows up in the
  block count instead, and, as in Dynamo, never in a membership delta.
* ``test_active_sequences_shared_blocks``: the HEAD variant (second request [5]); block hashes
  are chained, so the BASE-credit variant (hash 4 reused at another depth) cannot occur.
* ``test_mark_prefill_completed``: the second mark of a live request is outcome ``duplicate``
  (Dynamo: Ok, silent no-op); the numbers are the same.
* ``test_prefill_queue_and_sum_invariants_survive_idempotent_cleanup``: the second Free of an id
  that just ended is outcome ``unknown_request`` (Dynamo: warn, empty delta).
* ``test_force_expiry``, ``test_force_expiry_uses_custom_duration``,
  ``test_force_expiry_reanchors_new_oldest_request``: expiry runs on event time, not the wall
  clock. Dynamo's ``force_expiry()`` call at an instant is a ``Tick`` applied at that log
  time; the add-time check is an AddRequest applied at its log time. Add times are log
  times, so the throttle and the strict age cut-off are exact. ``test_force_expiry`` goes on
  past the catalogue's steps to pin the 30 s throttle while a request is already stale.
* ``test_add_request_without_prefill_tracking_keeps_active_tokens_zero`` also books a request
  with ``track_prefill_tokens=False`` *and* 12 hint tokens, which must stay untracked too.
* ``test_custom_expiry_rejects_zero_duration``: Dynamo panics; ``SequenceState(expiry_s=0)``
  raises ValueError with the same message.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from seqstate import (
    AddOutputBlock,
    AddRequest,
    Free,
    LoadRow,
    MarkPrefillCompleted,
    SequenceState,
    Tick,
    WorkerRemoved,
)
from seqstate.deltas import Delta
from seqstate.sequences import ActiveSequences

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
WORKER = 1
RANK = (WORKER, 0)


def add(
    state: SequenceState,
    request_id: str,
    hashes: list[int],
    at_s: float,
    tokens: int = 0,
    duration_s: float | None = None,
    track: bool = True,
) -> Delta:
    """Book ``request_id`` on worker (1, 0); ``tokens``/``duration_s`` form the prefill hint."""
    event = AddRequest(
        request_id=request_id,
        worker_id=WORKER,
        block_hashes=hashes,
        prefill_tokens=tokens,
        expected_prefill_ms=None if duration_s is None else duration_s * 1000,
        track_prefill_tokens=track,
    )
    return state.apply(event, int(at_s * S))


def mark(state: SequenceState, request_id: str, at_s: float) -> Delta:
    return state.apply(MarkPrefillCompleted(request_id=request_id, worker_id=WORKER), int(at_s * S))


def free(state: SequenceState, request_id: str, at_s: float) -> Delta:
    return state.apply(Free(request_id=request_id, worker_id=WORKER), int(at_s * S))


def tick(state: SequenceState, at_s: float) -> Delta:
    return state.apply(Tick(), int(at_s * S))


def row(state: SequenceState, at_s: float) -> LoadRow:
    """The registry's load row of worker (1, 0) read at ``at_s``."""
    rows = [r for r in state.registry.loads(int(at_s * S)) if (r.worker_id, r.dp_rank) == RANK]
    assert len(rows) == 1
    return rows[0]


def blocks(state: SequenceState) -> int:
    return row(state, 0).active_blocks


def tokens(state: SequenceState, at_s: float) -> int:
    return row(state, at_s).active_prefill_tokens


def slot(state: SequenceState) -> ActiveSequences:
    found = state.slot(*RANK)
    assert found is not None
    return found


def membership_change(
    state: SequenceState, step: Callable[[], Delta]
) -> tuple[list[int], list[int]]:
    """``(stored, removed)``: the hashes the rank's membership gained and lost in ``step``,
    which must be an applied event touching only this rank."""
    before = state.registry.hashes_of(RANK)
    delta = step()
    assert delta.outcome == "applied"
    assert [(c.worker_id, c.dp_rank) for c in delta.changes] == [RANK]
    after = state.registry.hashes_of(RANK)
    return sorted(after - before), sorted(before - after)


def test_active_worker_teardown_with_a_live_long_chain_is_iterative() -> None:
    chain = list(range(1, 65_537))
    state = SequenceState(expiry_s=None)

    # Released by a Free.
    assert membership_change(state, lambda: add(state, "long", chain, 0)) == (chain, [])
    assert blocks(state) == 65_536
    assert state.registry.overlap_depths(chain) == {RANK: 65_536}
    assert membership_change(state, lambda: free(state, "long", 1)) == ([], chain)
    assert blocks(state) == 0
    assert state.registry.membership_size() == 0

    # Dropped with its worker while still live.
    add(state, "long-2", chain, 2)
    assert state.registry.membership_size() == 65_536
    delta = state.apply(WorkerRemoved(worker_id=WORKER), 3 * S)
    assert delta.outcome == "applied"
    assert delta.removed_ranks == [RANK]
    assert state.slot(*RANK) is None
    assert state.registry.membership_size() == 0
    assert state.registry.ranks() == []
    assert "long-2" not in state.requests
    state.check_invariants()


def test_prompt_membership_delta_only_reports_first_add_and_last_remove() -> None:
    state = SequenceState(expiry_s=None)

    deltas: list[Delta] = []

    def step(delta: Delta) -> Delta:
        deltas.append(delta)
        return delta

    assert membership_change(state, lambda: step(add(state, "r1", [1, 2], 0, tokens=8))) == (
        [1, 2],
        [],
    )
    r2 = [1, 2, 3]
    assert membership_change(state, lambda: step(add(state, "r2", r2, 0, tokens=12))) == ([3], [])
    assert membership_change(state, lambda: step(free(state, "r1", 0))) == ([], [])
    assert membership_change(state, lambda: step(free(state, "r2", 0))) == ([], [1, 2, 3])

    for delta in deltas:
        assert delta.expired == []
    assert state.registry.hashes_of(RANK) == set()
    state.check_invariants()


def test_generic_block_membership_includes_output_blocks() -> None:
    state = SequenceState(expiry_s=None)

    added = membership_change(state, lambda: add(state, "r1", [1, 2, 3], 0, tokens=12))
    assert added == ([1, 2, 3], [])
    assert state.registry.hashes_of(RANK) == {1, 2, 3}
    assert blocks(state) == 3

    output = AddOutputBlock(request_id="r1", worker_id=WORKER, decay_fraction=0.5)
    # The output block is no prompt hash: membership is unchanged, the block count grows
    # (3 prompt + 1 output blocks, all exclusive to r1 and weighted 0.5 -> 2).
    assert membership_change(state, lambda: state.apply(output, 0)) == ([], [])
    assert state.registry.hashes_of(RANK) == {1, 2, 3}
    assert slot(state).blocks.outputs == 1
    assert blocks(state) == 2

    assert membership_change(state, lambda: mark(state, "r1", 0)) == ([], [])
    assert tokens(state, 0) == 0
    assert state.registry.hashes_of(RANK) == {1, 2, 3}

    assert membership_change(state, lambda: free(state, "r1", 0)) == ([], [1, 2, 3])
    assert state.registry.hashes_of(RANK) == set()
    assert blocks(state) == 0
    state.check_invariants()


def test_active_sequences_shared_blocks() -> None:
    state = SequenceState(expiry_s=None)

    add(state, "r1", [1, 2, 3], 0, tokens=12)
    assert (blocks(state), tokens(state, 0)) == (3, 12)
    add(state, "r2", [5], 0, tokens=4)
    assert (blocks(state), tokens(state, 0)) == (4, 16)
    add(state, "r3", [1, 2, 3, 4], 0)
    assert (blocks(state), tokens(state, 0)) == (5, 16)

    free(state, "r2", 0)
    assert (blocks(state), tokens(state, 0)) == (4, 12)
    free(state, "r3", 0)
    assert (blocks(state), tokens(state, 0)) == (3, 12)
    free(state, "r1", 0)
    assert (blocks(state), tokens(state, 0)) == (0, 0)
    state.check_invariants()


def test_output_blocks_with_fractional_decay() -> None:
    state = SequenceState(expiry_s=None)

    add(state, "r1", [1, 2, 3], 0, tokens=12)
    assert blocks(state) == 3
    state.apply(AddOutputBlock(request_id="r1", worker_id=WORKER, decay_fraction=0.5), 0)
    assert blocks(state) == 2  # 4 blocks x 0.5

    add(state, "r2", [1, 2], 0, tokens=8)
    assert blocks(state) == 2  # nothing new; 1 and 2 keep their 0.5 weight

    state.apply(AddOutputBlock(request_id="r1", worker_id=WORKER, decay_fraction=0.0), 0)
    # Shared 1 and 2 stay 0.5; r1's exclusive block 3 and both outputs drop to 0.
    assert blocks(state) == 1
    state.check_invariants()

    free(state, "r2", 0)
    free(state, "r1", 0)
    assert (blocks(state), tokens(state, 0)) == (0, 0)
    state.check_invariants()


def test_mark_prefill_completed() -> None:
    state = SequenceState(expiry_s=None)

    add(state, "r1", [1, 2, 3], 0, tokens=12)
    assert tokens(state, 0) == 12
    assert mark(state, "r1", 0).outcome == "applied"
    assert tokens(state, 0) == 0
    assert mark(state, "r1", 0).outcome == "duplicate"
    assert tokens(state, 0) == 0
    assert blocks(state) == 3  # marking keeps the blocks

    add(state, "r2", [4, 5], 0, tokens=8)
    assert tokens(state, 0) == 8
    free(state, "r2", 0)
    assert tokens(state, 0) == 0
    state.check_invariants()


def test_add_request_without_prefill_tracking_keeps_active_tokens_zero() -> None:
    state = SequenceState(expiry_s=None)

    add(state, "r1", [1, 2, 3], 0, track=False)
    # A hint with tokens is ignored as well when tracking is off.
    add(state, "r2", [4], 0, tokens=12, track=False)
    prefill = slot(state).prefill
    assert tokens(state, 0) == 0
    assert prefill.order == []
    assert prefill.full_tokens == 0
    assert row(state, 0).active_requests == 2

    mark(state, "r1", 0)
    assert tokens(state, 0) == 0
    free(state, "r1", 0)
    free(state, "r2", 0)
    assert blocks(state) == 0
    assert row(state, 0).active_requests == 0
    state.check_invariants()


def test_prefill_queue_and_sum_invariants_survive_idempotent_cleanup() -> None:
    state = SequenceState(expiry_s=None)
    add(state, "r1", [1], 0, tokens=50, duration_s=10)
    add(state, "r2", [2], 0, tokens=30, duration_s=10)
    prefill = slot(state).prefill
    assert prefill.full_tokens == 80
    assert prefill.order == ["r1", "r2"]

    assert mark(state, "r1", 0).outcome == "applied"
    assert mark(state, "r1", 0).outcome == "duplicate"
    assert (prefill.full_tokens, prefill.order) == (30, ["r2"])
    prefill.check_invariants()

    assert free(state, "r1", 0).outcome == "applied"
    assert free(state, "r1", 0).outcome == "unknown_request"
    assert (prefill.full_tokens, prefill.order) == (30, ["r2"])
    prefill.check_invariants()

    free(state, "r2", 0)
    assert (prefill.full_tokens, prefill.order) == (0, [])
    assert prefill.anchor is None
    assert slot(state).requests == {}
    state.check_invariants()


def test_force_expiry() -> None:
    state = SequenceState()  # default 300 s
    add(state, "r1", [1, 2], 0, tokens=8)
    add(state, "r2", [3, 4], 0, tokens=8)
    assert blocks(state) == 4

    # t=20: the 30 s check interval has not passed since the rank was created.
    assert tick(state, 20).expired == []
    assert blocks(state) == 4
    # t=31 and t=121: the check runs but both requests are too young.
    assert tick(state, 31).expired == []
    assert blocks(state) == 4
    assert tick(state, 121).expired == []
    assert blocks(state) == 4

    # t=301: both were added strictly more than 300 s before.
    delta = tick(state, 301)
    assert sorted(delta.expired) == ["r1", "r2"]
    assert (blocks(state), tokens(state, 301)) == (0, 0)
    assert state.registry.hashes_of(RANK) == set()
    assert "r1" not in state.requests and "r2" not in state.requests

    # t=332: the add runs its rank's check (31 s later), which finds nothing.
    delta = add(state, "r3", [5], 332, tokens=4)
    assert delta.expired == []
    assert (blocks(state), tokens(state, 332)) == (1, 4)
    assert state.counters["expired"] == 2
    state.check_invariants()

    # Beyond the catalogue: the 30 s throttle holds even when something is stale. The add at
    # t=620 checks (r3, added at 332, is not yet 300 s old); at t=640 r3 is stale but the last
    # check was 20 s ago; at t=650 the check runs again and expires it.
    assert add(state, "r4", [6], 620).expired == []
    assert tick(state, 640).expired == []
    assert "r3" in state.requests
    assert tick(state, 650).expired == ["r3"]
    assert blocks(state) == 1
    state.check_invariants()


def test_force_expiry_uses_custom_duration() -> None:
    state = SequenceState(expiry_s=60)
    add(state, "r1", [1, 2], 0)
    assert blocks(state) == 2

    delta = tick(state, 61)
    assert delta.expired == ["r1"]
    assert blocks(state) == 0
    assert "r1" not in state.requests
    state.check_invariants()


def test_custom_expiry_rejects_zero_duration() -> None:
    with pytest.raises(ValueError) as excinfo:
        SequenceState(expiry_s=0)
    assert str(excinfo.value) == "expiry_duration must be greater than zero"


def test_force_expiry_reanchors_new_oldest_request() -> None:
    state = SequenceState()  # default 300 s
    add(state, "r1", [1], 0, tokens=40, duration_s=100)
    # The add at t=250 runs the rank's check: nothing is 300 s old yet.
    assert add(state, "r2", [2], 250, tokens=30, duration_s=100).expired == []

    delta = tick(state, 310)
    assert delta.expired == ["r1"]
    assert tokens(state, 310) == 30
    assert slot(state).prefill.anchor == ("r2", 310 * S)
    assert tokens(state, 330) == 24
    state.check_invariants()
