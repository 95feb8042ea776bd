"""The writer: folds SEQSTATE_EVENTS, in stream order, into the write model and publishes deltas.

Each event is applied at its JetStream timestamp (the time the log received it), so a replay
anywhere rebuilds the same state. The writer consumes with an ordered push consumer (the
fastest consumer nats-py has, and gap-free: it resets itself on a missed sequence) from the
first message, so a restarted writer rebuilds its state from the log; it republishes no delta
the DELTAS stream already holds: it reads the source sequence of the last delta first, folds
up to it silently, and publishes from the next. Issue #4 adds snapshots so that a restart
costs the tail, not the history.

Deltas go to SEQSTATE_DELTAS through a :class:`~projector.delta_log.DeltaLog`: one message
in flight, each stored right after the previous one (a compare-and-set on the subject's last
sequence), so the chain has no hole even when the server crashes, and what is folded while a
message travels gathers into the next one.

A message that does not decode, or that would pass the rank bounds, goes to the dead-letter
subject with the reason and its sequence, is counted, and the writer goes on. When the stream
is idle, and at least every ``tick_every_s`` when it is not, the writer publishes a Tick, so
that expiry (and forgetting idle lazy ranks) happens at a time the log recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from projector.config import Config
from projector.dead_letters import DeadLetters
from projector.delta_log import ACK_TIMEOUT_S, DeltaLog, WriterStalled
from projector.progress import Progress
from projector.resources import ensure
from projector.retention import trim, trimmed_below
from projector.snapshots import SnapshotStore
from projector.tasks import attempt, cancel
from seqstate import (
    EventDecodeError,
    SequenceState,
    Tick,
    decode_event,
    encode_event,
)
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.writer")

SNAPSHOT_TIMEOUT_S = 30.0  # a snapshot not stored by then is given up: the log has it all
FINAL_SNAPSHOT_S = 10.0  # what a clean stop spends on snapshots, within the CLI's 15 s


class SnapshotUnavailable(SeqstateError, RuntimeError):
    """The log's beginning is gone and no valid snapshot covers it."""


def log_time_ns(msg: Msg) -> tuple[int, int]:
    """``(stream_sequence, timestamp_ns)`` from a JetStream delivery's reply subject.

    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream_seq>.<consumer_seq>.<ts_ns>.<pending>``
    (newer servers prefix a domain and account hash): nanoseconds, which the parsed
    ``msg.metadata.timestamp`` (a datetime) would round to microseconds.
    """
    tokens = msg.reply.split(".")
    return int(tokens[-4]), int(tokens[-2])


async def last_seq_of(js: JetStreamContext, stream: str, subjects: str) -> int:
    """Sequence of the newest message on ``subjects`` (wildcards allowed); 0 if none."""
    try:
        return (await js.get_last_msg(stream, subjects)).seq or 0
    except NotFoundError:
        return 0


async def first_seq_of(js: JetStreamContext, stream: str, subjects: str) -> int:
    """Sequence of the oldest message on ``subjects`` in ``stream``; 0 if none."""
    try:
        msg = await js.get_msg(stream, seq=1, subject=subjects, next=True)
    except NotFoundError:
        return 0
    return msg.seq or 0


@dataclass
class WriterStats:
    applied: int = 0
    dead_letters: int = 0
    deltas_published: int = 0
    ticks_published: int = 0
    last_delta_seq: int = 0  # source sequence of the last delta handed to the delta log
    restored_from: int = 0  # the snapshot's sequence the writer started from (0: none)
    snapshots_saved: int = 0
    snapshot_failures: int = 0
    last_snapshot_seq: int = 0
    trimmed_below: int = 0  # events below this sequence were trimmed by this writer
    last_seq: int = 0  # outcomes are counted by the state itself: state.counters


