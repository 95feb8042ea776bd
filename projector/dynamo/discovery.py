"""Dynamo's discovery, followed: which workers serve an endpoint, on which data-parallel ranks,
and which publishers put events on its subjects.

Every Dynamo 1.6.1 process registers itself in discovery, and the frontends route by what it
holds: a worker that leaves it is dropped from every frontend's view, with its requests. So
seqstate reads the same records, from the same store, to follow the fleet without a hand on
the wheel. The store is etcd (Dynamo's default on bare metal,
:mod:`projector.dynamo.discovery_etcd`) or a directory of files (``DYN_FILE_KV``,
:mod:`projector.dynamo.discovery_files`); both hold the same keys under ``v1/``:

- ``v1/instances/<ns>/<component>/<endpoint>/<instance id, hex>``: a worker's endpoint
  (``{"type": "Endpoint", "namespace", "component", "endpoint", "instance_id", ...}``);
- ``v1/event_channels/namespace/<ns>/component/<c>/endpoint/<e>/topic/<topic>/<id hex>``: a
  publisher of ``topic`` on the endpoint's subjects; its ``instance_id`` is the publisher id
  it puts in its NATS envelopes;
- ``v1/event_sources/.../topic/kv-events/<id hex>``: one per data-parallel rank of a worker
  (``metadata.worker = {worker_id, dp_rank}``);
- ``v1/mdc/<ns>/<component>/<endpoint>/<instance id, hex>``: a worker's model card (its
  ``runtime_config`` names its data-parallel ranks).

A backend is a :class:`Source`: it yields :class:`RawBatch` es of keys and values, and knows
nothing of what they mean. :class:`DiscoveryFollower` parses them into typed records, keeps the
current :class:`DiscoveryView`, and hands a consumer :class:`ChangeBatch` es: first the initial
listing (``initial=True``, even when empty), so a consumer can tell a worker present at start
from one that appeared; then every change as it happens. A key of a kind seqstate does not
read, or a value it cannot parse, is skipped and counted (:attr:`DiscoveryView.skipped`),
logged once per reason: discovery is shared with every Dynamo process, and nothing written
there may stop the ledger.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Annotated, Final, Literal, NamedTuple, Protocol

import msgspec
from msgspec import Meta, Struct

from seqstate.dynamo import TOPIC, dynamo_subject
from seqstate.errors import SeqstateError

log = logging.getLogger("seqstate.dynamo.discovery")

PREFIX: Final = "v1/"
INSTANCES: Final = "v1/instances/"
MODEL_CARDS: Final = "v1/mdc/"
EVENT_CHANNELS: Final = "v1/event_channels/"
EVENT_SOURCES: Final = "v1/event_sources/"
BUCKETS: Final = (INSTANCES, MODEL_CARDS, EVENT_CHANNELS, EVENT_SOURCES)
KV_EVENTS: Final = "kv-events"
# A record is a few hundred bytes (a model card a few KiB): a value past this is no record of
# Dynamo's, and is skipped unread rather than held.
MAX_VALUE_BYTES: Final = 1 << 20
# What a batch queue holds before a backend waits for the consumer.
QUEUE_BATCHES: Final = 64

# JSON numbers are unbounded: past u64 (what Dynamo writes) is refused after decoding.
U64 = Annotated[int, Meta(ge=0)]
_U64_MAX: Final = (1 << 64) - 1
U32 = Annotated[int, Meta(ge=0, le=(1 << 32) - 1)]


class Endpoint(NamedTuple):
    """A Dynamo endpoint, ``NS.COMPONENT.ENDPOINT`` as ``--dynamo-endpoint`` names it."""

    namespace: str
    component: str
    name: str

    def __str__(self) -> str:
        return f"{self.namespace}.{self.component}.{self.name}"

    @classmethod
    def parse(cls, text: str) -> Endpoint:
        """``NS.COMPONENT.ENDPOINT``; a :class:`~seqstate.dynamo.DynamoEndpointError` (one
        clear line) for anything else, as for the capture's subject."""
        dynamo_subject(text)  # validates: three NATS tokens
        namespace, component, name = text.split(".")
        return cls(namespace, component, name)


