"""The trackers a serving process serves, and which of them it holds the lease of.

Each ``(model_name, routing_group)`` is a namespace (:mod:`projector.http.tracker_names`)
folded by the slot-tracker rules, whose writer and projector run in whichever serving process
holds its lease (:class:`~projector.run.standby.StandbyPipeline`): every process offers to.
Where this process holds it, its calls are answered from its own writer's fold
(:meth:`Trackers.own_fold`, :mod:`projector.http.own_fold`).

Trackers are bounded (``--max-trackers``), since each is a pipeline, a view and an outcomes feed
in every serving process: a registration of one tracker more is refused (400, nothing stored);
a tracker registered through a process with a higher bound is left out here (logged once) and
a call naming it is 503, never answered as if it did not exist. A tracker whose last worker is
unregistered has ended (its ``<ns>.tracker`` key deleted): once no call is in flight on it, its
pipeline, view and feed are stopped and its room is free for another (the unregistration that
ended it is answered after that), so that registering and unregistering never accumulate.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from projector.aio.tasks import cancel, cancel_all
from projector.bucket.contents import tracker_updates
from projector.bucket.reader import RegistryView
from projector.http.own_fold import OwnFold
from projector.http.shared_lookup import SharedLookup
from projector.http.slot_routes import Rejected
from projector.http.tracker_names import NotATrackerNamespace, namespace_for, tracker_of
from projector.route.outcomes import Outcomes
from projector.route.publisher import RouterPublisher
from projector.run.standby import StandbyPipeline
from projector.settings.config import Config
from projector.wire.values import tracker_key
from projector.write.writer import Writer
from seqstate import SequenceState
from seqstate.deltas import APPLIED, TRACKER_ENDED

log = logging.getLogger("seqstate.slots")

TRACKERS_RETRY_S = 1.0  # a watch of the trackers that failed starts again after this
MAX_BOOKED = 65_536  # per tracker: the adds this process published that are not freed yet


@dataclass
class Tracker:
    model_name: str
    routing_group: str
    config: Config
    standby: StandbyPipeline
    task: asyncio.Task[None]
    outcomes: Outcomes
    view: RegistryView
    publisher: RouterPublisher
    # request id -> (worker, rank) of the adds this process published, newest last: where a
    # /prefill_complete or /free that follows at once finds its request (the bucket shows it
    # a flush later). Bounded: the oldest are forgotten, and found in the view instead.
    # Ordered: a dict's first key, once the oldest are deleted, is found past every slot
    # deleted before it.
    booked: OrderedDict[str, tuple[int, int]] = dataclasses.field(default_factory=OrderedDict)
    # While this process holds the lease: its calls, answered by its writer's fold.
    own: OwnFold | None = None
    opening_own: bool = False
    # Where it does not: what a read must reflect, found once for the reads that wait together.
    newest: SharedLookup | None = None
    answered: int = 0  # the last event of a call this process answered
    calls: int = 0  # calls in flight on it: it is never stopped under them
    ended: bool = False  # the bucket showed no tracker when last looked: stop it once idle
    stopped: bool = False

    def holder(
        self, request_id: str, *, ending: bool, state: SequenceState | None = None
    ) -> tuple[int, int]:
        """The worker and rank that hold ``request_id``, as far as this process can tell
        without asking anyone: its own adds, then its writer's fold (``state``, when it holds
        the lease) or the bucket. (0, 0) when none knows it (an unknown request: the fold
        answers that, whatever the worker)."""
        held = self.booked.pop(request_id, None) if ending else self.booked.get(request_id)
        if held is None:
            held = self.view.rank_of(request_id) if state is None else _rank_in(state, request_id)
        return (0, 0) if held is None else held

    def book(self, request_id: str, rank: tuple[int, int]) -> None:
        """An add of ours is stored: its request is there, unless it held one already (a
        duplicate add changes nothing)."""
        booked = self.booked
        if request_id in booked:
            return
        booked[request_id] = rank
        if len(booked) > MAX_BOOKED:
            booked.popitem(last=False)

    def settle(
        self,
        request_id: str,
        rank: tuple[int, int],
        outcome: str | None,
        owner: tuple[int, int] | None,
    ) -> None:
        """An add's outcome: booked only if applied (a duplicate's request is the owner's)."""
        if outcome == APPLIED:
            return
        if outcome == "duplicate" and owner is not None:
            self.booked[request_id] = (owner[0], owner[1])
        elif self.booked.get(request_id) == rank:
            del self.booked[request_id]


def _rank_in(state: SequenceState, request_id: str) -> tuple[int, int] | None:
    rank = state.requests.worker_for(request_id)
    return None if rank is None else (rank[0], rank[1])


