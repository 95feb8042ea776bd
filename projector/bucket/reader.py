"""RegistryView: a scheduler's local replica of the registry bucket; reads in microseconds.

The view watches the namespace's keys and folds each value into a
:class:`~seqstate.PromptRegistry` as a synthetic :class:`~seqstate.Delta` (a rank's new load,
a slot's request released and the new one booked, a removed rank), so ``loads`` and
``potential_loads`` are the core's own code over the same data the writer's registry holds: no
second implementation of the rules. A slot value costs the view the hashes of that one
request, whatever the size of its rank's set; a long prompt's part keys (see
:mod:`projector.wire.values`) are counted key by key, each its own hashes, so a part that
arrives before or after its head adds up the same, and at each position the counts are exact.

Time: values carry their prefill anchors in log time. The view keeps one estimate of the log's
clock, anchored at receive time: each value received at local monotonic time ``t`` with
``as_of = a`` proves the log had reached at least ``a`` by ``t``, so the estimate is the largest
``a + (now - t)`` seen. No clock synchronisation is needed between the scheduler and the
server. Passing ``now_ns`` explicitly evaluates decay at that log time instead (exact
comparisons, replays).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.errors import BucketNotFoundError, NotFoundError, ServiceUnavailableError
from nats.js.kv import KV_DEL, KV_OP, KV_PURGE

from projector.aio.lifetime import Started
from projector.aio.progress import Progress
from projector.aio.tasks import cancel_all
from projector.nats.backlog import datetime_ns, stamp_ns
from projector.nats.client_internals import api_prefix
from projector.nats.connection import PermissionRefused, refused_or
from projector.nats.failures import JETSTREAM_OFF, jetstream_off
from projector.nats.lease import decode_holder
from projector.nats.stream import drop_subscription
from projector.settings.config import Config
from projector.wire.values import (
    Heartbeat,
    Rank,
    decode_load,
    decode_position,
    decode_request,
    decode_tracker,
    lease_key,
    parse_key,
    position_key,
)
from seqstate import (
    CostRow,
    CostWeights,
    Delta,
    LoadRow,
    OverlapRow,
    PotentialLoadRow,
    PromptRegistry,
    RankChange,
)
from seqstate.cost import DEFAULT_WEIGHTS
from seqstate.deltas import Booking
from seqstate.errors import SeqstateError
from seqstate.loads import EMPTY_LOAD

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry
    from prometheus_client.registry import Collector

log = logging.getLogger("seqstate.reader")


class RegistryUnavailable(SeqstateError, RuntimeError):
    """The bucket does not exist (no projector has run in this account) or cannot be watched."""


class BlockSizeUnknown(SeqstateError, ValueError):
    """A cost was asked in blocks of a namespace whose workers registered no block size."""


class _RankRow(Protocol):
    @property
    def worker_id(self) -> int: ...
    @property
    def dp_rank(self) -> int: ...


_Row = TypeVar("_Row", bound=_RankRow)


def _part_slot(slot: int, part: int) -> int:
    """Where the view's registry holds part ``part`` of ``slot``'s request: a negative
    number, unique per (slot, part) since a part number is below 2^32 (``parse_key``)."""
    return -1 - (slot << 32 | part)


def _delivered(info: api.ConsumerInfo) -> tuple[int, int]:
    """The consumer sequence and stream sequence of the last message a consumer sent."""
    if info.delivered is None:
        return 0, 0
    return info.delivered.consumer_seq, info.delivered.stream_seq


STALL_AFTER_S = 3.0  # a projector renews its lease every second: this much silence is news
HOLD_S = 0.5  # a flush's values not followed by a position are shown after this long


@dataclass(frozen=True)
class Staleness:
    """How far the view may be behind the log, from what the bucket alone says.

    The view is behind by ``behind_events`` events, the oldest waiting ``behind_s``, as of the
    projector's lag measurement of ``measured_s`` ago: while the projector renews its lease
    (every second), ``age_s`` stays near a second and those counts are current. Once ``age_s``
    passes ``silent_after_s`` (the projector's lease TTL, as a successor would wait it out),
    the projector is stopped, cut off or gone: events logged since are not counted, and the
    view may be behind by anything logged in the last ``age_s`` seconds (:attr:`silent`).
    """

    applied_seq: int  # the newest event sequence the view reflects
    as_of_ns: int  # the log time of that event
    age_s: float  # seconds since the view last heard from the projector, renewals too (inf: never)
    head: int = 0  # the namespace's newest logged event at that measurement (0: none heard)
    behind_events: int = 0  # events of it the view does not reflect (0 once it reaches head)
    behind_s: float = 0.0  # how long the oldest of them has waited, on the view's log clock
    measured_s: float = math.inf  # how old that measurement is (inf: none heard)
    silent_after_s: float = STALL_AFTER_S  # the projector's lease TTL

    @property
    def silent(self) -> bool:
        """The projector has not been heard from for longer than its lease TTL."""
        return self.age_s > self.silent_after_s

    def within(self, events: int, seconds: float) -> bool:
        """Current enough: the projector is heard from, and the view is behind by at most
        ``events`` events whose oldest has waited at most ``seconds``."""
        return not self.silent and self.behind_events <= events and self.behind_s <= seconds


# The watch's idle heartbeat. nats-py re-creates an ordered consumer only after two missed
# heartbeats, and again two heartbeats later if that failed (a server still restarting): with
# its 5 s default a view went 10-20 s stale at every server restart. The view's own check
# (:meth:`RegistryView._guard`) does that job within ``stall_after_s`` of silence, so the
# heartbeat is kept long: it costs every idle watch traffic, and the view needs it for
# nothing, the check asking the server directly whether anything is held back.
HEARTBEAT_S = 30.0
INACTIVE_S = 300.0  # a watch whose client went away is deleted by the server after this
_MARKER_REASON = "Nats-Marker-Reason"  # nats-server 2.11+ places TTL markers with it
_MARKERS = {"MaxAge": KV_PURGE, "Purge": KV_PURGE, "Remove": KV_DEL}


class RegistryView(Started):
    """``async with RegistryView(nc, namespace="prod") as view: view.potential_loads(...)``.

    The watch outlives the server. An ordered consumer lives in the server's memory, so a
    server restart ends it while the client reconnects and waits on, seeing nothing. Whenever
    the watch has been silent for ``stall_after_s``, the view asks the server about its
    consumer; one that is gone or holds back messages is replaced by one that starts right
    after the last revision the view applied, so no update is lost or applied twice, and
    catching up costs what changed meanwhile, not the size of the bucket.

    Prometheus, opt-in: ``view.export_metrics(registry)`` exports
    the view's per-worker gauges (``seqstate_worker_active_blocks``, ``..._active_prefill_tokens``,
    ``..._active_requests``, ``..._remaining_prefill_ms``, labels ``namespace, worker, dp_rank``)
    from the scheduler's own registry, read at scrape time at the log time of the newest value
    received; nothing is registered unless asked (a scheduler's registry is its own).

    Attributes a scheduler reads:

    - ``applied_seq``: the newest event sequence the view reflects (``as_of_ns``: its log time).
    - ``block_size``: the namespace's tokens per KV block, as its workers registered it (None:
      no registration named one).
    - ``unreadable``: ``{(worker_id, dp_rank): why}``, ranks whose load value in the bucket
      does not decode. They are not served (no row in ``loads``, ``potential_loads`` or
      ``overlap_depths``: unknown is not idle) until a readable value replaces theirs.
    - ``bad_values``: how many values received did not decode (each logged).

    Told when it moves: ``view.on_change(callback)`` calls ``callback(view)`` each time the
    view's position advances, and ``async for seq in view.changes()`` yields the new position
    (see both for why a position and not each key).
    """

    def __init__(
        self,
        nc: Client,
        *,
        namespace: str | None = None,
        config: Config | None = None,
        initial_timeout: float = 30.0,
        stall_after_s: float = STALL_AFTER_S,
    ) -> None:
        if stall_after_s <= 0:
            raise ValueError(f"stall_after_s={stall_after_s}: must be positive")
        # One rule, as in RouterPublisher: ``namespace``, when given, wins over ``config``'s.
        config = (config or Config()).with_namespace(namespace)
        self.nc = nc
        self.config = config
        self.namespace = config.namespace  # as a writer's and a projector's (the metrics)
        self.registry = PromptRegistry()
        self.applied_seq = 0
        self.as_of_ns = 0
        self.values_received = 0
        self.bad_values = 0  # values that did not decode (each logged)
        # Ranks whose current load value does not decode, with why: not served (a rank read as
        # idle would draw traffic it may not have room for) until a readable value replaces it.
        self.unreadable: dict[Rank, str] = {}
        # The request each slot holds and the rank each request is on: where a request is,
        # for a caller that names only its id (serve-http's /free).
        self._slot_ids: dict[Rank, dict[int, str]] = {}
        self._request_ranks: dict[str, Rank] = {}
        self.resumes = 0  # watches re-created after a stall (a server restart, mostly)
        # The namespace's block size, tokens per KV block, as its workers registered it (the
        # latest registration naming one; under the slot-tracker rules the first, and None
        # again once no worker is left). None: no registration named one.
        self.block_size: int | None = None
        self.stall_after_s = stall_after_s
        self._initial_timeout = initial_timeout
        self._clock_offset_ns: int | None = None  # log time minus local monotonic time
        self._heard_at: float | None = None  # monotonic time of the last value or renewal
        self.renewals = 0  # lease renewals received: the projector's heartbeats
        self._lease_ttl_s = STALL_AFTER_S
        self._heartbeat: Heartbeat | None = None  # the last lag measurement heard
        self._heartbeat_at = 0.0  # monotonic time it was heard
        self._server_clock: tuple[int, float] | None = None  # server ns at our monotonic time
        self._written_at: float | None = None  # when the entry being received was written
        self._position = Progress()  # applied_seq, for wait_for
        self._stream = f"KV_{config.registry_bucket}"
        self._prefix = f"$KV.{config.registry_bucket}."
        self._js: JetStreamContext | None = None  # made by start: a view can fold without one
        self._sub: JetStreamContext.PushSubscription | None = None
        self._generation = 0  # of the current watch: a replaced one's stragglers are ignored
        self._revision = 0  # the bucket stream's sequence of the last entry applied
        self._stirred = 0.0  # monotonic time the watch last delivered anything (leases too)
        self._suspect: int | None = None  # a consumer held back messages at the last check
        self._unanswered = 0  # consumer checks in a row that got no answer
        self._ready: asyncio.Future[None] | None = None
        self._ready_at: int | None = None  # the revision by which the current values are in
        self._task: asyncio.Task[None] | None = None
        # Values of the flush in progress, shown with its position (see _deliver); the keys
        # shown at once: the position itself, and the lease (who writes, not what).
        self._held: list[tuple[str, bytes, bool]] = []
        self._hold_timer: asyncio.TimerHandle | None = None
        self._unheld = frozenset((position_key(config.namespace), lease_key(config.namespace)))
        self._listeners: dict[int, Callable[[RegistryView], object]] = {}
        self._listener_ids = 0
        self._moved: set[asyncio.Event] = set()  # one per changes() iterator
        self._stopped = False

    # ---- lifecycle --------------------------------------------------------------------------

    async def start(self) -> RegistryView:
        """Watch the bucket; returns once the current values have been received."""
        self._js = self.nc.jetstream()
        self._stopped = False
        bucket = self.config.registry_bucket
        try:  # a role that may not read the bucket is told so at once, not by a timeout
            await refused_or(
                self.nc,
                self._js.key_value(bucket),
                user=self.config.nats_user,
                names=[f"KV_{bucket}", bucket],
                lacks=True,
            )
        except PermissionRefused as exc:
            raise RegistryUnavailable(str(exc)) from None
        except BucketNotFoundError:
            raise RegistryUnavailable(
                f"bucket {self.config.registry_bucket!r} does not exist: is a projector running?"
            ) from None
        except ServiceUnavailableError as exc:
            if jetstream_off(exc):
                raise RegistryUnavailable(JETSTREAM_OFF) from None
            raise
        ready = self._ready = asyncio.get_running_loop().create_future()
        try:
            async with asyncio.timeout(self._initial_timeout):
                await self._read_server_clock()
                self._sub = sub = await self._watch()
                info = await sub.consumer_info()
                # nats-py's own "no more current values" marker is decided from consumer info
                # while deliveries are still queued; a revision cannot overtake anything.
                pending, (sent, stream_seq) = info.num_pending or 0, _delivered(info)
                if pending == 0 and not ready.done():
                    self._ready_at = stream_seq if sent else 0
                    if self._revision >= self._ready_at:
                        ready.set_result(None)
                await asyncio.shield(ready)
        except BaseException:
            await self.stop()
            raise
        self._task = asyncio.create_task(self._guard(), name="seqstate-view-guard")
        return self

    async def _read_server_clock(self) -> None:
        """The server's time now, against ours: the current values arrive at once whenever
        they were written, and their stored times say when that was, so a view that starts
        beside a projector stopped long ago does not take its last values for news."""
        assert self._js is not None, "start() makes it"
        subject = f"{api_prefix(self._js)}.STREAM.INFO.{self._stream}"
        asked = time.monotonic()
        try:
            reply = await self.nc.request(subject, b"", timeout=min(self._initial_timeout, 5.0))
            stamp = msgspec.json.decode(reply.data).get("ts")
        except (nats.errors.Error, TimeoutError, msgspec.DecodeError, AttributeError):
            return  # its values count from when they arrive
        server_ns = stamp_ns(stamp) if isinstance(stamp, str) else None  # a server before 2.10
        if server_ns is not None:
            self._server_clock = (server_ns, asked)

    async def stop(self) -> None:
        """End the watch (``async with`` does it on exit); the replica keeps what it holds."""
        if self._task is not None:
            await cancel_all([self._task], None)  # a request may drop one cancellation
            self._task = None
        self._generation += 1
        await self._unsubscribe()
        if self._held:
            self._release()  # what arrived is shown, as before the watch ended
        self._stopped = True
        for moved in self._moved:
            moved.set()  # each changes() iterator ends

    # ---- the watch --------------------------------------------------------------------------

    async def _watch(self) -> JetStreamContext.PushSubscription:
        """An ordered consumer of the namespace's keys: their current values at first, and
        after a stall every entry newer than the last one applied."""
        self._generation += 1
        generation = self._generation

        async def deliver(msg: Msg) -> None:
            if generation == self._generation:
                self._deliver(msg)

        if self._ready is not None and self._ready.done():
            policy = api.DeliverPolicy.BY_START_SEQUENCE
            config = api.ConsumerConfig(opt_start_seq=self._revision + 1)
        else:  # still loading: every current value, and whatever follows
            policy, config = api.DeliverPolicy.LAST_PER_SUBJECT, None
            if self._revision:  # a stall while loading: what was applied stays applied
                policy = api.DeliverPolicy.BY_START_SEQUENCE
                config = api.ConsumerConfig(opt_start_seq=self._revision + 1)
        self._stirred = time.monotonic()
        assert self._js is not None, "start() makes it"
        return await self._js.subscribe(
            f"{self._prefix}{self.config.namespace}.>",
            stream=self._stream,
            cb=deliver,
            ordered_consumer=True,
            deliver_policy=policy,
            config=config,
            idle_heartbeat=HEARTBEAT_S,
            inactive_threshold=INACTIVE_S,
        )

    def _deliver(self, msg: Msg) -> None:
        meta = msg.metadata
        revision = meta.sequence.stream
        if revision <= self._revision:
            return  # applied already (a watch that restarted behind the last one)
        self._revision = revision
        self._stirred = time.monotonic()
        headers = msg.headers
        deleted = False
        if headers:
            op = headers.get(KV_OP)
            if op is None and _MARKER_REASON in headers:
                op = _MARKERS.get(headers[_MARKER_REASON])
                if op is None:
                    return  # a marker of a kind not known yet: no value
            deleted = op in (KV_DEL, KV_PURGE)
        ready, ready_at = self._ready, self._ready_at
        if self._server_clock is not None and ready is not None and not ready.done():
            server_ns, asked = self._server_clock  # a current value: when was it written?
            written = asked + (datetime_ns(meta.timestamp) - server_ns) / 1e9
            self._written_at = min(time.monotonic(), written)
        key = msg.subject[len(self._prefix) :]
        if ready is not None and ready.done() and key not in self._unheld:
            # A flush's values wait for its position, written after them: what the view shows
            # is then always the state at its applied_seq, never half a flush ahead of it (a
            # scheduler counting its own events until the view passes them would count a free
            # twice). Values no position follows (a writer that died mid-flush, a key written
            # by hand) are shown after HOLD_S anyway.
            if not self._held:
                loop = asyncio.get_running_loop()
                self._hold_timer = loop.call_later(HOLD_S, self._release)
            self._held.append((key, msg.data, deleted))
            return
        before = self.applied_seq
        if self._held:
            self._release()
        self.receive(key, msg.data, deleted=deleted)
        self._position.advance(self.applied_seq)
        if self.applied_seq != before and (self._listeners or self._moved):
            self._notify()
        if (
            ready is not None
            and not ready.done()
            and (meta.num_pending == 0 or (ready_at is not None and revision >= ready_at))
        ):
            ready.set_result(None)

    def _release(self) -> None:
        """Show the values held for a position (see :meth:`_deliver`)."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
            self._hold_timer = None
        held, self._held = self._held, []
        for key, data, deleted in held:
            self.receive(key, data, deleted=deleted)

    async def _guard(self) -> None:
        """After each silence of ``stall_after_s``: is the watch still there? If not, a new one.

        Self-contained on purpose: the client and its reconnect callbacks belong to the caller.
        """
        while not self.nc.is_closed:
            wait = self._stirred + self.stall_after_s - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            self._stirred = time.monotonic()  # the next check after another silence
            try:
                if await self._stalled():
                    await self._resume()
            except Exception:  # a view that stops checking would go stale without a word
                log.exception("registry watch check failed; checking again")

    async def _stalled(self) -> bool:
        sub = self._sub
        if sub is None:
            return True  # the last attempt to re-create it failed
        seen = self._revision
        try:
            info = await sub.consumer_info()
        except NotFoundError:
            return True  # the server restarted (or dropped a watch inactive too long)
        except (nats.errors.Error, TimeoutError):
            # The server is away or busy, or the watch's consumer lived on a cluster node that
            # died (its info then never comes): unanswered twice running, the watch is made
            # anew; where the server is away, that attempt fails and is made again later.
            self._unanswered += 1
            return self._unanswered >= 2
        self._unanswered = 0
        sent = _delivered(info)[1]
        if sent < seen:
            return True  # a consumer that lost its state (recreated on a restarted node)
        # A consumer that says it sent more than arrived, or holds messages back, may only be
        # a delivery on its way: the same answer twice in a row is a stall.
        behind = sent > seen or bool(info.num_pending)
        if not behind or self._revision != seen:
            self._suspect = None
            return False
        stuck = self._suspect == seen
        self._suspect = seen
        return stuck

    async def _resume(self) -> None:
        await self._unsubscribe()
        self._suspect = None
        self._unanswered = 0
        try:
            self._sub = await self._watch()
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("registry watch not re-created yet, retrying: %s", exc)
            return
        self.resumes += 1
        log.info("registry watch re-created after revision %d", self._revision)

    async def _unsubscribe(self) -> None:
        sub, self._sub = self._sub, None
        if sub is not None and self._js is not None:
            await drop_subscription(self._js, sub)

    # ---- folding values ---------------------------------------------------------------------

    def receive(self, key: str, value: bytes | None, *, deleted: bool = False) -> None:
        """Fold one bucket entry into the replica; a damaged value is counted and skipped."""
        written, self._written_at = self._written_at, None
        heard = time.monotonic() if written is None else written
        kind, rank, slot, part = parse_key(self.config.namespace, key)
        if kind == "lease":  # who writes, not what: renewed every second even when nothing moves
            if not deleted and value:
                self._renewed(value, heard)
            return
        self.values_received += 1
        self._hear(heard)
        try:
            if kind == "position" and not deleted and value:
                position = decode_position(value)
                self.applied_seq = max(self.applied_seq, position.applied_seq)
                self._observe(position.as_of)
            elif kind == "tracker":
                self.block_size = None if deleted or not value else decode_tracker(value).block_size
            elif kind == "load" and rank is not None:
                if deleted or not value:
                    self.unreadable.pop(rank, None)
                    self.registry.apply(Delta("applied", 0, removed_ranks=[rank]))
                    self._forget_rank(rank)
                else:
                    try:
                        load = decode_load(value)
                    except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
                        self.unreadable[rank] = str(exc)
                        raise
                    self.unreadable.pop(rank, None)
                    self._observe(load.as_of)
                    self.registry.apply(Delta("applied", 0, [RankChange(rank, load.rank_load())]))
            elif (kind == "req" or kind == "part") and rank is not None:
                current = self.registry.load_of(rank)
                if current is None and (deleted or not value):
                    return  # the rest of a removed rank
                # Each key counts its own hashes: a long prompt's parts are held apart from
                # its head, under a number no slot has, and the counts add up the same.
                held = slot if kind == "req" else _part_slot(slot, part)
                booked = []
                if not deleted and value:
                    request = decode_request(value)
                    if not request.empty:
                        booked = [Booking(held, request.request_id, request.hash_list())]
                change = RankChange(rank, current or EMPTY_LOAD, [held], booked)
                self.registry.apply(Delta("applied", 0, [change]))
                if kind == "req":
                    self._index_slot(rank, slot, booked[0].request_id if booked else None)
        except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as exc:
            self.bad_values += 1
            if kind == "load":
                log.warning(
                    "rank %s of namespace %s not served: its load value %s does not decode (%s)",
                    rank,
                    self.namespace,
                    key,
                    exc,
                )
            else:
                log.warning("skipping unreadable value of %s: %s", key, exc)

    def _hear(self, heard: float) -> None:
        self._heard_at = heard if self._heard_at is None else max(self._heard_at, heard)

    def _renewed(self, value: bytes, heard: float) -> None:
        """A lease renewal: its writer lives, and a projector's says how far it is behind."""
        self._hear(heard)
        self.renewals += 1
        holder = decode_holder(value)
        if holder is None:
            return
        if 0 < holder.ttl_s < math.inf:
            self._lease_ttl_s = holder.ttl_s
        if holder.heartbeat is not None:
            self._heartbeat, self._heartbeat_at = holder.heartbeat, heard

    def _index_slot(self, rank: Rank, slot: int, request_id: str | None) -> None:
        ids = self._slot_ids.setdefault(rank, {})
        old = ids.pop(slot, None)
        if old is not None and self._request_ranks.get(old) == rank:
            del self._request_ranks[old]
        if request_id is not None:
            ids[slot] = request_id
            self._request_ranks[request_id] = rank

    def _forget_rank(self, rank: Rank) -> None:
        for request_id in self._slot_ids.pop(rank, {}).values():
            if self._request_ranks.get(request_id) == rank:
                del self._request_ranks[request_id]

    def _observe(self, as_of_ns: int) -> None:
        self.as_of_ns = max(self.as_of_ns, as_of_ns)
        offset = as_of_ns - time.monotonic_ns()
        if self._clock_offset_ns is None or offset > self._clock_offset_ns:
            self._clock_offset_ns = offset

    # ---- telling when the view moves --------------------------------------------------------

    def on_change(self, callback: Callable[[RegistryView], object]) -> Callable[[], None]:
        """Call ``callback(view)`` each time the view's position (``applied_seq``) advances;
        returns the handle that unsubscribes it (as :meth:`remove_listener` does).

        A position, not each key: the projector writes a flush's keys first and its position
        last, so at a position the view shows one event sequence whole, and a long prompt's
        keys or a removed worker's many keys make one call, not one each. The callback runs on
        the event loop, in the watch's delivery: keep it short (hand long work to a task, or
        use :meth:`changes`). An exception it raises is logged and changes nothing else."""
        self._listener_ids += 1
        key = self._listener_ids
        self._listeners[key] = callback

        def unsubscribe() -> None:
            self._listeners.pop(key, None)

        return unsubscribe

    def remove_listener(self, callback: Callable[[RegistryView], object]) -> None:
        """Unsubscribe ``callback`` (every time it was passed to :meth:`on_change`)."""
        for key in [k for k, f in self._listeners.items() if f == callback]:
            del self._listeners[key]

    async def changes(self) -> AsyncIterator[int]:
        """``async for seq in view.changes():`` the view's position each time it advances,
        until the view stops.

        Coalesced: a consumer slower than the moves gets the latest position when it asks
        again, never a queue of the ones it missed, so what it holds stays bounded however far
        behind it falls."""
        moved = asyncio.Event()
        self._moved.add(moved)
        try:
            seen = self.applied_seq
            while not self._stopped:
                await moved.wait()
                moved.clear()
                if self.applied_seq > seen:
                    seen = self.applied_seq
                    yield seen
        finally:
            self._moved.discard(moved)

    def _notify(self) -> None:
        for moved in self._moved:
            moved.set()
        for callback in tuple(self._listeners.values()):
            try:
                callback(self)
            except Exception:  # a scheduler's bug must not stop the view it reads
                log.exception("a change listener of the registry view failed")

    # ---- reads ------------------------------------------------------------------------------

    def export_metrics(self, registry: CollectorRegistry | None = None) -> Collector:
        """Opt-in: this view's per-worker gauges in ``registry`` (prometheus_client's default
        ``REGISTRY``, where a scheduler's own metrics usually are, when None), read at each
        scrape; the collector is returned for ``registry.unregister``. Several views in one
        registry: register one ``projector.bucket.view_metrics.view_collector(*views)``
        instead (their series share names, so each namespace must be collected once)."""
        from prometheus_client import REGISTRY

        from projector.bucket.view_metrics import view_collector

        collector = view_collector(self)
        (REGISTRY if registry is None else registry).register(collector)
        return collector

    def log_now_ns(self) -> int:
        """The view's estimate of the log's current time (receive-time anchored)."""
        if self._clock_offset_ns is None:
            return time.time_ns()
        return time.monotonic_ns() + self._clock_offset_ns

    def loads(self, now_ns: int | None = None) -> list[LoadRow]:
        """One row per rank, sorted by (worker_id, dp_rank); decay at ``now_ns`` (log time).
        A rank whose load value does not decode has no row (see :attr:`unreadable`)."""
        rows = self.registry.loads(self.log_now_ns() if now_ns is None else now_ns)
        if self.unreadable:
            rows = [r for r in rows if (r.worker_id, r.dp_rank) not in self.unreadable]
        return rows

    def potential_loads(
        self, block_hashes: Sequence[int], isl_tokens: int, now_ns: int | None = None
    ) -> list[PotentialLoadRow]:
        """What each rank's load would be with this request booked there (see PromptRegistry);
        none for a rank whose load value does not decode."""
        now = self.log_now_ns() if now_ns is None else now_ns
        rows = self.registry.potential_loads(block_hashes, isl_tokens, now)
        if self.unreadable:
            rows = [r for r in rows if (r.worker_id, r.dp_rank) not in self.unreadable]
        return rows

    def overlap_depths(self, block_hashes: Sequence[int]) -> dict[Rank, int]:
        """Per rank, how many leading blocks of the prompt it holds (ranks with none, and
        ranks in :attr:`unreadable`, omitted; :meth:`overlaps` gives every rank a row)."""
        depths = self.registry.overlap_depths(block_hashes)
        if self.unreadable:
            depths = {rank: d for rank, d in depths.items() if rank not in self.unreadable}
        return depths

    def overlaps(self, block_hashes: Sequence[int]) -> list[OverlapRow]:
        """The query's longest prefix active on each rank, a row per rank, zeros included."""
        return self._served(self.registry.overlaps(block_hashes))

    def costs(
        self,
        block_hashes: Sequence[int],
        isl_tokens: int,
        candidates: Iterable[Sequence[int]] | None = None,
        *,
        block_size: int | None = None,
        weights: CostWeights | None = None,
        overlaps: Mapping[Rank, int] | None = None,
        now_ns: int | None = None,
    ) -> list[CostRow]:
        """Dynamo's KV-router cost of this request on each rank (``PromptRegistry.costs``), in
        blocks of ``block_size``: by default the one the namespace's workers registered with.
        ``isl_tokens`` is the whole prompt; none for a rank whose load value does not decode."""
        if block_size is None:
            block_size = self.block_size
            if block_size is None:
                raise BlockSizeUnknown(
                    f"namespace {self.namespace!r} has no registered block size: "
                    "pass block_size= or register workers with one"
                )
        now = self.log_now_ns() if now_ns is None else now_ns
        rows = self.registry.costs(
            block_hashes,
            isl_tokens,
            now,
            block_size,
            DEFAULT_WEIGHTS if weights is None else weights,
            candidates,
            overlaps,
        )
        return self._served(rows)

    def _served(self, rows: list[_Row]) -> list[_Row]:
        """``rows`` without the ranks whose load value does not decode: unknown is not idle."""
        if not self.unreadable:
            return rows
        return [r for r in rows if (r.worker_id, r.dp_rank) not in self.unreadable]

    def rank_of(self, request_id: str) -> Rank | None:
        """The rank the bucket shows ``request_id`` booked on (None: not active, or not yet
        in the bucket)."""
        return self._request_ranks.get(request_id)

    def staleness(self) -> Staleness:
        """How far behind the log the view may be (see :class:`Staleness`)."""
        now = time.monotonic()
        age = math.inf if self._heard_at is None else now - self._heard_at
        beat, applied = self._heartbeat, self.applied_seq
        if beat is None:
            return Staleness(applied, self.as_of_ns, age, silent_after_s=self._lease_ttl_s)
        # The bucket lacked ``behind`` events after its position, all at or below ``head``; a
        # view further on lacks at most one per sequence it has yet to reach.
        logged = beat.behind - beat.captured
        events = beat.captured + (0 if applied >= beat.head else min(logged, beat.head - applied))
        waited = 0.0
        if events and beat.oldest_ns is not None:
            waited = max(0.0, (self.log_now_ns() - beat.oldest_ns) / 1e9)
        return Staleness(
            applied,
            self.as_of_ns,
            age,
            beat.head,
            events,
            waited,
            beat.ago_s + now - self._heartbeat_at,
            self._lease_ttl_s,
        )

    async def wait_for(self, seq: int, timeout: float | None = None) -> None:
        """Read-your-writes: return once the view reflects event sequence ``seq``."""
        await self._position.wait(seq, timeout)
