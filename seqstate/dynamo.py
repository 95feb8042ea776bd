"""Dynamo's own replica-sync messages: their subject, their bytes, and the core event each is.

A stock Dynamo KV router started with ``--router-replica-sync`` on the NATS event plane
publishes every AddRequest, MarkPrefillCompleted and Free it decides on NATS Core, at
``namespace.<NS>.component.<C>.endpoint.<E>.active_sequences_events`` (workers publish their
own MarkPrefillCompleted there too). JetStream stores them in a namespace's events stream, and
the one fold (:mod:`seqstate.fold`) folds them beside seqstate's own events. This module reads
and writes those bytes exactly as Dynamo 1.6.1 does (``tests/unit/test_dynamo_wire.py`` decodes
a real fleet's, recorded in ``tests/support/dynamo_capture.py``):

- an envelope, a msgpack map with named fields ``publisher_id`` (u64, one per publishing
  process), ``sequence`` (u64, per publisher from 0, +1 per message), ``published_at`` (u64
  ms, the publisher's clock), ``topic`` and ``payload`` (bin);
- inside ``payload``, msgpack again: an ``ActiveSequenceEvent`` ``{request_id, worker
  {worker_id, dp_rank}, data, router_id, lora_name}``, where ``data`` is the string
  ``"MarkPrefillCompleted"`` or ``"Free"``, or ``{"AddRequest": {...}}``.

Unknown fields are ignored where Dynamo's serde ignores them (every struct: serde's derive
skips an unknown field unless told ``deny_unknown_fields``, which Dynamo never says), so a
newer Dynamo that adds a field still feeds the ledger. Where serde refuses, so does this
decoder: an unknown ``data`` variant, and an unknown field of a Rust ``Duration`` (serde's own
implementation names only ``secs`` and ``nanos``). A ``worker`` without its ``dp_rank`` is
rank 0, the one rank a worker without data parallelism has (Dynamo 1.6.1's replicas refuse
it instead, "missing field `dp_rank`": a row of docs/dynamo.md). Two are refused,
each with its reason: a ``topic`` other than
``active_sequences_events`` (a replica ignores such a message, whatever its subject), and an
empty ``request_id`` (a replica books it, but every empty id would be the same request).

Ignoring a field means skipping its value, and skipping recurses in msgspec, against Python's
recursion limit with the caller's frames: the same bytes could decode on a writer's shallow
stack and fail on a replay's deep one. So the hot path decodes strictly (every unknown field
refused, nothing skipped, no deeper than the schema), and only bytes that path refuses are
read again, after :func:`seqstate.nesting.nests_deeper` has refused anything nested past
:data:`~seqstate.nesting.MAX_NESTING` without recursion: the verdict depends on the bytes
alone.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta, Struct, field

from seqstate.errors import SeqstateError
from seqstate.events import (
    MAX_PREFILL_MS,
    U32_MAX,
    AddRequest,
    EventDecodeError,
    Free,
    MarkPrefillCompleted,
)
from seqstate.nesting import MAX_NESTING, nests_deeper

TOPIC: Final = "active_sequences_events"
ADD: Final = "AddRequest"
MARK: Final = "MarkPrefillCompleted"
FREE: Final = "Free"
Operation = Literal["AddRequest", "MarkPrefillCompleted", "Free"]

U64 = Annotated[int, Meta(ge=0)]  # msgpack carries nothing above u64: ge=0 is the u64 range
U32 = Annotated[int, Meta(ge=0, le=U32_MAX)]

_NS_PER_MS: Final = 1_000_000
_NS_PER_S: Final = 1_000_000_000


class DynamoEndpointError(SeqstateError, ValueError):
    """An endpoint that is not ``NS.COMPONENT.ENDPOINT`` (a configuration error)."""


# ---- the wire: Dynamo's structs, in Dynamo's field order -----------------------------------
# Every field is written, nil included, in the order Dynamo writes it (rmp-serde's named
# maps, smallest integer width, as msgspec writes): encoding a decoded message gives its bytes.


class _Wire(Struct, forbid_unknown_fields=True):
    """The strict shape of every struct: the hot path refuses what it would have to skip."""


class _Duration(_Wire):
    """A Rust ``Duration`` as serde writes it."""

    secs: U64
    nanos: U32


class _Hint(_Wire):
    initial_effective_prefill_tokens: U64
    expected_prefill_duration: _Duration | None = None


class _Add(_Wire):
    token_sequence: list[U64] | None = None
    track_prefill_tokens: bool = True
    expected_output_tokens: U32 | None = None
    prefill_load_hint: _Hint | None = None


class _AddVariant(_Wire):
    """``{"AddRequest": {...}}``: serde's externally tagged enum variant."""

    add: _Add = field(name=ADD)