def listed(trackers: Iterable[tuple[str, str]], shown: int = 3) -> str:
    """A few trackers by name, and how many more (a log line or an error stays short)."""
    trackers = list(trackers)
    named = ", ".join(f"model={m} routing_group={g}" for m, g in trackers[:shown])
    return named if len(trackers) <= shown else f"{named} and {len(trackers) - shown} more"


class Trackers:
    """The trackers served here: opened when the bucket or a call names one, stopped once
    ended and idle, each with its own fold while this process holds its lease."""

    def __init__(self, nc: Client, config: Config, *, outcome_wait_s: float, fast: bool):
        self.nc = nc
        self.config = config
        self.outcome_wait_s = outcome_wait_s
        self.fast = fast  # False: no call is answered from the own fold
        self.served: dict[str, Tracker] = {}
        self.left_out: dict[str, tuple[str, str]] = {}  # no room here, in the order they came
        self.on_stop: list[Callable[[], None]] = []  # called when a tracker is stopped
        self._opening = asyncio.Lock()  # trackers are opened and stopped one at a time
        self._stopping = 0  # trackers being stopped: they still take their room
        self._followed = False  # the trackers in the bucket at the start are all delivered
        self._shut = False  # stopping: no tracker is opened any more
        self._tasks: set[asyncio.Task[None]] = set()
        self._following: asyncio.Task[None] | None = None

    async def follow(self) -> None:
        """Until every tracker the bucket holds is served (or left out for want of room);
        each one registered later, through any process, is served as it comes."""
        served: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._following = asyncio.create_task(
            self._follow_trackers(served), name="seqstate-slot-trackers"
        )
        await asyncio.wait([served, self._following], return_when=asyncio.FIRST_COMPLETED)
        if not served.done():
            await self._following  # its failure, told

    async def _follow_trackers(self, served: asyncio.Future[None]) -> None:
        """Serve every tracker the bucket holds (``served`` once those there at the start
        are), and each one registered later through any process: an unfiltered ``/loads`` here
        then shows it too, a watch's delivery after its registration was answered."""
        while True:
            try:
                await self._watch_trackers(served)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not served.done():
                    raise
                log.warning("watching the trackers failed (%s); watching again", exc)
                await asyncio.sleep(TRACKERS_RETRY_S)

    async def _watch_trackers(self, served: asyncio.Future[None]) -> None:
        async with contextlib.aclosing(tracker_updates(self.nc, self.config)) as updates:
            async for update in updates:
                if update is None:
                    if not served.done():
                        self._say_left_out()
                        served.set_result(None)
                    continue
                namespace, block_size = update
                try:
                    tracker_of(namespace, self.config.namespace)
                except NotATrackerNamespace:
                    continue  # another deployment's, or no tracker's at all
                tracker = self.served.get(namespace)
                if block_size == TRACKER_ENDED:
                    self.left_out.pop(namespace, None)
                    if tracker is not None:
                        tracker.ended = True
                        self.stop_if_idle(tracker)
                elif tracker is not None:
                    tracker.ended = False
                else:
                    try:
                        opened = await self._open(namespace)
                    except Exception as exc:  # served once a call names it
                        log.warning("cannot serve tracker %s yet: %s", namespace, exc)
                        continue
                    if opened is None:
                        self._leave_out(namespace)
                    else:
                        self.stop_if_idle(opened)

    async def stop(self) -> None:
        self._shut = True
        if self._following is not None:
            await cancel(self._following)
        for tracker in list(self.served.values()):
            if tracker.own is not None:
                await tracker.own.close("serve-http is stopping")
                tracker.own = None
        for task in list(self._tasks):
            with contextlib.suppress(Exception):
                await task
        for tracker in list(self.served.values()):
            await self._close(tracker, "serve-http is stopping")
        self.served = {}

    def spawn(self, work: Awaitable[None]) -> None:
        """Run ``work`` in the background; :meth:`stop` waits for it."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- which trackers -----------------------------------------------------------------

    def named(self, model: str | None, group: str | None) -> list[Tracker]:
        """The trackers served here that a read of ``model`` and ``group`` names."""
        return [
            t
            for t in self.served.values()
            if (model is None or t.model_name == model)
            and (group is None or t.routing_group == group)
        ]

    def unknown(self, model: str | None, group: str | None) -> str | None:
        """The namespace a read names whole (model and group) if this process does not serve
        it yet: it may have been registered through another process a moment ago."""
        if model is None or group is None:
            return None
        namespace = namespace_for(model, group, self.config.namespace)
        return None if namespace in self.served else namespace

    def left_out_of(self, model: str | None, group: str | None) -> list[tuple[str, str]]:
        """The trackers left out here that a read of ``model`` and ``group`` names."""
        return [
            (m, g)
            for m, g in self.left_out.values()
            if (model is None or m == model) and (group is None or g == group)
        ]

    # ---- opening ------------------------------------------------------------------------

    def _room(self) -> bool:
        """Whether this process may serve one tracker more (none once it is stopping)."""
        if self._shut:
            return False
        return len(self.served) + self._stopping < self.config.max_trackers

    async def _open(self, namespace: str) -> Tracker | None:
        """Serve one namespace: offer to run its pipeline, follow its outcomes and bucket.
        None if this process serves its bound of trackers already."""
        tracker = self.served.get(namespace)
        if tracker is not None:
            return tracker
        if not self._room():
            return None
        async with self._opening:
            tracker = self.served.get(namespace)
            if tracker is not None:
                return tracker
            if not self._room():
                return None
            model, group = tracker_of(namespace, self.config.namespace)
            config = self.config.with_namespace(namespace)
            outcomes = await Outcomes(self.nc, config).start()  # before any publish of ours
            try:
                view = await RegistryView(self.nc, config=config).start()
            except BaseException:
                await outcomes.stop()
                raise
            standby = StandbyPipeline(self.nc, config)
            task = asyncio.create_task(standby.run(), name=f"seqstate-standby-{namespace}")
            # A msg-id prefix of its own (the events stream is shared by every namespace, and
            # by every serving process): no two publishers ever deduplicate each other.
            publisher = RouterPublisher(
                self.nc, router_id=f"slots-{uuid.uuid4().hex}", config=config
            )
            tracker = Tracker(model, group, config, standby, task, outcomes, view, publisher)
            tracker.ended = view.block_size is None  # a registration's first: not yet
            self.served[namespace] = tracker
            self.left_out.pop(namespace, None)
            log.info(
                "serving tracker model=%s routing_group=%s",
                model,
                group,
                extra={"namespace": namespace},
            )
            return tracker

    async def existing(self, namespace: str) -> Tracker | None:
        """The namespace's tracker if one exists anywhere (the bucket says), else None; a
        :class:`Rejected` (503) if this process has no room for it."""
        tracker = self.served.get(namespace)
        if tracker is not None:
            return tracker
        if namespace not in self.left_out and not await self._has_tracker(namespace):
            return None
        tracker = await self._open(namespace)
        if tracker is None:
            self._leave_out(namespace)
            raise self._no_room(namespace, new=False)
        return tracker

    async def registering(self, namespace: str) -> Tracker:
        """The tracker a registration goes to, opened if need be; a :class:`Rejected` if this
        process has no room for it: 400 for a new one (nothing is stored), 503 for one that
        another process, with a higher bound, serves."""
        tracker = await self._open(namespace)
        if tracker is not None:
            return tracker
        if namespace in self.left_out or await self._has_tracker(namespace):
            self._leave_out(namespace)
            raise self._no_room(namespace, new=False)
        raise self._no_room(namespace, new=True)

    async def _has_tracker(self, namespace: str) -> bool:
        kv = await self.nc.jetstream().key_value(self.config.registry_bucket)
        try:
            await kv.get(tracker_key(namespace))
        except KeyNotFoundError:  # a deleted key too
            return False
        return True

    def _no_room(self, namespace: str, *, new: bool) -> Rejected:
        """A call to a tracker this process has no room for: 400 for a new one (nothing is
        stored), 503 for one that exists (a process with a higher bound serves it)."""
        model, group = tracker_of(namespace, self.config.namespace)
        where = f"model={model} routing_group={group}"
        bound = f"its bound of {self.config.max_trackers} trackers (--max-trackers)"
        if new:
            why = f"no room for a new slot tracker for {where}: this server serves {bound}; "
            return Rejected(400, why + "unregistering a tracker's last worker frees its room")
        why = f"the slot tracker for {where} is not served by this process: it serves {bound}; "
        return Rejected(503, why + "call a serve-http with a higher bound")

    def _leave_out(self, namespace: str) -> None:
        """A tracker in the bucket this process has no room for: said once, at the end of
        the first pass over the bucket's trackers, or as it comes after that."""
        if namespace in self.left_out:
            return
        model, group = self.left_out[namespace] = tracker_of(namespace, self.config.namespace)
        if self._followed:
            log.warning(
                "not serving tracker model=%s routing_group=%s: this process serves its bound "
                "of %d trackers (--max-trackers); calls naming it are answered 503",
                model,
                group,
                self.config.max_trackers,
                extra={"namespace": namespace},
            )

    def _say_left_out(self) -> None:
        self._followed = True
        if not self.left_out:
            return
        log.warning(
            "not serving %d trackers registered through processes with a higher bound (%s): "
            "this process serves its bound of %d (--max-trackers); calls naming them are "
            "answered 503",
            len(self.left_out),
            listed(self.left_out.values()),
            self.config.max_trackers,
        )

    # ---- calls in flight, and stopping once ended ---------------------------------------

    def hold(self, tracker: Tracker) -> None:
        tracker.calls += 1

    def let_go(self, tracker: Tracker) -> bool:
        """One call on ``tracker`` is done: True if the tracker may be stopped now."""
        tracker.calls -= 1
        return tracker.calls == 0 and tracker.ended

    def done_with(self, tracker: Tracker) -> None:
        if self.let_go(tracker):
            self.spawn(self.stop_ended(tracker))

    def stop_if_idle(self, tracker: Tracker) -> None:
        if tracker.calls == 0 and tracker.ended:
            self.spawn(self.stop_ended(tracker))

    async def stop_ended(self, tracker: Tracker) -> None:
        """Stop serving a tracker that has ended (no call is in flight on it, and the
        bucket, asked now, shows no tracker), then take in one left out for want of room."""
        namespace = tracker.config.namespace
        async with self._opening:
            if self.served.get(namespace) is not tracker or tracker.calls or not tracker.ended:
                return
            try:
                ended = not await self._has_tracker(namespace)
            except Exception as exc:  # looked at again when the watch next tells of it
                log.warning("cannot tell whether tracker %s has ended: %s", namespace, exc)
                return
            if not ended:
                tracker.ended = False
                return
            if tracker.calls:
                return  # a call came meanwhile: its end looks again
            del self.served[namespace]
            for (
                stopped
            ) in self.on_stop:  # caches keyed by its folds' ids, which a new one may reuse
                stopped()
            self._stopping += 1
        try:
            await self._close(tracker, "the tracker has ended")
        finally:
            self._stopping -= 1
        log.info(
            "stopped serving tracker model=%s routing_group=%s: it has no worker",
            tracker.model_name,
            tracker.routing_group,
            extra={"namespace": namespace},
        )
        if self.left_out:
            self.spawn(self._take_left_out())

    async def _take_left_out(self) -> None:
        """Serve the trackers left out for want of room, the oldest first, while there is."""
        for namespace in list(self.left_out):
            if not self._room():
                return
            try:
                if not await self._has_tracker(namespace):
                    self.left_out.pop(namespace, None)  # ended meanwhile
                    continue
                tracker = await self._open(namespace)
            except Exception as exc:
                log.warning("cannot serve tracker %s yet: %s", namespace, exc)
                continue
            if tracker is None:
                return  # no room after all
            self.stop_if_idle(tracker)

    async def _close(self, tracker: Tracker, why: str) -> None:
        """Stop what serves ``tracker``: its answers from the fold, its pipeline (and its
        lease), its outcomes feed and its view."""
        if tracker.stopped:
            return
        tracker.stopped = True
        if tracker.own is not None:
            own, tracker.own = tracker.own, None
            await own.close(why)
        if tracker.newest is not None:
            await tracker.newest.close()
        await cancel_all([tracker.task], None)
        await tracker.outcomes.stop()
        await tracker.view.stop()

    # ---- the lease ----------------------------------------------------------------------

    def own_fold(self, tracker: Tracker) -> OwnFold | None:
        """Where this process's writer folds the tracker: what answers its calls from that
        fold (None: not here, or not ready yet; the deltas answer meanwhile)."""
        if not self.fast:
            return None
        pipeline = tracker.standby.pipeline
        own = tracker.own
        if pipeline is None or not tracker.standby.active.is_set():
            if own is not None:
                self._retire(tracker, "this process no longer holds the tracker's lease")
            return None
        writer = pipeline.writer
        if own is not None and own.writer is writer and not own.closed:
            return own
        if own is not None:
            self._retire(tracker, "the tracker's pipeline restarted")
        if not tracker.opening_own:
            tracker.opening_own = True
            self.spawn(self._open_own(tracker, writer))
        return None

    async def _open_own(self, tracker: Tracker, writer: Writer) -> None:
        try:
            own = await OwnFold(self.nc, writer, answer_within_s=self.outcome_wait_s).start()
        except Exception as exc:
            log.warning("cannot answer from this writer's fold: %s", exc)
            return
        finally:
            tracker.opening_own = False
        if tracker.own is None and not own.closed and not tracker.stopped:
            tracker.own = own
        else:
            await own.close("not needed")

    def _retire(self, tracker: Tracker, why: str) -> None:
        own, tracker.own = tracker.own, None
        if own is not None:
            self.spawn(own.close(why))
