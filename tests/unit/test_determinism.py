"""Determinism and snapshot properties of the fold, over hypothesis-generated event logs.

(a) one log folded twice gives identical bytes, deltas and reads; (b) snapshot + restore at
any cut points, then folding the rest, is indistinguishable from one uninterrupted fold;
(c) restore(snapshot) round-trips to the same bytes; (d) damaged snapshots raise
SnapshotError and nothing else.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
import msgspec
import pytest
from hypothesis import HealthCheck, given, note, settings

from seqstate import (
    AddOutputBlock,
    AddRequest,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    SnapshotError,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    encode_delta,
)
from seqstate.snapshot import MAGIC, READABLE_VERSIONS, SNAPSHOT_VERSION

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

S = 1_000_000_000
LINEAGE_LEN = 8
LINEAGES = tuple(tuple(k * 100 + i for i in range(1, LINEAGE_LEN + 1)) for k in range(4))
QUERIES: tuple[list[int], ...] = (
    [],
    list(LINEAGES[0][:3]),
    list(LINEAGES[1]),
    [*LINEAGES[2][:4], 251, 252],
    [999],
)
IDS = st.sampled_from([f"r{i}" for i in range(8)])
WORKER_IDS = st.sampled_from((1, 1, 2, 3))
DPS = st.sampled_from((0, 0, 1, 2))

# Every configuration the snapshot carries, including tiny id memories so that capacity
# eviction happens (and must survive a restore).
CONFIGS: tuple[dict[str, object], ...] = (
    {"expiry_s": 60.0, "lazy_workers": True},
    {"expiry_s": None, "lazy_workers": True},
    {"expiry_s": 60.0, "lazy_workers": False},
    {"expiry_s": 45.5, "lazy_workers": True, "max_tombstones": 2, "max_ended": 3},
    {"expiry_s": 60.0, "lazy_workers": True, "lease_scan_s": 30.0},  # Dynamo's lease
)
CONFIG_INDEX = st.integers(0, len(CONFIGS) - 1)

STEPS = st.one_of(
    st.just(0),
    st.integers(1, 5 * S),
    st.integers(1, 5 * S),
    st.integers(1, 5 * S),
    st.integers(20 * S, 40 * S),
    st.integers(31 * S, 400 * S),
    st.integers(-3 * S, -1),  # a clock stepping back: the fold clamps it
)

ADDS = st.builds(
    AddRequest,
    request_id=IDS,
    worker_id=WORKER_IDS,
    dp_rank=DPS,
    block_hashes=st.builds(
        lambda k, n: list(LINEAGES[k][:n]),
        st.integers(0, len(LINEAGES) - 1),
        st.integers(0, LINEAGE_LEN),
    ),
    prefill_tokens=st.one_of(st.just(0), st.integers(1, 4000)),
    expected_prefill_ms=st.one_of(
        st.none(), st.just(0.0), st.floats(0.0, 20_000.0, allow_nan=False), st.just(1e6)
    ),
    expected_output_tokens=st.none() | st.integers(0, 500),
    track_prefill_tokens=st.booleans(),
    router_id=st.sampled_from(["", "router-a"]),
    lora_name=st.sampled_from([None, "a", "b"]),
)
TARGETED = {"request_id": IDS, "worker_id": WORKER_IDS, "dp_rank": DPS}
EVENTS = st.one_of(
    ADDS,
    ADDS,
    st.builds(MarkPrefillCompleted, **TARGETED),
    st.builds(Free, **TARGETED),
    st.builds(
        AddOutputBlock,
        **TARGETED,
        decay_fraction=st.one_of(
            st.none(), st.none(), st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.floats(0.0, 1.0)
        ),
    ),
    st.builds(
        lambda w, start, size: WorkerAdded(worker_id=w, dp_start=start, dp_size=size),
        WORKER_IDS,
        st.integers(0, 2),
        st.integers(1, 3),
    ),
    st.builds(WorkerRemoved, worker_id=WORKER_IDS, final=st.booleans()),
    st.just(Tick()),
)
TimedEvents = list[tuple[object, int]]


@st.composite
def timed_events(draw: st.DrawFn, max_size: int = 80) -> TimedEvents:
    """Events with log times: cumulative steps, sometimes going back (the fold clamps)."""
    out: TimedEvents = []
    t = 0
    for event, step in draw(st.lists(st.tuples(EVENTS, STEPS), max_size=max_size)):
        t = max(0, t + step)
        out.append((event, t))
    return out


def fresh(config: int) -> SequenceState:
    return SequenceState(**CONFIGS[config])  # type: ignore[arg-type]


def fold(state: SequenceState, events: TimedEvents) -> list[bytes]:
    """Apply every event; returns the encoded deltas."""
    return [encode_delta(state.apply(event, at)) for event, at in events]


def reads(state: SequenceState) -> list[object]:
    """Everything a reader can see: loads and potential loads at several times, overlap and
    membership per rank."""
    now = state.now_ns
    out: list[object] = []
    for t in (now, now + S, now + 7 * S, now + 500 * S):
        out.append(state.registry.loads(t))
        for query in QUERIES:
            out.append(state.registry.potential_loads(query, 11 * len(query), t))
    for query in QUERIES:
        out.append(sorted(state.registry.overlap_depths(query).items()))
    out.append([(rank, sorted(state.registry.hashes_of(rank))) for rank in state.registry.ranks()])
    out.append(state.registry.membership_size())
    out.append(dict(state.counters))
    return out


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ---- (a) same log, same result --------------------------------------------------------------


@PROPERTY
@given(config=CONFIG_INDEX, events=timed_events())
def test_same_log_folds_to_identical_state(config: int, events: TimedEvents) -> None:
    first, second = fresh(config), fresh(config)
    deltas_first = fold(first, events)
    deltas_second = fold(second, events)
    assert deltas_first == deltas_second
    assert first.snapshot() == second.snapshot()
    assert reads(first) == reads(second)
    first.check_invariants()


# ---- (b) snapshot + restore at cut points ---------------------------------------------------


@PROPERTY
@given(config=CONFIG_INDEX, events=timed_events(), data=st.data())
def test_restore_at_cut_points_is_invisible(
    config: int, events: TimedEvents, data: st.DataObject
) -> None:
    cuts = sorted(data.draw(st.lists(st.integers(0, len(events)), max_size=4), label="cuts"))
    whole = fresh(config)
    expected_deltas = fold(whole, events)

    state = fresh(config)
    deltas: list[bytes] = []
    done = 0
    for cut in [*cuts, len(events)]:
        deltas += fold(state, events[done:cut])
        done = cut
        data_bytes = state.snapshot()
        state = SequenceState.restore(data_bytes)
        assert state.snapshot() == data_bytes
        state.check_invariants()
    assert deltas == expected_deltas
    assert state.snapshot() == whole.snapshot()
    assert reads(state) == reads(whole)


@PROPERTY
@given(config=CONFIG_INDEX, events=timed_events(), data=st.data())
def test_restored_registry_equals_incremental_registry(
    config: int, events: TimedEvents, data: st.DataObject
) -> None:
    """The registry rebuilt by restore (projection) equals the one the deltas built."""
    cut = data.draw(st.integers(0, len(events)), label="cut")
    state = fresh(config)
    fold(state, events[:cut])
    restored = SequenceState.restore(state.snapshot())
    assert reads(restored) == reads(state)
    # The incremental and the restored registry keep following the rest of the log alike.
    assert fold(restored, events[cut:]) == fold(state, events[cut:])
    assert reads(restored) == reads(state)


# ---- (c) round trip -------------------------------------------------------------------------


@PROPERTY
@given(config=CONFIG_INDEX, events=timed_events())
def test_snapshot_round_trips_exactly(config: int, events: TimedEvents) -> None:
    state = fresh(config)
    fold(state, events)
    data = state.snapshot()
    assert data.startswith(MAGIC)
    restored = SequenceState.restore(data)
    assert restored.snapshot() == data
    assert SequenceState.restore(bytearray(data)).snapshot() == data
    assert SequenceState.restore(memoryview(data)).snapshot() == data
    assert restored.expiry_s == state.expiry_s
    assert restored.lazy_workers == state.lazy_workers
    assert restored.counters == state.counters
    restored.check_invariants()


def test_empty_state_round_trips() -> None:
    for config in range(len(CONFIGS)):
        data = fresh(config).snapshot()
        assert SequenceState.restore(data).snapshot() == data


# ---- (d) damaged snapshots ------------------------------------------------------------------


def sample_snapshot(config: int, events: TimedEvents) -> bytes:
    state = fresh(config)
    fold(state, events)
    return state.snapshot()


SMALL_LOGS = timed_events(max_size=30)


def assert_snapshot_error_or_usable(data: bytes) -> None:
    """A damaged snapshot raises SnapshotError; a damage msgpack cannot notice (a changed
    count, time or hash) may restore, and then the state must still be usable."""
    try:
        state = SequenceState.restore(data)
    except SnapshotError:
        return
    note("the damaged snapshot restored")
    state.check_invariants()  # whatever restores is self-consistent
    state.snapshot()
    state.registry.loads(state.now_ns)


@PROPERTY
@given(config=CONFIG_INDEX, events=SMALL_LOGS, data=st.data())
def test_truncated_snapshot_raises_snapshot_error(
    config: int, events: TimedEvents, data: st.DataObject
) -> None:
    snap = sample_snapshot(config, events)
    length = data.draw(st.integers(0, len(snap) - 1), label="length")
    with pytest.raises(SnapshotError):
        SequenceState.restore(snap[:length])


@PROPERTY
@given(
    config=CONFIG_INDEX,
    events=SMALL_LOGS,
    magic=st.binary(min_size=0, max_size=6).filter(lambda m: not (m + b"\x00").startswith(MAGIC)),
)
def test_wrong_magic_raises_snapshot_error(config: int, events: TimedEvents, magic: bytes) -> None:
    snap = sample_snapshot(config, events)
    with pytest.raises(SnapshotError, match="magic"):
        SequenceState.restore(magic + snap[len(MAGIC) :])


@PROPERTY
@given(
    config=CONFIG_INDEX,
    events=SMALL_LOGS,
    version=st.integers(-(2**63), 2**64 - 1).filter(lambda v: v not in READABLE_VERSIONS),
)
def test_wrong_version_raises_snapshot_error(
    config: int, events: TimedEvents, version: int
) -> None:
    snap = sample_snapshot(config, events)
    body = msgspec.msgpack.decode(snap[len(MAGIC) :])
    assert body[0] == SNAPSHOT_VERSION
    body[0] = version
    with pytest.raises(SnapshotError, match="version"):
        SequenceState.restore(MAGIC + msgspec.msgpack.encode(body))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=CONFIG_INDEX, events=SMALL_LOGS, data=st.data())
def test_byte_damage_raises_snapshot_error_only(
    config: int, events: TimedEvents, data: st.DataObject
) -> None:
    snap = bytearray(sample_snapshot(config, events))
    edits = data.draw(
        st.lists(
            st.tuples(
                st.sampled_from(("replace", "insert", "delete")),
                st.integers(0, len(snap) - 1),
                st.integers(0, 255),
            ),
            min_size=1,
            max_size=4,
        ),
        label="edits",
    )
    for kind, position, value in edits:
        position %= max(1, len(snap))
        if kind == "replace" and snap:
            snap[position] = value
        elif kind == "insert":
            snap.insert(position, value)
        elif snap:
            del snap[position]
    assert_snapshot_error_or_usable(bytes(snap))


@PROPERTY
@given(config=CONFIG_INDEX, events=SMALL_LOGS, data=st.data())
def test_body_with_wrong_field_types_raises_snapshot_error(
    config: int, events: TimedEvents, data: st.DataObject
) -> None:
    """A well-formed msgpack body whose fields have the wrong shape is a SnapshotError."""
    snap = sample_snapshot(config, events)
    body = msgspec.msgpack.decode(snap[len(MAGIC) :])
    index = data.draw(st.integers(1, len(body) - 1), label="field")
    junk = data.draw(
        st.one_of(st.text(max_size=3), st.binary(max_size=3), st.just([[1, 2]]), st.just({})),
        label="junk",
    )
    note(f"field {index}: {body[index]!r} -> {junk!r}")
    if body[index] == junk:
        return
    body[index] = junk
    assert_snapshot_error_or_usable(MAGIC + msgspec.msgpack.encode(body))


def test_inconsistent_body_raises_snapshot_error() -> None:
    """Bodies that decode but contradict themselves (a request on two ranks, a prefill with no
    request) are SnapshotErrors."""
    state = SequenceState(expiry_s=60.0)
    state.apply(AddRequest(request_id="r0", worker_id=1, block_hashes=[1, 2], prefill_tokens=5), 0)
    state.apply(AddRequest(request_id="r1", worker_id=2, block_hashes=[1], prefill_tokens=5), 0)
    body = msgspec.msgpack.decode(state.snapshot()[len(MAGIC) :])
    slots = body[7]
    assert [s[:2] for s in slots] == [[1, 0], [2, 0]]

    twice = msgspec.msgpack.decode(msgspec.msgpack.encode(body))
    twice[7][1][3] = twice[7][0][3]  # r0 now also lives on worker 2
    with pytest.raises(SnapshotError):
        SequenceState.restore(MAGIC + msgspec.msgpack.encode(twice))

    orphan = msgspec.msgpack.decode(msgspec.msgpack.encode(body))
    orphan[7][0][4].append(["ghost", 3, None])  # a prefill with no request
    with pytest.raises(SnapshotError):
        SequenceState.restore(MAGIC + msgspec.msgpack.encode(orphan))


def test_registered_rank_without_slot_raises_snapshot_error() -> None:
    """A range naming a rank the snapshot has no slot for would make that rank uncreatable."""
    state = SequenceState(lazy_workers=False)
    state.apply(WorkerAdded(worker_id=1, dp_size=1), 0)
    body = msgspec.msgpack.decode(state.snapshot()[len(MAGIC) :])
    assert body[6] == [[1, 0, 1]]
    body[6] = [[1, 0, 2]]
    with pytest.raises(SnapshotError, match=r"registered rank \(1, 1\) has no slot"):
        SequenceState.restore(MAGIC + msgspec.msgpack.encode(body))


def expiry_float_damaged(how: str) -> bytes:
    """A snapshot whose expiry_s is non-finite, or finite but too big to scale to ns."""
    snap = SequenceState(expiry_s=60.0).snapshot()
    if how == "byte":
        damaged = bytearray(snap)
        position = damaged.index(msgspec.msgpack.encode(60.0))  # 0xcb + 8 bytes of 60.0
        damaged[position + 1] = 0x7F  # exponent 0x7F4: about 2**1013, times 1e9 overflows
        return bytes(damaged)
    body = msgspec.msgpack.decode(snap[len(MAGIC) :])
    assert body[1] == 60.0
    body[1] = {"inf": math.inf, "huge": 1e300}[how]
    return MAGIC + msgspec.msgpack.encode(body)


@pytest.mark.parametrize("how", ["inf", "huge", "byte"])
def test_overflowing_expiry_in_snapshot_raises_snapshot_error(how: str) -> None:
    """round(expiry_s * 1e9) overflows for these; that must not escape as OverflowError (one
    damaged byte of the expiry_s float is enough: 0x40 -> 0x7F)."""
    with pytest.raises(SnapshotError):
        SequenceState.restore(expiry_float_damaged(how))
