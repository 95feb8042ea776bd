"""``seqstate inspect``: one request's story, one worker's ranks, from the log and the bucket.

A request's events are found without reading the whole log when that can be avoided:

- An **active** request has a slot in the bucket (``<ns>.req.<w>.<r>.<slot>`` names its id and
  is stamped with the sequence of the AddRequest that booked it), so its worker and rank are
  known, and its events are read from that one subject (``seqstate.events.<ns>.<w>.<r>``)
  from the booking on: the server filters by subject, the client reads only that rank's
  traffic since the booking.
- An **ended or unknown** request names no rank in the bucket: its events are looked for in a
  bounded window of the namespace's events, the newest ``window`` events by default, or from
  ``since_seq`` on. The report says which window was read, so "no event" is never mistaken
  for "never existed".

Each event's outcome (applied, duplicate, unknown_request, ...) comes from the writer's delta
for it, found by a binary search over the deltas stream (a few ``get_msg`` calls per event, no
scan). How a request ended without a Free (expired, orphaned, dropped with its worker) is
found by reading the deltas after its booking until one names it.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError

from projector.bucket.contents import BucketView, read_bucket
from projector.nats.stream import first_seq_of, last_seq_of, log_time_ns
from projector.settings.config import Config
from projector.wire.headers import MSG_ID
from projector.wire.msg_ids import router_of
from projector.wire.values import LoadValue, Rank
from seqstate import (
    AddRequest,
    EventDecodeError,
    Free,
    MarkPrefillCompleted,
    RouterGoodbye,
    WorkerRemoved,
    decode_deltas,
)
from seqstate.deltas import Delta
from seqstate.dynamo import is_dynamo_subject
from seqstate.errors import SeqstateError
from seqstate.fold import event_of, events_of

Update = Callable[[int, int], None]
DEFAULT_WINDOW = 100_000  # newest events of the namespace read for a request not in the bucket
READ_TIMEOUT_S = 60.0


class InspectError(SeqstateError, RuntimeError):
    """Something an operator asked that cannot be answered (one line)."""


def iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).isoformat(timespec="microseconds")


def no_bucket(config: Config) -> InspectError:
    return InspectError(
        f"bucket {config.registry_bucket!r} does not exist: is a projector running?"
    )


async def bucket(nc: Client, config: Config, keys: str) -> BucketView:
    """The namespace's current values under ``keys``; a missing bucket is one clear line."""
    try:
        return await read_bucket(nc, config, keys=keys)
    except BucketNotFoundError:
        raise no_bucket(config) from None


# ---- reading a range of the events stream --------------------------------------------------


@dataclass
class Found:
    seq: int
    log_time_ns: int
    subject: str
    msg_id: str | None
    event: Any  # a decoded Event
    outcome: str | None = None  # from the writer's delta; see outcome_of
    index: int | None = None  # its index in a record batch (None: a message of its own)

    @property
    def position(self) -> str:
        """Where the log holds it: its sequence, and in a batch its index (``12#3``)."""
        return str(self.seq) if self.index is None else f"{self.seq}#{self.index}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "seq": self.seq,
            "log_time": iso(self.log_time_ns),
            "log_time_ns": self.log_time_ns,
            "type": type(self.event).__name__,
            "outcome": self.outcome,
            "subject": self.subject,
            "msg_id": self.msg_id,
            "event": msgspec.to_builtins(self.event),
            **({} if self.index is None else {"index": self.index}),
        }


