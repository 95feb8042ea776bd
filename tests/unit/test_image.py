"""The bucket image: deltas in, the bucket's writes out; a pure value, no server."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from projector.read.bucket import BucketView
from projector.read.image import BucketImage
from projector.wire.values import (
    EMPTY_SLOT,
    Position,
    decode_load,
    decode_position,
    decode_request,
    load_key,
    parse_key,
    slot_key,
)
from seqstate import (
    AddRequest,
    Delta,
    Event,
    Free,
    RankChange,
    SequenceState,
    WorkerAdded,
    WorkerRemoved,
)
from seqstate.deltas import Booking, split_delta
from seqstate.loads import EMPTY_LOAD

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
NS = "img"


def fold(
    events: list[object],
    image: BucketImage | None = None,
    state: SequenceState | None = None,
    start: int = 1,
) -> tuple[BucketImage, SequenceState]:
    image = image or BucketImage(NS)
    state = state or SequenceState(expiry_s=None)
    for seq, event in enumerate(events, start):
        delta = state.apply(event, seq * S)
        delta.seq = seq
        image.apply(delta)
    return image, state


def test_a_booking_writes_its_slot_and_the_load_once_per_take() -> None:
    image, _ = fold(
        [AddRequest("a", 1, block_hashes=[5, 6, 7]), AddRequest("b", 1, block_hashes=[5])]
    )
    writes = dict(image.take())
    assert sorted(writes) == [
        load_key(NS, (1, 0)),
        slot_key(NS, (1, 0), 0),
        slot_key(NS, (1, 0), 1),
    ]
    a = decode_request(writes[slot_key(NS, (1, 0), 0)] or b"")
    assert (a.applied_seq, a.request_id, a.hash_list()) == (1, "a", [5, 6, 7])
    load = decode_load(writes[load_key(NS, (1, 0))] or b"")
    assert (load.active_blocks, load.active_requests, load.applied_seq) == (3, 2, 2)
    assert image.take() == []  # nothing owed any more


def test_writes_coalesce_and_a_free_slot_holds_the_empty_value() -> None:
    image, state = fold(
        [AddRequest("a", 1, block_hashes=[5]), Free("a", 1), AddRequest("b", 1, block_hashes=[9])]
    )
    writes = dict(image.take())
    b = decode_request(writes[slot_key(NS, (1, 0), 0)] or b"")  # b took the slot a freed
    assert (b.applied_seq, b.request_id, b.hash_list()) == (3, "b", [9])
    fold([Free("b", 1)], image, state, start=4)
    assert dict(image.take())[slot_key(NS, (1, 0), 0)] == EMPTY_SLOT
    assert decode_request(EMPTY_SLOT).empty
    # Booked and freed again between two takes: the bucket already holds the empty value.
    fold([AddRequest("c", 1, block_hashes=[1]), Free("c", 1)], image, state, start=5)
    assert [key for key, _ in image.take()] == [load_key(NS, (1, 0))]


def test_a_removed_rank_deletes_every_slot_key_it_had_and_its_load() -> None:
    events = [AddRequest(f"r{i}", 2, block_hashes=[i]) for i in range(3)] + [Free("r1", 2)]
    image, state = fold(events)
    image.take()
    fold([WorkerRemoved(2)], image, state, start=5)
    assert image.take() == [(load_key(NS, (2, 0)), None)] + [
        (slot_key(NS, (2, 0), slot), None) for slot in range(3)
    ]


def test_a_failed_flush_is_owed_again_unless_superseded() -> None:
    image, state = fold(
        [AddRequest("a", 1, block_hashes=[5]), AddRequest("b", 1, block_hashes=[6])]
    )
    failed = image.take()
    fold([Free("a", 1)], image, state, start=3)  # supersedes slot 0 and the load
    image.owe(failed)
    writes = dict(image.take())
    assert decode_request(writes[slot_key(NS, (1, 0), 0)] or b"").empty  # not a's old value
    assert decode_request(writes[slot_key(NS, (1, 0), 1)] or b"").request_id == "b"
    assert decode_load(writes[load_key(NS, (1, 0))] or b"").applied_seq == 3


def test_a_restored_image_goes_on_writing_what_an_uninterrupted_one_writes() -> None:
    first = [AddRequest(f"r{i}", i % 2, block_hashes=[i, i + 100]) for i in range(6)] + [
        Free("r2", 0)
    ]
    rest = [AddRequest("late", 0, block_hashes=[1]), Free("r3", 1), WorkerRemoved(1)]
    whole, _ = fold(first + rest)
    want = whole.everything()
    # A projector wrote the first part, stopped; a new one restores from the bucket's values.
    image, state = fold(first)
    written = image.everything()
    view = BucketView(position=decode_position(image.position(7)[1]))
    for key, value in written.items():
        kind, rank, slot = parse_key(NS, key)
        assert rank is not None
        if kind == "load":
            view.loads[rank] = decode_load(value)
        else:
            view.slots.setdefault(rank, {})[slot] = decode_request(value)
    resumed = BucketImage(NS)
    resumed.restore(view)
    assert resumed.applied_seq == 7
    fold(rest, resumed, state, start=8)
    bucket = dict(written)
    for key, value in resumed.take():
        if value is None:
            bucket.pop(key, None)
        else:
            bucket[key] = value
    assert bucket == want


def test_an_event_half_applied_in_parts_is_not_yet_reflected() -> None:
    state = SequenceState(expiry_s=60.0)
    image = BucketImage(NS)
    for i in range(200):
        d = state.apply(AddRequest(f"long-request-id-{i:05d}", 1, block_hashes=[i]), S)
        d.seq = i + 1
        image.apply(d)
    tick = state.apply(AddRequest("new", 1, block_hashes=[1]), 100 * S)  # expires the 200
    tick.seq = 201
    parts = split_delta(tick, 1_000)
    assert len(parts) > 2
    for part in parts[:-1]:
        image.apply(part)
        assert image.applied_seq == 200 and image.partial == (201, part.part)
    image.apply(parts[-1])
    assert image.applied_seq == 201 and image.partial is None
    assert decode_position(image.position(9)[1]) == Position(201, 100 * S, 9)


# ---- what no writer writes --------------------------------------------------------------------

HONEST = st.lists(
    st.one_of(
        st.builds(
            AddRequest,
            st.sampled_from([f"q{i}" for i in range(12)]),
            st.integers(0, 2),
            dp_rank=st.integers(0, 1),
            block_hashes=st.lists(st.integers(0, 2**64 - 1), max_size=3),
        ),
        st.builds(
            Free,
            st.sampled_from([f"q{i}" for i in range(12)]),
            st.integers(0, 2),
            dp_rank=st.integers(0, 1),
        ),
        st.builds(WorkerAdded, st.integers(0, 2), dp_size=st.integers(1, 2)),
        st.builds(WorkerRemoved, st.integers(0, 2)),
    ),
    max_size=60,
)


def _restored(image: BucketImage) -> BucketImage:
    """A projector that stopped after ``image``'s writes and resumed from the bucket."""
    view = BucketView(position=decode_position(image.position(1)[1]))
    for key, value in image.everything().items():
        kind, rank, slot = parse_key(NS, key)
        assert rank is not None
        if kind == "load":
            view.loads[rank] = decode_load(value)
        else:
            view.slots.setdefault(rank, {})[slot] = decode_request(value)
    resumed = BucketImage(NS)
    resumed.restore(view)
    return resumed


