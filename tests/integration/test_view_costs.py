"""Dynamo's cost read through the whole pipeline: RouterPublisher → writer → projector →
RegistryView, on a real nats-server.

The view's cost and overlap rows must equal the core's over the same log, folded in process
at the same log times; the block size comes from the namespace's registered workers, and a
cost asked of a namespace that registered none says what to do.
"""

from __future__ import annotations

import pytest
from nats.aio.client import Client
from pipeline_kit import folded, fresh_config, read_events

from projector import BlockSizeUnknown, CostRow, CostWeights, SeqstateError
from projector.bucket.reader import RegistryView
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from projector.settings.config import Config
from projector.wire.values import load_key
from seqstate import OverlapRow, SequenceState, WorkerAdded

MS = 1_000_000
PREFIX = [101, 102, 103, 104]
QUERIES = [[*PREFIX, 1], [*PREFIX, 2, 3, 4], PREFIX[:1], [900, 901], [], [42, 43]]
WEIGHTS = [
    None,
    CostWeights(prefill_load_scale=2.0),
    CostWeights(overlap_score_credit=0.5, decode_active_request_weight=3.0),
    CostWeights(track_prefill_tokens=False),
]


async def lifecycle(pub: RouterPublisher, block_size: int | None) -> int:
    """Shared prefixes, modeled and unmodeled prefills, a mark and a free; the last sequence."""
    await pub.publish(WorkerAdded(worker_id=1, dp_size=2, block_size=block_size))
    await pub.publish(WorkerAdded(worker_id=2, block_size=block_size))
    await pub.add("r1", 1, 0, [*PREFIX, 1], prefill_tokens=500, expected_prefill_ms=40.0)
    await pub.add("r2", 1, 1, [*PREFIX, 2, 3], prefill_tokens=700)
    await pub.add("r3", 2, 0, PREFIX[:2], prefill_tokens=300, expected_prefill_ms=5000.0)
    await pub.add("r5", 2, 0, [*PREFIX, 8], prefill_tokens=1000, expected_prefill_ms=2000.0)
    await pub.mark_prefill_completed("r1", 1, 0)
    await pub.free("r2", 1, 1)
    return await pub.add("r6", 1, 1, [*PREFIX, 2], prefill_tokens=123)


async def reference(nc: Client, config: Config) -> tuple[SequenceState, int]:
    log = await read_events(nc, config)
    return folded(config, log), log[-1][1]


async def test_the_views_costs_equal_the_cores_over_the_same_log(nc: Client) -> None:
    config = fresh_config("c")
    async with Pipeline(nc, config):
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-c", config=config)
        last = await lifecycle(pub, None)
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(last, timeout=10)
            state, last_ns = await reference(nc, config)
            registry = state.registry
            for offset_ms in (0, 7, 40, 1999, 6000):
                now = last_ns + offset_ms * MS
                for query in QUERIES:
                    for weights in WEIGHTS:
                        got = view.costs(query, 1500, block_size=16, weights=weights, now_ns=now)
                        want = registry.costs(query, 1500, now, 16, weights or CostWeights())
                        assert got == want
                    assert view.costs(
                        query, 64, [(2, 0), (1, 1)], block_size=32, overlaps={(2, 0): 3}, now_ns=now
                    ) == registry.costs(
                        query, 64, now, 32, CostWeights(), [(2, 0), (1, 1)], {(2, 0): 3}
                    )
                    assert view.overlaps(query) == registry.overlaps(query)
            # By hand (rank (2, 0)'s modeled prefills decay with the log's real times): (1, 0)
            # holds r1's 5 blocks, marked: 80 tokens = 5 blocks less 4 cached, decode 5 + 5 - 4.
            # (1, 1) holds r6's 5 blocks, 123 tokens unmodeled: 203 / 16 - 5, decode 5 + 5 - 5.
            rows = view.costs([*PREFIX, 2], 80, block_size=16, now_ns=last_ns + 9000 * MS)
            assert rows[:2] == [
                CostRow(1, 0, 1.0 + 6, 4, 4, 1.0, 80, 6, 1),
                CostRow(1, 1, 7.6875 + 5, 5, 5, 7.6875, 203, 5, 1),
            ]
            # No worker registered a block size: the cost cannot be in blocks of anything.
            assert view.block_size is None
            with pytest.raises(BlockSizeUnknown) as raised:
                view.costs(PREFIX, 64)
            assert isinstance(raised.value, SeqstateError) and isinstance(raised.value, ValueError)
            assert str(raised.value) == (
                f"namespace {config.namespace!r} has no registered block size: "
                "pass block_size= or register workers with one"
            )


async def test_the_block_size_the_workers_registered_is_the_default(nc: Client) -> None:
    config = fresh_config("c", rules="slot-tracker")
    async with Pipeline(nc, config):
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-c", config=config)
        last = await lifecycle(pub, 16)
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(last, timeout=10)
            state, last_ns = await reference(nc, config)
            assert view.block_size == 16
            for query in QUERIES:
                assert view.costs(query, 300, now_ns=last_ns) == state.registry.costs(
                    query, 300, last_ns, 16
                )


async def test_a_rank_whose_load_value_does_not_decode_has_no_cost_or_overlap_row(
    nc: Client,
) -> None:
    """Unknown is not idle: a rank the view cannot read would be the cheapest of all."""
    config = fresh_config("c")
    async with Pipeline(nc, config) as pipeline:
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="r-c", config=config)
        await pub.add("a", 4, 0, [1, 2, 3], prefill_tokens=100)
        last = await pub.add("b", 5, 0, [9], prefill_tokens=10)
        await pipeline.wait_applied(last)
    kv = await nc.jetstream().key_value(config.registry_bucket)
    await kv.put(load_key(config.namespace, (4, 0)), b'{"active_blocks": "many"}')
    async with RegistryView(nc, config=config) as view:
        assert list(view.unreadable) == [(4, 0)]
        assert view.overlaps([1, 2, 3]) == [OverlapRow(5, 0, 0)]
        # (5, 0): 10 unmodeled tokens + 48 = 3.625 blocks, nothing cached; decode 1 + 3.
        assert view.costs([1, 2, 3], 48, block_size=16) == [
            CostRow(5, 0, 3.625 + 4, 0, 0, 3.625, 58, 4, 1)
        ]
