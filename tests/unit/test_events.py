"""The wire schema: every event round-trips, and every defect raises EventDecodeError naming it."""
# ruff: noqa: E501

from __future__ import annotations

import re

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from seqstate import (
    SCHEMA_VERSION,
    AddOutputBlock,
    AddRequest,
    Event,
    EventDecodeError,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
    decode_event,
    encode_event,
)

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

U64 = 2**64 - 1

EVENTS = [
    AddRequest(
        request_id="r-1",
        worker_id=U64,
        dp_rank=3,
        block_hashes=[0, 1, U64],
        prefill_tokens=4096,
        expected_prefill_ms=12.5,
        expected_output_tokens=200,
        track_prefill_tokens=False,
        router_id="router-a",
        lora_name="adapter",
    ),
    AddRequest(request_id="minimal", worker_id=0),
    MarkPrefillCompleted(request_id="r-1", worker_id=7, dp_rank=1, router_id="x"),
    Free(request_id="r-1", worker_id=7),
    AddOutputBlock(request_id="r-1", worker_id=7, decay_fraction=0.25),
    WorkerAdded(worker_id=9, dp_start=2, dp_size=4),
    WorkerRemoved(worker_id=9),
    Tick(),
]


@pytest.mark.parametrize("event", EVENTS, ids=lambda e: type(e).__name__)
def test_every_event_round_trips(event: object) -> None:
    assert decode_event(encode_event(event)) == event  # type: ignore[arg-type]


def test_defaults_are_omitted_on_the_wire() -> None:
    small = encode_event(Free(request_id="a", worker_id=1))
    assert len(small) < 40
    assert b"dp_rank" not in small


def _raw(event: dict[str, object], version: int = SCHEMA_VERSION) -> bytes:
    return msgspec.msgpack.encode([version, event])


BAD = [
    ({"type": "AddRequest", "request_id": "", "worker_id": 1}, "request_id"),
    ({"type": "AddRequest", "request_id": "a", "worker_id": -1}, "worker_id"),
    (
        {"type": "AddRequest", "request_id": "a", "worker_id": 1, "prefill_tokens": -5},
        "prefill_tokens",
    ),
    (
        {"type": "AddRequest", "request_id": "a", "worker_id": 1, "block_hashes": [1, -2]},
        "block_hashes[1]",
    ),
    (
        {"type": "AddRequest", "request_id": "a", "worker_id": 1, "expected_prefill_ms": -0.5},
        "expected_prefill_ms",
    ),
    (
        {
            "type": "AddRequest",
            "request_id": "a",
            "worker_id": 1,
            "expected_prefill_ms": float("nan"),
        },
        "expected_prefill_ms",
    ),
    (
        {
            "type": "AddRequest",
            "request_id": "a",
            "worker_id": 1,
            "expected_prefill_ms": float("inf"),
        },
        "expected_prefill_ms",
    ),
    ({"type": "AddRequest", "request_id": "a", "worker_id": 1, "dp_rank": 2**32}, "dp_rank"),
    ({"type": "AddRequest", "request_id": "a"}, "worker_id"),
    ({"type": "AddRequest", "request_id": 5, "worker_id": 1}, "request_id"),
    ({"type": "WorkerAdded", "worker_id": 1, "dp_size": 0}, "dp_size"),
    ({"type": "WorkerAdded", "worker_id": 1, "dp_start": 2**32 - 1, "dp_size": 1}, "dp_size"),
    (
        {"type": "AddOutputBlock", "request_id": "a", "worker_id": 1, "decay_fraction": 1.5},
        "decay_fraction",
    ),
    ({"type": "Nonsense"}, "type"),
    ({"request_id": "a", "worker_id": 1}, "type"),
]


@pytest.mark.parametrize(("payload", "field"), BAD, ids=[f for _, f in BAD])
def test_invalid_fields_are_named(payload: dict[str, object], field: str) -> None:
    # Either the path of a bad value, or the name of a missing field.
    named = re.escape(f"`$.{field}`") + "|" + re.escape(f"field `{field}`")
    with pytest.raises(EventDecodeError, match=named):
        decode_event(_raw(payload))


def test_unsupported_schema_version_is_reported() -> None:
    with pytest.raises(EventDecodeError, match="unsupported schema version 99"):
        decode_event(_raw({"type": "Tick"}, version=99))


def test_hash_above_u64_cannot_be_encoded_in_msgpack() -> None:
    # The wire itself bounds hashes to u64: msgpack has no larger integer.
    with pytest.raises(OverflowError):
        msgspec.msgpack.encode(
            [1, {"type": "AddRequest", "request_id": "a", "worker_id": 1, "block_hashes": [2**64]}]
        )


def test_encoding_an_integer_beyond_64_bits_names_the_field() -> None:
    event = AddRequest(request_id="a", worker_id=1, block_hashes=[1, 2**64])
    with pytest.raises(
        EventDecodeError,
        match=r"^invalid event: 18446744073709551616 does not fit in 64 bits - at `\$.block_hashes\[1\]`$",
    ):
        encode_event(event)
    with pytest.raises(EventDecodeError, match=r"at `\$.worker_id`"):
        encode_event(Free(request_id="a", worker_id=2**70))


@pytest.mark.parametrize(
    "tag",
    [
        "AddRequest",
        "MarkPrefillCompleted",
        "Free",
        "AddOutputBlock",
        "WorkerAdded",
        "WorkerRemoved",
        "Tick",
    ],
)
def test_an_unknown_field_is_rejected_by_name_on_both_wires(tag: str) -> None:
    minimal = {"Tick": {}, "WorkerAdded": {"worker_id": 5}, "WorkerRemoved": {"worker_id": 5}}
    fields = minimal.get(tag, {"request_id": "t", "worker_id": 5})
    payload = {"type": tag, **fields, "prefil_tokens": 500}
    with pytest.raises(EventDecodeError, match="unknown field `prefil_tokens`"):
        decode_event(_raw(payload))
    with pytest.raises(msgspec.ValidationError, match="unknown field `prefil_tokens`"):
        msgspec.json.decode(msgspec.json.encode(payload), type=Event)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        b"garbage",
        msgspec.msgpack.encode({"a": 1}),
        msgspec.msgpack.encode([1]),
        encode_event(Tick())[:-1],
        encode_event(EVENTS[0])[:-3],
    ],
)
def test_garbage_bytes_raise_the_one_error_type(data: bytes) -> None:
    with pytest.raises(EventDecodeError):
        decode_event(data)


@given(st.binary(max_size=64))
def test_arbitrary_bytes_never_raise_anything_else(data: bytes) -> None:
    try:
        event = decode_event(data)
    except EventDecodeError:
        return
    SequenceState().apply(event, 0)  # whatever decodes is applicable


def test_apply_rejects_an_object_that_is_not_an_event() -> None:
    state = SequenceState()
    with pytest.raises(EventDecodeError, match="not a seqstate event: dict"):
        state.apply({"type": "AddRequest"}, 0)
    assert sum(state.counters.values()) == 0