class _Worker(_Wire):
    """``WorkerWithDpRank``. A missing ``dp_rank`` is rank 0: the worker has one rank, as a
    publisher that leaves it out means (Dynamo's KV events default it so; a 1.6.1 replica
    refuses it in this message, which no 1.6.1 process sends without one)."""

    worker_id: U64
    dp_rank: U32 = 0


class _Event(_Wire):
    request_id: str  # not empty: checked after decoding (:data:`_EMPTY_ID`)
    worker: _Worker
    data: Literal["MarkPrefillCompleted", "Free"] | _AddVariant
    router_id: U64
    lora_name: str | None = None


class _Envelope(_Wire):
    publisher_id: U64
    sequence: U64
    published_at: U64
    topic: str
    payload: bytes


# What a lenient reading keeps of each map: its struct's wire names (``_prune_envelope`` and
# ``_prune_event``). ``data`` and a ``_Duration`` are not pruned: serde refuses an unknown
# variant and an unknown field of a Duration.
def _names(cls: type[Struct]) -> frozenset[str]:
    return frozenset(f.encode_name for f in msgspec.structs.fields(cls))


_EVENT_NAMES: Final = _names(_Event)
_WORKER_NAMES: Final = _names(_Worker)
_ADD_NAMES: Final = _names(_Add)
_HINT_NAMES: Final = _names(_Hint)
_ENVELOPE_NAMES: Final = _names(_Envelope)

_envelope_decoder = msgspec.msgpack.Decoder(_Envelope)
_event_decoder = msgspec.msgpack.Decoder(_Event)
_any_decoder = msgspec.msgpack.Decoder()
_encoder = msgspec.msgpack.Encoder()


# ---- what a message says -------------------------------------------------------------------


class DynamoMessage(Struct, kw_only=True):
    """One replica-sync message, flat: the envelope's fields and its event's.

    ``op`` is the operation; the AddRequest fields are meaningful for ``op == "AddRequest"``
    only. ``prefill_tokens`` is the ``prefill_load_hint``'s ``initial_effective_prefill_tokens``
    (None: no hint), ``expected_prefill_duration`` its Duration as ``(secs, nanos)``. Nothing
    is normalised, so :func:`encode_dynamo` gives back the bytes this was decoded from.

    ``published_at_ms`` is the publisher's clock: the fold never reads it, its time is the
    log's (the time JetStream stored the message), as for every event.
    """

    publisher_id: int
    sequence: int
    published_at_ms: int
    request_id: str
    worker_id: int
    dp_rank: int = 0
    router_id: int
    lora_name: str | None = None
    op: Operation
    token_sequence: list[int] | None = None
    track_prefill_tokens: bool = True
    expected_output_tokens: int | None = None
    prefill_tokens: int | None = None
    expected_prefill_duration: tuple[int, int] | None = None
    topic: str = TOPIC

    @property
    def expected_prefill_ms(self) -> float | None:
        """The hint's duration in milliseconds, as the core's AddRequest takes it."""
        duration = self.expected_prefill_duration
        if duration is None:
            return None
        return (duration[0] * _NS_PER_S + duration[1]) / _NS_PER_MS


