"""Bounded, time-limited memory of request ids: recently ended ones, and tombstones.

Entries are kept in the order they were (last) written, which is also log-time order because
event time never goes back; so both limits (age and count) evict from the front in O(1)
amortised, and a snapshot lists the entries in that same order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import accumulate, pairwise
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

    __slots__ = (
        "_columns",
        "_packed",
        "_queue",
        "_times",
        "capacity",
        "due_ns",
        "entries",
        "evicted",
        "retention_ns",
    )

    def __init__(self, retention_ns: int, capacity: int) -> None:
        self.retention_ns = retention_ns
        self.capacity = capacity
        # request_id -> written_at_ns << VALUE_BITS | value, in write order.
        self.entries: dict[str, int] = {}
        # Ids in write order, and beside them (``_times``) when each was written; an entry is
        # stale when the id was deleted since, or rewritten at another time. A rewrite at the
        # same log time leaves two entries that both match the id: the first one met retires
        # it, no sooner by age (the same time) and at most a few places sooner by count (among
        # ids written at that same time). Two deques, not one of pairs: a restore builds them
        # from two lists without a tuple per id.
        self._queue: deque[str] = deque()
        self._times: deque[int] = deque()
        # When the oldest entry falls out of retention: callers skip prune() before then.
        self.due_ns: int = NEVER
        self.evicted = 0  # dropped for capacity before their time (an operator signal)
        # The last :meth:`columns` given (or loaded), and the packed entries they were made
        # of: the next one reuses what is unchanged.
        self._columns: tuple[list[str], bytes, list[int]] | None = None
        self._packed: list[int] = []

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
        queue.append(request_id)
        self._times.append(now_ns)
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
        times = self._times
        return times[0] if times else None

    def _drop_before(self, cutoff: int, taken: list[str] | None) -> None:
        queue = self._queue
        times = self._times
        entries = self.entries
        while times and times[0] < cutoff:
            at = times.popleft()
            request_id = queue.popleft()
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
        entries = self.entries
        self._queue = deque(entries)
        self._times = deque([packed >> VALUE_BITS for packed in entries.values()])
        self._set_due()

    def _set_due(self) -> None:
        times = self._times
        self.due_ns = times[0] + self.retention_ns if times else NEVER

    def _pop_front(self, evicting: bool) -> None:
        queue = self._queue
        times = self._times
        entries = self.entries
        while queue:
            at = times.popleft()
            request_id = queue.popleft()
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
        self._queue = deque([rid for rid, _, _ in items])
        self._times = deque([at for _, _, at in items])
        self._columns, self._packed = None, []
        self._set_due()

    def columns(self) -> tuple[list[str], bytes, list[int]]:
        """The content as three columns, oldest first: the ids, their values (one byte each),
        and the gaps between their write times (the first one's time first), which are small
        numbers where the times are not: what a snapshot stores, compactly.

        Between two snapshots most of the entries stay as they were: some of the oldest go,
        newer ones come after the rest. So the last columns are kept with the entries they
        were made of, and whatever of those is still, in order and unchanged, the start of
        the entries is reused; only the entries after it are computed. Checking that costs a
        comparison of references per entry, not the arithmetic on 70-bit integers that
        computing the columns again does (40 ms for the 250,000 ended ids a busy writer
        keeps: a snapshot's encode, almost all of it).
        """
        entries = self.entries
        ids = list(entries)
        packed = list(entries.values())
        columns = self._reused(ids, packed)
        if columns is None:
            times = [each >> VALUE_BITS for each in packed]
            gaps = times[:1] + [b - a for a, b in pairwise(times)]
            columns = ids, bytes([each & VALUE_MASK for each in packed]), gaps
        self._columns = columns
        self._packed = packed
        return columns

    def _reused(
        self, ids: list[str], packed: list[int]
    ) -> tuple[list[str], bytes, list[int]] | None:
        """The columns of the entries ``ids`` -> ``packed`` made from the last ones, if the
        entries those were made of, from some point on, are the same objects at the start of
        these; None otherwise (nothing to reuse)."""
        if self._columns is None or not ids:
            return None
        old_ids, old_values, old_gaps = self._columns
        old_packed = self._packed
        try:  # the oldest ones gone: where the first of these stood (an id is there once)
            start = old_ids.index(ids[0])
        except ValueError:
            return None
        kept = len(old_ids) - start
        if kept > len(ids) or ids[:kept] != old_ids[start:] or packed[:kept] != old_packed[start:]:
            return None
        at = old_packed[-1] >> VALUE_BITS
        gaps = [packed[0] >> VALUE_BITS]
        gaps += old_gaps[start + 1 :]
        for each in packed[kept:]:
            written = each >> VALUE_BITS
            gaps.append(written - at)
            at = written
        values = old_values[start:] + bytes([each & VALUE_MASK for each in packed[kept:]])
        return ids, values, gaps

    def load_columns(self, ids: list[str], values: bytes, gaps: list[int]) -> None:
        """Replace the content with :meth:`columns`' output, without an object per id beyond
        the id and its packed entry (a restore of 250,000 ended ids)."""
        if not len(ids) == len(values) == len(gaps):
            raise ValueError("the columns of a memory differ in length")
        times = list(accumulate(gaps))
        self.entries.clear()
        packed = [at << VALUE_BITS | v for at, v in zip(times, values, strict=True)]
        self.entries.update(zip(ids, packed, strict=True))
        if len(self.entries) != len(ids):
            raise ValueError("an id twice in a memory")
        self._queue = deque(ids)
        self._times = deque(times)
        self._columns, self._packed = (ids, values, gaps), packed
        self._set_due()
