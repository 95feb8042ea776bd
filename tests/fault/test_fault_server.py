"""nats-server itself is SIGKILLed at seeded points of a publishing
run, with deltas in flight, and restarted on the same store.

Expected of everyone who lives through it:

- the router's RouterPublisher either returns a stream sequence (after retrying) or raises
  PublishError, never anything else, and never a sequence whose message is not that event;
- the writer and the projector ride it out without a restart of their own (or are killed and
  restarted too, in the ``also`` runs) and end, byte for byte, where one uninterrupted fold of the
  same log ends (snapshot and every bucket value);
- a RegistryView started before the first kill, on a client that reconnects, follows the bucket
  through every kill and ends equal to that fold, without being restarted.

Before the gap-free delta chain, a crash lost the deltas in flight while later ones were
stored after the reconnect; the restarted writer resumed after the newest and the bucket
stayed wrong for good (``blocks.9.0: 8 hashes too many``).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path

import nats
import pytest
from fault_kit import (
    WAIT_S,
    Service,
    Step,
    StepCount,
    bucket_position,
    bucket_values,
    delta_source_seq,
    fault_config,
    fold_differences,
    fold_log,
    read_stream,
    wait_current,
    workload,
)
from nats.aio.client import Client

from projector.bucket.reader import RegistryView
from projector.nats.resources import ensure
from projector.nats.server import NatsServer
from projector.nats.snapshots import SnapshotStore
from projector.nats.stream import last_seq_of
from projector.route.publisher import PublishError, RouterPublisher
from projector.wire.values import position_key
from seqstate import AddRequest, Event

KILLS = 3
WINDOW = 40  # publishes in flight at once: the writer always has deltas on the wire
NS_PER_MS = 1_000_000


async def robust_client(url: str) -> Client:
    async def quiet(exc: Exception) -> None:  # a dead server is the point of the test
        pass

    return await nats.connect(
        url, max_reconnect_attempts=-1, reconnect_time_wait=0.1, error_cb=quiet, connect_timeout=2
    )


class Ledger:
    """What RouterPublisher said it stored: stream sequence → the exact bytes of that event.

    Only ``PublishError`` may come out of the publisher besides a sequence; anything else
    escaping it while the server is away is a bug the router could not handle, so it fails the
    test naming the exception instead of being retried like a PublishError.
    """

    def __init__(self, pub: RouterPublisher) -> None:
        self.pub = pub
        self.stored: dict[int, bytes] = {}
        self.publish_errors = 0

    def record(self, seq: int, event: Event) -> None:
        _, payload = self.pub.check(event)  # the bytes publish sends: router_id filled in
        assert seq not in self.stored, f"two events acknowledged with stream sequence {seq}"
        self.stored[seq] = payload

    async def one(self, event: Event) -> int:
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                seq = await self.pub.publish(event)
            except PublishError:  # a retry takes a new msg-id: it may store the event twice
                self.publish_errors += 1
                assert time.monotonic() < deadline, "publish failed for good"
                await asyncio.sleep(0.05)
                continue
            except Exception as exc:
                raise AssertionError(f"RouterPublisher.publish let {exc!r} escape") from exc
            self.record(seq, event)
            return seq

    async def many(self, events: list[Event]) -> list[int]:
        """publish_many, retrying only the events a PublishError's ``sequences`` say are not
        stored (those it says are stay stored: their sequences must hold them)."""
        deadline = time.monotonic() + WAIT_S
        seqs: list[int | None] = [None] * len(events)
        while True:
            todo = [i for i, seq in enumerate(seqs) if seq is None]
            if not todo:
                return [seq for seq in seqs if seq is not None]
            try:
                got: list[int | None] = list(await self.pub.publish_many(events[i] for i in todo))
            except PublishError as exc:
                self.publish_errors += 1
                assert exc.sequences is not None and len(exc.sequences) == len(todo), exc
                assert time.monotonic() < deadline, "publish_many failed for good"
                got = exc.sequences
                await asyncio.sleep(0.05)
            except Exception as exc:
                raise AssertionError(f"RouterPublisher.publish_many let {exc!r} escape") from exc
            for i, seq in zip(todo, got, strict=True):
                if seq is not None:
                    self.record(seq, events[i])
                    seqs[i] = seq


async def publish_raw(js: object, step: Step) -> int:
    """A malformed message, straight to the stream (the writer dead-letters it): retried across
    the restart with whatever the client raises; these are not RouterPublisher's."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            ack = await js.publish(step.subject, step.raw, timeout=2)  # type: ignore[attr-defined]
            return int(ack.seq)
        except (nats.errors.Error, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(
    ("seed", "also"), [(31, ""), (32, ""), (33, ""), (34, "writer"), (35, "projector")]
)
async def test_a_server_killed_at_random_points_leaves_the_ledger_exact(
    tmp_path: Path, seed: int, also: str
) -> None:
    """Breaks: nats-server, SIGKILLed three times mid-run (down 0.2-1.5 s each), with 40
    publishes in flight (every other window one publish_many call) and a RegistryView watching.
    Expects: publishes return a sequence or raise PublishError; every sequence returned holds
    exactly its event; the writer and projector run on (one pid each, bar the ``also`` victim);
    their snapshot, the bucket and the view all equal one uninterrupted fold of the log."""
    rng = random.Random(f"server-{seed}")
    config = fault_config("s", expiry_s=2.0, idle_tick_s=3600.0, snapshot_every_events=250)
    server = NatsServer(tmp_path / "store")
    server.start()  # its port is kept across restarts, so every client finds it again
    nc = await robust_client(server.url)
    view_nc: Client | None = None
    view: RegistryView | None = None
    services: list[Service] = []
    try:
        await ensure(nc, config)
        js = nc.jetstream()
        writer = Service("writer", config, server.url, tmp_path)
        projector = Service("projector", config, server.url, tmp_path)
        services = [writer, projector]
        for service in services:
            await service.start(js, 0)
            await service.wait_ready(js)
        pids = {service.command: service.proc.pid for service in services if service.proc}
        # A scheduler's view, on a connection of its own, watching from before the first kill.
        view_nc = await robust_client(server.url)
        view = await RegistryView(view_nc, config=config).start()
        steps = workload(seed, config, requests=700)
        crashes = sorted(rng.sample(range(150, len(steps) - 150), KILLS))
        pub = RouterPublisher(
            nc,
            namespace=config.namespace,
            router_id=f"srv{seed}",
            config=config,
            retries=1,
            timeout=2.0,
        )
        ledger = Ledger(pub)

        async def deltas() -> int:
            return await delta_source_seq(js, config)

        async def events() -> int:
            return await last_seq_of(js, config.events_stream, config.events_subjects)

        done = StepCount()
        last = 0
        behind: list[int] = []  # events stored but not yet in a stored delta, at each crash

        async def publisher() -> None:
            """Publishes on, WINDOW at a time, straight through the crashes: every other
            window's events as one publish_many call, the others as concurrent publishes."""
            nonlocal last
            for start in range(0, len(steps), WINDOW):
                window = steps[start : start + WINDOW]
                raw = [publish_raw(js, s) for s in window if s.event is None]
                valid = [s.event for s in window if s.event is not None]
                if (start // WINDOW) % 2:
                    batch = await asyncio.gather(ledger.many(valid), *raw)
                    seqs = [*batch[0], *batch[1:]]
                else:
                    seqs = await asyncio.gather(*(ledger.one(e) for e in valid), *raw)
                last = max(last, *seqs)
                await done.advance(start + len(window))

        async def crasher() -> None:
            """At each crash point, with events and deltas on the wire: SIGKILL, a pause, a
            restart on the same store (and of one consumer too, in the ``also`` runs)."""
            for at in crashes:
                await done.reached(at)
                behind.append(await events() - await deltas())
                server.kill()
                await asyncio.sleep(rng.uniform(0.2, 1.5))  # down a while: clients retry
                server.start()
                if also:
                    victim = writer if also == "writer" else projector
                    victim.kill()
                    await victim.start(js, 0)

        await asyncio.gather(publisher(), crasher())
        await wait_current(js, writer, projector, last)
        for service in services:
            if service.command == also:
                assert len(service.runs) == KILLS + 1, "restarted only by the test"
                continue
            assert service.proc is not None and service.proc.poll() is None, (
                f"{service.command} exited on its own\n{service.logs()}"
            )
            assert (service.proc.pid, len(service.runs)) == (pids[service.command], 1), (
                f"{service.command} was restarted"
            )
        for service in services:
            code = await service.stop()
            assert code == 0, f"{service.command} exited with {code}\n{service.logs()}"

        # No silent drop: each sequence a publish returned holds that very event.
        log = {
            seq: data
            for seq, _, data in await read_stream(nc, config.events_stream, config.events_subjects)
        }
        assert ledger.stored and max(ledger.stored) <= last
        missing = sorted(seq for seq in ledger.stored if seq not in log)
        other = sorted(s for s, data in ledger.stored.items() if s in log and log[s] != data)
        assert not (missing or other), (
            f"acknowledged but not stored: {missing[:5]}; stored as another message: {other[:5]}"
        )

        fold = await fold_log(nc, config)
        snapshot, values = fold.state.snapshot(), fold.image.everything()
        assert fold.last == last
        store = await SnapshotStore(nc, config).open()
        newest = (await store.list())[-1]
        assert newest.applied_seq == last
        assert await store.fetch(newest.name) == snapshot, "the final snapshot differs"
        got = await bucket_values(nc, config)
        position = got.pop(position_key(config.namespace))
        assert position, "no position"
        assert (await bucket_position(js, config)).delta_seq == await last_seq_of(
            js, config.deltas_stream, config.deltas_subject
        )
        assert not (differences := fold_differences(values, got)), differences

        # The view, never restarted, followed the bucket through every kill.
        try:
            await view.wait_for(last, timeout=WAIT_S)
        except TimeoutError:
            stalled = f"the RegistryView stalled at event {view.applied_seq} of {last}"
            raise AssertionError(f"{stalled} ({view.resumes} watches re-created)") from None
        assert view.resumes >= 1, "the view's watch outlived a server restart?"
        fold.state.sync_registry()
        reference = fold.state.registry
        queries = [s.event.block_hashes for s in steps[::97] if isinstance(s.event, AddRequest)]
        for offset_ms in (0, 50, 900, 5000):
            now = fold.last_ns + offset_ms * NS_PER_MS
            assert view.loads(now) == reference.loads(now), f"view loads differ at +{offset_ms}ms"
            for query in queries:
                assert view.potential_loads(query, 256, now) == reference.potential_loads(
                    query, 256, now
                ), f"view potential loads differ at +{offset_ms}ms"
        assert view.bad_values == 0

        # The crashes hit a writer with work in hand (what lost deltas before the gap-free chain).
        assert len(behind) == KILLS and any(b > 0 for b in behind), behind
    finally:
        if view is not None:
            await view.stop()
        for service in services:
            service.close()
        for client in (nc, view_nc):
            if client is not None:
                with contextlib.suppress(Exception):
                    await client.close()
        server.stop()
