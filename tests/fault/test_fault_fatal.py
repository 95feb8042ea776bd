"""A consumer that cannot go on exits at once and non-zero, saying why in one line,
so that its supervisor restarts it (before, a failed writer stayed up for minutes, consumer-less,
and then exited 0 on SIGTERM, hiding the failure).

The writer meets another writer's delta on its namespace's chain; the projector finds its lease
taken. Each must end by itself with exit status 1 and the reason as its last line.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
from eventually import eventually
from fault_kit import BUSY, WAIT_S, Service, delta_source_seq, fault_config
from log_text import plain_lines
from nats.aio.client import Client

from projector.nats.lease import Holder
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.wire.headers import PREV_SOURCE_SEQ
from projector.wire.values import lease_key
from seqstate import Delta, encode_deltas


async def exit_status(service: Service) -> tuple[int, str]:
    """Wait (at most ``WAIT_S``) for the service to end by itself: its status, last log line."""
    proc = service.proc
    assert proc is not None

    code = await eventually(
        proc.poll, lambda c: c is not None, what=f"{service.command} exited", watch=service.logs
    )
    service.proc = None
    lines = plain_lines(service.logs())
    assert code is not None
    return code, lines[-1]


async def test_a_writer_meeting_another_writer_exits_non_zero_at_once(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fault_config("f")
    await ensure(nc, config)
    js = nc.jetstream()
    writer = Service("writer", config, nats_server.url, tmp_path)
    try:
        await writer.start(js, 0)
        await writer.wait_ready(js)
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="fatal-w", config=config)
        first = await pub.add("a", 1, block_hashes=[1])

        async def deltas() -> int:
            return await delta_source_seq(js, config)

        await eventually(
            deltas,
            lambda seq: seq >= first,
            what="the writer stored its delta",
            retry_on=BUSY,
            watch=writer.logs,
            check=writer.check,
        )
        # A delta as another writer of the namespace would store it: chained, of a real event.
        other = encode_deltas([Delta("applied", 0, seq=first)])
        await js.publish(config.deltas_subject, other, headers={PREV_SOURCE_SEQ: str(first - 1)})
        await pub.add("b", 1, block_hashes=[2])  # the writer's next delta meets it
        code, last = await exit_status(writer)
    finally:
        writer.close()
    assert code == 1
    assert last.startswith("seqstate: error: another writer stored deltas for namespace"), last


async def test_a_projector_whose_lease_is_taken_exits_non_zero_at_once(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fault_config("f")
    await ensure(nc, config)
    js = nc.jetstream()
    projector = Service("projector", config, nats_server.url, tmp_path)
    try:
        await projector.start(js, 0)
        await projector.wait_ready(js)
        kv = await js.key_value(config.registry_bucket)
        stranger = Holder("projector", "stranger", "elsewhere", 1, "", ttl_s=WAIT_S)
        await kv.put(lease_key(config.namespace), msgspec.json.encode(stranger))
        code, last = await asyncio.wait_for(exit_status(projector), WAIT_S + 5)
    finally:
        projector.close()
    assert code == 1
    assert last.startswith("seqstate: error: ") and "lease" in last, last
