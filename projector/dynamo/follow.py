"""Following a Dynamo fleet with no operator: its workers into the log, its new router
replicas resynced, its mistakes said.

Dynamo's frontends learn their workers from the fleet's discovery (etcd, files, Kubernetes)
and keep their requests in memory; a frontend that starts late knows nothing of the requests
in flight. Beside a running pipeline, the follower closes both gaps:

- **Workers.** A worker that leaves discovery (its process died, its lease lapsed) is dropped
  by every frontend within seconds, with its requests. The follower publishes a final
  ``WorkerRemoved`` for it on the namespace's control subject, so the ledger drops it at that
  point of the log (a replay drops it at the same point) and late messages about it never
  bring it back. A worker that appears (Dynamo draws a new instance id at each start) is
  published as ``WorkerAdded`` with the dp ranks its model card declares, so a scheduler sees
  an idle worker before its first request. At start, the ledger is reconciled with what
  discovery holds: a worker that died while seqstate was down is removed then.
- **Router replicas.** A frontend with replica sync registers an ``active_sequences_events``
  channel in discovery as it starts, and subscribes to the subject right after. The follower
  resyncs (:mod:`projector.dynamo.resync`) a moment after a channel appears, and at start if a
  channel's publisher is one the log had not heard before this start (a frontend started
  while seqstate was down: what it routed meanwhile reached the log, but no resync did). The
  subject is shared by every replica, so each of them receives the resync: a replica that
  knows a request takes its Add as a duplicate. With no discovery, the first message of a
  router publisher the log had not heard before this start triggers the same resync: the
  last resort, since that frontend has already routed once blind.
- **Mistakes.** An endpoint discovery does not know (``dynamo.backend.generat``) is said at
  start, with the endpoints discovery does know, and again while nothing arrives from it.

Nothing here decides what the ledger holds: every change goes through the log as an event,
and the fold decides. The follower runs in the process that holds the namespace's pipeline,
so one follower acts per namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from projector.aio.tasks import cancel_all
from projector.dynamo.discovery import DiscoveryFollower
from projector.settings.config import Config
from seqstate import SequenceState
from seqstate.dynamo import decode_dynamo, dynamo_subject, resync_publisher_id
from seqstate.errors import SeqstateError
from seqstate.events import Event, EventDecodeError, WorkerAdded, WorkerRemoved

log = logging.getLogger("seqstate.dynamo")

# How long after a router replica's channel appears the resync is sent. The frontend creates
# its subscriber right after it registers the channel (a millisecond apart in its log), but the
# subscription and its worker set reach the server a moment later.
RESYNC_DELAY_S = 0.5
# How often an endpoint that sends nothing is said again.
QUIET_WARN_S = 60.0
# Router publishers remembered as seen (a bounded memory: the oldest are forgotten first).
MAX_SEEN = 4096
# Without discovery, a resync for a router publisher never seen before comes at least this long
# after the last one so wanted: any client that may publish on Dynamo's subjects can draw new
# publisher ids, and each resync republishes every request in flight to every replica.
FIRST_SEEN_SPACING_S = 10.0
# A resync wanted while one is due already joins it; those are counted in its lines, as are
# the resyncs that would be due with automatic resync off (a line per this many seconds).
SAY_EVERY_S = 10.0

Range = tuple[int, int]  # (dp_start, dp_size)


@dataclass(frozen=True)
class Fleet:
    """What discovery holds for the namespace's endpoints, at one moment."""

    workers: Mapping[int, Range | None] = field(default_factory=dict)  # None: ranks unknown
    channels: frozenset[int] = frozenset()  # active_sequences_events publishers
    endpoints: frozenset[str] = frozenset()  # every endpoint discovery knows (for the warning)


class FleetFeed(Protocol):
    """A discovery backend, as the follower sees it."""

    where: str  # said in the log: "etcd at http://...", "files in /..."

    def fleets(self) -> AsyncIterator[Fleet]:
        """The fleet now, then after each change (the first one: what was there at start)."""
        ...


