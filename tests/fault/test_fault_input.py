"""Hostile input reaches real writer and projector processes: a message just under
the server's payload limit (it used to wedge the writer: its dead letter did not fit), 25
small events asking for 102,400 ranks (250 MB in the writer, 204k keys), and a forged delta
for event 10**12 (it froze the read model). All are dead-lettered, the events around them
applied, and the final snapshot and bucket are byte for byte what one uninterrupted fold of
the log gives.
"""

from __future__ import annotations

from pathlib import Path

from fault_kit import (
    Service,
    assert_exact,
    bucket_values,
    fault_config,
    stop_all,
    wait_current,
    workload,
)
from nats.aio.client import Client

from projector.nats.resources import dead_letter_stream, ensure
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.wire.headers import PREV_SOURCE_SEQ, SIZE, TRUNCATED
from projector.wire.values import load_key
from seqstate import Delta, WorkerAdded, encode_deltas


async def test_a_huge_message_and_a_rank_bomb_are_dead_lettered_and_the_ledger_stays_exact(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    config = fault_config("i", expiry_s=2.0, idle_tick_s=3600.0)
    await ensure(nc, config)
    js = nc.jetstream()
    writer = Service("writer", config, nats_server.url, tmp_path)
    projector = Service("projector", config, nats_server.url, tmp_path)
    services = [writer, projector]
    try:
        for service in services:
            await service.start(js, 0)
            await service.wait_ready(js)
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="hostile", config=config)
        steps = workload(41, config, requests=200)
        half = len(steps) // 2
        for step in steps[:half]:
            await (pub.publish(step.event) if step.event else js.publish(step.subject, step.raw))
        huge = b"\xc1" * 1_048_566  # as reported: 1,048,566 bytes to a worker's subject
        await js.publish(config.event_subject(1, 0), huge)
        for w in range(25):
            await pub.publish(WorkerAdded(worker_id=100 + w, dp_size=4096))
        # A forged delta that moved the position to 10**12 and froze the read model.
        forged = encode_deltas([Delta("applied", 0, seq=10**12)])
        await js.publish(config.deltas_subject, forged, headers={PREV_SOURCE_SEQ: "0"})
        last = 0
        for step in steps[half:]:
            last = (
                await pub.publish(step.event)
                if step.event
                else (await js.publish(step.subject, step.raw)).seq
            )

        await wait_current(js, writer, projector, last)
        await stop_all(services)
    finally:
        for service in services:
            service.close()
    await assert_exact(nc, config, last)
    bombed = {load_key(config.namespace, (100 + w, 0)) for w in range(25)}
    assert not bombed & set(await bucket_values(nc, config)), "a refused worker has ranks"
    dead = await js.stream_info(dead_letter_stream(config))
    assert dead.state.messages == 3 + 1 + 25 + 1  # the workload's malformed three, then ours
    letters = [
        await js.get_msg(dead_letter_stream(config), n)
        for n in range(dead.state.first_seq, dead.state.last_seq + 1)
    ]
    big = [m for m in letters if (m.headers or {}).get(SIZE) == str(len(huge))]
    assert len(big) == 1 and (big[0].headers or {}).get(TRUNCATED) == "true"
    refused = [
        m for m in letters if "max_ranks_per_worker" in (m.headers or {}).get("Seqstate-Reason", "")
    ]
    assert len(refused) == 25
    beyond = [
        m
        for m in letters
        if "beyond the events stream" in (m.headers or {}).get("Seqstate-Reason", "")
    ]
    assert len(beyond) == 1 and beyond[0].data == forged
