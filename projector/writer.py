"""The writer: folds SEQSTATE_EVENTS, in stream order, into the write model and publishes deltas.

Each event is applied at its JetStream timestamp (the time the log received it), so a replay
anywhere rebuilds the same state. The writer consumes with an ordered push consumer (the
fastest consumer nats-py has, and gap-free: it resets itself on a missed sequence) from the
first message, so a restarted writer rebuilds its state from the log; it republishes no delta
the DELTAS stream already holds: it reads the source sequence of the last delta first, folds
up to it silently, and publishes from the next. Issue #4 adds snapshots so that a restart
costs the tail, not the history.

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
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from projector.config import Config
from projector.resources import ensure
from seqstate import (
    EventDecodeError,
    SequenceState,
    Tick,
    decode_delta,
    decode_event,
    encode_delta,
    encode_event,
)

log = logging.getLogger("seqstate.writer")

SOURCE_SEQ = "Seqstate-Source-Seq"
REASON = "Seqstate-Reason"
MAX_PENDING_DELTAS = 512
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
        self._slots = asyncio.Semaphore(MAX_PENDING_DELTAS)
        self._published_up_to = 0
        self._last_event_at = 0.0
        self._stopping = asyncio.Event()
        self._progress = asyncio.Condition()
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
                    return decode_delta(raw.data or b"").seq or 0
                except (ValueError, msgspec.DecodeError):
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
        target = await last_seq_of(self._js, self.config.events_stream, self.config.events_subjects)
        if target == 0:
            self.caught_up.set()
        queue: asyncio.Queue[Msg] = asyncio.Queue(maxsize=10_000)
        sub = await self._js.subscribe(
            self.config.events_subjects,
            stream=self.config.events_stream,
            ordered_consumer=True,
            idle_heartbeat=1.0,
            cb=queue.put,
        )
        ticker = asyncio.create_task(self._tick_when_idle())
        try:
            while not self._stopping.is_set():
                getter = asyncio.ensure_future(queue.get())
                stopper = asyncio.ensure_future(self._stopping.wait())
                done, _ = await asyncio.wait({getter, stopper}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    break
                stopper.cancel()
                msg = getter.result()
                await self.handle(msg)
                if not self.caught_up.is_set() and self.stats.last_seq >= target:
                    self.caught_up.set()
                async with self._progress:
                    self._progress.notify_all()
            await self.flush()
        finally:
            ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await ticker
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

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
            await self._publish_delta(encode_delta(delta), seq)

    async def _publish_delta(self, payload: bytes, seq: int) -> None:
        try:
            await asyncio.wait_for(self._slots.acquire(), ACK_TIMEOUT_S)
        except TimeoutError:
            # Acks lost to a disconnect never arrive (publish_async has no deadline). Stop: a
            # restarted writer finds the last delta stored and publishes from the next.
            raise WriterStalled(
                f"{MAX_PENDING_DELTAS} delta publishes unacknowledged for {ACK_TIMEOUT_S:g}s"
            ) from None
        future = await self._js.publish_async(
            self.config.deltas_subject,
            payload,
            headers={
                "Nats-Msg-Id": f"{self.config.namespace}:{seq}",
                SOURCE_SEQ: str(seq),
            },
        )
        self._pending.add(future)
        future.add_done_callback(self._settled)
        self.stats.deltas_published += 1
        self.stats.last_delta_seq = seq

    def _settled(self, future: asyncio.Future[object]) -> None:
        self._pending.discard(future)
        self._slots.release()
        if not future.cancelled() and future.exception() is not None:
            # A lost delta would leave the projector behind for good: stop loudly.
            log.error("delta publish failed: %r", future.exception())
            self._stopping.set()

    async def flush(self) -> None:
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

    async def wait_applied(self, seq: int) -> None:
        """Return once the event at stream sequence ``seq`` has been folded."""
        async with self._progress:
            await self._progress.wait_for(lambda: self.stats.last_seq >= seq)

    def stop(self) -> None:
        self._stopping.set()