async def scan_events(
    js: JetStreamContext,
    config: Config,
    subject: str,
    start: int,
    end: int,
    wanted: Callable[[str, bytes], bool],
    progress: Update | None = None,
    named: Callable[[Any], bool] | None = None,
) -> list[Found]:
    """The events on ``subject`` from sequence ``start`` to ``end`` whose message's bytes
    ``wanted`` accepts, that decode and that ``named`` accepts, in order (an ordered
    consumer: the server filters by subject); each event of a record batch on its own."""
    out: list[Found] = []
    if end < start:
        return out
    done = asyncio.Event()
    total = end - start + 1

    async def take(msg: Msg) -> None:
        seq, at_ns = log_time_ns(msg)
        if seq > end:
            done.set()
            return
        if wanted(msg.subject, msg.data):
            with contextlib.suppress(EventDecodeError):
                msg_id = (msg.headers or {}).get(MSG_ID)
                for index, event in events_of(msg.subject, msg.data):
                    if named is None or named(event):
                        out.append(Found(seq, at_ns, msg.subject, msg_id, event, index=index))
        if progress is not None:
            progress(seq - start + 1, total)
        if seq >= end:
            done.set()

    last = await last_seq_of(js, config.events_stream, subject)
    if last < start:
        return out
    end = min(end, last)
    await read_until(js, config.events_stream, subject, start, take, done)
    return [f for f in out if f.seq <= end]


async def read_until(
    js: JetStreamContext,
    stream: str,
    subject: str,
    start: int,
    take: Callable[[Msg], Awaitable[None]],
    done: asyncio.Event,
) -> None:
    """Hand ``take`` the messages on ``subject`` from sequence ``start``, in order, until it sets
    ``done`` (an ordered consumer: nothing to clean up on the server); a read that stalls for
    READ_TIMEOUT_S raises TimeoutError."""
    sub = await js.subscribe(
        subject,
        stream=stream,
        ordered_consumer=True,
        cb=take,
        deliver_policy=api.DeliverPolicy.BY_START_SEQUENCE,
        config=api.ConsumerConfig(opt_start_seq=start),
    )
    try:
        await asyncio.wait_for(done.wait(), READ_TIMEOUT_S)
    finally:
        await sub.unsubscribe()


# ---- outcomes from the deltas --------------------------------------------------------------


class DeltaIndex:
    """Finds the writer's delta message for an event by binary search over the deltas stream."""

    def __init__(self, js: JetStreamContext, config: Config) -> None:
        self.js = js
        self.stream = config.deltas_stream
        self.subject = config.deltas_subject
        self._bounds: tuple[int, int] | None = None

    async def bounds(self) -> tuple[int, int]:
        if self._bounds is None:
            last = await last_seq_of(self.js, self.stream, self.subject)
            first = await first_seq_of(self.js, self.stream, self.subject) if last else 0
            self._bounds = (first, last)
        return self._bounds

    async def _at(self, seq: int) -> tuple[int, list[Delta]] | None:
        try:
            msg = await self.js.get_msg(self.stream, seq=seq, subject=self.subject, next=True)
        except NotFoundError:
            return None
        try:
            return msg.seq or seq, decode_deltas(msg.data or b"")
        except msgspec.DecodeError:
            return msg.seq or seq, []

    async def locate(self, event_seq: int) -> tuple[str, int, list[Delta]]:
        """``(where, message_seq, deltas)``: where is "found" (the message holding the event's
        delta), "before" (the event is older than every stored delta), "after" (not folded
        yet), or "none" (between two messages: the writer stored no delta for it)."""
        first, last = await self.bounds()
        if not last:
            return "after", 0, []
        lo, hi = first, last
        while lo <= hi:
            mid = (lo + hi) // 2
            got = await self._at(mid)
            if got is None or got[0] > hi:
                hi = mid - 1
                continue
            seq, deltas = got
            seqs = [d.seq for d in deltas if d.seq is not None]
            if not seqs or event_seq > max(seqs):
                lo = seq + 1
            elif event_seq < min(seqs):
                hi = mid - 1
            else:
                return "found", seq, deltas
        if lo > last:
            got = await self._at(last)
            newest = max((d.seq or 0 for d in got[1]), default=0) if got else 0
            return ("after" if event_seq > newest else "none"), lo, []
        if hi < first:
            return "before", first, []
        return "none", lo, []

    async def outcome_of(self, event_seq: int, index: int | None = None) -> str:
        """The outcome of the event at ``event_seq`` (of a record batch: its event at
        ``index``), from the writer's delta."""
        where, _, deltas = await self.locate(event_seq)
        if where == "found":
            for d in deltas:
                if d.seq == event_seq and d.index == (index or 0):
                    return d.outcome
            return "dead-lettered"
        return {
            "before": "unknown (deltas trimmed)",
            "after": "not folded yet",
            "none": "dead-lettered",
        }[where]

    async def ending(
        self,
        request_id: str,
        rank: Rank,
        after_event: int,
        progress: Update | None = None,
    ) -> Delta | None:
        """The first delta after event ``after_event`` that ends ``request_id`` without a Free:
        an expiry naming it, an orphaning naming it, or the removal of its rank."""
        where, start, _ = await self.locate(after_event)
        first, last = await self.bounds()
        if where == "after" or not last:
            return None
        if where == "before":
            start = first
        hit: Delta | None = None
        done = asyncio.Event()
        total = max(last - start + 1, 1)

        async def take(msg: Msg) -> None:
            nonlocal hit
            seq = msg.metadata.sequence.stream
            if hit is None and seq <= last:
                with contextlib.suppress(msgspec.DecodeError):
                    for d in decode_deltas(msg.data):
                        if (d.seq or 0) <= after_event:
                            continue
                        if (
                            request_id in d.expired
                            or request_id in d.orphaned
                            or any(tuple(r) == rank for r in d.removed_ranks)
                        ):
                            hit = d
                            break
            if progress is not None:
                progress(min(seq, last) - start + 1, total)
            if hit is not None or seq >= last:
                done.set()

        await read_until(self.js, self.stream, self.subject, start, take, done)
        return hit