# ---- the records -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WorkerInstance:
    """A worker serving ``endpoint``: ``instance_id`` is its worker id in the events."""

    key: str
    endpoint: Endpoint
    instance_id: int


@dataclass(frozen=True, slots=True)
class EventChannel:
    """A publisher of ``topic`` on ``endpoint``'s subjects. ``publisher_id`` is the id it puts
    in every NATS envelope it sends (a frontend's replica sync, a worker's own Marks)."""

    key: str
    endpoint: Endpoint
    topic: str
    publisher_id: int


@dataclass(frozen=True, slots=True)
class KvEventSource:
    """One data-parallel rank of a worker, publishing KV events: the ranks a worker serves."""

    key: str
    endpoint: Endpoint
    publisher_id: int
    worker_id: int
    dp_rank: int


@dataclass(frozen=True, slots=True)
class ModelCard:
    """A worker's model card: the model it serves on ``endpoint`` and its data-parallel ranks
    (``dp_start`` and ``dp_size`` from the card's runtime config; None when it names none)."""

    key: str
    endpoint: Endpoint
    instance_id: int
    model: str | None
    dp_start: int | None
    dp_size: int | None


Record = WorkerInstance | EventChannel | KvEventSource | ModelCard
DeleteWhy = Literal["deleted", "stale", "relisted"]


@dataclass(frozen=True, slots=True)
class Put:
    """``record`` appeared, or its key's value changed (``record`` is the new one)."""

    record: Record


@dataclass(frozen=True, slots=True)
class Delete:
    """``record`` left discovery. ``why``: ``deleted`` (its key was deleted: a clean exit, an
    etcd lease that ran out, a file Dynamo removed), ``stale`` (a file no Dynamo process has
    kept fresh, past Dynamo's TTL), ``relisted`` (absent from a full listing taken after the
    watch could not resume)."""

    record: Record
    why: DeleteWhy = "deleted"


Change = Put | Delete


@dataclass(frozen=True, slots=True)
class ChangeBatch:
    """Changes seen together, applied to the view before the consumer gets them.

    ``initial``: the first listing (every record present at start, as Puts; comes first, once,
    even when empty). ``relisted``: a full listing taken again (after etcd compacted the
    revisions a watch needed): its Puts and Deletes are the difference from what was known."""

    changes: tuple[Change, ...]
    initial: bool = False
    relisted: bool = False


@dataclass(frozen=True, slots=True)
class RawBatch:
    """What a backend saw, before parsing: ``puts`` (key to value) and ``deletes`` (key to the
    reason). ``snapshot``: ``puts`` is the whole of discovery, and a known key missing from it
    is gone (``why`` of :attr:`snapshot_why`). ``skipped``: keys the backend did not read, with
    the reason (a value too large), counted like a value that does not parse."""

    puts: Mapping[str, bytes] = field(default_factory=dict)
    deletes: Mapping[str, DeleteWhy] = field(default_factory=dict)
    snapshot: bool = False
    initial: bool = False
    snapshot_why: DeleteWhy = "relisted"
    skipped: Mapping[str, str] = field(default_factory=dict)


Emit = Callable[[RawBatch], Awaitable[None]]


class Source(Protocol):
    """A discovery backend. :meth:`run` emits the initial listing first (``initial=True`` and
    ``snapshot=True``), then changes, and returns only when cancelled: an unreachable store is
    retried (with the outage logged), never an error for the consumer."""

    def describe(self) -> str:
        """Where it reads, for a log line."""
        ...

    @property
    def connected(self) -> bool:
        """Whether the last read reached the store."""
        ...

    async def run(self, emit: Emit) -> None: ...