def _gone_while_away(state: SequenceState, fleet: Fleet) -> set[int]:
    """The ledger's workers that discovery no longer holds and the frontends have dropped:
    those discovery registered (their ``WorkerAdded``), and those whose every rank is idle (a
    worker that died while seqstate was down: its routers freed what it held). A worker known
    only by requests still in flight was never in discovery (a peer's Add naming a worker no
    process registered): the frontends keep those requests until they expire, so does the
    ledger."""
    workers = state.workers
    gone: set[int] = set()
    for worker_id, ranks in workers.by_worker.items():
        if worker_id in fleet.workers:
            continue
        idle = not any(workers.slots[(worker_id, r)].requests for r in ranks)
        if worker_id in workers.ranges or idle:
            gone.add(worker_id)
    return gone | (set(workers.ranges) - set(fleet.workers))


class DiscoveryFeed:
    """A :class:`~projector.dynamo.discovery.DiscoveryFollower` seen as fleets of the
    namespace's endpoints. A worker's ranks are written as one range (its lowest to its
    highest), which is what ``WorkerAdded`` holds."""

    def __init__(self, follower: DiscoveryFollower, endpoints: tuple[str, ...]) -> None:
        self.follower = follower
        self.endpoints = endpoints
        self.where = follower.describe()

    async def fleets(self) -> AsyncIterator[Fleet]:
        view = self.follower.view
        async for _ in self.follower.changes():
            workers: dict[int, Range | None] = {}
            channels: set[int] = set()
            for endpoint in self.endpoints:
                for worker_id, ranks in view.workers(endpoint).items():
                    workers[worker_id] = (min(ranks), max(ranks) - min(ranks) + 1)
                channels.update(c.publisher_id for c in view.channels(endpoint))
            yield Fleet(workers, frozenset(channels), frozenset(map(str, view.endpoints())))


class Resyncer(Protocol):
    def __call__(self) -> Awaitable[object]: ...


