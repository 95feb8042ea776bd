"""What one applied event changed: the writer's message to the read model.

A :class:`Delta` is everything :class:`~seqstate.registry.PromptRegistry` needs to follow the
write model, and nothing it could not get over the wire: topology changes, and per rank the
requests booked (with their prompt hashes) and released (by slot), plus the rank's new
time-free load. A delta is as large as what its event changed, never as large as the rank's
active set: an AddRequest carries its own prompt once, a Free or an expiry names slots, and a
removed rank is one entry. The registry is updated only from deltas, so the projector that
receives them over NATS and the in-process registry compute the same read model.

Each live request holds a *slot* of its rank: a small integer, the lowest free one when it was
booked (see :class:`~seqstate.sequences.ActiveSequences`). Slots are part of the write model,
so they are a pure function of the log; the projector names its per-request bucket keys by
them, and a Free or an expiry only has to name the slot.

The events of a record batch (:mod:`seqstate.batches`) share their message's ``seq``: their
deltas are numbered by :func:`as_parts` as the parts of one delta, so everything keyed by a
stored message's sequence (the delta chain, the projector's position) holds as it is.

A delta too large for one message (an expiry that releases very many requests) is cut by
:func:`split_delta` into *parts*: consecutive deltas with the same ``seq``, numbered by
``part``, all but the last flagged ``more``. Applied in order they change exactly what the whole
delta changes; a reader treats event ``seq`` as reflected once its last part is applied.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec
from msgspec import Struct

from seqstate.errors import SeqstateError
from seqstate.loads import RankLoad

# The largest integer msgpack carries, so the largest any delta or snapshot may hold: a count
# that could grow past it (by amounts the input chooses) saturates here instead.
U64_MAX: Final = 2**64 - 1

Outcome = Literal[
    "applied",
    "duplicate",
    "unknown_request",
    "unknown_worker",
    "superseded",
    "no_tracker",
    "worker_exists",
    "block_size_mismatch",
    "echo",
    "removed_worker",
]
OUTCOMES: Final = (
    "applied",
    "duplicate",
    "unknown_request",
    "unknown_worker",
    "superseded",
    # Only in the slot-tracker rules (``SequenceState(slot_tracker=True)``), Dynamo's:
    "no_tracker",  # a request event while no worker is registered
    "worker_exists",  # a WorkerAdded for a registered worker: it keeps its range
    "block_size_mismatch",  # a WorkerAdded naming another block size than the tracker's
    # A Dynamo message seqstate republished itself (a resync, under its own publisher id):
    # the fold takes it and changes nothing, since the requests it names are the ledger's.
    "echo",
    # An AddRequest for a worker removed for good (WorkerRemoved with ``final``): refused,
    # so a late message cannot bring a dead worker's ranks back.
    "removed_worker",
)

APPLIED: Final = "applied"
DUPLICATE: Final = "duplicate"
UNKNOWN_REQUEST: Final = "unknown_request"
UNKNOWN_WORKER: Final = "unknown_worker"
SUPERSEDED: Final = "superseded"
NO_TRACKER: Final = "no_tracker"
TRACKER_ENDED: Final = 0  # Delta.block_size of the removal that ends a tracker
WORKER_EXISTS: Final = "worker_exists"
BLOCK_SIZE_MISMATCH: Final = "block_size_mismatch"
ECHO: Final = "echo"
REMOVED_WORKER: Final = "removed_worker"


class Booking(Struct, array_like=True, gc=False):
    """A request booked on a rank: its slot, its id, and the prompt hashes it holds."""

    slot: int
    request_id: str
    hashes: list[int]


class RankChange(Struct, array_like=True, gc=False):
    """One rank's change: free the ``released`` slots first, then take ``booked``, then
    ``load``.

    Releases come first because an add can expire an older request (perhaps holding the same
    prefix, perhaps the slot the add then takes) in the same step.
    """

    rank: tuple[int, int]
    load: RankLoad
    released: list[int] = []
    booked: list[Booking] = []

    @property
    def worker_id(self) -> int:
        return self.rank[0]

    @property
    def dp_rank(self) -> int:
        return self.rank[1]


class Hole(Struct, array_like=True, gc=False):
    """Messages of a Dynamo publisher the log never got: ``missing`` of them, from sequence
    ``first_missing`` on (see :mod:`seqstate.publishers`). Both are below 2^64: a sequence is a
    u64, and a hole lies between two of one publisher's sequences."""

    publisher_id: int
    first_missing: int
    missing: int


