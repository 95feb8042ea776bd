"""The runner dead-letters what its processor refuses, against a real nats-server.

A processor only says ``Refused(kind, reason)``; the :class:`OrderedConsumer` that runs it
writes the dead letter (once, even when the message is read again), the processor hears of
it, and the position moves past the message to the next one.
"""

from __future__ import annotations

import asyncio

from nats.aio.client import Client
from nats.aio.msg import Msg
from pipeline_kit import fresh_config, read_stream

from projector.nats.consumer import OrderedConsumer
from projector.nats.dead_letters import OUT_OF_BOUNDS, UNDECODABLE, WRITER_KINDS
from projector.nats.resources import dead_letter_stream, ensure
from projector.nats.stream import Refused, log_time_ns
from projector.run.assemble import build_dead_letters
from projector.settings.config import Config
from projector.wire.headers import MSG_ID, REASON, SIZE, SOURCE_SEQ, SOURCE_STREAM, SUBJECT

WAIT_S = 10.0


class Picky:
    """Takes ``ok`` messages, refuses ``bad`` ones as undecodable and ``big`` ones as out of
    bounds (the latter with log fields), and records what it was told."""

    def __init__(self) -> None:
        self.taken: list[tuple[int, bytes]] = []
        self.dead: list[tuple[int, str]] = []

    async def handle(self, msg: Msg) -> Refused | None:
        seq = log_time_ns(msg)[0]
        if msg.data.startswith(b"bad"):
            return Refused(UNDECODABLE, f"not an event: {msg.data.decode()}")
        if msg.data.startswith(b"big"):
            return Refused(OUT_OF_BOUNDS, "refused: too many ranks", {"request_id": "r-big"})
        self.taken.append((seq, msg.data))
        return None

    def dead_lettered(self, seq: int, refused: Refused) -> None:
        self.dead.append((seq, refused.kind))


async def publish(nc: Client, config: Config, payloads: list[bytes]) -> list[int]:
    js = nc.jetstream()
    subject = config.event_subject(1)
    return [(await js.publish(subject, data)).seq for data in payloads]


async def run_over(
    nc: Client, config: Config, processor: Picky, last: int
) -> tuple[OrderedConsumer, list[BaseException]]:
    failures: list[BaseException] = []
    consumer = OrderedConsumer(
        nc.jetstream(),
        config.events_stream,
        config.events_subjects,
        processor,
        on_failure=failures.append,
        dead_letters=build_dead_letters(nc, config, WRITER_KINDS),
    )
    await consumer.start()
    try:
        await consumer.position.wait(last, WAIT_S)
    finally:
        await consumer.stop()
    return consumer, failures


async def test_each_refused_message_is_dead_lettered_once_and_the_next_is_handled(
    nc: Client,
) -> None:
    config = fresh_config("rf")
    await ensure(nc, config)
    seqs = await publish(nc, config, [b"ok-1", b"bad-2", b"ok-3", b"big-4", b"bad-5", b"ok-6"])
    picky = Picky()
    consumer, failures = await run_over(nc, config, picky, seqs[-1])
    assert not failures
    assert consumer.position.value == seqs[-1]
    assert picky.taken == [(seqs[0], b"ok-1"), (seqs[2], b"ok-3"), (seqs[5], b"ok-6")]
    assert picky.dead == [(seqs[1], UNDECODABLE), (seqs[3], OUT_OF_BOUNDS), (seqs[4], UNDECODABLE)]
    dead_letters = consumer.dead_letters
    assert dead_letters is not None
    assert dead_letters.counts == {
        UNDECODABLE: 2,
        "too_large": 0,
        OUT_OF_BOUNDS: 1,
        "wrong_subject": 0,
    }

    stored = await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject)
    assert [data for _, _, data in stored] == [b"bad-2", b"big-4", b"bad-5"]
    for (_, headers, _), seq, reason in zip(
        stored,
        [seqs[1], seqs[3], seqs[4]],
        ["not an event: bad-2", "refused: too many ranks", "not an event: bad-5"],
        strict=True,
    ):
        assert headers[REASON] == reason
        assert headers[SOURCE_STREAM] == config.events_stream
        assert headers[SOURCE_SEQ] == str(seq)
        assert headers[SUBJECT] == config.event_subject(1)
        assert headers[SIZE] == "5"
        assert headers[MSG_ID] == f"dead:{config.namespace}:{config.events_stream}:{seq}"


async def test_a_message_read_again_is_dead_lettered_once(nc: Client) -> None:
    """A consumer that re-reads the stream (a restart) writes no second dead letter."""
    config = fresh_config("rf")
    await ensure(nc, config)
    seqs = await publish(nc, config, [b"bad-1", b"ok-2"])
    for _ in range(2):
        picky = Picky()
        consumer, failures = await run_over(nc, config, picky, seqs[-1])
        assert not failures and picky.dead == [(seqs[0], UNDECODABLE)]
        assert consumer.position.value == seqs[-1] and picky.taken == [(seqs[1], b"ok-2")]
    stored = await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject)
    assert [(headers[SOURCE_SEQ], data) for _, headers, data in stored] == [
        (str(seqs[0]), b"bad-1")
    ]


async def test_a_refusal_with_no_dead_letters_stops_the_consumer(nc: Client) -> None:
    """A consumer given nowhere to put a refused message must not pass over it silently."""
    config = fresh_config("rf")
    await ensure(nc, config)
    await publish(nc, config, [b"ok-1", b"bad-2", b"ok-3"])
    picky = Picky()
    failed = asyncio.Event()
    failures: list[BaseException] = []

    def fail(exc: BaseException) -> None:
        failures.append(exc)
        failed.set()

    consumer = OrderedConsumer(
        nc.jetstream(), config.events_stream, config.events_subjects, picky, on_failure=fail
    )
    await consumer.start()
    try:
        await asyncio.wait_for(failed.wait(), WAIT_S)
    finally:
        await consumer.stop()
    assert len(failures) == 1 and "no dead letters" in str(failures[0])
    assert consumer.position.value == 1 and [d for _, d in picky.taken] == [b"ok-1"]
    assert await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject) == []
