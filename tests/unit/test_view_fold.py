"""What a RegistryView makes of the bucket's values, fed by hand: no server (the view folds
values without one; the watch only delivers them)."""

from __future__ import annotations

import logging
import math
import time

import msgspec
import pytest

from projector.bucket.image import BucketImage
from projector.bucket.reader import RegistryView
from projector.nats.lease import Holder
from projector.settings.config import Config
from projector.wire.values import (
    Heartbeat,
    Position,
    encode_position,
    lease_key,
    load_key,
    position_key,
)
from seqstate import AddRequest, Free, SequenceState, WorkerRemoved

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
NS = "vf"


class _Fed:
    """A view fed the writes a projector would make of a run of events."""

    def __init__(self) -> None:
        self.view = RegistryView(None, config=Config(namespace=NS))  # type: ignore[arg-type]
        self.state = SequenceState(expiry_s=None)
        self.image = BucketImage(NS)
        self.seq = 0

    def events(self, *events: object) -> None:
        for key, value in self.writes(*events):
            self.view.receive(key, value, deleted=value is None)

    def writes(self, *events: object) -> list[tuple[str, bytes | None]]:
        """What the projector writes for ``events``, in order, not yet fed to the view."""
        for event in events:
            self.seq += 1
            delta = self.state.apply(event, self.seq * S)  # type: ignore[arg-type]
            delta.seq = self.seq
            self.image.apply(delta)
        return self.image.take()

    def rows(self) -> list[tuple[int, int, int]]:
        return [(r.worker_id, r.dp_rank, r.active_blocks) for r in self.view.loads(self.seq * S)]


def test_rank_of_follows_bookings_frees_slot_reuse_and_removed_ranks() -> None:
    """serve-http's /free names the worker that holds the request: the view knows it from the
    request slots, and forgets it as the bucket does."""
    fed = _Fed()
    fed.events(AddRequest(request_id="a", worker_id=1, dp_rank=2, block_hashes=[1, 2]))
    fed.events(AddRequest(request_id="b", worker_id=4, block_hashes=[3]))
    assert (fed.view.rank_of("a"), fed.view.rank_of("b"), fed.view.rank_of("x")) == (
        (1, 2),
        (4, 0),
        None,
    )
    fed.events(Free(request_id="a", worker_id=1, dp_rank=2))
    assert fed.view.rank_of("a") is None
    fed.events(AddRequest(request_id="c", worker_id=1, dp_rank=2, block_hashes=[5]))  # a's slot
    assert (fed.view.rank_of("a"), fed.view.rank_of("c")) == (None, (1, 2))
    fed.events(WorkerRemoved(worker_id=4))
    assert (fed.view.rank_of("b"), fed.view.rank_of("c")) == (None, (1, 2))


