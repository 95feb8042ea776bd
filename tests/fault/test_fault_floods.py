"""Floods on real writer and projector processes: more Frees of ids never
added, and more ended ids, than the writer's id memories hold; more workers than the rank
bounds admit. The writer must go on, hold no more than its bounds, refuse (dead-letter, with
the reason) what is beyond them, and end with the snapshot and bucket of one uninterrupted fold
of the log.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from fault_kit import (
    Service,
    bucket_values,
    fault_config,
    read_log,
    read_stream,
    uninterrupted_fold,
    wait_current,
)
from nats.aio.client import Client

from projector.nats.resources import dead_letter_stream, ensure
from projector.nats.server import NatsServer
from projector.nats.snapshots import SnapshotStore
from projector.route.publisher import RouterPublisher
from projector.settings.config import Config
from projector.wire.headers import REASON, SOURCE_SEQ
from projector.wire.values import load_key, position_key
from seqstate import (
    AddRequest,
    Event,
    Free,
    MarkPrefillCompleted,
    SequenceState,
    WorkerAdded,
    WorkerRemoved,
    decode_event,
)
from seqstate.bounds import MAX_RANKS, MAX_RANKS_PER_WORKER

BATCH = 4096  # events per publish_many call


async def _run(
    nc: Client, url: str, config: Config, tmp_path: Path, events: Sequence[Event]
) -> tuple[SequenceState, list[int]]:
    """Publish ``events`` in order while a writer and a projector process run; wait until
    both have handled the last, stop them cleanly. The writer's final snapshot, restored, and
    the stream sequence of each event."""
    js = nc.jetstream()
    writer = Service("writer", config, url, tmp_path)
    projector = Service("projector", config, url, tmp_path)
    services = [writer, projector]
    try:
        for service in services:
            await service.start(js, 0)
            await service.wait_ready(js)
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="flood", config=config)
        seqs: list[int] = []
        for start in range(0, len(events), BATCH):
            seqs += await pub.publish_many(events[start : start + BATCH])
        assert seqs == sorted(seqs), "the events were not stored in the order given"
        last = seqs[-1]  # an event the writer applies: it makes a delta

        await wait_current(js, writer, projector, last, interval=0.05)
        for service in services:
            code = await service.stop()
            assert code == 0, f"{service.command} exited with {code}\n{service.logs()}"
    finally:
        for service in services:
            service.close()
    store = await SnapshotStore(nc, config).open()
    newest = (await store.list())[-1]
    assert newest.applied_seq == last, "the clean stop took no final snapshot"
    return SequenceState.restore(await store.fetch(newest.name)), seqs


async def _same_as_one_fold(
    nc: Client, config: Config, state: SequenceState, last: int
) -> dict[str, bytes]:
    """Assert the writer's state and the bucket are those of one uninterrupted fold of the
    log; the bucket's keys and values (the position aside)."""
    snapshot, values, logged = await uninterrupted_fold(nc, config)
    assert logged == last
    assert state.snapshot() == snapshot
    got = await bucket_values(nc, config)
    assert got.pop(position_key(config.namespace))
    assert got == values
    return got


