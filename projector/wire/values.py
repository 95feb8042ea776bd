"""What the projector writes into the registry bucket, and how the keys are named.

One module owns the bucket's layout so the projector (writer of the bucket) and the
RegistryView (reader) cannot drift apart:

- ``<ns>.load.<worker_id>.<dp_rank>``: JSON, readable with ``nats kv get``: the rank's
  time-free load (the prefill part keeps its anchor in log time, decay is evaluated by the
  reader), stamped with the sequence and log time of the event that last changed it.
- ``<ns>.req.<worker_id>.<dp_rank>.<slot>``: msgpack ``{"applied_seq", "request_id",
  "hashes", "parts"}``, one live request of the rank: the prompt-block hashes it holds (the
  first 4,096 of a long prompt, whose rest is in ``parts`` part keys), in prompt order,
  packed as little-endian u64 (8 bytes each; a msgpack list of random u64s would take 9, and
  decoding the packed form is one C call). The slot is the request's slot in the write model
  (the lowest free one of its rank when it was booked), so keys are reused: a rank has as many
  slot keys as it ever had requests in flight at once, not one per request it ever served,
  and a free slot holds the empty value (an empty msgpack map, ``EMPTY_SLOT``: no stamp, so a
  slot freed again is no write at all when the bucket already holds it) instead of leaving a
  delete marker per request in the bucket's stream. A booking writes the keys of its prompt
  (one but for a long one), a free one small value each: the cost of an event follows what
  it changed. A reader reference-counts each rank's hashes over its slots.
- ``<ns>.req.<worker_id>.<dp_rank>.<slot>.<part>`` (part 1, 2, ...): the rest of a long
  prompt. A key holds at most ``KEY_HASHES`` (4,096) hashes, 32 KiB: a head holds the first
  4,096 and its number of parts (``"parts"``, left out when 0, so a prompt of up to 4,096
  blocks is one key, as before parts existed), each part the next 4,096, as msgpack
  ``{"applied_seq", "hashes"}`` stamped like its head. A head whose request id takes more than
  ``ID_ROOM`` bytes holds no hash (the id alone may be as large as its event). So no value
  is larger than 36 KiB or its event, whatever the server: the chunking is fixed, never
  derived from a server's limit, so the bucket's bytes stay a pure function of the log. A
  part whose request ended, or whose slot took a shorter one, holds the empty value, as a
  free slot does; a removed rank's part keys are deleted with its slots.
- Torn reads: the projector writes a slot's parts before its head, and the position after
  both, so a reader that sees position ``n`` holds every part of every head reflecting ``n``;
  between two positions it may see a head with parts of another booking (told apart by the
  stamp) or an emptied part under a head not yet emptied.
- Stamps come from the deltas, never from flush timing, so the bucket's bytes are a pure
  function of the log: a projector that crashed and resumed writes what an uninterrupted one
  writes.
- ``<ns>.position``: JSON ``{"applied_seq", "as_of", "delta_seq"}``, written after every flush
  once the flush's other keys are acknowledged. Because a KV watch delivers in stream order, a
  reader that sees position ``n`` already holds every value that reflects ``n``: that is what
  ``RegistryView.wait_for(n)`` waits on. ``delta_seq`` lets a restarted projector resume.
- ``<ns>.lease``: JSON, who may write the namespace's keys (see :mod:`projector.nats.lease`). Not
  part of the read model: readers skip it, and its bytes differ from run to run. A projector's
  renewals (every second) also carry its last lag measurement (``"heartbeat"``, a
  :class:`Heartbeat`): the one value a reader with access to the bucket alone can tell an idle
  current view from a stalled one by.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, Final, NamedTuple

import msgspec

from seqstate import PrefillSnapshot, RankLoad

Rank = tuple[int, int]


class PrefillValue(msgspec.Struct, frozen=True):
    full_tokens: int = 0
    anchor_tokens: int = 0
    anchor_duration_ns: int | None = None
    anchored_since_ns: int | None = None
    modeled_ms: int | None = 0


class LoadValue(msgspec.Struct, frozen=True):
    worker_id: int
    dp_rank: int
    active_blocks: int
    active_requests: int
    prefill: PrefillValue
    applied_seq: int
    as_of: int  # log time (ns since the epoch) of the event that last changed this value

    def rank_load(self) -> RankLoad:
        p = self.prefill
        return RankLoad(
            self.active_blocks,
            self.active_requests,
            PrefillSnapshot(
                p.full_tokens,
                p.anchor_tokens,
                p.anchor_duration_ns,
                p.anchored_since_ns,
                p.modeled_ms,
            ),
        )


class RequestValue(msgspec.Struct, frozen=True, omit_defaults=True):
    """One slot: the request it holds, stamped with the event that booked it; or none. Also
    the value of a part key (no ``request_id``, no ``parts``: its head has them)."""

    applied_seq: int = 0
    request_id: str = ""
    hashes: bytes = b""
    parts: int = 0  # a head's part keys holding the rest of its hashes

    @property
    def empty(self) -> bool:
        return not self.request_id and not self.hashes

    def hash_list(self) -> list[int]:
        """The packed hashes as ints; raises ``ValueError`` unless a multiple of 8 bytes."""
        return unpack_hashes(self.hashes)


class Position(msgspec.Struct, frozen=True):
    applied_seq: int
    as_of: int
    delta_seq: int


class Heartbeat(msgspec.Struct, frozen=True):
    """The projector's last lag measurement (:class:`projector.nats.lag.Lag`), as its lease
    renewals carry it: what the bucket lacked of the log then."""

    head: int  # the namespace's newest logged event when measured
    behind: int  # events logged (or captured) that the bucket did not reflect then
    captured: int  # of those, Dynamo messages captured, not in the events stream yet (no seq)
    oldest_ns: int | None  # log time of the oldest of them (None: none)
    ago_s: float  # how long before this renewal the measurement was taken


_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()
_load_decoder = msgspec.json.Decoder(LoadValue)
_request_decoder = msgspec.msgpack.Decoder(RequestValue)
_position_decoder = msgspec.json.Decoder(Position)
_BIG_ENDIAN = sys.byteorder == "big"


def _decoded(decoder: Any, data: bytes) -> Any:
    """``decoder.decode(data)``; a value nested past the recursion limit (in a field this
    build skips) is a ``msgspec.DecodeError`` as any other bad value, never a crash."""
    try:
        return decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError("malformed value: nested too deeply") from None


def load_key(namespace: str, rank: Rank) -> str:
    return f"{namespace}.load.{rank[0]}.{rank[1]}"


def slot_key(namespace: str, rank: Rank, slot: int) -> str:
    return f"{namespace}.req.{rank[0]}.{rank[1]}.{slot}"


def part_key(namespace: str, rank: Rank, slot: int, part: int) -> str:
    """Part ``part`` (1, 2, ...) of the request in ``slot``: the rest of a long prompt."""
    return f"{namespace}.req.{rank[0]}.{rank[1]}.{slot}.{part}"


def position_key(namespace: str) -> str:
    return f"{namespace}.position"


def lease_key(namespace: str) -> str:
    return f"{namespace}.lease"


def tracker_key(namespace: str) -> str:
    """The slot-tracker rules' per-namespace value: the block size its workers share."""
    return f"{namespace}.tracker"


