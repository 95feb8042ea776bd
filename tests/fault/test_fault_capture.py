"""The capture's forwarder SIGKILLed mid-burst, and nats-server SIGKILLed under it.

The writer's forwarder stores the Dynamo capture's bursts as record batches, each naming the
capture sequences it holds, with a compare-and-set on its subject: a restarted forwarder
resumes just after the last one stored. So whatever is killed when, every captured message
is in the log once, in the order captured, and the ledger equals one uninterrupted fold.
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

from dynamo_capture import CAPTURE
from eventually import eventually
from fault_kit import (
    BUSY,
    Service,
    assert_exact,
    fault_config,
    stop_all,
    wait_current,
)
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from pipeline_kit import read_events
from test_fault_server import robust_client

from projector.nats.backlog import covered_seq
from projector.nats.resources import dynamo_capture, ensure
from projector.nats.server import NatsServer
from projector.nats.stream import last_seq_of
from projector.settings.config import Config
from projector.wire.capture import captured_subjects, dynamo_subject
from seqstate.batches import items_of

COPIES = 20  # of the real fleet's 155 messages, per part: 3,100 Dynamo messages


async def forwarded(js: JetStreamContext, config: Config) -> int:
    """The last capture sequence the log holds (0: none yet)."""
    try:
        newest = await js.get_last_msg(config.events_stream, captured_subjects(config.namespace))
    except NotFoundError:
        return 0
    return covered_seq(newest.headers, dynamo_capture(config))


async def publish(nc: Client, config: Config, data: list[bytes]) -> None:
    for each in data:
        await nc.publish(dynamo_subject(config.dynamo_endpoints[0]), each)  # NATS Core
    await nc.flush()


async def test_forwarder_and_server_killed_mid_burst_lose_and_repeat_nothing(
    tmp_path: Path,
) -> None:
    """Broke: 3,100 Dynamo messages captured while no writer ran; the writer SIGKILLed as
    soon as its forwarder stored some; nats-server SIGKILLed; 3,100 more captured; the
    writer started again, and nats-server SIGKILLed as soon as its forwarder moved on.
    Expected: the log holds the 6,200 messages once each, in the order captured;
    the ledger equals one uninterrupted fold of it."""
    config = fault_config("cf", idle_tick_s=3600.0)
    config = dataclasses.replace(config, dynamo_endpoint=f"{config.namespace}.backend.generate")
    server = NatsServer(tmp_path / "store")
    server.start()
    nc = await robust_client(server.url)
    services: list[Service] = []
    data = [m.data for m in CAPTURE] * COPIES
    try:
        await ensure(nc, config)
        js = nc.jetstream()
        await publish(nc, config, data)
        capture = dynamo_capture(config)
        await eventually(
            lambda: js.stream_info(capture),
            lambda info: info.state.last_seq == len(data),
            what="the first part captured",
        )
        writer = Service("writer", config, server.url, tmp_path)
        projector = Service("projector", config, server.url, tmp_path)
        services = [writer, projector]
        for service in services:
            await service.start(js, 0)
        first = await eventually(
            lambda: forwarded(js, config),
            lambda seq: seq > 0,
            what="the forwarder's first batch stored",
            interval=0.005,
            retry_on=BUSY,
            check=writer.check,
            watch=writer.logs,
        )
        writer.kill()  # mid-burst, most likely: the capture holds 3,100
        server.kill()
        await asyncio.sleep(0.3)
        server.start()
        await publish(nc, config, data)  # a second part, captured while no writer runs
        await eventually(
            lambda: js.stream_info(capture),
            lambda info: info.state.last_seq == 2 * len(data),
            what="the second part captured",
            retry_on=BUSY,
        )
        await writer.start(js, 0)
        await eventually(
            lambda: forwarded(js, config),
            lambda seq: seq > first,
            what="the new forwarder moving on",
            interval=0.005,
            retry_on=BUSY,
            check=writer.check,
            watch=writer.logs,
        )
        server.kill()
        await asyncio.sleep(0.3)
        server.start()
        await eventually(
            lambda: forwarded(js, config),
            lambda seq: seq == 2 * len(data),
            what="every captured message stored",
            retry_on=BUSY,
            check=writer.check,
            watch=writer.logs,
        )
        last = await last_seq_of(js, config.events_stream, config.events_subjects)
        await wait_current(js, writer, projector, last)
        await stop_all(services)
        log = await read_events(nc, config)
        stored = [
            item
            for _, _, subject, payload in log
            if ".dynamo." in subject
            for item in items_of(payload)
        ]
        assert stored == data + data  # none lost, none twice, in the order captured
        assert len(log) < len(stored)  # bursts as batches
        await assert_exact(nc, config, last)
    finally:
        for service in services:
            service.close()
        await nc.close()
        server.stop()
