"""DELTAS messages as the projector reads them: each booking's block hashes packed at once.

The projector never uses a booking's hashes as numbers: it packs them into its slot's value
(little-endian u64, :func:`projector.wire.values.pack_hashes`). Decoded as a list, a prompt of
136 hashes cost 136 int objects, a min and a max to check their range, and an ``array`` to
pack them again; that was the largest part of the projector's cost per delta. So the decoder
leaves the hashes the msgpack they came as (``msgspec.Raw``), and :func:`read_deltas`
packs them straight from it: a writer's encoder writes a u64 hash as ``0xcf`` and 8
big-endian bytes, so a list of them is a fixed stride; deleting every ninth byte and
reversing each 8 leaves the packed form, in a few C calls and with no object per hash, and
every one of them is a u64. A booking's hashes are then ``bytes``, packed (a core delta's
are never bytes); in any other encoding (small numbers, a negative one), the list the core's
reader decodes, checked and packed as before.

The decoder also checks the range of every other number a writer's deltas carry (worker ids,
dp ranks, slots), in C as it reads them: the projector's plausibility check then has nothing
left to look at (it walked every delta's ranks and slots in Python).

What a message means, and what is refused, do not change: :func:`read_deltas` takes the
messages :func:`seqstate.decode_deltas` takes and raises, for any other, the error that
function raises (it is called for the message then, so the reason reads the same); a message
with a number out of range is read by it, and the plausibility check refuses it as before.
"""

from __future__ import annotations

from array import array
from typing import Annotated, NamedTuple

import msgspec

from projector.wire.values import pack_hashes
from seqstate import Delta, decode_deltas
from seqstate.deltas import Booking, RankChange

_U64_HEAD = 0xCF  # msgpack's uint 64: a head byte, then 8 bytes big-endian
_STRIDE = 9
_U64 = 2**64

# The numbers' ranges as the events carry them (a worker id, a slot: u64; a dp rank: u32),
# checked by the decoder as it reads them. msgpack carries no integer past 2**64 - 1.
U64 = Annotated[int, msgspec.Meta(ge=0)]
U32 = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
RawRank = tuple[U64, U32]


class RawBooking(Booking):
    """A :class:`~seqstate.deltas.Booking` as decoded: its ``hashes`` their msgpack bytes,
    until :func:`read_deltas` puts them there packed (or their list)."""

    slot: U64
    hashes: msgspec.Raw  # type: ignore[assignment]


class RawRankChange(RankChange):
    rank: RawRank
    released: list[U64] = msgspec.field(default_factory=list)
    booked: list[RawBooking] = msgspec.field(default_factory=list)  # type: ignore[assignment]


class RawDelta(Delta):
    """A :class:`~seqstate.deltas.Delta` as the projector reads it (see the module doc)."""

    changes: list[RawRankChange] = msgspec.field(default_factory=list)  # type: ignore[assignment]
    added_ranks: list[RawRank] = msgspec.field(default_factory=list)
    removed_ranks: list[RawRank] = msgspec.field(default_factory=list)


Hashes = list[int] | bytes  # bytes: packed, every one a u64


class DeltaMessage(NamedTuple):
    """A DELTAS message's deltas, and whether every number in them is in the range a writer's
    are (as :meth:`~projector.bucket.image.BucketImage.refusal` checks them): then that check
    has nothing to say, and is not run."""

    deltas: list[Delta]
    in_range: bool


_decoder = msgspec.msgpack.Decoder(list[RawDelta])
_hashes_decoder = msgspec.msgpack.Decoder(list[int])


def read_deltas(data: bytes) -> DeltaMessage:
    """The deltas of a DELTAS message, each booking's hashes packed (or, in another encoding
    than the writer's, a list); raises ``msgspec.DecodeError`` for exactly the messages
    :func:`seqstate.decode_deltas` refuses, with its reason."""
    try:
        deltas = _decoder.decode(data)
    except (msgspec.DecodeError, RecursionError):
        # The core reader's own error for this message; or, when it reads it, a number out of
        # a writer's range, which the plausibility check names: the deltas as it reads them.
        return DeltaMessage(decode_deltas(data), False)
    in_range = True
    for delta in deltas:
        for change in delta.changes:
            for booking in change.booked:
                raw = booking.hashes
                hashes: Hashes | None = _packed(raw)
                if hashes is None:  # not the writer's form: as the core decodes them
                    try:
                        hashes = _hashes_decoder.decode(raw)
                    except (msgspec.DecodeError, RecursionError):
                        decode_deltas(data)  # raises the core reader's error for the message
                        raise  # (never reached: it refuses what this refuses)
                    in_range = False  # a list: the check looks at it
                booking.hashes = hashes  # type: ignore[assignment]
    return DeltaMessage(deltas, in_range)  # type: ignore[arg-type]


def _packed(raw: msgspec.Raw) -> bytes | None:
    """The msgpack array ``raw`` of ``0xcf`` u64s only, packed; None for any other bytes."""
    data = bytearray(raw)
    head = data[0] if data else 0
    if 0x90 <= head <= 0x9F:
        count, start = head - 0x90, 1
    elif head == 0xDC:
        count, start = int.from_bytes(data[1:3], "big"), 3
    elif head == 0xDD:
        count, start = int.from_bytes(data[1:5], "big"), 5
    else:
        return None
    if len(data) - start != _STRIDE * count or data[start::_STRIDE].count(_U64_HEAD) != count:
        return None
    del data[start::_STRIDE]  # each hash's head: its 8 bytes big-endian remain, back to back
    del data[:start]
    hashes = array("Q")
    hashes.frombytes(data)
    hashes.byteswap()  # each one's 8 bytes reversed: little-endian, on any machine
    return hashes.tobytes()


def packed(hashes: Hashes) -> bytes:
    """A booking's hashes (a list, or bytes packed already) as
    :func:`~projector.wire.values.pack_hashes` packs them."""
    return hashes if type(hashes) is bytes else pack_hashes(hashes)  # type: ignore[arg-type]


def all_u64(hashes: Hashes) -> bool:
    """Whether every hash is a u64 (a list's checked; packed ones are)."""
    if type(hashes) is bytes or not hashes:
        return True
    return min(hashes) >= 0 and max(hashes) < _U64
