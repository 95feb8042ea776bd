"""A 3-node JetStream cluster (``projector.nats.server.NatsCluster``) with R3
streams, bucket and object store. The stream leader of the events stream is SIGKILLed while
routers publish and the writer and projector (real processes, given every node's URL
comma-separated) fold; publishing, folding and reading go on after the election, the node
restarts on its store and catches up, and the end state equals an uninterrupted fold of the log,
with every acknowledged event in it. And ``seqstate run --replicas 3`` against the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import nats.errors
import pytest
from dynamo_capture import CAPTURE, ENDPOINT, SUBJECT
from eventually import eventually
from fault_kit import (
    BUSY,
    ROOT,
    WAIT_S,
    Service,
    Step,
    StepCount,
    bucket_position,
    bucket_values,
    delta_source_seq,
    fault_config,
    fold_log,
    read_stream,
    uninterrupted_fold,
    workload,
)
from nats.aio.client import Client
from nats.js import JetStreamContext
from pipeline_kit import events_in, forwarding, name_flags, read_events

from projector.bucket.reader import RegistryView
from projector.nats.resources import dead_letter_stream, dynamo_capture, ensure
from projector.nats.server import NatsCluster
from projector.nats.snapshots import SnapshotStore
from projector.route.publisher import PublishError, RouterPublisher
from projector.settings.config import Config
from projector.wire.headers import MSG_ID
from projector.wire.values import position_key
from seqstate import AddRequest, Free, WorkerAdded
from seqstate.batches import items_of

WINDOW = 40  # publishes in flight at once
ELECTION_S = 20.0  # a killed leader stalls publishing 4-9 s (the server's election timeout)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    with NatsCluster(tmp_path_factory.mktemp("cluster")) as started:
        yield started


async def cluster_client(cluster: NatsCluster) -> Client:
    async def quiet(exc: Exception) -> None:  # a dead node is the point of the test
        pass

    return await nats.connect(
        servers=cluster.urls,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.1,
        error_cb=quiet,
        connect_timeout=2,
    )


def replicated(config: Config) -> list[str]:
    """Every stream behind the config: events, deltas, dead letters, bucket, object store."""
    return [
        config.events_stream,
        config.deltas_stream,
        dead_letter_stream(config),
        f"KV_{config.registry_bucket}",
        f"OBJ_{config.snapshot_bucket}",
    ]


async def replica_report(js: JetStreamContext, stream: str) -> tuple[int, str | None, list[str]]:
    """``(replicas configured, leader, [name:current/offline of each follower])``."""
    info = await js.stream_info(stream)
    cluster = info.cluster
    assert cluster is not None, f"{stream} has no cluster info"
    peers = [
        f"{p.name}:{'current' if p.current and not p.offline else 'behind'}"
        for p in cluster.replicas or []
    ]
    return info.config.num_replicas or 0, cluster.leader, sorted(peers)


async def wait_all_current(js: JetStreamContext, config: Config) -> None:
    """Until every stream of ``config`` has 3 replicas: a leader and two current followers."""

    async def reports() -> list[tuple[int, str | None, list[str]]]:
        out = []
        for stream in replicated(config):
            try:
                out.append(await replica_report(js, stream))
            except (nats.errors.Error, TimeoutError) as exc:  # mid-election: ask again
                out.append((0, None, [repr(exc)]))
        return out

    def ok(seen: list[tuple[int, str | None, list[str]]]) -> bool:
        return all(
            n == 3 and leader and len(peers) == 2 and all(p.endswith(":current") for p in peers)
            for n, leader, peers in seen
        )

    await eventually(
        reports, ok, what="every stream has 3 current replicas", interval=0.05, retry_on=BUSY
    )


async def provision(nc: Client, config: Config) -> None:
    await ensure(nc, config)
    await SnapshotStore(nc, config).open()  # the writer would create it: make it R3 now
    await wait_all_current(nc.jetstream(timeout=2.0), config)


async def lead_all(nc: Client, js: JetStreamContext, config: Config, leader: str) -> None:
    """Move the leadership of every stream of ``config`` to ``leader`` (a step-down naming the
    preferred server), so that killing it makes deltas, bucket and object store elect too."""

    async def leaders() -> dict[str, str | None]:
        return {stream: (await replica_report(js, stream))[1] for stream in replicated(config)}

    async def moved() -> dict[str, str | None]:
        seen = await leaders()
        for stream, who in seen.items():
            if who not in (leader, None):
                request = json.dumps({"placement": {"preferred": leader}}).encode()
                with contextlib.suppress(nats.errors.Error):
                    await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", request, 2)
        return seen

    await eventually(
        moved,
        lambda seen: set(seen.values()) == {leader},
        what=f"every stream led by {leader}",
        interval=0.2,
        retry_on=BUSY,
    )


async def publish_acked(
    pub: RouterPublisher, js: JetStreamContext, step: Step, errors: list[str]
) -> tuple[int, bytes]:
    """One step, retried until stored: ``(sequence, bytes stored)``. A PublishError (raised,
    never silent) is counted, then the step is sent again (a new msg-id: the first attempt
    may have been stored too, and the fold reads duplicates as the log has them)."""
    deadline = time.monotonic() + WAIT_S + ELECTION_S
    while True:
        try:
            if step.event is not None:
                _, payload = pub.check(step.event)
                return await pub.publish(step.event), payload
            ack = await js.publish(step.subject, step.raw, timeout=2)
            return int(ack.seq), step.raw
        except (PublishError, nats.errors.Error, TimeoutError) as exc:
            errors.append(type(exc).__name__)
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


async def test_the_events_stream_leader_killed_mid_run_leaves_the_ledger_exact(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    config = fault_config(
        "c", replicas=3, expiry_s=2.0, idle_tick_s=3600.0, snapshot_every_events=250
    )
    nc = await cluster_client(cluster)
    services: list[Service] = []
    try:
        await provision(nc, config)
        js = nc.jetstream(timeout=2.0)  # a call to a node that just died is asked again
        for stream in replicated(config):
            replicas, leader, peers = await replica_report(js, stream)
            assert (replicas, len(peers)) == (3, 2), (stream, replicas, leader, peers)
        # Every node's URL, comma-separated, as NATS_URL: each process may land on any node.
        writer = Service("writer", config, cluster.url, tmp_path)
        projector = Service("projector", config, cluster.url, tmp_path)
        services = [writer, projector]
        for service in services:
            await service.start(js, 0)
            await service.wait_ready(js)
        view = await RegistryView(nc, config=config).start()  # reads across the kill
        _, first, _ = await replica_report(js, config.events_stream)
        assert first is not None
        await lead_all(nc, js, config, first)  # the kill makes every stream elect

        steps = workload(41, config, requests=500)
        kill_at, restart_at = len(steps) * 2 // 5, len(steps) * 3 // 5
        pub = RouterPublisher(
            nc,
            namespace=config.namespace,
            router_id="cluster41",
            config=config,
            retries=3,
            timeout=2.0,
        )
        acked: dict[int, bytes] = {}
        errors: list[str] = []
        done = StepCount()
        killed: dict[str, str] = {}

        async def publisher() -> None:
            for start in range(0, len(steps), WINDOW):
                window = steps[start : start + WINDOW]
                got = await asyncio.gather(*(publish_acked(pub, js, s, errors) for s in window))
                for seq, payload in got:
                    assert acked.setdefault(seq, payload) == payload, f"seq {seq} acked twice"
                await done.advance(start + len(window))

        async def crasher() -> None:
            await done.reached(kill_at)
            _, leader, _ = await replica_report(js, config.events_stream)
            leaders = [(await replica_report(js, stream))[1] for stream in replicated(config)]
            assert leader is not None
            assert leaders == [leader] * len(leaders), f"leaders moved: {leaders}"
            killed["name"] = leader
            killed["before"] = str(max(acked))
            cluster.kill(leader)
            # After the election: events acknowledged, folded and projected past the kill.
            await eventually(
                lambda: max(acked),
                lambda seq: seq > int(killed["before"]),
                what="an event acknowledged after the kill",
                timeout=ELECTION_S,
            )
            after = max(acked)
            await eventually(
                lambda: delta_source_seq(js, config),
                lambda s: s >= after,
                what="the writer folded past the kill",
                retry_on=BUSY,
                watch=writer.logs,
                check=writer.check,
            )
            await eventually(
                lambda: view.applied_seq,
                lambda s: s >= after,
                what="the view read past the kill",
                watch=projector.logs,
                check=projector.check,
            )
            # Asked until answered: right after the kill, a stream info can time out while
            # the peers elect.
            _, new_leader, _ = await eventually(
                lambda: replica_report(js, config.events_stream),
                lambda report: True,
                what="the events stream's new leader",
                retry_on=BUSY,
            )
            killed["new"] = new_leader or "?"
            await done.reached(restart_at)
            await asyncio.to_thread(cluster.restart, leader)

        await asyncio.gather(publisher(), crasher())
        assert killed["new"] != killed["name"]
        await wait_all_current(js, config)  # the restarted node caught up on every stream
        last = max(acked)
        await eventually(
            lambda: delta_source_seq(js, config),
            lambda seq: seq >= last,
            what="the writer caught up",
            retry_on=BUSY,
            watch=writer.logs,
            check=writer.check,
        )
        await eventually(
            lambda: bucket_position(js, config),
            lambda p: p.applied_seq >= last,
            what="the projector caught up",
            retry_on=BUSY,
            watch=projector.logs,
            check=projector.check,
        )
        await view.wait_for(last, timeout=WAIT_S)
        for service in services:
            code = await service.stop()
            assert code == 0, f"{service.command} exited with {code}\n{service.logs()}"

        stored = {
            seq: data
            for seq, _, data in await read_stream(nc, config.events_stream, config.events_subjects)
        }
        lost = sorted(seq for seq, payload in acked.items() if stored.get(seq) != payload)
        assert not lost, f"acknowledged but not in the stream: {lost[:10]}"
        snapshot, values, logged = await uninterrupted_fold(nc, config)
        assert logged == last == max(stored)
        store = await SnapshotStore(nc, config).open()
        newest = (await store.list())[-1]
        assert newest.applied_seq == last
        assert await store.fetch(newest.name) == snapshot, "the final snapshot differs"
        got = await bucket_values(nc, config)
        assert got.pop(position_key(config.namespace)), "no position"
        missing = sorted(set(values) - set(got))
        extra = sorted(set(got) - set(values))
        differing = sorted(k for k in values if k in got and got[k] != values[k])
        assert not (missing or extra or differing), (
            f"bucket differs from an uninterrupted fold: missing {missing[:5]}, extra "
            f"{extra[:5]}, differing {differing[:5]}"
        )
        await view.stop()
        print(
            f"killed {killed}, {len(acked)} acked, {len(stored)} stored, "
            f"{len(errors)} publish errors raised: {sorted(set(errors))}"
        )
    finally:
        for service in services:
            service.close()
        with contextlib.suppress(Exception):
            await nc.close()
        for node in cluster.nodes:  # the next test gets a whole cluster, even after a failure
            if not node.running:
                await asyncio.to_thread(cluster.restart, node.name)


async def test_publish_many_with_the_default_retries_rides_a_leader_election(
    cluster: NatsCluster,
) -> None:
    """The publisher's default retries backed off about 0.35 s in all, and
    an R3 leader election takes 4-9 s: 13 of about 940 calls failed during leader kills.

    Broke: SIGKILLed the events stream's leader while a RouterPublisher built with its
    defaults published batches with publish_many, flat out; restarted the node. Expected: no
    PublishError; every event stored exactly once; the longest call (the election, as the
    publisher saw it) is printed and is within the retry budget."""
    config = fault_config("e", replicas=3)
    nc = await cluster_client(cluster)
    killed: str | None = None
    try:
        await provision(nc, config)
        js = nc.jetstream(timeout=2.0)
        pub = RouterPublisher(nc, namespace=config.namespace, router_id="elect", config=config)
        assert pub.retries is None and pub.retry_for_s >= 15.0  # the defaults under test
        calls: list[tuple[float, float, int]] = []  # (started, took, events), each call
        stop = asyncio.Event()
        published = 0

        async def publisher() -> None:
            nonlocal published
            loop = asyncio.get_running_loop()
            while not stop.is_set():
                batch = [Free(request_id=f"e{published + i}", worker_id=1) for i in range(50)]
                started = loop.time()
                seqs = await pub.publish_many(batch)  # a PublishError fails the test
                calls.append((started, loop.time() - started, len(seqs)))
                published += len(seqs)

        async def crasher() -> None:
            nonlocal killed
            await eventually(lambda: len(calls), lambda n: n >= 20, what="20 calls stored")
            _, leader, _ = await replica_report(js, config.events_stream)
            assert leader is not None
            killed = leader
            before = len(calls)
            cluster.kill(leader)
            await eventually(
                lambda: len(calls),
                lambda n: n >= before + 20,
                what="20 calls stored after the kill",
                timeout=ELECTION_S + 30,
            )
            await asyncio.to_thread(cluster.restart, leader)
            killed = None
            after = len(calls)
            await eventually(lambda: len(calls), lambda n: n >= after + 20, what="20 more")
            stop.set()

        await asyncio.gather(publisher(), crasher())
        stored = await read_stream(nc, config.events_stream, config.events_subjects)
        assert len(stored) == published, f"{published} acknowledged, {len(stored)} stored"
        assert len({headers[MSG_ID] for _, headers, _ in stored}) == published, "stored twice"
        longest = max(took for _, took, _ in calls)
        print(
            f"{len(calls)} calls of 50 events, none failed; the longest took {longest:.2f}s "
            f"(the election as a publisher sees it)"
        )
        assert longest < pub.retry_for_s + pub.timeout
    finally:
        with contextlib.suppress(Exception):
            await nc.close()
        if killed is not None:
            await asyncio.to_thread(cluster.restart, killed)


async def test_seqstate_run_with_3_replicas_against_the_cluster(
    cluster: NatsCluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``seqstate run --replicas 3`` with ``NATS_URL`` listing the nodes: R3 streams, bucket
    and object store; events published are read back by ``seqstate loads --json``; SIGTERM
    stops it with 0."""
    config = fault_config("r", replicas=3)
    seqstate = str(Path(sys.executable).parent / "seqstate")
    names = name_flags(config)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SEQSTATE_")}
    env["NATS_URL"] = cluster.url
    log_path = tmp_path / "run.log"
    nc = await cluster_client(cluster)
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [seqstate, "run", "--replicas", "3", *names, "--log-level", "warning"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=ROOT,
        )

    def alive() -> None:
        if proc.poll() is not None:
            raise AssertionError(
                f"seqstate run exited with {proc.returncode}\n"
                f"{log_path.read_text(errors='replace')[-3000:]}"
            )

    try:
        js = nc.jetstream(timeout=2.0)

        async def subscribed() -> int:
            alive()
            try:
                events = await js.consumers_info(config.events_stream)
                deltas = await js.consumers_info(config.deltas_stream)
            except nats.errors.Error:  # not provisioned yet
                return 0
            return min(len(events), len(deltas))

        await eventually(subscribed, what="the writer and the projector subscribed", retry_on=BUSY)
        await wait_all_current(js, config)  # the object store too: the writer opened it
        for stream in replicated(config):
            assert (await replica_report(js, stream))[0] == 3, stream

        pub = RouterPublisher(nc, namespace=config.namespace, router_id="clusterrun", config=config)
        await pub.publish(WorkerAdded(worker_id=1, dp_size=2))
        for i in range(4):
            add = AddRequest(
                request_id=f"q{i}",
                worker_id=1,
                dp_rank=i % 2,
                block_hashes=[11, 12, 13 + i],
                prefill_tokens=100,
            )
            await pub.publish(add)
        last = await pub.publish(Free(request_id="q0", worker_id=1, dp_rank=0))
        async with RegistryView(nc, config=config) as view:
            await view.wait_for(last, timeout=WAIT_S)
            from_view = {(r.worker_id, r.dp_rank): r.active_requests for r in view.loads()}
        assert from_view == {(1, 0): 1, (1, 1): 2}, from_view

        loads = await asyncio.to_thread(
            subprocess.run,
            [seqstate, "loads", "--json", *names],
            env=env,
            cwd=ROOT,
            capture_output=True,
            timeout=WAIT_S,
        )
        assert loads.returncode == 0, loads.stderr.decode(errors="replace")
        rows = [json.loads(line) for line in loads.stdout.decode().splitlines() if line]
        got = {(r["worker_id"], r["dp_rank"]): r["active_requests"] for r in rows}
        assert got == from_view, rows

        # A process started with the default --replicas 1 (a writer someone restarts by hand)
        # must not strip the cluster's streams of their copies: it keeps them, and says so.
        with caplog.at_level(logging.WARNING, logger="seqstate.resources"):
            await ensure(nc, dataclasses.replace(config, replicas=1))
        for stream in (config.events_stream, config.deltas_stream):
            assert (await replica_report(js, stream))[0] == 3, stream
        assert f"stream {config.events_stream} keeps its 3 replicas" in caplog.text

        alive()
        proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(proc.wait, WAIT_S)
        assert code == 0, log_path.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        with contextlib.suppress(Exception):
            await nc.close()


