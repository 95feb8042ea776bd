"""Under the slot-tracker rules the read model holds the tracker's block size (``<ns>.tracker``),
so a reader can list workers as Dynamo's ``GET /workers`` does: written when the first
registration fixes it, deleted when the last worker goes, checked by verify, and rewritten by
rebuild."""

from __future__ import annotations

import dataclasses
import json

from nats.aio.client import Client
from pipeline_kit import bucket_values, fresh_config

from projector.bucket.contents import read_trackers
from projector.bucket.reader import RegistryView
from projector.ops.replay import rebuild, verify
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.wire.values import tracker_key
from seqstate import WorkerAdded, WorkerRemoved


async def test_the_block_size_follows_the_tracker_through_the_bucket(nc: Client) -> None:
    config = fresh_config("tk", rules="slot-tracker")
    key = tracker_key(config.namespace)
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="tk", config=config)
        async with RegistryView(nc, config=config) as view:
            await pipeline.wait_applied(await pub.publish(WorkerAdded(worker_id=1, block_size=16)))
            await view.wait_for(pipeline.writer.stats.last_seq, timeout=20)
            assert view.block_size == 16
            assert json.loads((await bucket_values(nc, config))[key]) == {"block_size": 16}
            await pub.publish(WorkerAdded(worker_id=2, block_size=32))  # refused: no change
            last = await pub.publish(WorkerAdded(worker_id=2, block_size=16))
            await pipeline.wait_applied(last)
            assert await verify(nc, config) == []
            await pub.publish(WorkerRemoved(worker_id=1))
            last = await pub.publish(WorkerRemoved(worker_id=2))  # the last one: tracker ends
            await pipeline.wait_applied(last)
            await view.wait_for(last, timeout=20)
            assert view.block_size is None and view.loads() == []
            assert key not in await bucket_values(nc, config)
            assert await verify(nc, config) == []
            last = await pub.publish(WorkerAdded(worker_id=3, block_size=64))  # a new tracker
            await pipeline.wait_applied(last)
            await view.wait_for(last, timeout=20)
            assert view.block_size == 64
    # Tampered: verify names the key; rebuild rewrites it from the write model.
    kv = await nc.jetstream().key_value(config.registry_bucket)
    await kv.put(key, b'{"block_size": 8}')
    assert await verify(nc, config) == [f"{key}: bucket block size 8, replay 64"]
    await rebuild(nc, config)
    assert await verify(nc, config) == []
    assert json.loads((await bucket_values(nc, config))[key]) == {"block_size": 64}


async def test_a_starting_server_finds_every_live_tracker(nc: Client) -> None:
    """Broke: nothing. Expected: read_trackers lists each slot-tracker namespace with a worker
    now, with its block size; one whose last worker left, and a router namespace, are not."""
    shared = fresh_config("tf").registry_bucket  # one bucket, as a deployment has
    configs = [
        dataclasses.replace(fresh_config("tf", rules="slot-tracker"), registry_bucket=shared)
        for _ in range(3)
    ]
    for i, config in enumerate(configs):
        async with Pipeline(nc, config) as pipeline:
            pub = RouterPublisher(nc, namespace=config.namespace, router_id="tf", config=config)
            last = await pub.publish(WorkerAdded(worker_id=1, block_size=16 * (i + 1)))
            if i == 2:
                last = await pub.publish(WorkerRemoved(worker_id=1))
            await pipeline.wait_applied(last)
    found = await read_trackers(nc, configs[0])
    assert {ns: found[ns] for ns in found if ns.startswith("tf")} == {
        configs[0].namespace: 16,
        configs[1].namespace: 32,
    }
