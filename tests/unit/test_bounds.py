"""Rank bounds: an event that would take a worker or the table past its bound is refused, by a
pure check that costs what the event names; everything else is admitted unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqstate import AddRequest, Free, SequenceState, WorkerAdded, WorkerRemoved
from seqstate.bounds import RankBounds

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

BOUNDS = RankBounds(per_worker=4, total=10)


def fold(events: list[object], bounds: RankBounds = BOUNDS) -> tuple[SequenceState, list[str]]:
    state = SequenceState(expiry_s=None)
    refused = []
    for at, event in enumerate(events):
        why = bounds.refusal(state, event)  # type: ignore[arg-type]
        if why:
            refused.append(why)
        else:
            state.apply(event, at)
    return state, refused


def test_a_worker_wider_than_its_bound_is_refused_naming_the_bound() -> None:
    state, refused = fold([WorkerAdded(worker_id=1, dp_size=4096)])
    assert refused == [
        "worker 1 would have 4096 ranks, over the bound of 4 per worker (max_ranks_per_worker)"
    ]
    assert len(state.workers.slots) == 0


def test_the_table_bound_counts_what_a_resize_adds_and_drops() -> None:
    events: list[object] = [WorkerAdded(worker_id=w, dp_size=4) for w in range(2)]  # 8 ranks
    events.append(WorkerAdded(worker_id=2, dp_size=3))  # 11: refused
    events.append(WorkerAdded(worker_id=2, dp_size=2))  # 10: admitted
    events.append(WorkerAdded(worker_id=0, dp_start=2, dp_size=4))  # drops 0, 1; adds 4, 5
    events.append(WorkerAdded(worker_id=1, dp_start=0, dp_size=2))  # drops 2: 8 ranks
    state, refused = fold(events)
    assert refused == ["the write model would hold 11 ranks, over the bound of 10 (max_ranks)"]
    assert len(state.workers.slots) == 8
    assert sorted(r for w, r in state.workers.slots if w == 0) == [2, 3, 4, 5]


def test_lazy_ranks_count_and_existing_ranks_are_never_refused() -> None:
    events: list[object] = [
        AddRequest(request_id=f"r{i}", worker_id=7, dp_rank=i) for i in range(6)
    ]
    events.append(AddRequest(request_id="again", worker_id=7, dp_rank=0))
    events.append(Free(request_id="r0", worker_id=7))
    state, refused = fold(events)
    assert (
        refused
        == ["worker 7 would have 5 ranks, over the bound of 4 per worker (max_ranks_per_worker)"]
        * 2
    )
    assert state.workers.ranks_of(7) == 4
    assert "again" in state.requests.owner


def test_the_per_worker_index_follows_removals() -> None:
    state, _ = fold(
        [
            WorkerAdded(worker_id=3, dp_size=4),
            AddRequest(request_id="x", worker_id=3, dp_rank=9),
            WorkerRemoved(worker_id=3),
        ],
        RankBounds(per_worker=8, total=10),
    )
    assert state.workers.ranks_of(3) == 0 and not state.workers.by_worker
    state.check_invariants()


topology = st.lists(
    st.one_of(
        st.builds(
            WorkerAdded,
            worker_id=st.integers(0, 3),
            dp_start=st.integers(0, 3),
            dp_size=st.integers(1, 6),
        ),
        st.builds(WorkerRemoved, worker_id=st.integers(0, 3)),
        st.tuples(st.integers(0, 3), st.integers(0, 8)),  # an AddRequest for (worker, rank)
    ),
    max_size=40,
)


@settings(max_examples=200)
@given(topology)
def test_an_event_is_refused_exactly_when_applying_it_would_pass_a_bound(
    steps: list[object],
) -> None:
    bounds = RankBounds(per_worker=4, total=9)
    state = SequenceState(expiry_s=None)
    for at, step in enumerate(steps):
        event = (
            AddRequest(request_id=f"r{at}", worker_id=step[0], dp_rank=step[1])
            if isinstance(step, tuple)
            else step
        )
        why = bounds.refusal(state, event)  # type: ignore[arg-type]
        trial = SequenceState.restore(state.snapshot())  # the naive answer: try it and count
        trial.apply(event, at)
        sizes = [len(ranks) for ranks in trial.workers.by_worker.values()]
        exceeded = len(trial.workers.slots) > bounds.total or max(sizes, default=0) > 4
        assert bool(why) == exceeded, (event, why)
        if not why:
            state.apply(event, at)
        state.check_invariants()
        assert len(state.workers.slots) <= bounds.total
