"""The slot-tracker drop-in's logic, apart from the HTTP transport that feeds it.

One call in, one ``(status, JSON body)`` out, as Dynamo's standalone slot tracker answers it
(docs/slot-tracker-api.md), on top of the pipeline:

- each ``(model_name, routing_group)`` is a namespace (:mod:`projector.http.tracker_names`) folded
  by the slot-tracker rules, whose writer and projector run in whichever serving process holds
  its lease (:class:`~projector.run.standby.StandbyPipeline`): every process offers to;
- a mutating call publishes its event and answers with the writer's outcome of it, as soon
  as the writer has folded it: in the process that holds the lease, heard from its own
  writer (:mod:`projector.http.own_fold`); elsewhere, read from the deltas
  (:class:`~projector.route.outcomes.Outcomes`);
- ``/prefill_complete`` and ``/free`` name no worker: their events name the worker and rank
  that hold the request (the add this process stored, else the bucket's view), so they are
  logged on that rank's subject (where ``inspect`` reads) and no ``worker_mismatch`` is counted;
- reads answer from the lease holder's own fold where this process holds every lease they
  read, else from a :class:`~projector.read.reader.RegistryView` per namespace, once it
  reflects every call this process has answered (read-your-writes, paid by the read that
  needs it, not by every write); a registration is answered only once the bucket shows it,
  so another process that is asked about the tracker next finds it there.

A call for a namespace this process does not serve yet looks for the tracker in the bucket
(another process may have created it); with none there, a lifecycle call is ``404 no slot
tracker`` at once, since no writer runs for a namespace that never had a worker.

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
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.js.errors import KeyNotFoundError

from projector.http.http_server import Call, Encoded
from projector.http.own_fold import OwnFold
from projector.http.serde_errors import (
    PARSE_PREFIX,
    accepted_fields,
    error_for_accepted,
    extractor_error,
)
from projector.http.shared_lookup import SharedLookup
from projector.http.slot_api import (
    OK,
    AddBody,
    PotentialLoadsBody,
    RegisterBody,
    RequestBody,
    UnregisterBody,
    answer,
    as_u64,
    event_for,
    register_problem,
    request_event,
)
from projector.http.tracker_names import (
    NotATrackerNamespace,
    TrackerNameTooLong,
    namespace_for,
    tracker_of,
)
from projector.nats import fast_publish
from projector.nats.logs import event_fields
from projector.nats.resources import ensure
from projector.nats.stream import last_seq_of
from projector.nats.tasks import cancel, cancel_all
from projector.read.bucket import tracker_updates
from projector.read.reader import RegistryView
from projector.route.outcomes import Outcomes
from projector.route.publisher import EventTooLarge, PublishError, RouterPublisher
from projector.run.standby import StandbyPipeline
from projector.wire.config import Config
from projector.wire.values import tracker_key
from projector.write.writer import Writer
from seqstate import Delta, LoadRow, PotentialLoadRow, SequenceState
from seqstate.deltas import APPLIED, TRACKER_ENDED
from seqstate.errors import SeqstateError
from seqstate.fold import Verdict

log = logging.getLogger("seqstate.slots")

OUTCOME_WAIT_S = 30.0  # a writer taking over a namespace (a lease TTL) fits well within

_DECODERS: dict[str, msgspec.json.Decoder] = {  # type: ignore[type-arg]
    "/register": msgspec.json.Decoder(RegisterBody),
    "/unregister": msgspec.json.Decoder(UnregisterBody),
    "/add": msgspec.json.Decoder(AddBody),
    "/prefill_complete": msgspec.json.Decoder(RequestBody),
    "/free": msgspec.json.Decoder(RequestBody),
    "/potential_loads": msgspec.json.Decoder(PotentialLoadsBody),
}
TRACKERS_RETRY_S = 1.0  # a watch of the trackers that failed starts again after this
READS = frozenset({"/loads", "/workers", "/potential_loads"})
ROUTES: dict[str, str] = {
    **dict.fromkeys(_DECODERS, "POST"),
    "/loads": "GET",
    "/workers": "GET",
    "/health": "GET",
}


_Body = RegisterBody | UnregisterBody | AddBody | RequestBody


def _now(status: int, payload: object) -> asyncio.Future[tuple[int, object]]:
    answered: asyncio.Future[tuple[int, object]] = asyncio.get_running_loop().create_future()
    answered.set_result((status, payload))
    return answered


def _too_large(exc: EventTooLarge) -> tuple[int, object]:
    """A call whose event is over the size every door allows: nothing is stored (413, as a
    body over the HTTP limit; the error names the limit)."""
    return 413, {"error": str(exc)}


class _Rejected(SeqstateError):
    """A call refused before anything is stored: a body (``answer`` is serde_json's, word for
    word), or a tracker this process has no room for."""

    def __init__(self, status: int, error: str) -> None:
        super().__init__(error)
        self.answer: tuple[int, object] = (status, {"error": error})


def _parse(path: str, body: bytes) -> Any:
    """The body of a call to ``path`` as Dynamo's serde_json reads it, or :class:`_Rejected`:
    msgspec decodes it, and the few bodies the two read differently are settled by serde's
    rules (serde_errors)."""
    decoder = _DECODERS[path]
    try:
        parsed = decoder.decode(body)
    except (msgspec.DecodeError, RecursionError):  # a ValidationError is a DecodeError
        problem = extractor_error(path, body)
        if problem is not None:
            raise _Rejected(*problem) from None
        try:  # one of the few bodies serde reads and msgspec does not
            return msgspec.convert(accepted_fields(path, body), decoder.type)
        except (ValueError, RecursionError, msgspec.ValidationError) as exc:
            raise _Rejected(400, f"{PARSE_PREFIX}{exc}") from None
    problem = error_for_accepted(path, body)
    if problem is not None:
        raise _Rejected(*problem)
    if getattr(parsed, "request_id", None) == "":
        raise _Rejected(422, EMPTY_ID)  # serde takes it; the log keeps no nameless request
    return parsed


EMPTY_ID = "request_id: must not be empty (the ledger keeps no request without an id)"


def _is_json(content_type: str) -> bool:
    """axum's test: ``application/json`` or any ``application/*+json``, parameters aside."""
    mime = content_type.split(";", 1)[0].strip().lower()
    kind, _, subtype = mime.partition("/")
    return kind == "application" and (subtype == "json" or subtype.endswith("+json"))


