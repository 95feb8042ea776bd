"""What the write model may hold: admission, before an event is applied.

Ranks. Each rank costs a slot, two bucket keys and a row in every read. A ``WorkerAdded`` with
``dp_size`` 4096 is a valid event, and 25 of them made 102,408 ranks (250 MB in the writer,
204k keys). So the writer refuses, and dead-letters with the reason, an event that would take a
worker or the whole table past its bound. The check is a pure function of the state and the
event, and costs what the event names (its dp range), not the size of the table; every fold
of the log (the writer, a replay) asks it before ``apply`` (through
:class:`seqstate.fold.Fold`), so they stay equal.

Sums. A rank's pending prefill tokens and modeled prefill milliseconds are sums of numbers the
events carry, each valid alone (a u64), so two valid AddRequests with ``prefill_tokens`` of
2^63 made a sum no delta could encode (msgpack stops at u64): the writer died on it, for good.
An AddRequest that would take either sum of its rank past :data:`MAX_SUM` is refused with
the sum it would make. Every other number the state keeps is a count that grows by one per
event or by what one event carries (requests, slots, blocks, output blocks), or a log time:
2^64 is out of reach of any log. Checked against the rank's slot as it stands before the
event, so an add that would be a duplicate, or whose Mark came first, is refused alike: the
rule stays a function of the state and the event alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from seqstate.decay import NS_PER_MS
from seqstate.deltas import U64_MAX
from seqstate.events import MAX_PREFILL_MS, AddRequest, Event, RouterHeartbeat, WorkerAdded
from seqstate.prefill import PrefillTracker
from seqstate.state import SequenceState

MAX_RANKS_PER_WORKER: Final = 1024
MAX_RANKS: Final = 16_384
# Live routers the write model tracks: each heartbeat of a new router id adds one until it
# lapses, so a flood of invented ids must not grow the state without bound.
MAX_ROUTERS: Final = 100_000
# The largest sum a rank keeps: what a delta (msgpack) and a bucket value can carry.
MAX_SUM: Final = U64_MAX
# One AddRequest adds at most MAX_PREFILL_MS whole milliseconds: below this, no add can overflow.
_MS_NEAR_MAX: Final = MAX_SUM - int(MAX_PREFILL_MS)


@dataclass(frozen=True)
class RankBounds:
    per_worker: int = MAX_RANKS_PER_WORKER
    total: int = MAX_RANKS
    routers: int = MAX_ROUTERS

    def refusal(self, state: SequenceState, event: Event) -> str:
        """Why ``event`` may not be applied ("" if it may)."""
        workers = state.workers
        # Exact type tests: an isinstance of a Struct class costs ~80 ns, on every event.
        if type(event) is RouterHeartbeat:
            if event.router_id in state.routers or len(state.routers) < self.routers:
                return ""
            return (
                f"{len(state.routers)} live routers already, the bound (max_routers); "
                f"router {event.router_id!r} is not tracked"
            )
        if type(event) is AddRequest:
            rank = (event.worker_id, event.dp_rank)
            slot = workers.slots.get(rank)
            known = slot is not None
            if slot is None and state.departures.slots:  # a departed worker's, in its grace
                slot = state.departures.slots.get(rank)
            if slot is not None and event.prefill_tokens and event.track_prefill_tokens:
                prefill = slot.prefill  # the fold's hot path: two additions, one call if near
                if (
                    prefill.full_tokens + event.prefill_tokens > MAX_SUM
                    or prefill.modeled_ms_sum > _MS_NEAR_MAX
                ):
                    why = _prefill_overflow(rank, prefill, event)
                    if why:
                        return why
            if known or not state.lazy_workers:
                return ""  # an existing rank, or none is created (unknown_worker)
            return self._over(
                event.worker_id, workers.ranks_of(event.worker_id) + 1, len(workers.slots) + 1
            )
        if type(event) is WorkerAdded:
            worker_id = event.worker_id
            wanted = range(event.dp_start, event.dp_start + event.dp_size)
            if event.dp_size > self.per_worker:
                return self._over(worker_id, event.dp_size, 0)
            have = workers.by_worker.get(worker_id, {})
            old = workers.ranges.get(worker_id)
            dropped = sum(1 for r in (old.ranks() if old else ()) if r in have and r not in wanted)
            added = sum(1 for r in wanted if r not in have)
            return self._over(
                worker_id, len(have) + added - dropped, len(workers.slots) + added - dropped
            )
        return ""

    def _over(self, worker_id: int, worker_ranks: int, total: int) -> str:
        if worker_ranks > self.per_worker:
            return (
                f"worker {worker_id} would have {worker_ranks} ranks, over the bound of "
                f"{self.per_worker} per worker (max_ranks_per_worker)"
            )
        if total > self.total:
            return (
                f"the write model would hold {total} ranks, over the bound of "
                f"{self.total} (max_ranks)"
            )
        return ""


def _prefill_overflow(rank: tuple[int, int], prefill: PrefillTracker, event: AddRequest) -> str:
    """Why booking ``event``'s prefill would take a sum of its rank past :data:`MAX_SUM`."""
    tokens = prefill.full_tokens + event.prefill_tokens
    if tokens > MAX_SUM:
        return (
            f"the prefill tokens pending on worker {rank[0]} rank {rank[1]} would sum to "
            f"{tokens}, over the bound of {MAX_SUM} (u64); AddRequest "
            f"{event.request_id[:60]!r} is not booked"
        )
    ms = event.expected_prefill_ms
    if ms is not None:
        total_ms = prefill.modeled_ms_sum + round(ms * 1_000_000) // NS_PER_MS
        if total_ms > MAX_SUM:
            return (
                f"the modeled prefill milliseconds pending on worker {rank[0]} rank {rank[1]} "
                f"would sum to {total_ms}, over the bound of {MAX_SUM} (u64); AddRequest "
                f"{event.request_id[:60]!r} is not booked"
            )
    return ""
