"""What the projector writes into the registry bucket, and how the keys are named.

One module owns the bucket's layout so the projector (writer of the bucket) and the
RegistryView (reader) cannot drift apart:

- ``<ns>.load.<worker_id>.<dp_rank>``: JSON, readable with ``nats kv get``: the rank's
  time-free load (the prefill part keeps its anchor in log time, decay is evaluated by the
  reader), stamped with the sequence and log time of the event that last changed it.
- ``<ns>.blocks.<worker_id>.<dp_rank>``: msgpack ``{"applied_seq", "hashes"}``, the hashes being
  the sorted active prompt-block hashes packed as little-endian u64 (8 bytes each; a msgpack
  list of random u64s would take 9, and decoding the packed form is one C call), stamped alike.
  Stamps come from the deltas, never from flush timing, so the bucket's bytes are a pure
  function of the log: a projector that crashed and resumed writes what an uninterrupted one
  writes.
- ``<ns>.position``: JSON ``{"applied_seq", "as_of", "delta_seq"}``, written after every flush
  once the flush's other keys are acknowledged. Because a KV watch delivers in stream order, a
  reader that sees position ``n`` already holds every value that reflects ``n``: that is what
  ``RegistryView.wait_for(n)`` waits on. ``delta_seq`` lets a restarted projector resume.
- ``<ns>.lease``: JSON, who may write the namespace's keys (see :mod:`projector.lease`). Not
  part of the read model: readers skip it, and its bytes differ from run to run.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

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
                p.full_tokens, p.anchor_tokens, p.anchor_duration_ns, p.anchored_since_ns,
                p.modeled_ms,
            ),
        )  # fmt: skip


class BlocksValue(msgspec.Struct, frozen=True):
    applied_seq: int
    hashes: bytes


class Position(msgspec.Struct, frozen=True):
    applied_seq: int
    as_of: int
    delta_seq: int


_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()
_load_decoder = msgspec.json.Decoder(LoadValue)
_blocks_decoder = msgspec.msgpack.Decoder(BlocksValue)
_position_decoder = msgspec.json.Decoder(Position)
_BIG_ENDIAN = sys.byteorder == "big"


def load_key(namespace: str, rank: Rank) -> str:
    return f"{namespace}.load.{rank[0]}.{rank[1]}"


def blocks_key(namespace: str, rank: Rank) -> str:
    return f"{namespace}.blocks.{rank[0]}.{rank[1]}"


def position_key(namespace: str) -> str:
    return f"{namespace}.position"


def lease_key(namespace: str) -> str:
    return f"{namespace}.lease"


def parse_key(namespace: str, key: str) -> tuple[str, Rank | None]:
    """``("load", rank)``, ``("blocks", rank)``, ``("position", None)`` or ``("lease", None)``;
    else ``("", None)``."""
    parts = key.split(".")
    if len(parts) == 2 and parts[0] == namespace and parts[1] in ("position", "lease"):
        return parts[1], None
    if len(parts) == 4 and parts[0] == namespace and parts[1] in ("load", "blocks"):
        try:
            return parts[1], (int(parts[2]), int(parts[3]))
        except ValueError:
            return "", None
    return "", None


def encode_load(rank: Rank, load: RankLoad, applied_seq: int, as_of: int) -> bytes:
    p = load.prefill
    return _json.encode(
        LoadValue(
            rank[0], rank[1], load.active_blocks, load.active_requests,
            PrefillValue(p.full_tokens, p.anchor_tokens, p.anchor_duration_ns,
                         p.anchored_since_ns, p.modeled_ms),
            applied_seq, as_of,
        )
    )  # fmt: skip


def decode_load(data: bytes) -> LoadValue:
    return _load_decoder.decode(data)


def encode_blocks(hashes: Iterable[int], applied_seq: int) -> bytes:
    packed = array("Q", sorted(hashes))
    if _BIG_ENDIAN:
        packed.byteswap()
    return _msgpack.encode(BlocksValue(applied_seq, packed.tobytes()))


def decode_blocks(data: bytes) -> tuple[int, array[int]]:
    """``(applied_seq, hashes)``; raises ``msgspec.DecodeError`` or ``ValueError`` if damaged."""
    value = _blocks_decoder.decode(data)
    hashes = array("Q")
    hashes.frombytes(value.hashes)  # ValueError unless a multiple of 8 bytes
    if _BIG_ENDIAN:
        hashes.byteswap()
    return value.applied_seq, hashes


def encode_position(position: Position) -> bytes:
    return _json.encode(position)


def decode_position(data: bytes) -> Position:
    return _position_decoder.decode(data)