def core_event(message: DynamoMessage) -> AddRequest | MarkPrefillCompleted | Free:
    """The seqstate event ``message`` is, as a Dynamo replica applies it (reference §7.2).

    The owner is ``router_id`` in decimal (the core names routers by strings). A Dynamo router
    never sends seqstate's heartbeats, so it never enters the core's live routers: its requests
    are never orphaned (that needs a heartbeat, then silence), and end by their Free or by
    expiry, as in Dynamo. A worker's own Mark names the worker as its router: harmless, a Mark
    only refreshes a router the core already knows."""
    op = message.op
    if op == ADD:
        return AddRequest(
            request_id=message.request_id,
            worker_id=message.worker_id,
            dp_rank=message.dp_rank,
            block_hashes=message.token_sequence or [],
            prefill_tokens=message.prefill_tokens or 0,
            expected_prefill_ms=message.expected_prefill_ms,
            expected_output_tokens=message.expected_output_tokens,
            track_prefill_tokens=message.track_prefill_tokens,
            router_id=str(message.router_id),
            lora_name=message.lora_name,
        )
    if op == MARK:
        return MarkPrefillCompleted(
            request_id=message.request_id,
            worker_id=message.worker_id,
            dp_rank=message.dp_rank,
            router_id=str(message.router_id),
        )
    return Free(
        request_id=message.request_id,
        worker_id=message.worker_id,
        dp_rank=message.dp_rank,
        router_id=str(message.router_id),
    )


# ---- subjects ------------------------------------------------------------------------------

# A NATS subject token: not empty, no dot, no wildcard, no whitespace or control character.
_TOKEN: Final = r"[^.*>\s\x00-\x1f\x7f]+"
_ENDPOINT: Final = re.compile(rf"({_TOKEN})\.({_TOKEN})\.({_TOKEN})")
_RAW: Final = re.compile(
    rf"namespace\.({_TOKEN})\.component\.({_TOKEN})\.endpoint\.({_TOKEN})\.{TOPIC}"
)
_CAPTURED: Final = re.compile(rf"seqstate\.events\.{_TOKEN}\.dynamo\.{_TOKEN}\.{_TOKEN}\.{_TOKEN}")
CAPTURED: Final = "dynamo"  # the token after a namespace's events prefix in a captured subject


def _shown(text: str) -> str:
    """``text`` cut to what a reason or an error line shows of it."""
    return text if len(text) <= 100 else text[:100] + "…"


def _endpoint(endpoint: str) -> tuple[str, str, str]:
    match = _ENDPOINT.fullmatch(endpoint)
    if match is None:
        raise DynamoEndpointError(
            f"Dynamo endpoint {_shown(endpoint)!r} is not NAMESPACE.COMPONENT.ENDPOINT (three "
            "non-empty names without dots, wildcards or spaces, e.g. dynamo.backend.generate)"
        )
    ns, component, name = match.groups()
    return ns, component, name


def dynamo_subject(endpoint: str) -> str:
    """The subject Dynamo publishes ``endpoint``'s (``NS.COMPONENT.ENDPOINT``) lifecycle on."""
    ns, component, name = _endpoint(endpoint)
    return f"namespace.{ns}.component.{component}.endpoint.{name}.{TOPIC}"


def endpoint_of(subject: str) -> str | None:
    """The endpoint ``NS.COMPONENT.ENDPOINT`` whose lifecycle Dynamo publishes on
    ``subject`` (the inverse of :func:`dynamo_subject`); None for any other subject."""
    match = _RAW.fullmatch(subject)
    return None if match is None else ".".join(match.groups())


