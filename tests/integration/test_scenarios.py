"""One scenario suite, two backends: the in-process core, and the full pipeline over NATS.

In the manner of Watermill's conformance suite: each scenario publishes events through a
:class:`Backend` and asserts exact loads. The ``core`` backend folds with ``SequenceState`` at
times it chooses; the ``nats`` backend goes RouterPublisher → SEQSTATE_EVENTS → writer →
SEQSTATE_DELTAS → projector → bucket → RegistryView, with times set by the log. Scenarios
therefore read decay relative to the log time of the event that matters (``backend.at(seq)``),
which makes the same numbers exact on both.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol

import nats
import pytest
from nats.aio.client import Client
from pipeline_kit import fresh_config, read_log

from projector.bucket.reader import RegistryView
from projector.nats.server import NatsServer
from projector.route.publisher import RouterPublisher
from projector.run.pipeline import Pipeline
from seqstate import (
    AddRequest,
    Event,
    Free,
    LoadRow,
    MarkPrefillCompleted,
    PotentialLoadRow,
    SequenceState,
    WorkerAdded,
    WorkerRemoved,
)

MS = 1_000_000


class Backend(Protocol):
    async def publish(self, *events: Event) -> int: ...  # the sequence of the last one
    async def settle(self) -> None: ...  # until every published event is readable
    async def at(self, seq: int) -> int: ...  # the log time the event was applied at
    def loads(self, now_ns: int) -> list[LoadRow]: ...
    def potential_loads(
        self, hashes: Sequence[int], isl: int, now: int
    ) -> list[PotentialLoadRow]: ...
    def counters(self) -> dict[str, int]: ...


class CoreBackend:
    """SequenceState in process; event n is applied at 1 s + n ms."""

    def __init__(self) -> None:
        self.state = SequenceState(expiry_s=300.0)
        self.times: dict[int, int] = {}

    async def publish(self, *events: Event) -> int:
        for event in events:
            seq = len(self.times) + 1
            self.times[seq] = 1_000 * MS + seq * MS
            self.state.apply(event, self.times[seq])
        return len(self.times)

    async def settle(self) -> None:
        return None

    async def at(self, seq: int) -> int:
        return self.times[seq]

    def loads(self, now_ns: int) -> list[LoadRow]:
        return self.state.registry.loads(now_ns)

    def potential_loads(self, hashes: Sequence[int], isl: int, now: int) -> list[PotentialLoadRow]:
        return self.state.registry.potential_loads(hashes, isl, now)

    def counters(self) -> dict[str, int]:
        return dict(self.state.counters)


class NatsBackend:
    def __init__(self, nc: Client) -> None:
        self.nc = nc
        self.config = fresh_config("s")
        self.pipeline = Pipeline(nc, self.config)
        self.publisher = RouterPublisher(
            nc, namespace=self.config.namespace, router_id="scn", config=self.config
        )
        self.view = RegistryView(nc, config=self.config)
        self.last = 0
        self._times: dict[int, int] = {}

    async def start(self) -> None:
        await self.pipeline.start()
        await self.view.start()

    async def stop(self) -> None:
        await self.view.stop()
        await self.pipeline.stop()

    async def publish(self, *events: Event) -> int:
        for event in events:
            self.last = await self.publisher.publish(event)
        return self.last

    async def settle(self) -> None:
        await self.view.wait_for(self.last, timeout=10)

    async def at(self, seq: int) -> int:
        if seq not in self._times:
            self._times = {s: t for s, t, _ in await read_log(self.nc, self.config)}
        return self._times[seq]

    def loads(self, now_ns: int) -> list[LoadRow]:
        return self.view.loads(now_ns)

    def potential_loads(self, hashes: Sequence[int], isl: int, now: int) -> list[PotentialLoadRow]:
        return self.view.potential_loads(hashes, isl, now)

    def counters(self) -> dict[str, int]:
        return dict(self.pipeline.writer.state.counters)


# The core backend needs no server: its scenarios are ``core`` tests (the pure pass runs them),
# and the server is asked for only by the nats backend.
@pytest.fixture(params=[pytest.param("core", marks=pytest.mark.core), "nats"])
async def backend(request: pytest.FixtureRequest) -> AsyncIterator[Backend]:
    if request.param == "core":
        yield CoreBackend()
        return
    nats_server: NatsServer = request.getfixturevalue("nats_server")
    nc = await nats.connect(nats_server.url, max_reconnect_attempts=0)
    nats_backend = NatsBackend(nc)
    await nats_backend.start()
    try:
        yield nats_backend
    finally:
        await nats_backend.stop()
        await nc.drain()


def table(rows: Sequence[LoadRow]) -> list[tuple[int, int, int, int, int]]:
    return [
        (r.worker_id, r.dp_rank, r.active_requests, r.active_blocks, r.active_prefill_tokens)
        for r in rows
    ]


# ---- scenarios ---------------------------------------------------------------------------


async def test_lifecycle_of_one_request(backend: Backend) -> None:
    added = await backend.publish(
        AddRequest(request_id="a", worker_id=0, block_hashes=[1, 2, 3], prefill_tokens=300)
    )
    await backend.settle()
    t = await backend.at(added)
    assert table(backend.loads(t)) == [(0, 0, 1, 3, 300)]
    marked = await backend.publish(MarkPrefillCompleted(request_id="a", worker_id=0))
    await backend.settle()
    assert table(backend.loads(await backend.at(marked))) == [(0, 0, 1, 3, 0)]
    freed = await backend.publish(Free(request_id="a", worker_id=0))
    await backend.settle()
    assert table(backend.loads(await backend.at(freed))) == [(0, 0, 0, 0, 0)]


async def test_shared_prefix_blocks_count_once(backend: Backend) -> None:
    await backend.publish(
        AddRequest(request_id="a", worker_id=1, block_hashes=[10, 11, 12], prefill_tokens=30),
        AddRequest(request_id="b", worker_id=1, block_hashes=[10, 11, 13, 14], prefill_tokens=20),
    )
    last = await backend.publish(Free(request_id="a", worker_id=1))
    await backend.settle()
    assert table(backend.loads(await backend.at(last))) == [(1, 0, 1, 4, 20)]


async def test_prefill_decays_from_the_anchor_at_its_modeled_rate(backend: Backend) -> None:
    added = await backend.publish(
        AddRequest(request_id="p", worker_id=2, prefill_tokens=1000, expected_prefill_ms=100.0)
    )
    await backend.settle()
    t = await backend.at(added)
    for offset_ms, tokens, remaining_ms in [
        (0, 1000, 100),
        (25, 750, 75),
        (50, 500, 50),
        (99, 10, 1),
        (100, 0, 0),
        (5000, 0, 0),
    ]:
        (row,) = backend.loads(t + offset_ms * MS)
        assert (row.active_prefill_tokens, row.modeled_remaining_prefill_ms) == (
            tokens,
            remaining_ms,
        )


async def test_potential_loads_use_prefix_overlap_per_rank(backend: Backend) -> None:
    await backend.publish(
        WorkerAdded(worker_id=5, dp_size=2),
        AddRequest(request_id="x", worker_id=5, dp_rank=0, block_hashes=[1, 2, 3, 4]),
        AddRequest(request_id="y", worker_id=5, dp_rank=1, block_hashes=[1, 2, 9]),
    )
    last = await backend.publish(AddRequest(request_id="z", worker_id=6, block_hashes=[7]))
    await backend.settle()
    now = await backend.at(last)
    rows = backend.potential_loads([1, 2, 3, 8], 64, now)
    assert [
        (
            r.worker_id,
            r.dp_rank,
            r.potential_decode_blocks,
            r.potential_prefill_tokens,
            r.active_requests,
        )
        for r in rows
    ] == [
        (5, 0, 4 + 4 - 3, 64, 1),
        (5, 1, 3 + 4 - 2, 64, 1),
        (6, 0, 1 + 4 - 0, 64, 1),
    ]


async def test_a_free_that_overtakes_its_add_leaks_nothing(backend: Backend) -> None:
    await backend.publish(Free(request_id="early", worker_id=3))
    last = await backend.publish(
        AddRequest(request_id="early", worker_id=3, block_hashes=[5], prefill_tokens=99)
    )
    await backend.settle()
    # The superseded add is not booked, and books nothing, not even its rank.
    assert table(backend.loads(await backend.at(last))) == []
    assert backend.counters()["superseded"] == 1


async def test_duplicate_add_changes_nothing(backend: Backend) -> None:
    await backend.publish(
        AddRequest(request_id="d", worker_id=4, block_hashes=[1], prefill_tokens=7)
    )
    last = await backend.publish(
        AddRequest(request_id="d", worker_id=4, block_hashes=[1, 2, 3], prefill_tokens=70)
    )
    await backend.settle()
    assert table(backend.loads(await backend.at(last))) == [(4, 0, 1, 1, 7)]
    assert backend.counters()["duplicate"] == 1


async def test_removed_worker_takes_its_load_and_comes_back_empty(backend: Backend) -> None:
    await backend.publish(
        WorkerAdded(worker_id=8, dp_size=2),
        AddRequest(request_id="r", worker_id=8, dp_rank=1, block_hashes=[3, 4], prefill_tokens=5),
        AddRequest(request_id="s", worker_id=9, block_hashes=[3], prefill_tokens=5),
        WorkerRemoved(worker_id=8),
    )
    await backend.settle()
    last = await backend.publish(WorkerAdded(worker_id=8))
    await backend.settle()
    now = await backend.at(last)
    assert table(backend.loads(now)) == [(8, 0, 0, 0, 0), (9, 0, 1, 1, 5)]
    rows = backend.potential_loads([3, 4], 0, now)
    assert [(r.worker_id, r.potential_decode_blocks) for r in rows] == [(8, 2), (9, 2)]
    late = await backend.publish(Free(request_id="r", worker_id=8, dp_rank=1))
    await backend.settle()
    assert table(backend.loads(await backend.at(late))) == [(8, 0, 0, 0, 0), (9, 0, 1, 1, 5)]
    assert backend.counters()["unknown_request"] == 1


async def test_unmodeled_prefill_does_not_decay_and_spills_nothing(backend: Backend) -> None:
    await backend.publish(
        AddRequest(request_id="m", worker_id=0, prefill_tokens=400, expected_prefill_ms=10.0),
        AddRequest(request_id="u", worker_id=0, prefill_tokens=600),
    )
    await backend.settle()
    t = await backend.at(1)
    (row,) = backend.loads(t + 5 * MS)
    assert (row.active_prefill_tokens, row.modeled_remaining_prefill_ms) == (800, None)
    (row,) = backend.loads(t + 60_000 * MS)
    assert (row.active_prefill_tokens, row.modeled_remaining_prefill_ms) == (600, None)
