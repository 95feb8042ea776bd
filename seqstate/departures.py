"""Departures: workers removed within their grace period, their ranks kept out of sight.

A worker that flaps (removed, then added again a moment later by a discovery blip or a
restarting agent) would otherwise come back empty: its requests are still running, but the
ledger would show it idle and a scheduler would pile work onto it. With a grace period, a
removed worker's busy ranks are parked here instead of dropped: the read model loses them at
once (nothing new should be routed there), the write model keeps following their requests'
Marks and Frees, and a re-add within the grace brings them back with their bookings. When the
grace lapses (at log time, so a replay decides the same), their requests end as a plain
removal would have ended them.

Entries are kept in removal order, which is also deadline order because log time never goes
back and the grace is one constant; so lapsing costs only what lapses.
"""

from __future__ import annotations

from seqstate.sequences import ActiveSequences

Rank = tuple[int, int]
NEVER = 2**64  # later than any log time


class Departures:
    __slots__ = ("due_ns", "grace_ns", "slots", "workers")

    def __init__(self, grace_ns: int) -> None:
        self.grace_ns = grace_ns
        # Every parked rank, of every worker, in deadline order (as a snapshot restores it).
        self.slots: dict[Rank, ActiveSequences] = {}
        # worker_id -> (deadline, its parked ranks in creation order); deadline order.
        self.workers: dict[int, tuple[int, list[Rank]]] = {}
        self.due_ns = NEVER  # when the oldest departure lapses: callers skip lapse() before

    def _due(self) -> None:
        self.due_ns = NEVER
        for until, _ in self.workers.values():
            self.due_ns = until
            break

    def __len__(self) -> int:
        return len(self.workers)

    def __contains__(self, worker_id: int) -> bool:
        return worker_id in self.workers

    def park(self, worker_id: int, slots: dict[Rank, ActiveSequences], now: int) -> None:
        """Keep a removed worker's busy ranks until ``now + grace``. A worker removed again
        while parked (it came back lazily, then went) keeps all its parked ranks, and its
        deadline moves to the later removal."""
        _, ranks = self.workers.pop(worker_id, (0, []))
        for rank in ranks:  # to the end, beside its new ranks: deadline order, as a restore has
            self.slots[rank] = self.slots.pop(rank)
        for rank, slot in slots.items():
            self.slots[rank] = slot
            ranks.append(rank)
        if ranks:
            self.workers[worker_id] = (now + self.grace_ns, ranks)
        self._due()

    def restore(self, worker_id: int, until_ns: int, slots: dict[Rank, ActiveSequences]) -> None:
        """Put back a departure read from a snapshot (in deadline order)."""
        for rank, slot in slots.items():
            self.slots[rank] = slot
        self.workers[worker_id] = (until_ns, list(slots))
        self._due()

    def reclaim(self, worker_id: int) -> dict[Rank, ActiveSequences]:
        """The worker is back within its grace: its parked ranks, no longer parked."""
        _, ranks = self.workers.pop(worker_id, (0, []))
        self._due()
        return {rank: self.slots.pop(rank) for rank in ranks}

    def lapse(self, now: int) -> list[ActiveSequences]:
        """Pop every departure whose grace ended at or before ``now``: their ranks' slots."""
        gone: list[ActiveSequences] = []
        workers = self.workers
        while workers:
            worker_id, (until, ranks) = next(iter(workers.items()))
            if until > now:
                break
            del workers[worker_id]
            gone.extend(self.slots.pop(rank) for rank in ranks)
        self._due()
        return gone
