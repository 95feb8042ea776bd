"""Snapshots on a real server: restart from the newest valid one, skip damaged ones, trim safely."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client
from nats.js import api
from pipeline_kit import fresh_config, read_log

from projector.nats.resources import ensure
from projector.nats.snapshots import SnapshotStore
from projector.nats.stream import first_seq_of
from projector.route.publisher import RouterPublisher
from projector.run.assemble import build_writer
from projector.settings.config import Config
from projector.write.log_fold import ReplayError, replay
from projector.write.snapshotter import SnapshotUnavailable
from projector.write.writer import Writer
from seqstate import EventDecodeError, decode_event


def workload(prefix: str, n: int) -> list[tuple[str, dict[str, object]]]:
    """Adds with shared prefixes, marks and frees across three workers."""
    steps: list[tuple[str, dict[str, object]]] = []
    for i in range(n):
        rid, worker = f"{prefix}{i}", i % 3
        steps.append(
            (
                "add",
                {
                    "request_id": rid,
                    "worker_id": worker,
                    "block_hashes": [1, 2, i],
                    "prefill_tokens": 10 + i,
                    "expected_prefill_ms": 20.0,
                },
            )
        )
        if i % 2:
            steps.append(("mark", {"request_id": rid, "worker_id": worker}))
        if i % 3 == 0:
            steps.append(("free", {"request_id": rid, "worker_id": worker}))
    return steps


async def publish(pub: RouterPublisher, steps: list[tuple[str, dict[str, object]]]) -> int:
    last = 0
    for kind, args in steps:
        if kind == "add":
            last = await pub.add(**args)  # type: ignore[arg-type]
        elif kind == "mark":
            last = await pub.mark_prefill_completed(**args)  # type: ignore[arg-type]
        else:
            last = await pub.free(**args)  # type: ignore[arg-type]
    return last


async def full_fold(nc: Client, config: Config) -> bytes:
    state = config.new_state()
    for _, at_ns, data in await read_log(nc, config):
        with contextlib.suppress(EventDecodeError):
            state.apply(decode_event(data), at_ns)
    return state.snapshot()


@contextlib.asynccontextmanager
async def running(nc: Client, config: Config) -> AsyncIterator[Writer]:
    writer = build_writer(nc, config)
    task = asyncio.create_task(writer.run())
    try:
        done, _ = await asyncio.wait(
            [task, asyncio.ensure_future(writer.caught_up.wait())],
            timeout=20,
            return_when=asyncio.FIRST_COMPLETED,
        )
        if task in done:
            task.result()  # raise what stopped it
        yield writer
    finally:
        writer.stop()
        await asyncio.wait_for(task, 20)


def snap_config(**overrides: object) -> Config:
    return fresh_config("n", snapshot_bucket=f"snap{id(overrides)}", **overrides)


async def test_a_restart_folds_only_the_tail_and_ends_identical(nc: Client) -> None:
    config = snap_config(snapshot_every_events=7)
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="s-a", config=config)
    await ensure(nc, config)
    first = await publish(pub, workload("a", 12))
    async with running(nc, config) as writer:
        await writer.wait_applied(first, timeout=10)
    store = await SnapshotStore(nc, config).open()
    kept = await store.list()
    assert 1 <= len(kept) <= config.snapshots_keep
    assert kept[-1].applied_seq == first  # the final snapshot at a clean stop
    assert all(info.meta and info.meta.namespace == config.namespace for info in kept)
    second = await publish(pub, workload("b", 5))
    async with running(nc, config) as writer:
        await writer.wait_applied(second, timeout=10)
        assert writer.stats.restored_from == first
        assert writer.stats.applied == second - first  # only the tail was folded
        await writer.flush()
        restarted = writer.state.snapshot()
    assert restarted == await full_fold(nc, config)


async def damage(store: SnapshotStore, name: str, data: bytes, **meta_changes: object) -> None:
    info = {i.name: i for i in await store.list()}[name]
    assert info.meta is not None
    meta = msgspec.structs.replace(info.meta, **meta_changes)  # type: ignore[arg-type]
    description = msgspec.json.encode(meta).decode()
    await store.store.put(name, data, meta=api.ObjectMeta(name=name, description=description))


async def lose_a_chunk(nc: Client, store: SnapshotStore, name: str) -> None:
    """Delete the object's second chunk from the object store's stream."""
    bucket = store.config.snapshot_bucket
    stream, chunks = f"OBJ_{bucket}", f"$O.{bucket}.C.{(await store.store.get_info(name)).nuid}"
    js = nc.jetstream()
    first = await js.get_msg(stream, seq=1, subject=chunks, next=True)
    assert first.seq is not None
    second = await js.get_msg(stream, seq=first.seq + 1, subject=chunks, next=True)
    assert second.seq is not None and await js.delete_msg(stream, second.seq)


@pytest.mark.parametrize(
    ("how", "reason"),
    [
        ("flipped", "snapshot"),
        ("truncated", "snapshot"),
        ("incompatible", "version 99"),
        ("chunk lost", "2 of 3 chunks stored"),
    ],
)
async def test_a_damaged_snapshot_is_skipped_with_its_reason(
    nc: Client, caplog: pytest.LogCaptureFixture, how: str, reason: str
) -> None:
    config = snap_config(snapshot_every_events=0, snapshot_every_s=0)
    pub = RouterPublisher(nc, namespace=config.namespace, router_id=f"s-{how}", config=config)
    await ensure(nc, config)
    first = await publish(pub, workload("c", 6))
    async with running(nc, config) as writer:
        await writer.wait_applied(first, timeout=10)
        await writer.snapshot_now()
        second = await publish(pub, workload("d", 6))
        await writer.wait_applied(second, timeout=10)
    store = await SnapshotStore(nc, config).open()
    names = [i.name for i in await store.list()]
    assert [int(n.rsplit(".", 1)[1]) for n in names] == [first, second]
    good = await store.fetch(names[-1])
    if how == "flipped":
        await damage(store, names[-1], good[:40] + bytes([good[40] ^ 0xFF]) + good[41:])
    elif how == "truncated":
        await damage(store, names[-1], good[: len(good) // 2])
    elif how == "chunk lost":
        await damage(store, names[-1], good + bytes(300_000))  # three chunks of 128 kB at most
        await lose_a_chunk(nc, store, names[-1])
    else:
        await damage(store, names[-1], good, snapshot_version=99)
    third = await publish(pub, workload("e", 3))
    caplog.set_level(logging.WARNING, logger="seqstate.snapshots")
    async with running(nc, config) as writer:
        await writer.wait_applied(third, timeout=10)
        assert writer.stats.restored_from == first  # the older, valid one
        assert [name for name, _ in writer._skipped()] == [names[-1]]
        await writer.flush()
        state = writer.state.snapshot()
    assert any(names[-1] in r.getMessage() and reason in r.getMessage() for r in caplog.records)
    assert state == await full_fold(nc, config)


async def test_trimming_waits_for_verified_snapshots_and_keeps_each_usable(nc: Client) -> None:
    config = snap_config(snapshot_every_events=10, snapshots_keep=2, retain_events=0)
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="s-t", config=config)
    await ensure(nc, config)
    last = await publish(pub, workload("t", 20))
    async with running(nc, config) as writer:
        await writer.wait_applied(last, timeout=10)
    store = await SnapshotStore(nc, config).open()
    kept = await store.list()
    assert len(kept) == 2
    js = nc.jetstream()
    first = await first_seq_of(js, config.events_stream, config.events_subjects)
    assert first == kept[0].applied_seq + 1  # nothing newer than the oldest kept snapshot went
    # The newest snapshot is lost: the older one still has its whole tail.
    await store.store.delete(kept[-1].name)
    async with running(nc, config) as writer:
        assert writer.stats.restored_from == kept[0].applied_seq
        assert writer.stats.last_seq == last
    # Every snapshot lost and the beginning trimmed: refuse, naming why.
    for info in await store.list():
        await store.store.delete(info.name)
    with pytest.raises(SnapshotUnavailable, match="trimmed and no valid snapshot covers them"):
        async with running(nc, config):
            pass
    with pytest.raises(ReplayError, match=r"trimmed and no valid snapshot .* --from-seq \d+"):
        await replay(nc, config)
    # Another namespace on the same (trimmed) stream has lost nothing: it starts.
    other = Config(**{**config.__dict__, "namespace": config.namespace + "x"})
    await ensure(nc, other)
    pub_x = RouterPublisher(nc, namespace=other.namespace, router_id="s-x", config=other)
    last_x = await publish(pub_x, workload("x", 3))
    async with running(nc, other) as writer:
        await writer.wait_applied(last_x, timeout=10)
        assert writer.stats.restored_from == 0 and len(writer.state.requests) == 2


async def test_a_writer_restarted_with_other_fold_rules_keeps_the_snapshots_and_says_so(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Broke: the fold settings changed between two runs (expiry, grace). Expected: the
    restored state keeps the rules it was folded by (so it still equals a replay of the log),
    and the writer names each setting that differs, once, at its restore."""
    config = snap_config(snapshot_every_events=5)
    pub = RouterPublisher(nc, namespace=config.namespace, router_id="s-r", config=config)
    await ensure(nc, config)
    first = await publish(pub, workload("r", 6))
    async with running(nc, config) as writer:
        await writer.wait_applied(first, timeout=10)
    changed = dataclasses.replace(config, expiry_s=60.0, worker_grace_s=5.0)
    with caplog.at_level(logging.WARNING, logger="seqstate.writer"):
        async with running(nc, changed) as writer:
            assert writer.stats.restored_from == first
            assert (writer.state.expiry_s, writer.state.worker_grace_s) == (300.0, None)
    warnings = [r.getMessage() for r in caplog.records if "keeps the rules" in r.getMessage()]
    assert len(warnings) == 1, caplog.text
    assert (
        "(expiry_s: snapshot 300, configured 60; worker_grace_s: snapshot off, configured 5)"
    ) in warnings[0]
