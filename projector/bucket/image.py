"""The bucket image: the registry bucket's keys and values as a pure function of the deltas.

The projector, ``seqstate rebuild`` and ``seqstate replay --verify`` all need to know what the
bucket must hold after a run of deltas. This fold is that knowledge, with no I/O: deltas go
in, ``(key, value)`` writes come out (``None``: delete the key). The projector feeds it the
DELTAS stream and writes what :meth:`BucketImage.take` hands it; ``rebuild`` feeds it the
write model's projection; tests feed it lists of deltas.

What it keeps is what the next delta's writes depend on, and no more: each rank's load and
stamp, the slot keys the rank has (so a removed rank's keys can all be deleted), and for a
slot that held a long prompt, how many part keys it has and how many may hold hashes (so a
release, or a shorter request taking the slot, empties exactly the parts left over). The
hashes of a booking are encoded into its slot's values at once and not kept: the projector's
memory follows the number of ranks and slots, not the number of active hashes.

Writes are coalesced: a key changed twice before :meth:`take` is written once, with its last
value; a rank's load is encoded at :meth:`take` time. So the bytes written depend only on the
deltas, never on when a flush happened. A take lists the part keys before the slot keys
(heads), so a reader that sees a head has seen the parts written with it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from projector.bucket.raw_deltas import all_u64, packed
from projector.wire.values import (
    EMPTY_SLOT,
    Position,
    Rank,
    encode_load,
    encode_position,
    encode_tracker,
    load_key,
    parse_key,
    part_key,
    position_key,
    request_values,
    slot_key,
    tracker_key,
)
from seqstate import Delta, RankLoad
from seqstate.loads import EMPTY_LOAD

if TYPE_CHECKING:
    from projector.bucket.contents import BucketView

Write = tuple[str, bytes | None]  # (key, value); None deletes the key


@dataclass(slots=True)
class Parts:
    """A slot's part keys: ``keys`` the highest the bucket has (a removal deletes 1..keys),
    ``live`` the highest that may hold hashes (a release empties 1..live)."""

    keys: int = 0
    live: int = 0


class BucketImage:
    """One namespace's bucket, folded from deltas. See the module docstring."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self.loads: dict[Rank, RankLoad] = {}
        self.load_stamps: dict[Rank, tuple[int, int]] = {}  # (source seq, log time)
        # The slot keys each rank has in the bucket: a removal deletes exactly those, so its
        # cost follows the keys written, never a slot number a delta names.
        self.slot_keys: dict[Rank, set[int]] = {}
        # The slots that have part keys (a long prompt's), and how many: most never do.
        self.parts: dict[tuple[Rank, int], Parts] = {}
        self.applied_seq = 0  # the last event whose delta (every part of it) is applied
        self.as_of = 0  # its log time
        self.partial: tuple[int, int] | None = None  # (event, part) of an event half applied
        self._slots: dict[str, bytes | None] = {}  # slot keys written since the last take
        self._parts: dict[str, bytes | None] = {}  # part keys written since the last take
        # Slot keys the bucket holds empty, as far as the writes taken tell: a request booked
        # and freed between two takes then costs no write at all (the bytes would not change).
        self._empty: set[str] = set()
        self._dirty_loads: set[Rank] = set()
        self._deleted_loads: set[Rank] = set()
        # The namespace's block size, as registrations named it (None: none yet).
        self.block_size: int | None = None
        self._tracker_dirty = False

    # ---- folding ----------------------------------------------------------------------------

    def apply(self, delta: Delta) -> None:
        """Fold one delta (or one part of one). ``delta.seq`` None keeps the current stamp."""
        seq = self.applied_seq if delta.seq is None else delta.seq
        stamp = (seq, delta.at_ns)
        ns = self.namespace
        for raw in delta.removed_ranks:
            rank = (raw[0], raw[1])
            self.loads.pop(rank, None)
            self.load_stamps.pop(rank, None)
            self._dirty_loads.discard(rank)
            self._deleted_loads.add(rank)
            for slot in sorted(self.slot_keys.pop(rank, ())):
                self._delete_parts(rank, slot)
                key = slot_key(ns, rank, slot)
                self._slots[key] = None
                self._empty.discard(key)
        for raw in delta.added_ranks:
            self._touch((raw[0], raw[1]), stamp)
        for change in delta.changes:
            rank = (change.rank[0], change.rank[1])
            self._touch(rank, stamp)
            self.loads[rank] = change.load
            keys = self.slot_keys.setdefault(rank, set())
            slots, parts = self._slots, self.parts
            for slot in change.released:
                keys.add(slot)
                slots[slot_key(ns, rank, slot)] = EMPTY_SLOT
                if parts and (rank, slot) in parts:
                    self._hold_parts(rank, slot, [])
            for booking in change.booked:
                head, *rest = request_values(seq, booking.request_id, packed(booking.hashes))
                keys.add(booking.slot)
                slots[slot_key(ns, rank, booking.slot)] = head
                if rest or (parts and (rank, booking.slot) in parts):
                    self._hold_parts(rank, booking.slot, rest)
        if delta.block_size is not None:
            block_size = delta.block_size or None  # TRACKER_ENDED (0): the tracker is gone
            if block_size != self.block_size:
                self.block_size = block_size
                self._tracker_dirty = True
        if delta.more:
            self.partial = (seq, delta.part)
        else:
            self.partial = None
            self.applied_seq = seq
        self.as_of = max(self.as_of, delta.at_ns)

    def _hold_parts(self, rank: Rank, slot: int, values: list[bytes]) -> None:
        """``slot``'s parts now hold ``values`` (part 1 first); parts beyond them that may
        hold hashes are emptied. Costs the keys written, never the slot's history."""
        parts = self.parts.get((rank, slot))
        if parts is None:
            parts = self.parts[(rank, slot)] = Parts()
        count = len(values)
        for part in range(1, max(count, parts.live) + 1):
            key = part_key(self.namespace, rank, slot, part)
            self._parts[key] = values[part - 1] if part <= count else EMPTY_SLOT
        parts.live = count
        parts.keys = max(parts.keys, count)

    def _delete_parts(self, rank: Rank, slot: int) -> None:
        parts = self.parts.pop((rank, slot), None)
        if parts is None:
            return
        for part in range(1, parts.keys + 1):
            key = part_key(self.namespace, rank, slot, part)
            self._parts[key] = None
            self._empty.discard(key)

    def refusal(self, deltas: Sequence[Delta]) -> str:
        """Why ``deltas`` cannot be a writer's ("" if they can): a number out of the range the
        events carry (a worker id, a slot or a block hash past u64, a dp rank past u32; a
        negative hash once stopped the projector for good, as it packed the slot's value).
        Costs what they name.

        A slot number is not checked: no rule about it holds across a projector that resumed
        from a bucket written ahead of its position (a flush cut short), and none is needed,
        since a slot costs the image one key whatever its number (:attr:`slot_keys`).
        """
        for delta in deltas:
            ranks = [*delta.removed_ranks, *delta.added_ranks, *(c.rank for c in delta.changes)]
            for raw in ranks:
                if not _in_range(raw):
                    return f"not a writer's delta: rank {raw} is out of range"
            for change in delta.changes:
                for slot in change.released:
                    if not 0 <= slot < _U64:
                        return f"not a writer's delta: slot {slot} is out of range"
                for booking in change.booked:
                    if not 0 <= booking.slot < _U64:
                        return f"not a writer's delta: slot {booking.slot} is out of range"
                    if not all_u64(booking.hashes):
                        return "not a writer's delta: a block hash is not a u64"
        return ""

    def _touch(self, rank: Rank, stamp: tuple[int, int]) -> None:
        if rank not in self.loads:
            self.loads[rank] = EMPTY_LOAD
            self.slot_keys.setdefault(rank, set())
            self._deleted_loads.discard(rank)
        self.load_stamps[rank] = stamp
        self._dirty_loads.add(rank)

    def restore(self, bucket: BucketView) -> None:
        """Start from the bucket's values (a projector resuming). Slot keys of a rank whose
        load key is gone are leftovers of a removal that did not finish: owed as deletes."""
        if (pos := bucket.position) is not None:
            self.applied_seq, self.as_of = pos.applied_seq, pos.as_of
        if bucket.tracker is not None:
            self.block_size = bucket.tracker.block_size
        for rank, value in bucket.loads.items():
            self.loads[rank] = value.rank_load()
            self.load_stamps[rank] = (value.applied_seq, value.as_of)
            self.slot_keys[rank] = set()
        for rank, slots in bucket.slots.items():
            if rank in self.loads:
                self.slot_keys[rank] = set(slots)
                self._empty.update(
                    slot_key(self.namespace, rank, slot)
                    for slot, value in slots.items()
                    if value.empty
                )
            else:
                for slot in slots:
                    self._slots[slot_key(self.namespace, rank, slot)] = None
        for (rank, slot), values in bucket.parts.items():
            if rank not in self.loads:
                for part in values:
                    self._parts[part_key(self.namespace, rank, slot, part)] = None
                continue
            self.slot_keys[rank].add(slot)  # its removal deletes them, even with no head
            live = max((part for part, value in values.items() if not value.empty), default=0)
            self.parts[(rank, slot)] = Parts(max(values), live)
            self._empty.update(
                part_key(self.namespace, rank, slot, part)
                for part, value in values.items()
                if value.empty
            )
        for key in bucket.unreadable:  # a damaged slot value still counts as a slot key
            parsed = parse_key(self.namespace, key)
            if parsed.rank is None or parsed.rank not in self.slot_keys:
                continue
            if parsed.kind == "req":
                self.slot_keys[parsed.rank].add(parsed.slot)
            elif parsed.kind == "part":  # and may hold hashes
                self.slot_keys[parsed.rank].add(parsed.slot)
                parts = self.parts.setdefault((parsed.rank, parsed.slot), Parts())
                parts.keys = max(parts.keys, parsed.part)
                parts.live = max(parts.live, parsed.part)

    # ---- what to write ----------------------------------------------------------------------

    @property
    def dirty(self) -> bool:
        return bool(
            self._slots
            or self._parts
            or self._dirty_loads
            or self._deleted_loads
            or self._tracker_dirty
        )

    def take(self) -> list[Write]:
        """Every write owed since the last take, in a deterministic order; then owe nothing."""
        ns = self.namespace
        writes: list[Write] = [(load_key(ns, rank), None) for rank in sorted(self._deleted_loads)]
        for rank in sorted(self._dirty_loads):
            seq, as_of = self.load_stamps[rank]
            writes.append((load_key(ns, rank), encode_load(rank, self.loads[rank], seq, as_of)))
        empty = self._empty
        for pending in (self._parts, self._slots):  # a head after the parts written with it
            for key, value in pending.items():
                if value == EMPTY_SLOT:
                    if key in empty:
                        continue
                    empty.add(key)
                else:
                    empty.discard(key)
                writes.append((key, value))
        if self._tracker_dirty:
            block_size = self.block_size
            writes.append(
                (tracker_key(ns), None if block_size is None else encode_tracker(block_size))
            )
        self._tracker_dirty = False
        self._slots = {}
        self._parts = {}
        self._dirty_loads = set()
        self._deleted_loads = set()
        return writes

    def owe(self, writes: list[Write]) -> None:
        """Owe ``writes`` again (a flush failed), unless a later change superseded them."""
        for key, value in writes:
            parsed = parse_key(self.namespace, key)
            if parsed.kind == "load" and parsed.rank is not None:
                if parsed.rank in self.loads:
                    self._dirty_loads.add(parsed.rank)
                elif value is None:
                    self._deleted_loads.add(parsed.rank)
            elif parsed.kind == "tracker":
                self._tracker_dirty = True
            else:
                self._empty.discard(key)  # what the bucket holds there is not known now
                pending = self._parts if parsed.kind == "part" else self._slots
                if key not in pending:
                    pending[key] = value

    def position(self, delta_seq: int) -> tuple[str, bytes]:
        return position_key(self.namespace), encode_position(
            Position(self.applied_seq, self.as_of, delta_seq)
        )

    def everything(self) -> dict[str, bytes]:
        """Every key the bucket must hold (no deletes): for an image folded from nothing."""
        return {key: value for key, value in self.take() if value is not None}


_U64 = 2**64


def _in_range(rank: tuple[int, int]) -> bool:
    """A worker id is a u64 and a dp rank a u32, as the events carry them."""
    return 0 <= rank[0] < _U64 and 0 <= rank[1] < 2**32
