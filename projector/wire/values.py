"""What the projector writes into the registry bucket, and how the keys are named.

One module owns the bucket's layout so the projector (writer of the bucket) and the
RegistryView (reader) cannot drift apart:

- ``<ns>.load.<worker_id>.<dp_rank>``: JSON, readable with ``nats kv get``: the rank's
  time-free load (the prefill part keeps its anchor in log time, decay is evaluated by the
  reader), stamped with the sequence and log time of the event that last changed it.
- ``<ns>.req.<worker_id>.<dp_rank>.<slot>``: msgpack ``{"applied_seq", "request_id",
  "hashes"}``, one live request of the rank: the prompt-block hashes it holds, in prompt order,
  packed as little-endian u64 (8 bytes each; a msgpack list of random u64s would take 9, and
  decoding the packed form is one C call). The slot is the request's slot in the write model
  (the lowest free one of its rank when it was booked), so keys are reused: a rank has as many
  slot keys as it ever had requests in flight at once, not one per request it ever served,
  and a free slot holds the empty value (an empty msgpack map, ``EMPTY_SLOT``: no stamp, so a
  slot freed again is no write at all when the bucket already holds it) instead of leaving a
  delete marker per request in the bucket's stream. A booking writes one key of the size of
  its prompt, a free writes one small value: the cost of an event follows what it changed.
  A reader reference-counts each rank's hashes over its slots.
- Stamps come from the deltas, never from flush timing, so the bucket's bytes are a pure
  function of the log: a projector that crashed and resumed writes what an uninterrupted one
  writes.
- ``<ns>.position``: JSON ``{"applied_seq", "as_of", "delta_seq"}``, written after every flush
  once the flush's other keys are acknowledged. Because a KV watch delivers in stream order, a
  reader that sees position ``n`` already holds every value that reflects ``n``: that is what
  ``RegistryView.wait_for(n)`` waits on. ``delta_seq`` lets a restarted projector resume.
- ``<ns>.lease``: JSON, who may write the namespace's keys (see :mod:`projector.nats.lease`). Not
  part of the read model: readers skip it, and its bytes differ from run to run.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any, NamedTuple

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
    """One slot: the request it holds, stamped with the event that booked it; or none."""

    applied_seq: int = 0
    request_id: str = ""
    hashes: bytes = b""

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
    """A parsed bucket key: ``kind`` is "load", "req", "position", "lease", "tracker", or ""
    (not ours)."""

    kind: str
    rank: Rank | None = None
    slot: int = -1


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


def encode_request(applied_seq: int, request_id: str, hashes: list[int]) -> bytes:
    """A booked slot's value."""
    return _msgpack.encode(RequestValue(applied_seq, request_id, pack_hashes(hashes)))


EMPTY_SLOT = _msgpack.encode(RequestValue())  # a free slot's value


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
