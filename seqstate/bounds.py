"""How many ranks the write model may hold: admission, before an event is applied.

Each rank costs a slot, two bucket keys and a row in every read. A ``WorkerAdded`` with
``dp_size`` 4096 is a valid event, and 25 of them made 102,408 ranks (250 MB in the writer,
204k keys). So the writer refuses, and dead-letters with the reason, an event that would take a
worker or the whole table past its bound. The check is a pure function of the state and the
event, and costs what the event names (its dp range), not the size of the table; every fold
of the log (the writer, a replay) asks it before ``apply``, so they stay equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from seqstate.events import AddRequest, Event, RouterHeartbeat, WorkerAdded
from seqstate.state import SequenceState

MAX_RANKS_PER_WORKER: Final = 1024
MAX_RANKS: Final = 16_384
# Live routers the write model tracks: each heartbeat of a new router id adds one until it
# lapses, so a flood of invented ids must not grow the state without bound.
MAX_ROUTERS: Final = 100_000


@dataclass(frozen=True)
class RankBounds:
    per_worker: int = MAX_RANKS_PER_WORKER
    total: int = MAX_RANKS
    routers: int = MAX_ROUTERS

    def refusal(self, state: SequenceState, event: Event) -> str:
        """Why ``event`` may not be applied ("" if it may)."""
        workers = state.workers
        if isinstance(event, RouterHeartbeat):
            if event.router_id in state.routers or len(state.routers) < self.routers:
                return ""
            return (
                f"{len(state.routers)} live routers already, the bound (max_routers); "
                f"router {event.router_id!r} is not tracked"
            )
        if isinstance(event, AddRequest):
            rank = (event.worker_id, event.dp_rank)
            if rank in workers.slots or not state.lazy_workers:
                return ""  # an existing rank, or none is created (unknown_worker)
            return self._over(
                event.worker_id, workers.ranks_of(event.worker_id) + 1, len(workers.slots) + 1
            )
        if isinstance(event, WorkerAdded):
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
