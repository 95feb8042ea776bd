"""WorkerTable: which worker ranks exist, and the authoritative dp range of each worker.

A rank is a ``(worker_id, dp_rank)`` slot holding its own :class:`ActiveSequences`. Ranks come
from a registered range (``WorkerAdded``) or lazily from the first request naming them.
Slots are kept in creation order, which is the order every sweep visits them, so replays
visit them in the same order too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from msgspec import Struct

from seqstate.errors import SeqstateError
from seqstate.events import U32_MAX
from seqstate.sequences import ActiveSequences

Rank = tuple[int, int]


class WorkerDpRange(Struct, frozen=True, order=True):
    worker_id: int
    dp_start: int = 0
    dp_size: int = 1

    def validate(self) -> None:
        if self.dp_size == 0:
            raise InvalidDpSize(self.worker_id)
        if self.dp_start + self.dp_size > U32_MAX:
            raise InvalidDpRange(self.worker_id, self.dp_start, self.dp_size)

    def ranks(self) -> range:
        return range(self.dp_start, self.dp_start + self.dp_size)


class WorkerTopologyError(SeqstateError):
    """A strict topology call that cannot be honoured (not raised by event application)."""


class InvalidDpSize(WorkerTopologyError):
    def __init__(self, worker_id: int) -> None:
        super().__init__(f"worker {worker_id}: dp_size must be at least 1")
        self.worker_id = worker_id


class InvalidDpRange(WorkerTopologyError):
    def __init__(self, worker_id: int, dp_start: int, dp_size: int) -> None:
        super().__init__(f"worker {worker_id}: dp range {dp_start}+{dp_size} overflows u32")
        self.worker_id, self.dp_start, self.dp_size = worker_id, dp_start, dp_size


class DuplicateWorker(WorkerTopologyError):
    def __init__(self, worker_id: int) -> None:
        super().__init__(f"worker {worker_id} is already registered")
        self.worker_id = worker_id


class WorkerNotFound(WorkerTopologyError):
    def __init__(self, worker_id: int) -> None:
        super().__init__(f"worker {worker_id} is not registered")
        self.worker_id = worker_id


@dataclass
class TopologyChange:
    added: list[Rank] = field(default_factory=list)
    removed: list[Rank] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.removed)


SlotFactory = Callable[[Rank], ActiveSequences]


class WorkerTable:
    """Ranks and their slots; ``ranges`` are the registered (authoritative) workers."""

    __slots__ = ("by_worker", "make_slot", "ranges", "slots")

    def __init__(self, make_slot: SlotFactory) -> None:
        self.make_slot = make_slot
        self.slots: dict[Rank, ActiveSequences] = {}
        self.ranges: dict[int, WorkerDpRange] = {}
        # Each worker's ranks in creation order: removing a worker, or counting its ranks,
        # costs what that worker has, not what the whole table has.
        self.by_worker: dict[int, dict[int, None]] = {}

    @classmethod
    def new(cls, make_slot: SlotFactory, ranges: dict[int, tuple[int, int]]) -> WorkerTable:
        table = cls(make_slot)
        for worker_id, (dp_start, dp_size) in ranges.items():
            table.register_worker(WorkerDpRange(worker_id, dp_start, dp_size))
        return table

    def __len__(self) -> int:
        return len(self.slots)

    def __contains__(self, rank: Rank) -> bool:
        return rank in self.slots

    def __iter__(self) -> Iterator[Rank]:
        return iter(self.slots)

    def get(self, rank: Rank) -> ActiveSequences | None:
        return self.slots.get(rank)

    def worker_ranges(self) -> list[WorkerDpRange]:
        return sorted(self.ranges.values())

    def has_registered_workers(self) -> bool:
        return bool(self.ranges)

    def ensure_worker(self, rank: Rank) -> TopologyChange:
        """Lazily create exactly one rank (no authoritative range); idempotent."""
        if rank in self.slots:
            return TopologyChange()
        self.adopt(rank, self.make_slot(rank))
        return TopologyChange(added=[rank])

    def adopt(self, rank: Rank, slot: ActiveSequences) -> None:
        """Add ``rank`` with ``slot`` (a new one, or one restored from a snapshot)."""
        self.slots[rank] = slot
        self.by_worker.setdefault(rank[0], {})[rank[1]] = None

    def _drop(self, rank: Rank) -> None:
        del self.slots[rank]
        ranks = self.by_worker[rank[0]]
        del ranks[rank[1]]
        if not ranks:
            del self.by_worker[rank[0]]

    def forget_rank(self, rank: Rank) -> None:
        """Drop one rank (an idle lazy one); its requests, if any, are the caller's to end."""
        self._drop(rank)

    def ranks_of(self, worker_id: int) -> int:
        """How many ranks the worker has, registered or lazy."""
        return len(self.by_worker.get(worker_id, ()))

    def register_worker(self, worker: WorkerDpRange) -> TopologyChange:
        worker.validate()
        if worker.worker_id in self.ranges:
            raise DuplicateWorker(worker.worker_id)
        return self.upsert_worker(worker)

    def upsert_worker(self, worker: WorkerDpRange) -> TopologyChange:
        """Set one worker's range: ranks still in range keep their state, others come or go.

        Lazy ranks are untouched, of this worker as of others: only ranks of the previous
        registered range can be dropped.
        """
        worker.validate()
        old = self.ranges.get(worker.worker_id)
        if old == worker:
            return TopologyChange()
        self.ranges[worker.worker_id] = worker
        change = TopologyChange()
        new_ranks = worker.ranks()
        if old is not None:
            for dp_rank in old.ranks():
                rank = (worker.worker_id, dp_rank)
                if dp_rank not in new_ranks and rank in self.slots:
                    self._drop(rank)
                    change.removed.append(rank)
        for dp_rank in new_ranks:
            change.added.extend(self.ensure_worker((worker.worker_id, dp_rank)).added)
        return change

    def unregister_worker(self, worker_id: int) -> TopologyChange:
        """Strict: the worker must be registered. Removes every rank of it, lazy ones too."""
        if worker_id not in self.ranges:
            raise WorkerNotFound(worker_id)
        return self.remove_worker(worker_id)

    def remove_worker(self, worker_id: int) -> TopologyChange:
        """Drop every rank with this worker id, registered or lazy; no error if none."""
        self.ranges.pop(worker_id, None)
        removed = [(worker_id, dp_rank) for dp_rank in self.by_worker.get(worker_id, ())]
        for rank in removed:
            self._drop(rank)
        return TopologyChange(removed=removed)

    def reconcile(self, workers: Iterable[WorkerDpRange]) -> TopologyChange:
        """Replace the whole registered set; lazy ranks absent from it are removed too."""
        wanted: dict[int, WorkerDpRange] = {}
        for worker in workers:
            worker.validate()
            if worker.worker_id in wanted:
                raise DuplicateWorker(worker.worker_id)
            wanted[worker.worker_id] = worker
        keep = {(w.worker_id, r) for w in wanted.values() for r in w.ranks()}
        change = TopologyChange(removed=[rank for rank in self.slots if rank not in keep])
        for rank in change.removed:
            self._drop(rank)
        self.ranges = {}
        for worker in wanted.values():
            self.ranges[worker.worker_id] = worker
            for dp_rank in worker.ranks():
                change.added.extend(self.ensure_worker((worker.worker_id, dp_rank)).added)
        return change
