"""PromptRegistry: the derived read model that schedulers query.

It is not a source of truth: it follows the write model only through :class:`Delta` values,
so it can live in another process (the projector, a scheduler's replica) or be rebuilt from a
snapshot.

Deltas name requests, not hash sets: a booking brings a request's prompt hashes and its slot,
a release names the slot. So the registry reference-counts each rank's hashes itself, and a
change costs what the event changed, never the size of the rank's set. Removing a rank
releases its own requests, not a scan of every hash.

Membership is a map from prompt hash to a bitmask of the ranks on which it is present. Each
rank owns one bit. The overlap depth of a query on a rank is the length of the longest query
prefix present there (prefix membership: the walk stops at the first miss). One walk along
the query narrows the mask of still-matching ranks, so a potential-load read costs one dict
lookup per query block, not one per block per worker. Because block hashes are chained, a
hash present on a rank implies its whole prefix is present there, which is what makes the
per-hash mask exact.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from seqstate.cost import DEFAULT_WEIGHTS, CostRow, CostWeights, dynamo_cost
from seqstate.decay import active_tokens, modeled_remaining_ms
from seqstate.deltas import Delta
from seqstate.loads import EMPTY_LOAD, LoadRow, OverlapRow, PotentialLoadRow, RankLoad

Rank = tuple[int, int]


class _Holdings:
    """One rank's booked requests (by slot) and its hashes held more than once."""

    __slots__ = ("bit", "extra", "held")

    def __init__(self, bit: int) -> None:
        self.bit = bit
        self.held: dict[int, list[int]] = {}  # slot -> the prompt hashes its request holds
        self.extra: dict[int, int] = {}  # hash -> references beyond the first


