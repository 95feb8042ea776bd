"""JetStream plumbing that every reader of the streams shares, so that it is done one way.

The writer, the projector and replay read their streams alike: the same headers link a
message to the event it stands for, the same reply subject says where and when the log stored
it, and an ordered push consumer feeds each of them in stream order. Spelled once here, a
header cannot drift between the side that writes it and the side that reads it.

A consumer's logic is a *processor*: an object whose async ``handle(msg)`` takes one message
and knows nothing of subscriptions, start positions or the client's quirks. The
:class:`~projector.nats.consumer.OrderedConsumer` runs it, as eventsourcing's runners run an
``EventProcessor``. A processor that cannot read a message says so by returning
:class:`Refused`; dead-lettering wraps it (:mod:`projector.nats.dead_lettering`) and writes the
dead letter, so that every consumer dead-letters the same way and no processor holds
dead-letter code of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from projector.aio.tasks import attempt
from projector.nats import client_internals


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
    consumer, as :class:`~projector.nats.consumer.OrderedConsumer` does at its stop. Left to the
    server, a consumer outlives its subscription by its inactive threshold (five minutes for a
    KV watch), and a process that opens and closes watches as it goes (serve-http, as slot
    trackers come and go) would leave them behind by the hundred. Clean-up only: a failure is
    passed over."""
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
