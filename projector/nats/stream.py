"""JetStream plumbing that every reader of the streams shares, so that it is done one way.

The writer, the projector and replay read their streams alike: the same headers link a
message to the event it stands for, the same reply subject says where and when the log stored
it, and an ordered push consumer feeds each of them in stream order. Spelled once here, a
header cannot drift between the side that writes it and the side that reads it.

A consumer's logic is a *processor*: an object whose async ``handle(msg)`` takes one message
and knows nothing of subscriptions, start positions or the client's quirks. The
:class:`OrderedConsumer` runs it, as eventsourcing's runners run an ``EventProcessor``. A
processor that cannot read a message says so by returning :class:`Refused`; the runner writes
the dead letter, so that every consumer dead-letters the same way and no processor holds
dead-letter code of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import nats.errors
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from projector.nats import client_internals, direct_delivery
from projector.nats.progress import Progress
from projector.nats.tasks import attempt, cancel

log = logging.getLogger("seqstate")

# Messages a runner holds received and not yet handled, at most (``consumer_window``): what a
# consumer far behind holds in memory, whatever its backlog. 4096 large AddRequests are ~10 MB.
DEFAULT_WINDOW = 4096
YIELD_EVERY = 64  # messages handled back to back before the runner lets other tasks run
MIN_WINDOW = 16
HEARTBEAT_S = 1.0  # the server's idle heartbeat to the runner's consumer
# Caught up, the runner acks what it handled at most this often (a heartbeat acks the rest):
# not once per message, which at a call's pace was one more message per event to the server.
ACK_IDLE_S = 0.05
STALE_S = 3.5  # no message and no heartbeat for this long: the consumer (or server) is gone
CREATE_S = 5.0  # creating a consumer: a server that does not answer in time is asked again
ACK_WAIT_S = 22 * 3600.0  # never redelivered for want of an ack: ordered, as nats-py's are
ACK = b"+ACK"
STATUS = api.Header.STATUS
DELIVERY = "$JS.ACK."  # the reply subject of every message a consumer delivers


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


@dataclass(frozen=True)
class Refused:
    """A processor's answer for a message it cannot take: dead-letter it, and go on.

    ``kind`` is the bounded word the dead letter is counted under (a metric's label),
    ``reason`` the free text the dead letter carries; ``fields`` is the log context known of
    the message (its request id, worker...), for the log line only. A processor refuses
    events of a record batch one by one (a list of them, each with its ``index``).
    """

    kind: str
    reason: str
    fields: Mapping[str, Any] | None = field(default=None, compare=False)
    # An event of a record batch: its index in the batch, and its own bytes (the dead letter
    # carries them, not the whole batch's).
    index: int | None = None
    payload: bytes | None = field(default=None, compare=False)


class DeadLetterSink(Protocol):
    """Where a runner puts what its processor refused (:class:`~projector.nats.dead_letters.
    DeadLetters`); a protocol, so that a processor's module need not import it."""

    counts: dict[str, int]

    async def put(
        self,
        stream: str,
        seq: int,
        subject: str,
        payload: bytes,
        reason: str,
        *,
        kind: str,
        fields: Mapping[str, Any] | None = None,
        index: int | None = None,
    ) -> None: ...

    def say_held(self) -> None:
        """Log what the sink holds back of its dead letters (its log is rate-bounded)."""


class Processor(Protocol):
    async def handle(self, msg: Msg) -> Refused | list[Refused] | None:
        """Take one message, or refuse it (or events of it: a list); an exception stops the
        consumer that runs it."""


@runtime_checkable
class RefusingProcessor(Processor, Protocol):
    """A processor that keeps count of its refusals, or whose position must move past them."""

    def dead_lettered(self, seq: int, refused: Refused) -> None:
        """Message ``seq`` was refused and its dead letter is stored: count it, move past it."""


async def drop_subscription(js: JetStreamContext, sub: Any) -> None:
    """Unsubscribe ``sub`` (a push subscription of ``js``: a KV watch's, say) and delete its
    consumer, as :class:`OrderedConsumer` does at its stop. Left to the server, a consumer
    outlives its subscription by its inactive threshold (five minutes for a KV watch), and a
    process that opens and closes watches as it goes (serve-http, as slot trackers come and
    go) would leave them behind by the hundred. Clean-up only: a failure is passed over."""
    await attempt(sub.unsubscribe())
    stream, name = client_internals.consumer_of(sub)
    if (
        stream and name and client_internals.client_of(js).is_connected
    ):  # else it goes by itself, without interest
        await attempt(js.delete_consumer(stream, name))


async def stop_watch(js: JetStreamContext, watcher: Any) -> None:
    """Stop a KV watch (``KeyValue.watch``'s) and delete its consumer, as
    :func:`drop_subscription` does."""
    await attempt(watcher.stop())
    sub = client_internals.subscription_of(watcher)
    if sub is not None:
        await drop_subscription(js, sub)


class OrderedConsumer:
    """Runs a processor over ``subjects`` of ``stream``, in stream order, from a position, with
    at most ``window`` messages received and not yet handled.

    nats-py's ordered push consumer was the runner first, and a runner far behind (a writer
    paused for 20 s under load) showed what it does not bound: the server pushes at full
    speed, nats-py answers the flow control on receipt rather than once a message is handled,
    so the client queued half a million messages (36 MB became 612 MB, never returned),
    dropped the rest one slow-consumer error at a time, reset, and took 133 s to catch up.
    So the runner makes its own push consumer, ordered as nats-py's is, and bounded by the
    server:

    - acknowledgement ``all`` with ``max_ack_pending = window``: the server sends at most
      ``window`` messages past the last one acknowledged, and the runner acknowledges (one ack
      covers every message before it) each quarter window handled, and when it has handled all
      it holds (at most every ``ACK_IDLE_S``; each idle heartbeat acks the rest). What it
      holds is ``window`` messages at most, whatever the backlog, and a backlog flows at the
      fold's own rate, with no drop, no reset and no wasted delivery;
    - flow control, answered once the messages before it are handled: a bound in bytes too
      (the server's window, at most 32 MB), for very large messages;
    - ordered: a message whose consumer sequence is not the next one (lost in a reconnect, or
      by a slow-consumer drop) makes the runner start a new consumer after the last message
      handled, as does a heartbeat naming a later delivery than the last one received, and
      silence (no message or heartbeat for ``STALE_S``: the consumer or its server is gone).
      A message the runner has already handled (one sent again after such a restart) is
      passed over.

    The client's subscription only queues what arrives; the messages are handled in a task of
    the runner's own, one after another, so that replacing the subscription never cancels a
    message being handled. The runner also does what the client would not:

    - a processor's exception is kept in ``failure``, reported once to ``on_failure``, and no
      further message is handed over;
    - after each message the loop gets a turn, so a backlog does not starve the loop's other
      tasks (a processor's background work);
    - a caller needs to know when the processor has seen what the stream held when it
      started: ``caught_up`` is set once it has passed the subjects' last sequence as looked
      up at :meth:`start` (at once if there was nothing to pass).

    ``position`` (a :class:`~projector.nats.progress.Progress`, the caller's or a new one) advances
    to each message's stream sequence once the processor has handled it.

    A message the processor refuses (:class:`Refused`) is written to ``dead_letters`` once,
    the processor is told (``dead_lettered``), and the position moves past it. A consumer
    without ``dead_letters`` cannot refuse: a refusal stops it, as an exception would.
    """

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        subjects: str,
        processor: Processor,
        *,
        on_failure: Callable[[BaseException], None],
        position: Progress | None = None,
        dead_letters: DeadLetterSink | None = None,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if window < MIN_WINDOW:
            raise ValueError(f"window={window}: must be at least {MIN_WINDOW}")
        self.stream = stream
        self.subjects = subjects
        self.position = position if position is not None else Progress()
        self.caught_up = asyncio.Event()
        self.failure: BaseException | None = None
        self.window = window
        self.peak_held = 0  # the most messages ever received and not yet handled at once
        self.restarts = 0  # consumers started again (a gap, a silent server)
        self._js = js
        self._nc = client_internals.client_of(js)
        self._processor = processor
        self._dead_letters = dead_letters
        self._on_failure = on_failure
        self._target = 0
        self._halted = False
        self._ack_every = max(1, window // 4)
        # The current subscription and consumer; ``_generation`` tells their messages from
        # those of one replaced (still queued, or arriving late).
        self._sub: Subscription | None = None
        self._consumer: str | None = None
        self._generation = 0
        self._queue: deque[tuple[int, Msg]] = deque()
        self._held = 0  # deliveries in the queue (not status messages)
        self._since_yield = 0  # messages handled since the runner last gave the loop a turn
        self._wake = asyncio.Event()
        self._delivered = 0  # consumer sequence of the last message taken from the queue
        self._unacked = 0  # handled since the last ack
        self._ack_reply: str | None = None  # the last message handled: acking it acks all
        self._acked_at = 0.0  # loop time of the last ack
        self._heard_at = 0.0  # loop time of the last message or heartbeat received
        self._reopen = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self, after: int = 0) -> None:
        """Subscribe from the message after stream sequence ``after`` (0: from the first)."""
        client_internals.install()  # a feed on a client of the caller's making takes any subject
        self.position.advance(after)
        self._target = await last_seq_of(self._js, self.stream, self.subjects)
        if self._target <= after:
            self.caught_up.set()
        await self._open()
        self._tasks = [
            asyncio.create_task(self._run(), name=f"seqstate-consume-{self.stream}"),
            asyncio.create_task(self._watch(), name=f"seqstate-watch-{self.stream}"),
        ]

    @property
    def target(self) -> int:
        """The subjects' last sequence when :meth:`start` looked it up: ``caught_up`` is set
        once the processor has passed it (0 before the start)."""
        return self._target

    @property
    def held(self) -> int:
        """Messages received and not yet handled (at most ``window``)."""
        return self._held

    # ---- the consumer on the server -----------------------------------------------------------

    async def _open(self) -> None:
        """A subscription and a consumer from the message after the position (the caller
        holds no lock; a failure leaves none, and the watch tries again)."""
        nc = self._nc
        after = self.position.value
        self._generation += 1
        generation = self._generation
        self._delivered = self._unacked = 0
        self._ack_reply = None
        self._queue.clear()  # anything queued is of a consumer replaced
        self._held = 0

        loop = asyncio.get_running_loop()

        def received(msg: Msg) -> None:
            self._heard_at = loop.time()
            self._queue.append((generation, msg))
            if msg.reply.startswith(DELIVERY):
                self._held += 1
                if self._held > self.peak_held:
                    self.peak_held = self._held
            self._wake.set()

        async def receive(msg: Msg) -> None:  # where nats-py's queue cannot be bypassed
            received(msg)

        inbox = nc.new_inbox()
        self._heard_at = loop.time()
        self._sub = await nc.subscribe(inbox, cb=receive, pending_msgs_limit=2 * self.window + 64)
        direct_delivery.attach(self._sub, received)
        config = api.ConsumerConfig(
            deliver_subject=inbox,
            filter_subject=self.subjects,
            deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE if after else api.DeliverPolicy.ALL,
            opt_start_seq=after + 1 if after else None,
            ack_policy=api.AckPolicy.ALL,
            ack_wait=ACK_WAIT_S,
            max_ack_pending=self.window,
            flow_control=True,
            idle_heartbeat=HEARTBEAT_S,
            mem_storage=True,
            num_replicas=1,
        )
        try:
            info = await self._js.add_consumer(self.stream, config=config, timeout=CREATE_S)
        except BaseException:
            sub, self._sub = self._sub, None
            await attempt(sub.unsubscribe())
            raise
        self._consumer = info.name

    async def _restart(self, why: str, seen: int) -> None:
        """A new consumer after the last message handled (the old one is deleted); ``seen``:
        the generation found at fault (if it has been replaced meanwhile, nothing is done)."""
        async with self._reopen:
            if self._halted or seen != self._generation:
                return
            self.restarts += 1
            log.info(
                "%s: consumer of %s started again after sequence %d: %s",
                self.stream,
                self.subjects,
                self.position.value,
                why,
            )
            sub, self._sub = self._sub, None
            name, self._consumer = self._consumer, None
            self._generation += 1  # what is queued or still arrives is passed over
            self._queue.clear()
            self._held = 0
            if sub is not None:
                await attempt(sub.unsubscribe())
            if name is not None:
                task = asyncio.create_task(attempt(self._js.delete_consumer(self.stream, name)))
                self._tasks.append(task)
                task.add_done_callback(self._forget)
            try:
                await self._open()
            except (TimeoutError, nats.errors.Error) as exc:  # the server away: the watch retries
                log.debug("%s: consumer not started again: %r", self.stream, exc)

    def _forget(self, task: asyncio.Task[None]) -> None:
        with contextlib.suppress(ValueError):
            self._tasks.remove(task)

    async def _watch(self) -> None:
        """Start a new consumer when the current one has been silent ``STALE_S`` (heartbeats
        come every ``HEARTBEAT_S``): its server restarted, or the connection was away long
        enough for it to go."""
        loop = asyncio.get_running_loop()
        while not self._halted:
            await asyncio.sleep(HEARTBEAT_S)
            if self._halted:
                return
            sub = self._sub
            # Messages the client holds for the runner's callback are news too (a loop too
            # busy to hand them over is not a silent server).
            if sub is None or (loop.time() - self._heard_at > STALE_S and not sub.pending_msgs):
                await self._restart("no message or heartbeat from it", self._generation)

    # ---- handling what arrives ----------------------------------------------------------------

    async def _run(self) -> None:
        queue = self._queue
        loop = asyncio.get_running_loop()
        while not self._halted:
            if not queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            generation, msg = queue.popleft()
            if generation != self._generation:
                continue
            # A delivery is known by its reply subject, never by its headers: a router can put
            # a "Status" header on an event, and no event may pass for a control message.
            if not msg.reply.startswith(DELIVERY):
                await self._control(msg, generation)
                continue
            self._held -= 1
            try:
                tokens = msg.reply.split(".")
                delivered, seq = int(tokens[-3]), int(tokens[-4])
            except (ValueError, IndexError):
                continue  # not a delivery of a consumer: nothing sends one to the inbox
            if delivered != self._delivered + 1:
                await self._restart(
                    f"delivery {delivered} came after {self._delivered}", generation
                )
                continue
            self._delivered = delivered
            if seq > self.position.value:
                await self._deliver(msg, seq)
                if self._halted or generation != self._generation:
                    continue
            self._unacked += 1
            self._ack_reply = msg.reply
            if self._unacked >= self._ack_every or (
                not queue and loop.time() - self._acked_at >= ACK_IDLE_S
            ):
                await self._ack()

    async def _ack(self) -> None:
        """Acknowledge every message handled so far (acknowledgement ``all``)."""
        reply, self._unacked = self._ack_reply, 0
        self._acked_at = asyncio.get_running_loop().time()
        if reply is not None:
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._nc.publish(reply, ACK)

    async def _control(self, msg: Msg, generation: int) -> None:
        """A status message: flow control, a heartbeat, or the consumer gone."""
        headers = msg.headers or {}
        status = headers.get(STATUS)
        nc = self._nc
        if status == "100" and msg.reply:  # flow control: everything before it is handled
            with contextlib.suppress(nats.errors.Error, OSError):
                await nc.publish(msg.reply)
            return
        if status == "100":  # an idle heartbeat
            stalled = headers.get(api.Header.CONSUMER_STALLED)
            with contextlib.suppress(nats.errors.Error, OSError):
                if stalled:
                    await nc.publish(stalled)
                if self._ack_reply is not None:  # an ack lost in a reconnect would stall it
                    await nc.publish(self._ack_reply, ACK)
            last = headers.get(api.Header.LAST_CONSUMER)
            if last is not None and last.isdigit() and int(last) > self._delivered:
                await self._restart(
                    f"delivery {last} was sent, {self._delivered} received", generation
                )
            return
        if status in ("409", "404"):  # the consumer deleted, or no longer there
            said = f"{status} {headers.get(api.Header.DESCRIPTION, '')}".strip()
            await self._restart(said, generation)

    def halt(self) -> None:
        """Hand no further message over; synchronous, so any callback can call it."""
        self._halted = True

    async def stop(self) -> None:
        """Halt, then end the subscription and the consumer (within bounds: the server may be
        away). A message being handled is left to finish only if this is called from within
        it."""
        self._halted = True
        self._wake.set()
        current = asyncio.current_task()
        for task in list(self._tasks):
            if task is not current:
                await cancel(task)
        self._tasks = []
        if self._dead_letters is not None:
            self._dead_letters.say_held()
        if self._sub is not None:
            await attempt(self._sub.unsubscribe())
            self._sub = None
        if self._consumer is not None:
            name, self._consumer = self._consumer, None
            if self._nc.is_connected:  # else it goes by itself, once without interest
                await attempt(self._js.delete_consumer(self.stream, name))

    async def _deliver(self, msg: Msg, seq: int) -> None:
        if self._halted:
            return
        try:
            refused = await self._processor.handle(msg)
            if refused is not None:
                if type(refused) is list:  # events of a record batch, each its own letter
                    for each in refused:
                        await self._dead_letter(msg, each)
                else:
                    await self._dead_letter(msg, refused)  # type: ignore[arg-type]
            # A backlog never makes a handler wait, so it would starve the loop's other tasks
            # (the delta log, a snapshot being saved, the ticker, the lease): give them a turn,
            # every YIELD_EVERY messages (a turn per message cost a loop pass per event).
            self._since_yield += 1
            if self._since_yield >= YIELD_EVERY:
                self._since_yield = 0
                await asyncio.sleep(0)
        except Exception as exc:
            self._halted = True
            self.failure = exc
            self._on_failure(exc)
            return
        if not self.caught_up.is_set() and seq >= self._target:
            self.caught_up.set()
        self.position.advance(seq)

    async def _dead_letter(self, msg: Msg, refused: Refused) -> None:
        seq = log_time_ns(msg)[0]
        if self._dead_letters is None:
            raise RuntimeError(
                f"message {seq} of {self.stream} refused ({refused.kind}: {refused.reason}), "
                "and this consumer has no dead letters to put it in"
            )
        # ``index`` only for an event of a batch: a sink of a consumer that never reads one
        # need not know the word.
        at = {} if refused.index is None else {"index": refused.index}
        await self._dead_letters.put(
            self.stream,
            seq,
            msg.subject,
            msg.data if refused.payload is None else refused.payload,
            refused.reason,
            kind=refused.kind,
            fields=refused.fields,
            **at,
        )
        if isinstance(self._processor, RefusingProcessor):
            self._processor.dead_lettered(seq, refused)