class PromptRegistry:
    """Per-rank loads plus prompt membership, updated only by :meth:`apply`."""

    __slots__ = ("_all", "_free_bits", "_index", "_loads", "_next_bit", "_order", "_ranks")

    def __init__(self) -> None:
        self._loads: dict[Rank, RankLoad] = {}
        self._ranks: dict[Rank, _Holdings] = {}
        self._index: dict[int, int] = {}
        self._free_bits: list[int] = []
        self._next_bit = 0
        self._order: list[tuple[int, int, Rank, int]] | None = []
        self._all = 0  # the bits of every known rank

    # ---- writes -------------------------------------------------------------------------

    def apply(self, delta: Delta) -> None:
        """Fold one delta: its removed and added ranks, then each rank's new load, released
        slots and bookings. The one way the registry changes."""
        if delta.removed_ranks or delta.added_ranks:
            for rank in delta.removed_ranks:
                self._remove_rank((rank[0], rank[1]))
            for rank in delta.added_ranks:
                self._ensure_rank((rank[0], rank[1]))
        ranks = self._ranks
        loads = self._loads
        for change in delta.changes:
            rank = change.rank
            holdings = ranks.get(rank)
            if holdings is None:
                rank = (rank[0], rank[1])  # a decoded delta may carry a list
                holdings = self._ensure_rank(rank)
            if change.released:
                held = holdings.held
                for slot in change.released:
                    hashes = held.pop(slot, None)
                    if hashes is not None:
                        self._drop(holdings, hashes)
            for booking in change.booked:
                old = holdings.held.get(booking.slot)
                if old is not None:  # a slot is released before it is booked again
                    self._drop(holdings, old)
                holdings.held[booking.slot] = booking.hashes
                self._take(holdings, booking.hashes)
            loads[rank] = change.load

    def _take(self, holdings: _Holdings, hashes: list[int]) -> None:
        # Hashes and masks stay Python objects here (``Any``): compiled code would otherwise
        # unbox each one and allocate it again for the dict call.
        index: dict[Any, Any] = self._index
        get = index.get
        flag = 1 << holdings.bit
        extra: dict[Any, Any] = holdings.extra
        h: Any
        for h in hashes:
            mask: int = get(h, 0)
            if mask & flag:
                extra[h] = extra.get(h, 0) + 1
            else:
                index[h] = mask | flag

    def _drop(self, holdings: _Holdings, hashes: list[int]) -> None:
        index: dict[Any, Any] = self._index
        flag = 1 << holdings.bit
        extra: dict[Any, Any] = holdings.extra
        h: Any
        for h in hashes:
            if extra:
                count = extra.get(h)
                if count is not None:
                    if count == 1:
                        del extra[h]
                    else:
                        extra[h] = count - 1
                    continue
            mask: int = index.pop(h, 0)
            if mask & ~flag:
                index[h] = mask & ~flag

    def _ensure_rank(self, rank: Rank) -> _Holdings:
        holdings = self._ranks.get(rank)
        if holdings is not None:
            return holdings
        if self._free_bits:
            bit = heapq.heappop(self._free_bits)
        else:
            bit = self._next_bit
            self._next_bit += 1
        holdings = self._ranks[rank] = _Holdings(bit)
        self._all |= 1 << bit
        self._loads[rank] = EMPTY_LOAD
        self._order = None
        return holdings

    def _remove_rank(self, rank: Rank) -> None:
        holdings = self._ranks.pop(rank, None)
        if holdings is None:
            return
        del self._loads[rank]
        holdings.extra.clear()  # every reference goes: only the first of each counts
        for hashes in holdings.held.values():
            self._drop(holdings, hashes)
        self._all &= ~(1 << holdings.bit)
        heapq.heappush(self._free_bits, holdings.bit)
        self._order = None

    # ---- reads --------------------------------------------------------------------------

    def _rows(self) -> list[tuple[int, int, Rank, int]]:
        order = self._order
        if order is None:
            order = sorted((w, r, (w, r), h.bit) for (w, r), h in self._ranks.items())
            self._order = order
        return order

    def ranks(self) -> list[Rank]:
        return [rank for _, _, rank, _ in self._rows()]

    def load_of(self, rank: Rank) -> RankLoad | None:
        return self._loads.get(rank)

    def loads(self, now_ns: int) -> list[LoadRow]:
        """One row per known rank, sorted by (worker_id, dp_rank); decay evaluated at ``now_ns``."""
        loads = self._loads
        rows = []
        for worker_id, dp_rank, rank, _ in self._rows():
            load = loads[rank]
            prefill = load.prefill
            rows.append(
                LoadRow(
                    worker_id,
                    dp_rank,
                    load.active_blocks,
                    active_tokens(prefill, now_ns),
                    load.active_requests,
                    modeled_remaining_ms(prefill, now_ns),
                )
            )
        return rows

    def overlap_depths(self, block_hashes: Iterable[int]) -> dict[Rank, int]:
        """Longest present prefix of the query per rank; ranks with depth 0 are omitted
        (Dynamo's map; :meth:`overlaps` gives a row per rank, zeros included)."""
        depth_by_bit = self._depths(list(block_hashes))
        return {rank: depth_by_bit[h.bit] for rank, h in self._ranks.items() if depth_by_bit[h.bit]}

    def overlaps(self, block_hashes: Sequence[int]) -> list[OverlapRow]:
        """The query's longest prefix active on each rank, in blocks: one row per known rank,
        zeros included, sorted by (worker_id, dp_rank)."""
        depths = self._depths(block_hashes) if len(block_hashes) else None
        return [
            OverlapRow(worker_id, dp_rank, depths[bit] if depths else 0)
            for worker_id, dp_rank, _, bit in self._rows()
        ]

    def _depths(self, query: Sequence[int]) -> list[int]:
        n = len(query)
        depths = [n] * self._next_bit
        alive = self._all
        get = self._index.get
        for i, h in enumerate(query):
            if not alive:
                break
            still = alive & get(h, 0)
            if still != alive:
                dropped = alive ^ still
                while dropped:
                    low = dropped & -dropped
                    depths[low.bit_length() - 1] = i
                    dropped ^= low
                alive = still
        return depths

    def potential_loads(
        self, block_hashes: Sequence[int], isl_tokens: int, now_ns: int
    ) -> list[PotentialLoadRow]:
        """What each rank's load would be if this request were booked there.

        ``potential_decode_blocks = active_blocks + len(block_hashes) - overlap_depth`` and
        ``potential_prefill_tokens = active_prefill_tokens(now) + isl_tokens``.
        """
        n = len(block_hashes)
        depths = self._depths(block_hashes) if n else None
        loads = self._loads
        rows = []
        for worker_id, dp_rank, rank, bit in self._rows():
            load = loads[rank]
            prefill = load.prefill
            tokens = 0 if prefill.anchored_since_ns is None else active_tokens(prefill, now_ns)
            rows.append(
                PotentialLoadRow(
                    worker_id,
                    dp_rank,
                    tokens + isl_tokens,
                    load.active_blocks + n - (depths[bit] if depths else 0),
                    load.active_requests,
                )
            )
        return rows

    def costs(
        self,
        block_hashes: Sequence[int],
        isl_tokens: int,
        now_ns: int,
        block_size: int,
        weights: CostWeights = DEFAULT_WEIGHTS,
        candidates: Iterable[Sequence[int]] | None = None,
        overlaps: Mapping[Rank, int] | None = None,
    ) -> list[CostRow]:
        """Dynamo's cost of booking this request on each rank (:mod:`seqstate.cost`).

        One row per known rank (of ``candidates`` only, when given: an unknown one has no
        row), sorted by (worker_id, dp_rank). The blocks credited as cached on a rank are
        ``overlaps[rank]`` when the caller knows the ranks' caches (its own KV indexer; a rank
        absent from it: 0), else the prompt's prefix active on the rank, which is in its cache.
        """
        if block_size <= 0:
            raise ValueError(f"block_size={block_size}: must be positive")
        n = len(block_hashes)
        depths = self._depths(block_hashes) if n else None
        if candidates is None:
            order = self._rows()
        else:
            known = self._ranks
            wanted = {(c[0], c[1]) for c in candidates}  # a decoded rank may be a list
            order = sorted((w, r, (w, r), known[w, r].bit) for w, r in wanted if (w, r) in known)
        loads = self._loads
        rows = []
        for worker_id, dp_rank, rank, bit in order:
            load = loads[rank]
            tokens = active_tokens(load.prefill, now_ns)
            depth = depths[bit] if depths else 0
            decode = load.active_blocks + n - depth
            cached = depth
            if overlaps is not None:
                cached = overlaps.get(rank, 0)
                if cached < 0:
                    raise ValueError(f"overlaps[{rank}]={cached}: must be non-negative")
            cost, prefill = dynamo_cost(
                weights, block_size, isl_tokens, tokens, cached, decode, load.active_requests
            )
            rows.append(
                CostRow(
                    worker_id,
                    dp_rank,
                    cost,
                    cached,
                    depth,
                    prefill,
                    tokens + isl_tokens,
                    decode,
                    load.active_requests,
                )
            )
        return rows

    # ---- inspection (tests, operators) ----------------------------------------------------

    def hashes_of(self, rank: Rank) -> set[int]:
        holdings = self._ranks.get(rank)
        if holdings is None:
            return set()
        return {h for hashes in holdings.held.values() for h in hashes}

    def requests_of(self, rank: Rank) -> dict[int, list[int]]:
        """The rank's booked requests: slot -> prompt hashes."""
        holdings = self._ranks.get(rank)
        return {} if holdings is None else dict(holdings.held)

    def references(self, rank: Rank, block_hash: int) -> int:
        """How many booked requests of ``rank`` hold ``block_hash`` (0: not active there). A
        scheduler's own bookings not yet in its replica are counted against this."""
        holdings = self._ranks.get(rank)
        if holdings is None or not self._index.get(block_hash, 0) >> holdings.bit & 1:
            return 0
        return 1 + holdings.extra.get(block_hash, 0)

    def membership_size(self) -> int:
        """Number of distinct prompt hashes present on any rank."""
        return len(self._index)

    def __len__(self) -> int:
        return len(self._ranks)