# ---- a request -----------------------------------------------------------------------------


@dataclass
class RequestReport:
    request_id: str
    state: str  # active | ended | tombstoned | refused | unknown
    detail: str
    router: str | None = None
    rank: Rank | None = None
    slot: int | None = None
    events: list[Found] = field(default_factory=list)
    subject: str = ""
    from_seq: int = 0
    to_seq: int = 0
    whole_log: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "request_id": self.request_id,
            "state": self.state,
            "detail": self.detail,
            "router": self.router,
            "worker_id": None if self.rank is None else self.rank[0],
            "dp_rank": None if self.rank is None else self.rank[1],
            "slot": self.slot,
            "events": [e.as_dict() for e in self.events],
            "searched": {
                "subject": self.subject,
                "from_seq": self.from_seq,
                "to_seq": self.to_seq,
                "whole_log": self.whole_log,
            },
        }

    def text(self) -> str:
        where = (
            "-"
            if self.rank is None
            else f"worker {self.rank[0]}, rank {self.rank[1]}"
            + ("" if self.slot is None else f" (slot {self.slot})")
        )
        lines = [
            f"request {self.request_id}",
            f"  state:  {self.state}: {self.detail}",
            f"  router: {self.router or '-'}",
            f"  where:  {where}",
            f"  events on {self.subject}, sequences {self.from_seq} to {self.to_seq}"
            + (" (the whole log)" if self.whole_log else "")
            + ":",
        ]
        if not self.events:
            lines.append("    (none)")
        else:
            lines.append(f"    {'seq':>10}  {'log time':<32}  {'event':<22}  outcome")
            for e in self.events:
                lines.append(
                    f"    {e.position:>10}  {iso(e.log_time_ns):<32}  "
                    f"{type(e.event).__name__:<22}  {e.outcome or '-'}"
                )
        return "\n".join(lines)


def _router_of(found: Found) -> str | None:
    router = getattr(found.event, "router_id", "") or None
    if router is None and found.msg_id:
        parsed = router_of(found.msg_id)
        router = parsed[0] if parsed is not None else None
    return router


