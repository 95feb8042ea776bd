"""Real sizes through the real pipeline: a rank past a million active hashes, a backlog of
large frees, and a server whose payload limit is small enough that deltas must be cut.

Each test asserts exact state (a new RegistryView against a fold of the log, ``verify``) and
that no stored message exceeds the server's ``max_payload``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import bucket_values, fresh_config, read_log, read_stream

from projector.bucket.image import BucketImage
from projector.bucket.reader import RegistryView
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.ops.replay import verify
from projector.route.publisher import EventTooLarge, RouterPublisher
from projector.run.assemble import build_delta_log, build_projector
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.write.writer import EventLimitUnfit
from seqstate import AddRequest, Free, SequenceState, decode_deltas, decode_event, encode_event
from seqstate.deltas import split_delta

BLOCKS = 1024  # a 16k-token prompt of 16-token blocks


def prompt(rng: random.Random, n: int = BLOCKS) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


async def fold(nc: Client, config: Config) -> SequenceState:
    state = config.new_state()
    for _, at_ns, data in await read_log(nc, config):
        state.apply(decode_event(data), at_ns)
    return state


async def largest_message(nc: Client, config: Config, stream: str) -> int:
    """The largest payload stored in the deltas stream or the bucket's (``stream``: "deltas"
    or "bucket"), headers included, as the server counts."""
    if stream == "deltas":
        name, subject = config.deltas_stream, config.deltas_subject
    else:
        name, subject = f"KV_{config.registry_bucket}", f"$KV.{config.registry_bucket}.>"
    biggest = 0
    for _, headers, data in await read_stream(nc, name, subject):
        size = sum(len(k) + len(v) + 4 for k, v in headers.items() if k != "subject")
        biggest = max(biggest, len(data or b"") + size)
    return biggest


async def assert_view_exact(nc: Client, config: Config, queries: list[list[int]]) -> None:
    state = await fold(nc, config)
    async with RegistryView(nc, config=config) as view:
        await view.wait_for(max(seq for seq, _, _ in await read_log(nc, config)))
        now = state.now_ns
        assert view.loads(now) == state.registry.loads(now)
        for query in queries:
            assert view.potential_loads(query, 1000, now) == state.registry.potential_loads(
                query, 1000, now
            )
        for rank in state.registry.ranks():
            assert view.registry.hashes_of(rank) == state.registry.hashes_of(rank)
    assert await verify(nc, config) == []


async def test_a_rank_past_a_million_active_hashes_round_trips_exactly(nc: Client) -> None:
    config = fresh_config("big")
    rng = random.Random(10)
    prompts = [prompt(rng) for _ in range(980)]  # 1,003,520 hashes on rank (0, 0)
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="big", config=config)
        events = [AddRequest(f"big-{i}", 0, block_hashes=p) for i, p in enumerate(prompts)]
        events += [AddRequest(f"small-{i}", 1, block_hashes=prompts[i][:100]) for i in range(20)]
        seqs = await pub.publish_many(events)
        await pipeline.wait_applied(seqs[-1])
    state = await fold(nc, config)
    assert len(state.registry.hashes_of((0, 0))) == 980 * BLOCKS > 1_000_000
    await assert_view_exact(nc, config, [prompts[0], prompts[7][:500], [*prompts[3][:10], 1]])
    # Free half of them: each Free costs a slot, not the rank's million hashes.
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="big2", config=config)
        seqs = await pub.publish_many([Free(f"big-{i}", 0) for i in range(0, 980, 2)])
        await pipeline.wait_applied(seqs[-1])
        assert pipeline.projector.stats.keys_written < 3 * 490  # a slot and a load per Free
    await assert_view_exact(nc, config, [prompts[0], prompts[1]])
    limit = nc.max_payload
    for stream in ("deltas", "bucket"):
        assert await largest_message(nc, config, stream) <= limit


async def test_a_backlog_of_adds_and_frees_is_caught_up_without_stalling(nc: Client) -> None:
    """A backlog that once crash-looped the writer: with it stopped, 2,000 AddRequests of 500
    unique hashes and then their 2,000 Frees; the writer used to fail on every restart with a
    batch of Free deltas over the payload limit."""
    config = fresh_config("backlog")
    await ensure(nc, config)
    rng = random.Random(11)
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="bl", config=config)
    await pub.publish_many(
        [AddRequest(f"b{i}", i % 4, block_hashes=prompt(rng, 500)) for i in range(2000)]
    )
    seqs = await pub.publish_many([Free(f"b{i}", i % 4) for i in range(2000)])
    async with Pipeline(nc, config) as pipeline:
        await asyncio.wait_for(pipeline.wait_applied(seqs[-1]), 120)
        assert pipeline.writer.stats.dead_letters == 0
    await assert_view_exact(nc, config, [])
    assert await largest_message(nc, config, "deltas") <= nc.max_payload


# ---- a server with a small payload limit -----------------------------------------------------

SMALL = 64 * 1024


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    tmp = tmp_path_factory.mktemp("small-payload")
    conf = tmp / "server.conf"
    conf.write_text(f"max_payload: {SMALL}\n")
    with NatsServer(tmp / "jetstream", extra_args=("-c", str(conf))) as server:
        yield server


@pytest.fixture
async def small(small_server: NatsServer) -> AsyncIterator[Client]:
    client = await nats.connect(small_server.url, max_reconnect_attempts=0)
    try:
        yield client
    finally:
        await client.drain()


async def test_a_delta_too_large_for_one_message_is_cut_into_parts_and_applied_exactly(
    small: Client, tmp_path: Path
) -> None:
    """An expiry that releases 3,000 requests of long ids on one rank: its delta takes several
    messages. Stored part by part (a writer restarted in the middle stores only the rest),
    applied by a projector, it leaves the bucket of the whole delta."""
    assert small.max_payload == SMALL
    config = fresh_config("parts", expiry_s=60.0)
    await ensure(small, config)
    pub = RouterPublisher(small, namespace=config.namespace, router_id="pt", config=config)
    ids = [f"request-with-a-long-id-{i:06d}-" + "x" * 40 for i in range(3000)]
    seqs = await pub.publish_many(
        [AddRequest(rid, 3, block_hashes=[i, i + 10**6]) for i, rid in enumerate(ids)]
    )
    tick_seq = seqs[-1]  # the expiry is folded as if at this event, 100 s later
    state = config.new_state()
    state.defer_registry()
    deltas = []
    for seq, at_ns, data in await read_log(small, config):
        event = decode_event(data)
        later = seq == tick_seq
        if later:  # the last add, 100 s after the others: it expires them all first
            event = AddRequest("late", 3, block_hashes=[7])
        delta = state.apply(event, at_ns + (100 * 10**9 if later else 0))
        delta.seq = seq
        deltas.append(delta)
    assert len(deltas[-1].expired) == 2999
    log = build_delta_log(small, config)
    parts = split_delta(deltas[-1], SMALL - 4096)
    assert len(parts) >= 3
    # A first writer stores everything up to the second part of the last event, then dies.
    await log.open()
    failures: list[BaseException] = []
    log.start(failures.append)
    for delta in deltas[:-1]:
        log.append(delta)
    await log.flush()
    for part in parts[:2]:  # what was in flight when it died
        log.append(part)
    await eventually(
        lambda: (log.messages, len(log._pending)),
        lambda stored_pending: stored_pending[0] >= 1 and not stored_pending[1],
        what="the parts in flight stored",
        watch=lambda: f"failures: {failures}",
    )
    await log.close()
    # Its successor finds the chain ending inside the event and stores only the rest.
    successor = build_delta_log(small, config)
    assert await successor.open() == tick_seq - 1
    assert successor.stored_part == (tick_seq, 1)
    successor.start(failures.append)
    successor.append(deltas[-1])
    await successor.flush()
    await successor.close()
    assert not failures
    messages = await read_stream(small, config.deltas_stream, config.deltas_subject)
    stored = [d for _, _, data in messages for d in decode_deltas(data)]
    assert [(d.seq, d.part) for d in stored if d.seq == tick_seq] == [
        (tick_seq, p.part) for p in parts
    ]
    assert await largest_message(small, config, "deltas") <= SMALL
    # A projector applies the parts: the bucket is the image of the whole delta.
    projector = build_projector(small, config)
    task = asyncio.create_task(projector.run())
    await asyncio.wait_for(projector.wait_flushed(tick_seq), 30)
    projector.stop()
    await task
    image = BucketImage(config.namespace)
    for delta in deltas:
        image.apply(delta)
    want = image.everything()
    got = {key: value for key, value in (await bucket_values(small, config)).items() if key in want}
    assert got == want
    assert await largest_message(small, config, "bucket") <= SMALL


async def test_an_event_that_cannot_fit_is_refused_at_publish_and_dead_lettered_by_the_writer(
    small: Client,
) -> None:
    # The fold's size rule is a setting: on a server with a smaller payload limit, it is set
    # to what the server can store the delta of (the writer refuses to start above it).
    config = fresh_config("huge", max_event_bytes=SMALL - 5 * 1024)
    async with Pipeline(small, config) as pipeline:
        pub = RouterPublisher(small, namespace=config.namespace, router_id="h", config=config)
        too_big = AddRequest("huge", 1, block_hashes=list(range(2**40, 2**40 + 7000)))
        with pytest.raises(EventTooLarge):
            await pub.publish(too_big)
        # Published around the publisher, it is dead-lettered once, never retried forever.
        raw = encode_event(too_big)
        assert SMALL - 5 * 1024 < len(raw) <= SMALL
        seq = (await small.jetstream().publish(config.event_subject(1, 0), raw)).seq
        after = await pub.add("after", 1, block_hashes=[1, 2])
        await pipeline.wait_applied(after)
        assert pipeline.writer.stats.dead_letters == 1
        assert after == seq + 1
    async with RegistryView(small, config=config) as view:
        await view.wait_for(after)
        assert [(r.worker_id, r.active_requests, r.active_blocks) for r in view.loads()] == [
            (1, 1, 2)
        ]


async def test_a_writer_whose_event_limit_this_server_cannot_store_refuses_to_start(
    small: Client,
) -> None:
    """The fold's size rule is a setting, the same for the writer and every replay:
    never read from the connection. On a server whose max_payload could not store the delta
    of an event that large, the writer stops at once with one line naming the setting, rather
    than fold by a rule a replay would not know."""
    with pytest.raises(EventLimitUnfit) as refused:
        async with Pipeline(small, fresh_config("unfit")):
            pass
    assert str(refused.value) == (
        f"max_event_bytes=1043456: over the {SMALL - 5 * 1024:,} bytes of event whose delta "
        f"this server can store (its max_payload of {SMALL:,} less 5,120); set "
        f"--max-event-bytes (SEQSTATE_MAX_EVENT_BYTES) to at most {SMALL - 5 * 1024}, the "
        "same for every fold of the log"
    )
