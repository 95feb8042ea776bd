"""The projector tells a forged break of the delta chain from deltas that were really lost.

A writer's DELTAS messages form a chain: each names the event the one before it ended at.
A message that breaks the chain right after the message before it (no message of the stream
between them was removed) lost nothing: it is not a writer's, and once stopped the projector
for good, at every restart (``DeltaGap``). It is dead-lettered now. A break across messages
that are gone from the stream is a real gap: the bucket cannot follow it, and the projector
still stops and says so.
"""

from __future__ import annotations

import asyncio

import pytest
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config, read_stream

from projector.bucket.projection import DeltaGap
from projector.nats.resources import dead_letter_stream, ensure
from projector.run.assemble import build_delta_log, build_projector, delta_log_settings
from projector.settings.config import Config
from projector.wire.headers import (
    BATCH_COMMIT,
    BATCH_ID,
    BATCH_SEQUENCE,
    PREV_SOURCE_SEQ,
    REASON,
)
from projector.write.delta_log import MAX_BATCH, DeltaLog
from seqstate import AddRequest, Delta, RankChange, encode_deltas, encode_event
from seqstate.deltas import Booking
from seqstate.loads import RankLoad

S = 1_000_000_000


def booked(seq: int, slot: int) -> Delta:
    """The delta of an add on rank (1, 0) that took ``slot``, at event ``seq``."""
    load = RankLoad(active_blocks=1, active_requests=slot + 1)
    change = RankChange((1, 0), load, booked=[Booking(slot, f"r{slot}", [slot])])
    return Delta("applied", seq * S, changes=[change], seq=seq)


async def chain(nc: Client, config: Config, messages: list[tuple[int, Delta]]) -> None:
    """Events 1..10 in the log, then ``messages`` (prev, delta) on the deltas subject."""
    await ensure(nc, config)
    js = nc.jetstream()
    for i in range(10):
        await js.publish(config.event_subject(1), encode_event(AddRequest(f"e{i}", 1)))
    for prev, delta in messages:
        await js.publish(
            config.deltas_subject, encode_deltas([delta]), headers={PREV_SOURCE_SEQ: str(prev)}
        )


async def test_a_break_right_after_the_message_before_it_is_dead_lettered(nc: Client) -> None:
    config = fresh_config("chain")
    bomb = Delta("applied", 4 * S, changes=[RankChange((1, 2**32), RankLoad())], seq=4)
    await chain(
        nc,
        config,
        [
            (0, booked(1, 0)),
            (3, booked(4, 1)),  # forged: the chain ended at event 1
            (1, bomb),  # forged: a rank no event can name (a dp rank past u32)
            (1, booked(2, 1)),  # the writer's own continues
            (2, booked(3, 2)),
        ],
    )
    projector = build_projector(nc, config)
    task = asyncio.create_task(projector.run())
    try:
        await eventually(
            lambda: (projector.applied_seq, projector.stats.dead_letters),
            lambda got: got == (3, 2) or task.done(),
            what="the chain applied to event 3, the two forged messages dead-lettered",
            check=lambda: task.exception() if task.done() else None,
        )
        assert not task.done()
        assert projector.image.slot_keys[(1, 0)] == {0, 1, 2}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    letters = await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject)
    assert [h[REASON] for _, h, _ in letters] == [
        "not a writer's delta: it continues from event 3, but the message before it ended at "
        "event 1",
        "not a writer's delta: rank (1, 4294967296) is out of range",
    ]


async def test_a_break_across_removed_messages_stops_the_projector(nc: Client) -> None:
    config = fresh_config("gap")
    await chain(nc, config, [(0, booked(1, 0)), (1, booked(2, 1)), (2, booked(3, 2))])
    js = nc.jetstream()
    await js.delete_msg(config.deltas_stream, 2)  # lost: event 2's delta
    projector = build_projector(nc, config)
    with pytest.raises(DeltaGap, match="message 3 continues from event 2, but the bucket "):
        await asyncio.wait_for(projector.run(), 30)
    assert projector.applied_seq == 1


async def test_a_restarting_writer_resumes_at_the_real_chain_not_at_a_broken_copy(
    nc: Client,
) -> None:
    """Broke (the fuzz on real processes found it): a restarting writer took the deltas
    subject's last message for the chain's end if it merely decoded. A broken copy of an
    older message stored last made it resume from that older event; its deltas then came back
    as duplicates of its predecessor's, and it stopped on its predecessor's real chain as if
    another writer had written it. Expected: the copy (no chain header; then with a chain
    that breaks) is stepped over, and the chain's end is the last real message's event."""
    config = fresh_config("resume")
    await chain(nc, config, [(0, booked(1, 0)), (1, booked(2, 1)), (2, booked(3, 2))])
    js = nc.jetstream()
    copy = encode_deltas([booked(1, 0)])
    await js.publish(config.deltas_subject, copy)  # no chain header
    await js.publish(config.deltas_subject, copy, headers={PREV_SOURCE_SEQ: "5"})
    assert await build_delta_log(nc, config).open() == 3