async def inspect_request(
    nc: Client,
    config: Config,
    request_id: str,
    *,
    since_seq: int | None = None,
    window: int = DEFAULT_WINDOW,
    progress: Update | None = None,
) -> RequestReport:
    js = nc.jetstream()
    active = await _active_slot(nc, config, request_id)
    last = await last_seq_of(js, config.events_stream, config.events_subjects)
    first = await first_seq_of(js, config.events_stream, config.events_subjects) if last else 0
    subject, start = _search_window(config, active, first, last, since_seq, window)
    if active is not None and (captured := await _dynamo_subject_at(js, config, active[2])):
        subject = captured  # a Dynamo request's events are on its endpoint's subject
    wanted, named = _naming(request_id)
    events = (
        await scan_events(js, config, subject, start, last, wanted, progress, named) if last else []
    )
    deltas = DeltaIndex(js, config)
    for e in events:
        e.outcome = await deltas.outcome_of(e.seq, e.index)
    report = RequestReport(
        request_id,
        "unknown",
        "",
        subject=subject,
        from_seq=start,
        to_seq=last,
        whole_log=start <= first,
    )
    report.events = events
    adds = [e for e in events if isinstance(e.event, AddRequest)]
    booked_add = next((e for e in reversed(adds) if e.outcome == "applied"), None)
    owner = booked_add or (adds[-1] if adds else (events[0] if events else None))
    report.router = _router_of(owner) if owner else None
    if active is not None:
        _tell_active(report, active, booked_add)
    elif booked_add is not None:
        await _tell_ended(report, js, config, deltas, booked_add, progress)
    else:
        _tell_never_booked(report, adds)
    return report


async def _dynamo_subject_at(js: JetStreamContext, config: Config, seq: int) -> str | None:
    """The subject of event ``seq`` if it is a captured Dynamo message."""
    try:
        msg = await js.get_msg(config.events_stream, seq)
    except NotFoundError:
        return None
    return msg.subject if msg.subject and is_dynamo_subject(msg.subject) else None


async def _active_slot(nc: Client, config: Config, request_id: str) -> tuple[Rank, int, int] | None:
    """The rank, slot and booking event of the request if the bucket holds it: an active
    request is found without reading the log."""
    active: tuple[Rank, int, int] | None = None
    held = await bucket(nc, config, "req.>")
    for rank, slots in held.slots.items():
        for slot, value in slots.items():
            if value.request_id == request_id:
                active = (rank, slot, value.applied_seq)
    return active


def _search_window(
    config: Config,
    active: tuple[Rank, int, int] | None,
    first: int,
    last: int,
    since_seq: int | None,
    window: int,
) -> tuple[str, int]:
    """The subject and the first sequence to read: an active request's rank from its booking
    on; otherwise the whole namespace, from ``since_seq`` or the newest ``window`` events."""
    if active is not None:
        rank, _, booked = active
        return config.event_subject(*rank), max(booked, first)
    if since_seq is None:
        return config.events_subjects, max(first, last - window + 1)
    if since_seq < 1:
        raise InspectError(f"--since-seq {since_seq}: must be at least 1")
    return config.events_subjects, max(since_seq, first)


def _naming(
    request_id: str,
) -> tuple[Callable[[str, bytes], bool], Callable[[Any], bool]]:
    """Whether a message's bytes may name the request (a substring test first, so that only
    the few candidates are decoded: a Dynamo message as the event it folds as, a record
    batch as its events), and whether a decoded event does."""
    needle = request_id.encode()

    def named(event: Any) -> bool:
        return getattr(event, "request_id", None) == request_id

    def wanted(subject: str, data: bytes) -> bool:
        if needle not in data:
            return False
        try:
            return any(named(event) for _, event in events_of(subject, data))
        except EventDecodeError:
            return False

    return wanted, named


def _tell_active(
    report: RequestReport, active: tuple[Rank, int, int], booked_add: Found | None
) -> None:
    """A request the bucket holds: where, and how far its prefill has got."""
    rank, slot, _ = active
    report.rank, report.slot = rank, slot
    report.state = "active"
    after = 0 if booked_add is None else booked_add.seq
    marked = any(
        isinstance(e.event, MarkPrefillCompleted) and e.outcome == "applied" and e.seq > after
        for e in report.events
    )
    if marked:
        report.detail = "prefill done"
    elif booked_add is not None and not booked_add.event.prefill_tokens:
        report.detail = "no prefill (0 prefill tokens)"
    else:
        report.detail = "prefill pending"


