"""Folding the log again into a fresh state: from the newest snapshot (or event 1) to any point.

Because every event is applied at its log time, and every message goes through the writer's
own fold (:class:`seqstate.fold.Fold`, by the configuration's ``fold_rules``: what the writer
dead-lettered, a fold of the log skips, for the same reason), folding the stream again gives
the state the writer had at any sequence, byte for byte. A log time bound instead of a
sequence answers "what did the scheduler see at 12:03:07?". The fold starts from the newest
valid snapshot at or before its target (so it costs the tail), or from an empty state at a
given sequence.

This is the write model rebuilt, so it lives beside the writer: ``seqstate replay``,
``verify`` and ``rebuild`` (:mod:`projector.ops.replay`), ``loads --at``, the report and the
Dynamo resync all fold through it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import gc
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import api
from nats.js.api import RawStreamMsg

from projector.nats.retention import trimmed_below
from projector.nats.snapshots import SnapshotInfo, SnapshotStore, starting_points
from projector.nats.stream import first_seq_of, last_seq_of, log_time_ns
from projector.nats.stream_reader import Reader, fast_fold, start_reader
from projector.settings.config import Config
from seqstate import Fold, FoldRules, LoadRow, Refusal, SequenceState
from seqstate.errors import SeqstateError

Progress = Callable[[int, int], None]  # (events folded, events to fold)
# The fast path's reader is a process of its own: a quarter of a second to start on a busy
# machine, in which nats-py folds ~15k events. A shorter range (a snapshot's tail, say) folds
# sooner through the client.
FAST_PATH_MIN_EVENTS = 20_000


class Ticks(Protocol):
    """Told, before the fold takes the first message at or after ``next_ns`` (log time), that
    the log has got there: the state is then as of every message before it (how a report
    samples the state over time, at a cost per sample, not per event)."""

    next_ns: int

    def passed(self, at_ns: int, events: int, dead_letters: int) -> None: ...


log = logging.getLogger("seqstate.replay")


class ReplayError(SeqstateError, RuntimeError):
    """The replay asked for cannot be done exactly; the message says why."""


@dataclass
class Replayed:
    state: SequenceState
    first_seq: int  # first event folded (0: none)
    last_seq: int  # last event folded, or the snapshot's position if none
    events: int = 0
    dead_letters: int = 0
    snapshot: SnapshotInfo | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    at_ns: int | None = None  # the --at bound, when given

    @property
    def as_of_ns(self) -> int:
        """The log time the loads are evaluated at."""
        return self.at_ns if self.at_ns is not None else self.state.now_ns

    def loads(self) -> list[LoadRow]:
        return self.state.registry.loads(self.as_of_ns)


class _Folder:
    """Folds ``(seq, log_time_ns, subject, payload)`` in order through the log's one
    :class:`~seqstate.fold.Fold` (the writer's), so that a replay refuses what the writer
    dead-lettered and applies the rest; either read path feeds it. ``on_refused(seq,
    refusal)``, if given, is told of each refused message."""

    def __init__(
        self,
        state: SequenceState,
        start_seq: int,
        end_seq: int,
        until_ns: int | None,
        progress: Progress | None,
        rules: FoldRules,
        on_refused: Callable[[int, Refusal], None] | None = None,
        ticks: Ticks | None = None,
    ) -> None:
        self.fold = Fold(state, rules)
        self.ticks = ticks
        self.state = state
        self.on_refused = on_refused
        self.start_seq, self.end_seq, self.until_ns = start_seq, end_seq, until_ns
        self.progress = progress
        self.first = self.last = self.count = self.dead = 0
        self.finished = False

    def __call__(self, seq: int, at_ns: int, subject: str, data: bytes) -> bool:
        """Fold one message; False once the range (or the time bound) is done."""
        if seq > self.end_seq or (self.until_ns is not None and at_ns > self.until_ns):
            self.finished = True
            return False
        if self.ticks is not None and at_ns >= self.ticks.next_ns:
            self.ticks.passed(at_ns, self.count, self.dead)
        verdict = self.fold(seq, at_ns, subject, data)
        if type(verdict) is list:  # a record batch: its events one by one
            self.count += len(verdict) - 1
            for each in verdict:
                if type(each) is Refusal:
                    self._refused(seq, each)
        elif type(verdict) is Refusal:
            self._refused(seq, verdict)
        self.first = self.first or seq
        self.last = seq
        self.count += 1
        if self.progress is not None and not self.count & 4095:
            self.progress(seq - self.start_seq + 1, self.end_seq - self.start_seq + 1)
        if seq >= self.end_seq:
            self.finished = True
            return False
        return True

    def _refused(self, seq: int, refusal: Refusal) -> None:
        self.dead += 1
        if self.on_refused is not None:
            self.on_refused(seq, refusal)

    def fold_batch(self, batch: list[tuple[int, int, str, bytes]]) -> bool:
        """:meth:`__call__` over a batch, with the per-message work kept in one tight loop."""
        fold, on_refused, refusal = self.fold.__call__, self.on_refused, Refusal
        end = self.end_seq
        until = self.until_ns if self.until_ns is not None else 1 << 64
        ticks = self.ticks
        tick = ticks.next_ns if ticks is not None else 1 << 64
        last, folded, dead = self.last, 0, 0
        for seq, at_ns, subject, data in batch:
            if seq > end or at_ns > until:
                self.finished = True
                break
            if at_ns >= tick:
                assert ticks is not None
                ticks.passed(at_ns, self.count + folded, self.dead + dead)
                tick = ticks.next_ns
            verdict = fold(seq, at_ns, subject, data)
            if type(verdict) is refusal:
                dead += 1
                if on_refused is not None:
                    on_refused(seq, verdict)  # type: ignore[arg-type]
            elif type(verdict) is list:  # a record batch: its events one by one
                folded += len(verdict) - 1
                for each in verdict:
                    if type(each) is refusal:
                        dead += 1
                        if on_refused is not None:
                            on_refused(seq, each)
            last = seq
            folded += 1
            if seq >= end:
                self.finished = True
                break
        if folded and not self.first:
            self.first = batch[0][0]
        self.last, self.count, self.dead = last, self.count + folded, self.dead + dead
        if self.progress is not None and folded:
            self.progress(last - self.start_seq + 1, end - self.start_seq + 1)
        return not self.finished


async def fold_stream(
    nc: Client,
    config: Config,
    state: SequenceState,
    *,
    start_seq: int,
    end_seq: int,
    until_ns: int | None = None,
    progress: Progress | None = None,
    fast: bool = True,
    on_refused: Callable[[int, Refusal], None] | None = None,
    ticks: Ticks | None = None,
    reader: Reader | None = None,
) -> tuple[int, int, int, int]:
    """Fold events ``start_seq..end_seq`` (stopping before log time ``until_ns``) into
    ``state``, by the configuration's :attr:`~projector.settings.config.Config.fold_rules`, as
    the writer folds.

    Returns ``(first_seq, last_seq, events, dead_letters)`` of what was folded;
    ``on_refused(seq, refusal)`` is told of each message refused, and of each event refused
    in a record batch (``events`` counts a batch's events); ``ticks``, if given, is told as
    the log's time passes its marks. The registry is rebuilt once at the end instead of after
    every event. The fast path (a reader process, see :mod:`projector.nats.stream_reader`) is
    tried first (through ``reader``, if one was started for ``end_seq``: this ends it); if it
    gives up, the fold continues through nats-py from where it stopped.
    """
    if reader is not None and (not fast or end_seq < start_seq):
        await reader.discard()
        reader = None
    if end_seq < start_seq:
        return 0, 0, 0, 0
    folder = _Folder(
        state, start_seq, end_seq, until_ns, progress, config.fold_rules, on_refused, ticks
    )
    state.defer_registry(changes=False)
    # A replay allocates millions of objects that live on: the cyclic collector would scan
    # them again and again for cycles that the fold never makes.
    collecting = gc.isenabled()
    gc.disable()
    try:
        why: str | None = "the fast path is off"
        if fast:
            _, why = await fast_fold(
                nc, config, folder.fold_batch, start_seq=start_seq, end_seq=end_seq, reader=reader
            )
            if why is not None and not folder.finished:
                log.warning("fast replay path stopped (%s); continuing through nats-py", why)
        if why is not None and not folder.finished:
            await _fold_through_client(nc, config, folder, max(start_seq, folder.last + 1))
    finally:
        if collecting:
            gc.enable()
        state.sync_registry()
    if progress is not None:
        progress(end_seq - start_seq + 1, end_seq - start_seq + 1)
    return folder.first, folder.last, folder.count, folder.dead


async def _fold_through_client(nc: Client, config: Config, folder: _Folder, start: int) -> None:
    js = nc.jetstream()
    done = asyncio.get_running_loop().create_future()

    async def take(msg: Msg) -> None:
        if done.done():
            return
        seq, at_ns = log_time_ns(msg)
        if not folder(seq, at_ns, msg.subject, msg.data) and not done.done():
            done.set_result(None)

    sub = await js.subscribe(
        config.events_subjects,
        stream=config.events_stream,
        ordered_consumer=True,
        idle_heartbeat=1.0,
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
        config=api.ConsumerConfig(opt_start_seq=start),
        cb=take,
        pending_msgs_limit=1_000_000,
        pending_bytes_limit=1 << 30,
    )
    try:
        await done
    finally:
        await sub.unsubscribe()


async def replay(
    nc: Client,
    config: Config,
    *,
    from_seq: int | None = None,
    to_seq: int | None = None,
    at_ns: int | None = None,
    progress: Progress | None = None,
    bounds: LogBounds | None = None,
) -> Replayed:
    """The state at the end of the log, at ``to_seq`` or at log time ``at_ns``.

    ``bounds`` is what the log holds, if the caller has just looked it up (``--at`` needs it).
    """
    bounds = bounds or await log_bounds(nc, config)
    check_range(bounds, from_seq=from_seq, to_seq=to_seq, at_ns=at_ns)
    end = bounds.last_seq if to_seq is None else to_seq
    if at_ns is not None and to_seq is None:  # the fold stops at the time: bound it there too
        end = await last_seq_at(nc, config, at_ns, bounds)
    store = await SnapshotStore(nc, config).open(create=False)  # a read makes nothing
    snapshot: SnapshotInfo | None = None
    reader: Reader | None = None
    try:
        if from_seq is not None:
            state = config.new_state()
            start = from_seq
        else:
            snapshots = await store.list()
            # The tail's reader process starts while the snapshot is fetched and restored.
            if end - _planned_start(snapshots, end, at_ns) + 1 >= FAST_PATH_MIN_EVENTS:
                started = await start_reader(nc, config, end)
                reader = started if isinstance(started, Reader) else None
            state, snapshot = await starting_state(
                nc, config, store, end_seq=end, at_ns=at_ns, snapshots=snapshots
            )
            start = snapshot.applied_seq + 1 if snapshot else 1
        fold, reader = reader, None  # fold_stream ends it
        first, last, count, dead = await fold_stream(
            nc,
            config,
            state,
            start_seq=start,
            end_seq=end,
            until_ns=at_ns,
            progress=progress,
            fast=end - start + 1 >= FAST_PATH_MIN_EVENTS,
            reader=fold,
        )
    finally:
        if reader is not None:  # a snapshot could not be restored: never used
            await reader.discard()
    if from_seq is not None and not last:  # the range holds other namespaces' events only
        raise ReplayError(
            f"no event of namespace {config.namespace!r} from event {from_seq} to event {end}: "
            f"{bounds}"
        )
    return Replayed(
        state=state,
        first_seq=first,
        last_seq=last or (snapshot.applied_seq if snapshot else 0),
        events=count,
        dead_letters=dead,
        snapshot=snapshot,
        skipped=list(store.skipped),
        at_ns=at_ns,
    )


def _planned_start(snapshots: list[SnapshotInfo], end_seq: int, at_ns: int | None) -> int:
    """Where a fold to ``end_seq`` (and log time ``at_ns``) starts if the newest snapshot at or
    before it restores (``starting_state`` says for sure)."""
    newest = next(starting_points(snapshots, end_seq, at_ns), None)
    return newest.applied_seq + 1 if newest else 1


async def starting_state(
    nc: Client,
    config: Config,
    store: SnapshotStore,
    *,
    end_seq: int,
    at_ns: int | None,
    snapshots: list[SnapshotInfo] | None = None,
) -> tuple[SequenceState, SnapshotInfo | None]:
    """Where a fold to ``end_seq`` (and log time ``at_ns``) starts: the newest valid snapshot
    at or before it (among ``snapshots``, if the caller has just listed them), else an empty
    state at the first event, refused if events were trimmed that no snapshot covers."""
    found = await store.newest_valid(at_most_seq=end_seq, at_most_ns=at_ns, snapshots=snapshots)
    if found is not None:
        return found
    cut = await trimmed_below(nc, config)
    if cut > 1:
        js = nc.jetstream()
        oldest = await first_seq_of(js, config.events_stream, config.events_subjects)
        raise ReplayError(
            f"events before sequence {cut} were trimmed and no valid snapshot covers "
            f"them; use --from-seq {oldest or cut} for a partial replay"
        )
    return config.new_state(), None


# ---- what can be asked for ------------------------------------------------------------------


@dataclass(frozen=True)
class LogBounds:
    """The namespace's events in the log: sequences and log times of the oldest and newest."""

    namespace: str
    first_seq: int  # 0: the log of this namespace is empty
    last_seq: int
    first_ns: int
    last_ns: int

    def __str__(self) -> str:
        if not self.last_seq:
            return f"the log of namespace {self.namespace!r} is empty"
        return (
            f"the log of namespace {self.namespace!r} holds events {self.first_seq} to "
            f"{self.last_seq}, from {iso(self.first_ns)} to {iso(self.last_ns)}"
        )


async def log_bounds(nc: Client, config: Config) -> LogBounds:
    js = nc.jetstream()
    stream, subjects = config.events_stream, config.events_subjects
    last = await last_seq_of(js, stream, subjects)
    if last == 0:
        return LogBounds(config.namespace, 0, 0, 0, 0)
    first = await first_seq_of(js, stream, subjects) or last
    first_msg, last_msg = await js.get_msg(stream, first), await js.get_msg(stream, last)
    return LogBounds(config.namespace, first, last, _stored_ns(first_msg), _stored_ns(last_msg))


async def last_seq_at(nc: Client, config: Config, at_ns: int, bounds: LogBounds) -> int:
    """The newest event of the namespace logged at or before ``at_ns`` (or one just after it:
    stored times keep microseconds, and the fold's own time bound is exact), by a binary
    search of the stream's log times, which grow with its sequence."""
    if at_ns >= bounds.last_ns:
        return bounds.last_seq
    js = nc.jetstream()
    lo, hi = bounds.first_seq, bounds.last_seq  # lo: an event at or before at_ns
    while lo < hi:
        mid = (lo + hi + 1) // 2
        msg = await js.get_msg(config.events_stream, mid, subject=config.events_subjects, next=True)
        found = msg.seq or 0
        if found <= hi and _stored_ns(msg) <= at_ns:
            lo = found
        else:
            hi = mid - 1
    return lo


def check_range(
    bounds: LogBounds, *, from_seq: int | None, to_seq: int | None, at_ns: int | None
) -> None:
    """Refuse, naming what the log holds, a range that cannot mean anything."""
    if from_seq is not None and to_seq is not None and from_seq > to_seq:
        raise ReplayError(f"--from-seq {from_seq} is after --to-seq {to_seq}")
    if not bounds.last_seq:
        raise ReplayError(str(bounds))
    if to_seq is not None and not 1 <= to_seq <= bounds.last_seq:
        raise ReplayError(f"--to-seq {to_seq} is outside the log: {bounds}")
    if from_seq is not None and not bounds.first_seq <= from_seq <= bounds.last_seq:
        raise ReplayError(f"--from-seq {from_seq} is outside the log: {bounds}")
    if at_ns is not None and at_ns < bounds.first_ns:
        raise ReplayError(f"--at {iso(at_ns)} is before the first event: {bounds}")


def _stored_ns(msg: RawStreamMsg) -> int:
    """A stored message's log time, to the microsecond (what nats-py parses)."""
    moment = msg.time
    if moment is None:  # pragma: no cover - the server always stamps stored messages
        raise ReplayError(f"event {msg.seq} has no log time")
    return _ns(moment)


def iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).isoformat(timespec="microseconds")


# ---- --at ------------------------------------------------------------------------------------


def parse_at(text: str, reference_ns: int) -> int:
    """An ISO 8601 instant (UTC unless it says otherwise), or a time of day on the log's date.

    A bare ``12:03:07`` means that time (UTC) on the day of the log's newest event, or the day
    before if that would be later than the newest event.
    """
    try:
        moment = dt.datetime.fromisoformat(text)
    except ValueError:
        try:
            clock = dt.time.fromisoformat(text)
        except ValueError:
            raise ReplayError(f"--at {text!r}: not an ISO time or time of day") from None
        day = dt.datetime.fromtimestamp(reference_ns / 1e9, dt.UTC).date()
        moment = dt.datetime.combine(day, clock, tzinfo=clock.tzinfo or dt.UTC)
        if _ns(moment) > reference_ns:
            moment -= dt.timedelta(days=1)
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=dt.UTC)
    return _ns(moment)


def _ns(moment: dt.datetime) -> int:
    delta = moment - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000