async def test_a_dynamo_capture_on_the_cluster_is_r3_and_every_message_folds(
    cluster: NatsCluster,
) -> None:
    """With ``--replicas 3``, the namespace's Dynamo capture stream is R3 like the
    events stream it feeds, and the shared capture's 155 real messages, published on NATS Core
    to any node, are each stored once in the namespace's log and fold to a drained ledger (no
    request in flight, four publishers, no hole)."""
    config = fault_config("dc", replicas=3, dynamo_endpoint=ENDPOINT)
    nc = await cluster_client(cluster)
    try:
        await ensure(nc, config)
        js = nc.jetstream(timeout=2.0)
        assert (await replica_report(js, dynamo_capture(config)))[0] == 3
        assert (await replica_report(js, config.events_stream))[0] == 3
        for message in CAPTURE:
            await nc.publish(SUBJECT, message.data)
        await nc.flush()
        async with forwarding(nc, config):  # a writer's
            await eventually(
                lambda: read_events(nc, config),
                lambda log: events_in(log) >= len(CAPTURE),
                what="every captured message in the namespace's log",
                retry_on=BUSY,
            )
        log = await read_events(nc, config)
        assert [item for *_, data in log for item in items_of(data)] == [m.data for m in CAPTURE]
        fold = await fold_log(nc, config)
        assert fold.last == log[-1][0]
        state = fold.state
        assert len(state.requests) == 0
        assert (len(state.publishers), state.publishers.holes) == (4, 0)
    finally:
        await nc.close()
