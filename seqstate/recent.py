"""Bounded, time-limited memory of request ids: recently ended ones, and tombstones.

Entries are kept in the order they were (last) written, which is also log-time order because
event time never goes back; so both limits (age and count) evict from the front in O(1)
amortised, and a snapshot lists the entries in that same order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Final

NEVER: Final = 2**64  # later than any log time
# Stale queue entries beyond twice the live ones plus this are compacted away, so the queue
# never holds more than ``2 * capacity + STALE_SLACK`` entries.
STALE_SLACK: Final = 1024


# An entry packs its value (a small code) and the log time it was written into one int: one
# object per entry instead of a tuple of three, about 100 bytes less per id (the writer keeps
# 250,000 ended ids by default).
VALUE_BITS: Final = 8
VALUE_MASK: Final = (1 << VALUE_BITS) - 1


class RecentIds:
    """``request_id -> (value, written_at_ns)``, forgetting entries older than ``retention_ns``
    and the oldest ones beyond ``capacity``. ``value`` is a code below 256."""

    __slots__ = ("_queue", "capacity", "due_ns", "entries", "evicted", "retention_ns")

    def __init__(self, retention_ns: int, capacity: int) -> None:
        self.retention_ns = retention_ns
        self.capacity = capacity
        # request_id -> written_at_ns << VALUE_BITS | value, in write order.
        self.entries: dict[str, int] = {}
        # (written_at_ns, request_id) in write order; stale when the id was deleted since, or
        # rewritten at another time. A rewrite at the same log time leaves two entries that
        # both match the id: the first one met retires it, no sooner by age (the same time)
        # and at most a few places sooner by count (among ids written at that same time).
        self._queue: deque[tuple[int, str]] = deque()
        # When the oldest entry falls out of retention: callers skip prune() before then.
        self.due_ns: int = NEVER
        self.evicted = 0  # dropped for capacity before their time (an operator signal)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.entries

    def get(self, request_id: str) -> int | None:
        packed = self.entries.get(request_id)
        return None if packed is None else packed & VALUE_MASK

    def written_ns(self, request_id: str) -> int | None:
        """When ``request_id`` was last written, or None."""
        packed = self.entries.get(request_id)
        return None if packed is None else packed >> VALUE_BITS

    def put(self, request_id: str, value: int, now_ns: int) -> None:
        entries = self.entries
        if request_id in entries:
            del entries[request_id]  # re-insert so dict order stays write order
        entries[request_id] = now_ns << VALUE_BITS | value
        queue = self._queue
        queue.append((now_ns, request_id))
        if len(entries) > self.capacity:
            self._pop_front(evicting=True)
            self._set_due()
        elif len(queue) == 1:
            self.due_ns = now_ns + self.retention_ns
        if len(queue) > 2 * len(entries) + STALE_SLACK:
            # Ids rewritten or taken out (an id reused, a tombstone consumed) leave their old
            # queue entries behind: without this the queue, and the ids it holds, would grow
            # with every such write of the retention period, whatever the capacity.
            self._compact()

    def pop(self, request_id: str) -> int | None:
        packed = self.entries.pop(request_id, None)
        return None if packed is None else packed & VALUE_MASK

    def prune(self, now_ns: int) -> None:
        """Forget entries written more than ``retention_ns`` before ``now_ns``."""
        self._drop_before(now_ns - self.retention_ns, None)

    def take_before(self, cutoff_ns: int) -> list[str]:
        """Remove and return the ids last written before ``cutoff_ns``, oldest first: a lease
        scan's expiries, at a cost that follows them (and the stale entries it passes)."""
        taken: list[str] = []
        self._drop_before(cutoff_ns, taken)
        return taken

    def oldest_ns(self) -> int | None:
        """When the oldest entry was written, or earlier (a stale entry's time); None if empty."""
        queue = self._queue
        return queue[0][0] if queue else None

    def _drop_before(self, cutoff: int, taken: list[str] | None) -> None:
        queue = self._queue
        entries = self.entries
        while queue and queue[0][0] < cutoff:
            at, request_id = queue.popleft()
            packed = entries.get(request_id)
            if packed is not None and packed >> VALUE_BITS == at:
                del entries[request_id]
                if taken is not None:
                    taken.append(request_id)
        if len(queue) > 2 * len(entries) + STALE_SLACK:
            self._compact()
        else:
            self._set_due()

    def _compact(self) -> None:
        """Drop the stale queue entries. It runs only when they outnumber the live ones, so
        it costs fewer steps than the entries it drops, each appended once: amortised O(1)."""
        self._queue = deque((packed >> VALUE_BITS, rid) for rid, packed in self.entries.items())
        self._set_due()

    def _set_due(self) -> None:
        queue = self._queue
        self.due_ns = queue[0][0] + self.retention_ns if queue else NEVER

    def _pop_front(self, evicting: bool) -> None:
        queue = self._queue
        entries = self.entries
        while queue:
            at, request_id = queue.popleft()
            packed = entries.get(request_id)
            if packed is not None and packed >> VALUE_BITS == at:
                del entries[request_id]
                if evicting:
                    self.evicted += 1
                return

    def items(self) -> Iterator[tuple[str, int, int]]:
        """``(request_id, value, written_at_ns)`` oldest first."""
        for request_id, packed in self.entries.items():
            yield request_id, packed & VALUE_MASK, packed >> VALUE_BITS

    def load(self, items: list[tuple[str, int, int]]) -> None:
        """Replace the content with ``items`` (oldest first), as :meth:`items` gave them."""
        # In place: the owner keeps a reference to this dict.
        self.entries.clear()
        self.entries.update((rid, at << VALUE_BITS | value) for rid, value, at in items)
        self._queue = deque((at, rid) for rid, _, at in items)
        self._set_due()