class Follower:
    """Follows ``feed`` (None: no discovery, the last resort only) for ``config``'s Dynamo
    endpoints; ``ledger()`` is the running writer's state (read, never changed);
    ``heard_before()`` the router publishers the log had heard when that writer began to read
    it (by default, the ledger's): a frontend whose publisher is not among them started while
    no seqstate ran, and whatever it routed since then reached the log without a resync."""

    def __init__(
        self,
        nc: Client,
        config: Config,
        *,
        feed: FleetFeed | None,
        ledger: Callable[[], SequenceState],
        resync: Resyncer,
        publish: Callable[[Event], Awaitable[object]],
        resync_delay_s: float = RESYNC_DELAY_S,
        quiet_warn_s: float = QUIET_WARN_S,
        auto_resync: bool = True,
        heard_before: Callable[[], Container[int]] | None = None,
    ) -> None:
        self.nc = nc
        self.config = config
        self.feed = feed
        self.ledger = ledger
        self._resync = resync
        self.resync_delay_s = resync_delay_s
        self.quiet_warn_s = quiet_warn_s
        self.auto_resync = auto_resync
        self._send = publish
        self._heard_before = heard_before
        self._ours = resync_publisher_id(config.namespace)
        self._fleet: Fleet | None = None
        self._seen: OrderedDict[int, None] = OrderedDict()  # router publishers seen on the wire
        self.heard: dict[str, int] = dict.fromkeys(config.dynamo_endpoints, 0)
        self._wanted = asyncio.Event()
        self._due = 0.0
        self._joined = 0  # triggers that joined the resync due, unsaid
        self._first_seen_due = -FIRST_SEEN_SPACING_S  # when the last such resync was due
        self._off_said_at = -SAY_EVERY_S
        self.listening = False  # subscribed to the endpoints' subjects
        self.triggers: deque[str] = deque(maxlen=100)  # why each resync was wanted, newest last
        self.resyncs = 0  # how many ran (status, tests)
        self.published = 0  # control events published

    # ---- running ------------------------------------------------------------------------------

    async def run(self) -> None:
        """Until cancelled. A discovery backend that fails is retried by its own feed; a NATS
        failure ends the pipeline, which ends this with it."""
        subs = await self._listen()
        tasks = [
            asyncio.create_task(self._resyncs(), name="seqstate-dynamo-resync"),
            asyncio.create_task(self._quiet(), name="seqstate-dynamo-quiet"),
        ]
        if self.feed is not None:
            tasks.append(asyncio.create_task(self._follow(self.feed), name="seqstate-discovery"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            # A resync's request may drop one cancellation; the loops clean nothing up.
            await cancel_all(tasks, None, again_after_s=0.25)
            for sub in subs:
                with contextlib.suppress(nats.errors.Error):
                    await sub.unsubscribe()

    def want_resync(self, delay_s: float, why: str) -> None:
        """A resync ``delay_s`` from now, or later: triggers that come together make one, sent
        once the last of them is due (a channel that appears while a resync waits must get its
        own delay, or the resync reaches the server before that frontend's subscription)."""
        self.triggers.append(why)
        loop = asyncio.get_running_loop()
        if not self.auto_resync:
            if loop.time() - self._off_said_at < SAY_EVERY_S:
                self._joined += 1
                return
            self._off_said_at = loop.time()
            joined = self._take_joined()
            more = f", and {joined:,} more since" if joined else ""
            log.info("a Dynamo resync would be due (%s%s); automatic resync is off", why, more)
            return
        due = loop.time() + delay_s
        pending = self._wanted.is_set()
        if not pending or due > self._due:
            self._due = due
        self._wanted.set()
        if pending:  # said with the resync it joins: a flood of triggers is not a line each
            self._joined += 1
            return
        log.info("Dynamo resync due in %.1fs: %s", max(0.0, self._due - loop.time()), why)

    def _take_joined(self) -> int:
        joined, self._joined = self._joined, 0
        return joined

    def _state(self) -> SequenceState | None:
        """The ledger now, or None while no pipeline runs (it is restarting)."""
        try:
            return self.ledger()
        except LookupError:
            return None

    def _heard(self) -> Container[int] | None:
        """The publishers heard before the running writer read the log, or None while no
        pipeline runs."""
        try:
            if self._heard_before is not None:
                return self._heard_before()
            return self.ledger().publishers.entries
        except LookupError:
            return None

    async def _resyncs(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wanted.wait()
            while (wait := self._due - loop.time()) > 0:
                await asyncio.sleep(wait)
            self._wanted.clear()
            joined = self._take_joined()
            try:
                done = await self._resync()
            except LookupError:  # no pipeline: the next one resyncs
                self.want_resync(1.0, "no pipeline ran: again")
                continue
            except (SeqstateError, nats.errors.Error, TimeoutError, OSError) as exc:
                log.error("Dynamo resync failed: %s", exc)
                continue
            self.resyncs += 1
            more = f" ({joined:,} more triggers joined it)" if joined else ""
            log.info("Dynamo resync done: %s%s", done, more)

    # ---- discovery ----------------------------------------------------------------------------

    async def _follow(self, feed: FleetFeed) -> None:
        async for fleet in feed.fleets():
            before, self._fleet = self._fleet, fleet
            if before is None:
                await self._started(feed, fleet)
            else:
                await self._changed(before, fleet)

    async def _started(self, feed: FleetFeed, fleet: Fleet) -> None:
        """The first view: warn of unknown endpoints, reconcile the ledger's workers, resync
        if a router replica started while seqstate was down."""
        unknown = [e for e in self.config.dynamo_endpoints if not self._known(fleet, e)]
        for endpoint in unknown:
            log.warning("%s", self._unknown_text(endpoint, feed.where, fleet))
        state = self._state()
        if state is not None and fleet.workers:
            for worker_id in sorted(_gone_while_away(state, fleet)):
                await self._publish(
                    WorkerRemoved(worker_id=worker_id, final=True),
                    f"worker {worker_id} is not in discovery ({feed.where}): removed",
                )
        for worker_id, dp in sorted(fleet.workers.items()):
            await self._register(state, worker_id, dp)
        # Not the ledger's publishers: a frontend that started while seqstate was down and
        # routed before it came back is in the log, yet it was never resynced.
        known = self._heard() or ()
        fresh = [p for p in fleet.channels if p not in known and p != self._ours]
        if fresh:
            self.want_resync(
                0.0,
                f"{len(fresh)} router replica(s) in discovery that the log had not heard "
                "before this start",
            )

    async def _changed(self, before: Fleet, fleet: Fleet) -> None:
        for worker_id in sorted(set(before.workers) - set(fleet.workers)):
            await self._publish(
                WorkerRemoved(worker_id=worker_id, final=True),
                f"worker {worker_id} left discovery: removed",
            )
        state = self._state()
        for worker_id, dp in sorted(fleet.workers.items()):
            if before.workers.get(worker_id) != dp or worker_id not in before.workers:
                await self._register(state, worker_id, dp)
        new = fleet.channels - before.channels - {self._ours}
        if new:
            self.want_resync(
                self.resync_delay_s,
                f"router replica channel {', '.join(map(str, sorted(new)))} appeared",
            )

    async def _register(
        self, state: SequenceState | None, worker_id: int, dp: Range | None
    ) -> None:
        if dp is None:
            return  # its ranks come with its first request
        dp_start, dp_size = dp
        have = state.workers.ranges.get(worker_id) if state is not None else None
        if have is not None and (have.dp_start, have.dp_size) == dp:
            return
        await self._publish(
            WorkerAdded(worker_id=worker_id, dp_start=dp_start, dp_size=dp_size),
            f"worker {worker_id} in discovery: ranks {dp_start}..{dp_start + dp_size - 1}",
        )

    async def _publish(self, event: Event, what: str) -> None:
        try:
            await self._send(event)
        except SeqstateError as exc:  # the publisher's PublishError
            log.error("Dynamo discovery: %s not published: %s", what, exc)
            return
        self.published += 1
        log.info("Dynamo discovery: %s", what)

    @staticmethod
    def _known(fleet: Fleet, endpoint: str) -> bool:
        return endpoint in fleet.endpoints

    def _unknown_text(self, endpoint: str, where: str, fleet: Fleet | None) -> str:
        known = ", ".join(sorted(fleet.endpoints)) if fleet and fleet.endpoints else "none"
        return (
            f"Dynamo endpoint {endpoint!r} is unknown to discovery ({where}): no worker or "
            f"router of it is registered, so nothing will be captured; discovery knows: {known}"
        )

    # ---- the wire -----------------------------------------------------------------------------

    async def _listen(self) -> list[Subscription]:
        """NATS Core subscriptions on each endpoint's subject: what arrives (the quiet-endpoint
        warning), and routers the log has never seen (the last resort)."""
        subs = []
        for endpoint in self.config.dynamo_endpoints:

            async def take(msg: Msg, endpoint: str = endpoint) -> None:
                self.heard[endpoint] += 1
                self._first_seen(msg.data)

            subs.append(await self.nc.subscribe(dynamo_subject(endpoint), cb=take))
        await self.nc.flush()
        self.listening = True
        return subs

    def _seen_now(self, publisher_id: int) -> bool:
        """Remembers ``publisher_id``; True if it was seen already."""
        seen = self._seen
        if publisher_id in seen:
            seen.move_to_end(publisher_id)
            return True
        seen[publisher_id] = None
        if len(seen) > MAX_SEEN:
            seen.popitem(last=False)
        return False

    def _first_seen(self, data: bytes) -> None:
        if self._fleet is not None:
            return  # discovery is followed: a replica that starts registers its channel first
        try:
            message = decode_dynamo(data)
        except EventDecodeError:
            return  # the fold dead-letters it; nothing to learn here
        publisher_id = message.publisher_id
        if publisher_id == self._ours or self._seen_now(publisher_id):
            return
        if message.router_id == message.worker_id:
            return  # a worker's own Mark publisher: no replica behind it
        heard = self._heard()
        if heard is None or publisher_id in heard:
            return  # the log had heard it before this start: not a replica started blind
        now = asyncio.get_running_loop().time()
        if self._wanted.is_set():  # joins the resync due
            delay = max(0.0, self._due - now)
        else:
            delay = max(0.0, self._first_seen_due + FIRST_SEEN_SPACING_S - now)
            self._first_seen_due = now + delay
        self.want_resync(delay, f"a router publisher never seen before ({publisher_id}) routes")

    async def _quiet(self) -> None:
        """Says again, every ``quiet_warn_s``, each endpoint that discovery does not know
        (with discovery) or from which nothing has arrived since start (without): an idle
        endpoint that discovery knows is not a mistake."""
        while True:
            await asyncio.sleep(self.quiet_warn_s)
            for endpoint, count in self.heard.items():
                if count:
                    continue
                if self.feed is not None:
                    if self._fleet is not None and not self._known(self._fleet, endpoint):
                        log.warning(
                            "%s", self._unknown_text(endpoint, self.feed.where, self._fleet)
                        )
                    continue
                log.warning(
                    "nothing arrived from Dynamo endpoint %r since start (subject %s): is it "
                    "the endpoint the workers serve, and are Dynamo's processes on the NATS "
                    "event plane with --router-replica-sync?",
                    endpoint,
                    dynamo_subject(endpoint),
                )
