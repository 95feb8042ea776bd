"""The registry bucket deleted under a running pipeline (an operator's mistake). The
projector used to retry its writes to the missing stream forever; now it stops at once, the
pipeline restarts in process, and the new projector recreates the bucket from the deltas:
every value ends byte for byte as one uninterrupted fold of the log gives it.
"""

from __future__ import annotations

import asyncio

from eventually import eventually
from fault_kit import BUSY, WAIT_S, bucket_position, bucket_values, fault_config, uninterrupted_fold
from nats.aio.client import Client
from nats.js.errors import BucketNotFoundError

from projector.route.publisher import RouterPublisher
from projector.run.pipeline import supervise
from projector.wire.values import position_key


async def test_a_bucket_deleted_under_a_running_pipeline_is_recreated_exact(nc: Client) -> None:
    config = fault_config("b", snapshot_every_events=0, snapshot_every_s=0)
    js = nc.jetstream()
    started = asyncio.Event()
    supervisor = asyncio.create_task(supervise(nc, config, started=started, backoff_s=0.05))
    try:
        await asyncio.wait_for(started.wait(), WAIT_S)
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="b-del", config=config)
        for i in range(20):
            await pub.add(f"d{i}", i % 3, block_hashes=[i, i + 1], prefill_tokens=10 + i)
        await js.delete_key_value(config.registry_bucket)
        last = 0
        for i in range(20, 40):
            last = await pub.add(f"d{i}", i % 3, block_hashes=[i, i + 1], prefill_tokens=10 + i)

        def restarting() -> None:
            assert not supervisor.done(), "the pipeline gave up instead of restarting"

        await eventually(
            lambda: bucket_position(js, config),
            lambda position: position.applied_seq >= last,
            what="the recreated bucket's position at the last event",
            retry_on=(BucketNotFoundError, *BUSY),
            check=restarting,
        )
        restarting()
    finally:
        supervisor.cancel()
        await asyncio.wait([supervisor])
    _, values, logged = await uninterrupted_fold(nc, config)
    assert logged == last
    got = await bucket_values(nc, config)
    assert got.pop(position_key(config.namespace))
    assert got == values