def captured_subject(namespace: str, endpoint: str) -> str:
    """The subject ``endpoint``'s messages have in ``namespace``'s log: the events stream
    sources the capture stream, rewriting Dynamo's subject under the namespace's prefix, so
    every reader that filters the namespace's events reads them too."""
    ns, component, name = _endpoint(endpoint)
    return f"seqstate.events.{namespace}.{CAPTURED}.{ns}.{component}.{name}"


def is_dynamo_subject(subject: str) -> bool:
    """Whether ``subject`` has the shape of a Dynamo lifecycle subject, whatever endpoint it
    names: Dynamo's own (``namespace.*.component.*.endpoint.*.active_sequences_events``) or a
    namespace's capture of it (``seqstate.events.*.dynamo.*.*.*``). The fold tells Dynamo's
    messages by their subject alone, with no configuration, so every fold of any log (writer,
    replay, rebuild, verify) decides alike."""
    return _CAPTURED.fullmatch(subject) is not None or _RAW.fullmatch(subject) is not None


def resync_publisher_id(namespace: str) -> int:
    """The publisher id under which seqstate republishes ``namespace``'s requests in flight
    (``seqstate dynamo resync``): fixed, so that the fold of any log knows its own
    republished messages and ignores them, and a u64 no Dynamo process is likely to draw."""
    digest = hashlib.blake2b(f"seqstate-resync:{namespace}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


# ---- decoding ------------------------------------------------------------------------------


def decode_dynamo(data: bytes | bytearray | memoryview) -> DynamoMessage:
    """Decode and validate one replica-sync message, both levels; any defect raises
    :class:`~seqstate.events.EventDecodeError` with a reason, the same whatever the caller's
    stack."""
    envelope: _Envelope = _decode(data, _envelope_decoder, _Envelope, _prune_envelope, "envelope")
    if envelope.topic != TOPIC:
        raise EventDecodeError(_other_topic(envelope.topic))
    event: _Event = _decode(envelope.payload, _event_decoder, _Event, _prune_event, "event")
    if not event.request_id:
        raise EventDecodeError(_EMPTY_ID)
    message = DynamoMessage(
        publisher_id=envelope.publisher_id,
        sequence=envelope.sequence,
        published_at_ms=envelope.published_at,
        request_id=event.request_id,
        worker_id=event.worker.worker_id,
        dp_rank=event.worker.dp_rank,
        router_id=event.router_id,
        lora_name=event.lora_name,
        op=ADD,
        topic=envelope.topic,
    )
    data_ = event.data
    if type(data_) is str:
        message.op = data_  # type: ignore[assignment]
        return message
    add = data_.add  # type: ignore[union-attr]
    message.token_sequence = add.token_sequence
    message.track_prefill_tokens = add.track_prefill_tokens
    message.expected_output_tokens = add.expected_output_tokens
    hint = add.prefill_load_hint
    if hint is not None:
        message.prefill_tokens = hint.initial_effective_prefill_tokens
        duration = hint.expected_prefill_duration
        if duration is not None:
            message.expected_prefill_duration = (duration.secs, duration.nanos)
            if (duration.secs * _NS_PER_S + duration.nanos) / _NS_PER_MS > MAX_PREFILL_MS:
                raise EventDecodeError(
                    f"invalid Dynamo event: an expected prefill of {duration.secs} s is not a "
                    f"prediction (at most {MAX_PREFILL_MS:.0f} ms) - at "
                    "`$.data.AddRequest.prefill_load_hint.expected_prefill_duration`"
                )
    return message


_TOO_DEEP: Final = f"malformed Dynamo message: nested deeper than {MAX_NESTING} levels"
# Dynamo's replicas key their requests by id, and would book an empty one (measured on 1.6.1):
# every empty id would then be one request, its Free anyone's. The core refuses it, as in its
# own events.
_EMPTY_ID: Final = (
    "invalid Dynamo event: an empty request_id (a Mark or a Free finds its request by id: "
    "every empty one would name the same request) - at `$.request_id`"
)


def _other_topic(topic: str) -> str:
    """A message of another of Dynamo's topics on a lifecycle subject: Dynamo's replicas
    ignore it (measured on 1.6.1, an empty topic too), so the ledger folds nothing of it."""
    return (
        f"invalid Dynamo envelope: topic {_shown(topic)!r} is not {TOPIC!r} (Dynamo's "
        "replicas ignore a message of another topic) - at `$.topic`"
    )


def _decode(
    data: bytes | bytearray | memoryview,
    strict: msgspec.msgpack.Decoder[Any],
    cls: type[Struct],
    prune: Callable[[object], object],
    what: str,
) -> Any:
    """One level, strictly; if refused, leniently as serde reads it (see the module's note)."""
    try:
        return strict.decode(data)
    except (msgspec.DecodeError, RecursionError):
        pass
    if nests_deeper(data):
        raise EventDecodeError(_TOO_DEEP)
    try:
        raw = _any_decoder.decode(data)  # no deeper than MAX_NESTING: any stack reads it
    except msgspec.DecodeError as exc:
        raise EventDecodeError(f"malformed Dynamo {what} bytes: {exc}") from None
    except RecursionError:
        raise EventDecodeError(f"malformed Dynamo {what}: the decoder ran out of stack") from None
    try:
        return msgspec.convert(prune(raw), cls)
    except msgspec.ValidationError as exc:
        raise EventDecodeError(f"invalid Dynamo {what}: {exc}") from None
    except RecursionError:
        raise EventDecodeError(f"malformed Dynamo {what}: the decoder ran out of stack") from None


def _known(value: object, names: frozenset[str]) -> object:
    """A map without the fields ``names`` does not hold (anything else as it is)."""
    if type(value) is not dict:
        return value
    return {k: v for k, v in value.items() if k in names}


def _prune_envelope(raw: object) -> object:
    return _known(raw, _ENVELOPE_NAMES)


def _prune_event(raw: object) -> object:
    event = _known(raw, _EVENT_NAMES)
    if type(event) is not dict:
        return event
    if "worker" in event:
        event["worker"] = _known(event["worker"], _WORKER_NAMES)
    data = event.get("data")
    if type(data) is dict and type(data.get(ADD)) is dict:
        add = _known(data[ADD], _ADD_NAMES)
        assert type(add) is dict
        if "prefill_load_hint" in add:
            add["prefill_load_hint"] = _known(add["prefill_load_hint"], _HINT_NAMES)
        event["data"] = {**data, ADD: add}
    return event


# ---- encoding ------------------------------------------------------------------------------


def encode_dynamo(message: DynamoMessage) -> bytes:
    """``message`` in Dynamo's wire format (the inverse of :func:`decode_dynamo`): what a
    resync republishes, so that Dynamo's own replicas apply it as a peer's.

    Raises :class:`~seqstate.events.EventDecodeError` for a value the wire cannot carry (an
    integer beyond u64)."""
    if message.op == ADD:
        hint = None
        if message.prefill_tokens is not None:
            duration = message.expected_prefill_duration
            hint = _Hint(message.prefill_tokens, None if duration is None else _Duration(*duration))
        data: str | _AddVariant = _AddVariant(
            _Add(
                message.token_sequence,
                message.track_prefill_tokens,
                message.expected_output_tokens,
                hint,
            )
        )
    else:
        data = message.op
    event = _Event(
        message.request_id,
        _Worker(message.worker_id, message.dp_rank),
        data,  # type: ignore[arg-type]
        message.router_id,
        message.lora_name,
    )
    try:
        payload = _encoder.encode(event)
        return _encoder.encode(
            _Envelope(
                message.publisher_id,
                message.sequence,
                message.published_at_ms,
                message.topic,
                payload,
            )
        )
    except OverflowError:
        raise EventDecodeError(
            "invalid Dynamo message: an integer does not fit in 64 bits"
        ) from None
