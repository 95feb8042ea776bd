"""Dynamo's replica-sync bytes: decoded exactly, encoded back to the same bytes, and
every defect refused with a reason, over the real capture (tests/support/dynamo_capture.py)."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from typing import Any

import msgspec
import pytest
from dynamo_capture import (
    BIG_WORKER,
    CAPTURE,
    ENDPOINT,
    FRONTEND_A,
    FRONTEND_B,
    SMALL_WORKER,
    SUBJECT,
    WORKER_DP1,
    WORKER_DP2,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from seqstate import AddRequest, Free, MarkPrefillCompleted
from seqstate.dynamo import (
    TOPIC,
    DynamoEndpointError,
    DynamoMessage,
    captured_subject,
    core_event,
    decode_dynamo,
    dynamo_subject,
    encode_dynamo,
    endpoint_of,
    is_dynamo_subject,
    resync_publisher_id,
)
from seqstate.errors import SeqstateError
from seqstate.events import EventDecodeError

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too

MESSAGES = [decode_dynamo(c.data) for c in CAPTURE]
FIRST = CAPTURE[0].data  # an AddRequest of frontend A, worker above 2^63


def raw(data: bytes) -> dict[str, Any]:
    """The envelope as plain msgpack, its payload decoded too (to build variants)."""
    envelope = msgspec.msgpack.decode(data)
    envelope["payload"] = msgspec.msgpack.decode(envelope["payload"])
    return envelope


def wire(envelope: dict[str, Any], payload: bytes | None = None) -> bytes:
    """Bytes of an envelope whose payload is a map (encoded) or given as bytes."""
    inner = msgspec.msgpack.encode(envelope["payload"]) if payload is None else payload
    return msgspec.msgpack.encode({**envelope, "payload": inner})


def refused(data: bytes) -> str:
    with pytest.raises(EventDecodeError) as caught:
        decode_dynamo(data)
    return str(caught.value)


# ---- the capture ------------------------------------------------------------------------------


def test_every_captured_message_decodes_and_the_traffic_is_what_the_fleet_did() -> None:
    assert len(MESSAGES) == 155
    assert Counter(m.op for m in MESSAGES) == {
        "AddRequest": 40,
        "MarkPrefillCompleted": 75,
        "Free": 40,
    }
    assert Counter(m.publisher_id for m in MESSAGES) == {
        FRONTEND_A: 56,
        FRONTEND_B: 59,
        WORKER_DP2: 26,
        WORKER_DP1: 14,
    }
    for publisher in (FRONTEND_A, FRONTEND_B, WORKER_DP2, WORKER_DP1):
        sequences = [m.sequence for m in MESSAGES if m.publisher_id == publisher]
        assert sequences == list(range(len(sequences)))  # gap-free from 0, in order
    workers_own = [m for m in MESSAGES if m.router_id == m.worker_id]
    assert len(workers_own) == 40 and {m.op for m in workers_own} == {"MarkPrefillCompleted"}
    assert {(m.worker_id, m.dp_rank) for m in MESSAGES} == {
        (BIG_WORKER, 0),
        (BIG_WORKER, 1),
        (SMALL_WORKER, 0),
    }
    assert all(m.topic == TOPIC and m.lora_name is None for m in MESSAGES)
    assert all(is_dynamo_subject(c.subject) and c.subject == SUBJECT for c in CAPTURE)


def test_the_first_add_request_field_by_field() -> None:
    assert MESSAGES[0] == DynamoMessage(
        publisher_id=FRONTEND_A,
        sequence=0,
        published_at_ms=1796233093802,
        request_id="5af77f4d-6bef-4b92-a9e8-d5548429c085",
        worker_id=18391909055928191313,
        dp_rank=0,
        router_id=60572485714993071,
        lora_name=None,
        op="AddRequest",
        token_sequence=[
            14771065666622777956,
            1947222085448794450,
            843431846235003396,
            12361539275455150396,
            14567928802343344230,
            13303123755460725469,
            16695668911325679568,
            13345166432662636625,
            795490903765777570,
            1740012737949005045,
            13753537792855840664,
            14455648877746627819,
        ],
        track_prefill_tokens=True,
        expected_output_tokens=None,
        prefill_tokens=200,
        expected_prefill_duration=None,
    )
    assert MESSAGES[0].worker_id > 2**63 and MESSAGES[0].expected_prefill_ms is None


def test_a_workers_own_mark_and_a_routers_free() -> None:
    mark = MESSAGES[12]  # the dp-2 worker's Mark at the first token of its request
    assert (mark.publisher_id, mark.sequence, mark.op) == (WORKER_DP2, 0, "MarkPrefillCompleted")
    assert mark.request_id == "02613d29-c7c9-4ac5-833a-185dd33bf9ee"
    assert mark.router_id == mark.worker_id == BIG_WORKER and mark.dp_rank == 0
    assert mark.token_sequence is None and mark.prefill_tokens is None
    free = MESSAGES[34]
    assert (free.publisher_id, free.sequence, free.op) == (FRONTEND_A, 10, "Free")
    assert (free.worker_id, free.dp_rank, free.router_id) == (SMALL_WORKER, 0, 60572485714993071)
    assert free.published_at_ms == 1796233096592


def test_encoding_a_decoded_message_gives_back_its_bytes_for_every_captured_message() -> None:
    for captured, message in zip(CAPTURE, MESSAGES, strict=True):
        assert encode_dynamo(message) == captured.data


def test_each_message_is_the_core_event_dynamo_means() -> None:
    add = core_event(MESSAGES[1])
    assert add == AddRequest(
        request_id="2bd1bcbd-5bb0-4819-b4ae-cd7cadf2040c",
        worker_id=BIG_WORKER,
        dp_rank=1,
        block_hashes=MESSAGES[1].token_sequence or [],
        prefill_tokens=314,
        expected_prefill_ms=None,
        expected_output_tokens=None,
        track_prefill_tokens=True,
        router_id="60572485714993071",
        lora_name=None,
    )
    assert len(add.block_hashes) == 19
    assert core_event(MESSAGES[12]) == MarkPrefillCompleted(
        request_id="02613d29-c7c9-4ac5-833a-185dd33bf9ee",
        worker_id=BIG_WORKER,
        dp_rank=0,
        router_id=str(BIG_WORKER),
    )
    assert core_event(MESSAGES[34]) == Free(
        request_id=MESSAGES[34].request_id,
        worker_id=SMALL_WORKER,
        dp_rank=0,
        router_id="60572485714993071",
    )


# ---- values as Dynamo means them --------------------------------------------------------------


def add_variant(**fields: Any) -> bytes:
    """The first AddRequest with its AddRequest fields replaced (None: removed)."""
    envelope = raw(FIRST)
    add = envelope["payload"]["data"]["AddRequest"]
    for name, value in fields.items():
        if value is None:
            add.pop(name, None)
        else:
            add[name] = value
    return wire(envelope)


def test_missing_optional_fields_take_serdes_defaults() -> None:
    message = decode_dynamo(
        add_variant(
            token_sequence=None,
            track_prefill_tokens=None,
            expected_output_tokens=None,
            prefill_load_hint=None,
        )
    )
    assert message.token_sequence is None and message.track_prefill_tokens
    assert message.prefill_tokens is None and message.expected_output_tokens is None
    event = core_event(message)
    assert isinstance(event, AddRequest)
    assert event.block_hashes == [] and event.prefill_tokens == 0
    assert event.track_prefill_tokens and event.expected_prefill_ms is None


def test_nil_values_are_no_hashes_and_no_prefill() -> None:
    envelope = raw(FIRST)
    add = envelope["payload"]["data"]["AddRequest"]
    add["token_sequence"] = None
    add["prefill_load_hint"] = None
    data = wire(envelope)
    message = decode_dynamo(data)
    event = core_event(message)
    assert isinstance(event, AddRequest)
    assert (event.block_hashes, event.prefill_tokens) == ([], 0)
    assert encode_dynamo(message) == data  # nil stays nil on the way back


def test_a_duration_is_secs_and_nanos_and_folds_as_milliseconds() -> None:
    data = add_variant(
        prefill_load_hint={
            "initial_effective_prefill_tokens": 21,
            "expected_prefill_duration": {"secs": 2, "nanos": 500_000_001},
        },
        expected_output_tokens=77,
        track_prefill_tokens=False,
    )
    message = decode_dynamo(data)
    assert message.expected_prefill_duration == (2, 500_000_001)
    assert message.expected_prefill_ms == 2500.000001
    assert (message.prefill_tokens, message.expected_output_tokens) == (21, 77)
    event = core_event(message)
    assert isinstance(event, AddRequest)
    assert event.expected_prefill_ms == 2500.000001 and not event.track_prefill_tokens
    assert encode_dynamo(message) == data


def test_a_prediction_over_31_years_is_refused() -> None:
    reason = refused(
        add_variant(
            prefill_load_hint={
                "initial_effective_prefill_tokens": 21,
                "expected_prefill_duration": {"secs": 10**9 + 1, "nanos": 0},
            }
        )
    )
    assert reason == (
        "invalid Dynamo event: an expected prefill of 1000000001 s is not a prediction (at "
        "most 1000000000000 ms) - at `$.data.AddRequest.prefill_load_hint."
        "expected_prefill_duration`"
    )


def test_unknown_fields_are_ignored_as_dynamos_serde_ignores_them() -> None:
    envelope = raw(FIRST)
    envelope["shard"] = [1, {"x": None}]
    event = envelope["payload"]
    event["trace"] = {"a": [1, 2, 3]}
    event["worker"]["zone"] = "b"
    event["data"]["AddRequest"]["new_hint"] = 5
    event["data"]["AddRequest"]["prefill_load_hint"]["cached"] = 48
    assert decode_dynamo(wire(envelope)) == MESSAGES[0]


def test_an_unknown_operation_and_an_unknown_duration_field_are_refused_as_serde_does() -> None:
    envelope = raw(FIRST)
    envelope["payload"]["data"] = "ActiveLoad"
    assert (
        refused(wire(envelope))
        == "invalid Dynamo event: Invalid enum value 'ActiveLoad' - at `$.data`"
    )
    envelope["payload"]["data"] = {"AddRequest": {}, "Free": None}
    assert refused(wire(envelope)) == (
        "invalid Dynamo event: Object contains unknown field `Free` - at `$.data`"
    )
    data = add_variant(
        prefill_load_hint={
            "initial_effective_prefill_tokens": 1,
            "expected_prefill_duration": {"secs": 1, "nanos": 0, "millis": 3},
        }
    )
    assert refused(data) == (
        "invalid Dynamo event: Object contains unknown field `millis` - at "
        "`$.data.AddRequest.prefill_load_hint.expected_prefill_duration`"
    )


def test_a_worker_without_its_dp_rank_is_rank_0() -> None:
    """A worker map without ``dp_rank`` names the worker's one rank, 0 (unknown fields beside
    it still ignored); both present decode as ever. (Dynamo 1.6.1's replicas refuse it:
    tests/dynamo/test_decoder_edges.py pins that difference.)"""
    for worker in ({"worker_id": 7}, {"worker_id": 7, "zone": "b"}):
        message = decode_dynamo(with_event(worker=worker))
        assert (message.worker_id, message.dp_rank) == (7, 0)
    assert decode_dynamo(with_event(worker={"worker_id": 7, "dp_rank": 1})).dp_rank == 1


@pytest.mark.parametrize("topic", ["kv-events", "", "active_sequences_events_v2"])
def test_a_message_of_another_topic_is_refused_as_dynamos_replicas_ignore_it(topic: str) -> None:
    """The envelope's ``topic`` is the one thing in a message that says which of Dynamo's
    event streams it belongs to (the envelope names no namespace, the subject says the rest).
    A Dynamo 1.6.1 replica ignores a lifecycle-subject message of another topic, an empty one
    too (measured on a live fleet): it is no lifecycle event, so the ledger folds nothing of
    it either."""
    envelope = raw(FIRST)
    envelope["topic"] = topic
    assert refused(wire(envelope)) == (
        f"invalid Dynamo envelope: topic {topic!r} is not 'active_sequences_events' (Dynamo's "
        "replicas ignore a message of another topic) - at `$.topic`"
    )


def test_a_long_topic_is_cut_in_its_reason() -> None:
    envelope = raw(FIRST)
    envelope["topic"] = "t" * 5000
    assert refused(wire(envelope)) == (
        f"invalid Dynamo envelope: topic '{'t' * 100}…' is not 'active_sequences_events' "
        "(Dynamo's replicas ignore a message of another topic) - at `$.topic`"
    )


# ---- defects ------------------------------------------------------------------------------------


def with_event(**fields: Any) -> bytes:
    envelope = raw(FIRST)
    envelope["payload"].update(fields)
    return wire(envelope)


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "malformed Dynamo envelope bytes: Input data was truncated"),
        (
            b"\xc1",
            "malformed Dynamo envelope bytes: MessagePack data is malformed: invalid opcode "
            "'\\xc1' (byte 0)",
        ),
        (
            msgspec.msgpack.encode([1, {}]),
            "invalid Dynamo envelope: Expected `object`, got `array`",
        ),
        (
            wire({**raw(FIRST), "sequence": -1}),
            "invalid Dynamo envelope: Expected `int` >= 0 - at `$.sequence`",
        ),
        (
            wire(raw(FIRST), payload=b"\x85\xa1a"),
            "malformed Dynamo event bytes: Input data was truncated",
        ),
        (
            msgspec.msgpack.encode({**raw(FIRST), "payload": 5}),
            "invalid Dynamo envelope: Expected `bytes`, got `int` - at `$.payload`",
        ),
        (
            with_event(worker={"worker_id": 1, "dp_rank": 2**32}),
            "invalid Dynamo event: Expected `int` <= 4294967295 - at `$.worker.dp_rank`",
        ),
        (
            with_event(worker={"worker_id": -1, "dp_rank": 0}),
            "invalid Dynamo event: Expected `int` >= 0 - at `$.worker.worker_id`",
        ),
        (
            with_event(router_id="r1"),
            "invalid Dynamo event: Expected `int`, got `str` - at `$.router_id`",
        ),
        (
            with_event(request_id=""),
            "invalid Dynamo event: an empty request_id (a Mark or a Free finds its request by "
            "id: every empty one would name the same request) - at `$.request_id`",
        ),
        (
            add_variant(expected_output_tokens=2**32),
            "invalid Dynamo event: Expected `int` <= 4294967295 - at "
            "`$.data.AddRequest.expected_output_tokens`",
        ),
        (
            add_variant(token_sequence=[1, -5]),
            "invalid Dynamo event: Expected `int` >= 0 - at `$.data.AddRequest.token_sequence[1]`",
        ),
        (
            add_variant(
                prefill_load_hint={
                    "initial_effective_prefill_tokens": 1,
                    "expected_prefill_duration": {"secs": 1, "nanos": 2**32},
                }
            ),
            "invalid Dynamo event: Expected `int` <= 4294967295 - at "
            "`$.data.AddRequest.prefill_load_hint.expected_prefill_duration.nanos`",
        ),
    ],
)
def test_defects_are_refused_with_their_reason(data: bytes, reason: str) -> None:
    assert refused(data) == reason


def test_a_seqstate_event_is_no_dynamo_message() -> None:
    from seqstate import encode_event

    assert refused(encode_event(Free(request_id="r", worker_id=1))) == (
        "invalid Dynamo envelope: Expected `object`, got `array`"
    )


def test_every_truncation_of_a_message_is_refused() -> None:
    for cut in range(len(FIRST)):
        with pytest.raises(EventDecodeError):
            decode_dynamo(FIRST[:cut])


def nested_unknown(depth: int, where: str) -> bytes:
    """The first message with an unknown field nested ``depth`` arrays deep, in the envelope
    or in the event."""
    nest = b"\x91" * depth + b"\xc0"
    payload = raw(FIRST)["payload"]
    inner = msgspec.msgpack.encode(payload)
    if where == "event":
        inner = bytes([inner[0] + 1]) + inner[1:] + b"\xa5extra" + nest
    envelope = msgspec.msgpack.encode({**raw(FIRST), "payload": inner})
    if where == "envelope":
        envelope = bytes([envelope[0] + 1]) + envelope[1:] + b"\xa5extra" + nest
    return envelope


@pytest.mark.parametrize("where", ["envelope", "event"])
def test_an_unknown_field_nested_past_16_is_refused_below_it_ignored(where: str) -> None:
    assert decode_dynamo(nested_unknown(14, where)) == MESSAGES[0]
    for depth in (16, 400, 5000):
        assert refused(nested_unknown(depth, where)) == (
            "malformed Dynamo message: nested deeper than 16 levels"
        )


def stack_depth() -> int:
    frame, depth = sys._getframe(), 0
    while frame is not None:
        frame, depth = frame.f_back, depth + 1  # type: ignore[assignment]
    return depth


def at_depth(depth: int, call: Callable[[], object]) -> object:
    """``call()`` with the stack ``depth`` frames deep."""
    return call() if stack_depth() >= depth else at_depth(depth, call)


def verdict(data: bytes) -> object:
    try:
        return decode_dynamo(data)
    except EventDecodeError as exc:
        return str(exc)


def test_a_verdict_does_not_depend_on_how_deep_the_caller_is() -> None:
    """A skipped unknown field recurses in msgspec: a lenient decoder alone would accept on a
    writer's shallow stack what it refused on a replay's deep one."""
    cases = [nested_unknown(d, w) for d in (14, 200, 900, 990) for w in ("envelope", "event")]
    shallow = [verdict(data) for data in cases]
    assert shallow[:2] == [MESSAGES[0], MESSAGES[0]]
    limit = sys.getrecursionlimit()
    for depth in (limit // 2, limit - 60):
        assert [at_depth(depth, lambda d=d: verdict(d)) for d in cases] == shallow


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=300) | st.sampled_from([FIRST[:n] for n in range(len(FIRST))]))
def test_no_bytes_make_the_decoder_raise_anything_else(data: bytes) -> None:
    try:
        decode_dynamo(data)
    except EventDecodeError as exc:
        assert str(exc)


def test_an_integer_past_u64_cannot_be_encoded() -> None:
    message = msgspec.structs.replace(MESSAGES[0], worker_id=2**64)
    with pytest.raises(EventDecodeError, match="does not fit in 64 bits"):
        encode_dynamo(message)


# ---- subjects and the resync publisher ---------------------------------------------------------


def test_an_endpoint_names_its_subject_and_its_subject_in_a_namespaces_log() -> None:
    assert dynamo_subject(ENDPOINT) == SUBJECT
    assert captured_subject("ns", ENDPOINT) == "seqstate.events.ns.dynamo.dynamo.backend.generate"
    assert dynamo_subject("ns-1.comp_2.gen") == (
        "namespace.ns-1.component.comp_2.endpoint.gen.active_sequences_events"
    )


@pytest.mark.parametrize(
    "endpoint", ["", "a.b", "a.b.c.d", "a..c", ".b.c", "a.b.", "a.*.c", "a.>.c", "a.b c.d"]
)
def test_a_malformed_endpoint_is_one_clear_error(endpoint: str) -> None:
    with pytest.raises(DynamoEndpointError) as caught:
        dynamo_subject(endpoint)
    with pytest.raises(DynamoEndpointError):
        captured_subject("ns", endpoint)
    assert isinstance(caught.value, SeqstateError) and isinstance(caught.value, ValueError)
    assert str(caught.value) == (
        f"Dynamo endpoint {endpoint!r} is not NAMESPACE.COMPONENT.ENDPOINT (three non-empty "
        "names without dots, wildcards or spaces, e.g. dynamo.backend.generate)"
    )


@pytest.mark.parametrize(
    ("subject", "dynamo"),
    [
        (SUBJECT, True),
        ("namespace.x.component.y.endpoint.z.active_sequences_events", True),
        ("namespace.x.component.y.endpoint.z.kv_metrics", False),
        ("namespace.x.component.y.endpoint.active_sequences_events", False),
        ("namespace.x.y.component.y.endpoint.z.active_sequences_events", False),
        ("namespace..component.y.endpoint.z.active_sequences_events", False),
        ("namespace.*.component.y.endpoint.z.active_sequences_events", False),
        ("seqstate.events.ns.dynamo.x.y.z", True),  # a namespace's capture of x.y.z
        ("seqstate.events.ns.dynamo.x.y", False),
        ("seqstate.events.ns.dynamo.x.y.z.w", False),
        ("seqstate.events.ns.dynamo.x.*.z", False),
        ("seqstate.events.default.control", False),
        ("seqstate.events.default.1.0", False),
        ("", False),
    ],
)
def test_a_dynamo_subject_is_told_by_its_shape(subject: str, dynamo: bool) -> None:
    assert is_dynamo_subject(subject) is dynamo


def test_a_dynamo_subject_names_its_endpoint_and_no_other_subject_does() -> None:
    """What ``seqstate dynamo uncapture`` reads back from a capture stream's subjects."""
    for endpoint in (ENDPOINT, "ns-1.comp_2.gen"):
        assert endpoint_of(dynamo_subject(endpoint)) == endpoint
    for subject in (
        "seqstate.events.ns.dynamo.x.y.z",
        "namespace.x.component.y.endpoint.z.kv_metrics",
        "namespace.*.component.y.endpoint.z.active_sequences_events",
        "SEQSTATE_EVENTS_DYNAMO_ns",  # a capture stream that captures nothing listens there
        "",
    ):
        assert endpoint_of(subject) is None, subject


def test_the_resync_publisher_is_a_fixed_u64_of_the_namespace() -> None:
    assert resync_publisher_id("default") == 13377834495404987561  # never changes: logs keep it
    assert resync_publisher_id("default") != resync_publisher_id("other")
    assert all(0 <= resync_publisher_id(ns) < 2**64 for ns in ("a", "b", "dynamo"))
    assert resync_publisher_id("default") not in {m.publisher_id for m in MESSAGES}
