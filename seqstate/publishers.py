"""Dynamo publishers' sequences: which messages the log never got.

Every Dynamo process that publishes replica-sync messages numbers them per publisher, from 0,
+1 per message, on NATS Core, where a lost message stays lost. The fold hands each message's
``(publisher_id, sequence)`` here, and a jump forward is a *hole*: that many messages of that
publisher are missing, and the requests they added, marked or freed are wrong in the ledger
until their Free or expiry. Counting them is how the loss becomes visible (status, metrics,
the writer's log), since nothing can bring them back.

Dynamo draws a new publisher id at every start, so an id never begins again under the same
number, and anyone allowed on Dynamo's subjects can send any id and sequence. So:

- A publisher seen for the first time starts its count wherever it is: what it published
  before the log began (or before it was forgotten) was never the log's to miss.
- A sequence at or below the last one taken in order (0 included) is a duplicate, a message
  overtaken, or a forgery: it is counted as ``late``, never as a hole, and it does not move
  the publisher back (moving back would turn its next message into a hole).
- Counts never stop the fold. A publisher's sequence only moves forward within the u64 range,
  so its holes stay below 2^64; the totals over every publisher, and a publisher's count
  carried across being forgotten, saturate at 2^64 - 1 (:data:`~seqstate.deltas.U64_MAX`),
  the most a snapshot can hold. Late messages and forgotten publishers grow by one per event
  at most, so they stay exact.

Bounded: at most ``capacity`` publishers, the one heard from least recently forgotten first
(a Dynamo process draws a new id at every start, so ids of dead processes pile up otherwise),
which is also why the state's memory of publishers is not refused when full: refusing would
dead-letter every message of a new router. A forgotten publisher's holes stay in the totals,
and the :data:`MOST_LOSSY` publishers that lost the most are kept apart from the table, so
that what status and metrics name survives a flood of new ids; one of them heard again goes on
from its count. Each message costs O(1) (a hole: O(MOST_LOSSY)). The order (least recently
heard first) is part of the write model, and snapshots keep it.
"""

from __future__ import annotations

from typing import Final

from seqstate.deltas import U64_MAX, Hole

MAX_PUBLISHERS: Final = 4096
MOST_LOSSY: Final = 20  # the publishers named by status and metrics, kept though forgotten


class Publisher:
    """One publisher's count: the last sequence taken in order, the messages missing before
    it (``holes``), its late messages, and when it was last heard (log time)."""

    __slots__ = ("heard_ns", "holes", "last_sequence", "late")

    def __init__(self, last_sequence: int, heard_ns: int, holes: int = 0, late: int = 0) -> None:
        self.last_sequence = last_sequence
        self.heard_ns = heard_ns
        self.holes = holes
        self.late = late


class Publishers:
    """``publisher_id -> Publisher``, least recently heard first; ``holes`` and ``late``
    are totals over every publisher ever counted, forgotten ones included; ``lossiest``
    the :data:`MOST_LOSSY` that lost the most (``publisher_id -> holes``)."""

    __slots__ = ("capacity", "entries", "forgotten", "holes", "late", "lossiest")

    def __init__(self, capacity: int = MAX_PUBLISHERS) -> None:
        if capacity < 1:
            raise ValueError("max_publishers must be at least 1")
        self.capacity = capacity
        self.entries: dict[int, Publisher] = {}
        self.holes = 0
        self.late = 0
        self.forgotten = 0  # publishers dropped for capacity (an operator signal)
        self.lossiest: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, publisher_id: int) -> bool:
        return publisher_id in self.entries

    def __getitem__(self, publisher_id: int) -> Publisher:
        return self.entries[publisher_id]

    def heard(self, publisher_id: int, sequence: int, now_ns: int) -> Hole | None:
        """Count one message; returns the hole it reveals, if any."""
        entries = self.entries
        publisher = entries.pop(publisher_id, None)
        if publisher is None:
            if len(entries) >= self.capacity:
                del entries[next(iter(entries))]
                self.forgotten += 1
            holes = self.lossiest.get(publisher_id, 0) if self.lossiest else 0
            entries[publisher_id] = Publisher(sequence, now_ns, holes)
            return None
        entries[publisher_id] = publisher  # now the most recently heard
        publisher.heard_ns = now_ns
        expected = publisher.last_sequence + 1
        if sequence == expected:
            publisher.last_sequence = sequence
            return None
        if sequence > expected:
            missing = sequence - expected
            publisher.last_sequence = sequence
            publisher.holes = min(publisher.holes + missing, U64_MAX)
            self.holes = min(self.holes + missing, U64_MAX)
            self._rank(publisher_id, publisher.holes)
            return Hole(publisher_id, expected, missing)
        publisher.late += 1
        self.late += 1
        return None

    def _rank(self, publisher_id: int, holes: int) -> None:
        """Keep ``lossiest`` the MOST_LOSSY publishers with the most holes (of equal counts,
        the lowest ids): ``publisher_id`` has ``holes`` now, and no other count changed."""
        lossiest = self.lossiest
        if publisher_id in lossiest or len(lossiest) < MOST_LOSSY:
            lossiest[publisher_id] = holes
            return
        least = min(lossiest, key=lambda pid: (lossiest[pid], -pid))
        if (holes, -publisher_id) > (lossiest[least], -least):
            del lossiest[least]
            lossiest[publisher_id] = holes

    def lossy(self, most: int = MOST_LOSSY) -> list[tuple[int, int]]:
        """``(publisher_id, holes)`` of the ``most`` publishers that lost the most messages
        (forgotten ones included), most first (ties by id): what status, metrics and the log
        name."""
        return sorted(self.lossiest.items(), key=lambda row: (-row[1], row[0]))[:most]

    def report(self) -> dict[str, object]:
        """The counts as the writer's status and ``seqstate status`` show them (JSON-ready;
        publisher ids as strings, since JSON numbers lose a u64's low bits)."""
        return {
            "publishers": len(self.entries),
            "lost": self.holes,
            "late": self.late,
            "forgotten": self.forgotten,
            "lost_by_publisher": {str(pid): holes for pid, holes in self.lossy()},
        }

    def rows(self) -> list[tuple[int, int, int, int, int]]:
        """``(publisher_id, last_sequence, heard_ns, holes, late)`` of every publisher, least
        recently heard first (snapshots)."""
        return [
            (pid, p.last_sequence, p.heard_ns, p.holes, p.late) for pid, p in self.entries.items()
        ]

    def load(
        self,
        rows: list[tuple[int, int, int, int, int]],
        lossiest: list[tuple[int, int]] | None = None,
    ) -> None:
        """Restore what :meth:`rows` and :meth:`lossy` listed (in that order); without
        ``lossiest`` (a snapshot older than it), the table's own lossiest are taken."""
        if len(rows) > self.capacity:
            raise ValueError(f"{len(rows)} publishers, over the capacity of {self.capacity}")
        self.entries = {row[0]: Publisher(*row[1:]) for row in rows}
        if len(self.entries) != len(rows):
            raise ValueError("a publisher listed twice")
        if lossiest is None:
            lossiest = [(pid, p.holes) for pid, p in self.entries.items() if p.holes]
            lossiest = sorted(lossiest, key=lambda row: (-row[1], row[0]))[:MOST_LOSSY]
        elif len(lossiest) > MOST_LOSSY:
            raise ValueError(f"{len(lossiest)} lossiest publishers, over {MOST_LOSSY}")
        self.lossiest = dict(lossiest)
        if len(self.lossiest) != len(lossiest):
            raise ValueError("a lossy publisher listed twice")
