"""The writer: folds SEQSTATE_EVENTS, in stream order, into the write model and publishes deltas.

Each event is applied at its JetStream timestamp (the time the log received it), so a replay
anywhere rebuilds the same state. The writer is a processor for an
:class:`~projector.nats.consumer.OrderedConsumer`, which hands it the events in stream order, gap-
free, from the first message, so a restarted writer rebuilds its state from the log; it
republishes no delta the DELTAS stream already holds: it reads the source sequence of the last
delta first, folds up to it silently, and publishes from the next. Its
:class:`~projector.write.snapshotter.Snapshotter` lets a restart start from a snapshot instead,
so that it costs the tail, not the history.

Deltas go to SEQSTATE_DELTAS through a :class:`~projector.write.delta_log.DeltaLog`: one append
in flight (an atomic batch of messages where the server has them), each stored whole right
after the previous one (a compare-and-set on the subject's last sequence), so the chain has no
hole even when the server crashes, and what is folded while an append travels gathers into the
next one.

Each message is folded by a :class:`seqstate.fold.Fold`, the one fold every reader of the log
(replay, rebuild, verify) uses, so they cannot disagree on it: one too large, that does not
decode, on another subject than its own, or that would pass a bound of the write model is
refused (:class:`~projector.nats.stream.Refused`): the runner dead-letters it with the reason and
its sequence, the writer counts it and goes on. When the stream is
idle, and at least every ``tick_every_s`` when it is not, the writer publishes a Tick, so that
expiry (and forgetting idle lazy ranks) happens at a time the log recorded.

Everything it works with (the delta log, the snapshotter, the dead letters, the server's
provisioning) is built by :mod:`projector.run.assemble` and handed in; it reads only
:class:`WriterSettings` of the configuration.

Its lag (events stored but not folded yet, and how long the oldest has waited) is looked up
every ``lag_check_s`` (:mod:`projector.nats.lag`): ``writer.lag`` is the last measurement, and
the log says when the writer falls behind (``behind_warn_events``, ``behind_warn_s``) and when
it has caught up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from projector.aio.progress import Progress
from projector.aio.tasks import cancel, until_set
from projector.nats.consumer import OrderedConsumer
from projector.nats.dead_letters import LOG_EVERY_S
from projector.nats.failures import describe, explain, refusal
from projector.nats.feed import DEFAULT_WINDOW
from projector.nats.host import Host
from projector.nats.lag import Lag, LagWatch, LagWatched, WatchSettings
from projector.nats.stream import DeadLetterSink, Refused, log_time_ns
from projector.settings.logs import Quiet, event_fields
from projector.wire import msg_ids
from projector.wire.headers import MSG_ID, STREAM_SOURCE
from projector.wire.sizes import EVENT_ROOM, largest_event
from projector.write.delta_log import ACK_TIMEOUT_S, DeltaLog
from projector.write.snapshotter import SnapshotStats, Snapshotter
from seqstate import (
    Delta,
    Event,
    Fold,
    FoldRules,
    Refusal,
    SequenceState,
    Tick,
    encode_event,
)
from seqstate.batches import decode_batch
from seqstate.deltas import APPLIED, Hole
from seqstate.errors import SeqstateError
from seqstate.fold import Verdict, event_of
from seqstate.recent import NEVER

log = logging.getLogger("seqstate.writer")
FORWARD_AT_START_S = 60.0  # for the capture's backlog to reach the log before the fold starts
SETTLE_S = 0.5  # what a prompt stop gives a snapshot save under way to finish

# (stream sequence, the fold's verdict: of a record batch, one per event); (0, None): never
# folded by this writer
FoldListener = Callable[[int, Verdict | list[Verdict] | None], None]


# At most one Tick a second for a due lease scan (while the idle rule would wait longer).
LEASE_TICK_S = 1.0


class Forwarder(Protocol):
    """What the writer runs beside its fold when a Dynamo namespace is captured: the
    capture's forwarder (:class:`projector.dynamo.forward.CaptureForwarder`), handed in by
    :mod:`projector.run.assemble` so that the write model knows nothing of Dynamo."""

    async def forward_waiting(self, timeout: float) -> int: ...

    async def run(self) -> None: ...


@dataclass
class WriterStats(SnapshotStats):
    applied: int = 0
    dead_letters: int = 0
    deltas_published: int = 0
    ticks_published: int = 0
    last_delta_seq: int = 0  # source sequence of the last delta handed to the delta log
    last_seq: int = 0  # outcomes are counted by the state itself: state.counters
    # its own publishes to the events stream (Ticks) that were not stored, by why
    publishes_refused: dict[str, int] = field(default_factory=dict)


class EventLimitUnfit(SeqstateError, ValueError):
    """The fold's event limit is over what this server can store the delta of."""


