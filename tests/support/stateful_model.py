"""A naive model of the rules, for the stateful property tests (test_stateful_*.py).

Written from the rules (docs/architecture.md, "The rules", and Dynamo's ActiveSequences and
prefill tracker in ``lib/kv-router/src/sequences``), not from the core: it keeps a flat list of
live requests and recomputes every read (blocks, prefill decay, overlap) from that list with
exact rational arithmetic. After every step the real ``SequenceState`` must agree with it
exactly (stateful_machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction

from seqstate import (
    AddOutputBlock,
    AddRequest,
    Free,
    LoadRow,
    MarkPrefillCompleted,
    PotentialLoadRow,
    RouterGoodbye,
    RouterHeartbeat,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)

S = 1_000_000_000
MS = 1_000_000
CHECK_INTERVAL_NS = 30 * S
DEFAULT_RETENTION_NS = 300 * S
MARK, FREE = "mark", "free"

Rank = tuple[int, int]

OUTCOMES = (
    "applied",
    "duplicate",
    "unknown_request",
    "unknown_worker",
    "superseded",
    "no_tracker",
    "worker_exists",
    "block_size_mismatch",
    "echo",  # a Dynamo message of seqstate's own resync: never in these events
    "removed_worker",  # an add for a worker removed for good: no final removal here
)


@dataclass
class Live:
    """One live request as the model sees it."""

    rid: str
    rank: Rank
    hashes: list[int]
    tokens: int  # effective prefill tokens (0 when untracked or no load)
    duration_ns: int | None
    added_ns: int
    marked: bool
    lora: str | None
    outputs: int = 0
    slot: int = -1
    router: str = ""

    @property
    def prefilling(self) -> bool:
        return self.tokens > 0 and not self.marked


@dataclass
class Expected:
    """What the Delta of one event should say. ``changes`` = (rank, released slots, bookings
    as (slot, request id, hashes))."""

    outcome: str
    expired: list[str] = field(default_factory=list)
    added_ranks: list[Rank] = field(default_factory=list)
    removed_ranks: list[Rank] = field(default_factory=list)
    changes: list[tuple[Rank, list[int], list[tuple[int, str, list[int]]]]] = field(
        default_factory=list
    )
    orphaned: list[str] = field(default_factory=list)
    owner: Rank | None = None  # a duplicate add's: the rank holding the id
    block_size: int | None = None  # a WorkerAdded's: the namespace's after it


class Model:
    """Flat, slow, obviously-correct bookkeeping of the rules."""

    def __init__(
        self,
        expiry_ns: int | None,
        lazy: bool,
        orphan_ns: int | None = None,
        grace_ns: int | None = None,
        tracker: bool = False,
    ) -> None:
        self.tracker = tracker  # Dynamo's slot-tracker rules (strict workers too)
        self.block_size: int | None = None
        self.expiry_ns = expiry_ns
        self.orphan_ns = orphan_ns
        self.grace_ns = grace_ns
        # Removed workers within their grace: deadline and parked ranks, removal order; the
        # parked ranks keep their requests in ``live`` (and their anchor and check times).
        self.departed: dict[int, tuple[int, list[Rank]]] = {}
        self.parked: dict[Rank, None] = {}
        self.routers: dict[str, int] = {}  # heartbeating routers: last heard, oldest first
        self.lazy = lazy
        self.retention_ns = expiry_ns if expiry_ns is not None else DEFAULT_RETENTION_NS
        self.now = 0
        self.live: list[Live] = []  # in add order
        self.ranks: dict[Rank, None] = {}  # in creation order
        self.ranges: dict[int, tuple[int, int]] = {}
        self.anchor: dict[Rank, int | None] = {}
        self.last_check: dict[Rank, int] = {}
        self.ended: dict[str, int] = {}
        self.tombstones: dict[str, tuple[str, int]] = {}
        self.counters: dict[str, int] = {
            **dict.fromkeys(OUTCOMES, 0),
            "expired": 0,
            "worker_mismatch": 0,
            "tombstoned": 0,
            "mark_before_add": 0,
            "orphaned": 0,
        }

    # -- reads --

    def find(self, rid: str) -> Live | None:
        for req in self.live:
            if req.rid == rid:
                return req
        return None

    def on(self, rank: Rank) -> list[Live]:
        return [r for r in self.live if r.rank == rank]

    def lowest_free_slot(self, rank: Rank) -> int:
        held = {r.slot for r in self.on(rank)}
        return next(slot for slot in range(len(held) + 1) if slot not in held)

    def present(self, rank: Rank) -> set[int]:
        out: set[int] = set()
        for req in self.on(rank):
            out.update(req.hashes)
        return out

    def prefills(self, rank: Rank) -> list[Live]:
        return [r for r in self.on(rank) if r.prefilling]

    def active_blocks(self, rank: Rank) -> int:
        return len(self.present(rank)) + sum(r.outputs for r in self.on(rank))

    def active_tokens(self, rank: Rank, now: int) -> int:
        """The pending prefill tokens, the oldest's decayed over its expected duration, in exact
        rationals."""
        queue = self.prefills(rank)
        if not queue:
            return 0
        anchor = self.anchor[rank]
        assert anchor is not None
        total = sum(r.tokens for r in queue)
        t_a, d_a = queue[0].tokens, queue[0].duration_ns
        elapsed = max(0, now - anchor)
        if any(r.duration_ns is None for r in queue):
            if d_a is None:
                remaining = t_a
            elif d_a == 0 or elapsed >= d_a:
                remaining = 0
            else:
                remaining = math.ceil(t_a * (1 - Fraction(elapsed, d_a)))
            return total - t_a + remaining
        completed = t_a if d_a == 0 else math.floor(Fraction(t_a * elapsed, d_a))
        return max(0, total - completed)

    def modeled_ms(self, rank: Rank, now: int) -> int | None:
        """The modeled prefill time left: the queue's durations, the oldest's decayed."""
        queue = self.prefills(rank)
        if any(r.duration_ns is None for r in queue):
            return None
        total_ms = sum(r.duration_ns // MS for r in queue)  # type: ignore[operator]
        if not queue:
            return total_ms
        anchor = self.anchor[rank]
        assert anchor is not None
        elapsed = max(0, now - anchor)
        return max(0, total_ms - elapsed // MS)

    def load_rows(self, now: int) -> list[LoadRow]:
        return [
            LoadRow(
                w,
                d,
                self.active_blocks((w, d)),
                self.active_tokens((w, d), now),
                len(self.on((w, d))),
                self.modeled_ms((w, d), now),
            )
            for (w, d) in sorted(self.ranks)
        ]

    def depth(self, rank: Rank, query: list[int]) -> int:
        best = 0
        for req in self.on(rank):
            n = 0
            while n < len(query) and n < len(req.hashes) and query[n] == req.hashes[n]:
                n += 1
            best = max(best, n)
        return best

    def potential_rows(self, query: list[int], isl: int, now: int) -> list[PotentialLoadRow]:
        return [
            PotentialLoadRow(
                w,
                d,
                self.active_tokens((w, d), now) + isl,
                self.active_blocks((w, d)) + len(query) - self.depth((w, d), query),
                len(self.on((w, d))),
            )
            for (w, d) in sorted(self.ranks)
        ]

    # -- mutations --

    def _remove_prefill(self, req: Live, now: int) -> None:
        """Take a still-prefilling request out of its rank's FIFO (6.2 remove)."""
        queue = self.prefills(req.rank)
        if queue[0] is req:
            self.anchor[req.rank] = now if len(queue) > 1 else None
        elif req.duration_ns is not None:
            anchor = self.anchor[req.rank]
            assert anchor is not None
            self.anchor[req.rank] = min(anchor + req.duration_ns, now)

    def _end(self, req: Live, now: int) -> None:
        if req.prefilling:
            self._remove_prefill(req, now)
        self.live.remove(req)
        self._put_ended(req.rid, now)

    def _put_ended(self, rid: str, now: int) -> None:
        self.ended.pop(rid, None)
        self.ended[rid] = now

    def _create_rank(self, rank: Rank, now: int) -> None:
        self.ranks[rank] = None
        self.anchor[rank] = None
        self.last_check[rank] = now

    def _drop_rank(self, rank: Rank, now: int) -> None:
        for req in self.on(rank):
            self.live.remove(req)
            self._put_ended(req.rid, now)
        self.ranks.pop(rank, None)
        self.parked.pop(rank, None)
        del self.anchor[rank], self.last_check[rank]

    def _expire(self, rank: Rank, now: int) -> tuple[list[str], list[int]]:
        if self.expiry_ns is None or now - self.last_check[rank] < CHECK_INTERVAL_NS:
            return [], []
        self.last_check[rank] = now
        victims = [
            r
            for r in self.on(rank)
            if r.added_ns < now - self.expiry_ns
            and not (self.orphan_ns is not None and r.router in self.routers)
        ]
        for req in victims:
            self._end(req, now)
        return [r.rid for r in victims], [r.slot for r in victims]

    def _advance(self, at: int) -> int:
        self.now = max(self.now, at)
        cutoff = self.now - self.retention_ns
        self.ended = {k: t for k, t in self.ended.items() if t >= cutoff}
        self.tombstones = {k: v for k, v in self.tombstones.items() if v[1] >= cutoff}
        for w, (until, ranks) in list(self.departed.items()):
            if until > self.now:
                break
            del self.departed[w]
            for rank in ranks:
                self._drop_rank(rank, self.now)
        return self.now

    def apply(self, event: object, at: int) -> Expected:
        now = self._advance(at)
        if isinstance(event, AddRequest):
            exp = self._add(event, now)
        elif isinstance(event, MarkPrefillCompleted):
            exp = self._mark(event, now)
        elif isinstance(event, Free):
            exp = self._free(event, now)
        elif isinstance(event, AddOutputBlock):
            exp = self._output(event)
        elif isinstance(event, Tick):
            exp = self._tick(now)
        elif isinstance(event, RouterHeartbeat):
            exp = Expected("applied")
            self._sweep(now, exp)
            self._heard(event.router_id, now)
        elif isinstance(event, RouterGoodbye):
            exp = Expected("applied")
            self._sweep(now, exp)
            self.routers.pop(event.router_id, None)
            self._free_router(event.router_id, now, exp)
        elif isinstance(event, WorkerAdded):
            exp = self._worker_added(event, now)
        elif isinstance(event, WorkerRemoved):
            exp = self._worker_removed(event, now)
        else:
            raise AssertionError(event)
        self.counters[exp.outcome] += 1
        self.counters["expired"] += len(exp.expired)
        self.counters["orphaned"] += len(exp.orphaned)
        return exp

    def _heard(self, router: str, now: int) -> None:
        self.routers.pop(router, None)
        self.routers[router] = now

    def _sweep(self, now: int, exp: Expected) -> None:
        """Orphan every router silent for the timeout, oldest first."""
        if self.orphan_ns is None:
            return
        for router, heard in list(self.routers.items()):
            if heard > now - self.orphan_ns:
                break
            del self.routers[router]
            self._free_router(router, now, exp)

    def _free_router(self, router: str, now: int, exp: Expected) -> None:
        mine = sorted(
            (r for r in self.live if r.router == router), key=lambda r: (r.rank, r.added_ns, r.rid)
        )
        current: Rank | None = None
        for req in mine:
            self._end(req, now)
            if req.rank in self.parked:  # out of the read model's sight
                exp.orphaned.append(req.rid)
                continue
            if req.rank == current:
                exp.changes[-1][1].append(req.slot)
            else:
                exp.changes.append((req.rank, [req.slot], []))
                current = req.rank
            exp.orphaned.append(req.rid)

    def _add(self, ev: AddRequest, now: int) -> Expected:
        rank = (ev.worker_id, ev.dp_rank)
        if self.tracker and not self.ranges:
            return Expected("no_tracker")
        if self.tracker and rank not in self.ranks:
            return Expected("unknown_worker")
        live = self.find(ev.request_id)
        if live is not None:
            return Expected("duplicate", owner=live.rank)
        if rank not in self.ranks and not self.lazy:
            return Expected("unknown_worker")
        tomb = self.tombstones.pop(ev.request_id, None)
        kind = None if tomb is None else tomb[0]
        if kind == FREE:
            self._put_ended(ev.request_id, now)
            return Expected("superseded")
        added: list[Rank] = []
        if rank not in self.ranks and rank not in self.parked:
            self._create_rank(rank, now)
            added.append(rank)
        expired, released = self._expire(rank, now)
        if kind == MARK:
            self.counters["mark_before_add"] += 1
        self.ended.pop(ev.request_id, None)
        ms = ev.expected_prefill_ms
        req = Live(
            ev.request_id,
            rank,
            list(ev.block_hashes),
            ev.prefill_tokens if ev.track_prefill_tokens else 0,
            None if ms is None else round(ms * MS),
            now,
            kind == MARK,
            ev.lora_name,
            slot=self.lowest_free_slot(rank),
            router=ev.router_id,
        )
        self.live.append(req)
        if ev.router_id in self.routers:
            self._heard(ev.router_id, now)
        if req.prefilling and self.anchor[rank] is None:
            self.anchor[rank] = now
        if rank in self.parked:
            return Expected("applied", expired)
        booked = (req.slot, req.rid, list(dict.fromkeys(req.hashes)))
        return Expected("applied", expired, added, [], [(rank, released, [booked])])

    def _owner(self, ev: MarkPrefillCompleted | Free | AddOutputBlock) -> Live | None:
        req = self.find(ev.request_id)
        if req is not None and req.rank != (ev.worker_id, ev.dp_rank):
            self.counters["worker_mismatch"] += 1
        return req

    def _unknown(self, rid: str, kind: str, now: int) -> Expected:
        if rid not in self.ended:
            current = self.tombstones.get(rid)
            if current is None or current[0] != FREE:
                self.tombstones.pop(rid, None)
                self.tombstones[rid] = (kind, now)
            self.counters["tombstoned"] += 1
        return Expected("unknown_request")

    def _mark(self, ev: MarkPrefillCompleted, now: int) -> Expected:
        if self.tracker and not self.ranges:
            return Expected("no_tracker")
        req = self._owner(ev)
        if req is None:
            return self._unknown(ev.request_id, MARK, now)
        if req.marked:
            return Expected("duplicate")
        if req.prefilling:
            self._remove_prefill(req, now)
        req.marked = True
        return Expected("applied", changes=self._seen(req.rank, []))

    def _free(self, ev: Free, now: int) -> Expected:
        if self.tracker and not self.ranges:
            return Expected("no_tracker")
        req = self._owner(ev)
        if req is None:
            return self._unknown(ev.request_id, FREE, now)
        self._end(req, now)
        return Expected("applied", changes=self._seen(req.rank, [req.slot]))

    def _output(self, ev: AddOutputBlock) -> Expected:
        assert ev.decay_fraction is None
        if self.tracker and not self.ranges:
            return Expected("no_tracker")
        req = self._owner(ev)
        if req is None:
            return Expected("unknown_request")
        req.outputs += 1
        return Expected("applied", changes=self._seen(req.rank, []))

    def _seen(self, rank: Rank, released: list[int]) -> list[tuple[Rank, list[int], list]]:  # type: ignore[type-arg]
        """The change a read model sees: none for a parked rank."""
        return [] if rank in self.parked else [(rank, released, [])]

    def _tick(self, now: int) -> Expected:
        exp = Expected("applied")
        self._sweep(now, exp)
        for rank in list(self.ranks):
            expired, released = self._expire(rank, now)
            if expired:
                exp.expired.extend(expired)
                exp.changes.append((rank, released, []))
        return exp

    def _worker_added(self, ev: WorkerAdded, now: int) -> Expected:
        w = ev.worker_id
        new = (ev.dp_start, ev.dp_size)
        if self.tracker:
            if ev.block_size is not None and self.block_size not in (None, ev.block_size):
                return Expected("block_size_mismatch", block_size=self.block_size)
            if w in self.ranges:
                return Expected("worker_exists")
            if self.block_size is None:
                self.block_size = ev.block_size
        else:  # the router rules: the latest registration naming a block size sets it
            if self.ranges.get(w) == new and ev.block_size in (None, self.block_size):
                return Expected("duplicate")
            if ev.block_size is not None:
                self.block_size = ev.block_size
        old = self.ranges.get(w)
        self.ranges[w] = new
        new_ranks = range(new[0], new[0] + new[1])
        exp = Expected("applied")
        _, back = self.departed.pop(w, (0, []))
        for rank in back:  # back within its grace: its range's parked ranks, with requests
            if rank[1] in new_ranks:
                del self.parked[rank]
                self.ranks[rank] = None
                exp.added_ranks.append(rank)
                bookings = [(r.slot, r.rid, list(dict.fromkeys(r.hashes))) for r in self.on(rank)]
                exp.changes.append((rank, [], bookings))
            else:
                self._drop_rank(rank, now)
        exp.block_size = self.block_size
        if old is not None:
            for d in range(old[0], old[0] + old[1]):
                if d not in new_ranks and (w, d) in self.ranks:
                    self._drop_rank((w, d), now)
                    exp.removed_ranks.append((w, d))
        for d in new_ranks:
            if (w, d) not in self.ranks:
                self._create_rank((w, d), now)
                exp.added_ranks.append((w, d))
        return exp

    def _worker_removed(self, ev: WorkerRemoved, now: int) -> Expected:
        w = ev.worker_id
        doomed = [rank for rank in self.ranks if rank[0] == w]
        if w not in self.ranges and not doomed:
            return Expected("unknown_worker")
        self.ranges.pop(w, None)
        if self.grace_ns is None:
            for rank in doomed:
                self._drop_rank(rank, now)
            if self.tracker and not self.ranges:
                self.block_size = None  # the tracker ends with its last worker
                return Expected("applied", removed_ranks=doomed, block_size=0)
            return Expected("applied", removed_ranks=doomed)
        _, parked = self.departed.pop(w, (0, []))
        for rank in parked:  # parked again: its ranks go after every other worker's
            self.parked[rank] = self.parked.pop(rank)
        for rank in doomed:
            del self.ranks[rank]
            if self.on(rank):
                self.parked[rank] = None
                parked.append(rank)
            else:
                del self.anchor[rank], self.last_check[rank]
        if parked:
            self.departed[w] = (now + self.grace_ns, parked)
        return Expected("applied", removed_ranks=doomed)