async def _tell_ended(
    report: RequestReport,
    js: JetStreamContext,
    config: Config,
    deltas: DeltaIndex,
    booked_add: Found,
    progress: Update | None,
) -> None:
    """A request once booked and no longer in the bucket: by its Free, or by what the deltas
    after its booking say ended it."""
    report.rank = (booked_add.event.worker_id, booked_add.event.dp_rank)
    report.state = "ended"
    free = next(
        (
            e
            for e in report.events
            if isinstance(e.event, Free) and e.seq > booked_add.seq and e.outcome == "applied"
        ),
        None,
    )
    if free is not None:
        report.detail = f"freed by event {free.seq} at {iso(free.log_time_ns)}"
        return
    ended = await deltas.ending(report.request_id, report.rank, booked_add.seq, progress)
    report.detail = await _ending_detail(js, config, report.request_id, ended)


async def _ending_detail(
    js: JetStreamContext, config: Config, request_id: str, ended: Delta | None
) -> str:
    """How a request ended without a Free; the event that caused it tells a router's goodbye
    from its silence, a worker's removal from its rank's."""
    if ended is None:
        return "not in the bucket, and no Free, expiry or worker removal found"
    if request_id in ended.expired:
        return f"expired at event {ended.seq} (no Free within the expiry)"
    cause = await _event_at(js, config, ended.seq or 0)
    if request_id in ended.orphaned:
        return (
            f"freed by its router's goodbye (event {ended.seq})"
            if isinstance(cause, RouterGoodbye)
            else f"orphaned at event {ended.seq}: its router went silent"
        )
    what = "rank removed"
    if isinstance(cause, WorkerRemoved):
        what = "worker removed for good" if cause.final else "worker removed"
    return f"dropped with its rank at event {ended.seq} ({what})"


def _tell_never_booked(report: RequestReport, adds: list[Found]) -> None:
    """A request no event booked: none found, superseded by its own Free, tombstoned, or
    refused; the first that fits."""
    events = report.events
    if not events:
        report.detail = f"no event names it in sequences {report.from_seq} to {report.to_seq}" + (
            "" if report.whole_log else "; widen with --since-seq"
        )
        return
    superseded = next((e for e in adds if e.outcome == "superseded"), None)
    if superseded is not None:
        report.state = "ended"
        report.rank = (superseded.event.worker_id, superseded.event.dp_rank)
        report.detail = (
            f"its AddRequest (event {superseded.seq}) came after its Free: superseded, never booked"
        )
        return
    early = [
        e
        for e in events
        if isinstance(e.event, (Free, MarkPrefillCompleted)) and e.outcome == "unknown_request"
    ]
    if early and not adds:
        e = early[-1]
        report.state = "tombstoned"
        report.rank = (e.event.worker_id, e.event.dp_rank)
        report.detail = (
            f"a {type(e.event).__name__} (event {e.seq}) for an id not live: "
            "its AddRequest, if it comes, is handled by the tombstone"
        )
        return
    if adds:
        e = adds[-1]
        report.state = "refused"
        report.rank = (e.event.worker_id, e.event.dp_rank)
        report.detail = f"its AddRequest (event {e.seq}) was not booked: {e.outcome}"
        return
    report.detail = "events name it, but none booked it"


async def _event_at(js: JetStreamContext, config: Config, seq: int) -> Any:
    try:
        msg = await js.get_msg(config.events_stream, seq)
        return event_of(msg.subject or "", msg.data or b"")
    except (NotFoundError, EventDecodeError):
        return None


# ---- a worker ------------------------------------------------------------------------------


