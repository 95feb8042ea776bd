"""The writer's and the projector's lag as a library user reads it: ``writer.lag`` (the last
measurement) and ``await writer.measure_lag()`` (one now); the projector's alike."""

from __future__ import annotations

from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline


async def test_the_lag_of_each_consumer_is_measured_and_readable(nc: Client) -> None:
    """Broke: published 10 events to a running pipeline, stopped it, published 5 more.
    Expected: while it ran, both consumers measured their lag every lag_check_s and found
    nothing waiting; after the stop, the writer's measure names the 5 unfolded events and the
    log time of the oldest, the projector's nothing (no delta was stored for them)."""
    config = fresh_config("lag", lag_check_s=0.05, idle_tick_s=3600.0)
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="lag", config=config)
    async with Pipeline(nc, config) as pipeline:
        seqs = [await pub.add(f"r{i}", i % 2, block_hashes=[i]) for i in range(10)]
        last = seqs[-1]
        await pipeline.wait_applied(last)
        writer, projector = pipeline.writer, pipeline.projector

        await eventually(  # the next checks see the events folded, in the bucket
            lambda: (writer.lag.position, projector.lag.position),
            lambda positions: min(positions) >= last,
            what="both consumers measured their lag at the last event",
            timeout=10,
        )
        assert (writer.lag.events, writer.lag.oldest_ns, writer.lag.newest) == (0, None, last)
        assert (projector.lag.events, projector.lag.messages) == (0, 0)
        assert writer.lag_watch.warnings == projector.lag_watch.warnings == 0
    more = [await pub.add(f"late{i}", 1) for i in range(5)]
    lag = await writer.measure_lag()
    assert (lag.events, lag.messages, lag.position, lag.newest) == (5, 5, last, more[-1])
    assert lag.oldest_ns is not None and 0 <= lag.oldest_age_s < 30
    lag = await projector.measure_lag()
    assert (lag.events, lag.messages, lag.position) == (0, 0, last)