class TrackerValue(msgspec.Struct, frozen=True):
    block_size: int


_tracker_decoder = msgspec.json.Decoder(TrackerValue)


def encode_tracker(block_size: int) -> bytes:
    return _json.encode(TrackerValue(block_size))


def decode_tracker(data: bytes) -> TrackerValue:
    return _decoded(_tracker_decoder, data)


class Key(NamedTuple):
    """A parsed bucket key: ``kind`` is "load", "req" (a slot's head), "part" (a slot's part
    ``part``), "position", "lease", "tracker", or "" (not ours)."""

    kind: str
    rank: Rank | None = None
    slot: int = -1
    part: int = 0


NOT_OURS = Key("")


def parse_key(namespace: str, key: str) -> Key:
    parts = key.split(".")
    if len(parts) < 2 or parts[0] != namespace:
        return NOT_OURS
    kind = parts[1]
    try:
        if len(parts) == 2 and kind in ("position", "lease", "tracker"):
            return Key(kind)
        if len(parts) == 4 and kind == "load":
            return Key(kind, (int(parts[2]), int(parts[3])))
        if len(parts) == 5 and kind == "req":
            slot = int(parts[4])
            if slot >= 0:
                return Key(kind, (int(parts[2]), int(parts[3])), slot)
        if len(parts) == 6 and kind == "req":
            slot, part = int(parts[4]), int(parts[5])
            if slot >= 0 and 0 < part <= MAX_PART:
                return Key("part", (int(parts[2]), int(parts[3])), slot, part)
    except ValueError:
        pass
    return NOT_OURS


