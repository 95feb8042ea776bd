"""What a real Dynamo 1.6.1 fleet does, pinned with exact numbers: the facts seqstate's fold of
Dynamo's events must reproduce. No seqstate process runs here; the frontends' own
gauges are compared with a model computed from the captured messages, decoded independently
(dynamo_kit.py). README.md beside this file has the findings in prose.

Prompts are digits (one token each): ``block(tag)`` is a 16-token block, and every test uses
tags of its own, so no test's blocks are cached on a worker by another.
"""

from __future__ import annotations

import asyncio
import uuid

import pytest
from dynamo_kit import (
    Gauges,
    Seen,
    block,
    close_all,
    forge,
    nonzero,
    open_streams,
    scrape,
    unique_blocks,
)
from eventually import eventually
from fleet import BLOCK_SIZE, TOP_BIT
from live import LiveFleet

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]

HELD = 2000  # max_tokens of a stream the test holds open and closes itself (~200 s of decode)


def ids(count: int) -> list[str]:
    """Fresh request ids: UUIDs, the only form Dynamo takes from ``x-dynamo-request-id``."""
    return [str(uuid.uuid4()) for _ in range(count)]


async def views(live: LiveFleet) -> list[Gauges]:
    return [await scrape(f.http_port) for f in live.frontends]


async def all_show(live: LiveFleet, expected: dict[tuple[int, int], int], what: str) -> None:
    """Every frontend's decode gauges equal ``expected`` (zero ranks left out)."""
    await eventually(
        lambda: views(live),
        lambda vs: all(nonzero(v.decode) == expected for v in vs),
        what=f"{what}: every frontend's decode blocks == {expected}",
        watch=live.fleet.tails,
    )


async def worker_marked(live: LiveFleet, rids: list[str]) -> None:
    """Until each request has its worker's MarkPrefillCompleted (sent at its first token)."""

    def marked() -> set[str]:
        adds = live.capture.adds(rids)
        return {
            rid
            for rid, add in adds.items()
            if add.event.worker.worker_id in live.capture.marked_by(rid)
        }

    await eventually(
        marked,
        lambda got: got == set(rids),
        what="the worker's MarkPrefillCompleted of every request",
        watch=live.fleet.tails,
    )


async def added(live: LiveFleet, rids: list[str]) -> dict[str, Seen]:
    return await eventually(
        lambda: live.capture.adds(rids),
        lambda adds: len(adds) == len(rids),
        what=f"an AddRequest for each of {len(rids)} requests",
        watch=live.fleet.tails,
    )