@dataclass
class RankReport:
    rank: Rank
    load: LoadValue
    requests: list[tuple[int, str, int]]  # (slot, request id, booking event)
    active_prefill_tokens: int
    modeled_remaining_ms: int | None

    def as_dict(self) -> dict[str, Any]:
        p = self.load.prefill
        return {
            "worker_id": self.rank[0],
            "dp_rank": self.rank[1],
            "active_requests": self.load.active_requests,
            "active_blocks": self.load.active_blocks,
            "requests": [
                {"slot": s, "request_id": r, "booked_seq": b} for s, r, b in self.requests
            ],
            "prefill": {
                "full_tokens": p.full_tokens,
                "anchor_tokens": p.anchor_tokens,
                "anchor_duration_ns": p.anchor_duration_ns,
                "anchored_since_ns": p.anchored_since_ns,
                "anchored_since": (
                    None if p.anchored_since_ns is None else iso(p.anchored_since_ns)
                ),
                "modeled_ms": p.modeled_ms,
                "active_tokens": self.active_prefill_tokens,
                "modeled_remaining_ms": self.modeled_remaining_ms,
            },
            "applied_seq": self.load.applied_seq,
            "as_of": iso(self.load.as_of),
        }


@dataclass
class WorkerReport:
    worker_id: int
    ranks: list[RankReport]
    now_ns: int
    applied_seq: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "worker_id": self.worker_id,
            "applied_seq": self.applied_seq,
            "log_time": iso(self.now_ns) if self.now_ns else None,
            "log_time_ns": self.now_ns,
            "ranks": [r.as_dict() for r in self.ranks],
        }

    def text(self) -> str:
        lines = [
            f"worker {self.worker_id}: {len(self.ranks)} rank"
            + ("" if len(self.ranks) == 1 else "s")
            + f", as of event {self.applied_seq}"
            + (f" (log time {iso(self.now_ns)})" if self.now_ns else "")
        ]
        for r in self.ranks:
            p = r.load.prefill
            ms = "-" if r.modeled_remaining_ms is None else f"{r.modeled_remaining_ms} ms"
            n = r.load.active_requests
            lines.append(
                f"  rank {r.rank[1]}: {n} request{'' if n == 1 else 's'}, "
                f"{r.load.active_blocks} active blocks"
            )
            anchor = (
                "none"
                if p.anchored_since_ns is None
                else f"{p.anchor_tokens} tokens since {iso(p.anchored_since_ns)}"
                + (
                    ""
                    if p.anchor_duration_ns is None
                    else f" for {p.anchor_duration_ns / 1e6:g} ms"
                )
            )
            lines.append(
                f"    prefill queue: {p.full_tokens} tokens queued, "
                f"{r.active_prefill_tokens} still to compute; anchor: {anchor}; "
                f"modeled remaining: {ms}"
            )
            for slot, rid, booked in r.requests:
                lines.append(f"    slot {slot:>4}  {rid}  (booked at event {booked})")
        return "\n".join(lines)


async def inspect_worker(nc: Client, config: Config, worker_id: int) -> WorkerReport:
    loads = await bucket(nc, config, f"load.{worker_id}.*")
    reqs = await bucket(nc, config, f"req.{worker_id}.>")
    position = (await bucket(nc, config, "position")).position
    if not loads.loads:
        raise InspectError(
            f"worker {worker_id} is not in the registry of namespace {config.namespace!r}"
        )
    # The log time the loads are modeled at: the newest value read, as `seqstate loads` does.
    now = max([v.as_of for v in loads.loads.values()] + ([position.as_of] if position else []))
    ranks = []
    for rank in sorted(loads.loads):
        value = loads.loads[rank]
        prefill = value.rank_load().prefill
        held = sorted(
            (slot, v.request_id, v.applied_seq) for slot, v in reqs.requests(rank).items()
        )
        ranks.append(
            RankReport(
                rank, value, held, prefill.active_tokens(now), prefill.modeled_remaining_ms(now)
            )
        )
    return WorkerReport(worker_id, ranks, now, position.applied_seq if position else 0)
