"""The writer's snapshots: so that a restart folds the tail, not the history.

A snapshot is taken between two events, so that it is exactly the fold up to one sequence
and a restart from it rebuilds the very state an uninterrupted writer has; it is encoded at
once for that reason and stored in the background, so the fold does not wait on the server.
It is stored only once every delta it reflects is: a restart from a snapshot ahead of the
deltas would skip them. A save is bounded in time: a snapshot is an optimisation, the log
still holds everything, so a failed one is counted and the writer goes on.

Each saved snapshot is read back (by the store) before older ones are pruned and the events
only they needed are trimmed; a start that finds the beginning of the log trimmed and no valid
snapshot to cover it refuses, since it could not rebuild the state exactly.

Two kinds of snapshot share one cadence. The newest one serves a restart, and is spaced by
its cost (count, size, encode time, one save at a time). A history snapshot serves a look back
(``loads --at``, ``replay``): the first event at or past each multiple of
``snapshot_history_every`` gets one, whatever the cost-based spacing says, so that a look back
folds fewer than that many events from the snapshot before it; a save under way does not hold
it back either, it is stored right after. It costs one encode per ``history_every`` events at
most, and resets the cost-based spacing as any snapshot does; one by count is left out when a
history snapshot comes sooner than the next by count would.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from projector.aio.tasks import cancel
from projector.nats.failures import describe
from projector.nats.retention import Retention
from projector.nats.snapshots import SnapshotInfo, SnapshotStore
from projector.write.delta_log import DeltaLog, WriterStalled
from seqstate import SequenceState
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.writer")  # an operator reads these as the writer's lines

SNAPSHOT_TIMEOUT_S = 30.0  # a snapshot not stored by then is given up: the log has it all
# The share of the fold's time that encoding snapshots may take. Encoding holds the event loop
# (the snapshot must be one consistent cut of the fold), and its cost grows with the model: at
# 2M active hashes it takes tens of milliseconds. Snapshotting every 10,000 events at 10k
# events/s would then stall the fold for several percent of its time, and every event behind
# a stall waits for it. So the next snapshot is not due before the last encode's duration,
# divided by this share, has passed: restarts fold a slightly longer tail, events stay fresh.
# Storing it costs the loop too (its chunks, their digests, the read-back): counted as
# ``SAVE_S_PER_BYTE``, the cost per byte measured on a writer catching up over a million
# events, so that a cheaper encode does not buy more saves than the share pays for.
ENCODE_SHARE = 0.02
SAVE_S_PER_BYTE = 20e-9
# Bytes of snapshot per event folded since the last one, at most, when snapshotting by count.
# A snapshot costs work in proportion to its size (encoding, the digest, storing its chunks,
# reading them back before older ones are pruned: about 40 ns a byte here, and as much again
# in the server), and the ended ids it keeps make it grow with the traffic, not with the load:
# 250,000 ended ids are ~5 MB. Every 10,000 events, that cost more than the events themselves.
# So a large snapshot is taken only every ``size / 64`` events (~2.5 µs an event), and a
# restart folds a tail in proportion to the snapshot it starts from.
BYTES_PER_EVENT = 64
FINAL_SNAPSHOT_S = 10.0  # what a clean stop spends on snapshots, within the CLI's 15 s
NO_HISTORY = 1 << 64  # past any sequence: no history snapshot is ever owed


class SnapshotUnavailable(SeqstateError, RuntimeError):
    """The log's beginning is gone and no valid snapshot covers it."""


@dataclass
class SnapshotStats:
    restored_from: int = 0  # the snapshot's sequence the writer started from (0: none)
    snapshots_saved: int = 0
    snapshot_failures: int = 0
    last_snapshot_seq: int = 0
    # The newest snapshot this writer stored (or started from): its size, and when it was
    # stored (wall clock, seconds since the epoch; None: none known). The metrics read them.
    last_snapshot_bytes: int = 0
    last_snapshot_stored_s: float | None = None
    trimmed_below: int = 0  # events below this sequence were trimmed by this writer


@dataclass(frozen=True)
class SnapshotSettings:
    """How often a writer snapshots its fold, and how many snapshots it keeps."""

    every_events: int  # 0: never by count
    every_s: float  # 0: never by time
    keep: int
    history_every: int | None = None  # None: no history snapshots
    history_keep: int = 0


