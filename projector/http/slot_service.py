"""The slot-tracker drop-in's logic, apart from the HTTP transport that feeds it.

One call in, one ``(status, JSON body)`` out, as Dynamo's standalone slot tracker answers it
(docs/slot-tracker-api.md), on top of the pipeline:

- each ``(model_name, routing_group)`` is a tracker (:mod:`.slot_trackers`), folded by a writer
  in whichever serving process holds its lease;
- a call is checked once (:mod:`.slot_routes`); a mutating call publishes its event and
  answers with the writer's outcome of it, as soon as the writer has folded it: in the process
  that holds the lease, heard from its own writer (:mod:`.own_fold`), else read from the deltas
  (:class:`~projector.route.outcomes.Outcomes`). Which of the two tells the outcome is all
  that differs: both build the event and the answer, and book the add, the same way
  (``_event``, ``_answer``);
- ``/prefill_complete`` and ``/free`` name no worker: their events name the worker and rank
  that hold the request (the add this process stored, else the fold's or the bucket's view),
  so they are logged on that rank's subject (where ``inspect`` reads) and no
  ``worker_mismatch`` is counted;
- reads (:mod:`.slot_reads`) answer from the lease holder's own fold where this process holds
  every lease they read, else from views caught up with every call answered; a registration
  is answered only once the bucket shows it, so another process that is asked about the
  tracker next finds it there.

A call for a namespace this process does not serve yet looks for the tracker in the bucket
(another process may have created it); with none there, a lifecycle call is ``404 no slot
tracker`` at once, since no writer runs for a namespace that never had a worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable

import msgspec
import nats.errors
from nats.aio.client import Client

from projector.http import slot_routes
from projector.http.http_server import Call, Encoded
from projector.http.own_fold import OwnFold
from projector.http.slot_api import (
    OK,
    AddBody,
    PotentialLoadsBody,
    RegisterBody,
    RequestBody,
    UnregisterBody,
    answer,
    event_for,
    register_problem,
    request_event,
)
from projector.http.slot_reads import SlotReads
from projector.http.slot_routes import ROUTES, Body, Read, Rejected
from projector.http.slot_trackers import Tracker, Trackers
from projector.http.tracker_names import TrackerNameTooLong, namespace_for
from projector.nats import fast_publish
from projector.nats.resources import ensure
from projector.route.publisher import EventTooLarge, PublishError
from projector.settings.config import Config
from projector.settings.logs import event_fields
from seqstate import Delta, Event
from seqstate.deltas import APPLIED
from seqstate.fold import Verdict

log = logging.getLogger("seqstate.slots")

OUTCOME_WAIT_S = 30.0  # a writer taking over a namespace (a lease TTL) fits well within


def _now(status: int, payload: object) -> asyncio.Future[tuple[int, object]]:
    answered: asyncio.Future[tuple[int, object]] = asyncio.get_running_loop().create_future()
    answered.set_result((status, payload))
    return answered


def _too_large(exc: EventTooLarge) -> tuple[int, object]:
    """A call whose event is over the size every door allows: nothing is stored (413, as a
    body over the HTTP limit; the error names the limit)."""
    return 413, {"error": str(exc)}


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


class SlotService:
    """``service = await SlotService(nc, config).start()``; ``await service.call(...)``."""

    def __init__(self, nc: Client, config: Config, *, outcome_wait_s: float = OUTCOME_WAIT_S):
        self.nc = nc
        # The slot tracker's rules, always: no grace, no Dynamo capture (nor its lease).
        self.config = dataclasses.replace(
            config, rules="slot-tracker", worker_grace_s=0.0, dynamo_endpoint=None
        )
        self.outcome_wait_s = outcome_wait_s
        self._fast = fast_publish.usable(nc)  # False: every call waits for the deltas
        self._trackers = Trackers(nc, self.config, outcome_wait_s=outcome_wait_s, fast=self._fast)
        self._reads = SlotReads(self._trackers, nc.jetstream(), outcome_wait_s=outcome_wait_s)

    @property
    def trackers(self) -> dict[str, Tracker]:
        """The trackers this process serves, by namespace."""
        return self._trackers.served

    async def start(self) -> SlotService:
        """Provision, then serve every tracker the bucket holds."""
        await ensure(self.nc, self.config)
        if not self._fast:
            log.warning(
                "this nats-py keeps no pending buffer serve-http can publish into: every "
                "call waits for its outcome from the deltas stream, much slower"
            )
        await self._trackers.follow()
        return self

    async def stop(self) -> None:
        await self._trackers.stop()

    allowed = staticmethod(slot_routes.allowed)
    reads = staticmethod(slot_routes.reads)

    def health(self) -> tuple[int, object]:
        """``GET /health``: Dynamo's 200 with an empty body while this process can serve
        calls; 503 while NATS is disconnected (the client reconnects meanwhile), which a
        Kubernetes probe or a load balancer reads as not ready."""
        if self.nc.is_connected:
            return 200, None
        return 503, {"error": "not ready: NATS is disconnected (reconnecting)"}

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

    def submit(self, call: Call) -> None:
        """Start one HTTP call (:class:`projector.http.http_server.Handler`).

        Checked once (:func:`~.slot_routes.route`). Where this process holds the tracker's
        lease, a lifecycle call's event is published at once and the call answered from the
        writer's fold of it (:mod:`.own_fold`), and a read is answered from that fold at once:
        no task, no future. Everything else (registrations, a tracker not served yet, a
        process that does not hold the lease) takes a task of its own (:meth:`_begin`).
        Names too long to be a tracker's (its namespace is a token of NATS subjects) are 400
        before anything reaches NATS."""
        try:
            self._submit(call)
        except TrackerNameTooLong as exc:
            call.answer(400, {"error": str(exc)})

    def _submit(self, call: Call) -> None:
        what = slot_routes.route(call.method, call.path, call.content_type, call.body)
        if what is None:
            call.answer(*self.health())
            return
        if isinstance(what, tuple):
            call.answer(*what)
            return
        if isinstance(what, Read):
            body = self._reads.here(what.path, call.query)
            if body is not None:
                call.answer(200, body)
                return
        elif isinstance(what, PotentialLoadsBody):
            answered = self._reads.potential_here(what)
            if answered is not None:
                call.answer(*answered)
                return
        elif not isinstance(what, (RegisterBody, UnregisterBody)):
            namespace = namespace_for(what.model_name, what.routing_group, self.config.namespace)
            tracker = self._trackers.served.get(namespace)
            own = None if tracker is None else self._trackers.own_fold(tracker)
            if tracker is not None and own is not None:
                self._fold_here(tracker, own, call.path, what, call)
                return
        self._trackers.spawn(self._begin_and_answer(call, what))

    async def _begin_and_answer(self, call: Call, what: Read | Body | PotentialLoadsBody) -> None:
        try:
            pending = await self._begin(call.path, call.query, what)
            call.begun()
            status, payload = await pending
        except TrackerNameTooLong as exc:
            status, payload = 400, {"error": str(exc)}
        except Rejected as rejected:  # no room for the tracker it names
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

    # ---- one call: its event, and its answer from the writer's outcome ------------------

    def _event(self, tracker: Tracker, path: str, parsed: Body, own: OwnFold | None) -> Event:
        """A call's event; a request's names the worker and rank that hold it (as this
        process's own fold knows, where it folds the tracker)."""
        if isinstance(parsed, RequestBody):
            state = None if own is None else own.writer.state
            worker, rank = tracker.holder(parsed.request_id, ending=path == "/free", state=state)
            return request_event(path, parsed, worker, rank)
        return event_for(parsed)

    def _answer(
        self,
        tracker: Tracker,
        path: str,
        parsed: Body,
        event: Event,
        seq: int,
        outcome: str | None,
        owner: tuple[int, int] | None,
        block_size: int | None,
    ) -> tuple[int, object]:
        """The answer to a call whose event ``seq`` the writer folded to ``outcome`` (None:
        refused, nothing for a view to show); an add is booked by it."""
        if outcome != APPLIED and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: %s",
                path,
                outcome or "refused by the writer",
                extra={
                    **event_fields(event),
                    "stream_seq": seq,
                    "namespace": tracker.config.namespace,
                },
            )
        if isinstance(parsed, AddBody):
            tracker.settle(parsed.request_id, (parsed.worker_id, parsed.dp_rank), outcome, owner)
        if outcome is not None and seq > tracker.answered:
            tracker.answered = seq
        return answer(path, parsed, outcome, owner=owner, block_size=block_size)

    # ---- where this process folds the tracker: answered by its own fold -----------------

    def _fold_here(
        self, tracker: Tracker, own: OwnFold, path: str, parsed: Body, call: Call
    ) -> None:
        """Publish a lifecycle call's event; the writer's fold of it answers it."""
        event = self._event(tracker, path, parsed, own)
        try:
            event, payload = tracker.publisher.check(event)
        except EventTooLarge as exc:
            call.answer(*_too_large(exc))
            return
        if isinstance(parsed, AddBody):
            tracker.book(parsed.request_id, (parsed.worker_id, parsed.dp_rank))
        trackers = self._trackers

        def folded(seq: int, verdict: Verdict) -> None:
            if type(verdict) is not Delta:
                answered = self._answer(tracker, path, parsed, event, seq, None, None, None)
            else:
                answered = self._answer(
                    tracker,
                    path,
                    parsed,
                    event,
                    seq,
                    verdict.outcome,
                    verdict.owner,
                    verdict.block_size,
                )
            call.answer(*answered)
            trackers.done_with(tracker)

        def failed(seq: int, index: int, why: str) -> None:
            if seq:  # stored, folded by another writer: its delta says how
                trackers.spawn(self._late(tracker, path, parsed, seq, index, event, call))
                return
            if isinstance(parsed, AddBody):
                tracker.settle(parsed.request_id, (parsed.worker_id, parsed.dp_rank), None, None)
            call.answer(503, {"error": f"no answer for the call's event: {why}"})
            trackers.done_with(tracker)

        trackers.hold(tracker)
        try:
            own.submit(
                tracker.publisher.subject_for(event), payload, folded, failed, order=call.conn
            )
        except BaseException:
            trackers.done_with(tracker)
            raise
        call.begun()

    async def _late(
        self,
        tracker: Tracker,
        path: str,
        parsed: Body,
        seq: int,
        index: int,
        event: Event,
        call: Call,
    ) -> None:
        """A call of the own fold whose event another writer folded: its delta answers it."""
        try:
            status, payload = await self._finish(tracker, path, parsed, seq, event, index)
        except Exception as exc:
            log.warning("%s: no outcome for stored event %d: %s", path, seq, exc)
            status, payload = 503, {"error": f"stored as event {seq}, outcome unknown: {exc}"}
        finally:
            self._trackers.done_with(tracker)
        call.answer(status, payload)

    # ---- elsewhere: answered by the deltas ----------------------------------------------

    async def _begin(
        self, path: str, query: dict[str, str], what: Read | Body | PotentialLoadsBody
    ) -> Awaitable[tuple[int, object]]:
        """One call up to the moment its event is stored; what it returns gives the answer.

        Why two steps: calls pipelined on one connection must take effect in order, so each is
        begun only once the one before it has begun (its event stored, hence ahead of this one
        in the log), but the long part, the writer folding the event, is waited for by all of
        them at once. A read has nothing to store: it is answered here.
        """
        if isinstance(what, Read):
            return _now(200, await self._reads.read(what.path, query))
        namespace = namespace_for(what.model_name, what.routing_group, self.config.namespace)
        if isinstance(what, PotentialLoadsBody):
            return _now(*await self._reads.potential(namespace, what))
        trackers = self._trackers
        if isinstance(what, RegisterBody):
            problem = self._register_problem(what)
            if problem is not None:
                return _now(400, {"error": problem})
            tracker: Tracker | None = await trackers.registering(namespace)
        else:
            tracker = await trackers.existing(namespace)
        if tracker is None:
            if isinstance(what, UnregisterBody):
                return _now(*answer(path, what, "unknown_worker"))
            return _now(404, {"error": f"no slot tracker for {what.where()}"})
        trackers.hold(tracker)
        try:
            event = self._event(tracker, path, what, None)
            if tracker.own is not None:  # the calls gathered for its group commit go first
                tracker.own.flush()
            seq = await tracker.publisher.publish(event)
        except (EventTooLarge, PublishError) as exc:
            await self._finished(tracker, what)
            if isinstance(exc, EventTooLarge):
                return _now(*_too_large(exc))
            return _now(503, {"error": f"not stored: {exc}"})  # a full disk, JetStream off
        except BaseException:
            trackers.done_with(tracker)
            raise
        if isinstance(what, AddBody):
            tracker.book(what.request_id, (what.worker_id, what.dp_rank))
        return self._finishing(tracker, path, what, seq, event)

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

    async def _finishing(
        self, tracker: Tracker, path: str, parsed: Body, seq: int, event: Event
    ) -> tuple[int, object]:
        try:
            answered = await self._finish(tracker, path, parsed, seq, event)
        except BaseException:
            self._trackers.done_with(tracker)
            raise
        await self._finished(tracker, parsed)
        return answered

    async def _finished(self, tracker: Tracker, parsed: Body) -> None:
        """A call on ``tracker`` is done. A registration's or unregistration's leaves the
        tracker as its view shows it (the answer waited for that): one that ended it, or a
        registration that did not create it, stops it before the call is answered, so that
        its room is free for the next."""
        if isinstance(parsed, (RegisterBody, UnregisterBody)):
            tracker.ended = tracker.view.block_size is None
        if self._trackers.let_go(tracker):
            await self._trackers.stop_ended(tracker)

    async def _finish(
        self, tracker: Tracker, path: str, parsed: Body, seq: int, event: Event, index: int = 0
    ) -> tuple[int, object]:
        """The answer to a stored event (``index``: its place in a record batch): the
        writer's outcome of it, read from the deltas."""
        result = await tracker.outcomes.of(seq, self.outcome_wait_s, index=index)
        answered = self._answer(
            tracker, path, parsed, event, seq, result.outcome, result.owner, result.block_size
        )
        if result.outcome is not None and isinstance(parsed, (RegisterBody, UnregisterBody)):
            await tracker.view.wait_for(seq, self.outcome_wait_s)  # in the bucket for all
        return answered


__all__ = ["OK", "ROUTES", "SlotService"]
