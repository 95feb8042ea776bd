"""Router ownership: heartbeats, orphans on log time, goodbye, and the age limit spared."""

from __future__ import annotations

import pytest

from seqstate import (
    AddRequest,
    Free,
    RouterGoodbye,
    RouterHeartbeat,
    SequenceState,
    Tick,
)
from seqstate.bounds import RankBounds

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000


def state(**options: object) -> SequenceState:
    return SequenceState(**{"expiry_s": 300.0, "orphan_after_s": 30.0, **options})  # type: ignore[arg-type]


def add(s: SequenceState, rid: str, router: str, at_s: float, worker: int = 1) -> None:
    delta = s.apply(
        AddRequest(rid, worker, block_hashes=[hash(rid) % 1000, 7], router_id=router), int(at_s * S)
    )
    assert delta.outcome == "applied"


def live(s: SequenceState) -> list[str]:
    return sorted(s.requests.owner)


def test_a_silent_router_is_orphaned_at_the_first_event_past_its_timeout() -> None:
    s = state()
    s.apply(RouterHeartbeat("r1"), 0)
    s.apply(RouterHeartbeat("r2"), 0)
    add(s, "a", "r1", 1)
    add(s, "b", "r1", 2, worker=2)
    add(s, "c", "r2", 3)
    add(s, "d", "", 4)  # no router named: never orphaned
    s.apply(RouterHeartbeat("r2"), 25 * S)
    assert s.apply(Tick(), 31 * S).orphaned == []  # r1 was last heard at 2 s: not 30 s yet
    delta = s.apply(Tick(), 32 * S)
    assert delta.orphaned == ["a", "b"]  # rank order, then add time
    assert [(tuple(c.rank), c.released, c.load.active_requests) for c in delta.changes] == [
        ((1, 0), [0], 2),
        ((2, 0), [0], 0),
    ]
    assert live(s) == ["c", "d"]
    assert s.counters["orphaned"] == 2
    assert list(s.routers) == ["r2"]
    # A late Free of an orphaned request is a plain no-op, not a tombstone for a later add.
    assert s.apply(Free("a", 1, router_id="r1"), 33 * S).outcome == "unknown_request"
    assert "a" not in s.tombstones
    s.check_invariants()


def test_any_event_of_a_router_keeps_it_alive() -> None:
    s = state()
    s.apply(RouterHeartbeat("r1"), 0)
    add(s, "a", "r1", 1)
    for t in (20, 40, 60):
        add(s, f"x{t}", "r1", t)
    assert s.apply(Tick(), 89 * S).orphaned == []
    assert s.apply(Tick(), 91 * S).orphaned == ["a", "x20", "x40", "x60"]
    s.check_invariants()


def test_goodbye_frees_that_routers_requests_at_once_and_no_others() -> None:
    s = state()
    for router in ("r1", "r2"):
        s.apply(RouterHeartbeat(router), 0)
    add(s, "a", "r1", 1)
    add(s, "b", "r2", 1)
    add(s, "c", "r1", 2)
    delta = s.apply(RouterGoodbye("r1"), 3 * S)
    assert (delta.outcome, delta.orphaned) == ("applied", ["a", "c"])
    assert live(s) == ["b"] and list(s.routers) == ["r2"]
    assert s.registry.loads(3 * S)[0].active_requests == 1
    s.check_invariants()


def test_the_age_limit_spares_a_live_routers_long_request_only() -> None:
    s = state(expiry_s=60.0)
    s.apply(RouterHeartbeat("agent"), 0)
    add(s, "long", "agent", 0)
    add(s, "blind", "", 0)
    add(s, "unbeating", "never-beat", 0)
    for t in range(25, 200, 25):  # the agent keeps beating; Ticks run the age limit
        s.apply(RouterHeartbeat("agent"), t * S)
        s.apply(Tick(), t * S + 1)
    assert live(s) == ["long"]  # the others expired after 60 s
    assert s.counters["expired"] == 2
    delta = s.apply(Tick(), 230 * S)  # 30 s after its last beat at 175 + 25: orphaned
    assert delta.orphaned == ["long"] and live(s) == []


def test_with_orphaning_off_heartbeats_shield_nothing() -> None:
    s = state(expiry_s=60.0, orphan_after_s=None)
    s.apply(RouterHeartbeat("agent"), 0)
    add(s, "long", "agent", 0)
    s.apply(Tick(), 100 * S)
    assert live(s) == []  # a dead router must not shield its requests forever
    assert s.counters["expired"] == 1 and s.counters["orphaned"] == 0


@pytest.mark.parametrize("cut", [1, 3, 5, 7])
def test_a_restored_snapshot_orphans_exactly_as_the_original(cut: int) -> None:
    events = [
        (RouterHeartbeat("r1"), 0),
        (RouterHeartbeat("r2"), 0),
        (AddRequest("a", 1, block_hashes=[1], router_id="r1"), S),
        (AddRequest("b", 2, block_hashes=[2], router_id="r2"), S),
        (AddRequest("c", 1, block_hashes=[3], router_id="r1"), 2 * S),
        (RouterHeartbeat("r2"), 20 * S),
        (AddRequest("d", 2, block_hashes=[4], router_id="r1"), 21 * S),
        (Tick(), 50 * S + S // 2),  # r2, last heard at 20 s, lapsed; r1 (21 s) not yet
        (RouterGoodbye("r1"), 53 * S),
    ]
    whole = state()
    want = [whole.apply(e, t) for e, t in events]
    part = state()
    for e, t in events[:cut]:
        part.apply(e, t)
    restored = SequenceState.restore(part.snapshot())
    got = [restored.apply(e, t) for e, t in events[cut:]]
    assert got == want[cut:]
    assert restored.snapshot() == whole.snapshot()
    assert want[7].orphaned == ["b"] and want[8].orphaned == ["a", "c", "d"]


def test_a_flood_of_invented_routers_is_bounded() -> None:
    s = state()
    bounds = RankBounds(routers=3)
    for i in range(3):
        assert bounds.refusal(s, RouterHeartbeat(f"r{i}")) == ""
        s.apply(RouterHeartbeat(f"r{i}"), 0)
    assert "max_routers" in bounds.refusal(s, RouterHeartbeat("r3"))
    assert bounds.refusal(s, RouterHeartbeat("r1")) == ""  # a known one still beats
