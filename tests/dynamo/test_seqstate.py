"""seqstate folding a real Dynamo fleet's replica-sync events, checked through
its CLI only, against the frontends' own gauges (the facts test_facts.py pins).

Each is skipped, with the missing piece named, while the installed ``seqstate`` lacks what it
needs (``run --dynamo-endpoint``: capture and fold; ``dynamo resync``: catch-up): so the live
suite also runs on a branch where those have not landed yet.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from dynamo_kit import Stream, block, close_all, nonzero, open_streams, scrape, unique_blocks
from eventually import eventually
from fleet import DYNAMO_ENDPOINT
from holding_proxy import HoldingProxy
from live import LiveFleet
from seqstate_kit import (
    HELD,
    NAMESPACE,
    REPO,
    SEQSTATE,
    Seqstate,
    agree,
    lacks,  # noqa: F401 (read by the skipif strings below)
    per_rank,
)

from projector.nats.server import NatsServer

# String conditions: evaluated only for a test about to run, so a `make test` that deselects
# these never pays for the two `--help` processes.
needs_capture = pytest.mark.skipif(
    "lacks('--dynamo-endpoint', 'run')",
    reason="seqstate run has no --dynamo-endpoint yet (capture and fold)",
)
needs_resync = pytest.mark.skipif(
    "lacks('--dynamo-endpoint', 'dynamo', 'resync')",
    reason="no `seqstate dynamo resync --dynamo-endpoint` yet (catch-up)",
)
pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module"), needs_capture]
# The command's own tests: seqstate's automatic resync of a new frontend (test_follow.py) off.
SEQSTATE_ARGS = ("--dynamo-resync", "off")


async def hold(live: LiveFleet, tag: int, count: int) -> tuple[list[str], list[Stream]]:
    f1, f2 = live.frontends
    rids = [str(uuid.uuid4()) for _ in range(count)]
    specs = [
        (
            rid,
            (f1 if i % 2 == 0 else f2).http_port,
            block(tag + 1) + block(tag + 2 + i % 3) + block(tag + 10 + i) + "1234",
            HELD,
        )
        for i, rid in enumerate(rids)
    ]
    streams = await open_streams(specs)
    await live.added(rids)
    return rids, streams


async def until_a_high_worker_holds_one(
    live: LiveFleet, rids: list[str], streams: list[Stream], tag: int
) -> None:
    """Hold one more stream at a time until a worker id above 2^63 has a request in flight.
    The KV router sends a new cold prompt to the least loaded rank, so an idle rank gets one
    within a few; ten is a bound, not a guess."""
    f1 = live.frontends[0]
    for extra in range(10):
        if any(worker >= 1 << 63 for worker, _ in per_rank(live, rids)):
            return
        rid = str(uuid.uuid4())
        prompt = block(tag + 500 + extra) + block(tag + 600 + extra) + "12"
        streams += await open_streams([(rid, f1.http_port, prompt, HELD)])
        rids.append(rid)
        await eventually(
            lambda: live.capture.adds(rids),
            lambda adds: len(adds) == len(rids),
            what="the extra stream's AddRequest",
        )
    assert any(worker >= 1 << 63 for worker, _ in per_rank(live, rids)), per_rank(live, rids)


async def test_seqstate_equals_both_frontends_then_zero(
    live: LiveFleet, seqstate: Seqstate
) -> None:
    """Eight streams held, two cut mid-stream: seqstate's blocks per (worker, dp_rank) equal
    both frontends' gauges, its request counts the streams held; once every request has its
    first token no prefill is left (seqstate applies every Mark); after the drain, zero."""
    rids, streams = await hold(live, 5_000_000, 8)
    try:
        await until_a_high_worker_holds_one(live, rids, streams, 5_000_000)
        await agree(live, seqstate, per_rank(live, rids), f"{len(rids)} streams held", rids=rids)
        rows = await seqstate.loads()
        assert any(worker >= 1 << 63 for worker, _ in rows), rows  # a u64 through the CLI
        first_token = await eventually(
            lambda: {r for r in rids if live.capture.marked_by(r)},
            lambda marked: marked == set(rids),
            what="a Mark for every request",
        )
        assert first_token
        await eventually(
            seqstate.loads,
            lambda rows: not any(v["prefill"] for v in rows.values()),
            what="no prefill left in seqstate once every request has its first token",
            watch=seqstate.tail,
        )
        await asyncio.gather(*(s.cut() for s in streams[:2]))
        await eventually(
            lambda: live.capture.freed(rids[:2]),
            lambda freed: len(freed) == 2,
            what="the cut streams' Frees",
        )
        assert sum(unique_blocks(live.capture.in_flight(rids).values()).values()) > 0
        await agree(live, seqstate, per_rank(live, rids), "2 streams cut")
    finally:
        await close_all(streams)
    await agree(live, seqstate, {}, "the drain")


async def test_sigkilled_seqstate_restarts_equal_and_replay_verifies(
    live: LiveFleet, seqstate: Seqstate
) -> None:
    """seqstate SIGKILLed while Dynamo routes and frees (JetStream keeps capturing), then
    restarted: it ends equal to the frontends; ``replay --verify`` finds the bucket identical."""
    rids, streams = await hold(live, 6_000_000, 6)
    try:
        await agree(live, seqstate, per_rank(live, rids), "6 streams held")
        seqstate.kill()
        await asyncio.gather(*(s.cut() for s in streams[:3]))
        more, more_streams = await hold(live, 7_000_000, 4)
        streams += more_streams
        rids += more
        seqstate.start()
        await agree(live, seqstate, per_rank(live, rids), "after the restart")
    finally:
        await close_all(streams)
    await agree(live, seqstate, {}, "the drain")
    rc, out, err = await seqstate.cli("replay", "--verify")
    assert rc == 0, (out, err)


@needs_resync
async def test_a_late_frontend_is_resynced(live: LiveFleet, seqstate: Seqstate) -> None:
    """Streams held; a frontend started now shows nothing of them (test_facts.py); after
    ``seqstate dynamo resync`` it shows the same decode gauges as the two that routed them, and
    seqstate's own counts do not double (its capture ignores what it republished)."""
    rids, streams = await hold(live, 8_000_000, 6)
    late = None
    try:
        requests = per_rank(live, rids)
        await agree(live, seqstate, requests, "6 streams held")
        late = await live.start_frontend("frontend-late")
        before = await scrape(late.http_port)
        assert nonzero(before.decode) == {} and nonzero(before.prefill) == {}
        rc, out, err = await seqstate.cli(
            "dynamo", "resync", "--namespace", NAMESPACE, "--dynamo-endpoint", DYNAMO_ENDPOINT
        )
        assert rc == 0, (out, err)
        await agree(live, seqstate, requests, "after the resync, the late frontend included")
        # What resync published: each held request's AddRequest again, as Dynamo wrote it (same
        # worker, rank and blocks), under one publisher id that is none of Dynamo's.
        again = live.capture.republished(rids)
        firsts = live.capture.adds(rids)
        assert sorted(s.event.request_id for s in again) == sorted(rids)
        (publisher,) = {s.envelope.publisher_id for s in again}
        assert publisher not in {s.envelope.publisher_id for s in firsts.values()}
        for seen in again:
            first = firsts[seen.event.request_id]
            assert seen.rank == first.rank
            assert seen.add.token_sequence == first.add.token_sequence
    finally:
        await close_all(streams)
    try:
        await agree(live, seqstate, {}, "the drain")
    finally:
        if late is not None:
            live.fleet.stop_proc(late)


