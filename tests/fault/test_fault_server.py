"""Issue #9: nats-server itself is SIGKILLed at seeded points of a publishing run, with deltas in
flight, and restarted on the same store; the writer and projector ride it out (or are killed and
restarted too). Afterwards the writer's final snapshot and every bucket value equal, byte for
byte, what one uninterrupted fold of the same log gives.

Before issue #9 a crash lost the deltas in flight while later ones were stored after the
reconnect; the restarted writer resumed after the newest and the bucket stayed wrong for good
(``blocks.9.0: 8 hashes too many``).
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
    bucket_position,
    bucket_values,
    delta_source_seq,
    fault_config,
    uninterrupted_fold,
    wait_until,
    workload,
)
from nats.aio.client import Client

from projector.publisher import PublishError, RouterPublisher
from projector.resources import ensure
from projector.server import NatsServer
from projector.snapshots import SnapshotStore
from projector.stream import last_seq_of
from projector.values import position_key

KILLS = 3
WINDOW = 40  # publishes in flight at once: the writer always has deltas on the wire


async def robust_client(url: str) -> Client:
    async def quiet(exc: Exception) -> None:  # a dead server is the point of the test
        pass

    return await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.1,
                              error_cb=quiet, connect_timeout=2)  # fmt: skip


async def publish_until_stored(pub: RouterPublisher, js: object, step: object) -> int:
    """One step, retried across a server restart (a retry may store it twice: the log is what
    the fold reads, duplicates included)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            if step.event is not None:  # type: ignore[attr-defined]
                return await pub.publish(step.event)  # type: ignore[attr-defined]
            ack = await js.publish(step.subject, step.raw, timeout=2)  # type: ignore[attr-defined]
            return int(ack.seq)
        except (PublishError, nats.errors.Error, TimeoutError):
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


@pytest.mark.parametrize(("seed", "also"), [(31, ""), (32, ""), (33, ""), (34, "writer"),
                                            (35, "projector")])  # fmt: skip
async def test_a_server_killed_at_random_points_leaves_the_ledger_exact(
    tmp_path: Path, seed: int, also: str
) -> None:
    rng = random.Random(f"server-{seed}")
    config = fault_config("s", expiry_s=2.0, idle_tick_s=3600.0, snapshot_every_events=250)
    server = NatsServer(tmp_path / "store")
    server.start()  # its port is kept across restarts, so every client finds it again
    nc = await robust_client(server.url)
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
        steps = workload(seed, config, requests=700)
        crashes = sorted(rng.sample(range(150, len(steps) - 150), KILLS))
        pub = RouterPublisher(nc, namespace=config.namespace, router_id=f"srv{seed}",
                              config=config, retries=1, timeout=2.0)  # fmt: skip

        async def deltas() -> int:
            return await delta_source_seq(js, config)

        async def applied() -> int:
            return (await bucket_position(js, config)).applied_seq

        async def events() -> int:
            return await last_seq_of(js, config.events_stream, config.events_subjects)

        done = {"steps": 0, "last": 0}
        behind: list[int] = []  # events stored but not yet in a stored delta, at each crash

        async def publisher() -> None:
            """Publishes on, WINDOW at a time, straight through the crashes."""
            for start in range(0, len(steps), WINDOW):
                window = steps[start : start + WINDOW]
                seqs = await asyncio.gather(*(publish_until_stored(pub, js, s) for s in window))
                done["last"] = max(done["last"], *seqs)
                done["steps"] = start + len(window)

        async def crasher() -> None:
            """At each crash point, with events and deltas on the wire: SIGKILL, a pause, a
            restart on the same store (and of one consumer too, in the ``also`` runs)."""
            for at in crashes:
                while done["steps"] < at:
                    await asyncio.sleep(0.001)
                behind.append(await events() - await deltas())
                server.kill()
                await asyncio.sleep(rng.uniform(0.2, 1.5))  # down a while: clients retry
                server.start()
                if also:
                    victim = writer if also == "writer" else projector
                    victim.kill()
                    await victim.start(js, 0)

        await asyncio.gather(publisher(), crasher())
        last = done["last"]
        await wait_until(deltas, lambda seq: seq >= last, "the writer caught up", watch=writer)
        await wait_until(applied, lambda seq: seq >= last, "the projector caught up",
                         watch=projector)  # fmt: skip
        for service in services:
            code = await service.stop()
            assert code == 0, f"{service.command} exited with {code}\n{service.logs()}"

        snapshot, values, logged = await uninterrupted_fold(nc, config)
        assert logged == last
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
        missing = sorted(set(values) - set(got))
        extra = sorted(set(got) - set(values))
        differing = sorted(k for k in values if k in got and got[k] != values[k])
        assert not (missing or extra or differing), (
            f"bucket differs from an uninterrupted fold: missing {missing[:5]}, extra "
            f"{extra[:5]}, differing {differing[:5]}"
        )
        # The crashes hit a writer with work in hand (what lost deltas before issue #9).
        assert len(behind) == KILLS and any(b > 0 for b in behind), behind
    finally:
        for service in services:
            service.close()
        with contextlib.suppress(Exception):
            await nc.close()
        server.stop()
