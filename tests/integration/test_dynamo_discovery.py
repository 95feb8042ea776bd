"""Following Dynamo 1.6.1's discovery, on a real etcd and on real files.

Each test writes the keys as a Dynamo fleet would (discovery_kit.py, from records observed on
a live fleet) and watches a follower's batches: the initial listing first, then each change;
a lease or a file that runs out seen as a delete; an etcd restart and a compaction survived
without a change lost; what is not a record skipped and counted, never fatal.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest
from discovery_kit import (
    CuttableProxy,
    Followed,
    channel,
    file_name,
    instance,
    keys_of,
    worker,
    write_file,
    write_files,
)
from etcd_server import EtcdServer

from projector.dynamo.discovery import (
    Delete,
    DiscoveryFollower,
    Endpoint,
    EventChannel,
    KvEventSource,
    ModelCard,
    Put,
    WorkerInstance,
)
from projector.dynamo.discovery_etcd import EtcdSource
from projector.dynamo.discovery_files import STALE_AFTER_S, FileSource

GENERATE = Endpoint("dynamo", "backend", "generate")
HIGH = (1 << 64) - 12345  # worker ids use all 64 bits
LOW = 0x580353C3B3DAE25F


class Store(Protocol):
    async def put(self, records: dict[str, bytes]) -> None: ...
    async def delete(self, key: str) -> None: ...
    def follower(self) -> DiscoveryFollower: ...


@dataclass
class EtcdStore:
    server: EtcdServer

    async def put(self, records: dict[str, bytes]) -> None:
        for key, value in records.items():
            await self.server.put(key, value)

    async def delete(self, key: str) -> None:
        assert await self.server.delete(key) == 1

    def follower(self) -> DiscoveryFollower:
        return DiscoveryFollower(EtcdSource([self.server.url]))


@dataclass
class FileStore:
    root: Path

    async def put(self, records: dict[str, bytes]) -> None:
        write_files(self.root, records)

    async def delete(self, key: str) -> None:
        (self.root / file_name(key)).unlink()

    def follower(self) -> DiscoveryFollower:
        return DiscoveryFollower(FileSource(self.root))


@pytest.fixture(params=["etcd", "files"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    if request.param == "etcd":
        return EtcdStore(request.getfixturevalue("etcd_server"))
    return FileStore(tmp_path / "dynamo_store_kv")


@pytest.fixture
async def followers() -> AsyncIterator[list[Followed]]:
    started: list[Followed] = []
    yield started
    for followed in started:
        await followed.stop()


async def test_initial_listing_holds_the_fleet_as_dynamo_wrote_it(
    store: Store, followers: list[Followed]
) -> None:
    fleet = worker(HIGH, dp=2, base=1000) | channel(7_000_000_000_001)
    await store.put(fleet)
    followed = Followed(store.follower())
    followers.append(followed)

    first = await followed.initial()
    assert not first.relisted
    assert all(isinstance(c, Put) for c in first.changes)
    assert keys_of(followed.puts()) == set(fleet)
    by_kind = {
        kind: [r for r in followed.puts() if isinstance(r, kind)]
        for kind in (WorkerInstance, ModelCard, EventChannel, KvEventSource)
    }
    # generate, and one worker_kv_query_source per rank
    assert len(by_kind[WorkerInstance]) == 3
    assert by_kind[ModelCard] == [
        ModelCard(f"v1/mdc/dynamo/backend/generate/{HIGH:x}", GENERATE, HIGH, "tiny", 0, 2)
    ]
    assert len(by_kind[EventChannel]) == 6
    assert sorted((s.worker_id, s.dp_rank, s.publisher_id) for s in by_kind[KvEventSource]) == [
        (HIGH, 0, 1100),
        (HIGH, 1, 1101),
    ]
    view = followed.view
    assert view.workers(GENERATE) == {HIGH: frozenset({0, 1})}
    assert view.ranks("dynamo.backend.generate") == {(HIGH, 0), (HIGH, 1)}
    assert [c.publisher_id for c in view.channels(GENERATE)] == [1001, 7_000_000_000_001]
    assert [c.publisher_id for c in view.channels(GENERATE, "kv-events")] == [1100, 1101]
    assert view.knows("dynamo.backend.generate")
    assert not view.knows("dynamo.backend.generat")
    assert view.endpoints() == [GENERATE]
    assert view.skipped == {}
    assert followed.follower.connected


async def test_an_empty_store_lists_nothing_first(store: Store, followers: list[Followed]) -> None:
    followed = Followed(store.follower())
    followers.append(followed)
    first = await followed.initial()
    assert first.changes == ()
    assert not followed.view.knows(GENERATE)
    assert followed.view.endpoints() == []

    await store.put(worker(LOW, base=10))
    await followed.until(lambda f: f.view.workers(GENERATE) == {LOW: {0}}, "the worker")
    assert not any(b.initial for b in followed.batches[1:])


async def test_a_put_then_a_delete_are_changes(store: Store, followers: list[Followed]) -> None:
    await store.put(worker(HIGH, dp=2, base=1000))
    followed = Followed(store.follower())
    followers.append(followed)
    await followed.initial()
    at = len(followed.batches)

    second = worker(LOW, base=2000)
    await store.put(second)
    await followed.until(lambda f: LOW in f.view.workers(GENERATE), "the second worker")
    await followed.until(lambda f: keys_of(f.puts(at)) == set(second), "every key of it")
    assert followed.view.workers(GENERATE) == {HIGH: {0, 1}, LOW: {0}}
    assert not any(b.initial or b.relisted for b in followed.batches[at:])

    at = len(followed.batches)
    (gone,) = instance(LOW)
    await store.delete(gone)
    await followed.until(lambda f: f.deletes(at), "the delete")
    assert followed.deletes(at) == [Delete(WorkerInstance(gone, GENERATE, LOW), "deleted")]
    assert followed.view.workers(GENERATE) == {HIGH: {0, 1}}


async def test_what_is_not_a_record_is_skipped_and_counted(
    store: Store, followers: list[Followed]
) -> None:
    odd_source = worker(LOW, base=500)
    (source_key,) = [k for k in odd_source if k.startswith("v1/event_sources/")]
    junk = {
        f"v1/instances/dynamo/backend/generate/{1:x}": b"{not json",
        f"v1/instances/dynamo/backend/generate/{2:x}": next(
            v for k, v in worker(3).items() if k.startswith("v1/mdc/")
        ),
        f"v1/instances/dynamo/backend/generate/{4:x}": b'{"type":"Endpoint","namespace":"d"}',
        "v1/claims/scope/session": b"{}",
        source_key.replace("kv-events", "other-events"): odd_source[source_key].replace(
            b'"kv-events"', b'"other-events"'
        ),
        f"v1/instances/dynamo/backend/generate/{5:x}": b" " * (1 << 20) + b"{}",
    }
    await store.put(junk)
    followed = Followed(store.follower())
    followers.append(followed)
    first = await followed.initial()
    assert first.changes == ()
    assert followed.view.skipped == {
        "a value that is not JSON": 1,
        "a record of type Model under v1/instances/": 1,
        "a value that is not a Dynamo record: Object missing required field `component`": 1,
        "a key of a kind not followed (v1/claims/)": 1,
        "an event source of topic 'other-events', not kv-events": 1,
        "a value larger than 1048576 bytes": 1,
    }
    # and the follower goes on
    await store.put(instance(HIGH))
    await followed.until(lambda f: f.view.workers(GENERATE) == {HIGH: {0}}, "a good record")


async def test_endpoints_are_those_served_or_published_on(
    store: Store, followers: list[Followed]
) -> None:
    other = Endpoint("prod", "vllm", "generate")
    await store.put(
        worker(HIGH, dp=2, base=100)
        | worker(LOW, ns="prod", component="vllm", base=200)
        | channel(9, ns="prod", component="router", name="only-events")
    )
    followed = Followed(store.follower())
    followers.append(followed)
    await followed.initial()
    view = followed.view
    # a worker's query endpoints (no model, no channel) are not offered to a typo's warning
    assert view.endpoints() == [
        GENERATE,
        Endpoint("prod", "router", "only-events"),
        other,
    ]
    assert view.knows(f"dynamo.backend.worker_kv_query_source_{200:x}")
    assert view.workers(other) == {LOW: {0}}
    assert view.workers("prod.router.only-events") == {}
    assert [c.publisher_id for c in view.channels("prod.router.only-events")] == [9]


# ---- liveness ---------------------------------------------------------------------------------


async def test_an_etcd_lease_that_runs_out_is_a_delete(
    etcd_server: EtcdServer, followers: list[Followed]
) -> None:
    await etcd_server.put(*next(iter(instance(HIGH).items())))
    followed = Followed(DiscoveryFollower(EtcdSource([etcd_server.url])))
    followers.append(followed)
    await followed.initial()

    ttl = 2
    lease = await etcd_server.grant(ttl)
    ((key, value),) = instance(LOW).items()
    granted = time.monotonic()
    await etcd_server.put(key, value, lease=lease)
    await followed.until(lambda f: LOW in f.view.workers(GENERATE), "the leased worker")
    await followed.until(
        lambda f: any(d.record.key == key for d in f.deletes()),
        "its lease ran out",
        timeout=ttl + 5,
    )
    assert time.monotonic() - granted >= ttl - 0.5
    assert [d.why for d in followed.deletes()] == ["deleted"]
    assert followed.view.workers(GENERATE) == {HIGH: {0}}


async def test_a_file_left_stale_is_a_delete_when_dynamo_would_have_swept_it(
    tmp_path: Path, followers: list[Followed]
) -> None:
    root = tmp_path / "kv"
    write_files(root, worker(HIGH, base=10))
    # a SIGKILLed worker's files: last touched long enough ago to go stale within a second
    last_touch = time.time() - STALE_AFTER_S + 1.0
    dead = worker(LOW, base=20)
    write_files(root, dead, mtime=last_touch)
    followed = Followed(DiscoveryFollower(FileSource(root)))
    followers.append(followed)
    await followed.initial()
    assert followed.view.workers(GENERATE) == {HIGH: {0}, LOW: {0}}

    await followed.until(lambda f: len(f.deletes()) == len(dead), "the stale files", timeout=10)
    assert time.time() >= last_touch + STALE_AFTER_S
    assert {d.record.key for d in followed.deletes()} == set(dead)
    assert {d.why for d in followed.deletes()} == {"stale"}
    assert followed.view.workers(GENERATE) == {HIGH: {0}}
    # Dynamo's sweep deleting them afterwards is no second change
    at = len(followed.batches)
    for key in dead:
        (root / file_name(key)).unlink()
    write_files(root, instance(7))
    await followed.until(lambda f: 7 in f.view.workers(GENERATE), "a marker after the sweep")
    assert followed.deletes(at) == []


async def test_files_stale_at_start_are_not_listed(
    tmp_path: Path, followers: list[Followed]
) -> None:
    root = tmp_path / "kv"
    write_files(root, worker(LOW, base=20), mtime=time.time() - STALE_AFTER_S - 1)
    write_files(root, instance(HIGH))
    followed = Followed(DiscoveryFollower(FileSource(root)))
    followers.append(followed)
    first = await followed.initial()
    assert keys_of(followed.puts()) == set(instance(HIGH))
    assert first.changes == (Put(followed.view.records[next(iter(instance(HIGH)))]),)


async def test_a_keep_alive_touch_is_no_change_and_a_new_value_is(
    tmp_path: Path, followers: list[Followed]
) -> None:
    root = tmp_path / "kv"
    write_files(root, worker(HIGH, dp=1, base=10))
    (card,) = [key for key in worker(HIGH) if key.startswith("v1/mdc/")]
    followed = Followed(DiscoveryFollower(FileSource(root)))
    followers.append(followed)
    await followed.initial()
    at = len(followed.batches)

    later = time.time() + 1
    for path in (root / "v1").rglob("*"):
        os.utime(path, (later, later))  # Dynamo's keep-alive: the mtime only
    write_files(root, instance(7))
    await followed.until(lambda f: 7 in f.view.workers(GENERATE), "the marker")
    assert keys_of(followed.puts(at)) == set(instance(7))

    # the worker's card written again with two ranks: a new file, a new record
    write_file(root, card, worker(HIGH, dp=2, base=10)[card])
    await followed.until(lambda f: card in keys_of(f.puts(at)), "the rewritten card")
    assert followed.view.workers(GENERATE) == {HIGH: {0, 1}, 7: {0}}


async def test_a_directory_not_there_yet_is_watched_for(
    tmp_path: Path, followers: list[Followed]
) -> None:
    root = tmp_path / "not-yet"
    followed = Followed(DiscoveryFollower(FileSource(root)))
    followers.append(followed)
    first = await followed.initial()
    assert first.changes == ()
    assert not followed.follower.connected
    write_files(root, worker(HIGH, base=1))
    await followed.until(lambda f: HIGH in f.view.workers(GENERATE), "the first worker")
    assert followed.follower.connected


# ---- etcd's faults ----------------------------------------------------------------------------


async def test_an_etcd_restart_mid_watch_loses_no_change(
    etcd_server: EtcdServer, followers: list[Followed]
) -> None:
    before = worker(HIGH, dp=2, base=100)
    for key, value in before.items():
        await etcd_server.put(key, value)
    source = EtcdSource([etcd_server.url])
    followed = Followed(DiscoveryFollower(source))
    followers.append(followed)
    await followed.initial()
    await followed.until(lambda f: source.revision > 0 and f.follower.connected, "connected")

    etcd_server.kill()
    await followed.until(lambda f: not f.follower.connected, "the outage noticed")
    etcd_server.start()
    (gone,) = instance(HIGH)
    await etcd_server.delete(gone)
    after = worker(LOW, base=200)
    for key, value in after.items():
        await etcd_server.put(key, value)

    await followed.until(lambda f: set(after) <= keys_of(f.puts(1)), "the puts")
    await followed.until(lambda f: f.deletes(), "the delete")
    assert followed.view.workers(GENERATE) == {LOW: {0}}
    assert [d.record.key for d in followed.deletes()] == [gone]
    assert keys_of(followed.puts(1)) == set(after)
    assert not any(b.relisted for b in followed.batches)  # resumed, not listed again
    assert followed.follower.connected


async def test_a_compacted_revision_is_listed_again(
    etcd_server: EtcdServer, followers: list[Followed]
) -> None:
    kept, dropped = worker(HIGH, base=100), worker(LOW, base=200)
    for key, value in (kept | dropped).items():
        await etcd_server.put(key, value)
    proxy = await CuttableProxy(etcd_server.client_port).start()
    try:
        source = EtcdSource([proxy.url])
        followed = Followed(DiscoveryFollower(source))
        followers.append(followed)
        await followed.initial()
        await followed.until(lambda f: f.follower.connected, "connected")

        proxy.sever()
        await followed.until(lambda f: not f.follower.connected, "the outage noticed")
        for key in dropped:
            await etcd_server.delete(key)
        added = channel(5_000)
        revision = 0
        for key, value in added.items():
            revision = await etcd_server.put(key, value)
        await etcd_server.compact(revision)
        proxy.mend()

        await followed.until(lambda f: any(b.relisted for b in f.batches), "a relisting")
        (relisted,) = [b for b in followed.batches if b.relisted]
        assert {c.record.key for c in relisted.changes if isinstance(c, Delete)} == set(dropped)
        assert {c.why for c in relisted.changes if isinstance(c, Delete)} == {"relisted"}
        assert {c.record.key for c in relisted.changes if isinstance(c, Put)} == set(added)
        assert followed.view.workers(GENERATE) == {HIGH: {0}}
        assert set(followed.view.records) == set(kept) | set(added)
    finally:
        await proxy.stop()


async def test_listing_in_small_pages_and_skipping_a_value_too_large(
    etcd_server: EtcdServer, followers: list[Followed]
) -> None:
    fleet = worker(HIGH, dp=2, base=100) | worker(LOW, dp=2, base=200)
    for key, value in fleet.items():
        await etcd_server.put(key, value)
    huge_key = "v1/instances/dynamo/backend/generate/99"
    await etcd_server.put(huge_key, b" " * 300_000 + b"{}")
    source = EtcdSource([etcd_server.url], page_keys=3, max_response_bytes=200_000)
    followed = Followed(DiscoveryFollower(source))
    followers.append(followed)
    await followed.initial()
    assert keys_of(followed.puts()) == set(fleet)
    assert followed.view.skipped == {"a value larger than the 200000 bytes of a response": 1}
    assert followed.view.workers(GENERATE) == {HIGH: {0, 1}, LOW: {0, 1}}


async def test_an_endpoint_that_does_not_answer_is_passed_over(
    etcd_server: EtcdServer, followers: list[Followed]
) -> None:
    await etcd_server.put(*next(iter(instance(HIGH).items())))
    proxy = await CuttableProxy(etcd_server.client_port).start()
    proxy.sever()
    try:
        source = EtcdSource([proxy.url, etcd_server.url])
        followed = Followed(DiscoveryFollower(source))
        followers.append(followed)
        await followed.initial()
        assert followed.view.workers(GENERATE) == {HIGH: {0}}
    finally:
        await proxy.stop()


async def test_an_etcd_that_hangs_is_noticed_and_left(
    etcd_server: EtcdServer, followers: list[Followed]
) -> None:
    await etcd_server.put(*next(iter(instance(HIGH).items())))
    proxy = await CuttableProxy(etcd_server.client_port).start()
    try:
        # a watch that hears nothing is normal; the status probe beside it is what notices
        source = EtcdSource([proxy.url], probe_s=1.0)
        followed = Followed(DiscoveryFollower(source))
        followers.append(followed)
        await followed.initial()
        await followed.until(lambda f: f.follower.connected, "connected")

        proxy.freeze()
        await followed.until(lambda f: not f.follower.connected, "the hang noticed")
        await etcd_server.put(*next(iter(instance(LOW).items())))
        proxy.mend()
        await followed.until(lambda f: LOW in f.view.workers(GENERATE), "the change after it")
        assert not any(b.relisted for b in followed.batches)
    finally:
        await proxy.stop()
