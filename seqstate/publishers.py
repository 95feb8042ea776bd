"""Dynamo publishers' sequences: which messages the log never got.

Every Dynamo process that publishes replica-sync messages numbers them per publisher, from 0,
+1 per message, on NATS Core, where a lost message stays lost. The fold hands each message's
``(publisher_id, sequence)`` here, and a jump forward is a *hole*: that many messages of that
publisher are missing, and the requests they added, marked or freed are wrong in the ledger
until their Free or expiry. Counting them is how the loss becomes visible (status, metrics,
the writer's log), since nothing can bring them back.

- A publisher seen for the first time starts its count wherever it is: what it published
  before the log began (or before it was forgotten) was never the log's to miss.
- Sequence 0 after a higher one is a restart (a new publisher under the same id), not a hole.
- A sequence below the next expected one (not 0) is a duplicate or a message overtaken: it is
  counted as ``late``, never as a hole, and the count of holes does not go back.

Bounded: at most ``capacity`` publishers, the one heard from least recently forgotten first
(a Dynamo process draws a new id at every start, so ids of dead processes pile up otherwise),
which is also why the state's memory of publishers is not refused when full: refusing would
dead-letter every message of a new router. Each message costs O(1). The order (least recently
heard first) is part of the write model, and snapshots keep it.
"""

from __future__ import annotations

from typing import Final

from seqstate.deltas import Hole

MAX_PUBLISHERS: Final = 4096


class Publisher:
    """One publisher's count: the last sequence taken in order, the messages missing before
    it (``holes``), its restarts, its late messages, and when it was last heard (log time)."""

    __slots__ = ("heard_ns", "holes", "last_sequence", "late", "restarts")

    def __init__(
        self, last_sequence: int, heard_ns: int, holes: int = 0, restarts: int = 0, late: int = 0
    ) -> None:
        self.last_sequence = last_sequence
        self.heard_ns = heard_ns
        self.holes = holes
        self.restarts = restarts
        self.late = late


class Publishers:
    """``publisher_id -> Publisher``, least recently heard first; ``holes`` and ``restarts``
    are totals over every publisher ever counted, forgotten ones included."""

    __slots__ = ("capacity", "entries", "forgotten", "holes", "restarts")

    def __init__(self, capacity: int = MAX_PUBLISHERS) -> None:
        if capacity < 1:
            raise ValueError("max_publishers must be at least 1")
        self.capacity = capacity
        self.entries: dict[int, Publisher] = {}
        self.holes = 0
        self.restarts = 0
        self.forgotten = 0  # publishers dropped for capacity (an operator signal)

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
            entries[publisher_id] = Publisher(sequence, now_ns)
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
            publisher.holes += missing
            self.holes += missing
            return Hole(publisher_id, expected, missing)
        if sequence == 0:
            publisher.last_sequence = 0
            publisher.restarts += 1
            self.restarts += 1
            return None
        publisher.late += 1
        return None

    def lossy(self, most: int = 20) -> list[tuple[int, int]]:
        """``(publisher_id, holes)`` of the ``most`` publishers that lost the most messages,
        most first (ties by id): what status, metrics and the log name."""
        lost = [(pid, p.holes) for pid, p in self.entries.items() if p.holes]
        lost.sort(key=lambda row: (-row[1], row[0]))
        return lost[:most]

    def report(self) -> dict[str, object]:
        """The counts as the writer's status and ``seqstate status`` show them (JSON-ready;
        publisher ids as strings, since JSON numbers lose a u64's low bits)."""
        return {
            "publishers": len(self.entries),
            "lost": self.holes,
            "restarts": self.restarts,
            "forgotten": self.forgotten,
            "lost_by_publisher": {str(pid): holes for pid, holes in self.lossy()},
        }

    def rows(self) -> list[tuple[int, int, int, int, int, int]]:
        """``(publisher_id, last_sequence, heard_ns, holes, restarts, late)`` of every
        publisher, least recently heard first (snapshots)."""
        return [
            (pid, p.last_sequence, p.heard_ns, p.holes, p.restarts, p.late)
            for pid, p in self.entries.items()
        ]

    def load(self, rows: list[tuple[int, int, int, int, int, int]]) -> None:
        """Restore what :meth:`rows` listed (in that order)."""
        if len(rows) > self.capacity:
            raise ValueError(f"{len(rows)} publishers, over the capacity of {self.capacity}")
        self.entries = {row[0]: Publisher(*row[1:]) for row in rows}
        if len(self.entries) != len(rows):
            raise ValueError("a publisher listed twice")