# ---- parsing Dynamo's values -------------------------------------------------------------------
# Dynamo's serde ignores unknown fields, so a newer Dynamo that adds one still parses here.


class _EndpointId(Struct):
    namespace: str
    component: str
    name: str


class _Scope(Struct):
    kind: str
    endpoint: _EndpointId | None = None


class _Worker(Struct):
    worker_id: U64
    dp_rank: U32 = 0


class _SourceMetadata(Struct):
    worker: _Worker | None = None


class _RuntimeConfig(Struct):
    data_parallel_start_rank: U32 | None = None
    data_parallel_size: U32 | None = None


class _Card(Struct):
    display_name: str | None = None
    runtime_config: _RuntimeConfig | None = None


class _Instance(Struct, tag_field="type", tag="Endpoint"):
    namespace: str
    component: str
    endpoint: str
    instance_id: U64


class _Model(Struct, tag_field="type", tag="Model"):
    namespace: str
    component: str
    endpoint: str
    instance_id: U64
    card_json: _Card | None = None


class _Channel(Struct, tag_field="type", tag="EventChannel"):
    scope: _Scope
    topic: str
    instance_id: U64


class _EventSource(Struct, tag_field="type", tag="EventSource"):
    scope: _Scope
    topic: str
    publisher_id: U64
    metadata: _SourceMetadata | None = None


_decoder: Final = msgspec.json.Decoder(_Instance | _Model | _Channel | _EventSource)
_EXPECTED: Final[dict[str, type]] = {
    INSTANCES: _Instance,
    MODEL_CARDS: _Model,
    EVENT_CHANNELS: _Channel,
    EVENT_SOURCES: _EventSource,
}


class Skipped(SeqstateError, ValueError):
    """A key not read as a record; the message is the reason (one per kind of problem, so it
    is logged once and counted)."""


def bucket_of(key: str) -> str | None:
    """The bucket prefix of ``key`` (``v1/instances/``, ...), None for any other key."""
    for bucket in BUCKETS:
        if key.startswith(bucket):
            return bucket
    return None


def _scoped(scope: _Scope) -> Endpoint:
    if scope.kind != "endpoint" or scope.endpoint is None:
        raise Skipped(f"scope of kind {scope.kind!r}, not an endpoint")
    e = scope.endpoint
    return Endpoint(e.namespace, e.component, e.name)


def parse_record(key: str, value: bytes) -> Record:
    """The record ``value`` is, at ``key``; :class:`Skipped` with the reason otherwise."""
    bucket = bucket_of(key)
    if bucket is None:
        raise Skipped(f"a key of a kind not followed ({'/'.join(key.split('/')[:2])}/)")
    if len(value) > MAX_VALUE_BYTES:
        raise Skipped(f"a value larger than {MAX_VALUE_BYTES} bytes")
    try:
        parsed: _Instance | _Model | _Channel | _EventSource = _decoder.decode(value)
    except msgspec.ValidationError as exc:  # names the field: a few reasons at most
        raise Skipped(f"a value that is not a Dynamo record: {_first_line(exc)}") from None
    except msgspec.DecodeError:
        raise Skipped("a value that is not JSON") from None
    if not isinstance(parsed, _EXPECTED[bucket]):
        raise Skipped(f"a record of type {type(parsed).__name__[1:]} under {bucket}")
    record = _record(key, parsed)
    ids = [getattr(record, name, 0) for name in ("instance_id", "publisher_id", "worker_id")]
    if max(ids) > _U64_MAX:
        raise Skipped("an id past 64 bits")
    return record