class Writer:
    """One writer per namespace. ``await writer.run()`` until cancelled or ``stop()``."""

    def __init__(
        self,
        nc: Client,
        config: Config,
        state: SequenceState | None = None,
        *,
        snapshots: bool = True,
    ) -> None:
        self.nc = nc
        self.config = config
        self._given_state = state is not None
        self.state = state or config.new_state()
        # The writer never reads its registry (readers build theirs from the bucket), and
        # keeping it current is about a third of the fold's cost.
        self.state.defer_registry()
        self.snapshots: SnapshotStore | None = SnapshotStore(nc, config) if snapshots else None
        self._snapshot_task: asyncio.Task[None] | None = None
        self._snapshot_at = 0.0  # loop time of the last snapshot taken
        self.stats = WriterStats()
        self._js: JetStreamContext = nc.jetstream()
        self.dead_letters = DeadLetters(self._js, config, max_payload=nc.max_payload)
        self._bounds = config.rank_bounds
        self.deltas = DeltaLog(self._js, config, max_payload=nc.max_payload)
        self._published_up_to = 0
        self._last_event_at = 0.0
        self._stopping = asyncio.Event()
        self._failure: BaseException | None = None
        self._sub: JetStreamContext.PushSubscription | None = None
        self._target = 0
        self.applied = Progress()  # the sequence of the last event folded
        self.caught_up = asyncio.Event()

    async def run(self) -> None:
        await ensure(self.nc, self.config)
        self._published_up_to = await self.deltas.open()
        self.stats.last_delta_seq = self._published_up_to
        self._snapshot_at = asyncio.get_running_loop().time()
        if self.snapshots is not None:
            await self.snapshots.open()
            if not self._given_state:
                await self._restore()
        await self._check_coverage()
        # The stream may carry other namespaces: catch up to this namespace's newest event.
        self._target = await last_seq_of(
            self._js, self.config.events_stream, self.config.events_subjects
        )
        if self._target <= self.applied.value:
            self.caught_up.set()
        # Messages are handled in the subscription's own callback task, one after another:
        # no task or wake-up per message beyond what the client already does.
        policy, start = self._start_options()
        sub = await self._js.subscribe(
            self.config.events_subjects,
            stream=self.config.events_stream,
            ordered_consumer=True,
            idle_heartbeat=1.0,
            cb=self._on_message,
            deliver_policy=policy,
            config=start,
        )
        self._sub = sub
        self.deltas.start(self._fail)
        ticker = asyncio.create_task(self._tick_when_idle())
        try:
            await self._stopping.wait()
            await attempt(sub.unsubscribe())
            self._sub = None
            if self._failure is None:
                await self.flush()
                await self._final_snapshot()
        finally:
            await cancel(ticker)
            await self.deltas.close()
            await cancel(self._snapshot_task)
            if self._sub is not None:
                await attempt(self._sub.unsubscribe())
        if self._failure is not None:
            raise self._failure

    # ---- snapshots (issue #4) ----------------------------------------------------------------

    async def _restore(self) -> None:
        """Start from the newest valid snapshot whose deltas are all on the DELTAS stream."""
        assert self.snapshots is not None
        found = await self.snapshots.newest_valid(at_most_seq=self._published_up_to)
        if found is None:
            return
        state, info = found
        self.state = state
        self.state.defer_registry()
        self.stats.last_seq = self.stats.restored_from = info.applied_seq
        self.stats.last_snapshot_seq = info.applied_seq
        self.applied.advance(info.applied_seq)
        log.info("restored the write model from snapshot %s (event %d)", info.name,
                 info.applied_seq)  # fmt: skip

    async def _check_coverage(self) -> None:
        """Refuse to fold a log whose beginning was trimmed when no snapshot covers it."""
        if self.applied.value:
            return
        cut = await trimmed_below(self.nc, self.config)
        if cut > 1:
            skipped = "; ".join(f"{n}: {why}" for n, why in self._skipped())
            raise SnapshotUnavailable(
                f"events before sequence {cut} were trimmed and no valid snapshot "
                f"covers them, so the state cannot be rebuilt exactly"
                + (f" (skipped {skipped})" if skipped else "")
            )

    def _skipped(self) -> list[tuple[str, str]]:
        return self.snapshots.skipped if self.snapshots is not None else []

    def _snapshot_due(self) -> bool:
        if self.snapshots is None or self.stats.last_seq <= self.stats.last_snapshot_seq:
            return False
        if self._snapshot_task is not None and not self._snapshot_task.done():
            return False
        every = self.config.snapshot_every_events
        if every and self.stats.last_seq - self.stats.last_snapshot_seq >= every:
            return True
        every_s = self.config.snapshot_every_s
        return bool(every_s) and asyncio.get_running_loop().time() - self._snapshot_at >= every_s

    async def _take_snapshot(self) -> None:
        """Encode now (consistent with the fold), then store in the background."""
        seq, at_ns = self.stats.last_seq, self.state.now_ns
        data = self.state.snapshot()
        self.stats.last_snapshot_seq = seq
        self._snapshot_at = asyncio.get_running_loop().time()
        self._snapshot_task = asyncio.create_task(self._save_snapshot(data, seq, at_ns))

    async def _save_snapshot(self, data: bytes, seq: int, at_ns: int) -> None:
        try:
            # A save caught in a server restart can wait on a reply that never comes.
            await asyncio.wait_for(self._store_snapshot(data, seq, at_ns), SNAPSHOT_TIMEOUT_S)
        except WriterStalled as exc:
            self._fail(exc)
        except Exception as exc:  # a snapshot is an optimisation: the log still has it all
            self.stats.snapshot_failures += 1
            log.warning("snapshot at event %d failed: %r", seq, exc)

    async def _store_snapshot(self, data: bytes, seq: int, at_ns: int) -> None:
        assert self.snapshots is not None
        # A snapshot must never get ahead of the deltas: a restart from it would skip them.
        await self.flush()
        info = await self.snapshots.save(data, seq, at_ns)
        self.stats.snapshots_saved += 1
        await self.snapshots.prune(self.config.snapshots_keep)
        log.info("snapshot %s saved and verified (%d bytes)", info.name, len(data))
        await self._trim()

    async def _trim(self) -> None:
        """Drop events older than the oldest kept snapshot (minus the configured margin)."""
        if self.config.retain_events is None or self.snapshots is None:
            return
        kept = await self.snapshots.list()
        cut = await trim(self.nc, self.config, kept, self.stats.trimmed_below)
        if cut != self.stats.trimmed_below:
            self.stats.trimmed_below = cut
            log.info("trimmed events below sequence %d", cut)

    async def _final_snapshot(self) -> None:
        """On a clean stop: the last snapshot, within ``FINAL_SNAPSHOT_S`` (a stop must end)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FINAL_SNAPSHOT_S
        if self._snapshot_task is not None:
            await asyncio.wait([self._snapshot_task], timeout=FINAL_SNAPSHOT_S / 2)
            await cancel(self._snapshot_task)
        if self.snapshots is not None and self.stats.last_seq > self.stats.last_snapshot_seq:
            await self._take_snapshot()
            assert self._snapshot_task is not None
            await asyncio.wait([self._snapshot_task], timeout=max(0.0, deadline - loop.time()))
            if not self._snapshot_task.done():
                log.warning("the final snapshot did not finish in time: a restart folds a "
                            "longer tail")  # fmt: skip
                await cancel(self._snapshot_task)

    async def snapshot_now(self) -> None:
        """Take and store a snapshot of the state as folded so far (operators, tests)."""
        if self._snapshot_task is not None:
            with contextlib.suppress(Exception):
                await self._snapshot_task
        await self._take_snapshot()
        assert self._snapshot_task is not None
        await self._snapshot_task

    def _start_options(self) -> tuple[api.DeliverPolicy | None, api.ConsumerConfig | None]:
        """Where the consumer starts: after the restored state's last event (issue #4)."""
        if self.applied.value == 0:
            return None, None
        return (api.DeliverPolicy.BY_START_SEQUENCE,
                api.ConsumerConfig(opt_start_seq=self.applied.value + 1))  # fmt: skip

    async def _on_message(self, msg: Msg) -> None:
        if self._stopping.is_set():
            return
        try:
            await self.handle(msg)
            if self.deltas.backlogged:
                await self.deltas.room()
            # A backlog never makes the callback wait, so it would starve the loop's other
            # tasks (the delta log, a snapshot being saved, the ticker): give them a turn.
            await asyncio.sleep(0)
            if self._snapshot_due():
                await self._take_snapshot()
        except Exception as exc:  # the callback's errors would be swallowed by the client
            log.error("writer stopping: %s", exc)
            self._fail(exc)
            return
        if not self.caught_up.is_set() and self.stats.last_seq >= self._target:
            self.caught_up.set()
        self.applied.advance(self.stats.last_seq)

    async def handle(self, msg: Msg) -> None:
        seq, at_ns = log_time_ns(msg)
        self.stats.last_seq = seq
        self._last_event_at = asyncio.get_running_loop().time()
        try:
            event = decode_event(msg.data)
        except EventDecodeError as exc:
            await self._dead_letter(msg, seq, str(exc))
            return
        refused = self._bounds.refusal(self.state, event)
        if refused:
            await self._dead_letter(msg, seq, f"refused: {refused}")
            return
        delta = self.state.apply(event, at_ns)
        delta.seq = seq
        self.stats.applied += 1
        if seq > self._published_up_to:
            self.deltas.append(delta)
            self.stats.deltas_published += 1
            self.stats.last_delta_seq = seq

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
        self._stopping.set()

    async def flush(self) -> None:
        """Until every delta folded so far is stored on SEQSTATE_DELTAS."""
        await self.deltas.flush()

    async def _dead_letter(self, msg: Msg, seq: int, reason: str) -> None:
        self.stats.dead_letters += 1
        await self.dead_letters.put(self.config.events_stream, seq, msg.subject, msg.data, reason)

    async def _tick_when_idle(self) -> None:
        """A Tick when the stream has been silent ``idle_tick_s``, and at least every
        ``tick_every_s`` even when it is busy: each Tick runs every rank's expiry check and
        forgets idle lazy ranks, which a rank with no traffic of its own would otherwise never
        get while the others are busy."""
        loop = asyncio.get_running_loop()
        idle, every = self.config.idle_tick_s, self.config.tick_every_s
        ticked = loop.time()
        while True:
            await asyncio.sleep(min(idle, every) / 4)
            if self._snapshot_due() and not self._stopping.is_set():
                await self._take_snapshot()  # an idle stream still gets its periodic snapshot
            now = loop.time()
            if not self.caught_up.is_set() or (now - self._last_event_at < idle
                                               and now - ticked < every):  # fmt: skip
                continue
            # The msg-id makes concurrent writers (or a retry) log one Tick per position.
            try:
                await self._js.publish(
                    self.config.control_subject,
                    encode_event(Tick()),
                    headers={"Nats-Msg-Id": f"tick:{self.config.namespace}:{self.stats.last_seq}"},
                    timeout=ACK_TIMEOUT_S,
                )
            except (TimeoutError, nats.errors.Error) as exc:  # the next round tries again
                log.warning("Tick not logged: %r", exc)
                continue
            self.stats.ticks_published += 1
            self._last_event_at = ticked = loop.time()

    async def wait_applied(self, seq: int, timeout: float | None = None) -> None:
        """Return once the event at stream sequence ``seq`` has been folded."""
        await self.applied.wait(seq, timeout)

    def stop(self) -> None:
        self._stopping.set()
