"""The request lease of Dynamo's embedded router (a second-chance CLOCK), on log time.

A lease is taken by the AddRequest and refreshed by a MarkPrefillCompleted that ends the
request's pending prefill; scans run at the log-time multiples of S, so a request last
refreshed in scan period ``e = t // S`` expires at the first scan at or after ``(e + 2) * S``.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqstate import (
    AddOutputBlock,
    AddRequest,
    Free,
    MarkPrefillCompleted,
    RouterHeartbeat,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    encode_delta,
)
from seqstate.snapshot import _State

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
SCAN = 300  # seconds: Dynamo's default DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS


def leased(**options: object) -> SequenceState:
    return SequenceState(**{"lease_scan_s": float(SCAN), **options})  # type: ignore[arg-type]


def add(s: SequenceState, rid: str, at_s: float, worker: int = 1, prefill: int = 48) -> None:
    delta = s.apply(
        AddRequest(rid, worker, block_hashes=[1, 2, 3], prefill_tokens=prefill), int(at_s * S)
    )
    assert delta.outcome == "applied"


def tick(s: SequenceState, at_ns: int) -> list[str]:
    delta = s.apply(Tick(), at_ns)
    assert delta.outcome == "applied"
    return list(delta.expired)


def test_a_lease_expires_at_the_second_scan_after_its_add_not_before() -> None:
    s = leased()
    add(s, "a", 100)  # period 0: the scan at 300 s marks it quiet, the one at 600 s expires it
    assert tick(s, 300 * S) == []
    assert tick(s, 600 * S - 1) == []
    delta = s.apply(Tick(), 600 * S)
    assert delta.expired == ["a"]
    assert [(tuple(c.rank), c.released, c.load.active_requests) for c in delta.changes] == [
        ((1, 0), [0], 0)
    ]
    assert s.counters["expired"] == 1 and "a" in s.ended and len(s.requests) == 0
    assert [(r.active_blocks, r.active_requests) for r in s.registry.loads(600 * S)] == [(0, 0)]
    # A late Free of an expired request is a plain no-op, never a tombstone.
    assert s.apply(Free("a", 1), 601 * S).outcome == "unknown_request"
    assert "a" not in s.tombstones
    s.check_invariants()


def test_an_add_on_a_boundary_counts_in_the_period_it_opens() -> None:
    s = leased()
    add(s, "a", SCAN)  # period 1 (the scan at 300 s came first): gone at 900 s
    assert tick(s, 600 * S) == []
    assert tick(s, 900 * S - 1) == []
    assert tick(s, 900 * S) == ["a"]
    add(s, "b", 900)  # after the scan of 900 s, in period 3: gone at 1500 s
    assert tick(s, 1200 * S) == []
    assert tick(s, 1500 * S) == ["b"]


def test_a_mark_that_ends_the_prefill_refreshes_the_lease() -> None:
    s = leased()
    add(s, "a", 100)
    assert s.apply(MarkPrefillCompleted("a", 1), 350 * S).outcome == "applied"  # period 1
    assert tick(s, 600 * S) == []
    assert tick(s, 900 * S - 1) == []
    assert tick(s, 900 * S) == ["a"]


def test_a_repeated_mark_does_not_refresh_the_lease() -> None:
    """As Dynamo's replicas: only a Mark that ends a pending prefill touches the lease."""
    s = leased()
    add(s, "a", 100)
    s.apply(MarkPrefillCompleted("a", 1), 200 * S)  # the router's: period 0, ends the prefill
    assert s.apply(MarkPrefillCompleted("a", 1), 350 * S).outcome == "duplicate"  # the worker's
    assert tick(s, 600 * S) == ["a"]


def test_a_mark_of_a_request_without_prefill_load_does_not_refresh_it() -> None:
    s = leased()
    add(s, "a", 100, prefill=0)  # its prompt was cached whole: no prefill to end
    assert s.apply(MarkPrefillCompleted("a", 1), 350 * S).outcome == "applied"
    assert tick(s, 600 * S) == ["a"]