def check_event_limit(max_payload: int, max_event_bytes: int) -> None:
    """The fold's size rule is a setting, the same for every fold of the log; the delta of
    the largest event it takes must still fit this server's messages (else EventLimitUnfit).
    """
    fits = largest_event(max_payload)
    if max_event_bytes > fits:
        raise EventLimitUnfit(
            f"max_event_bytes={max_event_bytes}: over the {fits:,} bytes of event whose delta "
            f"this server can store (its max_payload of {max_payload:,} less {EVENT_ROOM:,}); "
            f"set --max-event-bytes (SEQSTATE_MAX_EVENT_BYTES) to at most {fits}, the same for "
            "every fold of the log"
        )


@dataclass(frozen=True)
class WriterSettings:
    """What the writer reads of the configuration: its names, its ticks and its fold's rules."""

    namespace: str
    events_stream: str
    events_subjects: str
    control_subject: str
    idle_tick_s: float
    tick_every_s: float
    fold: FoldRules
    window: int = DEFAULT_WINDOW  # events received and not yet folded, at most (catch-up memory)
    # Keep the registry current on every event (about a third of the fold's cost): for a
    # process that answers reads from the write model itself (serve-http's lease holder).
    keep_registry: bool = False


class Writer(LagWatched):
    """One writer per namespace. ``await writer.run()`` until cancelled or ``stop()``.

    Built by :func:`projector.run.assemble.build_writer`. ``state`` is the fold to go on
    from; ``restore``: whether to replace it by the newest valid snapshot first (a state the
    caller hands in is kept as it is). ``stats`` are shared with the snapshotter, which keeps
    the snapshot counters. ``measure_lag(folded)`` looks the lag up on the server;
    ``rules_differing(state)`` says how a restored state's rules differ from the settings.

    ``writer.lag`` (the last measurement) and ``await writer.measure_lag()`` (one now): events
    stored but not folded yet, and the oldest one's log time."""

    def __init__(
        self,
        nc: Client,
        settings: WriterSettings,
        *,
        state: SequenceState,
        restore: bool,
        stats: WriterStats,
        deltas: DeltaLog,
        snapshotter: Snapshotter,
        dead_letters: DeadLetterSink,
        host: Host,
        lag: WatchSettings,
        measure_lag: Callable[[int], Awaitable[Lag]],
        rules_differing: Callable[[SequenceState], list[str]],
        forwarder: Forwarder | None = None,
    ) -> None:
        self.nc = nc
        self.settings = settings
        self._restore_first = restore
        # The fold every reader of the log shares: the writer's verdicts are replay's.
        self._fold = Fold(state, settings.fold)
        # A writer rarely reads its registry (readers build theirs from the bucket), and
        # keeping it current is about a third of the fold's cost.
        if not settings.keep_registry:
            state.defer_registry()
        # msg id -> who waits for the fold of that message (await_fold)
        self._awaited: dict[str, FoldListener] = {}
        self.stats = stats
        self._js: JetStreamContext = nc.jetstream()
        self.dead_letters = dead_letters  # written by the runner; counted (metrics) there
        self.deltas = deltas
        self.snapshotter = snapshotter
        self.snapshots = snapshotter.store
        self._host = host
        self._lag_of = measure_lag
        self._rules_differing = rules_differing
        # Stores the namespace's captured Dynamo messages into the log, bursts as batches.
        self.forwarder = forwarder
        self._published_up_to = 0
        # Holes logged: the first at once, then one line per interval (``_log_hole``).
        self._holes_quiet = Quiet(LOG_EVERY_S, self._say_held_holes)
        self._holes_held: list[Any] = [0, 0, ""]  # holes, messages missing, the last one said
        # Ticks refused (a full stream is retried every idle_tick_s / 4): said as holes are.
        self._ticks_quiet = Quiet(LOG_EVERY_S, self._say_held_ticks)
        self._ticks_held: list[Any] = [0, ""]  # Ticks not logged, the last reason
        self._tick_tag = ""  # read at the first Tick
        self._last_event_at = 0.0
        # The loop's clock, looked up once: asking for the running loop per event cost a
        # system call per event (it checks the process id).
        self._clock: Callable[[], float] = time.monotonic
        self._stopping = asyncio.Event()
        self._final_snapshot = True
        self._failure: BaseException | None = None
        self.applied = Progress()  # the sequence of the last event folded
        # The Dynamo publishers the write model had heard when this writer began to read the
        # log (its snapshot's): one first heard in the catch-up published while no writer
        # ran, so a frontend behind it may have started blind (the follower resyncs it).
        self.heard_before_start: frozenset[int] = frozenset()
        self._events = OrderedConsumer(
            self._js,
            settings.events_stream,
            settings.events_subjects,
            self,
            on_failure=self._fold_failed,
            position=self.applied,
            dead_letters=dead_letters,
            window=settings.window,
        )
        self.caught_up = self._events.caught_up
        self.lag_watch = LagWatch("writer", self._measure_lag, lag, log)

    @property
    def namespace(self) -> str:
        return self.settings.namespace

    @property
    def state(self) -> SequenceState:
        """The write model as folded so far."""
        return self._fold.state

    @state.setter
    def state(self, state: SequenceState) -> None:
        self._fold.state = state

    def _check_event_limit(self) -> None:
        check_event_limit(self.nc.max_payload, self.settings.fold.max_event_bytes)

    async def run(self) -> None:
        async with self._host.announce("writer", self.status):
            await self._run()

    def status(self) -> dict[str, Any]:
        """What ``nats micro stats`` and the status endpoint show (projector.nats.services)."""
        lag, stats = self.lag, self.stats
        return {
            "kind": "writer",
            "namespace": self.settings.namespace,
            "applied_seq": self.applied.value,
            "applied": stats.applied,
            "deltas_published": stats.deltas_published,
            "dead_letters": stats.dead_letters,
            "ticks_published": stats.ticks_published,
            "last_snapshot_seq": stats.last_snapshot_seq,
            "snapshots_saved": stats.snapshots_saved,
            "lag_events": lag.events,
            "lag_s": lag.oldest_age_s,
            "captured_waiting": lag.captured,
            "publishes_refused": dict(stats.publishes_refused),
            "outcomes": {k: n for k, n in sorted(self.state.counters.items()) if n},
            **({"dynamo": publishers.report()} if (publishers := self.state.publishers) else {}),
        }

    async def _run(self) -> None:
        self._clock = asyncio.get_running_loop().time
        self._check_event_limit()
        # Provisioning asks again while a restarting server is silent: a stop must not wait.
        await until_set(self._stopping, self._host.provision())
        if self._stopping.is_set():  # stopped while provisioning: nothing started
            self._release_awaited()
            return
        await self.deltas.take_batches()
        self._published_up_to = await self.deltas.open()
        self.stats.last_delta_seq = self._published_up_to
        await self.snapshotter.open(on_failure=self._fail)
        if self._restore_first:
            await until_set(self._stopping, self._restore())
        if self._stopping.is_set():  # stopped while starting: nothing folded, nothing owed
            self._release_awaited()
            if self._failure is not None:
                raise self._failure
            return
        await self.snapshotter.check_coverage(self.applied.value)
        self.heard_before_start = frozenset(self.state.publishers.entries)
        await self._forward_backlog()
        # The stream may carry other namespaces: caught up means up to this namespace's newest
        # event, and a restored state starts the consumer after its last one.
        await self._events.start(after=self.applied.value)
        if not (self.caught_up.is_set() or self._stopping.is_set()):
            log.info(
                "writer catching up: folding the log from event %d to event %d",
                self.applied.value + 1,
                self.catching_up_to,
                extra={"namespace": self.settings.namespace, "stream_seq": self.applied.value},
            )
        self.deltas.start(self._fail)
        ticker = asyncio.create_task(self._tick_when_idle())
        watcher = asyncio.create_task(self.lag_watch.run(), name="seqstate-writer-lag")
        forwarder = asyncio.create_task(self._forward(), name="seqstate-capture-forwarder")
        try:
            await self._stopping.wait()
            await cancel(watcher)  # a stop is no news of a lag
            await cancel(forwarder)
            await self._events.stop()
            if self._failure is None:
                await self.flush()
                if self._final_snapshot:
                    await self.snapshotter.final(self.state, self.stats.last_seq)
                else:  # a save under way is let finish (briefly), not cut into orphan chunks
                    await self.snapshotter.settle(SETTLE_S)
        finally:
            self._holes_quiet.flush()
            self._ticks_quiet.flush()
            self._release_awaited()
            await cancel(watcher)
            await cancel(forwarder)
            await cancel(ticker)
            await self.deltas.close()
            await self.snapshotter.close()
            await self._events.stop()
        if self._failure is not None:
            raise self._failure

    async def _forward_backlog(self) -> None:
        """What the capture holds at start, stored in the log before the writer reads it: so
        caught up means Dynamo's messages captured while no writer ran are folded too (a
        resync at start finds their requests). The forwarder goes on with anything left."""
        if self.forwarder is None:
            return
        try:
            await self.forwarder.forward_waiting(FORWARD_AT_START_S)
        except NotFoundError:
            return  # no capture stream (uncaptured): nothing waits
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the running forwarder retries, saying why
            log.warning(
                "the Dynamo capture's backlog is not all in the log at start: %s",
                describe(exc) if str(exc) else type(exc).__name__,
                extra={"namespace": self.settings.namespace},
            )

    async def _forward(self) -> None:
        """The capture's forwarder, for as long as the writer runs; one that cannot go on
        stops the writer, saying why."""
        if self.forwarder is None:
            return
        try:
            await self.forwarder.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            self._fail(exc)

    async def _restore(self) -> None:
        """Start from the newest valid snapshot whose deltas are all on the DELTAS stream."""
        found = await self.snapshotter.restore(
            at_most_seq=self._published_up_to, registry=self.settings.keep_registry
        )
        if found is None:
            return
        state, info = found
        differing = self._rules_differing(state)
        if differing:
            log.warning(
                "snapshot %s keeps the rules it was folded by, which differ from this "
                "writer's settings (%s): a fold cannot change its rules halfway and "
                "still replay the same, so the settings apply only to a log folded "
                "from its start",
                info.name,
                "; ".join(differing),
            )
        self.state = state
        if not self.settings.keep_registry:
            self.state.defer_registry()
        self.stats.last_seq = info.applied_seq
        self.applied.advance(info.applied_seq)

    def _skipped(self) -> list[tuple[str, str]]:
        return self.snapshotter.skipped

    async def snapshot_now(self) -> None:
        """Take and store a snapshot of the state as folded so far (operators, tests)."""
        await self.snapshotter.now(self.state, self.stats.last_seq)

    async def handle(self, msg: Msg) -> Refused | list[Refused] | None:
        """One event folded, or refused; then the delta log and the snapshots keep pace with
        the fold (for a refused event, once its dead letter is stored: :meth:`dead_lettered`)."""
        refused = self._fold_one(msg)
        if refused is not None:
            return refused
        if self.deltas.backlogged:
            await self.deltas.room()
        self.snapshotter.take_if_due(self.state, self.stats.last_seq)
        return None

    def dead_lettered(self, seq: int, refused: Refused) -> None:
        """Counted once stored: a snapshot taken before, at this event, would skip it."""
        self.stats.dead_letters += 1
        self.snapshotter.take_if_due(self.state, self.stats.last_seq)

    def await_fold(self, msg_id: str, listener: FoldListener) -> None:
        """Call ``listener(seq, verdict)`` once the message published with ``Nats-Msg-Id:
        msg_id`` is folded, or ``listener(0, None)`` if the writer stops first (serve-http's
        lease holder answers its calls so). Once: the listener is forgotten then."""
        self._awaited[msg_id] = listener

    def forget_fold(self, msg_id: str) -> None:
        self._awaited.pop(msg_id, None)

    def _release_awaited(self) -> None:
        awaited, self._awaited = self._awaited, {}
        for listener in awaited.values():
            listener(0, None)

    def _tell(self, seq: int, msg: Msg, verdict: Verdict | list[Verdict]) -> None:
        """The fold of a message someone awaits, told to them."""
        headers = msg.headers
        if headers and STREAM_SOURCE not in headers:  # a captured message's msg-id is forged
            listener = self._awaited.pop(headers.get(MSG_ID, ""), None)
            if listener is not None:
                listener(seq, verdict)

    def _fold_one(self, msg: Msg) -> Refused | list[Refused] | None:
        seq, at_ns = log_time_ns(msg)
        self.stats.last_seq = seq
        self._last_event_at = self._clock()
        verdict = self._fold(seq, at_ns, msg.subject, msg.data)
        if self._awaited:
            self._tell(seq, msg, verdict)
        if type(verdict) is list:
            return self._fold_batch(seq, msg, verdict)
        if type(verdict) is Refusal:
            event = verdict.event
            fields = None if event is None else event_fields(event)
            return Refused(verdict.kind, verdict.reason, fields)
        delta: Delta = verdict  # type: ignore[assignment]
        if delta.outcome != APPLIED and log.isEnabledFor(logging.DEBUG):  # the fold's hot path
            self._log_oddity(seq, msg.subject, msg.data, delta)
        self.stats.applied += 1
        if seq > self._published_up_to:
            self.deltas.append(delta)
            self.stats.deltas_published += 1
            self.stats.last_delta_seq = seq
            if delta.hole is not None:  # once: a restart folds it again, unlogged
                self._log_hole(seq, delta.hole)
        return None

    def _fold_batch(self, seq: int, msg: Msg, verdicts: list[Verdict]) -> list[Refused] | None:
        """A record batch's verdicts: its applied events' deltas go out as the parts of one
        delta at its sequence (the delta log's chain and the projector's position stay per
        stored message); each refused event is dead-lettered alone, with its index."""
        deltas: list[Delta] = []
        refused: list[Refused] = []
        for index, verdict in enumerate(verdicts):
            if type(verdict) is Refusal:
                event = verdict.event
                fields = None if event is None else event_fields(event)
                refused.append(Refused(verdict.kind, verdict.reason, fields, index=index))
            else:
                deltas.append(verdict)  # type: ignore[arg-type]
        self.stats.applied += len(deltas)
        if deltas and seq > self._published_up_to:
            self.deltas.append_parts(deltas)
            self.stats.deltas_published += len(deltas)
            self.stats.last_delta_seq = seq
            for delta in deltas:  # a batch of Dynamo messages may reveal holes
                if delta.hole is not None:
                    self._log_hole(seq, delta.hole, delta.index)
        if not refused:
            return None
        items = decode_batch(msg.data)  # decoded once more only when an event was refused
        return [replace(each, payload=items[each.index or 0]) for each in refused]

    def _log_hole(self, seq: int, hole: Hole, index: int | None = None) -> None:
        """A Dynamo publisher's messages the log never got (NATS Core keeps no copy). They
        may come by the thousand (forged sequences, a flood of publishers): the first is said
        at once, the rest once per interval, counted (the metrics keep every one)."""
        at = str(seq) if index is None else f"{seq}#{index}"  # an event of a batch: its index
        if not self._holes_quiet.now():
            held = self._holes_held
            held[0] += 1
            held[1] += hole.missing
            held[2] = f"publisher {hole.publisher_id}, {hole.missing:,} before event {at}"
            return
        log.warning(
            "Dynamo publisher %d lost %d message%s (its sequence %d on) before event %s: "
            "what they added, marked or freed stays wrong until a Free or expiry",
            hole.publisher_id,
            hole.missing,
            "" if hole.missing == 1 else "s",
            hole.first_missing,
            at,
            extra={"namespace": self.settings.namespace, "stream_seq": seq},
        )

    def _say_held_holes(self, span_s: float) -> None:
        holes, missing, last = self._holes_held
        self._holes_held = [0, 0, ""]
        log.warning(
            "Dynamo publishers lost messages %s more times in the last %.1fs (%s messages in "
            "all); the last: %s",
            f"{holes:,}",
            span_s,
            f"{missing:,}",
            last,
            extra={"namespace": self.settings.namespace},
        )

    def _say_held_ticks(self, span_s: float) -> None:
        ticks, why = self._ticks_held
        self._ticks_held = [0, ""]
        log.warning(
            "Tick not logged %s more times in the last %.1fs; the last: %s",
            f"{ticks:,}",
            span_s,
            why,
            extra={"namespace": self.settings.namespace},
        )

    def _fold_failed(self, exc: BaseException) -> None:
        log.error(
            "writer stopping: %s",
            describe(exc),
            extra={"namespace": self.settings.namespace, "stream_seq": self.stats.last_seq},
        )
        self._fail(exc)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self.stop()

    async def flush(self) -> None:
        """Until every delta folded so far is stored on SEQSTATE_DELTAS."""
        await self.deltas.flush()

    def _log_oddity(self, seq: int, subject: str, data: bytes, delta: Delta) -> None:
        """A DEBUG line for an event folded to something other than ``applied`` (a duplicate,
        an unknown request or worker...): which event, what it met, never its block hashes."""
        # It decoded once (a Dynamo message: as the event it folds as): DEBUG only, off the
        # hot path.
        event: Event = event_of(subject, data)
        owner = f" (held by worker {delta.owner[0]} rank {delta.owner[1]})" if delta.owner else ""
        log.debug(
            "event %d %s: %s%s",
            seq,
            type(event).__name__,
            delta.outcome,
            owner,
            extra={**event_fields(event), "stream_seq": seq, "namespace": self.settings.namespace},
        )

    async def _tick_when_idle(self) -> None:
        """A Tick when the stream has been silent ``idle_tick_s``, and at least every
        ``tick_every_s`` even when it is busy: each Tick runs every rank's expiry check and
        forgets idle lazy ranks, which a rank with no traffic of its own would otherwise never
        get while the others are busy."""
        loop = asyncio.get_running_loop()
        idle, every = self.settings.idle_tick_s, self.settings.tick_every_s
        ticked = loop.time()
        while True:
            await asyncio.sleep(min(idle, every) / 4)
            if not self._stopping.is_set():  # an idle stream still gets its periodic snapshot
                self.snapshotter.take_if_due(self.state, self.stats.last_seq)
            now = loop.time()
            if not self.caught_up.is_set() or (
                now - self._last_event_at < idle
                and now - ticked < every
                and not (self._lease_scan_due() and now - ticked >= LEASE_TICK_S)
            ):
                continue
            # The msg-id makes concurrent writers (or a retry) log one Tick per position; its
            # tag keeps a client that may publish on Dynamo's subjects from taking it first.
            try:
                tag = self._tick_tag or await self._read_tick_tag()
                await self._js.publish(
                    self.settings.control_subject,
                    encode_event(Tick()),
                    headers={MSG_ID: f"tick:{self.settings.namespace}:{self.stats.last_seq}:{tag}"},
                    timeout=ACK_TIMEOUT_S,
                )
            except (TimeoutError, nats.errors.Error) as exc:  # the next round tries again
                why = await explain(self.nc, exc, self.settings.events_stream)
                if self._ticks_quiet.now():
                    log.warning(
                        "Tick not logged: %s", why, extra={"namespace": self.settings.namespace}
                    )
                else:
                    self._ticks_held[0] += 1
                    self._ticks_held[1] = why
                refused = self.stats.publishes_refused
                refused[refusal(exc)] = refused.get(refusal(exc), 0) + 1
                continue
            self.stats.ticks_published += 1
            self._last_event_at = ticked = loop.time()

    def _lease_scan_due(self) -> bool:
        """A lease scan's boundary has passed on this clock and no logged event reached it
        yet: a Tick now expires what Dynamo's replicas expire at that scan, rather than up to
        ``idle_tick_s`` later. (The log's time decides; if this clock runs ahead, the Tick
        lands before the boundary and the next round ticks again.)"""
        due = self.state.lease_due_ns
        return due != NEVER and self.state.now_ns < due <= time.time_ns()

    async def _read_tick_tag(self) -> str:
        """The Ticks' tag, from the events stream's msg-id key (a random one if it has none,
        so that this writer's Ticks are its own)."""
        info = await self._js.stream_info(self.settings.events_stream)
        key = (info.config.metadata or {}).get(msg_ids.KEY)
        self._tick_tag = msg_ids.tick_tag(key, self.settings.namespace)
        return self._tick_tag

    async def _measure_lag(self) -> Lag:
        return await self._lag_of(self.applied.value)

    async def wait_applied(self, seq: int, timeout: float | None = None) -> None:
        """Return once the event at stream sequence ``seq`` has been folded."""
        await self.applied.wait(seq, timeout)

    @property
    def catching_up_to(self) -> int:
        """The namespace's newest event when the writer started reading the log: ``caught_up``
        is set once it has folded that far (0 before it started reading)."""
        return self._events.target

    def stop(self, *, final_snapshot: bool = True) -> None:
        """Fold no further event; store what is folded, then (``final_snapshot``) a snapshot
        of it, which a stop that must be prompt skips: a restart folds a longer tail."""
        self._final_snapshot = self._final_snapshot and final_snapshot
        if not final_snapshot:
            self.snapshotter.quiet = True  # the stop's own line is the news
        self._stopping.set()
        self._events.halt()
