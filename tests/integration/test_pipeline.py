"""The whole pipeline on a real nats-server: RouterPublisher → writer → projector → RegistryView.

The reference is an in-process SequenceState fed the same events at the same log times; after
``wait_for`` the view's loads and potential loads must equal it exactly.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging

import pytest
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config, read_log

from projector.bucket.contents import read_bucket
from projector.bucket.projection import Projector
from projector.bucket.reader import RegistryView
from projector.nats.resources import dead_letter_stream, ensure
from projector.ops.replay import verify
from projector.route.publisher import RouterPublisher
from projector.run.assemble import build_projector, build_writer
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.headers import PREV_SOURCE_SEQ, REASON
from projector.wire.values import decode_request, load_key, position_key, slot_key
from seqstate import Delta, SequenceState, WorkerAdded, WorkerRemoved, decode_event, encode_deltas

NS_PER_MS = 1_000_000
PREFIX = [101, 102, 103, 104]


async def scripted_lifecycle(pub: RouterPublisher) -> int:
    """Topology, shared prefixes, prefill marks, frees, oddities; returns the last sequence."""
    await pub.publish(WorkerAdded(worker_id=1, dp_size=2))
    await pub.publish(WorkerAdded(worker_id=2))
    await pub.add(
        "r1", 1, 0, block_hashes=[*PREFIX, 1], prefill_tokens=500, expected_prefill_ms=40.0
    )
    await pub.add("r2", 1, 1, block_hashes=[*PREFIX, 2, 3], prefill_tokens=700)
    await pub.add("r3", 2, block_hashes=PREFIX[:2], prefill_tokens=300, expected_prefill_ms=5000.0)
    await pub.add("r4", 7, block_hashes=[900, 901], prefill_tokens=64)  # a lazy worker
    await pub.mark_prefill_completed("r1", 1, 0)
    await pub.add("r1", 1, 0, block_hashes=[5])  # duplicate add: changes nothing
    await pub.free("ghost", 2)  # unknown: a tombstone
    await pub.add("ghost", 2, block_hashes=[77], prefill_tokens=9)  # superseded by it
    await pub.add(
        "r5", 2, block_hashes=[*PREFIX, 8], prefill_tokens=1000, expected_prefill_ms=2000.0
    )
    await pub.free("r2", 1, 1)
    await pub.publish(WorkerRemoved(worker_id=7))
    return await pub.add("r6", 1, 1, block_hashes=[*PREFIX, 2], prefill_tokens=123)


async def reference_state(nc: Client, config: Config) -> tuple[SequenceState, int]:
    state = config.new_state()
    last_ns = 0
    for _, at_ns, data in await read_log(nc, config):
        state.apply(decode_event(data), at_ns)
        last_ns = at_ns
    return state, last_ns


QUERIES = [[*PREFIX, 1], [*PREFIX, 2, 3, 4], PREFIX[:1], [900, 901], [], [42, 43]]


async def test_view_equals_an_in_process_state_fed_the_same_log(nc: Client) -> None:
    config = fresh_config("p")
    async with Pipeline(nc, config):
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-a", config=config)
        last = await scripted_lifecycle(pub)
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(last, timeout=10)
            state, last_ns = await reference_state(nc, config)
            assert view.applied_seq >= last
            for offset_ms in (0, 1, 7, 39, 40, 1999, 2500, 6000):
                now = last_ns + offset_ms * NS_PER_MS
                assert view.loads(now) == state.registry.loads(now)
                for query in QUERIES:
                    assert view.potential_loads(query, 256, now) == state.registry.potential_loads(
                        query, 256, now
                    )
            ranks = [(row.worker_id, row.dp_rank) for row in view.loads(last_ns)]
            assert ranks == [(1, 0), (1, 1), (2, 0)]  # worker 7 was removed
            assert state.counters["duplicate"] == 1 and state.counters["superseded"] == 1


async def test_bucket_values_are_readable_and_removed_ranks_are_deleted(nc: Client) -> None:
    config = fresh_config("p")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-b", config=config)
        last = await scripted_lifecycle(pub)
        await pipeline.wait_applied(last)
    kv = await nc.jetstream().key_value(config.registry_bucket)
    bucket = await read_bucket(nc, config)  # kv.keys() can lose a race with its own marker
    ns = config.namespace
    slots = [slot_key(ns, r, s) for r, held in bucket.slots.items() for s in held]
    keys = sorted(
        [position_key(ns)] * (bucket.position is not None)
        + [load_key(ns, r) for r in bucket.loads]
        + slots
    )
    # One key per slot: r1 on (1, 0); r6 reuses the slot r2 freed on (1, 1); r3 and r5 on
    # (2, 0). The removed lazy worker 7 left none.
    assert keys == sorted(
        [position_key(ns)]
        + [load_key(ns, r) for r in [(1, 0), (1, 1), (2, 0)]]
        + [slot_key(ns, r, s) for r, s in [((1, 0), 0), ((1, 1), 0), ((2, 0), 0), ((2, 0), 1)]]
    )
    value = json.loads((await kv.get(load_key(ns, (2, 0)))).value or b"")
    assert value["worker_id"] == 2 and value["dp_rank"] == 0
    assert value["active_requests"] == 2  # r3 and r5; the ghost was superseded
    assert value["active_blocks"] == 5  # PREFIX[:2] ∪ PREFIX + [8]
    assert value["prefill"]["full_tokens"] == 1300
    assert value["applied_seq"] == last - 3  # the event that last changed it: r5's add
    r6 = decode_request((await kv.get(slot_key(ns, (1, 1), 0))).value or b"")
    assert (r6.request_id, r6.hash_list()) == ("r6", [*PREFIX, 2])  # in prompt order
    assert r6.applied_seq == last
    position = json.loads((await kv.get(position_key(ns))).value or b"")
    assert position["applied_seq"] == last


async def test_restart_resumes_from_the_bucket_and_ends_identical(nc: Client) -> None:
    config = fresh_config("p")
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-c", config=config)
    async with Pipeline(nc, config) as pipeline:
        first = await scripted_lifecycle(pub)
        await pipeline.wait_applied(first)
    await ensure(nc, config)
    more = [await pub.free("r5", 2), await pub.add("r7", 2, block_hashes=[*PREFIX, 9])]
    async with Pipeline(nc, config) as pipeline:
        await pipeline.wait_applied(more[-1])
        assert pipeline.projector.stats.deltas == 2  # resumed after the recorded position
        assert pipeline.writer.stats.deltas_published == 2
    state, last_ns = await reference_state(nc, config)
    async with RegistryView(nc, config=config) as view:
        assert view.applied_seq == more[-1]
        assert view.loads(last_ns) == state.registry.loads(last_ns)
        for query in [*QUERIES, [*PREFIX, 9]]:
            assert view.potential_loads(query, 1, last_ns) == state.registry.potential_loads(
                query, 1, last_ns
            )


async def test_one_msg_id_twice_is_applied_once(nc: Client) -> None:
    config = fresh_config("p")
    async with Pipeline(nc, config):
        js = nc.jetstream()
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-d", config=config)
        seq = await pub.add("once", 3, block_hashes=[1, 2], prefill_tokens=10)
        stored = await js.get_msg(config.events_stream, seq)
        msg_id = (stored.headers or {})["Nats-Msg-Id"]  # r-d:1:<the publisher's tag>
        assert msg_id.startswith("r-d:1:"), msg_id
        again = await js.publish(
            stored.subject or "", stored.data or b"", headers={"Nats-Msg-Id": msg_id}
        )
        assert again.duplicate and again.seq == seq
        last = await pub.add("next", 3, block_hashes=[1, 2, 3])
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(last, timeout=10)
            (row,) = view.loads()
            assert row.active_requests == 2 and row.active_blocks == 3


async def test_a_malformed_message_is_dead_lettered_and_the_next_event_applied(
    nc: Client,
) -> None:
    config = fresh_config("p")
    async with Pipeline(nc, config) as pipeline:
        js = nc.jetstream()
        bad = await js.publish(config.event_subject(4), b"\xc1 definitely not msgpack")
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-e", config=config)
        good = await pub.add("after-bad", 4, block_hashes=[5], prefill_tokens=1)
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(good, timeout=10)
            assert [(r.worker_id, r.active_requests) for r in view.loads()] == [(4, 1)]
        assert pipeline.writer.stats.dead_letters == 1
        dead = await js.get_msg(dead_letter_stream(config), subject=config.dead_letter_subject)
        assert dead.headers is not None and dead.headers["Seqstate-Source-Seq"] == str(bad.seq)
        assert dead.headers[REASON]


async def test_the_view_follows_live_changes_and_reports_staleness(nc: Client) -> None:
    config = fresh_config("p")
    async with Pipeline(nc, config):
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-f", config=config)
        async with RegistryView(nc, config=config) as view:
            assert view.loads() == [] and view.staleness().applied_seq == 0
            seq = await pub.add(
                "live", 9, 2, block_hashes=[1], prefill_tokens=50, expected_prefill_ms=60_000.0
            )
            await view.wait_for(seq, timeout=10)
            (row,) = view.loads()
            assert (row.worker_id, row.dp_rank, row.active_requests) == (9, 2, 1)
            assert 0 < row.active_prefill_tokens <= 50
            staleness = view.staleness()
            assert staleness.applied_seq == seq and staleness.age_s < 10
            seq = await pub.free("live", 9, 2)
            await view.wait_for(seq, timeout=10)
            (row,) = view.loads()
            assert (row.active_requests, row.active_blocks, row.active_prefill_tokens) == (0, 0, 0)
            try:
                await view.wait_for(seq + 1000, timeout=0.2)
            except TimeoutError:
                pass
            else:
                raise AssertionError("wait_for returned for a sequence that was never applied")


async def test_a_rank_whose_load_value_does_not_decode_is_not_served_as_idle(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """A view that started on a bucket where a busy rank's load value does not
    decode showed that rank idle (its slot keys made it, the load was skipped), so a scheduler
    would have sent it traffic. Now such a rank is not served (no row in loads or potential
    loads, no overlap), the view names it in ``unreadable`` and counts and logs the value; a
    readable value brings it back, and a warm view that receives a damaged one hides it too."""
    config = fresh_config("p")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-u", config=config)
        await pub.add("a", 4, 0, block_hashes=[1, 2, 3], prefill_tokens=100)
        last = await pub.add("b", 5, 0, block_hashes=[9], prefill_tokens=10)
        await pipeline.wait_applied(last)
    kv = await nc.jetstream().key_value(config.registry_bucket)
    key = load_key(config.namespace, (4, 0))
    good = (await kv.get(key)).value or b""
    await kv.put(key, b'{"active_blocks": "many"}')
    caplog.set_level(logging.WARNING, logger="seqstate.reader")
    async with RegistryView(nc, config=config) as view:
        assert [(r.worker_id, r.dp_rank, r.active_blocks) for r in view.loads()] == [(5, 0, 1)]
        assert [(r.worker_id, r.dp_rank) for r in view.potential_loads([1, 2, 3], 0)] == [(5, 0)]
        assert view.overlap_depths([1, 2, 3]) == {}
        assert list(view.unreadable) == [(4, 0)] and view.bad_values == 1
        assert f"rank (4, 0) of namespace {config.namespace} not served" in caplog.text
        assert (view.rank_of("a"), view.rank_of("b"), view.rank_of("c")) == ((4, 0), (5, 0), None)
        await kv.put(key, good)
        await eventually(
            lambda: [(r.worker_id, r.active_blocks) for r in view.loads()],
            lambda rows: rows == [(4, 3), (5, 1)],
            what="the rank back with a readable value",
        )
        assert view.unreadable == {} and view.overlap_depths([1, 2, 3]) == {(4, 0): 3}
        await kv.put(key, b"\xc1")
        await eventually(
            lambda: [r.worker_id for r in view.loads()],
            lambda workers: workers == [5],
            what="a warm view hiding the rank again",
        )
        assert view.bad_values == 2


def recording(projector: Projector) -> list[tuple[float, list[str]]]:
    """When each flush of ``projector`` started writing and which keys it wrote."""
    writes: list[tuple[float, list[str]]] = []
    write = projector._write

    async def recorded(keys, position):  # type: ignore[no-untyped-def]
        writes.append((asyncio.get_running_loop().time(), [key for key, _ in keys]))
        await write(keys, position)

    projector._write = recorded  # type: ignore[method-assign]
    return writes


async def test_the_projector_writes_each_key_at_most_once_per_flush_interval(nc: Client) -> None:
    config = fresh_config("p", flush_interval_s=0.05)
    writer, projector = build_writer(nc, config), build_projector(nc, config)
    writes = recording(projector)
    tasks = [asyncio.create_task(writer.run()), asyncio.create_task(projector.run())]
    try:
        await asyncio.wait_for(projector.caught_up.wait(), 10)
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-g", config=config)
        seqs: list[int] = []
        for wave in range(12):  # each wave flushed before the next: 12 flushes at any speed
            seqs += await asyncio.gather(
                *(pub.add(f"q{wave}-{i}", i % 2, block_hashes=[i, i + 1]) for i in range(50))
            )
            await writer.wait_applied(max(seqs))
            await writer.flush()
            await projector.wait_flushed(max(seqs))
        looped = len(writes)  # the flush loop's; stopping adds a final, direct one
    finally:
        writer.stop()
        projector.stop()
        await asyncio.gather(*tasks)
    starts = [t for t, _ in writes[:looped]]
    assert looped >= 12
    assert min(b - a for a, b in itertools.pairwise(starts)) >= 0.05 * 0.99
    assert all(len(keys) == len(set(keys)) for _, keys in writes)  # once per flush
    # 600 deltas each touched one of 2 ranks: their loads coalesced into far fewer writes;
    # each request's slot key was written once.
    assert projector.stats.deltas == 600
    loads = [key for _, keys in writes for key in keys if ".load." in key]
    assert len(loads) <= 2 * len(writes) < 600
    slots = [key for _, keys in writes for key in keys if ".req." in key]
    assert len(slots) == len(set(slots)) == 600


async def test_a_malformed_delta_is_dead_lettered_and_the_projector_goes_on(nc: Client) -> None:
    config = fresh_config("p")
    await ensure(nc, config)
    js = nc.jetstream()
    await js.publish(config.deltas_subject, b"\x01 not a delta")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-h", config=config)
        seq = await pub.add("fine", 1, block_hashes=[1])
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(seq, timeout=10)
            assert [(r.worker_id, r.active_requests) for r in view.loads()] == [(1, 1)]
        assert pipeline.projector.stats.dead_letters == 1
    dead = await js.get_msg(dead_letter_stream(config), subject=config.dead_letter_subject)
    assert dead.data == b"\x01 not a delta"
    assert dead.headers is not None and "delta does not decode" in dead.headers[REASON]


async def test_forged_deltas_are_dead_lettered_and_never_freeze_the_read_model(
    nc: Client,
) -> None:
    config = fresh_config("p")
    js = nc.jetstream()
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-f", config=config)
        first = await pub.add("a", 1, block_hashes=[1])
        await pipeline.wait_applied(first)
        far = encode_deltas([Delta("applied", 0, seq=10**12)])
        backwards = encode_deltas(
            [Delta("applied", 0, seq=first + 9), Delta("applied", 0, seq=first + 8)]
        )
        forged = [  # what no writer of this namespace would store, with why it cannot be true
            (far, {PREV_SOURCE_SEQ: str(first)}, "beyond the events stream"),
            (far, {}, "no valid Seqstate-Prev-Source-Seq header"),
            (
                encode_deltas([Delta("applied", 0, seq=first)]),
                {PREV_SOURCE_SEQ: str(first)},
                f"it starts at event {first}, not after {first}",
            ),
            (backwards, {PREV_SOURCE_SEQ: str(first)}, "out of order"),
        ]
        for data, headers, _ in forged:
            await js.publish(config.deltas_subject, data, headers=headers)
        second = await pub.add("b", 2, block_hashes=[2])  # the writer steps over them
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(second, timeout=10)
            assert [(r.worker_id, r.active_requests) for r in view.loads()] == [(1, 1), (2, 1)]
            assert view.staleness().applied_seq == second  # not 10**12: nothing froze
        assert pipeline.projector.stats.dead_letters == len(forged)
    dead = await js.stream_info(dead_letter_stream(config))
    assert dead.state.messages == len(forged)
    for n, (_, _, why) in enumerate(forged):
        msg = await js.get_msg(dead_letter_stream(config), dead.state.first_seq + n)
        assert msg.headers is not None and why in msg.headers[REASON], msg.headers


async def test_an_idle_lazy_rank_is_forgotten_and_its_keys_deleted(nc: Client) -> None:
    config = fresh_config("p", forget_lazy_ranks_s=0.5, idle_tick_s=0.1)
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-idle", config=config)
        await pub.publish(WorkerAdded(worker_id=1))
        await pub.add("stray", 9, block_hashes=[5, 6])  # a rank no WorkerAdded registered
        last = await pub.free("stray", 9)
        await pipeline.wait_applied(last)
        assert (9, 0) in (await read_bucket(nc, config)).loads
        # Ticks (every 0.1 s of silence) find it empty, then drop it.
        await eventually(
            lambda: sorted(pipeline.writer.state.workers.slots),
            lambda slots: (9, 0) not in slots,
            what="the idle lazy rank (9, 0) forgotten",
        )
        await pipeline.wait_applied(pipeline.writer.stats.last_seq)
    bucket = await read_bucket(nc, config)
    assert set(bucket.loads) == {(1, 0)} and set(bucket.slots) <= {(1, 0)}
    assert await verify(nc, config) == []


async def test_two_namespaces_share_streams_and_bucket_and_stay_apart(nc: Client) -> None:
    base = fresh_config("p")
    a = Config(**{**base.__dict__, "namespace": base.namespace + "a"})
    b = Config(**{**base.__dict__, "namespace": base.namespace + "b"})
    pub_a = RouterPublisher(nc, namespace=a.namespace, router_id="r-na", config=a)
    pub_b = RouterPublisher(nc, namespace=b.namespace, router_id="r-nb", config=b)
    async with Pipeline(nc, a) as pipeline_a:
        await pub_a.add("x", 1, block_hashes=[1, 2])
        last_a = await pub_a.add("y", 1, block_hashes=[1])
        await pipeline_a.wait_applied(last_a)
    await ensure(nc, b)
    last_b = await pub_b.add("z", 2, block_hashes=[5])
    # The shared stream's last message belongs to b: a's pipeline must still see itself caught
    # up, and b's must not stop at a's events.
    async with Pipeline(nc, a, start_timeout=10), Pipeline(nc, b, start_timeout=10) as p_b:
        await p_b.wait_applied(last_b)
        async with RegistryView(nc, config=a) as view_a, RegistryView(nc, config=b) as view_b:
            assert [(r.worker_id, r.active_requests) for r in view_a.loads()] == [(1, 2)]
            assert [(r.worker_id, r.active_requests) for r in view_b.loads()] == [(2, 1)]


async def test_a_damaged_bucket_value_makes_the_projector_replay_every_delta(nc: Client) -> None:

    config = fresh_config("p")
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-i", config=config)
    async with Pipeline(nc, config) as pipeline:
        first = await scripted_lifecycle(pub)
        await pipeline.wait_applied(first)
    kv = await nc.jetstream().key_value(config.registry_bucket)
    await kv.put(load_key(config.namespace, (1, 0)), b"not json")
    await kv.put(load_key(config.namespace, (6, 0)), b"{}")  # a rank no delta ever made
    async with Pipeline(nc, config) as pipeline:
        last = await pub.add("after", 2, block_hashes=[*PREFIX, 3])
        await pipeline.wait_applied(last)
        assert pipeline.projector.stats.deltas == last  # resumed from nothing: every delta
    assert await verify(nc, config) == []
