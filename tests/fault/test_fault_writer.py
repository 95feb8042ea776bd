"""The writer is SIGKILLed at random points of a publishing run, restarted each time,
and ends with the very snapshot (and the very deltas) of one uninterrupted fold of the log."""

from __future__ import annotations

import collections
import itertools
from pathlib import Path

import pytest
from eventually import eventually
from fault_kit import (
    BUSY,
    Service,
    delta_source_seq,
    fault_config,
    kill_schedule,
    read_stream,
    run_with_kills,
    workload,
)
from nats.aio.client import Client
from pipeline_kit import read_log

from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.snapshots import SnapshotStore
from projector.nats.stream import last_seq_of
from projector.wire.headers import SOURCE_SEQ
from seqstate import (
    EventDecodeError,
    SnapshotError,
    decode_deltas,
    decode_event,
    encode_deltas,
)

KILLS = 4


@pytest.mark.parametrize("seed", [11, 12, 13])
async def test_a_writer_killed_at_random_points_ends_as_one_uninterrupted_fold(
    nc: Client, nats_server: NatsServer, tmp_path: Path, seed: int
) -> None:
    config = fault_config("w", snapshot_every_events=50, expiry_s=2.0, idle_tick_s=3600.0)
    await ensure(nc, config)
    js = nc.jetstream()
    steps = workload(seed, config, requests=800)
    writer = Service("writer", config, nats_server.url, tmp_path)

    store = await SnapshotStore(nc, config).open()

    async def progress() -> int:
        return await delta_source_seq(js, config)

    async def snapshot_seq() -> int:
        kept = await store.list()
        return kept[-1].applied_seq if kept else 0

    schedule = kill_schedule(seed, len(steps), KILLS)
    try:
        # A late kill waits for a snapshot of more than the writer had published at the kill
        # point: the next run restores it.
        last = await run_with_kills(
            nc,
            config,
            steps,
            writer,
            schedule,
            progress=progress,
            late_probe=snapshot_seq,
            late_target=progress,
            router_id=f"fault-w{seed}",
        )
        assert await last_seq_of(js, config.events_stream, config.events_subjects) == last
        await writer.wait_ready(js)
        await eventually(
            progress,
            lambda seq: seq >= last,
            what="the last writer caught up",
            retry_on=BUSY,
            watch=writer.logs,
            check=writer.check,
        )
        code = await writer.stop()
        assert code == 0, f"writer exited with {code} on SIGTERM\n{writer.logs()}"
    finally:
        writer.close()
    assert writer.kills == KILLS

    # The reference: one uninterrupted fold of the whole log, at the writer's log times.
    log = await read_log(nc, config)
    assert [seq for seq, _, _ in log] == list(range(1, last + 1))
    reference = config.new_state()
    expected_deltas: list[bytes] = []
    decodable: list[int] = []
    kept = {info.applied_seq: info for info in await store.list()}
    reference_at: dict[int, bytes] = {}
    for seq, at_ns, data in log:
        try:
            event = decode_event(data)
        except EventDecodeError:
            pass
        else:
            delta = reference.apply(event, at_ns)
            delta.seq = seq
            expected_deltas.append(encode_deltas([delta]))
            decodable.append(seq)
        if seq in kept:
            reference_at[seq] = reference.snapshot()
    assert len(log) - len(decodable) == sum(step.event is None for step in steps)

    # Every source position is on the DELTAS stream exactly once, as the reference folded it.
    batches = await read_stream(nc, config.deltas_stream, config.deltas_subject)
    published = []
    for delta_seq, headers, data in batches:
        deltas = decode_deltas(data)
        assert deltas, f"delta message {delta_seq} is empty"
        assert headers.get(SOURCE_SEQ) == str(deltas[-1].seq), f"delta message {delta_seq}"
        published.extend(deltas)
    seqs = [delta.seq for delta in published]
    twice = sorted(seq for seq, n in collections.Counter(seqs).items() if n > 1)
    assert not twice, f"source positions published more than once: {twice[:20]}"
    assert all(a < b for a, b in itertools.pairwise(seqs)), "deltas out of order"
    missing = sorted(set(decodable) - set(seqs))
    assert not missing, f"source positions with no delta: {missing[:20]}"
    assert seqs == decodable
    assert [encode_deltas([delta]) for delta in published] == expected_deltas

    # Every kept snapshot that loads is the uninterrupted fold at its position (a restart from
    # any of them rebuilds the reference).
    loaded = 0
    for seq, info in sorted(kept.items()):
        try:
            state = await store.load(info)
        except SnapshotError:
            continue  # an interrupted save: newest_valid skips it, with its reason
        assert state.snapshot() == reference_at[seq], f"snapshot {info.name} differs"
        loaded += 1
    assert loaded, f"no kept snapshot loads: {sorted(kept)}"

    # The clean stop took a final snapshot: the newest is the whole log, byte for byte.
    newest = await store.newest_valid()
    assert newest is not None
    state, info = newest
    assert info.applied_seq == last, (
        f"newest snapshot {info.name} is at event {info.applied_seq}, the log ends at {last}: "
        f"the SIGTERM stop took no final snapshot\n{writer.logs()}"
    )
    assert state.snapshot() == reference.snapshot()
