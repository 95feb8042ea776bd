"""A router's lifecycle through the pipeline: goodbye frees at once, silence orphans on log
time, and a replay makes the same decisions."""

from __future__ import annotations

from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config, read_log

from projector.bucket.reader import RegistryView
from projector.ops.replay import verify
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.write.log_fold import replay
from seqstate import decode_event


async def test_a_router_that_says_goodbye_has_its_requests_freed_at_once(nc: Client) -> None:
    config = fresh_config("bye")
    async with Pipeline(nc, config) as pipeline:
        other = RouterPublisher(nc, namespace=config.namespace, router_id="stays", config=config)
        await other.add("kept", 2, block_hashes=[9])
        async with RouterPublisher(
            nc, namespace=config.namespace, router_id="leaves", config=config
        ) as pub:
            for i in range(3):
                await pub.add(f"q{i}", 1, block_hashes=[i, 100 + i])
        last = pipeline.writer.stats.last_seq
        await pipeline.wait_applied(await other.mark_prefill_completed("kept", 2))
        assert pipeline.writer.state.counters["orphaned"] == 3
        assert sorted(pipeline.writer.state.requests.owner) == ["kept"]
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(last)
            assert [(r.worker_id, r.active_requests) for r in view.loads()] == [(1, 0), (2, 1)]
    kinds = [type(decode_event(data)).__name__ for _, _, data in await read_log(nc, config)]
    assert kinds[:2] == ["AddRequest", "RouterHeartbeat"] and "RouterGoodbye" in kinds
    assert await verify(nc, config) == []


async def test_a_silent_router_is_orphaned_and_a_replay_decides_the_same(nc: Client) -> None:
    config = fresh_config("orph", orphan_after_s=1.0, idle_tick_s=0.2)
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(
            nc,
            namespace=config.namespace,
            router_id="crashes",
            config=config,
            heartbeat_every_s=0.2,
        )
        await pub.start()
        for i in range(4):
            await pub.add(f"o{i}", i % 2, block_hashes=[i])
        await pub.close(goodbye=False)  # as a crash: it just goes silent
        state = pipeline.writer.state
        await eventually(
            lambda: state.counters["orphaned"],
            lambda orphaned: orphaned == 4,
            what="the router's requests orphaned",
            timeout=20,
            interval=0.02,
        )
        assert state.requests.owner == {} and state.routers == {}
        await pipeline.wait_applied(pipeline.writer.stats.last_seq)
    replayed = await replay(nc, config)
    assert replayed.state.counters["orphaned"] == 4
    assert replayed.state.snapshot() == state.snapshot()
    assert await verify(nc, config) == []
