"""An operator's whole day beside a live Dynamo 1.6.1 fleet on etcd, with no hand on the wheel.

The fleet runs and routes before seqstate exists; seqstate is started with the README's one
command (``ETCD_ENDPOINTS=... seqstate run --nats-url ... --namespace dyn --dynamo-endpoint
...``, plus the scan the fleet's frontends use) and never touched again, but for being
SIGKILLed and started again by the same command. Through it, at each stage, seqstate's
``loads`` is compared with every live frontend's decode-block gauges:

1. requests in flight at seqstate's first start were never captured: seqstate shows none of
   them (exactly), and equals the frontends once they end;
2. a frontend SIGKILLed with requests in flight and started again equals its peer once
   resynced; the dead frontend's requests (no Free will ever come) are idle, and leave
   seqstate when they leave the surviving frontend, at its lease;
3. seqstate down while a frontend restarts and routes: resynced when seqstate comes back;
4. seqstate down while a worker holding requests is SIGKILLed and leaves discovery: removed
   when seqstate comes back; a new worker comes in idle; traffic goes on; ``replay --verify``.

The scan is short (``S`` s) so that expiry is seen; held streams are compared within S of
their Add, since past it a frontend's peers expire their copy of a live stream while the
frontend that routed it keeps it (docs/dynamo.md's table), so no one ledger equals both.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import time
import uuid

import pytest
from dynamo_kit import (
    Stream,
    block,
    close_all,
    models,
    nonzero,
    open_streams,
    scrape,
    unique_blocks,
)
from eventually import eventually
from fleet import DYNAMO_ENDPOINT, Frontend
from live import LiveFleet
from seqstate_kit import HELD, NAMESPACE, REPO, SEQSTATE, Seqstate, agree, per_rank

from projector.nats.server import NatsServer

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]
DISCOVERIES = ("etcd",)
S = 15
FRONTEND_ENV = {"DYN_ROUTER_ACTIVE_REQUEST_EXPIRY_SECS": str(S)}
# How late a drop may be seen: a poll of /metrics, a `loads` run and the writer's Tick.
SEEN_S = 2.5

Rank = tuple[int, int]


class OneCommand(Seqstate):
    """``seqstate run`` exactly as the README's Dynamo section starts it: the fleet's etcd in
    ``ETCD_ENDPOINTS`` and nothing else of Dynamo's or seqstate's environment."""

    def start(self) -> None:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("DYN_", "ETCD_", "SEQSTATE_", "NATS_"))
        }
        env["ETCD_ENDPOINTS"] = self.live.fleet.gateway.url
        argv = [*SEQSTATE, "run", "--nats-url", self.nats_url, "--namespace", NAMESPACE]
        argv += ["--dynamo-endpoint", DYNAMO_ENDPOINT, "--expiry-scan-s", str(S)]
        self.since = self.log.stat().st_size if self.log.exists() else 0
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=REPO,
                start_new_session=True,
            )

    async def started(self) -> None:
        def alive() -> None:
            assert self.proc is not None and self.proc.poll() is None, self.tail()

        def said() -> str:
            with self.log.open("rb") as log:
                log.seek(self.since)
                return log.read().decode(errors="replace")

        await eventually(
            said,
            lambda text: "capturing Dynamo endpoint" in text,
            what="seqstate run up, capturing (its log)",
            check=alive,
            watch=self.tail,
        )


async def hold(
    live: LiveFleet, tag: int, fronts: list[Frontend], count: int, tokens: int = HELD
) -> tuple[list[str], list[Stream]]:
    """``count`` streams through ``fronts`` in turn (two blocks of their own each: no cached
    prefix draws them to one worker), until their AddRequests are captured."""
    rids = [str(uuid.uuid4()) for _ in range(count)]
    streams = await open_streams(
        (
            rid,
            fronts[i % len(fronts)].http_port,
            block(tag + i) + block(tag + 100 + i) + "12",
            tokens,
        )
        for i, rid in enumerate(rids)
    )
    await live.added(rids)
    return rids, streams


async def traffic(live: LiveFleet, tag: int, fronts: list[Frontend]) -> None:
    """Short requests through ``fronts``, run to completion and freed."""
    rids, streams = await hold(live, tag, fronts, 2 * len(fronts), tokens=3)
    try:
        await eventually(
            lambda: live.capture.freed(rids),
            lambda freed: len(freed) == len(rids),
            what="the short requests freed",
            timeout=60,
        )
        assert all(s.completed for s in streams), [bytes(s.received[-200:]) for s in streams]
    finally:
        await close_all(streams)


async def restarted(live: LiveFleet, name: str) -> tuple[Frontend, float]:
    """A frontend started now, ready to route (every rank of discovery registered); and when
    its channel appeared in discovery."""
    before = set(live.fleet.channels())
    front = live.fleet.start_frontend(name, env=FRONTEND_ENV)
    await eventually(
        lambda: set(live.fleet.channels()) - before,
        what=f"{name}'s channel in discovery",
        timeout=60,
        interval=0.02,
        check=front.check,
    )
    registered = time.monotonic()
    await eventually(
        lambda: models(front.http_port),
        lambda ids: "tiny" in ids,
        what=f"{name} lists the model",
        timeout=60,
        retry_on=(OSError,),
        check=front.check,
    )
    ranks = live.fleet.ranks()
    await eventually(
        lambda: scrape(front.http_port),
        lambda g: g.registered == ranks,
        what=f"{name} registered {sorted(ranks)}",
        timeout=60,
        check=front.check,
    )
    return front, registered


async def blocks(seq: Seqstate) -> dict[Rank, int]:
    return {rank: v["blocks"] for rank, v in (await seq.loads()).items() if v["blocks"]}


async def test_one_command_beside_a_running_fleet_through_its_day(
    live: LiveFleet, nats_server: NatsServer
) -> None:
    f1, f2 = live.frontends
    seq = OneCommand(live, nats_server.url)
    streams: list[Stream] = []
    try:
        # 1. The fleet routes before seqstate exists.
        await traffic(live, 40_000_000, [f1, f2])
        before, streams = await hold(live, 41_000_000, [f1, f2], 4)
        seq.start()
        await seq.started()
        gauges = nonzero((await scrape(f1.http_port)).decode)
        assert gauges == nonzero((await scrape(f2.http_port)).decode)
        assert gauges == unique_blocks(live.capture.in_flight(before).values())
        assert await blocks(seq) == {}  # never captured: nothing of them
        await close_all(streams)
        await agree(live, seq, {}, "the uncaptured requests ended")

        # 2. A frontend SIGKILLed with requests in flight, started again.
        rids, streams = await hold(live, 42_000_000, [f1, f2], 4)
        added = time.monotonic()
        await agree(live, seq, per_rank(live, rids), "4 held")
        orphans = [
            rid for rid in rids if live.capture.adds([rid])[rid].event.router_id == f1.router_id
        ]
        assert len(orphans) == 2
        live.fleet.kill_proc(f1)
        f1b, registered = await restarted(live, "frontend-1b")
        await agree(live, seq, per_rank(live, rids), "the restarted frontend resynced")
        await close_all(streams)  # f2's own two end; f1's two never will
        await agree(live, seq, per_rank(live, orphans), "the dead frontend's two, idle")
        dropped: dict[str, float] = {}

        async def who_dropped() -> bool:
            views = {"seqstate": await blocks(seq)}
            for front in (f2, f1b):
                views[front.name] = nonzero((await scrape(front.http_port)).decode)
            for name, view in views.items():
                if not view and name not in dropped:
                    dropped[name] = time.monotonic()
            return len(dropped) == len(views)

        await eventually(
            who_dropped, what="the idle requests expired", timeout=4 * S, interval=0.05
        )
        print(
            "idle requests gone after their Add:",
            {name: round(at - added, 2) for name, at in dropped.items()},
            f"(frontend-1b's channel at {registered - added:.2f})",
        )
        for name in ("seqstate", f2.name):  # the lease of their Add
            assert S - 0.2 <= dropped[name] - added <= 2 * S + SEEN_S, (dropped, added)
        # Its copy came with the resync: its lease is younger.
        # (the resync is sent 0.5 s after the channel appears; a busy machine takes longer)
        assert S - 0.2 <= dropped[f1b.name] - registered <= 2 * S + 5 + SEEN_S, dropped
        await agree(live, seq, {}, "every idle request expired")

        # 3. seqstate down while a frontend restarts and routes.
        rids, streams = await hold(live, 43_000_000, [f1b], 2)
        await agree(live, seq, per_rank(live, rids), "2 held through frontend-1b")
        seq.kill()
        live.fleet.kill_proc(f2)
        f2b, _ = await restarted(live, "frontend-2b")
        await traffic(live, 44_000_000, [f2b])  # its publisher reaches the log
        seq.start()
        await seq.started()
        await agree(live, seq, per_rank(live, rids), "frontend-2b resynced at seqstate's start")
        await close_all(streams)
        await agree(live, seq, {}, "the drain")

        # 4. seqstate down while a worker holding requests is SIGKILLed and leaves discovery.
        victim = next(m for m in live.fleet.mockers if m.name == "mocker-a")
        dead = live.fleet.worker_of(victim)
        rids, streams = await hold(live, 45_000_000, [f1b, f2b], 6)
        assert any(live.capture.adds([r])[r].rank[0] == dead for r in rids)
        seq.kill()
        live.fleet.kill_proc(victim)
        await close_all(streams)
        await eventually(
            lambda: asyncio.gather(*(scrape(f.http_port) for f in live.frontends)),
            lambda views: all(all(w != dead for w, _ in g.registered) for g in views),
            what="both frontends dropped the dead worker (its etcd lease lapsed)",
            timeout=60,
            interval=0.2,
        )
        seq.start()
        await seq.started()
        await eventually(
            lambda: seq.cli("loads", "--json"),
            lambda r: r[0] == 0 and str(dead) not in r[1],
            what="the dead worker gone from loads",
            watch=seq.tail,
        )
        _, fresh = await live.new_mocker("mocker-c")
        await eventually(
            lambda: seq.cli("loads", "--json"),
            lambda r: r[0] == 0 and f'"worker_id":{fresh},' in r[1],
            what="the new worker in loads, idle",
            watch=seq.tail,
        )
        for front in live.frontends:
            ranks = live.fleet.ranks()
            await eventually(
                lambda front=front: scrape(front.http_port),
                lambda g, ranks=ranks: g.registered == ranks,
                what=f"{front.name} registered the new worker",
                timeout=60,
            )
        rids, streams = await hold(live, 46_000_000, list(live.frontends), 6)
        await agree(live, seq, per_rank(live, rids), "6 held on the fleet as it is now")
        await close_all(streams)
        await agree(live, seq, {}, "the drain")
        assert str(dead) not in (await seq.cli("loads", "--json"))[1]
    finally:
        await close_all(streams)
        seq.stop()
    rc, out, err = await seq.cli(
        "replay", "--verify", "--dynamo-endpoint", DYNAMO_ENDPOINT, "--expiry-scan-s", str(S)
    )
    assert rc == 0, (out, err)
