"""SequenceState: the orchestrator that folds lifecycle events into the write model.

``apply(event, at_ns)`` looks the request up (RequestIndex, WorkerTable), mutates the owning
rank's ActiveSequences, and returns a :class:`Delta` that it also applies to its own
PromptRegistry. It is a pure fold: the only time it knows is ``at_ns``, so the same events at
the same times always give the same state, byte for byte.

Lifecycle oddities are outcomes, never exceptions; only an object that is not an event raises.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Final

from seqstate import deltas as outcomes
from seqstate.deltas import TRACKER_ENDED, Booking, Delta, RankChange
from seqstate.departures import Departures
from seqstate.events import (
    AddOutputBlock,
    AddRequest,
    EventDecodeError,
    Free,
    MarkPrefillCompleted,
    RouterGoodbye,
    RouterHeartbeat,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)
from seqstate.publishers import MAX_PUBLISHERS, Publishers
from seqstate.recent import NEVER, RecentIds
from seqstate.registry import PromptRegistry
from seqstate.request_index import RequestIndex
from seqstate.sequences import EXPIRY_CHECK_INTERVAL_NS as EXPIRY_CHECK_NS
from seqstate.sequences import NS_PER_S, ActiveSequences
from seqstate.topology import Rank, TopologyChange, WorkerDpRange, WorkerTable

DEFAULT_EXPIRY_S: Final = 300.0
MAX_EXPIRY_S: Final = 10 * 365 * 24 * 3600.0  # beyond this, disable expiry (expiry_s=None)
MAX_TOMBSTONES: Final = 100_000
MAX_ENDED: Final = 250_000
MAX_REMOVED_WORKERS: Final = 100_000  # workers removed for good, remembered (oldest forgotten)

# Tombstone kinds; a Free tombstone outranks a Mark tombstone.
MARK_TOMBSTONE: Final = 1
FREE_TOMBSTONE: Final = 2

# A shared empty list for "nothing changed" fields of deltas; nothing mutates delta lists.
_NONE: Final[list] = []  # type: ignore[type-arg]

COUNTER_NAMES: Final = (
    *outcomes.OUTCOMES,
    "expired",
    "worker_mismatch",
    "tombstoned",
    "mark_before_add",
    "orphaned",
)


class SequenceState:
    """The authoritative write model (WorkerTable, RequestIndex, ActiveSequences per rank)
    plus the PromptRegistry derived from its deltas.

    ``expiry_s=None`` disables expiry. ``lazy_workers=False`` rejects requests for ranks no
    ``WorkerAdded`` registered (outcome ``unknown_worker``) instead of creating them.
    ``lease_scan_s`` replaces the age limit with the request lease of Dynamo's embedded
    router, on log time (see :meth:`_lease_scan`); None, the default, keeps the age limit.
    ``worker_grace_s`` keeps a removed worker's requests that long: a re-add within it
    restores them (see :mod:`seqstate.departures`); None, the default, drops them at once.

    ``slot_tracker=True`` folds by the rules of Dynamo's standalone slot tracker (the HTTP
    drop-in's): workers are strict (``lazy_workers=False``); an AddRequest's rank is checked
    before its id (an id live elsewhere sent to a bad rank is ``unknown_worker``); registering a
    registered worker is ``worker_exists`` and changes nothing; the first registration fixes
    the block size (another is ``block_size_mismatch``) until the last worker is removed,
    which ends the tracker; and while no worker is registered a request event is
    ``no_tracker`` and changes (or remembers) nothing. Under the router rules the latest
    registration that names a block size sets the namespace's, and no removal clears it.
    """

    def __init__(
        self,
        expiry_s: float | None = DEFAULT_EXPIRY_S,
        lazy_workers: bool = True,
        *,
        max_tombstones: int = MAX_TOMBSTONES,
        max_ended: int = MAX_ENDED,
        forget_lazy_after_s: float | None = None,
        orphan_after_s: float | None = None,
        worker_grace_s: float | None = None,
        slot_tracker: bool = False,
        max_publishers: int = MAX_PUBLISHERS,
        lease_scan_s: float | None = None,
    ) -> None:
        if expiry_s is not None:
            if not expiry_s > 0:
                raise ValueError("expiry_duration must be greater than zero")
            if not expiry_s <= MAX_EXPIRY_S:
                raise ValueError(f"expiry_duration must be at most {MAX_EXPIRY_S:.0f} s")
        if max_tombstones < 0 or max_ended < 0:
            raise ValueError("memory capacities must not be negative")
        if forget_lazy_after_s is not None and not 0 < forget_lazy_after_s <= MAX_EXPIRY_S:
            raise ValueError(f"forget_lazy_after_s must be in (0, {MAX_EXPIRY_S:.0f}] s")
        if orphan_after_s is not None and not 0 < orphan_after_s <= MAX_EXPIRY_S:
            raise ValueError(f"orphan_after_s must be in (0, {MAX_EXPIRY_S:.0f}] s")
        if worker_grace_s is not None and not 0 < worker_grace_s <= MAX_EXPIRY_S:
            raise ValueError(f"worker_grace_s must be in (0, {MAX_EXPIRY_S:.0f}] s")
        if lease_scan_s is not None and not 0 < lease_scan_s <= MAX_EXPIRY_S:
            raise ValueError(f"lease_scan_s must be in (0, {MAX_EXPIRY_S:.0f}] s")
        if worker_grace_s is not None and slot_tracker:
            raise ValueError(
                "worker_grace_s has no place under the slot-tracker rules, where "
                "an unregistered worker's requests are dropped at once"
            )
        self.worker_grace_s = worker_grace_s
        # Removed workers' busy ranks, parked for the grace (empty and unused without one).
        self.departures = Departures(
            0 if worker_grace_s is None else round(worker_grace_s * NS_PER_S)
        )
        # A router that heartbeated and then stayed silent this long has its requests freed
        # (outcome ``orphaned``). None: routers are never orphaned (the default).
        self.orphan_after_s = orphan_after_s
        self.orphan_ns: int | None = (
            None if orphan_after_s is None else round(orphan_after_s * NS_PER_S)
        )
        self.routers: dict[str, int] = {}  # live routers: last heard of (log time), oldest first
        self.expiry_s = expiry_s
        self.slot_tracker = slot_tracker
        self.lazy_workers = lazy_workers and not slot_tracker
        # Tokens per KV block: the tracker's under the slot-tracker rules, else the latest
        # registration's that named one (None: none did).
        self.block_size: int | None = None
        # A lazy rank (no WorkerAdded covers it) that a Tick finds empty this long is dropped,
        # so ranks named once by a stray event do not stay forever. None: never (the default).
        self.forget_lazy_after_s = forget_lazy_after_s
        self.forget_lazy_ns: int | None = (
            None if forget_lazy_after_s is None else round(forget_lazy_after_s * NS_PER_S)
        )
        self.idle_since: dict[Rank, int] = {}  # lazy ranks found empty at a Tick: since when
        self.expiry_ns: int | None = None if expiry_s is None else round(expiry_s * NS_PER_S)
        retention_ns = self.expiry_ns or round(DEFAULT_EXPIRY_S * NS_PER_S)
        # Dynamo's request lease (second-chance CLOCK), scanned every lease_scan_ns of log
        # time; 0: off, the ranks' age limit applies. Every live request holds a lease, in the
        # order of their periods (an Add, or a Mark that ends its pending prefill, refreshes it).
        self.lease_scan_s = None if lease_scan_s is None else float(lease_scan_s)
        self.lease_scan_ns = 0 if lease_scan_s is None else max(1, round(lease_scan_s * NS_PER_S))
        self.leases = RecentIds(NEVER, NEVER)
        self.lease_due_ns = NEVER  # the first scan that can expire a lease: apply checks it
        # The age limit each rank applies: none under the lease, which replaces it.
        self.age_expiry_ns: int | None = None if self.lease_scan_ns else self.expiry_ns
        # Workers removed for good (WorkerRemoved ``final``), by decimal id, oldest first: a
        # late AddRequest for one is refused until a WorkerAdded of it.
        self.removed_workers = RecentIds(NEVER, MAX_REMOVED_WORKERS)
        self.now_ns = 0
        self.workers = WorkerTable(self._make_slot)
        self.requests = RequestIndex()
        self.tombstones = RecentIds(retention_ns, max_tombstones)
        self.ended = RecentIds(retention_ns, max_ended)
        self.counters: dict[str, int] = dict.fromkeys(COUNTER_NAMES, 0)
        # Dynamo publishers' sequences: the holes in them (seqstate.publishers).
        self.publishers = Publishers(max_publishers)
        self.registry = PromptRegistry()
        self._projecting = True  # False while a replay defers the registry (defer_registry)
        self._changes = True  # False: deltas carry no per-rank changes (defer_registry)
        # One handler per event type: a dict lookup beats a chain of class patterns.
        self._handlers: dict[type, Callable[[Any, int], Delta]] = {
            AddRequest: self._add,
            MarkPrefillCompleted: self._mark,
            Free: self._free,
            AddOutputBlock: self._output_block,
            Tick: self._tick,
            RouterHeartbeat: self._heartbeat,
            RouterGoodbye: self._goodbye,
            WorkerAdded: self._worker_added,
            WorkerRemoved: self._worker_removed,
        }
        # Hot-path aliases of containers that live as long as the state.
        self._owner = self.requests.owner
        self._slots = self.workers.slots
        self._tombstone_entries = self.tombstones.entries
        self._ended_entries = self.ended.entries
        self._lease_entries = self.leases.entries
        self._removed_entries = self.removed_workers.entries

    def _make_slot(self, rank: Rank) -> ActiveSequences:
        return ActiveSequences(self.now_ns, self.age_expiry_ns)

    # ---- the fold -------------------------------------------------------------------------

    def apply(self, event: object, at_ns: int) -> Delta:
        """Fold one event at its log time; returns what changed (also applied to the registry)."""
        now = self.now_ns = at_ns if at_ns > self.now_ns else self.now_ns
        if now > self.tombstones.due_ns:
            self.tombstones.prune(now)
        if now > self.ended.due_ns:
            self.ended.prune(now)
        if now >= self.departures.due_ns:
            self._lapse_departures(now)
        handler = self._handlers.get(type(event))
        if handler is None:
            raise EventDecodeError(f"not a seqstate event: {type(event).__name__}")
        if now >= self.lease_due_ns:  # a scan is due before the event, as the boundary was
            lapsed = self._lease_scan(now)
            delta = handler(event, now)
            if lapsed[1]:
                self._with_lapsed(delta, lapsed)
        else:
            delta = handler(event, now)
        self.counters[delta.outcome] += 1
        if delta.expired:
            self.counters["expired"] += len(delta.expired)
        if delta.orphaned:
            self.counters["orphaned"] += len(delta.orphaned)
        if self._projecting:
            self.registry.apply(delta)
        return delta

    def echo(self, at_ns: int) -> Delta:
        """A message seqstate published itself came back (a Dynamo resync): counted, and
        nothing else changes, not even the state's clock."""
        self.counters[outcomes.ECHO] += 1
        return Delta(outcome=outcomes.ECHO, at_ns=at_ns if at_ns > self.now_ns else self.now_ns)

    def defer_registry(self, *, changes: bool = True) -> None:
        """Stop keeping the registry current until :meth:`sync_registry` (fast replays).

        A replay reads the registry once, at its end; keeping the hash index current on every
        event is about a third of the fold's cost. The write model is unaffected, so snapshots
        are byte-identical either way. With ``changes=False`` the deltas of adds, marks and
        frees also leave out their per-rank changes (outcome, expiry and topology stay), which
        a replay that discards them need not build.
        """
        self._projecting = False
        self._changes = changes

    def sync_registry(self) -> None:
        """Rebuild the registry from the write model and keep it current again."""
        self.registry = PromptRegistry()
        for delta in self.projection():
            self.registry.apply(delta)
        self._projecting = True
        self._changes = True

    def apply_all(self, timed_events: Iterable[tuple[object, int]]) -> list[Delta]:
        """Fold ``(event, at_ns)`` pairs in order (tests, replays)."""
        return [self.apply(event, at_ns) for event, at_ns in timed_events]

    # One piece: the fold's hottest path (every AddRequest, compiled by mypyc), where a call
    # per step costs measurably (benchmarks/fold.py); its order is Dynamo's and the tombstones'.
    def _add(self, event: AddRequest, now: int) -> Delta:  # noqa: C901
        request_id = event.request_id
        rank = (event.worker_id, event.dp_rank)
        if self.slot_tracker:  # Dynamo's order: the tracker, the rank, then the id
            if not self.workers.ranges:
                return Delta(outcome=outcomes.NO_TRACKER, at_ns=now)
            if rank not in self._slots:
                return Delta(outcome=outcomes.UNKNOWN_WORKER, at_ns=now)
        owner = self._owner.get(request_id)
        if owner is not None:
            return Delta(outcome=outcomes.DUPLICATE, at_ns=now, owner=owner)
        slot = self._slots.get(rank)
        if slot is None:
            if not self.lazy_workers:
                return Delta(outcome=outcomes.UNKNOWN_WORKER, at_ns=now)
            if self._removed_entries and str(rank[0]) in self._removed_entries:
                return Delta(outcome=outcomes.REMOVED_WORKER, at_ns=now)
        tombstone = self.tombstones.pop(request_id) if self._tombstone_entries else None
        if tombstone == FREE_TOMBSTONE:
            # Its Free already came: booking it now would leak its load until expiry.
            self.ended.put(request_id, 0, now)
            return Delta(outcome=outcomes.SUPERSEDED, at_ns=now)
        added_ranks: list[Rank] = []
        hidden = False
        if slot is None:
            # A rank of a worker removed within its grace: the request joins its parked
            # requests, out of sight, and comes back with them if the worker does.
            slot = self.departures.slots.get(rank) if self.departures.slots else None
            if slot is None:
                self.workers.ensure_worker(rank)
                slot = self._slots[rank]
                added_ranks.append(rank)
            else:
                hidden = True
        if slot.expiry_ns is not None and now - slot.last_expiry_check_ns >= EXPIRY_CHECK_NS:
            expired, released = slot.expire(now, self.requests.router_of, self._vouching())
            if expired:
                self._forget(expired, now)
        else:
            expired = released = _NONE
        marked = tombstone == MARK_TOMBSTONE
        if marked:
            self.counters["mark_before_add"] += 1
        self._ended_entries.pop(request_id, None)
        ms = event.expected_prefill_ms
        booked = slot.add(
            request_id,
            event.block_hashes,
            event.prefill_tokens if event.track_prefill_tokens else 0,
            None if ms is None else round(ms * 1_000_000),
            event.expected_output_tokens,
            marked,
            now,
        )
        self._owner[request_id] = rank
        if self.lease_scan_ns:
            self._lease(request_id, now)
        if event.lora_name is not None:
            self.requests.lora[request_id] = event.lora_name
        router_id = event.router_id
        if router_id:
            self.requests.set_router(request_id, router_id)
            if router_id in self.routers:
                self._heard(router_id, now)
        if hidden or not self._changes:
            return Delta(outcomes.APPLIED, now, _NONE, added_ranks, _NONE, expired)
        return Delta(
            outcomes.APPLIED,
            now,
            [
                RankChange(
                    rank, slot.load(), released, [Booking(booked.slot, request_id, booked.hashes)]
                )
            ],
            added_ranks,
            _NONE,
            expired,
        )

    def _unknown(self, request_id: str, worker_id: int, kind: int, now: int) -> Delta:
        """Mark or Free for an id that is not live: a no-op if it ended recently or names a
        worker removed for good (whose late AddRequest is refused anyway), else a tombstone so
        that its late AddRequest is handled right."""
        if request_id not in self.ended and not (
            self._removed_entries and str(worker_id) in self._removed_entries
        ):
            if self.tombstones.get(request_id) != FREE_TOMBSTONE:
                self.tombstones.put(request_id, kind, now)
            self.counters["tombstoned"] += 1
        return Delta(outcome=outcomes.UNKNOWN_REQUEST, at_ns=now)

    def _mark(self, event: MarkPrefillCompleted, now: int) -> Delta:
        if self.slot_tracker and not self.workers.ranges:
            return Delta(outcome=outcomes.NO_TRACKER, at_ns=now)
        if event.router_id in self.routers:
            self._heard(event.router_id, now)
        request_id = event.request_id
        owner = self._owner.get(request_id)
        if owner is None:
            return self._unknown(request_id, event.worker_id, MARK_TOMBSTONE, now)
        named = owner[0] == event.worker_id and owner[1] == event.dp_rank
        if not named:
            self.counters["worker_mismatch"] += 1
        slot = self._slots.get(owner)
        hidden = slot is None
        if slot is None:
            slot = self.departures.slots[owner]
        # Dynamo's replicas refresh a request's lease when a Mark that names its worker ends
        # its pending prefill; a repeated Mark, or one of a request with no prefill load, not.
        refresh = named and self.lease_scan_ns != 0 and request_id in slot.prefill.prefills
        if not slot.mark_prefill_completed(request_id, now):
            return Delta(outcome=outcomes.DUPLICATE, at_ns=now)
        if refresh:
            self._lease(request_id, now)
        if hidden or not self._changes:
            return Delta(outcomes.APPLIED, now)
        return Delta(
            outcomes.APPLIED,
            now,
            [RankChange(owner, slot.load(), _NONE, _NONE)],
        )

    def _free(self, event: Free, now: int) -> Delta:
        if self.slot_tracker and not self.workers.ranges:
            return Delta(outcome=outcomes.NO_TRACKER, at_ns=now)
        if event.router_id in self.routers:
            self._heard(event.router_id, now)
        request_id = event.request_id
        owner = self._owner.pop(request_id, None)
        if owner is None:
            return self._unknown(request_id, event.worker_id, FREE_TOMBSTONE, now)
        if owner[0] != event.worker_id or owner[1] != event.dp_rank:
            self.counters["worker_mismatch"] += 1
        if self.requests.lora:
            self.requests.lora.pop(request_id, None)
        if self.requests.router_of:
            self.requests.drop_router(request_id)
        if self.lease_scan_ns:
            self._lease_entries.pop(request_id, None)
        slot = self._slots.get(owner)
        hidden = slot is None
        if slot is None:
            slot = self.departures.slots[owner]
        released = slot.free(request_id, now)
        self.ended.put(request_id, 0, now)
        if hidden or not self._changes:
            return Delta(outcomes.APPLIED, now)
        return Delta(
            outcomes.APPLIED,
            now,
            [RankChange(owner, slot.load(), [released], _NONE)],
        )

    def _output_block(self, event: AddOutputBlock, now: int) -> Delta:
        if self.slot_tracker and not self.workers.ranges:
            return Delta(outcome=outcomes.NO_TRACKER, at_ns=now)
        owner = self._owner.get(event.request_id)
        if owner is None:
            return Delta(outcome=outcomes.UNKNOWN_REQUEST, at_ns=now)
        if owner[0] != event.worker_id or owner[1] != event.dp_rank:
            self.counters["worker_mismatch"] += 1
        slot = self._slots.get(owner)
        if slot is None:  # parked with its departed worker: out of sight
            self.departures.slots[owner].add_output_block(event.request_id, event.decay_fraction)
            return Delta(outcome=outcomes.APPLIED, at_ns=now)
        slot.add_output_block(event.request_id, event.decay_fraction)
        return Delta(
            outcome=outcomes.APPLIED,
            at_ns=now,
            changes=[RankChange(owner, slot.load())],
        )

    def _tick(self, _event: Tick, now: int) -> Delta:
        changes, orphaned = self._orphan_lapsed(now)
        all_expired: list[str] = []
        router_of, routers = self.requests.router_of, self._vouching()
        for rank, slot in self.workers.slots.items():
            expired, released = slot.expire(now, router_of, routers)
            if expired:
                self._forget(expired, now)
                all_expired.extend(expired)
                changes.append(RankChange(rank, slot.load(), released))
        gone = self._idle_lazy_ranks(now) if self.forget_lazy_ns is not None else []
        return Delta(
            outcome=outcomes.APPLIED,
            at_ns=now,
            changes=changes,
            expired=all_expired,
            removed_ranks=gone,
            orphaned=orphaned,
        )

    # ---- the request lease ------------------------------------------------------------------

    def _lease(self, request_id: str, now: int) -> None:
        """A request's lease is taken or refreshed: it goes to the back of the scan order,
        unless it was already refreshed in this scan period (its expiry would not move)."""
        scan = self.lease_scan_ns
        since = self.leases.written_ns(request_id)
        if since is not None and since // scan == now // scan:
            return
        self.leases.put(request_id, 0, now)
        if self.lease_due_ns == NEVER:
            self.lease_due_ns = (now // scan + 2) * scan

    def _lease_scan(self, now: int) -> tuple[list[RankChange], list[str]]:
        """Dynamo's request-lease reaper, a second-chance CLOCK, on log time.

        Dynamo scans every S seconds: a lease refreshed since the last scan loses its mark, an
        unmarked one expires, so a request goes 1 to 2 scans after its last refresh. Here the
        scans are at the log-time multiples of S, run at the first event that reaches one
        (missed ones collapse): a lease last refreshed in scan period ``e = t // S`` expires at
        the first scan at or after ``(e + 2) * S``. Leases are kept in the order they were taken
        or moved by a refresh in a later period, so a scan costs what it expires. A request of a
        live router (while lapsed routers are orphaned) is spared, as by the age limit: its lease
        is refreshed instead. Returns the changes of the ranks in sight and the expired ids, in
        lease order."""
        scan = self.lease_scan_ns
        lapsed = self.leases.take_before((now // scan - 1) * scan)
        vouched = self._vouching()
        if vouched:
            router_of = self.requests.router_of
            spared = [rid for rid in lapsed if router_of.get(rid, "") in vouched]
            if spared:
                for request_id in spared:
                    self.leases.put(request_id, 0, now)
                kept = set(spared)
                lapsed = [rid for rid in lapsed if rid not in kept]
        oldest = self.leases.oldest_ns()
        self.lease_due_ns = NEVER if oldest is None else (oldest // scan + 2) * scan
        if not lapsed:
            return [], lapsed
        owner, visible, parked = self._owner, self._slots, self.departures.slots
        released: dict[Rank, list[int]] = {}
        for request_id in lapsed:
            rank = owner[request_id]
            slot = visible.get(rank)
            if slot is None:  # parked with its departed worker: out of sight
                parked[rank].free(request_id, now)
                continue
            freed = released.get(rank)
            if freed is None:
                released[rank] = freed = []
            freed.append(slot.free(request_id, now))
        self._forget(lapsed, now)
        return [RankChange(r, visible[r].load(), freed) for r, freed in released.items()], lapsed

    def _with_lapsed(self, delta: Delta, lapsed: tuple[list[RankChange], list[str]]) -> None:
        """Put a lease scan's expiries first in the event's delta, as they came first. A rank
        the event then removed is left out: its removal says all (the read model applies
        removals before changes, and would otherwise bring the rank back)."""
        changes, expired = lapsed
        slots = self._slots
        delta.changes = [c for c in changes if c.rank in slots] + delta.changes
        delta.expired = expired + delta.expired

    # ---- routers ----------------------------------------------------------------------------

    def _vouching(self) -> dict[str, int] | None:
        """The routers whose requests the age limit spares: the live ones, but only while
        lapsed routers are orphaned (else a router that died would shield its requests
        forever)."""
        return self.routers if self.orphan_ns is not None else None

    def _heard(self, router_id: str, now: int) -> None:
        """A live router was heard from: it moves to the back of the lapse order."""
        routers = self.routers
        routers.pop(router_id, None)
        routers[router_id] = now

    def _heartbeat(self, event: RouterHeartbeat, now: int) -> Delta:
        changes, orphaned = self._orphan_lapsed(now)
        self._heard(event.router_id, now)
        return Delta(outcome=outcomes.APPLIED, at_ns=now, changes=changes, orphaned=orphaned)

    def _goodbye(self, event: RouterGoodbye, now: int) -> Delta:
        changes, orphaned = self._orphan_lapsed(now)
        self.routers.pop(event.router_id, None)
        more, left = self._free_router(event.router_id, now)
        return Delta(
            outcome=outcomes.APPLIED, at_ns=now, changes=changes + more, orphaned=orphaned + left
        )

    def _orphan_lapsed(self, now: int) -> tuple[list[RankChange], list[str]]:
        """Free the requests of every router silent for ``orphan_after_s`` (oldest first)."""
        changes: list[RankChange] = []
        orphaned: list[str] = []
        if self.orphan_ns is None:
            return changes, orphaned
        routers = self.routers
        cutoff = now - self.orphan_ns
        while routers:
            router_id, heard = next(iter(routers.items()))
            if heard > cutoff:
                break
            del routers[router_id]
            more, ids = self._free_router(router_id, now)
            changes += more
            orphaned += ids
        return changes, orphaned

    def _free_router(self, router_id: str, now: int) -> tuple[list[RankChange], list[str]]:
        """Free every live request ``router_id`` added, in a canonical order (rank, add time,
        id), so that a fold restored from a snapshot frees them exactly as the original."""
        held = self.requests.by_router.pop(router_id, None)
        if not held:
            return [], []
        owner, visible, parked = self._owner, self._slots, self.departures.slots

        def slot_of(rank: Rank) -> ActiveSequences:
            slot = visible.get(rank)
            return parked[rank] if slot is None else slot

        order = sorted(
            held, key=lambda rid: (owner[rid], slot_of(owner[rid]).requests[rid].added_ns, rid)
        )
        lora, router_of = self.requests.lora, self.requests.router_of
        by_rank: list[tuple[Rank, list[int]]] = []  # the order is by rank: one entry each
        leases = self._lease_entries
        for request_id in order:
            rank = owner.pop(request_id)
            lora.pop(request_id, None)
            router_of.pop(request_id, None)
            leases.pop(request_id, None)
            released = slot_of(rank).free(request_id, now)
            self.ended.put(request_id, 0, now)
            if by_rank and by_rank[-1][0] == rank:
                by_rank[-1][1].append(released)
            else:
                by_rank.append((rank, [released]))
        changes = [  # a parked rank is out of the read model's sight
            RankChange(rank, visible[rank].load(), freed)
            for rank, freed in by_rank
            if rank in visible
        ]
        return changes, order

    def _idle_lazy_ranks(self, now: int) -> list[Rank]:
        """Drop the lazy ranks that Ticks have found empty for ``forget_lazy_after_s``."""
        assert self.forget_lazy_ns is not None
        ranges = self.workers.ranges
        seen = self.idle_since
        idle: dict[Rank, int] = {}
        gone: list[Rank] = []
        for rank, slot in self.workers.slots.items():
            registered = ranges.get(rank[0])
            if slot.requests or (registered is not None and rank[1] in registered.ranks()):
                continue
            since = seen.get(rank, now)
            if now - since >= self.forget_lazy_ns:
                gone.append(rank)
            else:
                idle[rank] = since
        for rank in gone:
            self.workers.forget_rank(rank)
        self.idle_since = idle
        return gone

    def _forget(self, request_ids: list[str], now: int) -> None:
        """Requests that ended without a Free (expired or dropped with their worker)."""
        remove = self.requests.remove
        put = self.ended.put
        leases = self._lease_entries
        for request_id in request_ids:
            remove(request_id)
            put(request_id, 0, now)
            leases.pop(request_id, None)

    def _worker_added(self, event: WorkerAdded, now: int) -> Delta:
        worker_id = event.worker_id
        worker = WorkerDpRange(worker_id, event.dp_start, event.dp_size)
        if self.slot_tracker:
            # Dynamo's order: a block size the tracker does not have is refused first, even
            # for a worker already there.
            wanted = event.block_size
            if wanted is not None and self.block_size not in (None, wanted):
                return Delta(
                    outcome=outcomes.BLOCK_SIZE_MISMATCH, at_ns=now, block_size=self.block_size
                )
            if worker_id in self.workers.ranges:
                return Delta(outcome=outcomes.WORKER_EXISTS, at_ns=now)
            if self.block_size is None:
                self.block_size = wanted
        else:
            # The router rules refuse no registration: the latest that names a block size sets
            # the namespace's (a scheduler's cost counts blocks), the same range and size
            # again changes nothing.
            wanted = event.block_size
            if self.workers.ranges.get(worker_id) == worker and wanted in (None, self.block_size):
                return Delta(outcome=outcomes.DUPLICATE, at_ns=now)
            if wanted is not None:
                self.block_size = wanted
        if self._removed_entries:
            self._removed_entries.pop(str(worker_id), None)  # back: a new start, empty
        back = self.departures.reclaim(worker_id) if worker_id in self.departures else {}
        if back:
            # Back within its grace: the ranks of its new range come back with their
            # requests; parked ranks outside it end as a removal ends them.
            in_range = worker.ranks()
            for rank, slot in back.items():
                if rank[1] in in_range:
                    self.workers.adopt(rank, slot)
                else:
                    self._forget(list(slot.requests), now)
        change = self._dropping_requests(worker_id, lambda: self.workers.upsert_worker(worker), now)
        restored = [rank for rank in back if rank in self._slots]
        changes = [
            RankChange(
                rank,
                slot.load(),
                _NONE,
                [Booking(r.slot, rid, r.hashes) for rid, r in slot.requests.items()],
            )
            for rank in restored
            for slot in (self._slots[rank],)
        ]
        return Delta(
            outcome=outcomes.APPLIED,
            at_ns=now,
            changes=changes,
            added_ranks=restored + change.added,
            removed_ranks=change.removed,
            block_size=self.block_size,
        )

    def _worker_removed(self, event: WorkerRemoved, now: int) -> Delta:
        worker_id = event.worker_id
        if event.final and not self.slot_tracker:
            return self._worker_gone(worker_id, now)
        if worker_id not in self.workers.ranges and worker_id not in self.workers.by_worker:
            return Delta(outcome=outcomes.UNKNOWN_WORKER, at_ns=now)
        if self.worker_grace_s is None:
            change = self._dropping_requests(
                worker_id, lambda: self.workers.remove_worker(worker_id), now
            )
            if self.slot_tracker and not self.workers.ranges:
                self.block_size = None  # the last worker went: so did the tracker
                return Delta(
                    outcome=outcomes.APPLIED,
                    at_ns=now,
                    removed_ranks=change.removed,
                    block_size=TRACKER_ENDED,
                )
            return Delta(outcome=outcomes.APPLIED, at_ns=now, removed_ranks=change.removed)
        slots = self._slots
        busy = {
            (worker_id, dp_rank): slots[(worker_id, dp_rank)]
            for dp_rank in self.workers.by_worker.get(worker_id, ())
            if slots[(worker_id, dp_rank)].requests
        }
        change = self.workers.remove_worker(worker_id)
        self.departures.park(worker_id, busy, now)
        return Delta(outcome=outcomes.APPLIED, at_ns=now, removed_ranks=change.removed)

    def _worker_gone(self, worker_id: int, now: int) -> Delta:
        """A removal for good: the worker's ranks go with their requests, grace or not (it will
        not come back: a restarted Dynamo worker has a new id), parked ones too, and its id is
        remembered so that no late AddRequest brings a rank of it back. Known or not: a worker
        may die before any request named it. A repeat changes nothing (``duplicate``)."""
        key = str(worker_id)
        parked = self.departures.reclaim(worker_id) if worker_id in self.departures else {}
        known = worker_id in self.workers.ranges or worker_id in self.workers.by_worker
        if not known and not parked and key in self._removed_entries:
            return Delta(outcome=outcomes.DUPLICATE, at_ns=now)
        for slot in parked.values():
            self._forget(list(slot.requests), now)
        change = self._dropping_requests(
            worker_id, lambda: self.workers.remove_worker(worker_id), now
        )
        self.removed_workers.put(key, 0, now)
        return Delta(outcome=outcomes.APPLIED, at_ns=now, removed_ranks=change.removed)

    def _lapse_departures(self, now: int) -> None:
        """Workers whose grace ended without a re-add: their requests end now."""
        for slot in self.departures.lapse(now):
            self._forget(list(slot.requests), now)

    def _dropping_requests(
        self, worker_id: int, mutate: Callable[[], TopologyChange], now: int
    ) -> TopologyChange:
        """Run a mutation of one worker's ranks; requests of removed ranks end without a Free.

        Only that worker's ranks are looked at, so the cost is what the worker holds."""
        slots = self._slots
        before = {r: slots[(worker_id, r)] for r in self.workers.by_worker.get(worker_id, ())}
        change = mutate()
        for rank in change.removed:
            self._forget(list(before[rank[1]].requests), now)
        return change

    # ---- reads ------------------------------------------------------------------------------

    def slot(self, worker_id: int, dp_rank: int = 0) -> ActiveSequences | None:
        return self.workers.slots.get((worker_id, dp_rank))

    def active_lora_counts(self) -> dict[str, int]:
        return self.requests.active_lora_counts()

    def check_invariants(self) -> None:
        """Every cross-structure invariant of the write model (tests and debugging)."""
        from seqstate.invariants import check_invariants

        check_invariants(self)

    # ---- persistence --------------------------------------------------------------------

    def snapshot(self) -> bytes:
        """The whole write model (and counters), as deterministic msgpack bytes."""
        from seqstate.snapshot import encode_state

        return encode_state(self)

    @classmethod
    def restore(
        cls, data: bytes | bytearray | memoryview, *, registry: bool = True
    ) -> SequenceState:
        """Rebuild a state, registry included, from :meth:`snapshot` bytes. ``registry=False``:
        without it, deferred as :meth:`defer_registry` leaves it (a writer, which never reads
        it, skips building the hash index of every live request), until :meth:`sync_registry`."""
        from seqstate.snapshot import decode_state

        return decode_state(data, registry=registry)

    def projection(self) -> list[Delta]:
        """Deltas that build this state's read model from an empty registry.

        Used after a restore, and by a projector that re-derives its bucket from scratch.
        """
        changes = []
        for rank, slot in self.workers.slots.items():
            booked = [Booking(r.slot, rid, r.hashes) for rid, r in slot.requests.items()]
            changes.append(RankChange(rank, slot.load(), [], booked))
        return [
            Delta(
                outcome=outcomes.APPLIED,
                at_ns=self.now_ns,
                added_ranks=list(self.workers.slots),
                changes=changes,
                block_size=self.block_size,
            )
        ]
