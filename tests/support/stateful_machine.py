"""The stateful property tests' machine: random event interleavings applied to the real
``SequenceState`` and to the naive model (stateful_model), compared after every step.

Block hashes are chained: every prompt is a prefix of one of a few fixed lineages of distinct
integers, so a hash identifies its whole prefix and prompts share prefixes realistically.
Each test_stateful_*.py runs the machine under some of the rules' settings.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from stateful_model import FREE, MARK, Expected, Model, Rank, S

from seqstate import (
    AddOutputBlock,
    AddRequest,
    Delta,
    Free,
    MarkPrefillCompleted,
    RouterGoodbye,
    RouterHeartbeat,
    SequenceState,
    Tick,
    WorkerAdded,
    WorkerRemoved,
)

WORKERS = (1, 2, 3)
DP_RANKS = (0, 1, 2)
REQUEST_IDS = tuple(f"r{i}" for i in range(8))
LINEAGE_LEN = 8
LINEAGES = tuple(tuple(k * 100 + i for i in range(1, LINEAGE_LEN + 1)) for k in range(4))
# Queries for overlap and potential loads: prefixes, full lineages, divergent tails, misses.
QUERIES: tuple[list[int], ...] = (
    [],
    [999],
    list(LINEAGES[0][:1]),
    list(LINEAGES[0][:4]),
    list(LINEAGES[1]),
    [*LINEAGES[2][:3], 250],
    list(LINEAGES[3][:6]),
    [*LINEAGES[1][:2], 10_001, 10_002],
)
BLOCK_SIZES = st.sampled_from((None, 16, 16, 32))


# ---- strategies -----------------------------------------------------------------------------

# Time steps: mostly small (prefills queue and decay), sometimes past the 30 s check interval
# or the 60 s expiry, rarely past the 300 s id retention; rarely a clock that steps back (the
# fold clamps it). Tick draws big steps more often.
_STEP_KINDS = {
    "zero": st.just(0),
    "small": st.integers(1, 5 * S),
    "check": st.integers(25 * S, 35 * S),
    "expiry": st.integers(55 * S, 130 * S),
    "huge": st.integers(130 * S, 400 * S),
    "back": st.integers(-3 * S, -1),
    # Whole seconds, so that both boundaries are hit exactly: a check runs when exactly 30 s
    # passed since the last one; a request added exactly expiry_s ago is kept.
    "round": st.sampled_from((1 * S, 5 * S, 10 * S, 30 * S, 60 * S)),
}
STEPS = st.sampled_from(
    ("small",) * 10 + ("zero",) * 2 + ("round",) * 2 + ("check", "expiry", "huge", "back")
).flatmap(_STEP_KINDS.__getitem__)
BIG_STEPS = st.sampled_from(("check", "expiry", "huge", "round")).flatmap(_STEP_KINDS.__getitem__)
IDS = st.sampled_from(REQUEST_IDS)
WORKER_IDS = st.sampled_from(WORKERS)
DPS = st.sampled_from(DP_RANKS)
# Adds favour one rank so that several prefills queue on it (anchor, credit, spillover).
ADD_WORKERS = st.sampled_from((1, 1, 1, 2, 3))
ADD_DPS = st.sampled_from((0, 0, 0, 1, 2))
TOKENS = st.one_of(st.just(0), st.integers(1, 7), st.integers(1, 4000), st.integers(1, 4000))
TRACK = st.sampled_from((True, True, True, False))
# Quarter-millisecond durations are exact in binary, so round(ms * 1e6) is exact too.
DURATIONS_MS = st.one_of(
    st.none(),
    st.none(),
    st.just(0.0),
    st.integers(0, 40_000).map(lambda q: q / 4),
    st.integers(0, 40_000).map(lambda q: q / 4),
    st.integers(1, 400).map(lambda q: q * 250.0),
    st.just(1e6),
)
# How Mark/Free/AddOutputBlock pick their id: any pool id, a live one, a prefilling one, or
# a prefilling one queued behind its rank's anchor (the non-anchor credit path).
AIMS = st.sampled_from(("any", "live", "live", "prefilling", "queued", "queued"))
PICKS = st.integers(0, 15)
# Adds mostly take an id that is not live (else most would be duplicates).
FRESH = st.sampled_from((True, True, True, False))
RANGES = st.tuples(WORKER_IDS, DPS, st.integers(1, 3))


def prompt(lineage: int, length: int) -> list[int]:
    return list(LINEAGES[lineage][:length])


def add_event(
    rid: str,
    rank: Rank,
    router: str,
    lineage: int,
    length: int,
    tokens: int,
    duration_ms: float | None,
    track: bool,
    lora: str | None,
    output_tokens: int | None,
) -> AddRequest:
    return AddRequest(
        request_id=rid,
        worker_id=rank[0],
        dp_rank=rank[1],
        block_hashes=prompt(lineage, length),
        prefill_tokens=tokens,
        expected_prefill_ms=duration_ms,
        expected_output_tokens=output_tokens,
        track_prefill_tokens=track,
        lora_name=lora,
        router_id=router,
    )


def worker_added(worker: int, dp_start: int, dp_size: int, block: int | None = None) -> WorkerAdded:
    """A range within dp ranks 0..2."""
    size = min(dp_size, len(DP_RANKS) - dp_start)
    return WorkerAdded(worker_id=worker, dp_start=dp_start, dp_size=size, block_size=block)


ROUTERS = ("", "ra", "rb")  # "": the add names no router

ADD_ARGS = {
    "rid": IDS,
    "lineage": st.integers(0, len(LINEAGES) - 1),
    "length": st.integers(0, LINEAGE_LEN),
    "tokens": TOKENS,
    "duration_ms": DURATIONS_MS,
    "track": TRACK,
    "lora": st.sampled_from([None, None, "a", "b"]),
    "output_tokens": st.none() | st.integers(0, 500),
    "router": st.sampled_from(ROUTERS),
    "step": STEPS,
}


# ---- the machine ----------------------------------------------------------------------------


# The arguments of every rule that aims an event at some request (live, prefilling, or any id).
TARGETED = dict(
    aim=AIMS,
    pick=PICKS,
    rid=IDS,
    use_owner=st.booleans(),
    worker=WORKER_IDS,
    dp=DPS,
    step=STEPS,
)


class SeqStateMachine(RuleBasedStateMachine):
    """Lazy workers, 60 s expiry."""

    EXPIRY_S: float | None = 60.0
    LAZY = True
    ORPHAN_S: float | None = 30.0
    GRACE_S: float | None = None
    TRACKER = False

    def __init__(self) -> None:
        super().__init__()
        self.state = SequenceState(
            expiry_s=self.EXPIRY_S,
            lazy_workers=self.LAZY,
            orphan_after_s=self.ORPHAN_S,
            worker_grace_s=self.GRACE_S,
            slot_tracker=self.TRACKER,
        )
        expiry_ns = None if self.EXPIRY_S is None else round(self.EXPIRY_S * S)
        orphan_ns = None if self.ORPHAN_S is None else round(self.ORPHAN_S * S)
        grace_ns = None if self.GRACE_S is None else round(self.GRACE_S * S)
        self.model = Model(
            expiry_ns, self.LAZY and not self.TRACKER, orphan_ns, grace_ns, self.TRACKER
        )

    def _apply(self, event: object, step: int) -> None:
        at = max(0, self.model.now + step)
        expected = self.model.apply(event, at)
        delta = self.state.apply(event, at)
        self._check_delta(delta, expected)

    def _check_delta(self, delta: Delta, exp: Expected) -> None:
        now = self.model.now
        assert delta.outcome == exp.outcome, (delta, exp)
        assert delta.at_ns == now
        assert delta.expired == exp.expired, (delta.expired, exp.expired)
        assert delta.orphaned == exp.orphaned, (delta.orphaned, exp.orphaned)
        assert delta.owner == exp.owner, (delta.owner, exp.owner)
        assert delta.block_size == exp.block_size, (delta.block_size, exp.block_size)
        assert [tuple(r) for r in delta.added_ranks] == exp.added_ranks
        assert [tuple(r) for r in delta.removed_ranks] == exp.removed_ranks
        got = [
            (
                (c.worker_id, c.dp_rank),
                c.released,
                [(b.slot, b.request_id, b.hashes) for b in c.booked],
            )
            for c in delta.changes
        ]
        assert got == exp.changes, (got, exp.changes)
        # A rank may change twice in one delta (orphans swept, then the event's own change):
        # its last change carries the load after the event.
        last = {(c.worker_id, c.dp_rank): c for c in delta.changes}
        for rank, change in last.items():
            assert change.load.active_blocks == self.model.active_blocks(rank)
            assert change.load.active_requests == len(self.model.on(rank))
            assert change.load.prefill.active_tokens(now) == self.model.active_tokens(rank, now)

    def _target(
        self, aim: str, pick: int, rid: str, use_owner: bool, worker: int, dp: int
    ) -> tuple[str, int, int]:
        """The id and payload rank of a Mark/Free/AddOutputBlock."""
        pool = self.model.live
        if aim == "prefilling":
            pool = [r for r in pool if r.prefilling] or pool
        elif aim == "queued":
            queued = [r for rank in self.model.ranks for r in self.model.prefills(rank)[1:]]
            pool = queued or pool
        if aim != "any" and pool:
            rid = pool[pick % len(pool)].rid
        req = self.model.find(rid)
        if use_owner and req is not None:
            return rid, *req.rank
        return rid, worker, dp

    # -- rules --

    @initialize(ranges=st.lists(RANGES, max_size=3))
    def register_workers(self, ranges: list[tuple[int, int, int]]) -> None:
        for worker, dp_start, dp_size in ranges:
            self._apply(worker_added(worker, dp_start, dp_size), 0)

    def _fresh(self, rid: str, fresh: bool) -> str:
        """With ``fresh``, the first id from ``rid`` on in the pool that is not live."""
        if not fresh:
            return rid
        live = {r.rid for r in self.model.live}
        start = REQUEST_IDS.index(rid)
        for i in range(len(REQUEST_IDS)):
            candidate = REQUEST_IDS[(start + i) % len(REQUEST_IDS)]
            if candidate not in live:
                return candidate
        return rid

    @rule(worker=ADD_WORKERS, dp=ADD_DPS, fresh=FRESH, **ADD_ARGS)
    def add_request(
        self, worker: int, dp: int, fresh: bool, rid: str, step: int, **fields: object
    ) -> None:
        rid = self._fresh(rid, fresh)
        self._apply(add_event(rid=rid, rank=(worker, dp), **fields), step)  # type: ignore[arg-type]

    @precondition(lambda self: self.model.ranks)
    @rule(pick=PICKS, fresh=FRESH, **ADD_ARGS)
    def add_request_beside(
        self, pick: int, fresh: bool, rid: str, step: int, **fields: object
    ) -> None:
        """Add on an existing rank, preferably one with live requests (queued prefills,
        shared prefixes)."""
        busy = [r.rank for r in self.model.live] or list(self.model.ranks)
        rank = busy[pick % len(busy)]
        rid = self._fresh(rid, fresh)
        self._apply(add_event(rid=rid, rank=rank, **fields), step)  # type: ignore[arg-type]

    @rule(**TARGETED)
    def mark_prefill_completed(
        self, aim: str, pick: int, rid: str, use_owner: bool, worker: int, dp: int, step: int
    ) -> None:
        rid, worker, dp = self._target(aim, pick, rid, use_owner, worker, dp)
        self._apply(MarkPrefillCompleted(request_id=rid, worker_id=worker, dp_rank=dp), step)

    @rule(**TARGETED)
    def free(
        self, aim: str, pick: int, rid: str, use_owner: bool, worker: int, dp: int, step: int
    ) -> None:
        rid, worker, dp = self._target(aim, pick, rid, use_owner, worker, dp)
        self._apply(Free(request_id=rid, worker_id=worker, dp_rank=dp), step)

    @rule(**TARGETED)
    def add_output_block(
        self, aim: str, pick: int, rid: str, use_owner: bool, worker: int, dp: int, step: int
    ) -> None:
        rid, worker, dp = self._target(aim, pick, rid, use_owner, worker, dp)
        self._apply(AddOutputBlock(request_id=rid, worker_id=worker, dp_rank=dp), step)

    @rule(remove=st.booleans(), worker_range=RANGES, step=STEPS, block=BLOCK_SIZES)
    def topology(
        self, remove: bool, worker_range: tuple[int, int, int], step: int, block: int | None
    ) -> None:
        worker, dp_start, dp_size = worker_range
        if remove:
            self._apply(WorkerRemoved(worker_id=worker), step)
        else:
            self._apply(worker_added(worker, dp_start, dp_size, block), step)

    @rule(step=st.one_of(STEPS, BIG_STEPS))
    def tick(self, step: int) -> None:
        self._apply(Tick(), step)

    @rule(router=st.sampled_from(ROUTERS[1:]), step=st.one_of(STEPS, BIG_STEPS))
    def heartbeat(self, router: str, step: int) -> None:
        self._apply(RouterHeartbeat(router_id=router), step)

    @rule(router=st.sampled_from(ROUTERS[1:]), step=STEPS)
    def goodbye(self, router: str, step: int) -> None:
        self._apply(RouterGoodbye(router_id=router), step)

    @rule()
    def snapshot_and_restore(self) -> None:
        data = self.state.snapshot()
        restored = SequenceState.restore(data)
        assert restored.snapshot() == data
        self.state = restored

    # -- the comparison, after every step --

    @invariant()
    def agrees_with_model(self) -> None:
        state, model = self.state, self.model
        now = model.now
        state.check_invariants()
        assert state.now_ns == now
        # Topology and ownership.
        assert list(state.workers.slots) == list(model.ranks)
        assert state.registry.ranks() == sorted(model.ranks)
        assert {w: (r.dp_start, r.dp_size) for w, r in state.workers.ranges.items()} == (
            model.ranges
        )
        assert state.requests.owner == {r.rid: r.rank for r in model.live}
        assert state.requests.lora == {r.rid: r.lora for r in model.live if r.lora is not None}
        assert state.requests.router_of == {r.rid: r.router for r in model.live if r.router}
        assert list(state.routers.items()) == list(model.routers.items())
        assert list(state.departures.slots) == list(model.parked)
        assert state.departures.workers == model.departed
        for rank in model.parked:
            assert list(state.departures.slots[rank].requests) == [r.rid for r in model.on(rank)]
        # Per-rank write model: prefill FIFO, anchor, expiry throttle; registry membership.
        everything: set[int] = set()
        for rank in model.ranks:
            slot = state.slot(*rank)
            assert slot is not None
            assert list(slot.requests) == [r.rid for r in model.on(rank)]
            assert [q.slot for q in slot.requests.values()] == [r.slot for r in model.on(rank)]
            queue = model.prefills(rank)
            assert slot.prefill.order == [r.rid for r in queue]
            anchor = model.anchor[rank]
            assert slot.prefill.anchor == (None if anchor is None else (queue[0].rid, anchor))
            assert slot.last_expiry_check_ns == model.last_check[rank]
            present = model.present(rank)
            assert state.registry.hashes_of(rank) == present
            everything |= present
        assert state.registry.membership_size() == len(everything)
        # Reads at several times, before and after the log's now.
        for t in (max(0, now - 2 * S), now, now + S, now + 7 * S, now + 100 * S):
            assert state.registry.loads(t) == model.load_rows(t), t
        for query in QUERIES:
            want = {rank: model.depth(rank, query) for rank in model.ranks}
            assert state.registry.overlap_depths(query) == {r: d for r, d in want.items() if d}
            isl = 16 * len(query) + 3
            assert state.registry.potential_loads(query, isl, now + S) == model.potential_rows(
                query, isl, now + S
            )
        # Memory of ended ids and tombstones, and counters.
        assert {rid: at for rid, _, at in state.ended.items()} == model.ended
        kinds = {1: MARK, 2: FREE}
        got_tombs = {rid: (kinds[v], at) for rid, v, at in state.tombstones.items()}
        assert got_tombs == model.tombstones
        assert state.counters == model.counters


SETTINGS = settings(max_examples=150, stateful_step_count=60, deadline=None)