def test_a_mark_naming_another_worker_applies_but_does_not_refresh() -> None:
    s = leased()
    add(s, "a", 100)
    assert s.apply(MarkPrefillCompleted("a", 2), 350 * S).outcome == "applied"
    assert s.counters["worker_mismatch"] == 1
    assert s.registry.loads(350 * S)[0].active_prefill_tokens == 0
    assert tick(s, 600 * S) == ["a"]


def test_neither_a_duplicate_add_nor_an_output_block_refreshes_it() -> None:
    s = leased()
    add(s, "a", 100)
    assert s.apply(AddRequest("a", 1), 350 * S).outcome == "duplicate"
    assert s.apply(AddOutputBlock("a", 1), 400 * S).outcome == "applied"
    assert tick(s, 600 * S) == ["a"]


def test_a_request_freed_before_its_scan_never_expires() -> None:
    s = leased()
    add(s, "a", 100)
    add(s, "b", 110)
    assert s.apply(Free("a", 1), 500 * S).outcome == "applied"
    assert tick(s, 600 * S) == ["b"]
    assert s.counters["expired"] == 1
    assert tick(s, 10_000 * S) == []
    s.check_invariants()


def test_a_boundary_reached_by_an_add_expires_first_then_books() -> None:
    s = leased()
    add(s, "a", 100)
    delta = s.apply(AddRequest("b", 1, block_hashes=[1, 2, 3]), 600 * S)
    assert (delta.outcome, delta.expired) == ("applied", ["a"])
    # The expiry's release comes before the booking, which takes the freed slot again.
    assert [
        (tuple(c.rank), c.released, [b.request_id for b in c.booked]) for c in delta.changes
    ] == [
        ((1, 0), [0], []),
        ((1, 0), [], ["b"]),
    ]
    assert [r.active_requests for r in s.registry.loads(600 * S)] == [1]
    assert s.registry.overlap_depths([1, 2, 3]) == {(1, 0): 3}
    s.check_invariants()


def test_missed_boundaries_collapse_into_the_first_event_past_them() -> None:
    s = leased()
    add(s, "a", 100)  # period 0: due at 600 s
    add(s, "b", 400, worker=2)  # period 1: due at 900 s
    add(s, "c", 590)  # period 1: due at 900 s
    delta = s.apply(Tick(), 1000 * S)  # the scans of 600 and 900 s, at once
    assert delta.expired == ["a", "b", "c"]
    assert [(tuple(c.rank), c.released) for c in delta.changes] == [((1, 0), [0, 1]), ((2, 0), [0])]
    add(s, "d", 1100)  # period 3: due at 1500 s
    add(s, "e", 1250)  # period 4: due at 1800 s
    assert tick(s, 1799 * S) == ["d"]  # the scan of 1500 s only
    assert tick(s, 5000 * S) == ["e"]
    s.check_invariants()


def test_expiries_of_one_scan_are_in_lease_order_one_change_per_rank() -> None:
    """Leases are in the order they were taken or last moved; a refresh in the period of the
    lease's last one leaves it in place (its expiry does not move), a later one moves it."""
    s = leased()
    add(s, "a", 10)
    add(s, "b", 20, worker=2)
    add(s, "c", 30)
    s.apply(MarkPrefillCompleted("b", 2), 40 * S)  # period 0, as its Add: stays first but a
    s.apply(MarkPrefillCompleted("a", 1), 310 * S)  # period 1: behind c
    add(s, "d", 320)
    delta = s.apply(Tick(), 600 * S)
    assert delta.expired == ["b", "c"]
    assert [(tuple(c.rank), c.released) for c in delta.changes] == [((2, 0), [0]), ((1, 0), [1])]
    delta = s.apply(Tick(), 900 * S)
    assert delta.expired == ["a", "d"]
    assert [(tuple(c.rank), c.released) for c in delta.changes] == [((1, 0), [0, 2])]


