"""Idle lazy ranks are forgotten: a rank that only a stray event named, empty for a while (seen
at Ticks, in log time), leaves the write model and the read model. Off by default in the core
(the reference keeps every rank); the pipeline turns it on (``forget_lazy_ranks_s``)."""

from __future__ import annotations

import pytest

from seqstate import AddRequest, Free, SequenceState, Tick, WorkerAdded

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000


def test_an_empty_lazy_rank_goes_after_the_idle_time_seen_at_ticks() -> None:
    state = SequenceState(expiry_s=None, forget_lazy_after_s=600.0)
    state.apply(WorkerAdded(worker_id=1, dp_size=1), 0)
    state.apply(AddRequest(request_id="r", worker_id=1, dp_rank=5, block_hashes=[7]), 0)
    state.apply(AddRequest(request_id="q", worker_id=2, block_hashes=[8]), 0)  # lazy, stays busy
    state.apply(Free(request_id="r", worker_id=1, dp_rank=5), 5 * S)
    assert state.apply(Tick(), 10 * S).removed_ranks == []  # first seen empty at 10 s
    assert state.apply(Tick(), 609 * S).removed_ranks == []
    delta = state.apply(Tick(), 610 * S)
    assert delta.removed_ranks == [(1, 5)]
    assert sorted(state.workers.slots) == [(1, 0), (2, 0)]  # registered, and busy lazy
    assert [(r.worker_id, r.dp_rank) for r in state.registry.loads(610 * S)] == [(1, 0), (2, 0)]
    state.check_invariants()


def test_traffic_in_between_starts_the_idle_time_again() -> None:
    state = SequenceState(expiry_s=None, forget_lazy_after_s=60.0)
    state.apply(AddRequest(request_id="a", worker_id=3, block_hashes=[1]), 0)
    state.apply(Free(request_id="a", worker_id=3), S)
    state.apply(Tick(), 2 * S)  # empty since 2 s
    state.apply(AddRequest(request_id="b", worker_id=3, block_hashes=[1]), 30 * S)
    state.apply(Tick(), 40 * S)  # busy: the idle time is gone
    state.apply(Free(request_id="b", worker_id=3), 50 * S)
    assert state.apply(Tick(), 70 * S).removed_ranks == []  # empty since 70 s, not 2 s
    assert state.apply(Tick(), 130 * S).removed_ranks == [(3, 0)]


def test_a_snapshot_carries_the_rule_and_the_idle_times() -> None:
    events = [
        (AddRequest(request_id="a", worker_id=4, block_hashes=[1]), 0),
        (Free(request_id="a", worker_id=4), S),
        (Tick(), 2 * S),
    ]
    whole = SequenceState(expiry_s=None, forget_lazy_after_s=60.0)
    for event, at in events:
        whole.apply(event, at)
    resumed = SequenceState.restore(whole.snapshot())
    assert resumed.forget_lazy_after_s == 60.0 and resumed.idle_since == {(4, 0): 2 * S}
    assert resumed.apply(Tick(), 62 * S).removed_ranks == [(4, 0)]
    assert whole.apply(Tick(), 62 * S).removed_ranks == [(4, 0)]
    assert resumed.snapshot() == whole.snapshot()


def test_off_by_default_every_rank_stays() -> None:
    state = SequenceState(expiry_s=None)
    state.apply(AddRequest(request_id="a", worker_id=4, block_hashes=[1]), 0)
    state.apply(Free(request_id="a", worker_id=4), S)
    assert state.apply(Tick(), 10**6 * S).removed_ranks == []
    assert (4, 0) in state.workers.slots