@settings(max_examples=150, deadline=None)
@given(events=HONEST, restart=st.integers(0, 60), budget=st.sampled_from([None, 300]))
def test_no_delta_a_writer_writes_is_refused(
    events: list[Event], restart: int, budget: int | None
) -> None:
    """The rules that refuse a forged slot must never refuse a writer's delta: on any run of
    events, expiring ones included, cut into parts or not, and across a projector that resumed
    from the bucket (which knows its slots only by the keys it holds)."""
    state = SequenceState(expiry_s=3.0)
    image = BucketImage(NS)
    for seq, event in enumerate(events, 1):
        if seq == restart:
            image = _restored(image)
        delta = state.apply(event, seq * S)
        delta.seq = seq
        parts = split_delta(delta, budget) if budget else [delta]
        assert image.refusal(parts) == "", (seq, event)
        for part in parts:
            image.apply(part)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (
            RankChange((1, 0), EMPTY_LOAD, booked=[Booking(2**62, "x", [])]),
            "rank (1, 0) books slot 4611686018427387904 with 1 slots",
        ),
        (RankChange((1, 0), EMPTY_LOAD, released=[5]), "rank (1, 0) releases slot 5 of 1"),
        (RankChange((1, 0), EMPTY_LOAD, released=[-1]), "rank (1, 0) releases slot -1 of 1"),
        (RankChange((-1, 0), EMPTY_LOAD), "rank (-1, 0) is out of range"),
        (RankChange((1, 2**32), EMPTY_LOAD), "rank (1, 4294967296) is out of range"),
    ],
)
def test_a_slot_or_rank_no_writer_could_name_is_refused(change: RankChange, why: str) -> None:
    """Broke: a forged booking of slot 2^62 was applied, and the removal of its rank then
    deleted 2^62 keys one by one: the projector never came back. Expected: refused with why,
    the image untouched; the rank's next slot (1) is still accepted."""
    image, _ = fold([AddRequest("a", 1, block_hashes=[1])])
    image.take()
    assert image.refusal([Delta("applied", S, changes=[change], seq=2)]) == (
        f"not a writer's delta: {why}"
    )
    fine = RankChange((1, 0), EMPTY_LOAD, booked=[Booking(1, "b", [])])
    assert image.refusal([Delta("applied", S, changes=[fine], seq=2)]) == ""
    assert image.refusal([Delta("applied", S, removed_ranks=[(2**64, 0)], seq=2)]) != ""
    assert not image.dirty


def test_a_damaged_slot_value_still_counts_as_a_slot_key() -> None:
    """A resumed projector that could not read a rank's highest slot value must still accept
    the release of that slot (the writer knows the slot is there)."""
    image, _ = fold([AddRequest("a", 1), AddRequest("b", 1)])
    view = BucketView(position=decode_position(image.position(1)[1]))
    for key, value in image.everything().items():
        kind, rank, slot = parse_key(NS, key)
        assert rank is not None
        if kind == "load":
            view.loads[rank] = decode_load(value)
        elif slot == 1:
            view.unreadable[key] = (rank, "damaged")
        else:
            view.slots.setdefault(rank, {})[slot] = decode_request(value)
    resumed = BucketImage(NS)
    resumed.restore(view)
    release = RankChange((1, 0), EMPTY_LOAD, released=[1])
    assert resumed.refusal([Delta("applied", S, changes=[release], seq=3)]) == ""
