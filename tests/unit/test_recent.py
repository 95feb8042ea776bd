"""RecentIds: the bounded, time-limited memory of ended ids and tombstones, packed compactly."""

from __future__ import annotations

import pytest

from seqstate.recent import STALE_SLACK, RecentIds

pytestmark = pytest.mark.core

S = 1_000_000_000


def test_values_and_times_come_back_exact_and_in_write_order() -> None:
    ids = RecentIds(retention_ns=60 * S, capacity=10)
    ids.put("a", 2, 5 * S)
    ids.put("b", 0, 2**62)  # a log time far in the future still packs exactly
    ids.put("a", 1, 7 * S)  # a rewrite moves the id to the end
    assert list(ids.items()) == [("b", 0, 2**62), ("a", 1, 7 * S)]
    assert (ids.get("a"), ids.get("b"), ids.get("c")) == (1, 0, None)
    assert ids.pop("a") == 1 and "a" not in ids and ids.pop("a") is None


def test_the_oldest_go_first_by_count_and_by_age() -> None:
    ids = RecentIds(retention_ns=10 * S, capacity=3)
    for n, rid in enumerate("abcd"):
        ids.put(rid, 0, n * S)
    assert [rid for rid, _, _ in ids.items()] == ["b", "c", "d"] and ids.evicted == 1
    assert ids.due_ns == 11 * S  # b, written at 1 s, leaves at 11 s
    ids.prune(12 * S + 1)
    assert [rid for rid, _, _ in ids.items()] == ["d"]


def test_a_rewritten_id_is_forgotten_by_its_last_write() -> None:
    ids = RecentIds(retention_ns=10 * S, capacity=100)
    ids.put("a", 0, 1 * S)
    ids.put("a", 2, 5 * S)
    ids.prune(11 * S + 1)  # past the first write's retention, not the second's
    assert ids.get("a") == 2
    ids.prune(15 * S + 1)
    assert "a" not in ids


def test_stale_queue_entries_stay_bounded() -> None:
    ids = RecentIds(retention_ns=10**6 * S, capacity=5)
    for n in range(10 * STALE_SLACK):
        ids.put("x", 0, n)
        ids.pop("x")
    assert len(ids._queue) <= 2 * len(ids) + STALE_SLACK + 1


def test_a_snapshot_round_trip_keeps_order_values_and_times() -> None:
    ids = RecentIds(retention_ns=60 * S, capacity=10)
    for n, rid in enumerate("abc"):
        ids.put(rid, n, n * S)
    again = RecentIds(retention_ns=60 * S, capacity=10)
    again.load(list(ids.items()))
    assert list(again.items()) == list(ids.items()) and again.due_ns == ids.due_ns
    again.put("d", 0, 3 * S)
    ids.put("d", 0, 3 * S)
    assert list(again.items()) == list(ids.items())


def test_take_before_returns_the_ids_written_before_a_time_oldest_first() -> None:
    """A lease scan's expiries: ids moved by a later write, or taken out, are not returned
    for their old place."""
    ids = RecentIds(retention_ns=2**64, capacity=2**64)
    for n, rid in enumerate("abcde"):
        ids.put(rid, 0, n * S)
    ids.put("b", 0, 10 * S)  # moved behind e
    ids.pop("c")
    assert ids.oldest_ns() == 0 and ids.written_ns("b") == 10 * S
    assert ids.take_before(4 * S) == ["a", "d"]
    assert ids.take_before(4 * S) == []
    assert ids.oldest_ns() == 4 * S and ids.written_ns("a") is None
    assert ids.take_before(11 * S) == ["e", "b"]
    assert len(ids) == 0 and ids.oldest_ns() is None
