"""The writer against a real nats-server: stream order, log time, dead letters, restarts, ticks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta

import msgspec
import pytest
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.nats.dead_letters import PREFIX_BYTES
from projector.nats.resources import dead_letter_stream, ensure
from projector.run.assemble import build_writer
from projector.settings.config import Config
from projector.wire.headers import REASON, SIZE, SOURCE_SEQ, SOURCE_STREAM, TRUNCATED
from projector.write.log_fold import replay
from projector.write.writer import Writer
from seqstate import (
    AddRequest,
    Delta,
    Event,
    Free,
    MarkPrefillCompleted,
    Tick,
    WorkerAdded,
    decode_deltas,
    encode_delta,
    encode_event,
)


def lifecycle(prefix: str) -> list[Event]:
    events: list[Event] = []
    for i in range(6):
        rid = f"{prefix}-{i}"
        worker = i % 2
        events.append(
            AddRequest(
                request_id=rid,
                worker_id=worker,
                block_hashes=[1, 2, 10 + i],
                prefill_tokens=100 + i,
                expected_prefill_ms=50.0,
            )
        )
        if i % 3 != 2:
            events.append(MarkPrefillCompleted(request_id=rid, worker_id=worker))
        if i % 2 == 0:
            events.append(Free(request_id=rid, worker_id=worker))
    return events


async def publish(nc: Client, config: Config, events: list[Event]) -> list[int]:
    js = nc.jetstream()
    seqs = []
    for event in events:  # each on its own subject: the fold refuses it on another
        seqs.append((await js.publish(config.subject_of(event), encode_event(event))).seq)
    return seqs


EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def stream_time_us(stored: datetime | None) -> int:
    """The stored message's time as nats-py parses it: microseconds since the epoch."""
    assert stored is not None
    return (stored - EPOCH) // timedelta(microseconds=1)


async def all_deltas(nc: Client, config: Config) -> list[Delta]:
    js = nc.jetstream()
    info = await js.stream_info(config.deltas_stream)
    stored = [
        (await js.get_msg(config.deltas_stream, seq)).data or b""
        for seq in range(info.state.first_seq, info.state.last_seq + 1)
    ]
    return [delta for data in stored for delta in decode_deltas(data)]


@contextlib.asynccontextmanager
async def running(nc: Client, config: Config) -> AsyncIterator[Writer]:
    writer = build_writer(nc, config)
    task = asyncio.create_task(writer.run())
    try:
        await asyncio.wait_for(writer.caught_up.wait(), 10)
        yield writer
    finally:
        writer.stop()
        await asyncio.wait_for(task, 10)


async def test_writer_folds_in_stream_order_at_log_time(nc: Client) -> None:
    config = fresh_config("w")
    await ensure(nc, config)
    events = lifecycle("a")
    seqs = await publish(nc, config, events)
    async with running(nc, config) as writer:
        await asyncio.wait_for(writer.wait_applied(seqs[-1]), 10)
        await writer.flush()
        deltas = await all_deltas(nc, config)
        assert [d.seq for d in deltas] == seqs
        js = nc.jetstream()
        reference = config.new_state()
        for event, delta in zip(events, deltas, strict=True):
            stored = await js.get_msg(config.events_stream, delta.seq)
            # The writer reads nanoseconds from the delivery; nats-py keeps microseconds.
            assert delta.at_ns // 1000 == stream_time_us(stored.time)  # type: ignore[arg-type]
            expected = reference.apply(event, delta.at_ns)
            expected.seq = delta.seq
            assert encode_delta(expected) == encode_delta(delta)
        assert writer.state.snapshot() == reference.snapshot()


async def test_malformed_message_goes_to_dead_letters_and_the_next_is_applied(nc: Client) -> None:
    config = fresh_config("w")
    await ensure(nc, config)
    js = nc.jetstream()
    bad = await js.publish(config.event_subject(1, 0), b"\x93not an event")
    good = (await publish(nc, config, [AddRequest(request_id="g", worker_id=1)]))[0]
    async with running(nc, config) as writer:
        await asyncio.wait_for(writer.wait_applied(good), 10)
        assert writer.stats.dead_letters == 1
        assert writer.state.requests.worker_for("g") == (1, 0)
        dead = await js.get_msg(dead_letter_stream(config), subject=config.dead_letter_subject)
        assert dead.data == b"\x93not an event"
        assert dead.headers is not None
        assert dead.headers[SOURCE_SEQ] == str(bad.seq)
        assert "malformed" in dead.headers[REASON] or "invalid" in dead.headers[REASON]


async def test_an_event_with_an_unknown_field_is_dead_lettered_naming_it(nc: Client) -> None:
    config = fresh_config("w")
    await ensure(nc, config)
    js = nc.jetstream()
    typo = msgspec.msgpack.encode(
        [
            1,
            {
                "type": "AddRequest",
                "request_id": "t",
                "worker_id": 5,
                "block_hashes": [1],
                "prefil_tokens": 500,
            },
        ]
    )
    bad = await js.publish(config.event_subject(5, 0), typo)
    good = (await publish(nc, config, [AddRequest(request_id="g", worker_id=5)]))[0]
    async with running(nc, config) as writer:
        await asyncio.wait_for(writer.wait_applied(good), 10)
        assert writer.stats.dead_letters == 1
        assert writer.state.requests.worker_for("t") is None  # never booked without prefill
        assert writer.state.requests.worker_for("g") == (5, 0)
        dead = await js.get_msg(dead_letter_stream(config), subject=config.dead_letter_subject)
        assert dead.data == typo
        assert dead.headers is not None and dead.headers[SOURCE_SEQ] == str(bad.seq)
        assert "unknown field `prefil_tokens`" in dead.headers[REASON]


