"""A writer catching up stores its deltas many messages per round trip, as atomic batches; the
server is SIGKILLed while it does.

Expected: the writer rides the kills out (one process, never restarted); the DELTAS chain has
no hole (each message continues the one before it); every batch is stored whole, numbered
from 1 with its commit last; at least one batch holds several messages; and the writer's
snapshot and the bucket equal one uninterrupted fold of the log.
"""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from pathlib import Path

from eventually import eventually
from fault_kit import (
    BUSY,
    Service,
    assert_exact,
    delta_source_seq,
    fault_config,
    read_stream,
    wait_current,
    workload,
)
from test_fault_server import robust_client

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.wire.chain import covered_source
from projector.wire.headers import BATCH_COMMIT, BATCH_ID, BATCH_SEQUENCE, PREV_SOURCE_SEQ

KILLS = 2


async def test_a_server_killed_while_batches_are_in_flight_leaves_the_chain_whole(
    tmp_path: Path,
) -> None:
    """Breaks: nats-server SIGKILLed twice (down 0.2-0.8 s) while the writer stores the deltas
    of a backlog of ~31,000 events, each time as soon as its deltas have moved on (a backlog
    that takes several appends of at most 8,192 deltas: a smaller one, ~4,000 events, was
    stored in two appends by a writer fast enough, leaving the second kill nothing to cut).
    Expects: one writer process throughout; a gap-free chain of whole batches, one of several
    messages at least; snapshot and bucket equal to an uninterrupted fold."""
    rng = random.Random("batches")
    config = fault_config("b", idle_tick_s=3600.0, snapshot_every_events=1000)
    server = NatsServer(tmp_path / "store")
    server.start()
    nc = await robust_client(server.url)
    services: list[Service] = []
    try:
        await ensure(nc, config)
        js = nc.jetstream()
        pub = RouterPublisher(nc, router_id="backlog", config=config)
        events = [s.event for s in workload(7, config, requests=12_000) if s.event is not None]
        last = 0
        for start in range(0, len(events), 200):
            last = max(last, *await pub.publish_many(events[start : start + 200]))
        writer = Service("writer", config, server.url, tmp_path)
        projector = Service("projector", config, server.url, tmp_path)
        services = [writer, projector]
        for service in services:
            await service.start(js, 0)
        for service in services:  # the kills test riding them out, not a start cut short
            await service.wait_ready(js)
        pid = writer.proc.pid if writer.proc else 0

        seen = 0
        for _ in range(KILLS):
            before = seen
            seen = await eventually(
                lambda: delta_source_seq(js, config),
                lambda seq, before=before: seq > before,  # type: ignore[misc]
                what="the writer's deltas moving on",
                retry_on=BUSY,
                check=writer.check,
                watch=writer.logs,
            )
            server.kill()
            await asyncio.sleep(rng.uniform(0.2, 0.8))
            server.start()
        await wait_current(js, writer, projector, last)
        assert writer.proc is not None and writer.proc.pid == pid and len(writer.runs) == 1
        for service in services:
            code = await service.stop()
            assert code == 0, f"{service.command} exited with {code}\n{service.logs()}"

        stored = await read_stream(nc, config.deltas_stream, config.deltas_subject)
        covered = 0
        batches: dict[str, list[tuple[int, dict[str, str]]]] = defaultdict(list)
        for seq, headers, data in stored:
            assert headers[PREV_SOURCE_SEQ] == str(covered), f"a hole before message {seq}"
            covered = covered_source(headers, data) or 0
            if BATCH_ID in headers:  # an append of one message is no batch
                batches[headers[BATCH_ID]].append((seq, headers))
        assert covered == last
        for batch_id, messages in batches.items():
            seqs = [seq for seq, _ in messages]
            assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), f"batch {batch_id} split"
            numbers = [int(h[BATCH_SEQUENCE]) for _, h in messages]
            assert numbers == list(range(1, len(messages) + 1)), f"batch {batch_id} partial"
            assert [BATCH_COMMIT in h for _, h in messages] == [False] * (len(messages) - 1) + [
                True
            ]
        assert max(map(len, batches.values()), default=0) > 1, "no batch of several messages"
        await assert_exact(nc, config, last)
    finally:
        for service in services:
            service.close()
        await nc.close()
        server.stop()
