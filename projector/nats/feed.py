"""What reads a stream for a consumer: its messages in stream order, at most ``window`` held.

nats-py's ordered push consumer fed the consumers first, and one far behind (a writer paused
for 20 s under load) showed what it does not bound: the server pushes at full speed, nats-py
answers the flow control on receipt rather than once a message is handled, so the client
queued half a million messages (36 MB became 612 MB, never returned), dropped the rest one
slow-consumer error at a time, reset, and took 133 s to catch up. So the feed makes its own
push consumer, ordered as nats-py's is, and bounded by the server:

- acknowledgement ``all`` with ``max_ack_pending = window``: the server sends at most
  ``window`` messages past the last one acknowledged, and the feed acknowledges (one ack
  covers every message before it) each quarter window handled, and when all it holds is
  handled (at most every ``ACK_IDLE_S``; each idle heartbeat acks the rest). What it holds is
  ``window`` messages at most, whatever the backlog, and a backlog flows at the handler's own
  rate, with no drop, no reset and no wasted delivery;
- flow control, answered once the messages before it are handled: a bound in bytes too (the
  server's window, at most 32 MB), for very large messages;
- ordered: a message whose consumer sequence is not the next one (lost in a reconnect, or by
  a slow-consumer drop) makes the feed start a new consumer after the last message handled
  (its ``position``), as does a heartbeat naming a later delivery than the last one received,
  and silence (no message or heartbeat for ``STALE_S``: the consumer or its server is gone).

The client's subscription only queues what arrives; whoever drives the feed (a
:class:`~projector.nats.runner.Runner`) takes the messages off in a task of its own, so that
replacing the subscription never cancels a message being handled. :meth:`StreamFeed.take` is
the fast path, synchronous: the next delivery in order. What it cannot give (a status
message, a gap, nothing yet) :meth:`StreamFeed.settle` deals with.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

from projector.aio.progress import Progress
from projector.aio.tasks import attempt, cancel
from projector.nats import client_internals, direct_delivery

log = logging.getLogger("seqstate")

# Messages a feed holds received and not yet handled, at most (``consumer_window``): what a
# consumer far behind holds in memory, whatever its backlog. 4096 large AddRequests are ~10 MB.
DEFAULT_WINDOW = 4096
MIN_WINDOW = 16
HEARTBEAT_S = 1.0  # the server's idle heartbeat to the feed's consumer
# Caught up, the feed acks what was handled at most this often (a heartbeat acks the rest):
# not once per message, which at a call's pace was one more message per event to the server.
ACK_IDLE_S = 0.05
STALE_S = 3.5  # no message and no heartbeat for this long: the consumer (or server) is gone
CREATE_S = 5.0  # creating a consumer: a server that does not answer in time is asked again
ACK_WAIT_S = 22 * 3600.0  # never redelivered for want of an ack: ordered, as nats-py's are
ACK = b"+ACK"
STATUS = api.Header.STATUS
DELIVERY = "$JS.ACK."  # the reply subject of every message a consumer delivers


class StreamFeed:
    """``subjects`` of ``stream`` in stream order, from the message after ``position``, with at
    most ``window`` messages received and not yet handled.

    ``position`` is the driver's: it advances as messages are handled, and a new consumer
    starts after it. A message already handled (sent again after a restart) comes again; the
    driver passes it over.
    """

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        subjects: str,
        position: Progress,
        *,
        window: int = DEFAULT_WINDOW,
    ) -> None:
        if window < MIN_WINDOW:
            raise ValueError(f"window={window}: must be at least {MIN_WINDOW}")
        self.stream = stream
        self.subjects = subjects
        self.position = position
        self.window = window
        self.peak_held = 0  # the most messages ever received and not yet handled at once
        self.restarts = 0  # consumers started again (a gap, a silent server)
        self._js = js
        self._nc: Client | None = None  # the client of ``js``, at the first open
        self._loop: asyncio.AbstractEventLoop | None = None
        self._halted = False
        self._ack_every = max(1, window // 4)
        # The current subscription and consumer; ``_generation`` tells their messages from
        # those of one replaced (still queued, or arriving late).
        self._sub: Subscription | None = None
        self._consumer: str | None = None
        self._generation = 0
        self._taken = 0  # the generation of the message last taken
        self._queue: deque[tuple[int, Msg]] = deque()
        self._held = 0  # deliveries in the queue (not status messages)
        self._wake = asyncio.Event()
        self._delivered = 0  # consumer sequence of the last message taken from the queue
        self._unacked = 0  # handled since the last ack
        self._ack_reply: str | None = None  # the last message handled: acking it acks all
        self._acked_at = 0.0  # loop time of the last ack
        self._heard_at = 0.0  # loop time of the last message or heartbeat received
        self._reopen = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def held(self) -> int:
        """Messages received and not yet handled (at most ``window``)."""
        return self._held

    async def open(self) -> None:
        """Subscribe after the position, and watch for silence from then on."""
        await self._open()
        self._tasks.append(asyncio.create_task(self._watch(), name=f"seqstate-watch-{self.stream}"))

    # ---- taking messages off -----------------------------------------------------------------

    def take(self) -> tuple[Msg, int] | None:
        """The next delivery and its stream sequence; None when the head of the queue is for
        :meth:`settle` (a status message, a gap) or the queue is empty."""
        queue = self._queue
        while queue:
            generation, msg = queue[0]
            if generation != self._generation:
                queue.popleft()
                continue
            # A delivery is known by its reply subject, never by its headers: a router can put
            # a "Status" header on an event, and no event may pass for a control message.
            if not msg.reply.startswith(DELIVERY):
                return None
            try:
                tokens = msg.reply.split(".")
                delivered, seq = int(tokens[-3]), int(tokens[-4])
            except (ValueError, IndexError):
                queue.popleft()  # not a delivery of a consumer: nothing sends one to the inbox
                self._held -= 1
                continue
            if delivered != self._delivered + 1:
                return None
            queue.popleft()
            self._held -= 1
            self._delivered = delivered
            self._taken = generation
            return msg, seq
        return None

    async def settle(self) -> None:
        """Deal with what :meth:`take` left at the head of the queue (a status message, a gap),
        or wait for news."""
        queue = self._queue
        if not queue:
            self._wake.clear()
            await self._wake.wait()
            return
        generation, msg = queue.popleft()
        if generation != self._generation:
            return
        if not msg.reply.startswith(DELIVERY):
            await self._control(msg, generation)
            return
        self._held -= 1
        delivered = msg.reply.split(".")[-3]
        await self._restart(f"delivery {delivered} came after {self._delivered}", generation)

    def handled(self, msg: Msg) -> bool:
        """``msg``, the message last taken, is handled (or passed over): whether an ack is due.
        Nothing is noted of a message whose consumer was replaced meanwhile."""
        if self._taken != self._generation:
            return False
        self._unacked += 1
        self._ack_reply = msg.reply
        return self._unacked >= self._ack_every or (
            not self._queue
            and self._loop is not None
            and self._loop.time() - self._acked_at >= ACK_IDLE_S
        )

    async def ack(self) -> None:
        """Acknowledge every message handled so far (acknowledgement ``all``)."""
        reply, self._unacked = self._ack_reply, 0
        self._acked_at = asyncio.get_running_loop().time()
        if reply is not None and self._nc is not None:
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._nc.publish(reply, ACK)

    def halt(self) -> None:
        """Start no consumer again, and wake whoever waits in :meth:`settle`."""
        self._halted = True
        self._wake.set()

    async def close(self, current: asyncio.Task[object] | None = None) -> None:
        """Halt, then end the subscription and the consumer (within bounds: the server may be
        away). ``current``: a task not to cancel (the one closing)."""
        self.halt()
        for task in list(self._tasks):
            if task is not current:
                await cancel(task)
        self._tasks = []
        if self._sub is not None:
            await attempt(self._sub.unsubscribe())
            self._sub = None
        if self._consumer is not None:
            name, self._consumer = self._consumer, None
            if self._nc is not None and self._nc.is_connected:  # else it goes by itself
                await attempt(self._js.delete_consumer(self.stream, name))

    # ---- the consumer on the server -----------------------------------------------------------

    async def _open(self) -> None:
        """A subscription and a consumer from the message after the position (the caller
        holds no lock; a failure leaves none, and the watch tries again)."""
        if self._nc is None:
            self._nc = client_internals.client_of(self._js)
        nc = self._nc
        after = self.position.value
        self._generation += 1
        generation = self._generation
        self._delivered = self._unacked = 0
        self._ack_reply = None
        self._queue.clear()  # anything queued is of a consumer replaced
        self._held = 0

        loop = self._loop = asyncio.get_running_loop()

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
            # Messages the client holds for the feed's callback are news too (a loop too busy
            # to hand them over is not a silent server).
            if sub is None or (loop.time() - self._heard_at > STALE_S and not sub.pending_msgs):
                await self._restart("no message or heartbeat from it", self._generation)

    async def _control(self, msg: Msg, generation: int) -> None:
        """A status message: flow control, a heartbeat, or the consumer gone."""
        headers = msg.headers or {}
        status = headers.get(STATUS)
        nc = self._nc
        assert nc is not None, "a message comes only once opened"
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
