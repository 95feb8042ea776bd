"""What Dynamo 1.6.1 writes in discovery, and when, on files and on etcd: the facts a ledger
that follows a fleet with no operator must build on (README.md beside this file, "Discovery").

Each test runs once per discovery, on a fleet of its own (``DISCOVERIES``). In order: what
each process registers and what ties a key to its process; a frontend's start (its channel
key, its subscription, the peer Adds it applies); a worker's restart; a worker's SIGKILL,
last (it leaves the fleet one worker short).
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterable

import pytest
from dynamo_kit import Forger, Stream, add_of, block, close_all, open_streams, scrape
from eventually import eventually
from fleet import TOP_BIT, Frontend
from live import LiveFleet

pytestmark = [pytest.mark.dynamo, pytest.mark.asyncio(loop_scope="module")]

DISCOVERIES = ("file", "etcd")
HELD = 2000
# Dynamo's discovery lease, per backend: (TTL, keep-alive period) in seconds. etcd: a lease of
# 30 s granted to each process, kept alive every 15 s (half the TTL). Files: each process
# rewrites its files' mtime every 10/3 s, and a file older than 10 s is removed by any process
# of the fleet (the sweep). So after a SIGKILL the keys stay at least TTL - period, at most TTL.
LEASE = {"file": (10.0, 10.0 / 3), "etcd": (30.0, 15.0)}
SWEEP_S = 2.0  # what a sweep or etcd's own expiry check may take past the TTL
GHOST = (42, 0)  # a worker id no process of the fleet has
KINDS = ("instances", "mdc", "event_channels", "event_sources")


def forger(live: LiveFleet) -> Forger:
    return Forger(live.capture.nc, random.getrandbits(53), random.getrandbits(53))


def keys_of_worker(live: LiveFleet, worker: int, mark_publishers: Iterable[int]) -> set[str]:
    """Every key that names ``worker``: its instances and model cards (``instance_id``), its
    KV event sources (``metadata.worker``), their channels, and the channel of its Mark
    publisher (``mark_publishers``: known from the wire only, see the first test)."""
    found: set[str] = set()
    sources: set[int] = set()
    for entry in live.fleet.entries("instances") + live.fleet.entries("mdc"):
        if int(entry.value["instance_id"]) == worker:
            found.add(entry.key)
    for entry in live.fleet.entries("event_sources"):
        if int(entry.value["metadata"]["worker"]["worker_id"]) == worker:
            found.add(entry.key)
            sources.add(int(entry.value["publisher_id"]))
    kv = live.fleet.channels("kv-events")
    found |= {kv[p].key for p in sources if p in kv}
    asq = live.fleet.channels()
    found |= {asq[p].key for p in mark_publishers if p in asq}
    return found


def mark_publishers(live: LiveFleet, worker: int) -> set[int]:
    """The publisher ids under which ``worker`` sent its own MarkPrefillCompleted."""
    return {
        s.envelope.publisher_id
        for s in live.capture.seen
        if s.kind == "MarkPrefillCompleted" and s.event.router_id == worker
    }


async def every_worker_marks(live: LiveFleet, tag: int) -> list[Stream]:
    """Hold streams, one more at a time, until each worker has sent a Mark of its own (the
    router spreads held cold prompts over the least loaded ranks: three streams usually do,
    ten is a bound)."""
    streams: list[Stream] = []
    workers = set(live.fleet.worker_ids().values())
    for i in range(10):
        if all(mark_publishers(live, w) for w in workers):
            return streams
        rid = str(uuid.uuid4())
        front = live.frontends[i % 2]
        streams += await open_streams([(rid, front.http_port, block(tag + i) + "123", HELD)])
        await eventually(
            lambda rid=rid: live.capture.marked_by(rid),
            what=f"the worker's Mark of {rid}",
            watch=live.fleet.tails,
        )
    raise AssertionError(f"not every worker marked a request in 10 streams: {workers}")


async def test_each_process_s_keys_and_what_ties_them_to_it(live: LiveFleet) -> None:
    """Four ``active_sequences_events`` channels: one per frontend (replica sync), one per
    worker (the publisher of its own Marks; a dp-2 worker has one for both ranks). A channel's
    id (its key's last segment, in hex, and its ``instance_id``) is the publisher id of what
    it publishes; its value is the same for all four but that id, so the value does not say
    whose it is. On etcd a process's keys all hang on one lease, its own instance id: a
    worker's channel shares its lease with the worker's instance key, a frontend's channel is
    the only key of its lease, and that lease is the router_id it publishes under; leases are
    granted for 30 s, and every id is below 2^63. Files carry no lease."""
    streams = await every_worker_marks(live, 60_000_000)
    await close_all(streams)
    channels = live.fleet.channels()
    assert len(channels) == 4
    for publisher, entry in channels.items():
        assert entry.key.rsplit("/", 1)[1] == f"{publisher:x}"
    values = [{k: v for k, v in e.value.items() if k != "instance_id"} for e in channels.values()]
    assert all(value == values[0] for value in values), values
    assert values[0]["topic"] == "active_sequences_events"

    workers = live.fleet.worker_ids()
    frontend_publishers = {
        add.envelope.publisher_id: add.event.router_id
        for add in live.capture.seen
        if add.kind == "AddRequest" and add.event.router_id in {f.router_id for f in live.frontends}
    }
    worker_publishers = {p: w for w in workers.values() for p in mark_publishers(live, w)}
    assert len(frontend_publishers) == 2 and len(worker_publishers) == 2
    assert set(channels) == set(frontend_publishers) | set(worker_publishers)

    every = [entry for kind in KINDS for entry in live.fleet.entries(kind)]
    if live.fleet.discovery == "file":
        assert all(entry.lease is None for entry in every)
        return
    leases: dict[int, set[str]] = {}
    for entry in every:
        assert entry.lease, entry.key  # every key hangs on a lease
        leases.setdefault(entry.lease, set()).add(entry.key)
    for publisher, worker in worker_publishers.items():
        mine = keys_of_worker(live, worker, [publisher])
        assert channels[publisher].lease == worker
        # with the two metrics channels, whose values name no worker: one each per worker
        rest = leases[worker] - mine
        topics = sorted(key.split("/topic/")[1].split("/")[0] for key in rest)
        assert mine <= leases[worker] and topics == ["forward-pass-metrics", "kv_metrics"]
    for publisher, router in frontend_publishers.items():
        assert channels[publisher].lease == router
        assert leases[router] == {channels[publisher].key}
    assert set(leases) == set(workers.values()) | set(frontend_publishers.values())
    for lease in leases:
        granted, remaining = live.fleet.gateway.lease_ttl(lease)
        assert granted == LEASE["etcd"][0] and 0 < remaining <= granted
        assert lease < TOP_BIT


def log_index(front: Frontend, *needles: str) -> int:
    """The line number of the first line of ``front``'s log holding every needle."""
    lines = front.lines()
    found = [i for i, line in enumerate(lines) if all(n in line for n in needles)]
    assert found, f"no line with {needles} in {front.log}"
    return found[0]


async def test_a_frontend_registers_its_channel_before_it_subscribes(live: LiveFleet) -> None:
    """A frontend started beside a running fleet: its ``active_sequences_events`` channel key
    is written before it subscribes to the subject (its own log says so, in that order; the
    subscription shows on nats-server moments later, see README.md for how long). Once the
    subscription is there, a peer's AddRequest is applied: one on a real rank, and one on a
    worker that no discovery ever listed (counted on a rank of its own, never registered);
    the other frontends count both too, and their Frees take them all back to zero."""
    fleet = live.fleet
    channels_before = set(fleet.channels())
    subs_before = fleet.subscriptions()
    late = fleet.start_frontend("frontend-late")
    try:
        new = await eventually(
            lambda: set(fleet.channels()) - channels_before,
            what="the late frontend's active_sequences_events channel",
            timeout=120,
            check=late.check,
            watch=fleet.tails,
        )
        assert len(new) == 1
        await eventually(
            lambda: fleet.subscriptions() - subs_before,
            lambda subs: len(subs) == 1,
            what="the late frontend's subscription to the subject",
            check=late.check,
            watch=fleet.tails,
        )
        registered = log_index(
            late, "KVStoreDiscovery::register: EventChannel", "active_sequences_events"
        )
        subscribed = log_index(late, "EventSubscriber created", "topic=active_sequences_events")
        assert registered < subscribed

        peer = forger(live)
        rank = min(fleet.ranks())
        rids = {rank: str(uuid.uuid4()), GHOST: str(uuid.uuid4())}
        for where, rid in rids.items():
            await peer.send(rid, where, add_of([random.getrandbits(64) for _ in range(3)], 20))
        everyone = [*live.frontends]
        for front in everyone:
            gauges = await eventually(
                lambda front=front: scrape(front.http_port),
                lambda g: g.decode.get(rank) == 3 and g.decode.get(GHOST) == 3,
                what=f"{front.name} applies the peer's two AddRequests",
                check=front.check,
                watch=fleet.tails,
            )
            assert GHOST not in gauges.registered
        for where, rid in rids.items():
            await peer.send(rid, where, "Free")
        for front in everyone:
            await eventually(
                lambda front=front: scrape(front.http_port),
                lambda g: not g.decode.get(rank) and not g.decode.get(GHOST),
                what=f"{front.name} applies the peer's Frees",
                watch=fleet.tails,
            )
    finally:
        fleet.stop_proc(late)
    await eventually(
        lambda: set(fleet.channels()) == channels_before,
        what="the late frontend's channel removed when it stops (SIGTERM)",
        watch=fleet.tails,
    )


async def test_a_restarted_worker_has_a_new_instance_id_and_new_publishers(
    live: LiveFleet,
) -> None:
    """SIGTERM then a new start of the single-rank worker: its keys go (no TTL to wait), it
    comes back under a new instance id, with new channels (KV events and Marks), and its next
    Mark is published under a new publisher id; the frontends register the new rank and drop
    the old one."""
    fleet = live.fleet
    streams = await every_worker_marks(live, 61_000_000)
    await close_all(streams)
    (old_proc,) = [m for m in fleet.mockers if m.name == "mocker-a"]
    old = fleet.worker_of(old_proc)
    assert old is not None
    old_marks = mark_publishers(live, old)
    old_keys = keys_of_worker(live, old, old_marks)
    old_channels = {*fleet.channels(), *fleet.channels("kv-events")}
    fleet.stop_proc(old_proc)
    await eventually(
        lambda: old_keys & {e.key for kind in KINDS for e in fleet.entries(kind)},
        lambda left: not left,
        what="the stopped worker's keys removed",
        watch=fleet.tails,
    )
    new_proc = fleet.start_mocker("mocker-a")
    await live.registered(fleet.mockers)
    new = fleet.worker_of(new_proc)
    assert new is not None and new != old
    ranks = fleet.ranks()
    assert (new, 0) in ranks and not any(worker == old for worker, _ in ranks)
    for front in live.frontends:
        await eventually(
            lambda front=front: scrape(front.http_port),
            lambda g: g.registered == ranks,
            what=f"{front.name} registers the restarted worker's rank, and only it",
            watch=fleet.tails,
        )
    streams = await every_worker_marks(live, 62_000_000)
    await close_all(streams)
    new_marks = mark_publishers(live, new)
    assert new_marks and not new_marks & (old_marks | old_channels)
    new_channels = {*fleet.channels(), *fleet.channels("kv-events")} - old_channels
    assert new_marks <= new_channels
    assert len(new_channels) == 2  # its Mark publisher and its one rank's KV events


async def test_a_sigkilled_worker_s_keys_outlive_it_by_the_lease(live: LiveFleet) -> None:
    """Six streams over both workers; the dp-2 worker SIGKILLed. Its requests' routers publish
    their Frees at once (the streams fail), long before discovery says anything. Its keys
    stay until its lease runs out (files: between 6.7 and 10 s; etcd: between 15 and 30 s),
    within a sweep of each other; no frontend drops the worker while its keys are there, both drop
    it (registration and gauge series) right after. In the meantime new requests may still be
    routed to it: each such request's AddRequest is followed by its Free from the same
    router, at once (the client gets a 503), and nothing names the worker once the frontends
    dropped it."""
    fleet = live.fleet
    f1, f2 = live.frontends
    tag = 63_000_000
    rids = [str(uuid.uuid4()) for _ in range(6)]
    specs = [
        (rid, (f1, f2)[i % 2].http_port, block(tag + i) + block(tag + 100 + i) + "7", HELD)
        for i, rid in enumerate(rids)
    ]
    streams = await open_streams(specs)
    try:
        adds = await eventually(
            lambda: live.capture.adds(rids),
            lambda got: len(got) == 6 and all(live.capture.marked_by(r) for r in rids),
            what="6 AddRequests, each with its worker's Mark",
            watch=fleet.tails,
        )
        (doomed,) = [m for m in fleet.mockers if m.name.endswith("dp2")]
        dead = fleet.worker_of(doomed)
        assert dead is not None
        on_dead = {rid for rid, add in adds.items() if add.rank[0] == dead}
        assert on_dead and len(on_dead) < 6, {rid: add.rank for rid, add in adds.items()}
        keys = keys_of_worker(live, dead, mark_publishers(live, dead))
        # its generate instance and model card, per rank a KV query instance, a KV event
        # source and its channel, and its Marks' channel
        assert len(keys) == 9, keys
        if fleet.discovery == "etcd":  # and its metrics channels, on its lease
            keys |= {e.key for kind in KINDS for e in fleet.entries(kind) if e.lease == dead}
            assert len(keys) == 11, keys
        ttl, period = LEASE[fleet.discovery]

        killed = time.monotonic()
        fleet.kill_proc(doomed)
        await eventually(
            lambda: live.capture.freed(rids),
            lambda freed: freed == on_dead,
            what="a Free for each request on the dead worker, none for the others",
            watch=fleet.tails,
        )
        assert time.monotonic() - killed < ttl - period  # the streams failing, not discovery

        drop = await watch_the_drop(live, dead, keys, killed)
        gone = drop.keys_gone - killed
        assert ttl - period <= gone <= ttl + SWEEP_S, gone
        for front in (f1, f2):
            assert drop.dropped[front.name] >= drop.keys_gone
            gauges = await scrape(front.http_port)
            assert not any(w == dead for w, _ in [*gauges.registered, *gauges.decode])
    finally:
        await close_all(streams)

    about_dead: dict[str, list[str]] = {}
    for seen in live.capture.seen:
        if seen.rank[0] == dead:
            assert seen.envelope.published_at / 1000 < drop.dropped_wall
            if seen.event.request_id in on_dead | drop.routed_after:
                about_dead.setdefault(seen.event.request_id, []).append(seen.kind)
    for rid, kinds in about_dead.items():
        if rid in on_dead:  # held when it died: nothing after its Free
            assert kinds[0] == "AddRequest" and kinds[-1] == "Free", (rid, kinds)
            assert set(kinds[1:-1]) == {"MarkPrefillCompleted"}, (rid, kinds)
        else:  # routed to it after its death: refused at once
            assert kinds == ["AddRequest", "Free"], (rid, kinds)


class Drop:
    """When a dead worker's keys went and each frontend dropped it (monotonic), the wall time
    of the last drop, and the requests sent meanwhile."""

    def __init__(self) -> None:
        self.keys_gone = 0.0
        self.dropped: dict[str, float] = {}
        self.dropped_wall = 0.0
        self.routed_after: set[str] = set()


async def watch_the_drop(live: LiveFleet, dead: int, keys: set[str], killed: float) -> Drop:
    """Poll until both frontends dropped ``dead``; meanwhile send a short request every half
    second through each frontend in turn (some go to the dead worker: the router does not
    know yet). Each poll reads the frontends first and discovery second, so a frontend seen
    without the worker while its keys were still read there would be a frontend ahead of
    discovery."""
    fleet = live.fleet
    drop = Drop()
    shorts: list[Stream] = []
    sent = 0
    try:
        while len(drop.dropped) < 2:
            live.fleet.check()
            assert time.monotonic() - killed < 120, "the frontends never dropped the dead worker"
            now = time.monotonic()
            if now - killed > 0.5 * (sent + 1):
                rid = str(uuid.uuid4())
                front = live.frontends[sent % 2]
                prompt = block(64_000_000 + sent) + "12"
                shorts += await open_streams([(rid, front.http_port, prompt, 2)])
                drop.routed_after.add(rid)
                sent += 1
            views = {f.name: await scrape(f.http_port) for f in live.frontends}
            present = keys & {e.key for kind in KINDS for e in fleet.entries(kind)}
            seen_at = time.monotonic()
            if not present and not drop.keys_gone:
                drop.keys_gone = seen_at
            # Not all in one revision, even on etcd's one lease: a run once saw the KV event
            # sources go a poll before the rest. What matters is below: no frontend ahead.
            for name, gauges in views.items():
                if name not in drop.dropped and not any(w == dead for w, _ in gauges.registered):
                    assert not present, f"{name} dropped the worker while its keys were there"
                    drop.dropped[name] = seen_at
                    drop.dropped_wall = time.time()
            await asyncio.sleep(0.05)
    finally:
        await close_all(shorts)
    return drop
