"""What Dynamo's own gauges do when a worker or a router replica is SIGKILLed with requests in
flight: the ground truth a ledger compared with those gauges after a SIGKILL must match.

The two tests share one fleet and run in order: the worker first (two frontends route), then a
frontend (with the one worker left). What the peer does when the last worker then dies too is
not asserted: it differed between two runs (README.md).
"""

from __future__ import annotations

import uuid

import pytest
from dynamo_kit import close_all, nonzero, open_streams, scrape, unique_blocks
from eventually import eventually
from live import LiveFleet
from seqstate_kit import Seqstate, agree, per_rank

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]

HELD = 2000


def prompts(tag: int, count: int) -> list[str]:
    return [f"{tag + i:016d}{tag + 100 + i:016d}7" for i in range(count)]


async def test_a_sigkilled_worker_s_requests_are_freed_and_its_ranks_dropped(
    live: LiveFleet, seqstate_if_any: Seqstate | None
) -> None:
    """Six streams over both workers; the dp-2 mocker SIGKILLed. Each stream on it ends with
    "Service temporarily unavailable" (an HTTP 503, or an error event in a stream already
    begun), and its router publishes a Free for it; both frontends
    then drop the dead worker's ranks (from ``worker_registered`` and the gauges) once its
    discovery records go, and show exactly the blocks of the requests on the surviving worker.
    seqstate (when it can fold Dynamo) equals them, then zero after the drain."""
    f1, f2 = live.frontends
    rids = [str(uuid.uuid4()) for _ in range(6)]
    specs = [
        (rid, (f1 if i % 2 == 0 else f2).http_port, prompt, HELD)
        for i, (rid, prompt) in enumerate(zip(rids, prompts(20_000_000, 6), strict=True))
    ]
    streams = await open_streams(specs)
    try:
        adds = await eventually(
            lambda: live.capture.adds(rids),
            lambda got: len(got) == 6,
            what="6 AddRequests",
            watch=live.fleet.tails,
        )
        (doomed,) = [m for m in live.fleet.mockers if m.name.endswith("dp2")]
        dead = live.fleet.worker_of(doomed)
        on_dead = {rid for rid, add in adds.items() if add.rank[0] == dead}
        survivors = {rid: add for rid, add in adds.items() if rid not in on_dead}
        assert on_dead and survivors, {rid: add.rank for rid, add in adds.items()}
        live.fleet.kill_proc(doomed)
        await eventually(
            lambda: live.capture.freed(rids),
            lambda freed: freed == on_dead,
            what="a Free for each request on the dead worker, none for the others",
            watch=live.fleet.tails,
        )
        dead_streams = [s for s in streams if s.request_id in on_dead]
        await eventually(
            lambda: [(s.port, s.finished.is_set(), bytes(s.received[-300:])) for s in dead_streams],
            lambda got: all(done for _, done, _ in got),
            what="the dead worker's streams end",
            timeout=60,
        )
        for stream in dead_streams:  # an error event in the stream, or a 503 before it began
            assert b"Service temporarily unavailable" in stream.received, stream.received
            assert stream.status in (200, 503), stream.received
        alive = {rank for rank in live.fleet.ranks() if rank[0] != dead}
        expected = unique_blocks(survivors.values())
        for front in (f1, f2):
            await eventually(
                lambda front=front: scrape(front.http_port),
                lambda g: g.registered == alive and nonzero(g.decode) == expected,
                what=f"{front.name}: only {sorted(alive)} registered, showing {expected}",
                timeout=60,
                watch=live.fleet.tails,
            )
        if seqstate_if_any is not None:  # every request was freed by a live router: equal
            await agree(live, seqstate_if_any, per_rank(live, rids), "after the worker's kill")
    finally:
        await close_all(streams)
    if seqstate_if_any is not None:
        await agree(live, seqstate_if_any, {}, "the drain")
    for front in (f1, f2):
        await eventually(
            lambda front=front: scrape(front.http_port),
            lambda g: nonzero(g.decode) == {},
            what=f"{front.name} at zero after the drain",
            watch=live.fleet.tails,
        )


async def test_a_sigkilled_frontend_s_requests_stay_on_its_peer(
    live: LiveFleet, seqstate_if_any: Seqstate | None
) -> None:
    """Four streams, two routed by each frontend; frontend 1 SIGKILLed; frontend 2's two
    closed. No Free is ever published for frontend 1's requests (it was the only one that
    could), so frontend 2 goes on showing their blocks with nothing of its own in flight:
    Dynamo's replicas never let go of a dead peer's requests. seqstate (when it can fold
    Dynamo) shows the same, until its own expiry."""
    f1, f2 = live.frontends
    rids = [str(uuid.uuid4()) for _ in range(4)]
    specs = [
        (rid, (f1 if i % 2 == 0 else f2).http_port, prompt, HELD)
        for i, (rid, prompt) in enumerate(zip(rids, prompts(21_000_000, 4), strict=True))
    ]
    streams = await open_streams(specs)
    try:
        adds = await eventually(
            lambda: live.capture.adds(rids),
            lambda got: len(got) == 4,
            what="4 AddRequests",
            watch=live.fleet.tails,
        )
        orphans = {rid: add for rid, add in adds.items() if add.event.router_id == f1.router_id}
        own = [s for s in streams if s.request_id not in orphans]
        assert len(orphans) == 2 and len(own) == 2
        live.fleet.kill_proc(f1)
        await close_all(own)
        await eventually(
            lambda: live.capture.freed(rids),
            lambda freed: freed == {s.request_id for s in own},
            what="frontend 2's Frees",
            watch=live.fleet.tails,
        )
        expected = unique_blocks(orphans.values())
        assert sum(expected.values()) == 4  # two requests, two distinct blocks each
        await eventually(
            lambda: scrape(f2.http_port),
            lambda g: nonzero(g.decode) == expected,
            what=f"frontend 2 keeps the dead frontend's requests: {expected}",
            watch=live.fleet.tails,
        )
        assert live.capture.freed(orphans) == set()
        if seqstate_if_any is not None:  # no Free for the orphans: seqstate keeps them too
            await agree(
                live, seqstate_if_any, per_rank(live, rids), "after the frontend's kill", [f2]
            )
    finally:
        await close_all(streams)