async def test_deltas_folded_close_together_share_one_message(nc: Client) -> None:
    """A live event's delta that comes within ``linger_s`` of the last store waits for the
    deltas of the events folded right after it, so that calls made one at a time share a
    message, its ack and its deliveries, instead of one each; the first delta after a quiet
    spell goes at once; a flush (a writer stopping, a caller waiting for the bucket) ends the
    wait, and so does a full message. Expected, with a linger of a minute: the first delta is
    stored at once, alone; three more appended a loop turn apart are one message once flushed;
    a full message's worth more is stored with no flush, long before the minute is out; the
    chain runs on across all."""
    config = fresh_config("linger")
    await ensure(nc, config)
    settings = delta_log_settings(config)
    log = DeltaLog(nc.jetstream(), settings, max_payload=nc.max_payload, linger_s=60.0)
    await log.take_batches()
    assert await log.open() == 0
    failures: list[BaseException] = []
    log.start(failures.append)
    log.append(booked(1, 1))  # after a quiet spell: stored at once, with no flush
    await log.stored.wait(1, timeout=10)
    assert (log.messages, log.deltas) == (1, 1)
    log.append(booked(2, 2))
    for _ in range(3):  # the log takes the delta and waits for more
        await asyncio.sleep(0)
    log.append(booked(3, 3))
    await asyncio.sleep(0)
    log.append(booked(4, 4))
    await asyncio.wait_for(log.flush(), 10)
    assert (log.messages, log.deltas) == (2, 4)
    for seq in range(5, 5 + MAX_BATCH):
        log.append(booked(seq, seq))
    await log.stored.wait(4 + MAX_BATCH, timeout=10)
    assert (log.messages, log.deltas) == (3, 4 + MAX_BATCH)
    # Fewer deltas, but more bytes than a message holds (long prompts): no linger either.
    first = 5 + MAX_BATCH
    hashes = [2**63 + i for i in range(4_000)]  # 9 bytes each: ~36 KB a delta
    big = nc.max_payload // 36_000 + 2
    for seq in range(first, first + big):
        load = RankLoad(active_blocks=len(hashes), active_requests=1)
        change = RankChange((1, 0), load, booked=[Booking(seq, f"r{seq}", hashes)])
        log.append(Delta("applied", seq * S, changes=[change], seq=seq))
    await log.stored.wait(first + big - 1, timeout=10)
    await log.close()
    assert failures == [] and log.deltas == 4 + MAX_BATCH + big
    stored = await read_stream(nc, config.deltas_stream, config.deltas_subject)
    chain = [h[PREV_SOURCE_SEQ] for _, h, _ in stored][:4]
    assert chain == ["0", "1", "4", str(4 + MAX_BATCH)]


async def test_appends_are_atomic_batches_where_the_stream_takes_them_else_single_messages(
    nc: Client,
) -> None:
    """A backlog's deltas go out many messages per round trip, as one atomic batch, where the
    deltas stream takes atomic batches (``ensure`` turns them on); on a stream without them
    (a server older than 2.12) one message at a time, as before. Expected: without, 300
    deltas are two messages without batch headers; ``ensure`` turns batches on again; then 300
    more are two messages of one batch; the chain runs on unbroken across both."""
    config = fresh_config("batch")
    await ensure(nc, config)
    js = nc.jetstream()
    for i in range(600):
        await js.publish(config.event_subject(1), encode_event(AddRequest(f"e{i}", 1)))
    info = await js.stream_info(config.deltas_stream)
    assert info.config.allow_atomic is True
    info.config.allow_atomic = False
    await js.update_stream(info.config)

    async def append(first: int, atomic: bool) -> None:
        log = build_delta_log(nc, config)
        await log.take_batches()
        assert await log.open() == first - 1
        assert log.atomic is atomic
        failures: list[BaseException] = []
        log.start(failures.append)
        for seq in range(first, first + 300):
            log.append(booked(seq, seq))
        await log.flush()
        await log.close()
        assert failures == [] and (log.messages, log.deltas) == (2, 300)

    await append(1, atomic=False)
    await ensure(nc, config)
    await append(301, atomic=True)
    stored = await read_stream(nc, config.deltas_stream, config.deltas_subject)
    assert [h[PREV_SOURCE_SEQ] for _, h, _ in stored] == ["0", "256", "300", "556"]
    assert [h.get(BATCH_SEQUENCE) for _, h, _ in stored] == [None, None, "1", "2"]
    assert stored[2][1][BATCH_ID] == stored[3][1][BATCH_ID]
    assert BATCH_COMMIT in stored[3][1] and BATCH_COMMIT not in stored[2][1]
