"""The Dynamo follower's decisions, on a real nats-server: what discovery changes become
(control events, resyncs), and the last resort without discovery (a router publisher the log
has never heard, seen on Dynamo's own subject).

The feed is scripted (fleets handed over one by one, as a discovery backend hands them), the
ledger a fold built here, and the control events and resyncs are recorded rather than
published: the follower's whole output is what these tests read. The end-to-end path, with
``seqstate run`` and real discovery files, is in ``test_dynamo_follow_run.py``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import msgspec
import pytest
from dynamo_capture import CAPTURE, ENDPOINT
from eventually import eventually
from nats.aio.client import Client

from projector.dynamo.follow import Fleet, Follower
from projector.settings.config import Config
from seqstate import AddRequest, Free, SequenceState
from seqstate.dynamo import (
    ADD,
    MARK,
    decode_dynamo,
    dynamo_subject,
    encode_dynamo,
    resync_publisher_id,
)
from seqstate.events import Event, WorkerAdded, WorkerRemoved

CONFIG = Config(namespace="follow", dynamo_endpoint=ENDPOINT)
_ADD = next(m for m in map(decode_dynamo, (c.data for c in CAPTURE)) if m.op == ADD)


class ScriptedFeed:
    """Fleets handed to the follower when the test says so."""

    where = "a scripted feed"

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Fleet] = asyncio.Queue()

    async def fleets(self) -> AsyncIterator[Fleet]:
        while True:
            yield await self.queue.get()


class Recorder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self.resyncs = 0
        self.at: list[float] = []  # when each resync ran (loop time)

    async def publish(self, event: Event) -> int:
        self.events.append(event)
        return len(self.events)

    async def resync(self) -> str:
        self.resyncs += 1
        self.at.append(asyncio.get_running_loop().time())
        return f"resync {self.resyncs}"


def ledger_with(*workers: int, heard: tuple[int, ...] = ()) -> SequenceState:
    state = SequenceState()
    for n, worker in enumerate(workers):
        state.apply(AddRequest(request_id=f"r{n}", worker_id=worker, block_hashes=[n]), 1)
    for publisher_id in heard:
        state.publishers.heard(publisher_id, 0, 1)
    return state


async def running(
    nc: Client, state: SequenceState, feed: ScriptedFeed | None, **kw: float
) -> tuple[Follower, Recorder, asyncio.Task[None]]:
    rec = Recorder()
    follower = Follower(
        nc,
        CONFIG,
        feed=feed,
        ledger=lambda: state,
        resync=rec.resync,
        publish=rec.publish,
        resync_delay_s=kw.get("delay", 0.2),
        quiet_warn_s=kw.get("quiet", 60.0),
    )
    task = asyncio.create_task(follower.run())
    return follower, rec, task


async def stopped(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_start_removes_the_dead_and_registers_the_living(nc: Client) -> None:
    """At start the ledger is made to agree with discovery. A worker it holds that discovery
    does not is removed for good if discovery had registered it (11) or if its ranks are idle
    (12: it died while seqstate was down, and its routers freed what it held); one known only
    by a request still in flight (13: a peer's Add naming a worker no process registered) is
    kept, as the frontends keep it until it expires. A worker discovery holds with known ranks
    is registered; one whose ranks are not known yet waits for its first request."""
    state = SequenceState()
    state.apply(WorkerAdded(worker_id=11), 1)
    state.apply(AddRequest(request_id="a", worker_id=11, block_hashes=[1]), 1)
    state.apply(AddRequest(request_id="b", worker_id=12, block_hashes=[2]), 1)
    state.apply(Free(request_id="b", worker_id=12), 1)
    state.apply(AddRequest(request_id="c", worker_id=13, block_hashes=[3]), 1)
    feed = ScriptedFeed()
    _, rec, task = await running(nc, state, feed)
    try:
        feed.queue.put_nowait(
            Fleet(workers={22: (0, 1), 33: (0, 2), 44: None}, endpoints=frozenset({ENDPOINT}))
        )
        await eventually(lambda: len(rec.events) == 4, what="four control events")
        assert rec.events == [
            WorkerRemoved(worker_id=11, final=True),
            WorkerRemoved(worker_id=12, final=True),
            WorkerAdded(worker_id=22, dp_start=0, dp_size=1),
            WorkerAdded(worker_id=33, dp_start=0, dp_size=2),
        ]
        assert rec.resyncs == 0
    finally:
        await stopped(task)


async def test_a_discovery_that_knows_no_worker_removes_nothing(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """An empty or wrong discovery (another fleet's etcd) must not empty the ledger: with no
    worker of the endpoint in it, nothing is removed, and the endpoint is said unknown."""
    caplog.set_level(logging.WARNING, "seqstate.dynamo")
    feed = ScriptedFeed()
    _, rec, task = await running(nc, ledger_with(11), feed)
    try:
        feed.queue.put_nowait(Fleet(endpoints=frozenset({"other.backend.generate"})))
        await eventually(
            lambda: "unknown to discovery" in caplog.text,
            what="'unknown to discovery' in caplog.text",
        )
        assert rec.events == []
        assert (
            f"Dynamo endpoint {ENDPOINT!r} is unknown to discovery (a scripted feed): no worker "
            "or router of it is registered, so nothing will be captured; discovery knows: "
            "other.backend.generate"
        ) in caplog.text
    finally:
        await stopped(task)


async def test_changes_become_control_events_and_resyncs(nc: Client) -> None:
    """After the first view: a worker that leaves is removed for good, one that comes (a new
    instance id) is registered, and a new router replica channel brings one resync, after the
    delay; our own resync publisher's channel brings none."""
    feed = ScriptedFeed()
    state = ledger_with(11)
    state.apply(WorkerAdded(worker_id=11), 1)
    follower, rec, task = await running(nc, state, feed, delay=0.2)
    try:
        first = Fleet(
            workers={11: (0, 1)}, channels=frozenset({5}), endpoints=frozenset({ENDPOINT})
        )
        feed.queue.put_nowait(first)
        await eventually(lambda: rec.resyncs == 1, what="a resync at start")
        # Channel 5 never reached the log: a frontend started blind. Worker 11 is registered
        # with the ranks discovery gives it: nothing to publish.
        assert rec.events == []
        feed.queue.put_nowait(
            Fleet(
                workers={12: (0, 2)},
                channels=frozenset({5, 6, resync_publisher_id(CONFIG.namespace)}),
                endpoints=frozenset({ENDPOINT}),
            )
        )
        await eventually(lambda: rec.resyncs == 2, what="rec.resyncs == 2")
        assert rec.events == [
            WorkerRemoved(worker_id=11, final=True),
            WorkerAdded(worker_id=12, dp_start=0, dp_size=2),
        ]
        assert follower.resyncs == 2
        assert list(follower.triggers) == [
            "1 router replica(s) in discovery that the log had not heard before this start",
            "router replica channel 6 appeared",
        ]
    finally:
        await stopped(task)


async def test_a_channel_that_appears_while_a_resync_waits_gets_its_own_delay(
    nc: Client,
) -> None:
    """Two frontends start 0.3 s apart; the resync that the first one's channel brought is
    still waiting. Sent at the first's due time, it would reach the server 0.2 s after the
    second's channel appeared, before that frontend subscribes (it does so a few ms after its
    key, later on a loaded machine): one resync, once the second's delay has passed too."""
    feed = ScriptedFeed()
    state = ledger_with(11)
    started: list[float] = []

    async def resync() -> str:
        started.append(time.monotonic())
        return "resynced"

    follower = Follower(
        nc,
        CONFIG,
        feed=feed,
        ledger=lambda: state,
        resync=resync,
        publish=Recorder().publish,
        resync_delay_s=0.5,
    )
    task = asyncio.create_task(follower.run())
    try:
        feed.queue.put_nowait(Fleet(workers={11: (0, 1)}, endpoints=frozenset({ENDPOINT})))
        one = Fleet(workers={11: (0, 1)}, channels=frozenset({6}), endpoints=frozenset({ENDPOINT}))
        feed.queue.put_nowait(one)
        await asyncio.sleep(0.3)
        feed.queue.put_nowait(
            Fleet(workers={11: (0, 1)}, channels=frozenset({6, 7}), endpoints=frozenset({ENDPOINT}))
        )
        second = time.monotonic()
        await eventually(lambda: started, what="a resync")
        assert started[0] - second >= 0.5, started[0] - second
        await asyncio.sleep(0.3)
        assert len(started) == 1, started
    finally:
        await stopped(task)


async def publish_raw(nc: Client, *messages: bytes) -> None:
    for data in messages:
        await nc.publish(dynamo_subject(ENDPOINT), data)
    await nc.flush()


def message(publisher_id: int, *, op: str = ADD, worker_is_router: bool = False) -> bytes:
    m = msgspec.structs.replace(_ADD, publisher_id=publisher_id, sequence=0, op=op)
    if worker_is_router:
        m = msgspec.structs.replace(m, router_id=m.worker_id)
    return encode_dynamo(m)


async def test_without_discovery_a_new_router_publisher_triggers_a_resync(nc: Client) -> None:
    """The last resort: with no discovery, the first message of a router publisher that the
    log has never heard means a frontend started (Dynamo draws a new publisher id at every
    start). A worker's own Mark publisher, a publisher the log has heard, and seqstate's own
    resync publisher are not replicas that started blind."""
    follower, rec, task = await running(nc, ledger_with(11, heard=(700,)), None)
    try:
        await eventually(lambda: follower.listening, what="follower.listening")
        await publish_raw(
            nc,
            message(700),  # heard by the log before
            message(701, op=MARK, worker_is_router=True),  # a worker's own
            message(resync_publisher_id(CONFIG.namespace)),  # ours
            message(702),  # a new router: one resync
            message(702, op=MARK),  # the same one again: nothing more
        )
        await eventually(
            lambda: follower.heard[ENDPOINT] == 5, what="follower.heard[ENDPOINT] == 5"
        )
        await eventually(lambda: rec.resyncs == 1, what="rec.resyncs == 1")
        await publish_raw(nc, message(703))
        await eventually(lambda: rec.resyncs == 2, what="rec.resyncs == 2")
        assert follower.heard[ENDPOINT] == 6
        assert list(follower.triggers) == [
            "a router publisher never seen before (702) routes",
            "a router publisher never seen before (703) routes",
        ]
    finally:
        await stopped(task)


async def test_a_flood_of_new_publisher_ids_makes_one_spaced_resync_and_a_few_lines(
    nc: Client, caplog: pytest.LogCaptureFixture
) -> None:
    """Any client that may publish on Dynamo's subjects can draw publisher ids: 1,000 new
    ones, each a resync wanted, made a resync each as fast as they came (every one
    republishing every request in flight to every replica) and a log line each. The first
    is resynced at once; those after it wait for one more resync, 10 s after the first,
    said in one line when due and one when done."""
    caplog.set_level(logging.INFO, "seqstate.dynamo")
    follower, rec, task = await running(nc, ledger_with(11), None)
    try:
        await eventually(lambda: follower.listening, what="follower.listening")
        before = asyncio.get_running_loop().time()
        await publish_raw(nc, message(2000))
        await eventually(lambda: rec.resyncs == 1, what="rec.resyncs == 1")
        await publish_raw(nc, *(message(p) for p in range(2001, 3000)))
        await eventually(
            lambda: follower.heard[ENDPOINT] == 1000, what="follower.heard[ENDPOINT] == 1000"
        )
        assert rec.resyncs == 1
        await eventually(lambda: rec.resyncs == 2, what="rec.resyncs == 2")
        await eventually(lambda: "resync 2" in caplog.text, what="the second resync said")
    finally:
        await stopped(task)
    lines = [r.getMessage() for r in caplog.records if "Dynamo resync" in r.getMessage()]
    assert (
        lines[0] == "Dynamo resync due in 0.0s: a router publisher never seen before (2000) routes"
    )
    assert lines[1] == "Dynamo resync done: resync 1"
    assert lines[2].startswith("Dynamo resync due in "), lines[2]
    assert lines[2].endswith("s: a router publisher never seen before (2001) routes"), lines[2]
    assert rec.at[1] - before > 9.99, rec.at  # spaced from the first trigger (a timer's slack)
    assert lines[3:] == ["Dynamo resync done: resync 2 (998 more triggers joined it)"]


async def test_a_stop_during_a_resync_that_drops_its_cancellation_still_ends(
    nc: Client,
) -> None:
    """A resync is NATS requests, awaited through Python 3.11's ``wait_for``, which drops a
    cancellation that lands as the reply arrives: the resync then returns as if never
    cancelled and its loop waits for the next one. A follower stopped at that moment waited
    for it for ever, and ``seqstate run`` with it, deaf to SIGINT. Here the resync drops
    every cancellation it gets; one cancellation of the follower must still end it."""
    entered = asyncio.Event()
    dropped = 0

    async def resync() -> str:
        nonlocal dropped
        entered.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            dropped += 1  # as wait_for does when the reply lands with the cancellation
        return "a resync that went on"

    follower = Follower(
        nc,
        CONFIG,
        feed=None,
        ledger=lambda: ledger_with(11),
        resync=resync,
        publish=Recorder().publish,
    )
    task = asyncio.create_task(follower.run())
    await eventually(lambda: follower.listening, what="follower.listening")
    follower.want_resync(0.0, "a test")
    await asyncio.wait_for(entered.wait(), 10)
    task.cancel()  # what SIGINT does to it
    done, _ = await asyncio.wait([task], timeout=10)
    assert done == {task} and task.cancelled()
    assert dropped == 1
