"""Dynamo's ``--router-track-output-blocks`` (off by default): the routing replica counts the
blocks a request generates, its peers never do. A seqstate fold of the replica-sync events can
only ever equal the peers' view: output blocks are in no message on NATS.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from dynamo_kit import block, close_all, nonzero, open_streams, scrape
from eventually import eventually
from fleet import BLOCK_SIZE
from live import LiveFleet

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]

FRONTEND_ARGS = ("--router-track-output-blocks",)


async def test_output_blocks_grow_on_the_routing_replica_only(live: LiveFleet) -> None:
    """One 35-token prompt (2 full blocks) generating 100 tokens through frontend 1. Sampled
    until it completes: frontend 2 shows 2 blocks on its rank in every sample; frontend 1
    starts at 2 and climbs, never down, never past (35 + 100) // 16 = 8, and past 2 at some
    point. The AddRequest carries no expected_output_tokens; no message tells a peer about the
    output. After the Free both show zero."""
    f1, f2 = live.frontends
    rid = str(uuid.uuid4())
    prompt = block(4_000_001) + block(4_000_002) + "123"
    (stream,) = await open_streams([(rid, f1.http_port, prompt, 100)])
    try:
        add = (
            await eventually(
                lambda: live.capture.adds([rid]),
                lambda adds: rid in adds,
                what="the AddRequest",
                watch=live.fleet.tails,
            )
        )[rid]
        assert add.add.token_sequence is not None and len(add.add.token_sequence) == 2
        assert add.add.expected_output_tokens is None
        rank = add.rank
        routing: list[int] = []
        peer: list[int] = []
        while not stream.finished.is_set():
            one, two = await scrape(f1.http_port), await scrape(f2.http_port)
            routing.append(one.decode.get(rank, 0))
            peer.append(two.decode.get(rank, 0))
            assert nonzero(one.decode).keys() <= {rank} and nonzero(two.decode).keys() <= {rank}
            await asyncio.sleep(0.1)
        assert stream.completed
    finally:
        await close_all([stream])
    # Samples taken once the Free was applied (the last few, if any) read zero: not in flight.
    while routing and routing[-1] == 0:
        routing.pop()
    while peer and peer[-1] == 0:
        peer.pop()
    assert routing and peer, "no sample while the stream was in flight"
    assert set(peer) == {2}, peer
    assert routing == sorted(routing) and routing[0] >= 2, routing
    assert max(routing) <= (len(prompt) + 100) // BLOCK_SIZE == 8, routing
    assert max(routing) > 2, routing
    assert live.capture.kinds(rid).count("AddRequest") == 1
    await eventually(
        lambda: asyncio.gather(scrape(f1.http_port), scrape(f2.http_port)),
        lambda views: all(not any(v.decode.values()) for v in views),
        what="zero decode blocks on both after the Free",
        watch=live.fleet.tails,
    )