def test_a_rank_removed_by_the_event_that_reaches_the_boundary_stays_removed() -> None:
    s = leased()
    add(s, "a", 100)
    add(s, "b", 500)
    delta = s.apply(WorkerRemoved(1), 600 * S)
    assert delta.expired == ["a"]
    assert delta.changes == [] and [tuple(r) for r in delta.removed_ranks] == [(1, 0)]
    assert s.registry.loads(600 * S) == []
    s.check_invariants()


def test_a_live_routers_requests_are_spared_their_lease_refreshed() -> None:
    s = leased(orphan_after_s=30.0)
    s.apply(RouterHeartbeat("r"), 0)
    s.apply(AddRequest("a", 1, block_hashes=[1], router_id="r"), 100 * S)
    add(s, "b", 100)  # no router: the lease applies
    for at in range(20, 1000, 20):
        s.apply(RouterHeartbeat("r"), at * S)
    assert s.counters["expired"] == 1 and sorted(s.requests.owner) == ["a"]
    s.check_invariants()


def test_a_parked_request_expires_out_of_sight() -> None:
    s = leased(worker_grace_s=1000.0)
    s.apply(WorkerAdded(1), 0)
    add(s, "a", 100)
    s.apply(WorkerRemoved(1), 200 * S)  # parked for its grace
    delta = s.apply(Tick(), 600 * S)
    assert (delta.expired, delta.changes) == (["a"], [])
    back = s.apply(WorkerAdded(1), 700 * S)
    assert [tuple(r) for r in back.added_ranks] == [(1, 0)]
    assert [c.booked for c in back.changes] == [[]]  # back empty
    assert [r.active_requests for r in s.registry.loads(700 * S)] == [0]
    s.check_invariants()


def test_the_lease_replaces_the_age_limit() -> None:
    s = leased(expiry_s=1.0)
    add(s, "a", 0)
    add(s, "b", 100)  # an age limit of 1 s would expire a here
    assert tick(s, 500 * S) == []
    assert tick(s, 600 * S) == ["a", "b"]


def test_without_a_lease_the_age_limit_is_unchanged() -> None:
    s = SequenceState(expiry_s=300.0)
    add(s, "a", 0)
    assert tick(s, 301 * S) == ["a"]  # the rank's check, 30 s after its creation and on
    assert s.lease_scan_s is None and len(s.leases) == 0


@pytest.mark.parametrize("scan_s", [0.0, -1.0, 1e12])
def test_a_scan_period_out_of_range_is_refused(scan_s: float) -> None:
    with pytest.raises(ValueError, match="lease_scan_s"):
        SequenceState(lease_scan_s=scan_s)


TIMELINE: list[tuple[object, float]] = [
    (WorkerAdded(1, dp_size=2), 0),
    (AddRequest("a", 1, 0, block_hashes=[1, 2], prefill_tokens=32), 10),
    (AddRequest("c", 2, 0, block_hashes=[4], prefill_tokens=0), 290),
    (MarkPrefillCompleted("a", 1, 0), 320),
    (AddRequest("b", 1, 1, block_hashes=[1, 3], prefill_tokens=16), 350),
    (Tick(), 600),  # c expires
    (AddRequest("d", 1, 0, block_hashes=[1, 2, 5], prefill_tokens=48), 610),
    (Free("b", 1, 1), 700),
    (Tick(), 900),  # a expires
    (MarkPrefillCompleted("d", 1, 0), 1150),
    (Tick(), 1500),  # d expires
    (AddRequest("e", 2, 0, block_hashes=[9]), 1510),
    (Tick(), 2200),  # e expires
]


@pytest.mark.parametrize("cut", range(len(TIMELINE) + 1))
def test_a_snapshot_midway_restores_and_goes_on_byte_identically(cut: int) -> None:
    whole = leased()
    deltas = [encode_delta(whole.apply(e, int(t * S))) for e, t in TIMELINE]
    assert [list(msgspec.msgpack.decode(d)["expired"]) for d in deltas if b"expired" in d] == [
        ["c"],
        ["a"],
        ["d"],
        ["e"],
    ]
    assert len(whole.requests) == 0 and whole.counters["applied"] == len(TIMELINE)
    first = leased()
    for e, t in TIMELINE[:cut]:
        first.apply(e, int(t * S))
    data = first.snapshot()
    restored = SequenceState.restore(data)
    assert restored.snapshot() == data
    assert restored.lease_scan_s == float(SCAN)
    rest = [encode_delta(restored.apply(e, int(t * S))) for e, t in TIMELINE[cut:]]
    assert rest == deltas[cut:]
    assert restored.snapshot() == whole.snapshot()
    restored.check_invariants()


