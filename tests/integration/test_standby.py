"""Two processes offer to run one namespace (as two serve-http replicas will): one runs its
writer and projector, the other stands by and takes over when the first stops or dies, and
the ledger stays equal to a replay of the log throughout."""

from __future__ import annotations

import asyncio
import contextlib

import nats
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.bucket.reader import RegistryView
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.ops.replay import verify
from projector.route.publisher import RouterPublisher
from projector.run.standby import StandbyPipeline
from projector.settings.config import Config
from seqstate import WorkerAdded

WAIT_S = 20.0


async def book(pub: RouterPublisher, prefix: str, n: int) -> int:
    last = 0
    for i in range(n):
        last = await pub.add(f"{prefix}{i}", 1, block_hashes=[i, 1000 + i], prefill_tokens=16)
    return last


async def applied(nc: Client, config: Config, seq: int) -> None:
    async with RegistryView(nc, config=config) as view:
        await view.wait_for(seq, timeout=WAIT_S)


async def test_a_standby_takes_over_a_stopped_and_then_a_dead_holder(
    nc: Client, nats_server: NatsServer
) -> None:
    config = fresh_config("sb", rules="slot-tracker")
    await ensure(nc, config)
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="sb", config=config)
    clients = [await nats.connect(nats_server.url) for _ in range(3)]
    first, second, third = (StandbyPipeline(c, config, lease_ttl_s=1.5) for c in clients)
    tasks = [asyncio.create_task(first.run())]
    try:
        await asyncio.wait_for(first.active.wait(), WAIT_S)
        tasks.append(asyncio.create_task(second.run()))  # once the first holds the lease
        await pub.publish(WorkerAdded(worker_id=1, block_size=16))
        await applied(nc, config, await book(pub, "a", 5))
        assert not second.active.is_set()  # it waits: one writer per namespace

        # A clean stop hands over at once (the lease is released).
        tasks[0].cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tasks[0]
        await asyncio.wait_for(second.active.wait(), WAIT_S)
        await applied(nc, config, await book(pub, "b", 5))

        # A holder that dies (its connection gone, no release) is taken over after the TTL.
        tasks.append(asyncio.create_task(third.run()))
        await asyncio.sleep(0)
        await clients[1].close()
        await asyncio.wait_for(third.active.wait(), WAIT_S)
        await applied(nc, config, await book(pub, "c", 5))
        assert (first.terms, second.terms, third.terms) == (1, 1, 1)
    finally:
        for task in tasks:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for client in clients:
            with contextlib.suppress(Exception):
                await client.close()
    assert await verify(nc, config) == []