def encode_load(rank: Rank, load: RankLoad, applied_seq: int, as_of: int) -> bytes:
    p = load.prefill
    return _json.encode(
        LoadValue(
            rank[0],
            rank[1],
            load.active_blocks,
            load.active_requests,
            PrefillValue(
                p.full_tokens,
                p.anchor_tokens,
                p.anchor_duration_ns,
                p.anchored_since_ns,
                p.modeled_ms,
            ),
            applied_seq,
            as_of,
        )
    )


def decode_load(data: bytes) -> LoadValue:
    return _decoded(_load_decoder, data)


def pack_hashes(hashes: list[int]) -> bytes:
    packed = array("Q", hashes)
    if _BIG_ENDIAN:
        packed.byteswap()
    return packed.tobytes()


def unpack_hashes(data: bytes) -> list[int]:
    hashes = array("Q")
    hashes.frombytes(data)  # ValueError unless a multiple of 8 bytes
    if _BIG_ENDIAN:
        hashes.byteswap()
    return hashes.tolist()


# Hashes a key holds at most (32 KiB packed): a prompt of up to 4,096 blocks (64K tokens of
# 16) is one key. Fixed: the bucket's bytes are a pure function of the log, on any server.
KEY_HASHES: Final = 4096
# The longest request id (UTF-8 bytes) whose head also holds hashes: a head is then at most
# about 36 KiB; a longer id's head holds none, and is no larger than its event.
ID_ROOM: Final = 4096
MAX_PART: Final = 2**32 - 1  # no event holds enough hashes to come near


def encode_request(applied_seq: int, request_id: str, hashes: list[int]) -> bytes:
    """A booked slot's value, all in one key: what the projector writes for a prompt of at
    most ``KEY_HASHES`` hashes (see :func:`request_values`)."""
    return _msgpack.encode(RequestValue(applied_seq, request_id, pack_hashes(hashes)))


def request_values(applied_seq: int, request_id: str, packed: bytes) -> list[bytes]:
    """A booked slot's values, from its hashes packed (:func:`pack_hashes`): its head's, then
    each part's (none for a prompt that fits one key). Deterministic: the same booking gives
    the same bytes on any server."""
    # At most 4 UTF-8 bytes a character: most ids are known short without being encoded.
    short = len(request_id) <= ID_ROOM // 4 or len(request_id.encode()) <= ID_ROOM
    first = 8 * KEY_HASHES if short else 0
    if len(packed) <= first:
        return [_msgpack.encode(RequestValue(applied_seq, request_id, packed))]
    key_bytes = 8 * KEY_HASHES
    parts = -(-(len(packed) - first) // key_bytes)
    values = [_msgpack.encode(RequestValue(applied_seq, request_id, packed[:first], parts))]
    for start in range(first, len(packed), key_bytes):
        chunk = packed[start : start + key_bytes]
        values.append(_msgpack.encode(RequestValue(applied_seq, hashes=chunk)))
    return values


EMPTY_SLOT = _msgpack.encode(RequestValue())  # a free slot's value, and an emptied part's
# The largest value a key of a slot may take, but for a head whose id is over ID_ROOM (which is
# no larger than its event): a server whose max_payload is smaller cannot hold the bucket.
LARGEST_VALUE: Final = len(
    _msgpack.encode(RequestValue(2**64 - 1, "i" * ID_ROOM, bytes(8 * KEY_HASHES), MAX_PART))
)


def decode_request(data: bytes) -> RequestValue:
    """Raises ``msgspec.DecodeError`` or ``ValueError`` if damaged."""
    value = _decoded(_request_decoder, data)
    if len(value.hashes) % 8:
        raise ValueError(f"packed hashes of {len(value.hashes)} bytes, not a multiple of 8")
    return value


def encode_position(position: Position) -> bytes:
    return _json.encode(position)


def decode_position(data: bytes) -> Position:
    return _decoded(_position_decoder, data)