async def test_decode_blocks_are_each_rank_s_distinct_full_blocks(live: LiveFleet) -> None:
    """Seven streams with a two-block shared prefix, one distinct block each, five tokens more
    (one with none): each AddRequest's token_sequence has exactly its full blocks (53 tokens ->
    3 hashes, 48 -> 3); the shared prefix hashes alike, the distinct blocks do not; each
    frontend's decode gauge per rank is the number of DISTINCT hashes of the requests there
    (2 + the requests on that rank: the prefix once, no partial block); it does not grow while
    a stream generates 100 tokens; cut streams are freed; after the drain every gauge is zero."""
    f1, f2 = live.frontends
    tag = 1_000_000
    shared = block(tag + 1) + block(tag + 2)
    rids = ids(7)
    prompts = [shared + block(tag + 100 + i) + ("12345" if i else "") for i in range(7)]
    held, short = rids[:6], rids[6]
    specs = [
        (rid, (f1 if i % 2 == 0 else f2).http_port, prompt, HELD if rid != short else 100)
        for i, (rid, prompt) in enumerate(zip(rids, prompts, strict=True))
    ]
    streams = {s.request_id: s for s in await open_streams(specs)}
    try:
        adds = await added(live, rids)
        await worker_marked(live, rids)

        # The wire: full blocks only, prefix-chained hashes, u64 ids.
        for i, rid in enumerate(rids):
            sequence = adds[rid].add.token_sequence
            assert sequence is not None
            assert len(sequence) == len(prompts[i]) // BLOCK_SIZE == 3, (rid, len(prompts[i]))
            assert all(0 <= h < 1 << 64 for h in sequence)
        prefixes = {tuple(adds[r].add.token_sequence or ())[:2] for r in rids}
        assert len(prefixes) == 1
        assert len({(adds[r].add.token_sequence or ())[2] for r in rids}) == 7

        per_rank: dict[tuple[int, int], int] = {}
        for add in adds.values():
            per_rank[add.rank] = per_rank.get(add.rank, 0) + 1
        assert sum(per_rank.values()) == 7
        assert set(per_rank) <= live.fleet.ranks()
        expected = {rank: 2 + n for rank, n in per_rank.items()}
        assert unique_blocks(adds.values()) == expected
        await all_show(live, expected, "7 streams in flight")

        # The short stream generates 100 tokens (6 blocks of output, ~10 s of simulated
        # decode) while the gauges are sampled: every sample shows the prompt blocks only.
        without_short = unique_blocks(a for r, a in adds.items() if r != short)
        samples: list[list[dict[tuple[int, int], int]]] = []
        while not streams[short].finished.is_set():
            samples.append([nonzero(v.decode) for v in await views(live)])
            await asyncio.sleep(0.05)
        assert streams[short].completed
        assert samples and samples[0] == [expected, expected], samples[:1]
        assert all(view in (expected, without_short) for s in samples for view in s), samples
        await all_show(live, without_short, "the short stream completed and freed")

        # Cut three held streams mid-stream (each has its first token: the worker's Mark).
        cut = held[:3]
        await asyncio.gather(*(streams[r].cut() for r in cut))
        await eventually(
            lambda: live.capture.freed(cut),
            lambda freed: freed == set(cut),
            what="a Free for each cut stream",
            watch=live.fleet.tails,
        )
        rest = unique_blocks(live.capture.in_flight(rids).values())
        assert sum(rest.values()) - 2 * len(rest) == 3  # three distinct blocks left
        await all_show(live, rest, "three streams cut")
    finally:
        await close_all(streams.values())

    await all_show(live, {}, "every stream closed")
    assert all(not any(v.decode.values()) for v in await views(live))
    assert all(not any(v.prefill.values()) for v in await views(live))

    # Every request: one AddRequest first, one Free last, the worker's own Mark among them.
    routers = {f.router_id for f in live.frontends}
    for rid in rids:
        kinds = live.capture.kinds(rid)
        assert kinds[0] == "AddRequest" and kinds[-1] == "Free", (rid, kinds)
        assert kinds.count("AddRequest") == 1 and kinds.count("Free") == 1, (rid, kinds)
        add = adds[rid]
        assert add.event.router_id in routers
        assert add.event.worker.worker_id in live.capture.marked_by(rid)
        assert live.capture.marked_by(rid) <= routers | {add.event.worker.worker_id}
        assert add.event.lora_name is None
        assert add.add.track_prefill_tokens is True
        assert add.add.expected_output_tokens is None
    assert not live.capture.errors


async def test_sequences_are_gap_free_per_publisher_from_zero(live: LiveFleet) -> None:
    """Everything captured since before the fleet started: each publisher's sequence runs
    0, 1, 2, ... with no hole and no repeat (loopback NATS loses nothing), and publisher ids
    differ from router and worker ids."""
    by_publisher: dict[int, list[int]] = {}
    for seen in live.capture.seen:
        by_publisher.setdefault(seen.envelope.publisher_id, []).append(seen.envelope.sequence)
        assert seen.envelope.topic == "active_sequences_events"
    assert by_publisher
    for publisher, sequences in by_publisher.items():
        assert sorted(sequences) == list(range(len(sequences))), publisher
    routers = {f.router_id for f in live.frontends}
    workers = set(live.fleet.worker_ids().values())
    assert not set(by_publisher) & (routers | workers)


async def test_forged_messages_are_byte_identical_to_dynamo_s(live: LiveFleet) -> None:
    """Every captured message, encoded again from its decoded fields by ``forge`` (what the
    live tests use to act as a peer replica), is byte for byte what Dynamo published: the
    peers' messages the tests send are Dynamo's own format, not an approximation of it."""
    assert live.capture.seen
    for seen in live.capture.seen:
        data = seen.add if seen.kind == "AddRequest" else seen.kind
        assert seen.event.lora_name is None
        again = forge(
            seen.event.request_id,
            seen.rank,
            data,
            publisher_id=seen.envelope.publisher_id,
            sequence=seen.envelope.sequence,
            router_id=seen.event.router_id,
            published_at=seen.envelope.published_at,
        )
        assert again == seen.raw, seen


async def test_worker_ids_above_2_63_reach_the_gauges(live: LiveFleet) -> None:
    """A worker id above 2^63 (the fleet makes sure of one) is written in full, as an unsigned
    decimal, in both frontends' metrics; the rank series of the gauges use the same ids."""
    ranks = live.fleet.ranks()
    high = {rank for rank in ranks if rank[0] >= TOP_BIT}
    assert high and len(ranks) == 3 and len({worker for worker, _ in ranks}) == 2
    for front in live.frontends:
        gauges = await scrape(front.http_port)
        assert gauges.registered == ranks
        assert set(gauges.decode) <= ranks and set(gauges.prefill) <= ranks


