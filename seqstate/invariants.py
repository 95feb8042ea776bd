"""The cross-structure invariants of the write model: what every fold must leave true.

Apart from :class:`~seqstate.state.SequenceState`, which folds, because only tests and
debugging check them: each structure (ranks, the request index, the per-router and per-worker
indexes, leases, departures) must agree with every other that indexes the same requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from seqstate.topology import Rank

if TYPE_CHECKING:
    from seqstate.state import SequenceState


def check_invariants(state: SequenceState) -> None:
    """Assert every cross-structure invariant of ``state``'s write model."""
    owners: dict[str, Rank] = {}
    parked = state.departures.slots
    assert not set(parked) & set(state.workers.slots), "a rank both parked and visible"
    assert {r for _, ranks in state.departures.workers.values() for r in ranks} == set(parked)
    for rank, slot in [*state.workers.slots.items(), *parked.items()]:
        slot.check_invariants()
        for request_id in slot.requests:
            assert request_id not in owners, f"{request_id!r} live on two ranks"
            owners[request_id] = rank
    assert owners == state.requests.owner, "RequestIndex disagrees with ActiveSequences"
    assert set(state.requests.lora) <= set(owners)
    assert set(state.requests.router_of) <= set(owners)
    by_router: dict[str, set[str]] = {}
    for request_id, router_id in state.requests.router_of.items():
        by_router.setdefault(router_id, set()).add(request_id)
    assert by_router == state.requests.by_router, "the per-router index disagrees"
    for request_id in owners:
        assert request_id not in state.tombstones
    for worker in state.workers.ranges.values():
        for dp_rank in worker.ranks():
            assert (worker.worker_id, dp_rank) in state.workers.slots
    assert sorted(state.registry.ranks()) == sorted(state.workers.slots)
    by_worker = {(w, r) for w, ranks in state.workers.by_worker.items() for r in ranks}
    assert by_worker == set(state.workers.slots), "the per-worker index disagrees"
    if state.lease_scan_ns:
        assert set(state.leases.entries) == set(owners), "a live request without a lease"
        oldest = state.leases.oldest_ns()
        if oldest is not None:
            due = (oldest // state.lease_scan_ns + 2) * state.lease_scan_ns
            assert state.lease_due_ns <= due, "a lease scan due later than its oldest lease"
    else:
        assert not state.leases.entries
    for key in state.removed_workers.entries:
        worker_id = int(key)
        assert worker_id not in state.workers.by_worker, f"removed worker {key} has a rank"
        assert worker_id not in state.workers.ranges and worker_id not in state.departures