def test_a_load_value_that_does_not_decode_hides_its_rank_until_a_readable_one(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Unknown is not idle. A rank whose load value does not decode has no row in
    loads or potential loads and no overlap, whether the view met the value cold (the rank's
    slot keys first) or warm (over a good value); a readable value or a delete clears it."""
    fed = _Fed()
    fed.events(
        AddRequest(request_id="a", worker_id=1, block_hashes=[1, 2, 3]),
        AddRequest(request_id="b", worker_id=2, block_hashes=[9]),
    )
    assert fed.rows() == [(1, 0, 3), (2, 0, 1)]
    key = load_key(NS, (1, 0))
    with caplog.at_level(logging.WARNING, logger="seqstate.reader"):
        fed.view.receive(key, b"not json")
    assert fed.rows() == [(2, 0, 1)]
    assert [(r.worker_id, r.dp_rank) for r in fed.view.potential_loads([1, 2, 3], 10)] == [(2, 0)]
    assert fed.view.overlap_depths([1, 2, 3]) == {}
    assert list(fed.view.unreadable) == [(1, 0)] and fed.view.bad_values == 1
    assert f"rank (1, 0) of namespace {NS} not served" in caplog.text
    fed.events(AddRequest(request_id="c", worker_id=1, block_hashes=[4]))  # a readable value
    assert fed.rows() == [(1, 0, 4), (2, 0, 1)] and fed.view.unreadable == {}
    fed.view.receive(key, b"{}")
    assert fed.rows() == [(2, 0, 1)]
    fed.view.receive(key, None, deleted=True)  # the rank removed: nothing left to hide
    assert fed.view.unreadable == {} and fed.rows() == [(2, 0, 1)]


def test_a_long_prompt_in_parts_counts_as_one_request_through_torn_reads() -> None:
    """A 1M-token prompt (62,500 blocks: a head and 15 parts) shared in part by a smaller
    request of its rank: the view's hashes, overlaps and potential loads are the core's once
    a flush is in, and while one is half read (a head's parts ahead of it, or behind) the
    view never holds a hash no key holds nor loses one a key still holds. Freed, its slot
    reused by a shorter prompt, its rank removed: alike."""
    fed = _Fed()
    prompt = list(range(2**63, 2**63 + 62_500))
    rank = (1, 0)

    def exact() -> None:
        registry, now = fed.state.registry, fed.seq * S
        fed.state.sync_registry()
        assert fed.view.registry.hashes_of(rank) == registry.hashes_of(rank)
        for query in (prompt, prompt[:7], mid):
            assert fed.view.overlap_depths(query) == registry.overlap_depths(query)
            assert fed.view.potential_loads(query, 16, now) == registry.potential_loads(
                query, 16, now
            )

    mid = list(range(5, 5 + 5_000))
    writes = fed.writes(
        AddRequest(request_id="long", worker_id=1, block_hashes=prompt),
        AddRequest(request_id="short", worker_id=1, block_hashes=prompt[:10_000]),
        AddRequest(request_id="other", worker_id=2, block_hashes=prompt[:5]),
    )
    assert len(writes) == 2 + 16 + 3 + 1  # loads; long's head and 15 parts; short's; other's
    assert max(len(value or b"") for _, value in writes) < 33_000
    for key, value in writes:
        fed.view.receive(key, value)
    exact()
    assert fed.view.overlap_depths(prompt) == {rank: 62_500, (2, 0): 5}
    assert fed.view.rank_of("long") == rank
    for events in (
        [Free(request_id="long", worker_id=1)],
        [AddRequest(request_id="mid", worker_id=1, block_hashes=mid)],  # the freed slot 0
        [Free(request_id="mid", worker_id=1), AddRequest("back", 1, block_hashes=prompt)],
    ):
        before = fed.view.registry.hashes_of(rank)
        writes = fed.writes(*events)
        fed.state.sync_registry()
        after = fed.state.registry.hashes_of(rank)
        for key, value in writes:  # read one by one: the torn states in between
            fed.view.receive(key, value, deleted=value is None)
            assert before & after <= fed.view.registry.hashes_of(rank) <= before | after
        exact()
    assert fed.view.rank_of("back") == rank and fed.view.rank_of("mid") is None
    fed.events(WorkerRemoved(worker_id=1))
    assert fed.view.registry.hashes_of(rank) == set() and fed.view.rank_of("back") is None
    assert [key for key, value in fed.image.take()] == []


def _renewal(beat: Heartbeat | None, ttl_s: float = 3.0) -> bytes:
    """A projector's lease value as its renewals write it."""
    holder = Holder("projector", "p1", "host", 1, "2000-01-01T00:00:00+00:00", ttl_s, "", beat)
    return msgspec.json.encode(holder)


def test_staleness_counts_renewals_and_reads_the_projectors_lag_from_them() -> None:
    """Idle or stalled, from the bucket alone: every renewal is a sign of life, and the last
    one's lag measurement says what the view lacks of the log: what the bucket lacked then, at
    most one per sequence the view has yet to reach to the head, none once it reaches it
    (Dynamo messages captured and not logged yet count until a measurement says otherwise)."""
    view = RegistryView(None, config=Config(namespace=NS))  # type: ignore[arg-type]
    lease, position = lease_key(NS), position_key(NS)
    fresh = view.staleness()
    assert (fresh.age_s, fresh.head, fresh.behind_events, fresh.measured_s) == (
        math.inf,
        0,
        0,
        math.inf,
    )
    assert fresh.silent and not fresh.within(10**9, math.inf)
    as_of = 1_000 * S
    started = time.monotonic()
    view.receive(position, encode_position(Position(4, as_of, 4)))
    view.receive(lease, _renewal(Heartbeat(10, 6, 1, as_of - 2 * S, 0.25), ttl_s=6.0))
    s = view.staleness()
    took = time.monotonic() - started
    assert (view.renewals, view.values_received) == (1, 1)  # a renewal is no read model value
    assert (s.applied_seq, s.head, s.behind_events, s.silent_after_s) == (4, 10, 6, 6.0)
    assert 2.0 <= s.behind_s <= 2.0 + took  # on the view's log clock, anchored at as_of
    assert 0.25 <= s.measured_s <= 0.25 + took and 0 <= s.age_s <= took
    assert s.within(6, 2.0 + took) and not s.within(5, math.inf) and not s.within(6, 1.9)
    view.receive(position, encode_position(Position(8, as_of, 8)))
    assert view.staleness().behind_events == 1 + 2  # the captured one, and 9 and 10 at most
    view.receive(position, encode_position(Position(10, as_of, 10)))
    assert view.staleness().behind_events == 1
    view.receive(lease, _renewal(Heartbeat(10, 0, 0, None, 0.0)))
    s = view.staleness()
    assert (s.behind_events, s.behind_s, s.silent_after_s) == (0, 0.0, 3.0)
    assert s.within(0, 0.0)
    # A renewal without a measurement (a rebuild's, or one before the first) keeps the last;
    # an unreadable one still proves a writer lives; a released lease proves nothing.
    view.receive(lease, _renewal(None))
    view.receive(lease, b"not a lease")
    assert view.renewals == 4 and view.staleness().head == 10 and view.bad_values == 0
    view.receive(lease, None, deleted=True)
    assert view.renewals == 4
