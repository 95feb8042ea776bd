"""The bucket image: deltas in, the bucket's writes out; a pure value, no server."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from projector.bucket.contents import BucketView
from projector.bucket.image import BucketImage, Parts
from projector.ops.replay import differences
from projector.wire.values import (
    EMPTY_SLOT,
    ID_ROOM,
    KEY_HASHES,
    Position,
    decode_load,
    decode_position,
    decode_request,
    encode_request,
    load_key,
    parse_key,
    part_key,
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
        view.put(NS, key, value)
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


def _restored(image: BucketImage, bucket: dict[str, bytes] | None = None) -> BucketImage:
    """A projector that stopped after ``image``'s writes and resumed from the bucket (its
    values ``bucket``, or those of ``image`` alone)."""
    view = BucketView(position=decode_position(image.position(1)[1]))
    for key, value in (image.everything() if bucket is None else bucket).items():
        view.put(NS, key, value)
    resumed = BucketImage(NS)
    resumed.restore(view)
    return resumed


def _written(bucket: dict[str, bytes], writes: list[tuple[str, bytes | None]]) -> None:
    for key, value in writes:
        if value is None:
            bucket.pop(key, None)
        else:
            bucket[key] = value


@settings(max_examples=200, deadline=None)
@given(
    events=HONEST,
    restart=st.integers(0, 60),
    ahead=st.integers(0, 6),
    cut=st.integers(0, 40),
    budget=st.sampled_from([None, 300]),
)
def test_a_resumed_projector_refuses_nothing_and_writes_the_uninterrupted_bucket(
    events: list[Event], restart: int, ahead: int, cut: int, budget: int | None
) -> None:
    """On any run of events (expiring ones, removals and re-additions of ranks included), cut
    into parts or not, a projector that stopped anywhere and resumed from the bucket refuses
    no delta a writer wrote, and leaves the bucket exactly as one that never stopped. The
    bucket it resumes from may be ahead of its position: a flush cut short wrote ``cut`` of
    the keys of the next ``ahead`` events, and not the position (the bucket then has keys,
    or lacks deleted ones, that the deltas it folds again do not expect)."""
    state = SequenceState(expiry_s=3.0)
    deltas: list[list[Delta]] = []
    for seq, event in enumerate(events, 1):
        delta = state.apply(event, seq * S)
        delta.seq = seq
        deltas.append(split_delta(delta, budget) if budget else [delta])
    whole, image = BucketImage(NS), BucketImage(NS)
    bucket: dict[str, bytes] = {}
    for n, parts in enumerate(deltas):
        if n == restart:
            _written(bucket, image.take())
            ghost = copy.deepcopy(image)
            for later in deltas[n : n + ahead]:
                for part in later:
                    ghost.apply(part)
            _written(bucket, ghost.take()[:cut])
            image = _restored(image, bucket)
        assert image.refusal(parts) == "", (n, parts)
        for part in parts:
            image.apply(part)
            whole.apply(part)
    _written(bucket, image.take())
    assert bucket == whole.everything()


def test_a_bucket_ahead_of_its_position_is_folded_again_without_a_refusal() -> None:
    """Broke (the fault suite's projector kills found it): a rule that a booking names at
    most its rank's next slot refused a writer's delta after a restart, when a flush cut
    short had already removed the rank (keys and load) but not moved the position: the
    resumed projector knew no slot of the rank and refused the booking of slot 1 it folded
    again, then every message after it. Expected: no refusal, and the bucket ends as one
    that never stopped."""
    state = SequenceState(expiry_s=None)
    deltas = []
    for seq, event in enumerate([AddRequest("a", 1), AddRequest("b", 1), WorkerRemoved(1)], 1):
        delta = state.apply(event, seq * S)
        delta.seq = seq
        deltas.append(delta)
    image, whole = BucketImage(NS), BucketImage(NS)
    for delta in deltas:
        whole.apply(delta)
    image.apply(deltas[0])
    bucket: dict[str, bytes] = {}
    _written(bucket, image.take())
    ghost = copy.deepcopy(image)
    ghost.apply(deltas[1])
    ghost.apply(deltas[2])
    _written(bucket, ghost.take())  # every key of events 2 and 3, not the position
    assert bucket == {}
    image = _restored(image, bucket)
    for delta in deltas[1:]:
        assert image.refusal([delta]) == ""
        image.apply(delta)
    _written(bucket, image.take())
    assert bucket == whole.everything() == {}


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (RankChange((-1, 0), EMPTY_LOAD), "rank (-1, 0) is out of range"),
        (RankChange((1, 2**32), EMPTY_LOAD), "rank (1, 4294967296) is out of range"),
        (RankChange((2**64, 0), EMPTY_LOAD), f"rank ({2**64}, 0) is out of range"),
    ],
)
def test_a_rank_no_writer_could_name_is_refused(change: RankChange, why: str) -> None:
    image, _ = fold([AddRequest("a", 1, block_hashes=[1])])
    image.take()
    assert image.refusal([Delta("applied", S, changes=[change], seq=2)]) == (
        f"not a writer's delta: {why}"
    )
    assert image.refusal([Delta("applied", S, removed_ranks=[change.rank], seq=2)]) != ""
    assert not image.dirty


def test_a_slot_costs_one_key_whatever_its_number() -> None:
    """Broke: the image knew a rank's slot keys as a count (0 .. n-1), so a delta booking slot
    2^62 made the removal of its rank delete 2^62 keys, one by one: the projector never came
    back. Expected: a removal deletes the keys the rank has, one write each."""
    image, _ = fold([AddRequest("a", 1, block_hashes=[1])])
    image.take()
    far = RankChange((1, 0), EMPTY_LOAD, booked=[Booking(2**62, "x", [])])
    image.apply(Delta("applied", S, changes=[far], seq=2))
    assert image.slot_keys[(1, 0)] == {0, 2**62}
    image.take()
    image.apply(Delta("applied", S, removed_ranks=[(1, 0)], seq=3))
    assert dict(image.take()) == {
        load_key(NS, (1, 0)): None,
        slot_key(NS, (1, 0), 0): None,
        slot_key(NS, (1, 0), 2**62): None,
    }


def test_a_damaged_slot_value_still_counts_as_a_slot_key() -> None:
    """A resumed projector that could not read a rank's slot value still knows the key is
    there: the rank's removal deletes it too."""
    image, _ = fold([AddRequest("a", 1), AddRequest("b", 1)])
    view = BucketView(position=decode_position(image.position(1)[1]))
    for key, value in image.everything().items():
        kind, rank, slot, _ = parse_key(NS, key)
        assert rank is not None
        if kind == "load":
            view.loads[rank] = decode_load(value)
        elif slot == 1:
            view.unreadable[key] = (rank, "damaged")
        else:
            view.slots.setdefault(rank, {})[slot] = decode_request(value)
    resumed = BucketImage(NS)
    resumed.restore(view)
    assert resumed.slot_keys[(1, 0)] == {0, 1}


# ---- a long prompt: a slot cut into part keys --------------------------------------------------

R = (1, 0)


def long(n: int, base: int = 2**40) -> list[int]:
    """A prompt of ``n`` distinct block hashes (9 bytes each in an event)."""
    return list(range(base, base + n))


def head_and_parts(writes: dict[str, bytes | None], slot: int = 0) -> list[bytes | None]:
    """The values a take wrote to ``slot``'s head and parts 1, 2, ... in that order."""
    values = [writes.get(slot_key(NS, R, slot))]
    part = 1
    while part_key(NS, R, slot, part) in writes:
        values.append(writes[part_key(NS, R, slot, part)])
        part += 1
    return values


def test_a_long_prompt_takes_a_head_and_parts_of_at_most_4096_hashes_in_prompt_order() -> None:
    prompt = long(2 * KEY_HASHES + 5)
    image, _ = fold([AddRequest("a", 1, block_hashes=prompt)])
    taken = image.take()
    writes = dict(taken)
    head, *parts = (decode_request(v or b"") for v in head_and_parts(writes))
    assert (head.request_id, head.applied_seq, head.parts, len(parts)) == ("a", 1, 2, 2)
    assert [len(head.hashes) // 8] + [len(p.hashes) // 8 for p in parts] == [4096, 4096, 5]
    assert [p.applied_seq for p in parts] == [1, 1] and {p.request_id for p in parts} == {""}
    assert head.hash_list() + parts[0].hash_list() + parts[1].hash_list() == prompt
    assert max(len(v or b"") for v in writes.values()) < 33_000
    # The parts come before their head in a take: a reader that sees the head has them.
    order = [key for key, _ in taken]
    assert order.index(slot_key(NS, R, 0)) > order.index(part_key(NS, R, 0, 2))
    # A prompt of 4,096 blocks is one key, its bytes those of a single-key slot.
    image, _ = fold([AddRequest("b", 1, block_hashes=long(KEY_HASHES))])
    assert dict(image.take())[slot_key(NS, R, 0)] == encode_request(1, "b", long(KEY_HASHES))


def test_a_request_id_over_4_kib_leaves_every_hash_to_the_parts() -> None:
    rid = "i" * (ID_ROOM + 1)
    image, _ = fold([AddRequest(rid, 1, block_hashes=long(10))])
    head, part = (decode_request(v or b"") for v in head_and_parts(dict(image.take())))
    assert (head.request_id, head.hashes, head.parts) == (rid, b"", 1)
    assert part.hash_list() == long(10)


def test_a_release_empties_its_parts_and_a_smaller_reuse_writes_only_what_changed() -> None:
    image, state = fold([AddRequest("big", 1, block_hashes=long(3 * KEY_HASHES))])
    image.take()
    assert image.parts[(R, 0)] == Parts(keys=2, live=2)
    fold([Free("big", 1)], image, state, start=2)
    assert head_and_parts(dict(image.take())) == [EMPTY_SLOT, EMPTY_SLOT, EMPTY_SLOT]
    assert image.parts[(R, 0)] == Parts(keys=2, live=0)
    # A smaller request takes the slot: its head and its one part; part 2 is empty already.
    fold([AddRequest("mid", 1, block_hashes=long(KEY_HASHES + 1, 7))], image, state, start=3)
    writes = dict(image.take())
    assert sorted(writes) == sorted([load_key(NS, R), slot_key(NS, R, 0), part_key(NS, R, 0, 1)])
    assert decode_request(writes[part_key(NS, R, 0, 1)] or b"").hash_list() == [7 + KEY_HASHES]
    # A short one after it: part 1 is emptied; a one-key request touches no part.
    fold([Free("mid", 1), AddRequest("s", 1, block_hashes=[1])], image, state, start=4)
    assert head_and_parts(dict(image.take()))[1:] == [EMPTY_SLOT]
    fold([Free("s", 1), AddRequest("t", 1, block_hashes=[2])], image, state, start=6)
    assert [k for k, _ in image.take()] == [load_key(NS, R), slot_key(NS, R, 0)]


def test_a_reuse_by_a_smaller_request_in_the_same_take_empties_the_parts_left_over() -> None:
    image, state = fold([AddRequest("big", 1, block_hashes=long(3 * KEY_HASHES))])
    image.take()
    fold(
        [Free("big", 1), AddRequest("small", 1, block_hashes=long(KEY_HASHES + 1))],
        image,
        state,
        start=2,
    )
    head, one, two = head_and_parts(dict(image.take()))
    assert decode_request(head or b"").parts == 1
    assert decode_request(one or b"").hash_list() == [2**40 + KEY_HASHES]
    assert two == EMPTY_SLOT


def test_a_reuse_by_a_larger_request_writes_every_part() -> None:
    image, state = fold([AddRequest("a", 1, block_hashes=long(KEY_HASHES + 1))])
    image.take()
    fold(
        [Free("a", 1), AddRequest("b", 1, block_hashes=long(3 * KEY_HASHES, 5))],
        image,
        state,
        start=2,
    )
    values = [decode_request(v or b"") for v in head_and_parts(dict(image.take()))]
    assert [v.applied_seq for v in values] == [3, 3, 3]
    assert [h for v in values for h in v.hash_list()] == long(3 * KEY_HASHES, 5)
    assert image.parts[(R, 0)] == Parts(keys=2, live=2)


def test_a_removed_rank_deletes_every_part_key_of_every_slot() -> None:
    image, state = fold(
        [
            AddRequest("a", 1, block_hashes=long(2 * KEY_HASHES + 1)),
            AddRequest("b", 1, block_hashes=[1]),
            AddRequest("c", 1, block_hashes=long(KEY_HASHES + 1, 9)),
            Free("a", 1),
        ]
    )
    image.take()
    fold([WorkerRemoved(1)], image, state, start=5)
    assert sorted(image.take()) == sorted(
        [
            (load_key(NS, R), None),
            (slot_key(NS, R, 0), None),
            (part_key(NS, R, 0, 1), None),
            (part_key(NS, R, 0, 2), None),
            (slot_key(NS, R, 1), None),
            (slot_key(NS, R, 2), None),
            (part_key(NS, R, 2, 1), None),
        ]
    )
    assert image.parts == {} and R not in image.slot_keys


def test_a_resumed_projector_knows_the_parts_the_bucket_holds() -> None:
    """Restored from the bucket, the image knows each slot's part keys and which hold hashes:
    a release empties them, a removal deletes them, a damaged one too."""
    image, state = fold(
        [
            AddRequest("a", 1, block_hashes=long(2 * KEY_HASHES + 1)),
            AddRequest("b", 1, block_hashes=long(KEY_HASHES + 1, 5)),
        ]
    )
    bucket = image.everything()
    resumed = _restored(image, bucket)
    assert resumed.parts == {(R, 0): Parts(2, 2), (R, 1): Parts(1, 1)}
    fold([Free("a", 1)], resumed, state, start=3)
    assert head_and_parts(dict(resumed.take())) == [EMPTY_SLOT, EMPTY_SLOT, EMPTY_SLOT]
    view = BucketView(position=decode_position(image.position(1)[1]))
    for key, value in bucket.items():
        view.put(NS, key, value)
    damaged = part_key(NS, R, 1, 1)
    del view.parts[(R, 1)]
    view.unreadable[damaged] = (R, "damaged")
    resumed = BucketImage(NS)
    resumed.restore(view)
    assert resumed.parts[(R, 1)] == Parts(1, 1)
    fold([WorkerRemoved(1)], resumed, state, start=3)
    assert (damaged, None) in resumed.take()


SIZES = st.sampled_from([1, KEY_HASHES - 1, KEY_HASHES, KEY_HASHES + 1, 3 * KEY_HASHES + 2])
IDS = st.sampled_from(["q0", "q1"])
ADD = st.builds(
    AddRequest,
    st.one_of(IDS, st.just("i" * (ID_ROOM + 1))),
    st.just(1),
    block_hashes=st.builds(long, SIZES, st.sampled_from([0, 2**40, 2**63])),
)
LONG = st.lists(
    st.one_of(
        ADD,
        ADD,
        st.builds(Free, IDS, st.just(1)),
        st.builds(Free, IDS, st.just(1)),
        st.builds(WorkerAdded, st.just(1)),
        st.builds(WorkerRemoved, st.just(1)),
    ),
    min_size=4,
    max_size=30,
)


@settings(max_examples=100, deadline=None)
@given(events=LONG, takes=st.sets(st.integers(0, 30)), restart=st.integers(0, 30))
def test_long_prompts_leave_the_bucket_of_the_state_whatever_the_flushes(
    events: list[Event], takes: set[int], restart: int
) -> None:
    """Prompts of every size around the key's 4,096 hashes, freed, reused by smaller and
    larger ones, removed with their rank, flushed at any point, the projector restarted from
    the bucket anywhere: the bucket holds each live request whole in its head and parts (as
    verify reads it), no part holds hashes no head claims, no value is over 33 KB, and it
    equals the bucket of an uninterrupted image."""
    state = SequenceState(expiry_s=None)
    whole, image = BucketImage(NS), BucketImage(NS)
    bucket: dict[str, bytes] = {}
    for seq, event in enumerate(events, 1):
        if seq in takes:
            _written(bucket, image.take())
        if seq == restart:
            _written(bucket, image.take())
            image = _restored(image, bucket)
        delta = state.apply(event, seq * S)
        delta.seq = seq
        image.apply(delta)
        whole.apply(delta)
    _written(bucket, image.take())
    assert bucket == whole.everything()
    assert max(map(len, bucket.values()), default=0) < 33_000
    view = BucketView()
    for key, value in bucket.items():
        view.put(NS, key, value)
    assert differences(state, view, NS) == []
