"""Reference catalogue 9.3 (Dynamo ``topology.rs``), ported onto :class:`WorkerTable`.

Every HEAD test of the section is ported, with the catalogue's names and numbers; the
``WorkerTable`` is exercised directly, with a slot factory standing in for Dynamo's per-rank
``ActiveSequences`` construction.

Skipped: nothing. (The BASE-credit API variants listed under the section,
``register_external_only_adds_missing_workers`` and the older constructor, were replaced by
the HEAD tests ported here.)

Departures from Dynamo: none intended. Errors are Python exceptions carrying the same fields
as Dynamo's ``WorkerTopologyError`` variants; like Dynamo (``dp_start.checked_add(dp_size)``), a
range whose exclusive end is 2**32 overflows.

Added beyond the catalogue: ``test_reconcile_rejects_duplicate_worker_ids`` (section 4.1).
"""

from __future__ import annotations

import pytest

from seqstate.events import U32_MAX
from seqstate.sequences import ActiveSequences
from seqstate.topology import (
    DuplicateWorker,
    InvalidDpRange,
    InvalidDpSize,
    Rank,
    WorkerDpRange,
    WorkerNotFound,
    WorkerTable,
)

pytestmark = pytest.mark.core  # exercises the core: the pure pass runs it too


def make_slot(rank: Rank) -> ActiveSequences:
    return ActiveSequences(0, None)


def make_table(ranges: dict[int, tuple[int, int]] | None = None) -> WorkerTable:
    return WorkerTable.new(make_slot, ranges or {})


def test_new_expands_dp_ranges_into_slots_and_index() -> None:
    table = make_table({7: (2, 3), 9: (0, 1)})

    assert set(table.slots) == {(7, 2), (7, 3), (7, 4), (9, 0)}
    assert len(table) == 4
    for rank in [(7, 2), (7, 3), (7, 4), (9, 0)]:
        assert rank in table
        assert isinstance(table.get(rank), ActiveSequences)
    assert (7, 1) not in table
    assert (7, 5) not in table
    # Each rank is its own slot.
    assert len({id(table.get(rank)) for rank in table}) == 4
    assert table.worker_ranges() == [WorkerDpRange(7, 2, 3), WorkerDpRange(9, 0, 1)]
    assert table.has_registered_workers()


def test_upsert_worker_updates_one_authoritative_range() -> None:
    table = make_table({1: (0, 1)})
    assert table.ensure_worker((2, 0)).added == [(2, 0)]
    lazy_slot = table.get((2, 0))
    kept_slot = table.get((1, 0))

    change = table.upsert_worker(WorkerDpRange(1, 0, 2))

    assert change.added == [(1, 1)]
    assert change.removed == []
    assert len(table) == 3
    assert set(table.slots) == {(1, 0), (1, 1), (2, 0)}
    # The lazy slot of the other worker and the kept rank keep their objects (and state).
    assert table.get((2, 0)) is lazy_slot
    assert table.get((1, 0)) is kept_slot
    assert table.worker_ranges() == [WorkerDpRange(1, 0, 2)]
    # Upserting an identical range is a no-op.
    assert not table.upsert_worker(WorkerDpRange(1, 0, 2))


def test_register_and_unregister_worker_are_strict() -> None:
    table = make_table()
    assert not table.has_registered_workers()

    change = table.register_worker(WorkerDpRange(1, 2, 2))
    assert set(change.added) == {(1, 2), (1, 3)}
    assert change.removed == []

    with pytest.raises(DuplicateWorker) as duplicate:
        table.register_worker(WorkerDpRange(1, 2, 2))
    assert duplicate.value.worker_id == 1
    assert set(table.slots) == {(1, 2), (1, 3)}

    change = table.unregister_worker(1)
    assert len(change.removed) == 2
    assert set(change.removed) == {(1, 2), (1, 3)}
    assert change.added == []
    assert not table.has_registered_workers()
    assert len(table) == 0

    with pytest.raises(WorkerNotFound) as missing:
        table.unregister_worker(1)
    assert missing.value.worker_id == 1


def test_invalid_ranges_are_rejected() -> None:
    table = make_table()

    with pytest.raises(InvalidDpSize) as size:
        table.register_worker(WorkerDpRange(1, 0, 0))
    assert size.value.worker_id == 1
    # A range whose exclusive end still fits in u32 is accepted.
    assert table.register_worker(WorkerDpRange(2, U32_MAX - 1, 1)).added == [(2, U32_MAX - 1)]

    with pytest.raises(InvalidDpRange) as overflow:
        table.register_worker(WorkerDpRange(1, U32_MAX, 1))
    assert (overflow.value.worker_id, overflow.value.dp_start, overflow.value.dp_size) == (
        1,
        U32_MAX,
        1,
    )
    # Rejected ranges leave nothing behind.
    assert set(table.slots) == {(2, U32_MAX - 1)}
    assert table.worker_ranges() == [WorkerDpRange(2, U32_MAX - 1, 1)]


def test_ensure_worker_is_idempotent() -> None:
    table = make_table({1: (0, 1)})

    first = table.ensure_worker((2, 0))
    slot = table.get((2, 0))
    second = table.ensure_worker((2, 0))

    assert first.added == [(2, 0)]
    assert first.removed == []
    assert second.added == []
    assert second.removed == []
    assert not second
    assert len(table) == 2
    assert table.get((2, 0)) is slot
    # A lazy rank adds no authoritative range.
    assert table.worker_ranges() == [WorkerDpRange(1, 0, 1)]


def test_full_reconcile_removes_unregistered_lazy_workers() -> None:
    table = make_table({1: (0, 1)})
    table.ensure_worker((2, 0))

    change = table.reconcile([WorkerDpRange(1, 0, 1)])

    assert change.removed == [(2, 0)]
    assert change.added == []
    assert (2, 0) not in table
    assert table.get((2, 0)) is None
    assert set(table.slots) == {(1, 0)}
    assert table.worker_ranges() == [WorkerDpRange(1, 0, 1)]


def test_reconcile_preserves_existing_worker_state_and_reports_delta() -> None:
    table = make_table({1: (0, 1), 2: (0, 1)})
    slot = table.get((1, 0))
    assert slot is not None
    booked = slot.add("req-1", [1, 2, 3], 12, None, None, False, 0)
    assert (booked.slot, booked.hashes) == (0, [1, 2, 3])

    change = table.reconcile([WorkerDpRange(1, 0, 1), WorkerDpRange(3, 0, 1)])

    assert change.added == [(3, 0)]
    assert change.removed == [(2, 0)]
    assert table.get((1, 0)) is slot
    assert slot.blocks.active_blocks == 3
    assert "req-1" in slot.requests
    assert slot.active_tokens(0) == 12
    new_slot = table.get((3, 0))
    assert new_slot is not None
    assert new_slot.blocks.active_blocks == 0
    assert len(new_slot) == 0
    assert table.worker_ranges() == [WorkerDpRange(1, 0, 1), WorkerDpRange(3, 0, 1)]


def test_reconcile_rejects_duplicate_worker_ids() -> None:
    """Section 4.1: duplicate ids in the reconcile input raise DuplicateWorker."""
    table = make_table({1: (0, 1)})

    with pytest.raises(DuplicateWorker) as duplicate:
        table.reconcile([WorkerDpRange(2, 0, 1), WorkerDpRange(2, 1, 1)])

    assert duplicate.value.worker_id == 2
    assert set(table.slots) == {(1, 0)}