def _record(key: str, parsed: _Instance | _Model | _Channel | _EventSource) -> Record:
    match parsed:
        case _Instance():
            endpoint = Endpoint(parsed.namespace, parsed.component, parsed.endpoint)
            return WorkerInstance(key, endpoint, parsed.instance_id)
        case _Model():
            card = parsed.card_json or _Card()
            runtime = card.runtime_config or _RuntimeConfig()
            return ModelCard(
                key,
                Endpoint(parsed.namespace, parsed.component, parsed.endpoint),
                parsed.instance_id,
                card.display_name,
                runtime.data_parallel_start_rank,
                runtime.data_parallel_size,
            )
        case _Channel():
            return EventChannel(key, _scoped(parsed.scope), parsed.topic, parsed.instance_id)
        case _EventSource():
            endpoint = _scoped(parsed.scope)
            worker = parsed.metadata.worker if parsed.metadata else None
            if parsed.topic != KV_EVENTS:
                raise Skipped(f"an event source of topic {parsed.topic!r}, not {KV_EVENTS}")
            if worker is None:
                raise Skipped(f"a {KV_EVENTS} source that names no worker")
            return KvEventSource(
                key, endpoint, parsed.publisher_id, worker.worker_id, worker.dp_rank
            )
    raise AssertionError(parsed)  # pragma: no cover: the decoder's union is exhausted above