async def test_a_message_near_the_payload_limit_is_dead_lettered_as_a_prefix(nc: Client) -> None:
    config = fresh_config("w")
    await ensure(nc, config)
    js = nc.jetstream()
    huge = b"\xc1" * (nc.max_payload - 10)  # with the reason in headers it could not be stored
    bad = await js.publish(config.event_subject(1, 0), huge)
    good = (await publish(nc, config, [AddRequest(request_id="g", worker_id=1)]))[0]
    for _ in range(2):  # a restarted writer meets it again, and goes on again
        async with running(nc, config) as writer:
            await asyncio.wait_for(writer.wait_applied(good), 10)
            assert writer.state.requests.worker_for("g") == (1, 0)
    dead = await js.get_msg(dead_letter_stream(config), subject=config.dead_letter_subject)
    assert dead.seq == 1  # written once: the second writer's copy was a duplicate
    assert dead.headers is not None
    assert dead.headers[SOURCE_SEQ] == str(bad.seq)
    assert dead.headers[SOURCE_STREAM] == config.events_stream
    assert dead.headers[SIZE] == str(len(huge)) and dead.headers[TRUNCATED] == "true"
    assert dead.data == huge[: len(dead.data or b"")] and len(dead.data or b"") == PREFIX_BYTES
    info = await js.stream_info(dead_letter_stream(config))
    assert info.state.messages == 1


async def test_events_past_the_rank_bounds_are_dead_lettered_and_replays_agree(
    nc: Client,
) -> None:
    config = fresh_config("w", snapshot_bucket=f"wsnap{id(nc)}", max_ranks=3000)
    await ensure(nc, config)
    # 25 small events asked for 102,400 ranks before the bounds.
    events: list[object] = [WorkerAdded(worker_id=w, dp_size=4096) for w in range(25)]
    events += [WorkerAdded(worker_id=w, dp_size=1000) for w in range(4)]  # the 4th: > 3000
    events.append(AddRequest(request_id="g", worker_id=1, dp_rank=999))
    seqs = await publish(nc, config, events)  # type: ignore[arg-type]
    async with running(nc, config) as writer:
        await asyncio.wait_for(writer.wait_applied(seqs[-1]), 10)
        assert writer.stats.dead_letters == 26
        assert len(writer.state.workers.slots) == 3000
        assert writer.state.requests.worker_for("g") == (1, 999)
        state = writer.state.snapshot()
    js = nc.jetstream()
    reasons = [(await js.get_msg(dead_letter_stream(config), n)).headers or {} for n in (1, 26)]
    assert reasons[0][REASON] == (
        "refused: worker 0 would have 4096 ranks, over the bound of "
        "1024 per worker (max_ranks_per_worker)"
    )
    assert reasons[1][REASON] == (
        "refused: the write model would hold 4000 ranks, over the bound of 3000 (max_ranks)"
    )
    replayed = await replay(nc, config, from_seq=seqs[0])
    assert replayed.state.snapshot() == state and replayed.dead_letters == 26


async def test_restart_rebuilds_state_and_republishes_nothing(nc: Client) -> None:
    config = fresh_config("w")
    await ensure(nc, config)
    first = await publish(nc, config, lifecycle("b"))
    async with running(nc, config) as writer:
        await asyncio.wait_for(writer.wait_applied(first[-1]), 10)
    second = await publish(nc, config, lifecycle("c"))
    async with running(nc, config) as writer:
        await asyncio.wait_for(writer.wait_applied(second[-1]), 10)
        await writer.flush()
        restarted = writer.state.snapshot()
    deltas = await all_deltas(nc, config)
    assert [d.seq for d in deltas] == first + second  # each position published once
    reference = config.new_state()
    for event, delta in zip(lifecycle("b") + lifecycle("c"), deltas, strict=True):
        reference.apply(event, delta.at_ns)
    assert restarted == reference.snapshot()


async def test_an_idle_stream_gets_a_logged_tick(nc: Client) -> None:
    config = fresh_config("w", idle_tick_s=0.2)
    await ensure(nc, config)
    seqs = await publish(nc, config, [AddRequest(request_id="t", worker_id=3)])
    async with running(nc, config) as writer:
        await asyncio.wait_for(writer.wait_applied(seqs[-1] + 1), 10)  # the Tick after it
        js = nc.jetstream()
        tick = await js.get_msg(config.events_stream, seqs[-1] + 1)
        assert tick.subject == config.control_subject
        assert writer.stats.ticks_published >= 1
        assert tick.data == encode_event(Tick())


@pytest.mark.parametrize("count", [300])
async def test_many_events_fold_exactly_once(nc: Client, count: int) -> None:
    config = fresh_config("w")
    await ensure(nc, config)
    events: list[Event] = [
        AddRequest(request_id=f"m{i}", worker_id=i % 4, block_hashes=[i]) for i in range(count)
    ]
    seqs = await publish(nc, config, events)
    async with running(nc, config) as writer:
        await asyncio.wait_for(writer.wait_applied(seqs[-1]), 20)
        assert writer.stats.applied == count
        assert len(writer.state.requests) == count
