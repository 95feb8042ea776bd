"""projector.Scheduler on a real pipeline: a burst decided at once spreads over the ranks, a
booking counts from the call on and exactly once after the view shows it, replicas see each
other's bookings before their views do, and nothing is left at the end."""

from __future__ import annotations

import asyncio
import logging
import random

import pytest
from eventually import eventually
from nats.aio.client import Client
from pipeline_kit import fresh_config

from projector import (
    EventTooLarge,
    RegistryView,
    Scheduler,
    WorkerControl,
)
from projector.nats.resources import ensure
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.schedule.scheduler import (
    DuplicateRequest,
    NoCandidates,
    UnknownRequest,
)
from projector.settings.config import Config
from seqstate import AddRequest

BLOCK = 16
RANKS = [(w, 0) for w in range(1, 9)]


def prompt(n: int, blocks: int = 8) -> list[int]:
    """A prompt of its own (no prefix shared with another ``n``)."""
    return [n * 1000 + i for i in range(blocks)]


async def registered(nc: Client, config: Config) -> None:
    control = WorkerControl(nc, config=config)
    for worker_id, _ in RANKS:
        await control.add(worker_id)


def row_of(rows: list, rank: tuple[int, int]):  # type: ignore[no-untyped-def]
    (row,) = [r for r in rows if (r.worker_id, r.dp_rank) == rank]
    return row


async def test_a_burst_decided_at_once_spreads_over_every_rank(nc: Client) -> None:
    config = fresh_config("sb")
    await ensure(nc, config)
    async with Pipeline(nc, config):
        await registered(nc, config)
        async with Scheduler(
            nc, namespace=config.namespace, config=config, router_id="sched-a", block_size=BLOCK
        ) as sched:
            await sched.view.wait_for(0)
            chosen = []
            adds = []
            for n in range(len(RANKS)):  # nothing awaited between decisions: one burst
                hashes = prompt(n)
                worker_id, dp_rank = sched.choose(hashes, isl_tokens=len(hashes) * BLOCK)
                chosen.append((worker_id, dp_rank))
                adds.append(
                    asyncio.ensure_future(
                        sched.add(
                            f"req-{n}",
                            worker_id=worker_id,
                            dp_rank=dp_rank,
                            block_hashes=hashes,
                            prefill_tokens=len(hashes) * BLOCK,
                        )
                    )
                )
                await asyncio.sleep(0)  # the add runs up to its publish: counted from here
            assert sorted(chosen) == RANKS  # one each, where the view alone shows none
            seqs = await asyncio.gather(*adds)
            # Once the view shows them, each counts once: the view's rows and the scheduler's
            # are the same.
            await sched.view.wait_for(max(seqs))
            assert sched.pending == 0
            query = prompt(99)
            assert sched.costs(query, 128) == sched.view.costs(query, 128, block_size=BLOCK)
            assert {r.active_requests for r in sched.view.loads()} == {1}
            for n in range(len(RANKS)):
                await sched.mark_prefill_completed(f"req-{n}")
                last = await sched.free(f"req-{n}")
            await sched.view.wait_for(last)
            assert sched.pending == 0 and sched.booked == 0
            assert all(
                (r.active_blocks, r.active_requests, r.active_prefill_tokens) == (0, 0, 0)
                for r in sched.view.loads()
            )


async def test_a_booking_counts_from_the_call_and_once_after_the_view_shows_it(
    nc: Client,
) -> None:
    config = fresh_config("sc")
    await ensure(nc, config)
    async with Pipeline(nc, config):
        await registered(nc, config)
        async with Scheduler(
            nc, config=config, router_id="sched-a", block_size=BLOCK, peers=False
        ) as sched:
            hashes = prompt(1)
            rank = (3, 0)
            seen: list[int] = []

            def requests_on_rank() -> int:
                return row_of(sched.costs(hashes, 128), rank).active_requests

            add = asyncio.ensure_future(
                sched.add("req-1", worker_id=3, block_hashes=hashes, prefill_tokens=100)
            )
            await asyncio.sleep(0)
            assert not add.done() and requests_on_rank() == 1  # before its ack
            row = row_of(sched.costs(hashes, 128), rank)
            assert (row.active_overlap_blocks, row.potential_decode_blocks) == (8, 8)
            assert row.potential_prefill_tokens == 100 + 128
            seq = await add

            def moved() -> int:
                seen.append(requests_on_rank())
                return sched.view.applied_seq

            await eventually(moved, lambda s: s >= seq, what="the view shows the add")
            assert set(seen) == {1}  # never twice, never lost
            shown = sched.view.costs(hashes, 128, block_size=BLOCK)
            assert row_of(shown, rank).active_requests == 1
            await sched.free("req-1")
            assert requests_on_rank() == 0  # at once


