"""What a RegistryView makes of the bucket's values, fed by hand: no server (the view folds
values without one; the watch only delivers them)."""

from __future__ import annotations

import logging

import pytest

from projector.read.image import BucketImage
from projector.read.reader import RegistryView
from projector.wire.config import Config
from projector.wire.values import load_key
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
        for event in events:
            self.seq += 1
            delta = self.state.apply(event, self.seq * S)  # type: ignore[arg-type]
            delta.seq = self.seq
            self.image.apply(delta)
        for key, value in self.image.take():
            self.view.receive(key, value, deleted=value is None)

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
    """Issue 21: unknown is not idle. A rank whose load value does not decode has no row in
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
