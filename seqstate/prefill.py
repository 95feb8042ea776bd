"""Prefill load of one worker rank: what is still to be prefilled, and how fast it drains.

The tracker keeps active prefills in FIFO order. The oldest one is the *anchor*: decay is
measured from its anchor time. The tracker is written on mutations only; reads go through a
time-free :class:`PrefillSnapshot`, so a reader anywhere (the projector, a scheduler holding
a KV replica) evaluates decay at its own ``now`` with exactly this module's math.

All arithmetic is integer (nanoseconds, tokens) so results are exact and identical on every
machine; Dynamo's f64 evaluation can differ from the exact rational value by one token in the
anchor-only path, where we take the exact ceiling.
"""

from __future__ import annotations

from collections import deque

from msgspec import Struct

NS_PER_MS = 1_000_000


class PrefillSnapshot(Struct, array_like=True, frozen=True, gc=False):
    """Time-free view of a rank's prefill state; decay is evaluated at read time.

    ``anchored_since_ns`` is None when nothing is prefilling. ``modeled_ms`` is the sum of the
    whole-millisecond durations of all active prefills, or None as soon as one lacks a
    duration (Dynamo's MissingExpectedDuration).
    """

    full_tokens: int = 0
    anchor_tokens: int = 0
    anchor_duration_ns: int | None = None
    anchored_since_ns: int | None = None
    modeled_ms: int | None = 0

    def active_tokens(self, now_ns: int) -> int:
        """Prefill tokens still pending at ``now_ns`` (decayed)."""
        since = self.anchored_since_ns
        if since is None:
            return 0
        elapsed = now_ns - since
        if elapsed < 0:
            elapsed = 0
        duration = self.anchor_duration_ns
        tokens = self.anchor_tokens
        if self.modeled_ms is None:
            # Some prefill is unmodeled: only the anchor decays, and never past its own tokens.
            if duration is None:
                remaining = tokens
            elif duration == 0 or elapsed >= duration:
                remaining = 0
            else:
                remaining = -((-tokens * (duration - elapsed)) // duration)
            return self.full_tokens - tokens + remaining
        # Every prefill is modeled: the anchor's rate keeps draining later prefills (spillover).
        completed = tokens if duration == 0 else tokens * elapsed // duration  # type: ignore[operator]
        left = self.full_tokens - completed
        return left if left > 0 else 0

    def modeled_remaining_ms(self, now_ns: int) -> int | None:
        """Modeled milliseconds of prefill left at ``now_ns``; None if any prefill is unmodeled."""
        modeled = self.modeled_ms
        if modeled is None:
            return None
        since = self.anchored_since_ns
        if since is None:
            return modeled
        if self.anchor_duration_ns is None:  # cannot happen while modeled_ms is known
            return None
        elapsed_ms = (now_ns - since) // NS_PER_MS if now_ns > since else 0
        left = modeled - elapsed_ms
        return left if left > 0 else 0


EMPTY_PREFILL = PrefillSnapshot()


class PrefillTracker:
    """FIFO of active prefills with an anchor, aggregate sums, and the non-anchor credit.

    ``prefills`` maps request id to ``(tokens, duration_ns | None)`` in insertion order; the
    first key is the anchor. Sums are kept incrementally so a snapshot is O(1). ``_queue``
    repeats the order as ``(request_id, entry)`` pairs so the next anchor is found in O(1)
    amortised (a dict's first key costs a scan over deleted slots); a pair is stale once its
    entry object is no longer the one in ``prefills``.
    """

    __slots__ = (
        "_queue",
        "_snapshot",
        "anchor_id",
        "anchor_ns",
        "full_tokens",
        "modeled_ms_sum",
        "prefills",
        "unmodeled",
    )

    def __init__(self) -> None:
        self.prefills: dict[str, tuple[int, int | None]] = {}
        self._queue: deque[tuple[str, tuple[int, int | None]]] = deque()
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
        entry = (tokens, duration_ns)
        self.prefills[request_id] = entry
        self._queue.append((request_id, entry))
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
        if request_id == self.anchor_id:
            # The next prefill starts its own decay now; no credit.
            queue = self._queue
            while queue and prefills.get(queue[0][0]) is not queue[0][1]:
                queue.popleft()
            if queue:
                self.anchor_id = queue[0][0]
                self.anchor_ns = now_ns
            else:
                self.anchor_id = self.anchor_ns = None
        else:
            if len(self._queue) > 2 * len(prefills) + 64:
                self._queue = deque(prefills.items())
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
        live = [rid for rid, entry in self._queue if self.prefills.get(rid) is entry]
        assert live == list(self.prefills), "FIFO queue disagrees with the prefill order"
        assert all(t > 0 for t, _ in entries)
