"""Refusals, without a server: the consumer's order of things, and processors with stand-ins.

Dead-lettering must store a dead letter before it tells the processor, and the runner moves
the position only after (a crash in between re-reads the message, and the dead letter's
msg-id makes the second copy a duplicate); a dead letter that cannot be stored stops the
runner with the message unpassed. A
projector, handed stand-ins for everything it works with, refuses what it cannot read and
moves its position only once told the dead letter is stored.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any, cast

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from projector.aio.progress import Progress
from projector.bucket.contents import BucketView
from projector.bucket.projection import Projector, ProjectorSettings
from projector.nats.consumer import OrderedConsumer
from projector.nats.dead_lettering import DeadLettering
from projector.nats.dead_letters import PROJECTOR_KINDS, UNDECODABLE
from projector.nats.feed import StreamFeed
from projector.nats.host import Host
from projector.nats.lag import Lag, LagSettings
from projector.nats.lease import Lease
from projector.nats.runner import Runner
from projector.nats.stream import Refused


def delivery(seq: int, data: bytes, headers: dict[str, str] | None = None) -> Msg:
    """A JetStream delivery of stream sequence ``seq`` (its reply subject says where)."""
    reply = f"$JS.ACK.S.C.1.{seq}.{seq}.{1_700_000_000_000_000_000 + seq}.0"
    return Msg(cast(Any, None), subject="s.x", reply=reply, data=data, headers=headers)


class Sink:
    """Dead letters kept in a list; ``broken``: the server will not store them."""

    def __init__(self, kinds: tuple[str, ...], events: list[str], *, broken: bool = False):
        self.counts = dict.fromkeys(kinds, 0)
        self.put_args: list[tuple[str, int, str, bytes, str, str, Mapping[str, Any] | None]] = []
        self._events = events
        self._broken = broken

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
    ) -> None:
        if self._broken:
            raise TimeoutError("dead letter not stored")
        self._events.append(f"put {seq}")
        self.put_args.append((stream, seq, subject, payload, reason, kind, fields))
        self.counts[kind] += 1

    def say_held(self) -> None:
        pass


class Refuser:
    def __init__(self, events: list[str]) -> None:
        self._events = events
        self.runner: OrderedConsumer | None = None

    async def handle(self, msg: Msg) -> Refused | None:
        if msg.data == b"no":
            return Refused(UNDECODABLE, "it said no", {"request_id": "r1"})
        return None

    def dead_lettered(self, seq: int, refused: Refused) -> None:
        assert self.runner is not None
        self._events.append(f"told {seq} {refused.kind} at {self.runner.position.value}")


def consumer(processor: Refuser, sink: Sink, failures: list[BaseException]) -> OrderedConsumer:
    js = cast(JetStreamContext, None)  # never subscribed here: messages are delivered by hand
    return OrderedConsumer(js, "S", "s.>", processor, on_failure=failures.append, dead_letters=sink)


async def test_the_dead_letter_is_stored_then_the_processor_told_then_the_position_moved() -> None:
    events: list[str] = []
    failures: list[BaseException] = []
    sink = Sink((UNDECODABLE,), events)
    refuser = Refuser(events)
    runner = refuser.runner = consumer(refuser, sink, failures)
    await runner.runner.deliver(delivery(1, b"yes"), 1)
    await runner.runner.deliver(delivery(2, b"no"), 2)
    await runner.runner.deliver(delivery(3, b"yes"), 3)
    assert not failures and runner.position.value == 3
    assert events == ["put 2", f"told 2 {UNDECODABLE} at 1"]  # stored, told, then moved
    assert sink.put_args == [
        ("S", 2, "s.x", b"no", "it said no", UNDECODABLE, {"request_id": "r1"})
    ]
    assert sink.counts == {UNDECODABLE: 1}


async def test_a_dead_letter_not_stored_stops_the_runner_before_the_message() -> None:
    events: list[str] = []
    failures: list[BaseException] = []
    runner = consumer(Refuser(events), Sink((UNDECODABLE,), events, broken=True), failures)
    await runner.runner.deliver(delivery(1, b"yes"), 1)
    await runner.runner.deliver(delivery(2, b"no"), 2)
    await runner.runner.deliver(delivery(3, b"yes"), 3)  # halted: not handed over
    assert [type(exc) for exc in failures] == [TimeoutError]
    assert runner.position.value == 1 and events == []


class Batch:
    """Refuses the events of a record batch one by one: the second and the third."""

    def __init__(self) -> None:
        self.told: list[tuple[int, int | None]] = []

    async def handle(self, msg: Msg) -> list[Refused]:
        return [
            Refused(UNDECODABLE, "second", index=1, payload=b"e1"),
            Refused(UNDECODABLE, "third", index=2, payload=b"e2"),
        ]

    def dead_lettered(self, seq: int, refused: Refused) -> None:
        self.told.append((seq, refused.index))


class IndexedSink(Sink):
    async def put(self, *args: Any, index: int | None = None, **kwargs: Any) -> None:
        await super().put(*args, **kwargs)
        self.put_args[-1] = (*self.put_args[-1], index)  # type: ignore[assignment]


async def test_dead_lettering_writes_each_refused_event_once_and_refuses_nothing() -> None:
    """The wrapper stores what the processor refuses (each event of a batch its own letter,
    with its own bytes) and answers as if handled: the runner sees no refusal."""
    events: list[str] = []
    sink = IndexedSink((UNDECODABLE,), events)
    batch = Batch()
    wrapped = DeadLettering(batch, sink, "S")
    assert await wrapped.handle(delivery(7, b"batch")) is None
    assert [(args[1], args[3], args[-1]) for args in sink.put_args] == [
        (7, b"e1", 1),
        (7, b"e2", 2),
    ]
    assert batch.told == [(7, 1), (7, 2)] and sink.counts == {UNDECODABLE: 2}


async def test_a_runner_without_dead_lettering_stops_at_a_refusal() -> None:
    """A refusal that reaches the runner (nothing wraps the processor) is never passed over."""
    events: list[str] = []
    failures: list[BaseException] = []
    position = Progress()
    feed = StreamFeed(cast(JetStreamContext, None), "S", "s.>", position)
    runner = Runner(feed, Refuser(events), position=position, on_failure=failures.append)
    await runner.deliver(delivery(1, b"yes"), 1)
    await runner.deliver(delivery(2, b"no"), 2)
    await runner.deliver(delivery(3, b"yes"), 3)
    assert [str(exc) for exc in failures] == [
        f"message 2 of S refused ({UNDECODABLE}: it said no), and this consumer has no dead "
        "letters to put it in"
    ]
    assert runner.halted and position.value == 1 and events == []


def stand_in_projector(sink: Sink) -> Projector:
    """A projector whose every collaborator is a stand-in: it reads no Config."""

    class NC:
        max_payload = 1 << 20

        def jetstream(self) -> Any:
            return None

    @contextlib.asynccontextmanager
    async def announce(kind: str, status: Any) -> AsyncIterator[None]:
        yield None

    async def provision() -> None:
        return None

    def lease(on_lost: Any) -> Lease:
        raise AssertionError("no lease taken here")

    async def bucket() -> BucketView:
        raise AssertionError("no bucket read here")

    async def lag(applied: int, delta_seq: int) -> Lag:
        return Lag()

    projector = Projector(
        cast(Client, NC()),
        ProjectorSettings("ns", "EV", "DL", "seqstate.deltas.ns", "reg", 0.005),
        dead_letters=sink,
        host=Host(provision=provision, announce=announce),
        lease=lease,
        read_bucket=bucket,
        lag=LagSettings("ns", None, None, 1.0),
        measure_lag=lag,
    )
    return projector


async def test_the_projector_refuses_what_it_cannot_read_and_moves_only_when_told() -> None:
    projector = stand_in_projector(Sink(PROJECTOR_KINDS, []))
    refused = await projector.handle(delivery(7, b"\x93not deltas"))
    assert refused is not None and refused.kind == UNDECODABLE
    assert refused.reason.startswith("delta does not decode: ")
    assert projector.delta_seq == 0 and projector.stats.dead_letters == 0  # not yet stored
    projector.dead_lettered(7, refused)
    assert projector.delta_seq == 7 and projector.stats.dead_letters == 1


def test_a_refusal_is_a_value() -> None:
    """Equal refusals are equal whatever their log fields: they say the same to the reader."""
    assert Refused(UNDECODABLE, "x", {"a": 1}) == Refused(UNDECODABLE, "x")