def test_a_snapshot_from_before_the_lease_restores_with_the_age_limit() -> None:
    s = SequenceState(expiry_s=300.0)
    add(s, "a", 0)
    data = s.snapshot()
    magic, body = data[:4], msgspec.msgpack.decode(data[4:])
    older = magic + msgspec.msgpack.encode(body[: _State.__struct_fields__.index("lease_scan_s")])
    restored = SequenceState.restore(older)
    assert restored.lease_scan_s is None and restored.snapshot() == data
    assert tick(restored, 301 * S) == ["a"]


# ---- against a naive model: a referenced bit per request, a scan at every boundary ----------

SCAN_S = 10
RIDS = ("r0", "r1", "r2", "r3", "r4")
STEP = st.tuples(
    st.integers(0, 2 * SCAN_S),  # seconds since the previous event (0: the same time)
    st.sampled_from(("add", "mark", "mark_other", "free", "tick", "output")),
    st.sampled_from(RIDS),
    st.sampled_from((0, 16)),  # prefill tokens of an add
    st.integers(0, 1),  # its worker
)


class Clock:
    """The second-chance CLOCK as Dynamo's reaper runs it, with no arithmetic on periods: each
    live request has a referenced bit, set by a refresh; every scan clears a set bit and
    expires a clear one. Every boundary the time passes is scanned, in turn."""

    def __init__(self) -> None:
        self.referenced: dict[str, bool] = {}
        self.worker: dict[str, int] = {}
        self.pending: dict[str, bool] = {}  # prefill not yet ended
        self.next_scan = 0
        self.expired: list[str] = []

    def advance(self, now: int) -> set[str]:
        gone: set[str] = set()
        while self.next_scan <= now:
            for rid in list(self.referenced):
                if self.referenced[rid]:
                    self.referenced[rid] = False
                else:
                    gone.add(rid)
                    self.drop(rid)
            self.next_scan += SCAN_S
        return gone

    def drop(self, rid: str) -> None:
        del self.referenced[rid], self.worker[rid], self.pending[rid]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(STEP, max_size=60))
def test_the_lease_matches_a_naive_clock(steps: list[tuple[int, str, str, int, int]]) -> None:
    s = SequenceState(lease_scan_s=float(SCAN_S))
    model = Clock()
    now = 0
    for gap, op, rid, prefill, worker in steps:
        now += gap
        gone = model.advance(now)
        live = rid in model.referenced
        if op != "add" and not live:
            op = "tick"  # an early Mark or Free leaves a tombstone: another rule, not this one
        if op == "add":
            event: object = AddRequest(rid, worker, block_hashes=[7], prefill_tokens=prefill)
            if not live:
                model.referenced[rid] = True
                model.worker[rid] = worker
                model.pending[rid] = prefill > 0
        elif op in ("mark", "mark_other"):
            event = MarkPrefillCompleted(rid, model.worker[rid] if op == "mark" else 2)
            if model.pending[rid]:
                model.pending[rid] = False
                model.referenced[rid] |= op == "mark"  # a Mark naming another worker: no touch
        elif op == "free":
            event = Free(rid, model.worker[rid])
            model.drop(rid)
        elif op == "output":
            event = AddOutputBlock(rid, model.worker[rid])
        else:
            event = Tick()
        delta = s.apply(event, now * S)
        assert set(delta.expired) == gone
        assert len(delta.expired) == len(gone)
        assert set(s.requests.owner) == set(model.referenced)
        assert {r: s.requests.owner[r][0] for r in s.requests.owner} == model.worker
        s.check_invariants()