class Delta(Struct, omit_defaults=True):
    """What ``SequenceState.apply`` did; ``seq`` is the source stream sequence (writer-set).

    ``part``/``more``: see :func:`split_delta`; a delta that was not cut is part 0, not more.
    """

    outcome: Outcome
    at_ns: int
    changes: list[RankChange] = []
    added_ranks: list[tuple[int, int]] = []
    removed_ranks: list[tuple[int, int]] = []
    expired: list[str] = []
    seq: int | None = None
    part: int = 0
    more: bool = False
    # Requests freed because their router went silent past the orphan timeout, or said
    # goodbye (their slots are released in ``changes``), in the order they were freed.
    orphaned: list[str] = []
    # A duplicate AddRequest: the rank that holds the id already (a caller's error names it).
    owner: tuple[int, int] | None = None
    # A WorkerAdded's delta: the namespace's block size after it (None: none named yet);
    # under the slot-tracker rules the WorkerRemoved that removes the last worker: TRACKER_ENDED.
    block_size: int | None = None
    # A Dynamo message that came after a hole in its publisher's sequence: which publisher,
    # and how many messages are missing (the writer logs and counts it).
    hole: Hole | None = None
    # The event's index in its record batch (seqstate.batches), whose events share ``seq``:
    # what a tool asks the outcome of an event of a batch by. 0 (so not written) alone.
    index: int = 0


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Delta)
_TOO_DEEP: Final = "malformed delta bytes: nested too deeply"


def encode_delta(delta: Delta) -> bytes:
    return _encoder.encode(delta)


def decode_delta(data: bytes | bytearray | memoryview) -> Delta:
    """One delta; any defect raises ``msgspec.DecodeError`` (a ValidationError is one)."""
    try:
        return _decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError(_TOO_DEEP) from None


_batch_decoder = msgspec.msgpack.Decoder(list[Delta])


def encode_deltas(deltas: list[Delta]) -> bytes:
    """Several deltas in one message: the writer batches what it folds back to back."""
    return _encoder.encode(deltas)


def _array_head(count: int) -> bytes:
    """The msgpack head of an array of ``count`` items, as the encoder writes it."""
    if count < 16:
        return bytes((0x90 | count,))
    if count < 0x10000:
        return b"\xdc" + count.to_bytes(2, "big")
    return b"\xdd" + count.to_bytes(4, "big")


def join_deltas(encoded: list[bytes]) -> bytes:
    """The message of deltas encoded one by one (:func:`encode_delta`):
    ``join_deltas([encode_delta(d) for d in deltas]) == encode_deltas(deltas)``, so a writer
    can encode each delta as it folds it and cut messages later from the bytes."""
    return _array_head(len(encoded)) + b"".join(encoded)


def message_size(count: int, size: int) -> int:
    """The bytes of :func:`join_deltas` of ``count`` encodings of ``size`` bytes in all."""
    return len(_array_head(count)) + size


def decode_deltas(data: bytes | bytearray | memoryview) -> list[Delta]:
    """A message of deltas; any defect raises ``msgspec.DecodeError``. A field this build
    does not know is skipped (a newer writer's), and skipping recurses: a value nested past
    the interpreter's recursion limit is a decode error, never a crash of the reader."""
    try:
        return _batch_decoder.decode(data)
    except RecursionError:
        raise msgspec.DecodeError(_TOO_DEEP) from None


def as_parts(deltas: list[Delta]) -> list[Delta]:
    """The deltas of one stored message's events (a record batch's: one ``seq``), each cut
    to fit already, numbered as the parts of one delta: ``part`` 0 on, all but the last
    ``more``. Applied in order they change what the events changed, one after the other; a
    reader takes the message's ``seq`` as reflected once its last part is applied."""
    last = len(deltas) - 1
    for i, delta in enumerate(deltas):
        delta.part = i
        delta.more = i < last
    return deltas