class LoadOut(msgspec.Struct):
    model_name: str
    routing_group: str
    worker_id: int
    dp_rank: int
    active_prefill_tokens: int
    active_decode_blocks: int


class WorkerOut(msgspec.Struct):
    worker_id: int
    model_name: str
    routing_group: str
    block_size: int
    dp_start: int
    dp_size: int


MAX_BOOKED = 65_536  # per tracker: the adds this process published that are not freed yet


@dataclass
class _Tracker:
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


class _AwaitedCall:
    """A call made through :meth:`SlotService.call` (tests, tools): its answer as a future."""

    __slots__ = ("body", "content_type", "method", "path", "query", "result")

    def __init__(
        self, method: str, path: str, query: dict[str, str], content_type: str | None, body: bytes
    ) -> None:
        self.method, self.path, self.query = method, path, query
        self.content_type, self.body = content_type, body
        self.result: asyncio.Future[tuple[int, object]] = asyncio.get_running_loop().create_future()

    def begun(self) -> None:
        pass

    @property
    def conn(self) -> object:
        """What orders calls (:class:`Call`'s connection): each awaited call is on its own,
        in no order with calls made at the same time."""
        return self

    def answer(self, status: int, payload: object) -> None:
        if type(payload) is Encoded:  # a cached read: as a client would decode it
            payload = msgspec.json.decode(payload.data)
        if not self.result.done():
            self.result.set_result((status, payload))


# The POSTs the lease holder answers from its own fold, without a task each.
FOLDED_HERE = frozenset({"/add", "/prefill_complete", "/free", "/potential_loads"})
READ_CACHE = 64  # read bodies kept (distinct path and query pairs)


def _load_rows(t: _Tracker, rows: list[LoadRow]) -> list[LoadOut]:
    """``/loads``' rows of one tracker (the registry's, sorted by worker and rank)."""
    return [
        LoadOut(
            t.model_name,
            t.routing_group,
            row.worker_id,
            row.dp_rank,
            row.active_prefill_tokens,
            row.active_blocks,
        )
        for row in rows
    ]


def _worker_rows(t: _Tracker, rows: list[LoadRow], block_size: int) -> list[WorkerOut]:
    """``/workers``' rows of one tracker: a worker's ranks as one range."""
    ranks: dict[int, list[int]] = {}
    for row in rows:
        ranks.setdefault(row.worker_id, []).append(row.dp_rank)
    return [
        WorkerOut(worker_id, t.model_name, t.routing_group, block_size, min(dp), len(dp))
        for worker_id, dp in sorted(ranks.items())
    ]