async def test_replicas_see_each_others_bookings_before_their_views_do(nc: Client) -> None:
    config = fresh_config("sp")
    await ensure(nc, config)
    async with Pipeline(nc, config):
        await registered(nc, config)
        async with (
            Scheduler(nc, config=config, router_id="a", block_size=BLOCK) as a,
            Scheduler(nc, config=config, router_id="b", block_size=BLOCK) as b,
        ):
            assert a.following and b.following
            hashes = prompt(7)
            seen: list[int] = []
            seq = await a.add("req-a", worker_id=5, block_hashes=hashes, prefill_tokens=64)

            def counted_by_b() -> int:
                n = row_of(b.costs(hashes, 128), (5, 0)).active_requests
                seen.append(n)
                return n

            await eventually(counted_by_b, lambda n: n == 1, what="b counts a's booking")
            await eventually(lambda: b.view.applied_seq, lambda s: s >= seq, what="b's view")
            assert counted_by_b() == 1 and b.pending == 0
            assert set(seen) <= {0, 1}  # never counted twice on the way
            assert b.peer_events >= 1
            # b hears a peer, so it prefers its share of the ranks (replicas deciding at the
            # same instant do not pile onto the same ones); a heard nobody: every rank alike.
            assert (a.share(), b.share()) == (None, (2, 1))
            await a.free("req-a")