class DeltaTooLarge(SeqstateError, ValueError):
    """One booking alone does not fit the budget: no cut can make its delta fit."""


_ENVELOPE: Final = 256  # a part's own fields (outcome, times, seq, part, more) and list headers
_RANK_ENTRY: Final = 24  # a rank tuple in added_ranks / removed_ranks


def _int_size(n: int) -> int:
    """Bytes msgpack takes for a non-negative int (slots are never negative)."""
    return 1 if n < 128 else 3 if n < 0x10000 else 5 if n < 0x100000000 else 9


def split_delta(delta: Delta, budget: int) -> list[Delta]:
    """Cut ``delta`` into parts that each encode to at most ``budget`` bytes.

    Deterministic (the same delta and budget give the same parts), so a writer that restarts
    in the middle of an event's parts can tell which it already stored. The pieces keep their
    order: removed ranks, added ranks, then each rank change's releases before its bookings,
    then the expired ids (which the read model does not use; they only report the outcome).
    A rank's load rides along with every part that touches the rank: it is absolute, so
    repeating it is harmless. Raises :class:`DeltaTooLarge` if a single booking cannot fit.
    """
    if len(encode_delta(delta)) <= budget:
        return [delta]
    return _Cutter(delta, budget).cut()


class _Cutter:
    """Fills parts greedily with an upper bound of each piece's encoded size."""

    def __init__(self, delta: Delta, budget: int) -> None:
        self.delta = delta
        self.budget = budget
        self.parts: list[Delta] = []
        self.current = self._fresh()
        self.size = _ENVELOPE
        self.entry: RankChange | None = None  # the change being filled in the current part

    def _fresh(self) -> Delta:
        delta = self.delta
        return Delta(delta.outcome, delta.at_ns, seq=delta.seq, index=delta.index)

    def _fit(self, cost: int) -> None:
        """Make room for a piece of ``cost`` bytes, starting a new part if needed."""
        if cost + _ENVELOPE > self.budget:
            raise DeltaTooLarge(
                f"one piece of the delta of event {self.delta.seq} takes {cost} bytes, over "
                f"the budget of {self.budget}"
            )
        if self.size + cost > self.budget:
            self.parts.append(self.current)
            self.current = self._fresh()
            self.size = _ENVELOPE
            self.entry = None
        self.size += cost

    def _change(self, change: RankChange, head: int, cost: int) -> RankChange:
        """The current part's entry for ``change``'s rank, with room for ``cost`` more."""
        if self.entry is not None and self.size + cost <= self.budget:
            self.size += cost
            return self.entry
        self.entry = None
        self._fit(head + cost)
        self.entry = RankChange(change.rank, change.load)
        self.current.changes.append(self.entry)
        return self.entry

    def cut(self) -> list[Delta]:
        delta = self.delta
        for rank in delta.removed_ranks:
            self._fit(_RANK_ENTRY)
            self.current.removed_ranks.append(rank)
        for rank in delta.added_ranks:
            self._fit(_RANK_ENTRY)
            self.current.added_ranks.append(rank)
        for change in delta.changes:
            head = len(_encoder.encode(RankChange(change.rank, change.load))) + 8
            self.entry = None
            if not change.released and not change.booked:
                self._change(change, head, 0)
            for slot in change.released:
                self._change(change, head, _int_size(slot)).released.append(slot)
            for booking in change.booked:
                cost = len(_encoder.encode(booking))
                self._change(change, head, cost).booked.append(booking)
        self.entry = None
        for request_id in delta.expired:
            self._fit(len(request_id.encode()) + 5)
            self.current.expired.append(request_id)
        for request_id in delta.orphaned:
            self._fit(len(request_id.encode()) + 5)
            self.current.orphaned.append(request_id)
        self.parts.append(self.current)
        last = len(self.parts) - 1
        self.parts[0].hole = delta.hole
        for i, part in enumerate(self.parts):
            part.part = i
            part.more = i < last
        return self.parts