class Snapshotter:
    """Snapshots of one writer's fold, kept in ``store`` (None: the writer takes none).

    The fold tells it where it stands (its state and the sequence of its last event) after
    each event and on each idle round. ``stats`` are the writer's (it reports them);
    ``retention`` trims the events the kept snapshots make redundant.
    """

    def __init__(
        self,
        store: SnapshotStore | None,
        settings: SnapshotSettings,
        retention: Retention,
        stats: SnapshotStats,
        deltas: DeltaLog,
    ) -> None:
        self.store = store
        self.settings = settings
        self.stats = stats
        self._retention = retention
        self._deltas = deltas
        self._on_failure: Callable[[BaseException], None] = _unheard
        self._task: asyncio.Task[None] | None = None
        self._taken_at = 0.0  # monotonic time of the last snapshot taken (per event: no loop)
        self._encode_s = 0.0  # how long encoding it took
        self._taken_bytes = 0  # its size (or the one restored from)
        # The first sequence owed a history snapshot (past the last one taken or restored).
        self._history_at = self._next_history(0)
        self._queued = False  # a history snapshot waits for the save before it
        self.quiet = False  # saves say nothing (at debug): the writer is stopping

    @property
    def skipped(self) -> list[tuple[str, str]]:
        """``(name, why)`` of each snapshot a restore passed over."""
        return self.store.skipped if self.store is not None else []

    async def open(self, on_failure: Callable[[BaseException], None]) -> None:
        """Start; ``on_failure`` hears of a delta log that stalled under a save, which stops
        the writer as any stalled delta does."""
        self._on_failure = on_failure
        self._taken_at = time.monotonic()
        if self.store is not None:
            await self.store.open()

    async def restore(
        self, at_most_seq: int, *, registry: bool = True
    ) -> tuple[SequenceState, SnapshotInfo] | None:
        """The newest valid snapshot at or before ``at_most_seq``, whose deltas are all stored
        (``registry=False``: its registry left deferred, unbuilt)."""
        if self.store is None:
            return None
        found = await self.store.newest_valid(at_most_seq=at_most_seq, registry=registry)
        if found is None:
            return None
        _, info = found
        self.stats.restored_from = self.stats.last_snapshot_seq = info.applied_seq
        self.stats.last_snapshot_bytes = self._taken_bytes = info.size
        self.stats.last_snapshot_stored_s = _epoch_s(info.modified)
        self._history_at = self._next_history(info.applied_seq)
        log.info(
            "restored the write model from snapshot %s (event %d)", info.name, info.applied_seq
        )
        return found

    async def check_coverage(self, applied_seq: int) -> None:
        """Refuse to fold a log whose beginning was trimmed when no snapshot covers it."""
        if applied_seq:
            return
        cut = await self._retention.trimmed_below()
        if cut > 1:
            skipped = "; ".join(f"{n}: {why}" for n, why in self.skipped)
            raise SnapshotUnavailable(
                f"events before sequence {cut} were trimmed and no valid snapshot "
                f"covers them, so the state cannot be rebuilt exactly"
                + (f" (skipped {skipped})" if skipped else "")
            )

    def _next_history(self, seq: int) -> int:
        """The first multiple of ``history_every`` past ``seq`` (none when history is off)."""
        every = self.settings.history_every
        if not every or not self.settings.history_keep:
            return NO_HISTORY
        return (seq // every + 1) * every

    def due(self, seq: int) -> bool:
        """Whether the fold at event ``seq`` is owed a snapshot: for history (see the module's
        docstring), by events or by seconds."""
        if self.store is None or seq <= self.stats.last_snapshot_seq:
            return False
        if seq >= self._history_at:
            # A history snapshot waits for no save but one already waiting: a queue that
            # stays one long, whatever the server's pace.
            return not self._queued
        if self._task is not None and not self._task.done():
            return False
        since = time.monotonic() - self._taken_at
        if since < (self._encode_s + self._taken_bytes * SAVE_S_PER_BYTE) / ENCODE_SHARE:
            return False
        every = self.settings.every_events
        if every:
            spacing = max(every, self._taken_bytes // BYTES_PER_EVENT)
            # One due by count is not taken when a history snapshot comes sooner than the
            # next one by count would: that one serves a restart as well.
            if seq - self.stats.last_snapshot_seq >= spacing and self._history_at - seq >= spacing:
                return True
        every_s = self.settings.every_s
        return bool(every_s) and since >= every_s

    def take_if_due(self, state: SequenceState, seq: int) -> None:
        if self.due(seq):
            self.take(state, seq)

    def take(self, state: SequenceState, seq: int) -> None:
        """Encode ``state`` now, while it is the fold up to ``seq``; store it in the background."""
        at_ns = state.now_ns
        started = time.perf_counter()
        data = state.snapshot()
        self._encode_s = time.perf_counter() - started
        self._taken_bytes = len(data)  # what the next one is spaced by
        self.stats.last_snapshot_seq = seq
        self._history_at = self._next_history(seq)
        self._taken_at = time.monotonic()
        before = self._task
        if before is None or before.done():
            self._task = asyncio.create_task(self._save(data, seq, at_ns))
        else:
            self._queued = True
            self._task = asyncio.create_task(self._save_after(before, data, seq, at_ns))

    async def _save_after(
        self, before: asyncio.Task[None], data: bytes, seq: int, at_ns: int
    ) -> None:
        """Save once the save ``before`` it is done (it never raises: it counts its failure;
        cancelling this one cancels it too), so that snapshots are stored in their order."""
        try:
            await before
        finally:
            self._queued = False
        await self._save(data, seq, at_ns)

    async def now(self, state: SequenceState, seq: int) -> None:
        """Take and store a snapshot of the fold so far (operators, tests)."""
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        self.take(state, seq)
        assert self._task is not None
        await self._task

    async def final(self, state: SequenceState, seq: int) -> None:
        """On a clean stop: the last snapshot, within ``FINAL_SNAPSHOT_S`` (a stop must end)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FINAL_SNAPSHOT_S
        if self._task is not None:
            await asyncio.wait([self._task], timeout=FINAL_SNAPSHOT_S / 2)
            await cancel(self._task)
        if self.store is not None and seq > self.stats.last_snapshot_seq:
            self.take(state, seq)
            assert self._task is not None
            await asyncio.wait([self._task], timeout=max(0.0, deadline - loop.time()))
            if not self._task.done():
                log.warning(
                    "the final snapshot did not finish in time: a restart folds a longer tail"
                )
                await cancel(self._task)

    async def settle(self, timeout: float) -> None:
        """Let a save under way finish, for ``timeout`` seconds at most; take none."""
        if self._task is not None:
            await asyncio.wait([self._task], timeout=timeout)

    async def close(self) -> None:
        await cancel(self._task)

    async def _save(self, data: bytes, seq: int, at_ns: int) -> None:
        try:
            # A save caught in a server restart can wait on a reply that never comes.
            await asyncio.wait_for(self._store(data, seq, at_ns), SNAPSHOT_TIMEOUT_S)
        except WriterStalled as exc:
            self._on_failure(exc)
        except Exception as exc:  # a snapshot is an optimisation: the log still has it all
            self.stats.snapshot_failures += 1
            log.warning("snapshot at event %d failed: %s", seq, describe(exc))

    async def _store(self, data: bytes, seq: int, at_ns: int) -> None:
        assert self.store is not None
        # A snapshot must never get ahead of the deltas: a restart from it would skip them.
        await self._deltas.flush()
        info = await self.store.save(data, seq, at_ns)
        self.stats.snapshots_saved += 1
        self.stats.last_snapshot_bytes = len(data)
        self.stats.last_snapshot_stored_s = time.time()
        settings = self.settings
        await self.store.prune(settings.keep, settings.history_every, settings.history_keep)
        log.log(
            logging.DEBUG if self.quiet else logging.INFO,
            "snapshot %s saved and verified (%d bytes)",
            info.name,
            len(data),
        )
        await self._trim()

    async def _trim(self) -> None:
        """Drop events older than the oldest kept snapshot (minus the configured margin)."""
        if self._retention.retain_events is None or self.store is None:
            return
        kept = await self.store.list()
        cut = await self._retention.trim(kept, self.stats.trimmed_below)
        if cut != self.stats.trimmed_below:
            self.stats.trimmed_below = cut
            log.info("trimmed events below sequence %d", cut)


def _unheard(exc: BaseException) -> None:
    """Before :meth:`Snapshotter.open` nothing is saved, so nothing can fail."""
    raise exc


def _epoch_s(modified: str) -> float | None:
    """An object's modification time (RFC 3339; Python's parser drops digits past the
    microsecond) in seconds since the epoch; None when the store gave none, or one that does
    not parse."""
    try:
        at = dt.datetime.fromisoformat(modified.strip())
    except ValueError:
        return None
    return (at if at.tzinfo else at.replace(tzinfo=dt.UTC)).timestamp()
