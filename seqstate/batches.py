"""Record batches: many events in one stored message of the events stream.

A router that books a burst pays one publish, one acknowledgement and one stored message per
*message*, not per event; the fold still decides each event of a batch on its own
(:meth:`seqstate.fold.Fold.__call__`), in order, as if each had been a message of its own at
the batch's stream sequence and log time.

The bytes of a batch::

    MAGIC (4 bytes: 0xC1 's' 'q' 'b')  VERSION (1 byte)  msgpack array of bin

Each ``bin`` is one event's own bytes, exactly as :func:`seqstate.events.encode_event` writes
a single event (the ``[schema_version, event]`` envelope), so an event reads alike alone or in
a batch, and a dead letter of one event of a batch carries its own bytes.

Why a magic and not a header: the fold, replay and every tool see only ``(seq, log time,
subject, payload)``, and a header is not part of the payload. Why ``0xC1``: it is the one
byte msgpack never uses, so no seqstate event (a msgpack array, ``0x92``) and no Dynamo
message (a msgpack map) starts with it, and a log written before batches existed holds none
but a payload no fold ever decoded. The version byte lets a later layout be told apart
before any of it is read; this build reads :data:`VERSION` and refuses the others whole.

Bounded: at most :data:`MAX_EVENTS` events and :data:`MAX_BYTES` bytes; the count is read
from the array's head before anything is decoded. A batch over a bound, empty, of another
version, or not framed as above is refused whole (:class:`BatchDecodeError`); each event of
a well-framed batch is then the fold's to decide, and a poison event is refused alone.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Final

import msgspec

from seqstate.errors import SeqstateError
from seqstate.events import Event, EventDecodeError, encode_event

MAGIC: Final = b"\xc1sqb"
HEAD: Final = MAGIC[:1]  # what a batch starts with, and no event or Dynamo message does
VERSION: Final = 1
MAX_EVENTS: Final = 1024
# A batch's bytes, at most: more than nats-server's default message (1 MiB) holds, under the
# largest it can be configured to (64 MiB). The events stream's own limit is the server's.
MAX_BYTES: Final = 8 * 1024 * 1024
_PREFIX: Final = MAGIC + bytes([VERSION])
_BODY: Final = len(_PREFIX)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(list[bytes])


class BatchDecodeError(EventDecodeError):
    """A message that starts as a batch and cannot be read as one: refused whole."""


class BatchTooLarge(BatchDecodeError):
    """A batch over :data:`MAX_EVENTS` events or :data:`MAX_BYTES` bytes."""


class BatchUnfit(SeqstateError, ValueError):
    """What a publisher asked to batch is over a bound (its events or their bytes)."""


def is_batch(payload: bytes | bytearray | memoryview) -> bool:
    """Whether ``payload`` is framed as a record batch (of any version)."""
    return payload[:1] == HEAD and bytes(payload[:4]) == MAGIC


def encode_batch(events: Iterable[Event]) -> bytes:
    """The batch of ``events``, in order; raises :class:`BatchUnfit` over a bound."""
    return encode_batch_of([encode_event(event) for event in events])


def encode_batch_of(payloads: list[bytes]) -> bytes:
    """The batch of events already encoded (each :func:`~seqstate.events.encode_event`'s
    bytes); raises :class:`BatchUnfit` over a bound, or for none."""
    if not payloads:
        raise BatchUnfit("a record batch holds at least one event")
    if len(payloads) > MAX_EVENTS:
        raise BatchUnfit(f"{len(payloads)} events: a record batch holds at most {MAX_EVENTS}")
    data = _PREFIX + _encoder.encode(payloads)
    if len(data) > MAX_BYTES:
        raise BatchUnfit(
            f"{len(payloads)} events of {len(data):,} bytes: a record batch holds at most "
            f"{MAX_BYTES:,}"
        )
    return data


def batch_size(count: int, event_bytes: int) -> int:
    """The bytes of a batch of ``count`` events of ``event_bytes`` bytes in all (an upper
    bound of at most 8 bytes: the array's and each bin's head take their largest form)."""
    return _BODY + 5 + event_bytes + 5 * count


def decode_batch(payload: bytes | bytearray | memoryview) -> list[bytes]:
    """The events' bytes of a batch, in order (each still to be decoded and decided).

    Raises :class:`BatchTooLarge` over a bound, :class:`BatchDecodeError` for anything else
    that is not a batch of this version with at least one event. Never anything else."""
    if bytes(payload[:4]) != MAGIC:
        raise BatchDecodeError("not a record batch: no batch magic")
    if len(payload) > MAX_BYTES:
        raise BatchTooLarge(
            f"refused: a record batch of {len(payload):,} bytes (at most {MAX_BYTES:,})"
        )
    if len(payload) < _BODY + 1:
        raise BatchDecodeError("malformed record batch: it ends after its head")
    version = payload[4]
    if version != VERSION:
        raise BatchDecodeError(
            f"unsupported record batch version {version} (this build reads {VERSION})"
        )
    count = _count(bytes(payload[_BODY : _BODY + 5]))
    if count is None:
        raise BatchDecodeError("malformed record batch: its body is not an array of events")
    if count == 0:
        raise BatchDecodeError("malformed record batch: it holds no event")
    if count > MAX_EVENTS:
        raise BatchTooLarge(f"refused: a record batch of {count:,} events (at most {MAX_EVENTS})")
    try:
        return _decoder.decode(memoryview(payload)[_BODY:])
    except (msgspec.DecodeError, RecursionError) as exc:  # no nesting: an item is bin or wrong
        raise BatchDecodeError(f"malformed record batch: {exc}") from None


def items_of(payload: bytes) -> list[bytes]:
    """What a stored message holds, one bytes per event or Dynamo message: a batch's items,
    else the payload itself. Raises :class:`BatchDecodeError` for a batch that is none."""
    return decode_batch(payload) if is_batch(payload) else [payload]


def _count(head: bytes) -> int | None:
    """The length of the msgpack array ``head`` opens (fixarray, array 16, array 32)."""
    if not head:
        return None
    first = head[0]
    if 0x90 <= first <= 0x9F:
        return first - 0x90
    if first == 0xDC and len(head) >= 3:
        return int.from_bytes(head[1:3], "big")
    if first == 0xDD and len(head) >= 5:
        return int.from_bytes(head[1:5], "big")
    return None
