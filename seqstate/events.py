"""The wire schema of lifecycle events: what routers publish and the writer folds.

Events are msgspec Structs in one tagged union, so one reused decoder turns bytes into
the right type and validates every field in the same pass. Validation lives in the type
annotations (``Meta`` bounds), which is why a bad field is reported by name and why
``apply`` can trust a decoded event without re-checking it.

On the wire an event travels inside a two-element envelope ``[schema_version, event]``
(msgpack), so a future schema can be recognised before its fields are read.
"""

from __future__ import annotations

from typing import Annotated, Final

import msgspec
from msgspec import Meta, Struct

from seqstate.errors import SeqstateError
from seqstate.nesting import MAX_NESTING, nests_deeper

SCHEMA_VERSION: Final = 1

U32_MAX: Final = 2**32 - 1
# A modeled prefill longer than ~31 years is not a prediction; it is a bug upstream.
MAX_PREFILL_MS: Final = 1e12

MAX_ROUTER_ID: Final = 256  # characters
RequestId = Annotated[str, Meta(min_length=1)]
RouterId = Annotated[str, Meta(min_length=1, max_length=MAX_ROUTER_ID)]
# msgpack cannot carry an integer above u64, so ge=0 bounds these to u64 on the wire
# (msgspec rejects an explicit le beyond int64).
WorkerId = Annotated[int, Meta(ge=0)]
DpRank = Annotated[int, Meta(ge=0, le=U32_MAX)]
BlockHash = Annotated[int, Meta(ge=0)]
Tokens = Annotated[int, Meta(ge=0)]
DurationMs = Annotated[float, Meta(ge=0.0, le=MAX_PREFILL_MS)]
OutputTokens = Annotated[int, Meta(ge=0, le=U32_MAX)]
# Each rank is a slot with its own state; a u32-sized range from a bad event would exhaust
# memory, so the size is bounded far above any real data-parallel degree.
MAX_DP_SIZE: Final = 4096
DpSize = Annotated[int, Meta(ge=1, le=MAX_DP_SIZE)]
BlockSize = Annotated[int, Meta(ge=1, le=U32_MAX)]
Fraction = Annotated[float, Meta(ge=0.0, le=1.0)]


class EventDecodeError(SeqstateError, ValueError):
    """Raised for any event that cannot be trusted: bad bytes, unknown tag, out-of-range field."""