@needs_resync
async def test_a_resync_never_resurrects_requests_freed_while_it_runs(
    live: LiveFleet, seqstate: Seqstate, nats_server: NatsServer
) -> None:
    """Eight streams held through both frontends; ``seqstate dynamo resync`` is held (a proxy
    between it and NATS) at its first publish, after it has read the ledger; four streams are
    cut then, and their Frees folded. Released, resync sends its Adds, then the Free of each
    request that ended meanwhile: both frontends show the four still held, as seqstate does,
    and zero after the drain. (Before, the four came back on every replica that had not
    routed them, until the replicas' own expiry.)"""
    rids, streams = await hold(live, 10_000_000, 8)
    proxy = await HoldingProxy(nats_server.port).start()
    try:
        await agree(live, seqstate, per_rank(live, rids), "8 streams held")
        resync = await asyncio.create_subprocess_exec(
            *SEQSTATE,
            "dynamo",
            "resync",
            "--namespace",
            NAMESPACE,
            "--dynamo-endpoint",
            DYNAMO_ENDPOINT,
            env=dict(seqstate.env(), NATS_URL=proxy.url),
            cwd=REPO,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        await eventually(
            lambda: proxy.held.is_set() or resync.returncode is not None,
            what="resync at its first publish (held by the proxy)",
        )
        assert resync.returncode is None
        # Both frontends routed some of the four (the streams alternate between them).
        await asyncio.gather(*(s.cut() for s in streams[:4]))
        await eventually(
            lambda: live.capture.freed(rids[:4]),
            lambda freed: len(freed) == 4,
            what="the cut streams' Frees",
        )
        await agree(live, seqstate, per_rank(live, rids), "4 cut while resync is held")
        proxy.release.set()
        out, err = await resync.communicate()
        assert resync.returncode == 0, (out, err)
        await eventually(
            lambda: live.capture.republished(rids),
            lambda again: len(again) == 8,
            what="the 8 republished AddRequests on Dynamo's subject",
        )
        await agree(live, seqstate, per_rank(live, rids), "after the resync: the 4 still held")
        assert "resynced 8 requests in flight" in out.decode(), out
        assert "; 4 ended meanwhile, their Free sent again" in out.decode(), out
    finally:
        await proxy.stop()
        await close_all(streams)
    await agree(live, seqstate, {}, "the drain")