async def test_floods_of_unknown_frees_and_ended_ids_keep_the_id_memories_bounded(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Broke: nothing; guards the bounds, through the new --max-tombstones and --max-ended
    settings (their defaults, 100,000 and 250,000, take a flood the writer folds in about 30 s
    here). 3,000 Frees of ids never added into a tombstone memory of 2,000, then 1,500
    requests booked and freed into an ended-id memory of 1,000, between real requests.
    Expected: the writer folds them all and holds exactly its capacities, the newest ids,
    having evicted and counted the oldest; an Add of an evicted tombstone's id is booked, one
    of a remembered id is superseded; a Free of a remembered ended id is a no-op, one of a
    forgotten id leaves a tombstone; the requests around the floods fold as without them;
    snapshot and bucket equal one uninterrupted fold."""
    config = fault_config("tf", max_tombstones=2_000, max_ended=1_000, idle_tick_s=3600.0)
    await ensure(nc, config)
    events: list[Event] = [
        WorkerAdded(worker_id=1, dp_size=2),
        AddRequest(request_id="before", worker_id=1, block_hashes=[1, 2], prefill_tokens=64),
    ]
    events += [Free(request_id=f"g{i}", worker_id=1, dp_rank=i % 2) for i in range(3_000)]
    for i in range(1_500):
        events += [
            AddRequest(request_id=f"e{i}", worker_id=1, dp_rank=i % 2, block_hashes=[i]),
            Free(request_id=f"e{i}", worker_id=1, dp_rank=i % 2),
        ]
    events += [
        AddRequest(request_id="g0", worker_id=1, block_hashes=[3]),  # its tombstone evicted
        AddRequest(request_id="g2999", worker_id=1, block_hashes=[4]),  # remembered: superseded
        Free(request_id="e1499", worker_id=1, dp_rank=1),  # remembered as ended: a no-op
        Free(request_id="e0", worker_id=1),  # forgotten: a tombstone
        Free(request_id="before", worker_id=1),
        AddRequest(
            request_id="after", worker_id=1, dp_rank=1, block_hashes=[5, 6], prefill_tokens=32
        ),
        MarkPrefillCompleted(request_id="after", worker_id=1, dp_rank=1),
    ]
    state, seqs = await _run(nc, nats_server.url, config, tmp_path, events)
    tombstones = [rid for rid, _, _ in state.tombstones.items()]
    assert tombstones == [*(f"g{i}" for i in range(1_000, 2_999)), "e0"]
    assert state.tombstones.evicted == 1_000
    ended = [rid for rid, _, _ in state.ended.items()]  # g2999 and "before" evicted two more
    assert ended == [*(f"e{i}" for i in range(502, 1_500)), "g2999", "before"]
    assert state.ended.evicted == 502
    assert state.counters["tombstoned"] == 3_001
    assert state.counters["unknown_request"] == 3_002
    assert state.counters["superseded"] == 1
    assert {rid: state.requests.worker_for(rid) for rid in state.requests.owner} == {
        "g0": (1, 0),
        "after": (1, 1),
    }
    assert [
        (row.active_requests, row.active_blocks, row.active_prefill_tokens)
        for row in state.registry.loads(state.now_ns)
    ] == [(1, 1, 0), (1, 2, 0)]
    await _same_as_one_fold(nc, config, state, seqs[-1])


async def test_workers_beyond_the_default_rank_bounds_are_dead_lettered_and_change_nothing(
    nc: Client, nats_server: NatsServer, tmp_path: Path
) -> None:
    """Broke: nothing failed, but it showed each WorkerAdded or WorkerRemoved copying the whole
    rank table (and a WorkerRemoved of an unknown worker scanning it), so filling the table
    cost time quadratic in its size; now each costs what its worker has. Guards the bounds at
    their defaults (16,384 ranks, 1,024 per worker), end to end: 8 workers of 1,024 ranks and
    8,192 workers of one fill the table to the bound; then 100 new workers, a widened worker,
    a second rank for a one-rank worker and requests that would create lazy ranks ask for
    more. Expected: each of those is dead-lettered with its bound, the writer goes on, a
    request on a registered rank is booked, a removal makes room for exactly one more worker;
    the writer's state is the fold of every other event (without any bound check), and the
    bucket holds the 16,384 ranks of one uninterrupted fold."""
    config = fault_config("tw", idle_tick_s=3600.0)
    await ensure(nc, config)
    wide = MAX_RANKS // 2 // MAX_RANKS_PER_WORKER  # workers 0..7 with 1,024 ranks each
    narrow = MAX_RANKS - wide * MAX_RANKS_PER_WORKER  # workers 10,000.. with one rank each
    total = (
        f"the write model would hold {MAX_RANKS + 1} ranks, over the bound of "
        f"{MAX_RANKS} (max_ranks)"
    )

    def per_worker(worker: int) -> str:
        return (
            f"worker {worker} would have {MAX_RANKS_PER_WORKER + 1} ranks, over the bound "
            f"of {MAX_RANKS_PER_WORKER} per worker (max_ranks_per_worker)"
        )

    events: list[Event] = [
        WorkerAdded(worker_id=w, dp_size=MAX_RANKS_PER_WORKER) for w in range(wide)
    ]
    events += [WorkerAdded(worker_id=10_000 + w) for w in range(narrow)]
    refused: dict[int, str] = {}  # index in events -> the reason expected

    def beyond(event: Event, reason: str) -> None:
        refused[len(events)] = f"refused: {reason}"
        events.append(event)

    for w in range(100):
        beyond(WorkerAdded(worker_id=50_000 + w), total)
    beyond(WorkerAdded(worker_id=0, dp_size=MAX_RANKS_PER_WORKER + 1), per_worker(0))
    beyond(WorkerAdded(worker_id=10_000, dp_size=2), total)
    beyond(AddRequest(request_id="lazy", worker_id=60_000, block_hashes=[1]), total)
    beyond(
        AddRequest(request_id="lazy-rank", worker_id=3, dp_rank=MAX_RANKS_PER_WORKER), per_worker(3)
    )
    top = MAX_RANKS_PER_WORKER - 1  # a registered rank: a request on it is booked
    events.append(AddRequest(request_id="in", worker_id=7, dp_rank=top, block_hashes=[7, 8]))
    events.append(WorkerRemoved(worker_id=10_001))
    events.append(WorkerAdded(worker_id=50_000))  # the room the removal made
    beyond(WorkerAdded(worker_id=50_001), total)
    events.append(AddRequest(request_id="last", worker_id=50_000))  # a delta to wait for
    state, seqs = await _run(nc, nats_server.url, config, tmp_path, events)

    js = nc.jetstream()
    letters = await read_stream(nc, dead_letter_stream(config), config.dead_letter_subject)
    assert [(int(headers[SOURCE_SEQ]), headers[REASON]) for _, headers, _ in letters] == [
        (seqs[i], reason) for i, reason in refused.items()
    ]
    assert (await js.stream_info(dead_letter_stream(config))).state.messages == len(refused)
    # What the writer holds is the fold of every event not dead-lettered, bounds unchecked.
    skipped = {seqs[i] for i in refused}
    reference = config.new_state()
    for seq, at_ns, data in await read_log(nc, config):
        if seq not in skipped:
            reference.apply(decode_event(data), at_ns)
    assert state.snapshot() == reference.snapshot()
    assert len(state.workers.slots) == MAX_RANKS
    assert list(state.requests.owner) == ["in", "last"]
    bucket = await _same_as_one_fold(nc, config, state, seqs[-1])
    ranks = {(w, r) for w in range(wide) for r in range(MAX_RANKS_PER_WORKER)}
    ranks |= {(10_000 + w, 0) for w in range(narrow) if w != 1} | {(50_000, 0)}
    loads = {key for key in bucket if ".load." in key}
    assert loads == {load_key(config.namespace, rank) for rank in ranks}
