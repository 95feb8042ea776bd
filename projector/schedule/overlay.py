"""What a scheduler has booked, marked and freed that its view does not show yet.

A view follows the bucket 14-27 ms behind the events it reflects. A scheduler deciding a
burst on that view alone sends the whole burst to the worker that looked idlest: each of its
bookings is invisible to the next decision. Dynamo's router does not have that problem because
it updates its own state as it routes; the overlay gives a scheduler the same: every event it
sends (and, when it follows them, every event its peers send) is counted at once, and dropped
once the view's applied position passes the event's stream sequence, when the view counts it
itself. An event whose sequence is not known yet (its publish not acknowledged) stays.

What an event changes is estimated against the view and the overlay when it is sent, as
Dynamo's router would apply it to its own state: an add brings its prompt's blocks not active
on the rank yet, one request and its prefill tokens; a prefill's end takes its tokens back; a
free takes back the request, its tokens if still prefilling, and the blocks no other request of
the rank holds. Reference counts per hash keep overlap depths exact for later decisions: a
prompt just booked counts as cached on its rank, one just freed no longer does.

Hashes are chained (a block's hash names its whole prefix), as the registry assumes: past the
view's own overlap depth, the pending events alone say how far a prompt goes on.

Pure and synchronous: no clock, no I/O. The view's registry is read through ``references``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

Rank = tuple[int, int]


class References(Protocol):
    def references(self, rank: Rank, block_hash: int) -> int: ...


@dataclass(slots=True, eq=False)
class Pending:
    """One event not shown by the view yet, and what it changes on its rank."""

    rank: Rank
    requests: int  # +1 an add, -1 a free
    blocks: int  # active blocks it brings (negative: takes back)
    prefill: int  # prefill tokens it brings (negative: takes back)
    step: int  # +1: each hash gains a reference; -1: loses one; 0: none
    hashes: tuple[int, ...]
    seq: int | None = None  # its stream sequence, once acknowledged


@dataclass(slots=True)
class RankDelta:
    """The sum of one rank's pending events."""

    requests: int = 0
    blocks: int = 0
    prefill: int = 0
    refs: dict[int, int] = field(default_factory=dict)  # hash -> references gained (or lost)
    lost: set[int] = field(default_factory=set)  # the hashes of ``refs`` below zero
    entries: int = 0


class Overlay:
    """Pending events by rank; see the module's docstring."""

    def __init__(self, registry: References) -> None:
        self._registry = registry
        self._ranks: dict[Rank, RankDelta] = {}
        self._due: list[tuple[int, int, Pending]] = []  # acknowledged, by stream sequence
        self._order = itertools.count()
        self.entries = 0

    def __len__(self) -> int:
        return self.entries

    def get(self, rank: Rank) -> RankDelta | None:
        return self._ranks.get(rank)

    @property
    def ranks(self) -> dict[Rank, RankDelta]:
        """The ranks with pending events (read-only: the overlay owns it)."""
        return self._ranks

    def references(self, rank: Rank, block_hash: int) -> int:
        """References to ``block_hash`` on ``rank``: the view's, plus the pending events'."""
        count = self._registry.references(rank, block_hash)
        delta = self._ranks.get(rank)
        if delta is not None and delta.refs:
            count += delta.refs.get(block_hash, 0)
        return count

    # ---- events -------------------------------------------------------------------------

    def add(self, rank: Rank, block_hashes: Sequence[int], prefill_tokens: int) -> Pending:
        hashes = tuple(dict.fromkeys(block_hashes))
        refs = self.references
        new = sum(1 for h in hashes if refs(rank, h) <= 0)
        return self._apply(Pending(rank, 1, new, prefill_tokens, 1, hashes))

    def mark(self, rank: Rank, prefill_tokens: int) -> Pending:
        return self._apply(Pending(rank, 0, 0, -prefill_tokens, 0, ()))

    def free(self, rank: Rank, block_hashes: Sequence[int], prefill_tokens: int) -> Pending:
        hashes = tuple(dict.fromkeys(block_hashes))
        refs = self.references
        last = sum(1 for h in hashes if refs(rank, h) == 1)
        return self._apply(Pending(rank, -1, -last, -prefill_tokens, -1, hashes))

    def settle(self, entry: Pending, seq: int) -> None:
        """``entry``'s event is stored at ``seq``: it goes once the view passes ``seq``."""
        entry.seq = seq
        heapq.heappush(self._due, (seq, next(self._order), entry))

    def cancel(self, entry: Pending) -> None:
        """``entry``'s event was not stored: it never will be shown, so it goes now."""
        if entry.seq is None:
            self._unapply(entry)
            entry.seq = -1  # gone; a late settle cannot bring it back

    def prune(self, applied_seq: int) -> None:
        """Drop every event the view shows: those at or before ``applied_seq``."""
        due = self._due
        while due and due[0][0] <= applied_seq:
            self._unapply(heapq.heappop(due)[2])

    # ---- reads --------------------------------------------------------------------------

    def depth(self, rank: Rank, query: Sequence[int], view_depth: int) -> int:
        """The query's overlap depth on ``rank`` with the pending events counted: a prefix
        freed is no longer cached, a prompt booked is. ``view_depth``: the view's own."""
        delta = self._ranks.get(rank)
        if delta is None or not delta.refs:
            return view_depth
        refs = delta.refs
        count = self._registry.references
        depth = view_depth
        lost = delta.lost
        if lost and not lost.isdisjoint(query):
            for i in range(view_depth):
                h = query[i]
                if h in lost and count(rank, h) + refs[h] <= 0:
                    return i
        # Past the view's depth the view holds none of the query (hashes are chained: one held
        # means its whole prefix is), so the pending events alone say how far it goes on.
        n = len(query)
        get = refs.get
        while depth < n and get(query[depth], 0) > 0:
            depth += 1
        return depth

    # ---- bookkeeping --------------------------------------------------------------------

    def _apply(self, entry: Pending) -> Pending:
        delta = self._ranks.get(entry.rank)
        if delta is None:
            delta = self._ranks[entry.rank] = RankDelta()
        self._move(delta, entry, 1)
        self.entries += 1
        return entry

    def _unapply(self, entry: Pending) -> None:
        delta = self._ranks[entry.rank]
        self._move(delta, entry, -1)
        self.entries -= 1
        if not delta.entries:
            del self._ranks[entry.rank]

    @staticmethod
    def _move(delta: RankDelta, entry: Pending, sign: int) -> None:
        delta.requests += sign * entry.requests
        delta.blocks += sign * entry.blocks
        delta.prefill += sign * entry.prefill
        delta.entries += sign
        step = sign * entry.step
        if step:
            refs, lost = delta.refs, delta.lost
            for h in entry.hashes:
                count = refs.get(h, 0) + step
                if count:
                    refs[h] = count
                else:
                    del refs[h]
                if count < 0:
                    lost.add(h)
                elif lost:
                    lost.discard(h)