class _Event(Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """Options every event shares. An unknown field is rejected, never ignored: a typo such as
    ``prefil_tokens`` would otherwise be stored as an event with no prefill, forever."""


class AddRequest(_Event, tag=True):
    """A router booked ``request_id`` on a worker rank.

    ``prefill_tokens`` is the effective prefill (ISL minus tokens already cached on the chosen
    worker); 0 means no prefill load. ``block_hashes`` are the chained sequence hashes of the
    complete prompt blocks, so a hash names its whole prefix.
    """

    request_id: RequestId
    worker_id: WorkerId
    dp_rank: DpRank = 0
    block_hashes: list[BlockHash] = []
    prefill_tokens: Tokens = 0
    expected_prefill_ms: DurationMs | None = None
    expected_output_tokens: OutputTokens | None = None
    track_prefill_tokens: bool = True
    router_id: str = ""
    lora_name: str | None = None


class MarkPrefillCompleted(_Event, tag=True):
    """The first output token arrived: the request's prefill load is done, its blocks stay."""

    request_id: RequestId
    worker_id: WorkerId
    dp_rank: DpRank = 0
    router_id: str = ""


class Free(_Event, tag=True):
    """The response ended or was aborted; implies prefill completion."""

    request_id: RequestId
    worker_id: WorkerId
    dp_rank: DpRank = 0
    router_id: str = ""


class AddOutputBlock(_Event, tag=True):
    """One more decode block for a request; optionally re-weights its exclusive blocks."""

    request_id: RequestId
    worker_id: WorkerId
    dp_rank: DpRank = 0
    decay_fraction: Fraction | None = None


class WorkerAdded(_Event, tag=True):
    """A worker's authoritative data-parallel range: ranks ``dp_start .. dp_start+dp_size``.

    ``block_size`` (tokens per KV block) is the namespace's, as schedulers read it. Under the
    slot-tracker rules the first registration fixes it for every worker of the namespace (until
    the last one is removed); under the router rules the latest registration naming one sets
    it."""

    worker_id: WorkerId
    dp_start: DpRank = 0
    dp_size: DpSize = 1
    block_size: BlockSize | None = None

    def __post_init__(self) -> None:
        # Struct constructors skip Meta checks; this one invariant spans two fields.
        if self.dp_start + self.dp_size > U32_MAX:
            raise EventDecodeError(
                f"dp range {self.dp_start}+{self.dp_size} overflows u32 - at `$.dp_size`"
            )


class WorkerRemoved(_Event, tag=True):
    """Every rank of the worker goes, with its requests.

    ``final``: the worker is gone for good (its process died: Dynamo draws a new instance id at
    every start). Its requests end at once, grace or not, and the id is remembered: a late
    AddRequest for it is refused (outcome ``removed_worker``) instead of bringing its ranks
    back, until a ``WorkerAdded`` of the id. Sent only when true, so a plain removal's bytes
    are those of every build before it."""

    worker_id: WorkerId
    final: bool = False


class Tick(_Event, tag=True):
    """The log's clock moved with no traffic: gives expiry a logged time."""


class RouterHeartbeat(_Event, tag=True):
    """A router is alive. From its first heartbeat on, a router's requests belong to it: they
    are freed (outcome ``orphaned``) once it has been silent for the orphan timeout, and the
    blind age limit never expires them while it lives."""

    router_id: RouterId


class RouterGoodbye(_Event, tag=True):
    """A router stops cleanly: every request it still holds is freed now."""

    router_id: RouterId


Event = (
    AddRequest
    | MarkPrefillCompleted
    | Free
    | AddOutputBlock
    | WorkerAdded
    | WorkerRemoved
    | Tick
    | RouterHeartbeat
    | RouterGoodbye
)


class _Envelope(Struct, array_like=True, forbid_unknown_fields=True):
    """``[version, event]``, nothing after: a trailing element is refused, never skipped.

    Skipping a value is the decoder's recursive step, and its depth counts against Python's
    recursion limit with the caller's frames, so a trailing value nested deep enough decoded
    (and its event was applied) on a shallow stack and raised RecursionError on a deep one:
    a writer and a replay disagreed on the same bytes. With trailing elements and unknown
    fields refused, only the search for a map's tag still skips (see :func:`decode_event`)."""

    version: int
    event: Event


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(_Envelope)


def encode_event(event: Event) -> bytes:
    """Serialize one event (msgpack) inside the versioned envelope.

    Raises :class:`EventDecodeError` for an event no reader could decode: an integer beyond
    64 bits (msgpack's limit), named by its path as a decode error would name it.
    """
    try:
        return _encoder.encode(_Envelope(SCHEMA_VERSION, event))
    except OverflowError:
        raise EventDecodeError(_overflow(event)) from None


def _overflow(event: Event) -> str:
    for name in event.__struct_fields__:
        value = getattr(event, name)
        items = enumerate(value) if isinstance(value, list) else [(None, value)]
        for index, item in items:
            if isinstance(item, int) and not -(2**63) <= item < 2**64:
                at = f"$.{name}" if index is None else f"$.{name}[{index}]"
                return f"invalid event: {item} does not fit in 64 bits - at `{at}`"
    return "invalid event: an integer does not fit in 64 bits"


def decode_event(data: bytes | bytearray | memoryview) -> Event:
    """Decode and validate one event; any defect raises :class:`EventDecodeError`, whatever
    the bytes (a 1 KB message nested 1000 deep included), and the same defect
    whatever the caller's stack: bytes nested past :data:`~seqstate.nesting.MAX_NESTING`
    are refused for that, read without recursion (:mod:`seqstate.nesting`)."""
    try:
        envelope = _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError) as exc:  # a ValidationError is a DecodeError
        if nests_deeper(data):
            raise EventDecodeError(_TOO_DEEP) from None
        if isinstance(exc, msgspec.ValidationError):
            raise EventDecodeError(_describe(data, exc)) from None
        if isinstance(exc, msgspec.DecodeError):
            raise EventDecodeError(f"malformed event bytes: {exc}") from None
        # As shallow as an event and still out of stack: the caller is at Python's limit.
        raise EventDecodeError("malformed event bytes: the decoder ran out of stack") from None
    if envelope.version != SCHEMA_VERSION:
        raise EventDecodeError(_unsupported(envelope.version))
    return envelope.event


_TOO_DEEP: Final = f"malformed event bytes: nested deeper than {MAX_NESTING} levels"


def _describe(data: bytes | bytearray | memoryview, exc: msgspec.ValidationError) -> str:
    version = _envelope_version(bytes(data[:16]))
    if version is None:
        return f"invalid event envelope: {exc}"
    if version != SCHEMA_VERSION:
        return _unsupported(version)
    # Report paths relative to the event, not the envelope.
    return "invalid event: " + str(exc).replace("`$[1]", "`$").replace("`$.event", "`$")


# msgpack integer heads: (first byte, width in bytes, signed)
_INT_HEADS: Final = {
    0xCC: (1, False),
    0xCD: (2, False),
    0xCE: (4, False),
    0xCF: (8, False),
    0xD0: (1, True),
    0xD1: (2, True),
    0xD2: (4, True),
    0xD3: (8, True),
}
# A two-element array's head: fixarray, array 16, array 32.
_PAIR_HEADS: Final = (b"\x92", b"\xdc\x00\x02", b"\xdd\x00\x00\x00\x02")


def _envelope_version(head: bytes) -> int | None:
    """The version of ``[version, anything]`` read from its first bytes, or None.

    Read by hand, never by a decoder: decoding the pair (even as ``msgspec.Raw``) would walk
    the second element, as deep as it nests (a decoder's recursion)."""
    for pair in _PAIR_HEADS:
        if head.startswith(pair):
            rest = head[len(pair) :]
            break
    else:
        return None
    if not rest:
        return None
    first = rest[0]
    if first <= 0x7F:
        return first
    if first >= 0xE0:
        return first - 0x100
    width_signed = _INT_HEADS.get(first)
    if width_signed is None or len(rest) < 1 + width_signed[0]:
        return None
    width, signed = width_signed
    return int.from_bytes(rest[1 : 1 + width], "big", signed=signed)


def _unsupported(version: int) -> str:
    return f"unsupported schema version {version} (this build reads {SCHEMA_VERSION})"
