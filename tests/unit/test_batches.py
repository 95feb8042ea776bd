"""Record batches (seqstate.batches) and the one fold deciding each event of one.

The codec: a round trip keeps every event's bytes in order; any bytes whatever give a list of
events' bytes or a BatchDecodeError, never anything else; each bound is refused with its
reason. The fold: a poison event inside a batch is refused alone, with its index, and its
neighbours apply as they would one message each; a batch books nothing on a subject its
events do not belong on.
"""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from seqstate import (
    AddRequest,
    Delta,
    Fold,
    FoldRules,
    Free,
    MarkPrefillCompleted,
    Refusal,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    encode_event,
)
from seqstate.batches import (
    MAGIC,
    MAX_BYTES,
    MAX_EVENTS,
    VERSION,
    BatchDecodeError,
    BatchTooLarge,
    BatchUnfit,
    decode_batch,
    encode_batch,
    encode_batch_of,
    is_batch,
)
from seqstate.fold import (
    OUT_OF_BOUNDS,
    TOO_LARGE,
    UNDECODABLE,
    WRONG_SUBJECT,
    control_subject,
    worker_subject,
)

pytestmark = pytest.mark.core

NS = "default"
W1 = worker_subject(NS, 1)
CONTROL = control_subject(NS)


def new_fold(**rules: object) -> Fold:
    return Fold(SequenceState(expiry_s=None), FoldRules(NS, **rules))  # type: ignore[arg-type]


# ---- the codec ------------------------------------------------------------------------------


@given(st.lists(st.binary(max_size=64), min_size=1, max_size=40))
def test_a_batch_round_trips_its_events_bytes_in_order(items: list[bytes]) -> None:
    data = encode_batch_of(items)
    assert data.startswith(MAGIC + bytes([VERSION]))
    assert is_batch(data)
    assert decode_batch(data) == items


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_any_bytes_after_the_magic_decode_or_are_refused_never_crash(tail: bytes) -> None:
    for data in (MAGIC + tail, MAGIC + bytes([VERSION]) + tail, tail):
        try:
            items = decode_batch(data)
        except BatchDecodeError:
            continue
        assert 1 <= len(items) <= MAX_EVENTS
        assert all(type(item) is bytes for item in items)


def test_no_event_and_no_dynamo_message_is_taken_for_a_batch() -> None:
    assert not is_batch(encode_event(Tick()))
    assert not is_batch(msgspec.msgpack.encode({"event": 1}))
    assert not is_batch(b"")
    assert not is_batch(b"\xc1sq")


def test_each_bound_and_defect_is_refused_with_its_reason() -> None:
    one = encode_event(Tick())
    with pytest.raises(BatchTooLarge, match=f"1,025 events \\(at most {MAX_EVENTS}\\)"):
        decode_batch(MAGIC + bytes([VERSION]) + msgspec.msgpack.encode([one] * 1025))
    # The count is read from the array's head: a claim of 2^32-1 events costs nothing.
    with pytest.raises(BatchTooLarge, match="4,294,967,295 events"):
        decode_batch(MAGIC + bytes([VERSION]) + b"\xdd\xff\xff\xff\xff")
    with pytest.raises(BatchTooLarge, match="bytes \\(at most 8,388,608\\)"):
        decode_batch(MAGIC + bytes([VERSION]) + b"\x91" + b"\x00" * MAX_BYTES)
    with pytest.raises(BatchDecodeError, match="unsupported record batch version 2"):
        decode_batch(MAGIC + b"\x02" + msgspec.msgpack.encode([one]))
    with pytest.raises(BatchDecodeError, match="holds no event"):
        decode_batch(MAGIC + bytes([VERSION]) + b"\x90")
    with pytest.raises(BatchDecodeError, match="not an array of events"):
        decode_batch(MAGIC + bytes([VERSION]) + b"\x80")
    with pytest.raises(BatchDecodeError, match="Expected `bytes`, got `array`"):
        decode_batch(MAGIC + bytes([VERSION]) + b"\x91\x91\x91\xc0")
    with pytest.raises(BatchDecodeError, match="ends after its head"):
        decode_batch(MAGIC + bytes([VERSION]))
    with pytest.raises(BatchUnfit, match="at least one event"):
        encode_batch([])
    with pytest.raises(BatchUnfit, match="at most 1024"):
        encode_batch([Tick()] * 1025)
    with pytest.raises(BatchUnfit, match="at most 8,388,608"):
        encode_batch_of([b"x" * MAX_BYTES])


# ---- the fold -------------------------------------------------------------------------------


