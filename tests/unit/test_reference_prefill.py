"""Port of Dynamo's ``lib/kv-router/src/sequences/prefill_tracker.rs`` tests and of worked
examples of its decay, computed by hand from its formula.

The 9.2 tests drive :class:`seqstate.prefill.PrefillTracker` and read its
:class:`~seqstate.PrefillSnapshot` directly, with the catalogue's names and numbers. Times are
seconds from epoch 0 as nanoseconds; a ``(n, s)`` prefill is ``n`` tokens with an ``s``-second
modeled duration, ``None`` is no duration. Dynamo's ``Err(MissingExpectedDuration)`` is
``modeled_remaining_ms(...) is None``; its ``Ok(x)`` is ``x``.

``test_worked_examples_table`` is parametrized over every row of the 6.7 table. Each row is a
small script of adds, prefill completions (mark / remove), frees, expiry sweeps and expected
readings, run at every level that can express it:

* tracker level: one ``PrefillTracker`` per worker, a completion or free is ``remove``;
* state level: a :class:`~seqstate.SequenceState` fed the equivalent events at their log times
  (several workers are lazy ranks), read through ``registry.loads(now)`` and, for tokens, also
  through ``registry.potential_loads([], 0, now)`` (Dynamo's potential tokens with no delta);
* registry level: a :class:`~seqstate.PromptRegistry` given a load-only delta.

None of those tests is skipped. Departures from Dynamo, by design (docs/architecture.md):

* the "replica (receive-time anchored)" row (Dynamo's
  ``replica_sync_modeled_remaining_prefill_time_uses_receive_time_and_clears``) has no replica
  here: the remote events are log events applied at their log times, which is the time the
  decay is anchored at (the writer's receive time);
* the "single.rs expiry re-anchor" row (Dynamo's
  ``test_force_expiry_reanchors_new_oldest_request``) sweeps on event time: the sweep is a
  ``Tick`` applied at t=310 instead of a wall-clock ``force_expiry()``;
* the multi-worker rows (Dynamo's
  ``modeled_remaining_prefill_time_loads_follow_multi_worker_projection`` and
  ``free_nonanchor_modeled_prefill_applies_anchor_credit``) complete prefill with
  MarkPrefillCompleted / Free found by request id alone, as our lookup rule states.
* the anchor-only ceiling is exact integer arithmetic (no f64 evaluation); none of these
  numbers depend on the difference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import pytest

from seqstate import (
    AddRequest,
    Delta,
    Free,
    MarkPrefillCompleted,
    PrefillSnapshot,
    PromptRegistry,
    RankChange,
    RankLoad,
    SequenceState,
    Tick,
    WorkerAdded,
)
from seqstate.prefill import PrefillTracker

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S: Final = 1_000_000_000


def tracker_with(*prefills: tuple[str, int, float | None, float]) -> PrefillTracker:
    """Insert ``(request_id, tokens, duration_s | None, at_s)`` in order."""
    tracker = PrefillTracker()
    for request_id, tokens, duration_s, at_s in prefills:
        duration_ns = None if duration_s is None else int(duration_s * S)
        tracker.insert(request_id, tokens, duration_ns, int(at_s * S))
    tracker.check_invariants()
    return tracker


def active_tokens(tracker: PrefillTracker, at_s: float) -> int:
    return tracker.snapshot().active_tokens(int(at_s * S))


def modeled_ms(tracker: PrefillTracker, at_s: float) -> int | None:
    return tracker.snapshot().modeled_remaining_ms(int(at_s * S))


# ---- 9.2 prefill_tracker.rs ------------------------------------------------------------------


def test_snapshot_without_anchor_reports_zero_active_tokens() -> None:
    tracker = PrefillTracker()
    snapshot = tracker.snapshot()
    assert snapshot.anchored_since_ns is None
    assert snapshot.active_tokens(0) == 0
    assert snapshot.active_tokens(1_000 * S) == 0
    assert PrefillSnapshot().active_tokens(0) == 0


def test_modeled_remaining_snapshot_without_anchor_reports_zero() -> None:
    tracker = PrefillTracker()
    assert modeled_ms(tracker, 0) == 0
    assert modeled_ms(tracker, 1_000) == 0
    assert PrefillSnapshot().modeled_remaining_ms(0) == 0


def test_modeled_remaining_no_aic_prefill_returns_missing_duration_error() -> None:
    tracker = tracker_with(("r1", 100, None, 0))
    assert modeled_ms(tracker, 0) is None
    assert active_tokens(tracker, 0) == 100  # unmodeled: no decay


def test_modeled_remaining_mixed_modeled_and_unmodeled_prefills_return_error() -> None:
    tracker = tracker_with(("r1", 100, 10, 0), ("r2", 60, None, 0))
    assert modeled_ms(tracker, 2) is None


def test_modeled_remaining_single_prefill_clips_at_zero() -> None:
    tracker = tracker_with(("r1", 100, 10, 0))
    assert modeled_ms(tracker, 15) == 0


def test_modeled_remaining_subtracts_elapsed_from_total_modeled_duration() -> None:
    tracker = tracker_with(("r1", 100, 10, 0), ("r2", 60, 6, 2))
    assert modeled_ms(tracker, 2) == 14_000
    assert modeled_ms(tracker, 12) == 4_000
    assert modeled_ms(tracker, 17) == 0


def test_modeled_remaining_zero_duration_prefill_contributes_no_time() -> None:
    tracker = tracker_with(("r1", 100, 0, 0), ("r2", 60, 6, 0))
    assert modeled_ms(tracker, 0) == 6_000
    assert modeled_ms(tracker, 3) == 3_000
    assert modeled_ms(tracker, 7) == 0


def test_snapshot_only_decays_oldest_prefill() -> None:
    tracker = tracker_with(("r1", 100, 10, 0), ("r2", 60, 6, 2))
    assert active_tokens(tracker, 2) == 140
    assert active_tokens(tracker, 5) == 110
    assert active_tokens(tracker, 12) == 40  # spillover past the anchor's own tokens


def test_active_tokens_with_unmodeled_prefills_use_anchor_only_decay() -> None:
    tracker = tracker_with(("r1", 100, 10, 0), ("r2", 60, None, 0))
    assert active_tokens(tracker, 12) == 60


def test_active_tokens_zero_duration_anchor_only_completes_anchor() -> None:
    tracker = tracker_with(("r1", 100, 0, 0), ("r2", 60, 6, 0))
    assert active_tokens(tracker, 0) == 60
    assert active_tokens(tracker, 3) == 60


def test_nonfront_modeled_removal_preserves_time_and_token_continuity() -> None:
    tracker = tracker_with(("r1", 100, 10, 0), ("r2", 40, 4, 0))
    assert active_tokens(tracker, 5) == 90
    assert modeled_ms(tracker, 5) == 9_000

    assert tracker.remove("r2", 5 * S) == (40, 4 * S)
    tracker.check_invariants()
    assert tracker.order == ["r1"]
    assert tracker.anchor == ("r1", 4 * S)
    assert active_tokens(tracker, 5) == 90
    assert modeled_ms(tracker, 5) == 9_000


def test_nonfront_modeled_removal_caps_anchor_shift_at_removal_time() -> None:
    tracker = tracker_with(("r1", 100, 10, 0), ("r2", 40, 4, 0))
    assert tracker.remove("r2", 2 * S) == (40, 4 * S)
    tracker.check_invariants()
    assert tracker.anchor == ("r1", 2 * S)
    assert active_tokens(tracker, 2) == 100
    assert modeled_ms(tracker, 2) == 10_000
    assert active_tokens(tracker, 3) == 90
    assert modeled_ms(tracker, 3) == 9_000


def test_nonfront_unmodeled_removal_does_not_shift_anchor() -> None:
    tracker = tracker_with(("r1", 100, 10, 0), ("r2", 40, None, 0))
    assert tracker.remove("r2", 5 * S) == (40, None)
    tracker.check_invariants()
    assert tracker.anchor == ("r1", 0)
    assert active_tokens(tracker, 5) == 50


def test_removing_anchored_prefill_reanchors_front_and_resets_decay() -> None:
    tracker = tracker_with(("r1", 100, 10, 0), ("r2", 40, 8, 0))
    assert tracker.remove("r1", 3 * S) == (100, 10 * S)
    tracker.check_invariants()
    assert tracker.order == ["r2"]
    assert tracker.anchor == ("r2", 3 * S)
    assert active_tokens(tracker, 3) == 40
    assert active_tokens(tracker, 5) == 30
    assert modeled_ms(tracker, 5) == 6_000


def test_removing_nonfront_modeled_prefill_shifts_existing_anchor() -> None:
    tracker = tracker_with(("r1", 30, 6, 0), ("r2", 20, 4, 0))
    assert tracker.remove("r2", 2 * S) == (20, 4 * S)
    tracker.check_invariants()
    assert tracker.anchor == ("r1", 2 * S)
    assert active_tokens(tracker, 2) == 30
    assert active_tokens(tracker, 4) == 20


def test_duplicate_cleanup_is_idempotent() -> None:
    tracker = tracker_with(("r1", 50, 10, 0), ("r2", 30, 10, 0))
    assert tracker.remove("r1", 0) == (50, 10 * S)
    assert tracker.remove("r1", 0) is None
    tracker.check_invariants()
    assert tracker.full_tokens == 30
    assert tracker.order == ["r2"]

    assert tracker.remove("r2", 0) == (30, 10 * S)
    assert tracker.remove("r2", 0) is None
    tracker.check_invariants()
    assert tracker.full_tokens == 0
    assert tracker.order == []
    assert tracker.prefills == {}
    assert tracker.anchor is None


# ---- 6.7 worked examples -----------------------------------------------------------------------

A: Final = 1  # worker ids; every rank is dp rank 0
B: Final = 2


@dataclass(frozen=True)
class Add:
    request_id: str
    tokens: int
    duration_s: float | None
    at_s: float
    worker: int = A


@dataclass(frozen=True)
class Complete:
    """Prefill completion: MarkPrefillCompleted, or ``remove`` on a tracker."""

    request_id: str
    at_s: float
    worker: int = A


@dataclass(frozen=True)
class Release:
    """The request ends: Free, or ``remove`` on a tracker."""

    request_id: str
    at_s: float
    worker: int = A


@dataclass(frozen=True)
class Sweep:
    """An expiry sweep: a Tick (state level only)."""

    at_s: float


@dataclass(frozen=True)
class Register:
    """A known rank with nothing on it: WorkerAdded, or an empty tracker."""

    worker: int
    at_s: float = 0


@dataclass(frozen=True)
class LoadOnly:
    """A load-only registry update (registry level only)."""

    worker: int
    full_tokens: int
    anchor_tokens: int
    anchor_duration_s: float
    anchored_at_s: float
    modeled_ms: int


class _Unset:
    def __repr__(self) -> str:
        return "-"


UNSET: Final = _Unset()
MISSING: Final = None  # Dynamo's Err(MissingExpectedDuration)


@dataclass(frozen=True)
class Expect:
    """Readings at ``at_s`` on ``worker``; UNSET is a table dash (not asserted)."""

    at_s: float
    tokens: int | _Unset = UNSET
    ms: int | _Unset | None = UNSET
    worker: int = A
    requests: int | _Unset = UNSET  # state level only


Step = Add | Complete | Release | Sweep | Register | LoadOnly | Expect


@dataclass(frozen=True)
class Row:
    steps: tuple[Step, ...]
    expiry_s: float | None = None  # state level


WORKED_EXAMPLES: Final = [
    pytest.param(
        Row((Register(A), Expect(0, tokens=0, ms=0), Expect(1_000, tokens=0, ms=0))),
        id="empty",
    ),
    pytest.param(
        Row((Add("r1", 100, None, 0), Expect(0, ms=MISSING))),
        id="r1(100,None)@0-missing-duration",
    ),
    pytest.param(
        Row((Add("r1", 100, 10, 0), Add("r2", 60, None, 0), Expect(2, ms=MISSING))),
        id="r1(100,10s)+r2(60,None)@0-missing-duration@2",
    ),
    pytest.param(
        Row((Add("r1", 100, 10, 0), Add("r2", 60, None, 0), Expect(12, tokens=60))),
        id="r1(100,10s)+r2(60,None)@0-anchor-only@12",
    ),
    pytest.param(
        Row((Add("r1", 100, 10, 0), Expect(15, ms=0))),
        id="r1(100,10s)@0-clipped@15",
    ),
    pytest.param(
        Row(
            (
                Add("r1", 100, 10, 0),
                Add("r2", 60, 6, 2),
                Expect(2, tokens=140, ms=14_000),
                Expect(5, tokens=110),
                Expect(12, tokens=40, ms=4_000),
                Expect(17, ms=0),
            )
        ),
        id="r1(100,10s)@0+r2(60,6s)@2-spillover",
    ),
    pytest.param(
        Row(
            (
                Add("r1", 100, 0, 0),
                Add("r2", 60, 6, 0),
                Expect(0, tokens=60, ms=6_000),
                Expect(3, tokens=60, ms=3_000),
                Expect(7, ms=0),
            )
        ),
        id="r1(100,0ms)+r2(60,6s)@0-zero-duration-anchor",
    ),
    pytest.param(
        Row(
            (
                Add("r1", 100, 10, 0),
                Add("r2", 40, 8, 0),
                Complete("r1", 3),
                Expect(3, tokens=40),
                Expect(5, tokens=30, ms=6_000),
            )
        ),
        id="remove-anchor-r1@3-reanchors-r2",
    ),
    pytest.param(
        Row(
            (
                Add("r1", 30, 6, 0),
                Add("r2", 20, 4, 0),
                Complete("r2", 2),
                Expect(2, tokens=30),
                Expect(4, tokens=20),
            )
        ),
        id="remove-nonfront-r2@2-shifts-anchor-to-2",
    ),
    pytest.param(
        Row((Add("r1", 100, 10, 0), Add("r2", 40, 4, 0), Expect(5, tokens=90, ms=9_000))),
        id="r1(100,10s)+r2(40,4s)-before-removal@5",
    ),
    pytest.param(
        Row(
            (
                Add("r1", 100, 10, 0),
                Add("r2", 40, 4, 0),
                Expect(5, tokens=90, ms=9_000),
                Complete("r2", 5),
                Expect(5, tokens=90, ms=9_000),
            )
        ),
        id="then-remove-r2@5-continuous",
    ),
    pytest.param(
        Row(
            (
                Add("r1", 100, 10, 0),
                Add("r2", 40, 4, 0),
                Complete("r2", 2),
                Expect(2, tokens=100, ms=10_000),
                Expect(3, tokens=90, ms=9_000),
            )
        ),
        id="remove-r2@2-cap-binds",
    ),
    pytest.param(
        Row(
            (
                Add("r1", 100, 10, 0),
                Add("r2", 40, None, 0),
                Complete("r2", 5),
                Expect(5, tokens=50),
            )
        ),
        id="remove-unmodeled-r2@5-anchor-stays",
    ),
    pytest.param(
        Row(
            (
                Add("oldest", 100, 10, 0, worker=A),
                Add("later", 60, 4, 1, worker=A),
                Add("b", 12, None, 0, worker=B),
                Expect(3, ms=11_000, worker=A),
                Expect(3, ms=MISSING, worker=B),
            )
        ),
        id="multi-worker-modeled-time",
    ),
    pytest.param(
        Row(
            (
                Add("oldest", 100, 10, 0, worker=A),
                Add("later", 60, 4, 1, worker=A),
                Add("b", 12, None, 0, worker=B),
                Expect(3, ms=11_000, worker=A),
                Expect(3, ms=MISSING, worker=B),
                Complete("oldest", 3, worker=A),
                Expect(5, ms=2_000, worker=A, requests=2),
                Expect(5, ms=MISSING, worker=B, requests=1),
            )
        ),
        id="multi-worker-mark-oldest@3-reanchors-later",
    ),
    pytest.param(
        Row(
            (
                Add("oldest", 100, 10, 0, worker=A),
                Add("later", 40, 4, 0, worker=A),
                Register(B),
                Expect(5, tokens=90, ms=9_000, worker=A, requests=2),
                Release("later", 5, worker=A),
                Expect(5, tokens=90, ms=9_000, worker=A, requests=1),
                Expect(5, tokens=0, ms=0, worker=B, requests=0),
            )
        ),
        id="multi-worker-free-nonanchor@5",
    ),
    pytest.param(
        Row(
            (
                Add("remote-1", 12, 10, 0),
                Expect(0, ms=10_000),
                Complete("remote-1", 1),
                Expect(1, ms=0),
                Add("remote-2", 12, 6, 2),
                Expect(2, ms=6_000),
                Release("remote-2", 3),
                Expect(3, ms=0),
            )
        ),
        id="replica-receive-time-anchored",
    ),
    pytest.param(
        Row(
            (
                Add("r1", 40, 100, 0),
                Add("r2", 30, 100, 250),
                Sweep(310),
                Expect(310, tokens=30, requests=1),
                Expect(330, tokens=24),
            ),
            expiry_s=300,
        ),
        id="single-expiry-reanchor",
    ),
    pytest.param(
        Row(
            (
                LoadOnly(
                    A,
                    full_tokens=12,
                    anchor_tokens=10,
                    anchor_duration_s=10,
                    anchored_at_s=97,
                    modeled_ms=10_000,
                ),
                Expect(100, tokens=9),
            )
        ),
        id="registry-load-only",
    ),
    pytest.param(
        Row((Add("r1", 100, 10, 0), Register(B), Expect(5, tokens=50))),
        id="multi-worker-explicit-decay",
    ),
]


def _ns(at_s: float) -> int:
    return int(at_s * S)


def _duration_ns(duration_s: float | None) -> int | None:
    return None if duration_s is None else int(duration_s * S)


def _run_tracker_level(row: Row) -> bool:
    """Returns False if the row needs more than prefill trackers."""
    if any(isinstance(step, Sweep | LoadOnly) for step in row.steps):
        return False
    trackers: dict[int, PrefillTracker] = {}
    for step in row.steps:
        if isinstance(step, Register):
            trackers.setdefault(step.worker, PrefillTracker())
        elif isinstance(step, Add):
            tracker = trackers.setdefault(step.worker, PrefillTracker())
            tracker.insert(
                step.request_id, step.tokens, _duration_ns(step.duration_s), _ns(step.at_s)
            )
            tracker.check_invariants()
        elif isinstance(step, Complete | Release):
            assert trackers[step.worker].remove(step.request_id, _ns(step.at_s)) is not None
            trackers[step.worker].check_invariants()
        elif isinstance(step, Expect):
            snapshot = trackers[step.worker].snapshot()
            if step.tokens is not UNSET:
                assert snapshot.active_tokens(_ns(step.at_s)) == step.tokens, step
            if step.ms is not UNSET:
                assert snapshot.modeled_remaining_ms(_ns(step.at_s)) == step.ms, step
    return True


def _run_state_level(row: Row) -> bool:
    """Returns False if the row needs a hand-made registry load."""
    if any(isinstance(step, LoadOnly) for step in row.steps):
        return False
    state = SequenceState(expiry_s=row.expiry_s)
    for step in row.steps:
        if isinstance(step, Register):
            delta = state.apply(WorkerAdded(worker_id=step.worker), _ns(step.at_s))
        elif isinstance(step, Add):
            ms = None if step.duration_s is None else step.duration_s * 1000
            event = AddRequest(
                request_id=step.request_id,
                worker_id=step.worker,
                prefill_tokens=step.tokens,
                expected_prefill_ms=ms,
            )
            delta = state.apply(event, _ns(step.at_s))
        elif isinstance(step, Complete):
            event = MarkPrefillCompleted(request_id=step.request_id, worker_id=step.worker)
            delta = state.apply(event, _ns(step.at_s))
        elif isinstance(step, Release):
            delta = state.apply(
                Free(request_id=step.request_id, worker_id=step.worker), _ns(step.at_s)
            )
        elif isinstance(step, Sweep):
            delta = state.apply(Tick(), _ns(step.at_s))
            assert delta.expired, "the sweep was expected to expire something"
        else:
            assert isinstance(step, Expect)
            _expect_state(state, step)
            continue
        assert delta.outcome == "applied", (step, delta)
        state.check_invariants()
    return True


def _expect_state(state: SequenceState, step: Expect) -> None:
    now = _ns(step.at_s)
    [load] = [r for r in state.registry.loads(now) if (r.worker_id, r.dp_rank) == (step.worker, 0)]
    if step.tokens is not UNSET:
        assert load.active_prefill_tokens == step.tokens, step
        [potential] = [
            r
            for r in state.registry.potential_loads([], 0, now)
            if (r.worker_id, r.dp_rank) == (step.worker, 0)
        ]
        assert potential.potential_prefill_tokens == step.tokens, step
        slot = state.slot(step.worker)
        assert slot is not None
        assert slot.active_tokens(now) == step.tokens, step
    if step.ms is not UNSET:
        assert load.modeled_remaining_prefill_ms == step.ms, step
    if step.requests is not UNSET:
        assert load.active_requests == step.requests, step


def _run_registry_level(row: Row) -> bool:
    """Returns False unless the row is a hand-made registry load."""
    if not all(isinstance(step, LoadOnly | Expect) for step in row.steps):
        return False
    registry = PromptRegistry()
    for step in row.steps:
        if isinstance(step, LoadOnly):
            prefill = PrefillSnapshot(
                full_tokens=step.full_tokens,
                anchor_tokens=step.anchor_tokens,
                anchor_duration_ns=_duration_ns(step.anchor_duration_s),
                anchored_since_ns=_ns(step.anchored_at_s),
                modeled_ms=step.modeled_ms,
            )
            change = RankChange((step.worker, 0), RankLoad(5, 1, prefill))
            registry.apply(
                Delta(outcome="applied", at_ns=_ns(step.anchored_at_s), changes=[change])
            )
        else:
            assert isinstance(step, Expect)
            now = _ns(step.at_s)
            [load] = [r for r in registry.loads(now) if r.worker_id == step.worker]
            assert step.tokens is not UNSET
            assert load.active_prefill_tokens == step.tokens, step
            [potential] = registry.potential_loads([], 0, now)
            assert potential.potential_prefill_tokens == step.tokens, step
            if step.ms is not UNSET:
                assert load.modeled_remaining_prefill_ms == step.ms, step
    return True


@pytest.mark.parametrize("row", WORKED_EXAMPLES)
def test_worked_examples_table(row: Row) -> None:
    ran = [_run_tracker_level(row), _run_state_level(row), _run_registry_level(row)]
    assert any(ran), "row expressible at no level"
