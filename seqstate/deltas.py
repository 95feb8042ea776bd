"""What one applied event changed: the writer's message to the read model.

A :class:`Delta` is everything :class:`~seqstate.registry.PromptRegistry` needs to follow the
write model, and nothing it could not get over the wire: topology changes, and per rank the
prompt hashes that became absent or present plus the rank's new time-free load. The registry
is updated only from deltas, so the projector that receives them over NATS and the in-process
registry compute the same read model.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec
from msgspec import Struct

from seqstate.loads import RankLoad

Outcome = Literal["applied", "duplicate", "unknown_request", "unknown_worker", "superseded"]
OUTCOMES: Final = ("applied", "duplicate", "unknown_request", "unknown_worker", "superseded")

APPLIED: Final = "applied"
DUPLICATE: Final = "duplicate"
UNKNOWN_REQUEST: Final = "unknown_request"
UNKNOWN_WORKER: Final = "unknown_worker"
SUPERSEDED: Final = "superseded"


class RankChange(Struct, array_like=True, gc=False):
    """One rank's change: drop ``removed`` first, then add ``stored``, then take ``load``.

    Removes come first because an add can expire an older request holding the same prefix
    in the same step; applying in this order leaves the prefix present.
    """

    rank: tuple[int, int]
    load: RankLoad
    removed: list[int] = []
    stored: list[int] = []

    @property
    def worker_id(self) -> int:
        return self.rank[0]

    @property
    def dp_rank(self) -> int:
        return self.rank[1]


class Delta(Struct, omit_defaults=True):
    """What ``SequenceState.apply`` did; ``seq`` is the source stream sequence (writer-set)."""

    outcome: Outcome
    at_ns: int
    changes: list[RankChange] = []
    added_ranks: list[tuple[int, int]] = []
    removed_ranks: list[tuple[int, int]] = []
    expired: list[str] = []
    seq: int | None = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Delta)


def encode_delta(delta: Delta) -> bytes:
    return _encoder.encode(delta)


def decode_delta(data: bytes | bytearray | memoryview) -> Delta:
    return _decoder.decode(data)


_batch_decoder = msgspec.msgpack.Decoder(list[Delta])


def encode_deltas(deltas: list[Delta]) -> bytes:
    """Several deltas in one message: the writer batches what it folds back to back."""
    return _encoder.encode(deltas)


def decode_deltas(data: bytes | bytearray | memoryview) -> list[Delta]:
    return _batch_decoder.decode(data)