class SlotService:
    """``service = await SlotService(nc, config).start()``; ``await service.call(...)``."""

    def __init__(self, nc: Client, config: Config, *, outcome_wait_s: float = OUTCOME_WAIT_S):
        self.nc = nc
        # The slot tracker's rules, always: no grace, no Dynamo capture (nor its lease).
        self.config = dataclasses.replace(
            config, rules="slot-tracker", worker_grace_s=0.0, dynamo_endpoint=None
        )
        self.outcome_wait_s = outcome_wait_s
        self.trackers: dict[str, _Tracker] = {}
        self._js = nc.jetstream()
        self._answered: dict[str, int] = {}  # per namespace: the last event answered
        self._opening = asyncio.Lock()  # trackers are opened and stopped one at a time
        self._stopping = 0  # trackers being stopped: they still take their room
        # Trackers in the bucket this process has no room for, in the order they came.
        self._left_out: dict[str, tuple[str, str]] = {}
        self._followed = False  # the trackers in the bucket at the start are all delivered
        self._shut = False  # stopping: no tracker is opened any more
        self._fast = fast_publish.usable(nc)  # False: every call takes the slow path
        # (path, query) -> (the positions of the folds read, the body): see _read_here
        self._read_cache: dict[tuple[object, ...], tuple[tuple[tuple[int, int], ...], Encoded]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        self._following: asyncio.Task[None] | None = None

    async def start(self) -> SlotService:
        """Provision, then serve every tracker the bucket holds."""
        await ensure(self.nc, self.config)
        if not self._fast:
            log.warning(
                "this nats-py keeps no pending buffer serve-http can publish into: every "
                "call waits for its outcome from the deltas stream, much slower"
            )
        served: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._following = asyncio.create_task(
            self._follow_trackers(served), name="seqstate-slot-trackers"
        )
        await asyncio.wait([served, self._following], return_when=asyncio.FIRST_COMPLETED)
        if not served.done():
            await self._following  # its failure, told
        return self

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
                tracker = self.trackers.get(namespace)
                if block_size == TRACKER_ENDED:
                    self._left_out.pop(namespace, None)
                    if tracker is not None:
                        tracker.ended = True
                        self._stop_if_idle(tracker)
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
                        self._stop_if_idle(opened)

    async def stop(self) -> None:
        self._shut = True
        if self._following is not None:
            await cancel(self._following)
        for tracker in list(self.trackers.values()):
            if tracker.own is not None:
                await tracker.own.close("serve-http is stopping")
                tracker.own = None
        for task in list(self._closing):
            with contextlib.suppress(Exception):
                await task
        for tracker in list(self.trackers.values()):
            await self._close(tracker, "serve-http is stopping")
        self.trackers = {}

    # ---- the trackers -----------------------------------------------------------------------

    def _room(self) -> bool:
        """Whether this process may serve one tracker more (none once it is stopping)."""
        if self._shut:
            return False
        return len(self.trackers) + self._stopping < self.config.max_trackers

    async def _open(self, namespace: str) -> _Tracker | None:
        """Serve one namespace: offer to run its pipeline, follow its outcomes and bucket.
        None if this process serves its bound of trackers already."""
        tracker = self.trackers.get(namespace)
        if tracker is not None:
            return tracker
        if not self._room():
            return None
        async with self._opening:
            tracker = self.trackers.get(namespace)
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
            tracker = _Tracker(model, group, config, standby, task, outcomes, view, publisher)
            tracker.ended = view.block_size is None  # a registration's first: not yet
            self.trackers[namespace] = tracker
            self._left_out.pop(namespace, None)
            log.info(
                "serving tracker model=%s routing_group=%s",
                model,
                group,
                extra={"namespace": namespace},
            )
            return tracker

    async def _existing(self, namespace: str) -> _Tracker | None:
        """The namespace's tracker if one exists anywhere (the bucket says), else None; a
        :class:`_Rejected` (503) if this process has no room for it."""
        tracker = self.trackers.get(namespace)
        if tracker is not None:
            return tracker
        if namespace not in self._left_out and not await self._has_tracker(namespace):
            return None
        tracker = await self._open(namespace)
        if tracker is None:
            self._leave_out(namespace)
            raise self._no_room(namespace, new=False)
        return tracker

    async def _registering(self, namespace: str) -> _Tracker:
        """The tracker a registration goes to, opened if need be; a :class:`_Rejected` if this
        process has no room for it: 400 for a new one (nothing is stored), 503 for one that
        another process, with a higher bound, serves."""
        tracker = await self._open(namespace)
        if tracker is not None:
            return tracker
        if namespace in self._left_out or await self._has_tracker(namespace):
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

    def _no_room(self, namespace: str, *, new: bool) -> _Rejected:
        """A call to a tracker this process has no room for: 400 for a new one (nothing is
        stored), 503 for one that exists (a process with a higher bound serves it)."""
        model, group = tracker_of(namespace, self.config.namespace)
        where = f"model={model} routing_group={group}"
        bound = f"its bound of {self.config.max_trackers} trackers (--max-trackers)"
        if new:
            why = f"no room for a new slot tracker for {where}: this server serves {bound}; "
            return _Rejected(400, why + "unregistering a tracker's last worker frees its room")
        why = f"the slot tracker for {where} is not served by this process: it serves {bound}; "
        return _Rejected(503, why + "call a serve-http with a higher bound")

    def _leave_out(self, namespace: str) -> None:
        """A tracker in the bucket this process has no room for: said once, at the end of
        the first pass over the bucket's trackers, or as it comes after that."""
        if namespace in self._left_out:
            return
        model, group = self._left_out[namespace] = tracker_of(namespace, self.config.namespace)
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
        if not self._left_out:
            return
        log.warning(
            "not serving %d trackers registered through processes with a higher bound (%s): "
            "this process serves its bound of %d (--max-trackers); calls naming them are "
            "answered 503",
            len(self._left_out),
            _listed(self._left_out.values()),
            self.config.max_trackers,
        )

    def _left_out_of(self, model: str | None, group: str | None) -> list[tuple[str, str]]:
        """The trackers left out here that a read of ``model`` and ``group`` names."""
        return [
            (m, g)
            for m, g in self._left_out.values()
            if (model is None or m == model) and (group is None or g == group)
        ]

    def _hold(self, tracker: _Tracker) -> None:
        tracker.calls += 1

    def _let_go(self, tracker: _Tracker) -> bool:
        """One call on ``tracker`` is done: True if the tracker may be stopped now."""
        tracker.calls -= 1
        return tracker.calls == 0 and tracker.ended

    def _done_with(self, tracker: _Tracker) -> None:
        if self._let_go(tracker):
            self._spawn(self._stop_ended(tracker))

    def _stop_if_idle(self, tracker: _Tracker) -> None:
        if tracker.calls == 0 and tracker.ended:
            self._spawn(self._stop_ended(tracker))

    async def _stop_ended(self, tracker: _Tracker) -> None:
        """Stop serving a tracker that has ended (no call is in flight on it, and the
        bucket, asked now, shows no tracker), then take in one left out for want of room."""
        namespace = tracker.config.namespace
        async with self._opening:
            if self.trackers.get(namespace) is not tracker or tracker.calls or not tracker.ended:
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
            del self.trackers[namespace]
            self._answered.pop(namespace, None)
            self._read_cache.clear()  # keyed by its folds' ids, which a new one may reuse
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
        if self._left_out:
            self._spawn(self._take_left_out())

    async def _take_left_out(self) -> None:
        """Serve the trackers left out for want of room, the oldest first, while there is."""
        for namespace in list(self._left_out):
            if not self._room():
                return
            try:
                if not await self._has_tracker(namespace):
                    self._left_out.pop(namespace, None)  # ended meanwhile
                    continue
                tracker = await self._open(namespace)
            except Exception as exc:
                log.warning("cannot serve tracker %s yet: %s", namespace, exc)
                continue
            if tracker is None:
                return  # no room after all
            self._stop_if_idle(tracker)

    async def _close(self, tracker: _Tracker, why: str) -> None:
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

    # ---- calls ------------------------------------------------------------------------------

    async def call(
        self, method: str, path: str, query: dict[str, str], content_type: str | None, body: bytes
    ) -> tuple[int, object]:
        """One HTTP call: its status and its JSON body (None: an empty body)."""
        call = _AwaitedCall(method, path, query, content_type, body)
        try:
            self.submit(call)  # type: ignore[arg-type]  # the same two methods as Call
        except Exception:
            log.exception("call %s %s failed", method, path)
            call.answer(500, {"error": "internal error"})
        return await call.result

    # ---- the lease holder's own calls: answered from its fold, without a task each --------

    def submit(self, call: Call) -> None:
        """Start one HTTP call (:class:`projector.http.http_server.Handler`).

        Where this process holds the tracker's lease, a lifecycle call's event is published
        at once and the call answered from the writer's fold of it (:mod:`.own_fold`), and a
        read is answered from that fold at once: no task, no future. Everything else
        (registrations, a tracker not served yet, a process that does not hold the lease)
        takes :meth:`begin`'s path. Names too long to be a tracker's (its namespace is a
        token of NATS subjects) are 400 before anything reaches NATS."""
        try:
            self._submit(call)
        except TrackerNameTooLong as exc:
            call.answer(400, {"error": str(exc)})

    def health(self) -> tuple[int, object]:
        """``GET /health``: Dynamo's 200 with an empty body while this process can serve
        calls; 503 while NATS is disconnected (the client reconnects meanwhile), which a
        Kubernetes probe or a load balancer reads as not ready."""
        if self.nc.is_connected:
            return 200, None
        return 503, {"error": "not ready: NATS is disconnected (reconnecting)"}

    def _submit(self, call: Call) -> None:
        path = call.path
        if call.method in ("GET", "HEAD"):
            if path == "/health":
                call.answer(*self.health())
                return
            if path in READS and path != "/potential_loads":
                writers = self._states(call.query)
                if writers is not None:
                    call.answer(200, self._read_here(path, call.query, writers))
                    return
        elif (
            call.method == "POST"
            and path in FOLDED_HERE
            and call.content_type is not None
            and _is_json(call.content_type)
        ):
            try:
                parsed = _parse(path, call.body)
            except _Rejected as rejected:
                call.answer(*rejected.answer)
                return
            if isinstance(parsed, PotentialLoadsBody):
                writer = self._fold_of(parsed.model_name, parsed.routing_group)
                if writer is not None:
                    state = writer.state
                    registry = state.registry if len(state.registry) else None
                    call.answer(*_potential_answer(parsed, registry, state.now_ns))
                    return
            else:
                namespace = namespace_for(
                    parsed.model_name, parsed.routing_group, self.config.namespace
                )
                tracker = self.trackers.get(namespace)
                commit = None if tracker is None else self._commit(tracker)
                if tracker is not None and commit is not None:
                    self._fold_here(tracker, commit, path, parsed, call)
                    return
        self._spawn(self._begin_and_answer(call))

    async def _begin_and_answer(self, call: Call) -> None:
        try:
            pending = await self.begin(
                call.method, call.path, call.query, call.content_type, call.body
            )
            call.begun()
            status, payload = await pending
        except TrackerNameTooLong as exc:
            status, payload = 400, {"error": str(exc)}
        except _Rejected as rejected:  # no room for the tracker it names
            status, payload = rejected.answer
        except (nats.errors.Error, TimeoutError, ConnectionError) as exc:
            # NATS away or not answering: not a bug of ours, and a client may try again
            status, payload = 503, {"error": self._nats_failed(exc)}
        except Exception:  # a bug must not take the connection's other calls with it
            log.exception("call %s %s failed", call.method, call.path)  # never its body
            status, payload = 500, {"error": "internal error"}
        call.answer(status, payload)

    def _nats_failed(self, exc: BaseException) -> str:
        away = "" if self.nc.is_connected else " (NATS is disconnected, reconnecting)"
        return f"NATS failed the call: {exc or type(exc).__name__}{away}"

    def _commit(self, tracker: _Tracker) -> OwnFold | None:
        """Where this process's writer folds the tracker: what answers its calls from that
        fold (None: not here, or not ready yet; the slow path answers meanwhile)."""
        if not self._fast:
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
            self._spawn(self._open_own(tracker, writer))
        return None

    async def _open_own(self, tracker: _Tracker, writer: Writer) -> None:
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

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _retire(self, tracker: _Tracker, why: str) -> None:
        own, tracker.own = tracker.own, None
        if own is not None:
            self._spawn(own.close(why))

    def _fold_here(
        self, tracker: _Tracker, commit: OwnFold, path: str, parsed: _Body, call: Call
    ) -> None:
        """Publish a lifecycle call's event; the writer's fold of it answers it."""
        if isinstance(parsed, RequestBody):
            worker, rank = tracker.holder(
                parsed.request_id, ending=path == "/free", state=commit.writer.state
            )
            event = request_event(path, parsed, worker, rank)
        else:
            event = event_for(parsed)
        try:
            event, payload = tracker.publisher.check(event)
        except EventTooLarge as exc:
            call.answer(*_too_large(exc))
            return
        if isinstance(parsed, AddBody):
            tracker.book(parsed.request_id, (parsed.worker_id, parsed.dp_rank))
        namespace = tracker.config.namespace

        def folded(seq: int, verdict: Verdict) -> None:
            if type(verdict) is not Delta:
                outcome, owner, block_size = None, None, None
            else:
                outcome, owner, block_size = verdict.outcome, verdict.owner, verdict.block_size
            if isinstance(parsed, AddBody):
                tracker.settle(
                    parsed.request_id, (parsed.worker_id, parsed.dp_rank), outcome, owner
                )
            if outcome is not None and seq > self._answered.get(namespace, 0):
                self._answered[namespace] = seq
            call.answer(*answer(path, parsed, outcome, owner=owner, block_size=block_size))
            self._done_with(tracker)

        def failed(seq: int, index: int, why: str) -> None:
            if seq:  # stored, folded by another writer: its delta says how
                self._spawn(self._late(tracker, path, parsed, seq, index, event, call))
                return
            if isinstance(parsed, AddBody):
                tracker.settle(parsed.request_id, (parsed.worker_id, parsed.dp_rank), None, None)
            call.answer(503, {"error": f"no answer for the call's event: {why}"})
            self._done_with(tracker)

        self._hold(tracker)
        try:
            commit.submit(
                tracker.publisher.subject_for(event), payload, folded, failed, order=call.conn
            )
        except BaseException:
            self._done_with(tracker)
            raise
        call.begun()

    async def _late(
        self,
        tracker: _Tracker,
        path: str,
        parsed: _Body,
        seq: int,
        index: int,
        event: object,
        call: Call,
    ) -> None:
        try:
            status, payload = await self._finish(tracker, path, parsed, seq, event, index)
        except Exception as exc:
            log.warning("%s: no outcome for stored event %d: %s", path, seq, exc)
            status, payload = 503, {"error": f"stored as event {seq}, outcome unknown: {exc}"}
        finally:
            self._done_with(tracker)
        call.answer(status, payload)

    def _states(self, query: dict[str, str]) -> list[tuple[_Tracker, Writer]] | None:
        """The trackers a read names, each with its writer, if this process folds every one
        of them and each fold holds every call this process answered; else None."""
        model, group = query.get("model_name"), query.get("routing_group")
        if self._unknown(model, group) or (self._left_out and self._left_out_of(model, group)):
            return None
        found = []
        for t in self.trackers.values():
            if (model is None or t.model_name == model) and (
                group is None or t.routing_group == group
            ):
                commit = self._commit(t)
                if commit is None:
                    return None
                writer = commit.writer
                if writer.stats.last_seq < self._answered.get(t.config.namespace, 0):
                    return None
                found.append((t, writer))
        found.sort(key=lambda f: (f[0].model_name, f[0].routing_group))
        return found

    def _fold_of(self, model_name: str, routing_group: str) -> Writer | None:
        """The writer whose fold answers a read of one tracker here: this process holds its
        lease, and the fold holds every call this process answered; else None."""
        found = self._states({"model_name": model_name, "routing_group": routing_group})
        return found[0][1] if found else None

    def _read_here(
        self, path: str, query: dict[str, str], writers: list[tuple[_Tracker, Writer]]
    ) -> Encoded:
        """A read's body from the writers' folds; encoded once per position of the folds it
        reads (a scheduler polling ``/loads`` between two events reads the same bytes)."""
        key = (path, tuple(sorted(query.items())))
        position = tuple((id(w.state), w.stats.last_seq) for _, w in writers)
        cached = self._read_cache.get(key)
        if cached is not None and cached[0] == position:
            return cached[1]
        body = Encoded(msgspec.json.encode(self._rows(path, writers)))
        if len(self._read_cache) >= READ_CACHE:
            self._read_cache.clear()
        self._read_cache[key] = (position, body)
        return body

    def _rows(self, path: str, writers: list[tuple[_Tracker, Writer]]) -> object:
        out: list[Any] = []
        for t, writer in writers:
            state = writer.state
            rows = state.registry.loads(state.now_ns)
            if path == "/loads":
                out.extend(_load_rows(t, rows))
            else:
                out.extend(_worker_rows(t, rows, state.block_size or 0))
        return out

    @staticmethod
    def allowed(path: str) -> str | None:
        """A route's ``Allow`` header, as axum lists it."""
        wanted = ROUTES.get(path)
        return None if wanted is None else "GET,HEAD" if wanted == "GET" else wanted

    @staticmethod
    def reads(path: str) -> bool:
        """A call that must see the answers of every call before it on its connection."""
        return path in READS

    async def begin(
        self, method: str, path: str, query: dict[str, str], content_type: str | None, body: bytes
    ) -> Awaitable[tuple[int, object]]:
        """One call up to the moment its event is stored; what it returns gives the answer.

        Why two steps: calls pipelined on one connection must take effect in order, so each is
        begun only once the one before it has begun (its event stored, hence ahead of this one
        in the log), but the long part, the writer folding the event, is waited for by all of
        them at once. A read has nothing to store: it is answered here.
        """
        wanted = ROUTES.get(path)
        if wanted is None:
            return _now(404, {"error": "route not found"})
        if method == "HEAD" and wanted == "GET":  # as axum routes it: a GET without its body
            method = "GET"
        if method != wanted:
            return _now(405, {"error": "method not allowed"})
        if path == "/health":
            return _now(*self.health())
        if wanted == "GET":
            return _now(200, await self._read(path, query))
        if content_type is None or not _is_json(content_type):
            return _now(415, {"error": "Expected request with `Content-Type: application/json`"})
        try:
            parsed = _parse(path, body)
        except _Rejected as rejected:
            return _now(*rejected.answer)
        return await self._begin_write(path, parsed)

    async def _begin_write(self, path: str, parsed: _Body) -> Awaitable[tuple[int, object]]:
        """:meth:`begin` for a parsed POST: its tracker found or opened, its event stored."""
        namespace = namespace_for(parsed.model_name, parsed.routing_group, self.config.namespace)
        if isinstance(parsed, PotentialLoadsBody):
            return _now(*await self._potential(namespace, parsed))
        if isinstance(parsed, RegisterBody):
            problem = self._register_problem(parsed)
            if problem is not None:
                return _now(400, {"error": problem})
            tracker: _Tracker | None = await self._registering(namespace)
        else:
            tracker = await self._existing(namespace)
        if tracker is None:
            if isinstance(parsed, UnregisterBody):
                return _now(*answer(path, parsed, "unknown_worker"))
            return _now(404, {"error": f"no slot tracker for {parsed.where()}"})
        self._hold(tracker)
        try:
            if isinstance(parsed, RequestBody):
                worker, rank = tracker.holder(parsed.request_id, ending=path == "/free")
                event = request_event(path, parsed, worker, rank)
            else:
                event = event_for(parsed)
            if tracker.own is not None:  # the calls gathered for its group commit go first
                tracker.own.flush()
            seq = await tracker.publisher.publish(event)
        except (EventTooLarge, PublishError) as exc:
            await self._finished(tracker, parsed)
            if isinstance(exc, EventTooLarge):
                return _now(*_too_large(exc))
            return _now(503, {"error": f"not stored: {exc}"})  # a full disk, JetStream off
        except BaseException:
            self._done_with(tracker)
            raise
        if isinstance(parsed, AddBody):
            tracker.book(parsed.request_id, (parsed.worker_id, parsed.dp_rank))
        return self._finishing(tracker, path, parsed, seq, event)

    async def _finishing(
        self, tracker: _Tracker, path: str, parsed: _Body, seq: int, event: object
    ) -> tuple[int, object]:
        try:
            answered = await self._finish(tracker, path, parsed, seq, event)
        except BaseException:
            self._done_with(tracker)
            raise
        await self._finished(tracker, parsed)
        return answered

    async def _finished(self, tracker: _Tracker, parsed: _Body) -> None:
        """A call on ``tracker`` is done. A registration's or unregistration's leaves the
        tracker as its view shows it (the answer waited for that): one that ended it, or a
        registration that did not create it, stops it before the call is answered, so that
        its room is free for the next."""
        if isinstance(parsed, (RegisterBody, UnregisterBody)):
            tracker.ended = tracker.view.block_size is None
        if self._let_go(tracker):
            await self._stop_ended(tracker)

    async def _read(self, path: str, query: dict[str, str]) -> object:
        """The body of a GET: a read has nothing to store, so it is answered when begun."""
        if path == "/loads":
            return await self._loads(query)
        return await self._workers(query)

    def _register_problem(self, parsed: RegisterBody) -> str | None:
        """What Dynamo refuses in a registration, then what only the ledger bounds."""
        problem = register_problem(parsed)
        if problem is None and parsed.dp_size > self.config.max_ranks_per_worker:
            # Dynamo has no bound; the ledger does (a worker's ranks are its keys).
            problem = (
                f"dp_size {parsed.dp_size} is over this ledger's bound of "
                f"{self.config.max_ranks_per_worker} ranks per worker "
                "(--max-ranks-per-worker)"
            )
        return problem

    async def _finish(
        self, tracker: _Tracker, path: str, parsed: _Body, seq: int, event: object, index: int = 0
    ) -> tuple[int, object]:
        """The answer to a stored event (``index``: its place in a record batch): the
        writer's outcome of it."""
        result = await tracker.outcomes.of(seq, self.outcome_wait_s, index=index)
        if result.outcome != APPLIED and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: %s",
                path,
                result.outcome or "refused by the writer",
                extra={
                    **event_fields(event),
                    "stream_seq": seq,
                    "namespace": tracker.config.namespace,
                },
            )
        if isinstance(parsed, AddBody):
            tracker.settle(
                parsed.request_id, (parsed.worker_id, parsed.dp_rank), result.outcome, result.owner
            )
        if result.outcome is None:  # refused by the writer: nothing for a view to show
            return answer(path, parsed, None)
        namespace = tracker.config.namespace
        if seq > self._answered.get(namespace, 0):
            self._answered[namespace] = seq
        if isinstance(parsed, (RegisterBody, UnregisterBody)):
            await tracker.view.wait_for(seq, self.outcome_wait_s)  # in the bucket for all
        return answer(
            path, parsed, result.outcome, owner=result.owner, block_size=result.block_size
        )

    # ---- reads ------------------------------------------------------------------------------

    async def _caught_up(self, tracker: _Tracker) -> None:
        """Until the tracker's view reflects every call answered before this read began, by
        this process or any other (read-your-writes across replicas)."""
        await tracker.view.wait_for(await self._read_position(tracker), self.outcome_wait_s)

    async def _read_position(self, tracker: _Tracker) -> int:
        """The event a read must reflect: the last one folded where the namespace is folded
        when the read began, as far as deltas name it (a refused event has none).

        Any call answered anywhere was folded by the lease holder first (its own fold answers
        it, or its outcome does). The holder's writer has folded it then; elsewhere the
        namespace's newest stored event is asked for, and its outcome waited for, which comes
        only after every event before it was folded: one lookup for every read that waits
        together (:mod:`.shared_lookup`), none per read.
        """
        config = tracker.config
        target = self._answered.get(config.namespace, 0)
        pipeline = tracker.standby.pipeline
        if pipeline is not None and tracker.standby.active.is_set():
            return max(target, pipeline.writer.deltas.appended)
        if tracker.newest is None:
            tracker.newest = SharedLookup(lambda: self._newest_folded(config, tracker.outcomes))
        await tracker.newest.wait()
        return max(target, tracker.outcomes.named)

    async def _newest_folded(self, config: Config, outcomes: Outcomes) -> None:
        """Until the namespace's newest stored event, asked now, is folded (its outcome seen)."""
        stored = await last_seq_of(self._js, config.events_stream, config.events_subjects)
        await outcomes.folded(stored, self.outcome_wait_s)

    def _unknown(self, model: str | None, group: str | None) -> str | None:
        """The namespace a read names whole (model and group) if this process does not serve
        it yet: it may have been registered through another process a moment ago."""
        if model is None or group is None:
            return None
        namespace = namespace_for(model, group, self.config.namespace)
        return None if namespace in self.trackers else namespace

    async def _matching(self, query: dict[str, str]) -> list[_Tracker]:
        """The trackers a read names, caught up; a :class:`_Rejected` (503) if this process
        leaves out one of them for want of room (an answer without it would be wrong)."""
        model, group = query.get("model_name"), query.get("routing_group")
        named = self._unknown(model, group)
        if named is not None:
            await self._existing(named)
        left_out = self._left_out_of(model, group)
        if left_out:
            raise _Rejected(
                503,
                f"this process serves its bound of {self.config.max_trackers} slot trackers "
                f"(--max-trackers) and leaves out {len(left_out)} that this read names "
                f"({_listed(left_out)}); name one it serves, or call a serve-http with a "
                "higher bound",
            )
        found = sorted(
            (
                t
                for t in self.trackers.values()
                if (model is None or t.model_name == model)
                and (group is None or t.routing_group == group)
            ),
            key=lambda t: (t.model_name, t.routing_group),
        )
        for tracker in found:
            self._hold(tracker)
        try:
            for tracker in found:
                await self._caught_up(tracker)
        finally:
            for tracker in found:
                self._done_with(tracker)
        return found

    async def _loads(self, query: dict[str, str]) -> list[LoadOut]:
        return [row for t in await self._matching(query) for row in _load_rows(t, t.view.loads())]

    async def _workers(self, query: dict[str, str]) -> list[WorkerOut]:
        out = []
        for t in await self._matching(query):
            out.extend(_worker_rows(t, t.view.loads(), t.view.block_size or 0))
        return out

    async def _potential(self, namespace: str, body: PotentialLoadsBody) -> tuple[int, object]:
        tracker = await self._existing(namespace)
        if tracker is None:
            return _potential_answer(body, None, 0)
        self._hold(tracker)
        try:
            await self._caught_up(tracker)
            view = tracker.view
            return _potential_answer(body, view if view.loads() else None, view.log_now_ns())
        finally:
            self._done_with(tracker)


def _listed(trackers: Iterable[tuple[str, str]], shown: int = 3) -> str:
    """A few trackers by name, and how many more (a log line or an error stays short)."""
    trackers = list(trackers)
    named = ", ".join(f"model={m} routing_group={g}" for m, g in trackers[:shown])
    return named if len(trackers) <= shown else f"{named} and {len(trackers) - shown} more"


class _PotentialSource(Protocol):
    """A fold's registry, or a view of one."""

    def potential_loads(
        self, block_hashes: Sequence[int], isl_tokens: int, now_ns: int
    ) -> list[PotentialLoadRow]: ...


def _potential_answer(
    body: PotentialLoadsBody, source: _PotentialSource | None, now_ns: int
) -> tuple[int, object]:
    """``/potential_loads`` at ``now_ns`` from ``source``; 404 while the tracker has no rank
    (``source`` None)."""
    if source is None:
        return 404, {"error": f"no slot tracker for {body.where()}"}
    hashes = [as_u64(h) for h in body.sequence_hashes]
    return 200, source.potential_loads(hashes, body.new_isl_tokens, now_ns)


__all__ = ["OK", "ROUTES", "SlotService"]