def _first_line(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


# ---- the view ----------------------------------------------------------------------------------


class DiscoveryView:
    """What discovery holds now, as records by key, and the questions a consumer asks of it.

    Indexed by endpoint, so a question costs what its endpoint holds, not the whole fleet."""

    def __init__(self) -> None:
        self.records: dict[str, Record] = {}
        self._by_endpoint: dict[Endpoint, dict[str, Record]] = {}
        self.skipped: Counter[str] = Counter()  # reason -> keys skipped for it
        self._said: set[str] = set()

    # -- applying ------------------------------------------------------------------------------

    def skip(self, key: str, reason: str) -> None:
        """Count a key not read; the first of each reason is logged."""
        self.skipped[reason] += 1
        if reason not in self._said:
            self._said.add(reason)
            log.warning(
                "discovery: skipped %s: %s (said once; counted per reason after this)",
                key[:300],
                reason,
            )

    def apply(self, raw: RawBatch) -> ChangeBatch:
        """Parse ``raw``, apply it, and say what changed. A value that does not parse leaves
        the key's previous record in place (as Dynamo's own watchers do)."""
        changes: list[Change] = []
        for key, reason in raw.skipped.items():
            self.skip(key, reason)
        for key, value in raw.puts.items():
            try:
                record = parse_record(key, value)
            except Skipped as exc:
                self.skip(key, str(exc))
                continue
            if self.records.get(key) != record:
                self._put(record)
                changes.append(Put(record))
        if raw.snapshot:
            gone: dict[str, DeleteWhy] = {
                key: raw.snapshot_why for key in self.records if key not in raw.puts
            }
        else:
            gone = dict(raw.deletes)
        for key, why in gone.items():
            old = self._delete(key)
            if old is not None:
                changes.append(Delete(old, why))
        return ChangeBatch(
            tuple(changes), initial=raw.initial, relisted=raw.snapshot and not raw.initial
        )

    def _put(self, record: Record) -> None:
        old = self.records.get(record.key)
        if old is not None:
            self._unindex(old)
        self.records[record.key] = record
        self._by_endpoint.setdefault(record.endpoint, {})[record.key] = record

    def _delete(self, key: str) -> Record | None:
        old = self.records.pop(key, None)
        if old is not None:
            self._unindex(old)
        return old

    def _unindex(self, record: Record) -> None:
        held = self._by_endpoint.get(record.endpoint)
        if held is not None:
            held.pop(record.key, None)
            if not held:
                del self._by_endpoint[record.endpoint]

    # -- asking ----------------------------------------------------------------------------------

    def of(self, endpoint: Endpoint | str) -> Iterable[Record]:
        """Every record of ``endpoint``."""
        return self._by_endpoint.get(_as_endpoint(endpoint), {}).values()

    def knows(self, endpoint: Endpoint | str) -> bool:
        """Whether discovery holds anything at all for ``endpoint`` (a worker, a channel, a
        model card): False for a typo'd ``--dynamo-endpoint``, or a fleet not started yet."""
        return _as_endpoint(endpoint) in self._by_endpoint

    def endpoints(self) -> list[Endpoint]:
        """The endpoints a model is served on, or whose events someone publishes: those a
        ``--dynamo-endpoint`` may name, sorted (a worker's internal query endpoints, which
        have neither, are left out)."""
        return sorted(
            endpoint
            for endpoint, held in self._by_endpoint.items()
            if any(isinstance(r, ModelCard | EventChannel) for r in held.values())
        )

    def workers(self, endpoint: Endpoint | str) -> dict[int, frozenset[int]]:
        """Worker id to the data-parallel ranks it serves, for every worker registered on
        ``endpoint``. The ranks are those of its KV-event sources and of its model card's
        runtime config; a worker that names none serves rank 0."""
        records = list(self.of(endpoint))
        ranks: dict[int, set[int]] = {
            r.instance_id: set() for r in records if isinstance(r, WorkerInstance)
        }
        for r in records:
            if isinstance(r, KvEventSource) and r.worker_id in ranks:
                ranks[r.worker_id].add(r.dp_rank)
            elif isinstance(r, ModelCard) and r.instance_id in ranks and r.dp_size:
                start = r.dp_start or 0
                ranks[r.instance_id].update(range(start, start + r.dp_size))
        return {worker: frozenset(held or {0}) for worker, held in ranks.items()}

    def ranks(self, endpoint: Endpoint | str) -> set[tuple[int, int]]:
        """Every (worker id, dp rank) serving ``endpoint``."""
        return {(w, rank) for w, held in self.workers(endpoint).items() for rank in held}

    def channels(self, endpoint: Endpoint | str, topic: str = TOPIC) -> list[EventChannel]:
        """The publishers of ``topic`` (by default ``active_sequences_events``: every frontend
        with replica sync, and every worker for its own Marks) on ``endpoint``, by key."""
        return sorted(
            (r for r in self.of(endpoint) if isinstance(r, EventChannel) and r.topic == topic),
            key=lambda r: r.key,
        )


def _as_endpoint(endpoint: Endpoint | str) -> Endpoint:
    return endpoint if isinstance(endpoint, Endpoint) else Endpoint.parse(endpoint)


# ---- following ---------------------------------------------------------------------------------


class DiscoveryFollower:
    """A backend's batches, parsed, applied to :attr:`view`, and handed on.

    ``async for batch in follower.changes():`` runs the backend until the loop ends (or the
    task is cancelled): the first batch is the initial listing; the view already holds each
    batch when the consumer gets it. A backend that fails in a way it cannot retry raises out
    of :meth:`changes`: the consumer cannot go on without discovery, and says so.
    """

    def __init__(self, source: Source, *, queue_batches: int = QUEUE_BATCHES) -> None:
        self.source = source
        self.view = DiscoveryView()
        self._queue_batches = queue_batches

    @property
    def connected(self) -> bool:
        """Whether the backend's last read reached its store."""
        return self.source.connected

    def describe(self) -> str:
        return self.source.describe()

    async def changes(self) -> AsyncIterator[ChangeBatch]:
        queue: asyncio.Queue[RawBatch] = asyncio.Queue(self._queue_batches)
        task = asyncio.create_task(self.source.run(queue.put), name="dynamo-discovery")
        getter: asyncio.Future[RawBatch] | None = None
        try:
            while True:
                getter = asyncio.ensure_future(queue.get())
                done, _ = await asyncio.wait({getter, task}, return_when=asyncio.FIRST_COMPLETED)
                if getter not in done:
                    getter.cancel()
                    await task  # raises the backend's error; a clean return is a bug
                    raise RuntimeError(f"discovery backend {self.describe()} stopped")
                batch = self.view.apply(getter.result())
                if batch.changes or batch.initial or batch.relisted:
                    yield batch
        finally:
            if getter is not None:
                getter.cancel()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
