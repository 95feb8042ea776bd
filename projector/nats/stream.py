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
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import NotFoundError

from projector.nats.progress import Progress
from projector.nats.tasks import attempt


def _utf8(raw: bytes) -> bytes:
    return raw.decode(errors="replace").encode()


def _tolerate_any_subject() -> None:
    """A message whose subject is not UTF-8 must not stop a consumer.

    nats-py decodes each delivery's subject strictly, in its read loop: one message published
    raw on ``seqstate.events.<ns>.\\xff.0`` raised there, and the connection silently stopped
    handing messages over, to the writer and to every subscription on it, at every restart.
    Decoded with replacement characters instead (as the fast replay reader decodes it), such
    a subject meets no event's own, and the fold refuses it (``wrong_subject``) on every path
    alike. Patched only where the client has the method this knows (nats-py 2.x)."""
    original = getattr(Client, "_build_message", None)
    if original is None or getattr(original, "_seqstate_tolerant", False):
        return
    if list(inspect.signature(original).parameters) != [
        "self",
        "sid",
        "subject",
        "reply",
        "data",
        "headers",
    ]:
        return

    def build(
        self: Client,
        sid: int,
        subject: bytes,
        reply: bytes,
        data: bytes,
        headers: dict[str, str] | None,
    ) -> Any:
        try:
            return original(self, sid, subject, reply, data, headers)
        except UnicodeDecodeError:
            return original(self, sid, _utf8(subject), _utf8(reply), data, headers)

    build._seqstate_tolerant = True  # type: ignore[attr-defined]
    Client._build_message = build  # type: ignore[method-assign]


_tolerate_any_subject()


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
    the message (its request id, worker...), for the log line only.
    """

    kind: str
    reason: str
    fields: Mapping[str, Any] | None = field(default=None, compare=False)


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
    ) -> None: ...


class Processor(Protocol):
    async def handle(self, msg: Msg) -> Refused | None:
        """Take one message, or refuse it; an exception stops the consumer that runs it."""


@runtime_checkable
class RefusingProcessor(Processor, Protocol):
    """A processor that keeps count of its refusals, or whose position must move past them."""

    def dead_lettered(self, seq: int, refused: Refused) -> None:
        """Message ``seq`` was refused and its dead letter is stored: count it, move past it."""


class OrderedConsumer:
    """Runs a processor over ``subjects`` of ``stream``, in stream order, from a position.

    An ordered push consumer is the fastest consumer nats-py has, and gap-free: it resets
    itself on a missed sequence. The client calls back in one task per subscription, so each
    message is handled there, one after another, with no task or wake-up of its own. What the
    client does not do is done here:

    - it swallows a callback's exception, so a processor would fail silently and go on with
      the next message: the failure is kept in ``failure``, reported once to ``on_failure``,
      and no further message is handed over;
    - a backlog never makes the callback wait, so it would starve the loop's other tasks (a
      processor's background work): after each message the loop gets a turn;
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
    ) -> None:
        self.stream = stream
        self.subjects = subjects
        self.position = position if position is not None else Progress()
        self.caught_up = asyncio.Event()
        self.failure: BaseException | None = None
        self._js = js
        self._processor = processor
        self._dead_letters = dead_letters
        self._on_failure = on_failure
        self._target = 0
        self._halted = False
        self._sub: JetStreamContext.PushSubscription | None = None

    async def start(self, after: int = 0) -> None:
        """Subscribe from the message after stream sequence ``after`` (0: from the first)."""
        self.position.advance(after)
        self._target = await last_seq_of(self._js, self.stream, self.subjects)
        if self._target <= after:
            self.caught_up.set()
        policy, config = None, None
        if after:
            policy = api.DeliverPolicy.BY_START_SEQUENCE
            config = api.ConsumerConfig(opt_start_seq=after + 1)
        self._sub = await self._js.subscribe(
            self.subjects,
            stream=self.stream,
            ordered_consumer=True,
            idle_heartbeat=1.0,
            cb=self._deliver,
            deliver_policy=policy,
            config=config,
        )

    def halt(self) -> None:
        """Hand no further message over; synchronous, so any callback can call it."""
        self._halted = True

    async def stop(self) -> None:
        """Halt, then end the subscription (within bounds: the server may be away)."""
        self._halted = True
        if self._sub is not None:
            await attempt(self._sub.unsubscribe())
            self._sub = None

    async def _deliver(self, msg: Msg) -> None:
        if self._halted:
            return
        try:
            refused = await self._processor.handle(msg)
            if refused is not None:
                await self._dead_letter(msg, refused)
            await asyncio.sleep(0)
        except Exception as exc:
            self._halted = True
            self.failure = exc
            self._on_failure(exc)
            return
        seq = log_time_ns(msg)[0]
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
        await self._dead_letters.put(
            self.stream,
            seq,
            msg.subject,
            msg.data,
            refused.reason,
            kind=refused.kind,
            fields=refused.fields,
        )
        if isinstance(self._processor, RefusingProcessor):
            self._processor.dead_lettered(seq, refused)
