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


class RecentIds:
    """``request_id -> (value, written_at_ns)``, forgetting entries older than ``retention_ns``
    and the oldest ones beyond ``capacity``."""

    __slots__ = ("_queue", "_stamp", "capacity", "due_ns", "entries", "evicted", "retention_ns")

    def __init__(self, retention_ns: int, capacity: int) -> None:
        self.retention_ns = retention_ns
        self.capacity = capacity
        # request_id -> (value, written_at_ns, stamp); the stamp is unique per write.
        self.entries: dict[str, tuple[int, int, int]] = {}
        # (written_at_ns, stamp, request_id); stale when the id was rewritten or deleted since.
        self._queue: deque[tuple[int, int, str]] = deque()
        self._stamp = 0
        # When the oldest entry falls out of retention: callers skip prune() before then.
        self.due_ns: int = NEVER
        self.evicted = 0  # dropped for capacity before their time (an operator signal)

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.entries

    def get(self, request_id: str) -> int | None:
        entry = self.entries.get(request_id)
        return None if entry is None else entry[0]

    def put(self, request_id: str, value: int, now_ns: int) -> None:
        entries = self.entries
        if request_id in entries:
            del entries[request_id]  # re-insert so dict order stays write order
        self._stamp = stamp = self._stamp + 1
        entries[request_id] = (value, now_ns, stamp)
        queue = self._queue
        queue.append((now_ns, stamp, request_id))
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
        entry = self.entries.pop(request_id, None)
        return None if entry is None else entry[0]

    def prune(self, now_ns: int) -> None:
        """Forget entries written more than ``retention_ns`` before ``now_ns``."""
        queue = self._queue
        cutoff = now_ns - self.retention_ns
        entries = self.entries
        while queue and queue[0][0] < cutoff:
            _, stamp, request_id = queue.popleft()
            entry = entries.get(request_id)
            if entry is not None and entry[2] == stamp:
                del entries[request_id]
        if len(queue) > 2 * len(entries) + STALE_SLACK:
            self._compact()
        else:
            self._set_due()

    def _compact(self) -> None:
        """Drop the stale queue entries. It runs only when they outnumber the live ones, so
        it costs fewer steps than the entries it drops, each appended once: amortised O(1)."""
        self._queue = deque((at, stamp, rid) for rid, (_, at, stamp) in self.entries.items())
        self._set_due()

    def _set_due(self) -> None:
        queue = self._queue
        self.due_ns = queue[0][0] + self.retention_ns if queue else NEVER

    def _pop_front(self, evicting: bool) -> None:
        queue = self._queue
        entries = self.entries
        while queue:
            _, stamp, request_id = queue.popleft()
            entry = entries.get(request_id)
            if entry is not None and entry[2] == stamp:
                del entries[request_id]
                if evicting:
                    self.evicted += 1
                return

    def items(self) -> Iterator[tuple[str, int, int]]:
        """``(request_id, value, written_at_ns)`` oldest first."""
        for request_id, (value, at, _) in self.entries.items():
            yield request_id, value, at

    def load(self, items: list[tuple[str, int, int]]) -> None:
        """Replace the content with ``items`` (oldest first), as :meth:`items` gave them."""
        # In place: the owner keeps a reference to this dict.
        self.entries.clear()
        self.entries.update((rid, (value, at, i)) for i, (rid, value, at) in enumerate(items, 1))
        self._queue = deque((at, i, rid) for i, (rid, _, at) in enumerate(items, 1))
        self._stamp = len(items)
        self._set_due()