def test_a_poison_event_in_a_batch_is_refused_alone_with_its_index() -> None:
    alone, batched = new_fold(), new_fold()
    alone(1, 1000, CONTROL, encode_event(WorkerAdded(1)))
    batched(1, 1000, CONTROL, encode_event(WorkerAdded(1)))
    events = [
        encode_event(AddRequest("a", 1, block_hashes=[1, 2], prefill_tokens=5)),
        b"\x92\x01" + b"\x91" * 1000 + b"\xc0",  # nested 1000 deep
        encode_event(AddRequest("b", 2)),  # another rank's: not on this subject
        encode_event(WorkerRemoved(1)),  # a control event on a rank's subject
        encode_event(AddRequest("c", 1, prefill_tokens=2**64 - 1)),  # past a bound
        encode_event(MarkPrefillCompleted("a", 1)),
        encode_batch([Free("a", 1)]),  # no batch nests in a batch
        encode_event(Free("a", 1)),
    ]
    verdicts = batched(2, 2000, W1, encode_batch_of(events))
    assert isinstance(verdicts, list)
    kinds = [v.kind if type(v) is Refusal else v.outcome for v in verdicts]  # type: ignore[union-attr]
    assert kinds == [
        "applied",
        UNDECODABLE,
        WRONG_SUBJECT,
        WRONG_SUBJECT,
        OUT_OF_BOUNDS,
        "applied",
        UNDECODABLE,
        "applied",
    ]
    refused = [v for v in verdicts if type(v) is Refusal]
    assert [i for i, v in enumerate(verdicts) if type(v) is Refusal] == [1, 2, 3, 4, 6]
    assert refused[1].reason == (
        "event 2 of the batch: refused: AddRequest of worker 2 rank 0 on subject "
        "'seqstate.events.default.1.0'; it belongs on 'seqstate.events.default.2.0'"
    )
    assert refused[4].reason == "event 6 of the batch: a record batch inside a record batch"
    deltas = [v for v in verdicts if type(v) is Delta]
    assert [d.seq for d in deltas] == [2, 2, 2]
    assert {d.at_ns for d in deltas} == {2000}
    # The neighbours apply exactly as they would one message each (the nested batch alone
    # would be a batch of its own: it is left out).
    for payload in events:
        if not is_batch(payload):
            alone(2, 2000, W1, payload)
    assert batched.state.snapshot() == alone.state.snapshot()


def test_a_batch_refused_whole_names_no_index_and_changes_nothing() -> None:
    fold = new_fold()
    before = fold.state.snapshot()
    verdict = fold(1, 1000, CONTROL, MAGIC + b"\x07" + msgspec.msgpack.encode([b"x"]))
    assert verdict == Refusal(
        UNDECODABLE, "unsupported record batch version 7 (this build reads 1)"
    )
    too_many = encode_batch_of([encode_event(Tick())] * MAX_EVENTS)[:5] + b"\xdc\x04\x01"
    verdict = fold(2, 1000, CONTROL, too_many)
    assert type(verdict) is Refusal and verdict.kind == TOO_LARGE
    assert fold.state.snapshot() == before


def test_an_event_of_a_batch_over_the_event_limit_is_refused_alone() -> None:
    fold = new_fold(max_event_bytes=100)
    fold(1, 1000, CONTROL, encode_event(WorkerAdded(1)))
    big = encode_event(AddRequest("big", 1, block_hashes=list(range(50))))
    verdicts = fold(2, 2000, W1, encode_batch_of([big, encode_event(AddRequest("s", 1))]))
    assert isinstance(verdicts, list)
    first, second = verdicts
    assert type(first) is Refusal and first.kind == TOO_LARGE
    assert first.reason.startswith(f"event 0 of the batch: refused: an event of {len(big)} bytes")
    assert type(second) is Delta and second.outcome == "applied"


@settings(max_examples=300)
@given(
    st.lists(
        st.one_of(
            st.binary(max_size=40),
            st.sampled_from(
                [
                    encode_event(AddRequest("x", 1, block_hashes=[1])),
                    encode_event(Free("x", 1)),
                    encode_event(Tick()),
                    b"\x92\x01" + b"\x91" * 100 + b"\xc0",
                ]
            ),
        ),
        min_size=1,
        max_size=20,
    ),
    st.sampled_from([W1, CONTROL, "seqstate.events.default.routers", "elsewhere"]),
)
def test_the_fold_decides_any_batch_event_by_event_and_never_raises(
    items: list[bytes], subject: str
) -> None:
    fold = new_fold()
    fold(1, 1000, CONTROL, encode_event(WorkerAdded(1)))
    verdicts = fold(2, 2000, subject, encode_batch_of(items))
    assert isinstance(verdicts, list) and len(verdicts) == len(items)
    for index, verdict in enumerate(verdicts):
        if type(verdict) is Refusal:
            assert verdict.reason.startswith(f"event {index} of the batch: ")
        else:
            assert type(verdict) is Delta and verdict.seq == 2 and verdict.index == index