async def test_a_late_frontend_knows_nothing_of_requests_routed_before_it(
    live: LiveFleet,
) -> None:
    """Four streams held through frontends 1 and 2; a third frontend started then (ready: it
    routed a request of its own) shows zero decode blocks on every rank while the first two
    show the four requests' blocks: nothing replays what was routed before a replica started.
    That is what a seqstate resync must fix. The late one's gauges stay at zero through the
    Frees of requests it never saw (no underflow), and it is stopped cleanly."""
    f1, f2 = live.frontends
    tag = 2_000_000
    rids = ids(4)
    specs = [
        (
            rid,
            (f1 if i % 2 == 0 else f2).http_port,
            block(tag + 1) + block(tag + 10 + i) + block(tag + 20 + i) + "123",
            HELD,
        )
        for i, rid in enumerate(rids)
    ]
    streams = await open_streams(specs)
    late = None
    try:
        adds = await added(live, rids)
        expected = unique_blocks(adds.values())
        assert sum(expected.values()) == 4 * 2 + len(expected)  # 1 shared + 2 distinct each
        await all_show(live, expected, "4 streams in flight")
        late = await live.start_frontend("frontend-late")
        assert late.router_id not in {f1.router_id, f2.router_id}
        gauges = await scrape(late.http_port)
        assert gauges.registered == live.fleet.ranks()
        assert nonzero(gauges.decode) == {} and nonzero(gauges.prefill) == {}
        for front in (f1, f2):
            assert nonzero((await scrape(front.http_port)).decode) == expected
    finally:
        await close_all(streams)
    try:
        await eventually(
            lambda: live.capture.freed(rids),
            lambda freed: freed == set(rids),
            what="a Free for each stream",
            watch=live.fleet.tails,
        )
        await all_show(live, {}, "every stream closed")
    finally:
        if late is not None:
            live.fleet.stop_proc(late)
    assert late is not None and late.popen.returncode is not None


async def test_prefill_gauges_are_no_oracle_once_every_request_has_its_first_token(
    live: LiveFleet,
) -> None:
    """Six cold 23-token prompts (one block and seven tokens: nothing cached, so each
    AddRequest's initial_effective_prefill_tokens is exactly 23), held open until each has the
    worker's Mark (its first token). Every request is then past prefill, yet in every run we
    made the frontends' prefill gauges were neither zero nor equal to each other: a replica
    keeps some requests' tokens until their Free, which ones varying from run to run (see
    README.md), so none of that is asserted. What holds every time: a frontend shows at most
    the tokens of the requests in flight on each rank, a whole number of requests' worth, a
    rank with nothing in flight shows nothing, and after the drain every gauge is zero. So the
    live suite compares seqstate's prefill with the Marks, never with these gauges."""
    f1, f2 = live.frontends
    tag = 3_000_000
    rids = ids(6)
    specs = [
        (rid, (f1 if i % 2 == 0 else f2).http_port, block(tag + i) + "1234567", HELD)
        for i, rid in enumerate(rids)
    ]
    streams = await open_streams(specs)
    try:
        adds = await added(live, rids)
        await worker_marked(live, rids)
        upper: dict[tuple[int, int], int] = {}
        for add in adds.values():
            hint = add.add.prefill_load_hint
            assert hint is not None and hint.initial_effective_prefill_tokens == 23
            assert hint.expected_prefill_duration is None
            upper[add.rank] = upper.get(add.rank, 0) + 23
        await all_show(live, unique_blocks(adds.values()), "6 streams in flight")
        for front in (f1, f2):
            shown = nonzero((await scrape(front.http_port)).prefill)
            assert set(shown) <= set(upper), (shown, upper)
            assert all(0 < shown[r] <= upper[r] and shown[r] % 23 == 0 for r in shown), shown
        own = {f.router_id: 0 for f in (f1, f2)}
        for add in adds.values():
            own[add.event.router_id] += 1
        assert own == {f1.router_id: 3, f2.router_id: 3}
    finally:
        await close_all(streams)
    await eventually(
        lambda: views(live),
        lambda vs: all(not any(v.prefill.values()) and not any(v.decode.values()) for v in vs),
        what="zero prefill and decode everywhere after the drain",
        watch=live.fleet.tails,
    )