async def test_what_cannot_be_booked_is_refused_with_a_reason(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    config = fresh_config("sr")
    await ensure(nc, config)
    async with Pipeline(nc, config):
        async with Scheduler(
            nc, config=config, router_id="a", block_size=BLOCK, peers=False
        ) as sched:
            with pytest.raises(NoCandidates, match="no rank to choose from"):
                sched.choose(prompt(1), 128)
        await registered(nc, config)
        async with Scheduler(nc, config=config, router_id="a", peers=False) as sched:
            # No block size registered nor given: Dynamo's default, said once.
            with caplog.at_level(logging.WARNING, logger="seqstate.scheduler"):
                sched.choose(prompt(1), 128)
                sched.choose(prompt(1), 128)
            said = [r.getMessage() for r in caplog.records if "block size" in r.getMessage()]
            assert len(said) == 1 and "16 tokens" in said[0]
            (row,) = sched.costs(prompt(1), 128, [(1, 0)])
            assert row.prefill_blocks == 128 / 16
        async with Scheduler(
            nc, config=config, router_id="a", block_size=BLOCK, peers=False
        ) as sched:
            with pytest.raises(UnknownRequest, match="req-x"):
                await sched.free("req-x")
            await sched.add("req-1", worker_id=1, block_hashes=prompt(1))
            with pytest.raises(DuplicateRequest, match="req-1"):
                await sched.add("req-1", worker_id=2, block_hashes=prompt(1))
            before = sched.costs(prompt(2), 128)
            with pytest.raises(EventTooLarge):
                await sched.add("req-big", worker_id=2, block_hashes=list(range(10**6)))
            assert sched.costs(prompt(2), 128) == before  # not counted: never sent
            assert sched.booked == 1
            # A candidate the view does not know yet counts as idle.
            assert sched.choose(prompt(3), 128, candidates=[(42, 0)]) == (42, 0)


async def test_the_readme_example_runs_as_written(nc: Client) -> None:
    config = fresh_config("sx")
    await ensure(nc, config)
    async with Pipeline(nc, config):
        control = WorkerControl(nc, config=config)
        for worker_id in (1, 2):
            await control.add(worker_id, block_size=16)
        block_hashes = prompt(1, 94)
        async with Scheduler(
            nc, namespace=config.namespace, router_id="sched-a", config=config
        ) as sched:
            worker_id, dp_rank = sched.choose(block_hashes, isl_tokens=1500)
            await sched.add(
                "req-1",
                worker_id=worker_id,
                dp_rank=dp_rank,
                block_hashes=block_hashes,
                prefill_tokens=1500,
            )
            await sched.mark_prefill_completed("req-1")
            last = await sched.free("req-1")
            await sched.view.wait_for(last)
        async with RegistryView(nc, config=config) as view:
            assert {(r.active_blocks, r.active_requests) for r in view.loads()} == {(0, 0)}


async def test_every_booking_counts_where_it_was_made_under_load(nc: Client) -> None:
    """Two schedulers book and free at once on three ranks, prompts sharing prefixes: after
    each add, the scheduler that made it counts the whole prompt as active on its rank, while
    its view catches up with its own and the other's events in between."""
    config = fresh_config("sl")
    await ensure(nc, config)
    rng = random.Random(5)
    unseen: list[str] = []
    async with Pipeline(nc, config):
        control = WorkerControl(nc, config=config)
        for worker_id in (1, 2, 3):
            await control.add(worker_id, block_size=BLOCK)
        async with (
            Scheduler(nc, config=config, router_id="a", seed=1) as a,
            Scheduler(nc, config=config, router_id="b", seed=2) as b,
        ):

            async def lifecycle(i: int) -> None:
                sched = a if i % 2 else b
                branch = rng.randrange(1, 4) * 100  # chained: a block's hash names its prefix
                hashes = [1, 2, branch, branch + 1, branch + 2]
                rank = sched.choose(hashes, 80)
                await sched.add(f"r{i}", worker_id=rank[0], block_hashes=hashes, prefill_tokens=80)
                (row,) = sched.costs(hashes, 80, [rank])
                if row.active_overlap_blocks != len(hashes):
                    unseen.append(f"r{i}: {row.active_overlap_blocks} of {len(hashes)}")
                await asyncio.sleep(rng.random() * 0.02)
                if rng.random() < 0.5:
                    await sched.mark_prefill_completed(f"r{i}")
                await asyncio.sleep(rng.random() * 0.02)
                await sched.free(f"r{i}")

            tasks = []
            for i in range(1500):
                tasks.append(asyncio.ensure_future(lifecycle(i)))
                if i % 4 == 0:
                    await asyncio.sleep(0.001)
            await asyncio.gather(*tasks)
            last = max(a.publisher.last_sequence or 0, b.publisher.last_sequence or 0)
            for sched in (a, b):
                await sched.view.wait_for(last, timeout=30)
                assert (sched.pending, sched.booked) == (0, 0)
                assert {(r.active_blocks, r.active_requests) for r in sched.view.loads()} == {
                    (0, 0)
                }
    assert unseen == []


async def test_a_replica_counts_each_event_of_a_peers_record_batch(nc: Client) -> None:
    """A peer's ``publish_many`` with ``batch_events``: one stored message of two bookings.
    With no writer running the view never moves, so only the peer feed can count them: each
    event of the batch is counted, once."""
    config = fresh_config("sb")
    await ensure(nc, config)
    async with Pipeline(nc, config) as pipeline:
        await registered(nc, config)
        last = await WorkerControl(nc, config=config).add(9)
        await pipeline.wait_applied(last.seq)
    async with Scheduler(nc, config=config, router_id="b", block_size=BLOCK) as b:
        assert b.following
        hashes = prompt(3)
        peer = RouterPublisher(nc, router_id="c", config=config, batch_events=64)
        seqs = await peer.publish_many(
            [
                AddRequest("c1", 5, block_hashes=hashes, prefill_tokens=32, router_id="c"),
                AddRequest("c2", 5, block_hashes=hashes, prefill_tokens=32, router_id="c"),
            ]
        )
        assert seqs[0] == seqs[1] > b.view.applied_seq

        def counted() -> int:
            return row_of(b.costs(hashes, 128), (5, 0)).active_requests

        await eventually(counted, lambda n: n == 2, what="b counts both bookings")
        assert b.peer_events == 2 and b.view.applied_seq < seqs[0]
