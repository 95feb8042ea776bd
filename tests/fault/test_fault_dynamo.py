"""Dynamo keeps routing while seqstate's processes are SIGKILLed.

Dynamo publishes on NATS Core and never waits for seqstate: the shared capture's 155 real
messages are published in three parts, and between them ``seqstate writer`` and ``seqstate
projector`` (with ``--dynamo-endpoint``) are SIGKILLed; the middle part is published while
both are dead. The capture stream stores what Dynamo publishes whatever runs, so once they
are started again the write model and the bucket are exactly what one uninterrupted fold of
the log gives, every captured message is in the log, and ``replay --verify`` agrees.
"""

from __future__ import annotations

from pathlib import Path

from dynamo_capture import CAPTURE, ENDPOINT, SUBJECT
from eventually import eventually
from fault_kit import (
    Service,
    assert_exact,
    fault_config,
    stop_all,
    wait_current,
)
from nats.aio.client import Client
from pipeline_kit import read_events, run_cli

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from seqstate import SequenceState
from seqstate.batches import items_of


def dynamo_messages(log: list[tuple[int, int, str, bytes]]) -> list[bytes]:
    """The Dynamo messages ``log`` holds, in order: alone, or in the forwarder's batches."""
    return [item for _, _, _, data in log for item in items_of(data)]


async def publish(nc: Client, part: list[bytes]) -> None:
    for data in part:
        await nc.publish(SUBJECT, data)  # NATS Core, as Dynamo: nobody acknowledges
    await nc.flush()


async def test_seqstate_killed_while_dynamo_routes_ends_equal(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fault_config("dk", dynamo_endpoint=ENDPOINT, idle_tick_s=3600.0)
    await ensure(nc, config)
    js = nc.jetstream()
    writer = Service("writer", config, nats_server.url, tmp_path)
    projector = Service("projector", config, nats_server.url, tmp_path)
    services = [writer, projector]
    data = [m.data for m in CAPTURE]
    try:
        for service in services:
            await service.start(js, 0)
            await service.wait_ready(js)
        await publish(nc, data[:50])
        for service in services:
            service.kill()
        await publish(nc, data[50:110])  # both dead: Dynamo goes on routing
        for service in services:
            await service.start(js, 0)
            await service.wait_ready(js)
        await publish(nc, data[110:])

        async def logged() -> list[bytes]:
            return dynamo_messages(await read_events(nc, config))

        await eventually(logged, lambda got: len(got) >= len(data), what="every message stored")
        last = await last_seq_of(js, config.events_stream, config.events_subjects)
        await wait_current(js, writer, projector, last)
        await stop_all(services)
    finally:
        for service in services:
            service.close()
    # every captured message, once and in order, in the namespace's log (bursts as batches)
    assert dynamo_messages(await read_events(nc, config)) == data
    snapshot = await assert_exact(nc, config, last)
    state = SequenceState.restore(snapshot)
    assert len(state.requests) == 0 and state.publishers.holes == 0  # the capture drains
    out = await run_cli(config, nats_server.url, "replay", "--verify", "--no-progress")
    assert out.returncode == 0 and "identical: 0 keys differ" in out.stdout, out.stdout
