"""Prefill load of one worker rank: what is still to be prefilled, and how fast it drains.

The tracker keeps active prefills in FIFO order. The oldest one is the *anchor*: decay is
measured from its anchor time. The tracker is written on mutations only; reads go through a
time-free :class:`PrefillSnapshot`, so a reader anywhere (the projector, a scheduler holding
a KV replica) evaluates decay at its own ``now`` with exactly this module's math.

The snapshot type and its decay math live in :mod:`seqstate.loads`.
"""

from __future__ import annotations

from collections import deque

from seqstate.decay import NS_PER_MS
from seqstate.loads import EMPTY_PREFILL, PrefillSnapshot


class PrefillTracker:
    """FIFO of active prefills with an anchor, aggregate sums, and the non-anchor credit.

    ``prefills`` maps request id to ``(tokens, duration_ns | None)`` in insertion order; the
    first key is the anchor. Sums are kept incrementally so a snapshot is O(1). ``_queue``
    repeats the order as ``(request_id, stamp)`` pairs so the next anchor is found in O(1)
    amortised (a dict's first key costs a scan over deleted slots); a pair is stale once the
    id's current stamp in ``_stamps`` differs (or the id is gone). Stamps, not object
    identity, because compiled code does not preserve the identity of tuples.
    """

    __slots__ = (
        "_queue",
        "_snapshot",
        "_stamp",
        "_stamps",
        "anchor_id",
        "anchor_ns",
        "full_tokens",
        "modeled_ms_sum",
        "prefills",
        "unmodeled",
    )

    def __init__(self) -> None:
        self.prefills: dict[str, tuple[int, int | None]] = {}
        self._queue: deque[tuple[str, int]] = deque()
        self._stamps: dict[str, int] = {}
        self._stamp = 0
        self.full_tokens = 0
        self.unmodeled = 0
        self.modeled_ms_sum = 0
        self.anchor_id: str | None = None
        self.anchor_ns: int | None = None
        self._snapshot: PrefillSnapshot | None = EMPTY_PREFILL

    def __len__(self) -> int:
        return len(self.prefills)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.prefills

    @property
    def anchor(self) -> tuple[str, int] | None:
        """``(request_id, anchor_ns)`` of the oldest active prefill, or None."""
        if self.anchor_id is None or self.anchor_ns is None:
            return None
        return self.anchor_id, self.anchor_ns

    @property
    def order(self) -> list[str]:
        return list(self.prefills)

    def insert(self, request_id: str, tokens: int, duration_ns: int | None, now_ns: int) -> None:
        self.prefills[request_id] = (tokens, duration_ns)
        self._stamp = stamp = self._stamp + 1
        self._stamps[request_id] = stamp
        self._queue.append((request_id, stamp))
        self.full_tokens += tokens
        if duration_ns is None:
            self.unmodeled += 1
        else:
            self.modeled_ms_sum += duration_ns // NS_PER_MS
        if self.anchor_id is None:
            self.anchor_id = request_id
            self.anchor_ns = now_ns
        self._snapshot = None

    def remove(self, request_id: str, now_ns: int) -> tuple[int, int | None] | None:
        """Drop a prefill (mark, free or expiry); returns its state, or None if not tracked."""
        prefills = self.prefills
        state = prefills.get(request_id)
        if state is None:
            return None
        tokens, duration_ns = state
        self.full_tokens -= tokens
        if duration_ns is None:
            self.unmodeled -= 1
        else:
            self.modeled_ms_sum -= duration_ns // NS_PER_MS
        del prefills[request_id]
        stamps = self._stamps
        del stamps[request_id]
        if request_id == self.anchor_id:
            # The next prefill starts its own decay now; no credit.
            queue = self._queue
            while queue and stamps.get(queue[0][0]) != queue[0][1]:
                queue.popleft()
            if queue:
                self.anchor_id = queue[0][0]
                self.anchor_ns = now_ns
            else:
                self.anchor_id = self.anchor_ns = None
        else:
            if len(self._queue) > 2 * len(prefills) + 64:
                self._queue = deque(stamps.items())
            if duration_ns is None:
                self._snapshot = None
                return state
            # Completed non-anchor work consumed part of the elapsed time: shift the anchor by
            # its modeled duration, never past the removal time.
            shifted = self.anchor_ns + duration_ns  # type: ignore[operator]
            self.anchor_ns = shifted if shifted < now_ns else now_ns
        self._snapshot = None
        return state

    def snapshot(self) -> PrefillSnapshot:
        snap = self._snapshot
        if snap is None:
            if self.anchor_id is None:
                snap = EMPTY_PREFILL
            else:
                tokens, duration_ns = self.prefills[self.anchor_id]
                snap = PrefillSnapshot(
                    self.full_tokens,
                    tokens,
                    duration_ns,
                    self.anchor_ns,
                    None if self.unmodeled else self.modeled_ms_sum,
                )
            self._snapshot = snap
        return snap

    def check_invariants(self) -> None:
        """Recompute every aggregate from the entries (tests and debugging)."""
        entries = list(self.prefills.values())
        assert self.full_tokens == sum(t for t, _ in entries)
        assert self.unmodeled == sum(1 for _, d in entries if d is None)
        assert self.modeled_ms_sum == sum(d // NS_PER_MS for _, d in entries if d is not None)
        assert (self.anchor_ns is None) == (not entries)
        assert self.anchor_id == next(iter(self.prefills), None)
        assert list(self._stamps) == list(self.prefills)
        live = [rid for rid, stamp in self._queue if self._stamps.get(rid) == stamp]
        assert live == list(self.prefills), "FIFO queue disagrees with the prefill order"
        assert all(t > 0 for t, _ in entries)
