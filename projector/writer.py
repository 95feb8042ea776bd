"""The writer: folds SEQSTATE_EVENTS, in stream order, into the write model and publishes deltas.

Each event is applied at its JetStream timestamp (the time the log received it), so a replay
anywhere rebuilds the same state. The writer consumes with an ordered push consumer (the
fastest consumer nats-py has, and gap-free: it resets itself on a missed sequence) from the
first message, so a restarted writer rebuilds its state from the log; it republishes no delta
the DELTAS stream already holds: it reads the source sequence of the last delta first, folds
up to it silently, and publishes from the next. Issue #4 adds snapshots so that a restart
costs the tail, not the history.

Deltas folded back to back (a backlog, a replay) travel together: one DELTAS message holds
up to ``MAX_BATCH`` of them, published as soon as the consumer's backlog is empty, so a live
event still goes out alone and at once, while catching up costs one publish and one ack per
batch instead of per event.

A message that does not decode goes to the dead-letter subject with the reason and its
sequence, is counted, and the writer goes on. When the stream is idle the writer publishes a
Tick, so that expiry happens at a time the log recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from projector.config import Config
from projector.progress import Progress
from projector.resources import ensure
from seqstate import (
    Delta,
    EventDecodeError,
    SequenceState,
    Tick,
    decode_deltas,
    decode_event,
    encode_deltas,
    encode_event,
)

log = logging.getLogger("seqstate.writer")

SOURCE_SEQ = "Seqstate-Source-Seq"
REASON = "Seqstate-Reason"
MAX_PENDING_BATCHES = 256
MAX_BATCH = 256  # deltas per DELTAS message while catching up
ACK_TIMEOUT_S = 10.0


class WriterStalled(RuntimeError):
    """Delta publishes went unacknowledged; the writer stops so a restart can resume cleanly."""


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


@dataclass
class WriterStats:
    applied: int = 0
    dead_letters: int = 0
    deltas_published: int = 0
    batches_published: int = 0
    ticks_published: int = 0
    last_delta_seq: int = 0  # source sequence of the last delta published
    last_seq: int = 0  # outcomes are counted by the state itself: state.counters


class Writer:
    """One writer per namespace. ``await writer.run()`` until cancelled or ``stop()``."""

    def __init__(self, nc: Client, config: Config, state: SequenceState | None = None) -> None:
        self.nc = nc
        self.config = config
        self.state = state or SequenceState(expiry_s=config.expiry_s)
        self.stats = WriterStats()
        self._js: JetStreamContext = nc.jetstream()
        self._pending: set[asyncio.Future[object]] = set()
        self._slots = asyncio.Semaphore(MAX_PENDING_BATCHES)
        self._published_up_to = 0
        self._last_event_at = 0.0
        self._stopping = asyncio.Event()
        self._failure: BaseException | None = None
        self._batch: list[Delta] = []
        self._sub: JetStreamContext.PushSubscription | None = None
        self._target = 0
        self.applied = Progress()  # the sequence of the last event folded
        self.caught_up = asyncio.Event()

    async def last_published_source_seq(self) -> int:
        """The source sequence of the newest readable delta in SEQSTATE_DELTAS (0 if none).

        Something other than a writer may have published to the deltas subject; such a message
        is stepped over (the projector dead-letters it), never trusted or fatal.
        """
        stream, subject = self.config.deltas_stream, self.config.deltas_subject
        try:
            raw = await self._js.get_last_msg(stream, subject)
        except NotFoundError:
            return 0
        seq = raw.seq or 0
        while True:
            if raw.subject == subject:
                try:
                    if raw.headers and SOURCE_SEQ in raw.headers:
                        return int(raw.headers[SOURCE_SEQ])
                    return decode_deltas(raw.data or b"")[-1].seq or 0
                except (ValueError, IndexError, msgspec.DecodeError):
                    log.warning("delta %d is unreadable; looking further back", seq)
            seq -= 1
            if seq < 1:
                return 0
            try:
                raw = await self._js.get_msg(stream, seq)
            except NotFoundError:
                return 0

    async def run(self) -> None:
        await ensure(self.nc, self.config)
        self._published_up_to = await self.last_published_source_seq()
        # The stream may carry other namespaces: catch up to this namespace's newest event.
        self._target = await last_seq_of(
            self._js, self.config.events_stream, self.config.events_subjects
        )
        if self._target <= self.applied.value:
            self.caught_up.set()
        # Messages are handled in the subscription's own callback task, one after another:
        # no task or wake-up per message beyond what the client already does.
        sub = await self._js.subscribe(
            self.config.events_subjects,
            stream=self.config.events_stream,
            ordered_consumer=True,
            idle_heartbeat=1.0,
            cb=self._on_message,
            **self._start_options(),
        )
        self._sub = sub
        ticker = asyncio.create_task(self._tick_when_idle())
        try:
            await self._stopping.wait()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
            self._sub = None
            if self._failure is None:
                await self._publish_batch()
                await self.flush()
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            if self._sub is not None:
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()
        if self._failure is not None:
            raise self._failure

    def _start_options(self) -> dict[str, object]:
        """Where the consumer starts: after the restored state's last event (issue #4)."""
        if self.applied.value == 0:
            return {}
        return {
            "deliver_policy": api.DeliverPolicy.BY_START_SEQUENCE,
            "config": api.ConsumerConfig(opt_start_seq=self.applied.value + 1),
        }

    async def _on_message(self, msg: Msg) -> None:
        if self._stopping.is_set():
            return
        try:
            await self.handle(msg)
            # Publish what was folded back to back once the backlog is drained (or large).
            if len(self._batch) >= MAX_BATCH or (
                self._sub is not None and not self._sub.pending_msgs
            ):
                await self._publish_batch()
        except Exception as exc:  # the callback's errors would be swallowed by the client
            log.error("writer stopping: %s", exc)
            self._failure = exc
            self._stopping.set()
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
        delta = self.state.apply(event, at_ns)
        delta.seq = seq
        self.stats.applied += 1
        if seq > self._published_up_to:
            self._batch.append(delta)

    async def _publish_batch(self) -> None:
        if not self._batch:
            return
        batch, self._batch = self._batch, []
        last = batch[-1].seq or 0
        if self._slots.locked():
            try:
                await asyncio.wait_for(self._slots.acquire(), ACK_TIMEOUT_S)
            except TimeoutError:
                # Acks lost to a disconnect never arrive (publish_async has no deadline). Stop:
                # a restarted writer finds the last delta stored and publishes from the next.
                raise WriterStalled(
                    f"{MAX_PENDING_BATCHES} delta publishes unacknowledged for {ACK_TIMEOUT_S:g}s"
                ) from None
        else:
            await self._slots.acquire()
        future = await self._js.publish_async(
            self.config.deltas_subject,
            encode_deltas(batch),
            headers={"Nats-Msg-Id": f"{self.config.namespace}:{last}", SOURCE_SEQ: str(last)},
        )
        self._pending.add(future)
        future.add_done_callback(self._settled)
        self.stats.deltas_published += len(batch)
        self.stats.batches_published += 1
        self.stats.last_delta_seq = last

    def _settled(self, future: asyncio.Future[object]) -> None:
        self._pending.discard(future)
        self._slots.release()
        if not future.cancelled() and future.exception() is not None:
            # A lost delta would leave the projector behind for good: stop loudly.
            self._failure = WriterStalled(f"delta publish failed: {future.exception()!r}")
            log.error("%s", self._failure)
            self._stopping.set()

    async def flush(self) -> None:
        """Until every delta published so far is acknowledged by the stream."""
        await self._publish_batch()
        if self._pending:
            try:
                await asyncio.wait_for(
                    asyncio.gather(*list(self._pending), return_exceptions=True), ACK_TIMEOUT_S
                )
            except TimeoutError:
                raise WriterStalled(
                    f"{len(self._pending)} delta publishes unacknowledged for {ACK_TIMEOUT_S:g}s"
                ) from None

    async def _dead_letter(self, msg: Msg, seq: int, reason: str) -> None:
        self.stats.dead_letters += 1
        log.warning("dead letter: seq %d on %s: %s", seq, msg.subject, reason)
        await self._js.publish(
            self.config.dead_letter_subject,
            msg.data,
            headers={
                "Nats-Msg-Id": f"dead:{self.config.namespace}:{seq}",
                REASON: reason,
                SOURCE_SEQ: str(seq),
                "Seqstate-Subject": msg.subject,
            },
        )

    async def _tick_when_idle(self) -> None:
        loop = asyncio.get_running_loop()
        idle = self.config.idle_tick_s
        while True:
            await asyncio.sleep(idle / 4)
            if self._batch and self._sub is not None and not self._stopping.is_set():
                await self._publish_batch()  # a backlog count that never reached zero
            if not self.caught_up.is_set() or loop.time() - self._last_event_at < idle:
                continue
            # The msg-id makes concurrent writers (or a retry) log one Tick per position.
            await self._js.publish(
                self.config.control_subject,
                encode_event(Tick()),
                headers={"Nats-Msg-Id": f"tick:{self.config.namespace}:{self.stats.last_seq}"},
            )
            self.stats.ticks_published += 1
            self._last_event_at = loop.time()

    async def wait_applied(self, seq: int, timeout: float | None = None) -> None:
        """Return once the event at stream sequence ``seq`` has been folded."""
        await self.applied.wait(seq, timeout)

    def stop(self) -> None:
        self._stopping.set()
